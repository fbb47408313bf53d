"""Record this platform's numbers in tests/regression/fixtures.json (see runs.py for when).

    python -m tests.regression.record                 # add this platform's record, or configurations
                                                      # added to CONFIGS (refused if a recorded one moved)
    python -m tests.regression.record --drop-others   # a change meant to move the numbers
"""

import argparse
import json
import os
import sys

from tests.regression.runs import CONFIGS, COMMON, FIXTURES, LAYOUTS, run_layout
from tools.benchmarks.run_cache import platform_signature


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--drop-others", action="store_true",
                   help="keep only this platform's record (the others are stale after a change meant to move them)")
    args = p.parse_args()
    platforms = {}
    signature = platform_signature()
    if os.path.exists(FIXTURES) and not args.drop_others:
        with open(FIXTURES) as f:
            old = json.load(f)
        old_configs = old.get("configs", {})
        added = (old.get("common_args"), old.get("layouts")) == (COMMON, LAYOUTS) and \
            all(CONFIGS.get(name) == flags for name, flags in old_configs.items())
        if added:  # the same runs, perhaps more of them: the records stand
            platforms = old.get("platforms", {})
        else:
            print("the runs changed since the other platforms were recorded: dropping their records", file=sys.stderr)
    now = {layout: run_layout(layout) for layout in LAYOUTS}
    mine = platforms.get(signature, {})
    moved = [f"{layout}/{name}" for layout, runs in mine.items() for name, rec in runs.items()
             if (now[layout][name]["losses"], now[layout][name]["param_sha256"]) != (rec["losses"], rec["param_sha256"])]
    if moved:
        sys.exit(f"error: {', '.join(moved)} moved against this platform's record: to re-record on purpose, "
                 f"say why in the commit and pass --drop-others")
    platforms[signature] = now
    fixtures = {"common_args": COMMON, "layouts": LAYOUTS, "configs": CONFIGS, "platforms": platforms}
    with open(FIXTURES, "w") as f:
        json.dump(fixtures, f, indent=1)
        f.write("\n")
    print(f"wrote {FIXTURES}: {signature} ({len(platforms)} platform(s) recorded)", file=sys.stderr)


if __name__ == "__main__":
    main()
