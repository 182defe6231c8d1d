"""`python -m analysis.figures SWEEP_DIR`: the paper's figures from a sweep (analysis.figures.paper)."""

import sys

from analysis.figures.paper import main

sys.exit(main())
