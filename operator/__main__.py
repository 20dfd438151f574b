"""``python -m graphserving.operator run ...``: the operator process (see main.py)."""

import sys

from .main import main

sys.exit(main())
