"""Training entry for ``accelerate launch`` / ``torchrun``: parses and calls the library.

    accelerate launch --num_processes 2 --cpu train/gates.py --config configs/train/default.yaml
    python train/gates.py --config configs/train/default.yaml steps=50

Same arguments as ``learnroute train``.
"""

import sys

from learnroute.commands import train

if __name__ == "__main__":
    raise SystemExit(train(sys.argv[1:]))
