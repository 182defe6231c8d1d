"""The paper's figures (`python -m analysis.figures SWEEP_DIR`): `paper` draws figures 1-5 and the
panels from a sweep's logs; `steps`, `panels` and `corrections_panel` hold the figures themselves."""
