"""One module per study, named as its experiment file (conf/experiment/<name>.yaml), its
pre-registration (docs/studies/<name>.md) and its report (docs/reports/<name>.md). Studies never
import each other (tests/test_analysis_layout.py)."""
