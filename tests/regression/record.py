"""Write tests/regression/fixtures.json from the current code (see runs.py for when)."""

import json
import sys

from tests.regression.runs import CONFIGS, COMMON, FIXTURES, LAYOUTS, run_layout


def main() -> None:
    fixtures = {"common_args": COMMON, "layouts": LAYOUTS, "configs": CONFIGS,
                "runs": {layout: run_layout(layout) for layout in LAYOUTS}}
    with open(FIXTURES, "w") as f:
        json.dump(fixtures, f, indent=1)
        f.write("\n")
    print(f"wrote {FIXTURES}", file=sys.stderr)


if __name__ == "__main__":
    main()
