"""Study entry: parses and calls the library, as ``learnroute study`` does.

    python eval/study.py --config configs/study/default.yaml
    python eval/study.py --config experiments/study/full.yaml placements=100
"""

import sys

from learnroute.commands import study

if __name__ == "__main__":
    raise SystemExit(study(sys.argv[1:]))
