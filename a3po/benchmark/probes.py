"""The variants timed, in the order they run in each round: rollout, the proximal log-probs
(recompute and every approximation), one training step per algo, then the kernels (AdamW,
the vocabulary log-prob reduction, a memory copy, `approximate_prox_logp` on flat tensors)."""

from __future__ import annotations

from typing import Any

import torch

from a3po.benchmark.harness import TrafficCounter, Variant, repeated, timed
from a3po.benchmark.workload import Workload, group_configs
from a3po.device import autocast_dtype
from a3po.maths.loss import token_logprobs, token_logprobs_and_entropy
from a3po.maths.proximal import approximate_prox_logp
from a3po.learner.trainer import Trainer, all_finite

KernelInputs = dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
FLOOR_METHODS = ("loglinear", "linear")


def rollout_variant(w: Workload) -> Variant:
    """`HFEngine.generate` on the batch's prompts, `response_len` new tokens, from the start weights."""
    from a3po.rollout.hf import HFEngine

    rollout_cfg, batch = w.cfg.rollout, w.batch
    engine = HFEngine(w.policy, w.tokenizer, temperature=rollout_cfg.temperature, top_p=rollout_cfg.get("top_p", 1.0),
                      max_new_tokens=w.options.response_len, batch_size=rollout_cfg.get("batch_size"),
                      version=w.version, precision=w.precision)
    prompts = [w.samples[g * batch.n_samples].prompt_ids.tolist() for g in range(batch.n_prompts)]

    def rollout() -> dict[str, float]:
        timing = timed(lambda: engine.generate(prompts, batch.n_samples, seed=w.cfg.seed), w.device)
        generated = sum(g.response_ids.numel() for group in timing.out for g in group)
        return timing.as_dict(tokens=float(generated), tokens_per_s=generated / timing.seconds)

    return Variant("rollout", "rollout", rollout, before=w.start.restore)


def approximate_step(micro_inputs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], version: int, *,
                     method: str, schedule: str, schedule_params: dict[str, float]) -> None:
    """What one training step spends on an approximation: `approximate_prox_logp` per
    micro-batch with the finite check kept on the device (an `all_finite` flag each), the
    flags read once at the end (the trainer reads them once per minibatch)."""
    flags = []
    for behave, logp, versions in micro_inputs:
        prox = approximate_prox_logp(behave, logp.detach(), versions, version, method=method, schedule=schedule,
                                     check_finite=False, **schedule_params)
        flags.append(all_finite(prox))
    if flags and not bool(torch.stack(flags).all()):
        raise ValueError("approximate_prox_logp result has non-finite value(s) (NaN or Inf); all values must be finite")


def prox_variants(w: Workload) -> list[Variant]:
    """`prox/recompute`: the trainer's no-grad forward over the step's micro-batches;
    `prox/<method>-<schedule>`: the approximation over the same micro-batches, from the inputs
    the trainer holds there (behaviour log-probs, current log-probs, versions, on the device)."""
    samples, plans, device = w.samples, w.plans, w.device
    variants = [Variant("prox/recompute", "prox",
                        lambda: timed(lambda: w.reference.recompute_prox_logp(samples, plans), device).as_dict())]
    recomputed = w.reference.recompute_prox_logp(samples, plans)
    micro_inputs = [(torch.cat([samples[i].behave_logp for i in micro]).to(device),
                     torch.cat([recomputed[i] for i in micro]).to(device),
                     torch.cat([samples[i].versions for i in micro]).to(device))
                    for plan in plans for micro in plan]
    for method in w.options.approx_methods:
        for schedule in w.options.approx_schedules:
            _, schedule_cfg = group_configs(method, schedule)
            params = {k: float(v) for k, v in schedule_cfg.items() if k != "name"}

            def call(method: str = method, schedule: str = schedule, params: dict = params) -> None:
                approximate_step(micro_inputs, w.version, method=method, schedule=schedule, schedule_params=params)

            variants.append(Variant(f"prox/{method}-{schedule}", "prox", repeated(call, device)))
    return variants


def step_variants(w: Workload) -> list[Variant]:
    """The whole `Trainer.step` per algo, from the start state, with its phases from the timer."""
    variants = []
    for label, trainer in w.trainers.items():
        def step(trainer: Trainer = trainer) -> dict[str, float]:
            w.timer.pop()
            generator = torch.Generator().manual_seed(w.plan_seed)
            timing = timed(lambda: trainer.step(w.batch, version=w.version, generator=generator), w.device)
            phases = w.timer.pop()
            return timing.as_dict(prox_logp=phases.get("time/prox_logp", 0.0), train=phases.get("time/train", 0.0),
                                  loss=timing.out["actor/loss"])

        variants.append(Variant(f"step/{label}", "step", step, before=w.start.restore))
    return variants


def optimizer_variants(policy: torch.nn.Module, device: torch.device, train_cfg) -> list[Variant]:
    """One AdamW step over the live parameters with fixed random gradients, default vs fused.

    The steps move the live weights; every `step` and `rollout` repetition restores them first,
    and `prox/recompute`'s timing does not depend on their values.
    """
    params = [p for p in policy.parameters() if p.requires_grad]
    generator = torch.Generator(device=device).manual_seed(7)
    grads = [torch.randn(p.shape, device=device, dtype=p.dtype, generator=generator) * 1e-3 for p in params]
    kwargs = dict(lr=train_cfg.lr, betas=tuple(train_cfg.adam_betas), eps=train_cfg.adam_eps,
                  weight_decay=train_cfg.weight_decay)
    implementations = {"default": torch.optim.AdamW(params, **kwargs)}
    try:
        implementations["fused"] = torch.optim.AdamW(params, fused=True, **kwargs)
    except (RuntimeError, ValueError):
        pass
    n_params = sum(p.numel() for p in params)

    def set_grads() -> None:
        for param, grad in zip(params, grads):
            param.grad = grad

    return [Variant(f"kernel/adamw_{name}@{n_params}", "kernel",
                    lambda optimizer=optimizer: timed(optimizer.step, device).as_dict(),
                    before=set_grads, info={"params": n_params})
            for name, optimizer in implementations.items()]


def logits_dtype(policy: torch.nn.Module, precision: str) -> torch.dtype:
    """What the trainer's lm_head returns: bf16 under its autocast of a float32 model
    (precision=bf16), the weights' dtype otherwise."""
    return autocast_dtype(torch.device("cpu"), policy, precision) or next(policy.parameters()).dtype


def matmul_peak_variant(w: Workload) -> Variant:
    """The device's achievable matmul rate in the run's compute dtype: a GEMM of the model's
    own MLP shape (tokens x hidden @ hidden x intermediate) at a few thousand rows. The MFU
    figures divide by this measured peak, beside the nominal one where it is known."""
    config = w.policy.config
    rows, hidden, inner = 2048, int(config.hidden_size), int(config.intermediate_size)
    dtype = logits_dtype(w.policy, w.precision)
    generator = torch.Generator(device=w.device).manual_seed(w.cfg.seed + 37)
    a = torch.randn(rows, hidden, device=w.device, generator=generator).to(dtype)
    b = torch.randn(hidden, inner, device=w.device, generator=generator).to(dtype)
    flops = 2 * rows * hidden * inner
    return Variant(f"kernel/matmul_{str(dtype).removeprefix('torch.')}", "kernel", repeated(lambda: a @ b, w.device),
                   info={"flops": flops, "shape": [rows, hidden, inner], "dtype": str(dtype).removeprefix("torch.")})


def logprob_variants(w: Workload) -> list[Variant]:
    """The log-prob reduction over the vocabulary at the response positions of the largest
    micro-batch (the unit the trainer runs it on), forward and backward, with and without the
    entropy: what the entropy costs on top."""
    samples, device, vocab = w.samples, w.device, w.policy.config.vocab_size
    tokens = max(sum(samples[i].response_ids.numel() for i in micro) for plan in w.plans for micro in plan)
    logits = torch.randn(tokens, vocab, device=device, generator=torch.Generator(device=device).manual_seed(
        w.cfg.seed + 31)).to(logits_dtype(w.policy, w.precision))
    targets = torch.randint(0, vocab, (tokens,), device=device)

    def logprob_pass(with_entropy: bool) -> None:
        leaf = logits.detach().requires_grad_(True)
        logp = token_logprobs_and_entropy(leaf, targets)[0] if with_entropy else token_logprobs(leaf, targets)
        logp.sum().backward()

    info = {"tokens": tokens, "vocab": vocab}
    return [Variant(f"kernel/logprobs@{tokens}", "kernel", repeated(lambda: logprob_pass(False), device), info=info),
            Variant(f"kernel/logprobs+entropy@{tokens}", "kernel", repeated(lambda: logprob_pass(True), device),
                    info=dict(info))]


def copy_variant(device: torch.device, mib: int) -> Variant:
    """A large copy: bytes read + written per second is the streaming bandwidth the
    approximation's floor is divided by."""
    n = mib * 2**20 // 4
    source = torch.rand(n, device=device)
    target = torch.empty_like(source)
    return Variant("kernel/copy", "kernel", repeated(lambda: target.copy_(source), device), info={"bytes": 2 * n * 4})


def kernel_inputs(w: Workload) -> KernelInputs:
    """Flat tensors for the bandwidth floor: the batch's own size and the paper-scale sizes."""
    generator = torch.Generator().manual_seed(w.cfg.seed + 29)
    response_tokens = sum(s.response_ids.numel() for s in w.samples)
    inputs: KernelInputs = {}
    for n in sorted({response_tokens, *w.options.kernel_tokens}):
        behave = -torch.rand(n, generator=generator).to(w.device) * 5
        target = behave + torch.randn(n, generator=generator).to(w.device) * 0.1
        versions = torch.full((n,), w.version - w.staleness, dtype=torch.long, device=w.device)
        inputs[n] = (behave, target, versions)
    return inputs


def approximation_kernel_variants(inputs: KernelInputs, version: int, device: torch.device) -> list[Variant]:
    """`approximate_prox_logp` with and without its finite check, and the trainer's deferred
    check (a device-side flag per micro-batch, read once per minibatch), per size."""
    variants = []
    for n, flat in inputs.items():
        for method in FLOOR_METHODS:
            for check in (True, False):
                def call(method: str = method, check: bool = check, flat=flat) -> None:
                    approximate_prox_logp(*flat, version, method=method, check_finite=check)

                variants.append(Variant(f"kernel/{method}-inverse@{n}" + ("" if check else "/no_check"), "kernel",
                                        repeated(call, device), info={"tokens": n, "method": method,
                                                                      "check_finite": check}))
        variants.append(Variant(f"kernel/finite_flag@{n}", "kernel",
                                repeated(lambda flat=flat: all_finite(flat[0]), device), info={"tokens": n}))
    return variants


def approximation_traffic(inputs: KernelInputs, version: int) -> dict[str, dict[str, Any]]:
    """Per `<method>@<tokens>`: the bytes a fused kernel would move (each input read once, the
    output written once) and what the eager implementation moves, in how many aten ops."""
    out = {}
    for n, (behave, target, versions) in inputs.items():
        for method in FLOOR_METHODS:
            minimal = (behave.numel() * behave.element_size() + target.numel() * target.element_size()
                       + versions.numel() * versions.element_size() + behave.numel() * 4)
            with TrafficCounter() as traffic:
                approximate_prox_logp(behave, target, versions, version, method=method, check_finite=True)
            out[f"{method}@{n}"] = {"tokens": n, "bytes_minimal": minimal, "bytes_eager": traffic.bytes,
                                    "aten_ops": traffic.ops, "largest_tensor_elements": traffic.largest}
    return out


def all_variants(w: Workload) -> tuple[list[Variant], KernelInputs]:
    """Every variant in round order, and the flat inputs of the approximation kernels."""
    variants = [rollout_variant(w)] if w.options.rollout else []
    variants += prox_variants(w)
    variants += step_variants(w)
    if w.options.optimizer_kernels:
        variants += optimizer_variants(w.policy, w.device, w.cfg.train)
    variants += logprob_variants(w)
    variants.append(matmul_peak_variant(w))
    variants.append(copy_variant(w.device, w.options.bandwidth_mib))
    inputs = kernel_inputs(w)
    variants += approximation_kernel_variants(inputs, w.version, w.device)
    return variants, inputs
