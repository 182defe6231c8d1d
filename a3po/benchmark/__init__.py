"""What the proximal policy costs: recompute's forward pass against A-3PO's approximation,
and the whole training step per algo, measured on one synthetic batch in one process.

The variants (`probes`) call the library's own code: `Trainer.recompute_prox_logp`,
`Trainer.approximate_prox` with its finite flags and check, `Trainer.step`, the engine
`a3po.rollout.build_engine` gives, `make_optimizer`, `approximate_prox_logp` on flat tensors.
Timing is `torch.utils.benchmark.Timer` (`harness`), in rounds that run every variant once,
each starting one variant later, after a warm-up: on a shared machine load drifts over
minutes, and measuring variants in blocks would charge that drift to whichever ran last.
Every step and rollout repetition starts from the same weights (restored outside the timed
region), so the repetitions repeat one computation rather than a drifting one.

The batch is synthetic on purpose: random token ids, behaviour log-probs from the policy's
own forward, per-token versions giving a chosen staleness. A step's time depends on shapes,
not on what the tokens say, and no task is needed.

A run writes benchmark.json and benchmark.md under `--out` (default under the git-ignored
outputs/); it appends a section to docs/benchmarks.md only with `--append-docs`.

Modules: `workload` (options, config, trainers, synthetic batch, start state), `harness`
(timing, rounds, summaries, traffic counter, machine), `probes` (the variants), `derive`
(ratios, throughput, bandwidth floor), `report` (markdown, files), `cli` (the command line
and one run). A benchmark measures; nothing here asserts a timing.
"""

from a3po.benchmark.cli import build_parser, main, run_benchmark
from a3po.benchmark.workload import DEFAULT_ALGOS, BenchmarkOptions

__all__ = ["DEFAULT_ALGOS", "BenchmarkOptions", "build_parser", "main", "run_benchmark"]
