"""The GPU smoke test (`make gpu-smoke`, `python experiments/gpu_smoke.py`): what a user runs
first on a new cluster. Each item (a short training run, a parity probe, a benchmark) runs in
a subprocess with a timeout and checks its own result; the report is JSON plus a markdown
table with the machine.

- `runner`: an item, how one runs (subprocess, timeout, skip protocol) and the report.
- `items`: the items, the command each runs and how each checks its result.
- `probes`: what runs in an item's subprocess when it is not a training command (the machine,
  whether vLLM / SmolLM2 / GSM8K are there, behave_logp against the trainer's forward).
- `cli`: the command line.

The one-call check for a borrowed GPU (`make gpu-check`, `python experiments/gpu_check.py`)
reuses the runner: `gpu_check` (its command line and summary.json), `gpu_check_items` (its
items, budgets and the wheels it names), `gpu_check_probes` and `gpu_check_step` (what its
items' subprocesses run).

Nothing is imported here: `python -m a3po.smoke.probes` stays light.
"""
