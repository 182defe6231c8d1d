"""What A-3PO saves at a given scale (`python -m analysis.cost_model`, docs/cost_model.md): each
phase of an RL step from the model's shapes, the step's token counts and the device's peaks
(phases), the lagged and asynchronous pipelines (pipeline), the device table (devices), the fit
to this suite's benchmarks (validate) and the paper's setting with the reported speedups (setting)."""
