"""Record this platform's numbers in tests/regression/fixtures.json (see runs.py for when).

    python -m tests.regression.record                 # add or replace this platform's record
    python -m tests.regression.record --drop-others   # a change meant to move the numbers
"""

import argparse
import json
import os
import sys

from tests.regression.runs import CONFIGS, COMMON, FIXTURES, LAYOUTS, platform_signature, run_layout


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--drop-others", action="store_true",
                   help="keep only this platform's record (the others are stale after a change meant to move them)")
    args = p.parse_args()
    platforms = {}
    if os.path.exists(FIXTURES) and not args.drop_others:
        with open(FIXTURES) as f:
            old = json.load(f)
        if (old.get("common_args"), old.get("layouts"), old.get("configs")) == (COMMON, LAYOUTS, CONFIGS):
            platforms = old.get("platforms", {})
        else:
            print("the runs changed since the other platforms were recorded: dropping their records", file=sys.stderr)
    signature = platform_signature()
    platforms[signature] = {layout: run_layout(layout) for layout in LAYOUTS}
    fixtures = {"common_args": COMMON, "layouts": LAYOUTS, "configs": CONFIGS, "platforms": platforms}
    with open(FIXTURES, "w") as f:
        json.dump(fixtures, f, indent=1)
        f.write("\n")
    print(f"wrote {FIXTURES}: {signature} ({len(platforms)} platform(s) recorded)", file=sys.stderr)


if __name__ == "__main__":
    main()
