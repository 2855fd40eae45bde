"""Entry point: `python -m moemesh.tools.train --out models/kjv-dsv4-mini` (see tools/train/run.py)."""

import sys

from moemesh.tools.train.run import main

sys.exit(main())
