"""Entry point: `python -m tools.train --out models/kjv-dsv4-mini` (see tools/train/run.py)."""

import sys

from tools.train.run import main

sys.exit(main())
