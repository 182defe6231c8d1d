"""`python -m a3po.benchmark ...`: the same command line as experiments/benchmark.py."""

from a3po.benchmark.cli import main

main()
