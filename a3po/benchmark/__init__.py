"""What the proximal policy costs: recompute's forward pass against A-3PO's approximation.

The paper's headline is a cost (about 10 s of recompute forward per step against about
0.0012 s of loglinear approximation, and 18-27% less training time), so this package measures,
on one synthetic batch and in one process:

- `prox/recompute`: the no-grad forward the trainer runs (`Trainer.recompute_prox_logp`);
- `prox/<method>-<schedule>`: `approximate_prox_logp` over the same micro-batches as the trainer
  calls it (finite check kept on the device, the flags read once), i.e. what one training
  step spends on it;
- `step/<algo>`: the whole `Trainer.step` per algo;
- `rollout`: `HFEngine.generate` on the batch's prompts;
- `kernel/...`: `approximate_prox_logp` on flat tensors of N tokens, with and without its
  finite check, and the trainer's device-side finite flag; a large tensor copy whose GB/s
  gives the memory-bandwidth floor; AdamW's step, default against fused; the log-prob
  reduction over the vocabulary with and without the entropy.

Variants are interleaved (every repetition runs each once, starting one later each time)
after a warm-up: on a shared machine the load drifts over minutes, and measuring variants in
blocks would charge that drift to whichever ran last. Every `step` and `rollout` repetition
starts from the same weights and optimizer state (restored outside the timed region), so the
repetitions repeat one computation rather than a drifting one.

The batch is synthetic on purpose: random prompt/response token ids, behaviour log-probs
from the policy's own forward, and per-token versions giving a chosen staleness. The timing
of a step depends on shapes, not on what the tokens say, and no task is needed.

A run writes benchmark.json and benchmark.md under `--out` (default under the git-ignored
outputs/); it appends a section to docs/benchmarks.md only with `--append-docs`. To measure a
trainer change against older code, run the same command in a git worktree of the older commit
and compare the two reports.

Modules: `workload` (options, config, trainers, synthetic batch, restorable state), `harness`
(timing, interleaving, summaries, traffic counter, machine info), `probes` (the variants),
`derive` (ratios, throughput, bandwidth floor), `report` (markdown, files), `run` (one run),
`cli` (the command line). A benchmark measures; nothing here asserts a timing.
"""

from a3po.benchmark.cli import build_parser, main
from a3po.benchmark.run import run_benchmark
from a3po.benchmark.workload import DEFAULT_ALGOS, BenchmarkOptions

__all__ = ["DEFAULT_ALGOS", "BenchmarkOptions", "build_parser", "main", "run_benchmark"]
