"""What a run needs in memory, estimated before anything heavy loads (pure; docs/memory.md): `parts`
(the blocks and measured constants), `train` and `rollout` (each side's parts; an engine's are named by
its spec, a3po.rollout.engines), `estimate` (their sum, the peak), `machine` (what the machine can
still give). The check that holds the estimate against the machine at start is a3po.run.memory_check."""
