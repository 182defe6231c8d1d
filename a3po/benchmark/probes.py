"""The variants, in the order each round runs them: rollout, the proximal log-probs
(recompute and every approximation), one training step per algo, then the kernels (AdamW,
the vocabulary log-prob reduction, a matmul, a memory copy, `approximate_prox_logp` on flat
tensors). Each calls the library's own code: the engine `build_engine` gives, the trainer,
`make_optimizer`, `all_finite`, the trainer's autocast dtype."""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any

import torch

from a3po.benchmark.harness import TrafficCounter, Variant
from a3po.benchmark.workload import Workload
from a3po.device import autocast, bf16_gemm_in_float32
from a3po.learner.trainer import Trainer
from a3po.learner.update import all_finite, check_update, make_optimizer
from a3po.maths.logprobs import token_logprobs, token_logprobs_and_entropy
from a3po.maths.proximal import approximate_prox_logp, approximations
from a3po.rollout import build_engine

Flat = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # behave log-probs, current log-probs, versions


def rollout_variant(w: Workload) -> Variant:
    """The configured engine (`rollout.name`) generating `response_len` new tokens for the
    batch's prompts from the start weights."""
    rollout_cfg = dataclasses.replace(w.cfg.rollout, max_new_tokens=w.options.response_len)
    engine = build_engine(rollout_cfg, w.policy, w.tokenizer, w.device, precision=w.precision)
    prompts = [w.samples[g * w.batch.n_samples].prompt_ids.tolist() for g in range(w.batch.n_prompts)]
    last: dict[str, Any] = {}

    def rollout() -> None:
        last["groups"] = engine.generate(prompts, w.batch.n_samples, seed=w.cfg.seed)

    def generated() -> dict[str, float]:
        return {"tokens": float(sum(s.response_ids.numel() for group in last["groups"] for s in group))}

    return Variant("rollout", "rollout", rollout, before=w.start.restore, after=generated)


def approximate_step(trainer: Trainer, minibatches: list[list[Flat]], version: int) -> None:
    """What one `Trainer.step` spends on its approximation: `Trainer.approximate_prox` and an
    `all_finite` flag per micro-batch, then `check_update`'s one host read per
    minibatch (a non-finite result raises there; the loss and gradient norm it also checks
    are given as finite zeros, as they are not the approximation's)."""
    zero = minibatches[0][0][0].new_zeros(())
    for index, micro_batches in enumerate(minibatches):
        flags = [all_finite(trainer.approximate_prox(behave, logp, versions, version))
                 for behave, logp, versions in micro_batches]
        check_update(flags, zero, zero, version, index, len(minibatches), trainer.dist)


def micro_batch_inputs(w: Workload, recomputed: dict[int, torch.Tensor], micro: list[int]) -> Flat:
    """A micro-batch's behaviour log-probs, current log-probs and versions, concatenated
    sample by sample on the device: what the trainer holds when it approximates."""
    return (torch.cat([w.samples[i].behave_logp for i in micro]).to(w.device),
            torch.cat([recomputed[i] for i in micro]).to(w.device),
            torch.cat([w.samples[i].versions for i in micro]).to(w.device))


def prox_variants(w: Workload) -> list[Variant]:
    """`prox/recompute`: the trainer's no-grad forward over the step's micro-batches;
    `prox/<method>-<schedule>`: the approximation over the same micro-batches."""
    recomputed = w.reference.recompute_prox_logp(w.samples, w.plans)
    minibatches = [[micro_batch_inputs(w, recomputed, micro) for micro in plan] for plan in w.plans]
    variants = [Variant("prox/recompute", "prox", lambda: w.reference.recompute_prox_logp(w.samples, w.plans))]
    for method in w.options.approx_methods:
        for schedule in w.options.approx_schedules:
            trainer = w.trainer(method, schedule)
            variants.append(Variant(f"prox/{method}-{schedule}", "prox", blocked=True,
                                    run=partial(approximate_step, trainer, minibatches, w.version)))
    return variants


def step_variant(w: Workload, label: str, trainer: Trainer) -> Variant:
    """The whole `Trainer.step` from the start state, with its phases from the shared timer."""
    last: dict[str, float] = {}

    def before() -> None:
        w.start.restore()
        w.timer.pop()

    def step() -> None:
        last.update(trainer.step(w.batch, version=w.version, generator=torch.Generator().manual_seed(w.plan_seed)))

    def phases() -> dict[str, float]:
        times = w.timer.pop()
        return {"prox_logp": times.get("time/prox_logp", 0.0), "train": times.get("time/train", 0.0),
                "loss": last["actor/loss"]}

    return Variant(f"step/{label}", "step", step, before=before, after=phases)


def optimizer_variants(w: Workload) -> list[Variant]:
    """One step of the trainer's optimizer (`make_optimizer`: fused where torch has the
    kernel) and of torch's default AdamW with the same hyperparameters, on fixed random
    gradients. They move the live weights: every step and rollout repetition restores them,
    and prox/recompute's time does not depend on their values."""
    library = make_optimizer(w.policy, w.cfg.train)
    params = library.param_groups[0]["params"]
    hyperparameters = {key: library.defaults[key] for key in ("lr", "betas", "eps", "weight_decay")}
    generator = torch.Generator(device=w.device).manual_seed(7)
    grads = [torch.randn(p.shape, device=w.device, dtype=p.dtype, generator=generator) * 1e-3 for p in params]
    n_params = sum(p.numel() for p in params)

    def set_grads() -> None:
        for param, grad in zip(params, grads):
            param.grad = grad

    optimizers = {"default": torch.optim.AdamW(params, **hyperparameters),
                  **({"fused": library} if library.defaults.get("fused") else {})}
    return [Variant(f"kernel/adamw_{name}@{n_params}", "kernel", optimizer.step, before=set_grads,
                    info={"params": n_params}) for name, optimizer in optimizers.items()]


def compute_dtype(w: Workload) -> torch.dtype:
    """What the trainer's matmuls and lm_head run in: its autocast dtype, else the weights'."""
    return w.reference.autocast_dtype or next(w.policy.parameters()).dtype


def matmul_peak_variant(w: Workload) -> Variant:
    """The device's achievable matmul rate in the run's compute dtype, as the run's linear layers
    compute it (`a3po.device.autocast`: on a CPU where bf16 is not the faster, bf16 operands
    multiplied in float32): a linear layer of the model's own MLP shape (tokens x hidden @
    hidden x intermediate) at a few thousand rows. MFU is given against this measured peak,
    beside the nominal one where it is known."""
    rows, hidden, inner = 2048, int(w.policy.config.hidden_size), int(w.policy.config.intermediate_size)
    dtype, generator = compute_dtype(w), torch.Generator(device=w.device).manual_seed(w.cfg.seed + 37)
    a = torch.randn(rows, hidden, device=w.device, generator=generator).to(dtype)
    weight = torch.nn.Parameter(torch.randn(inner, hidden, device=w.device, generator=generator).to(dtype),
                                requires_grad=False)  # a parameter, as the layers' weights are

    def linear() -> torch.Tensor:
        with autocast(w.device, w.reference.autocast_dtype):
            return torch.nn.functional.linear(a, weight)

    name = str(dtype).removeprefix("torch.")
    gemm = "float32" if dtype == torch.bfloat16 and bf16_gemm_in_float32(w.device) else name
    return Variant(f"kernel/matmul_{name}", "kernel", linear, blocked=True,
                   info={"flops": 2 * rows * hidden * inner, "shape": [rows, hidden, inner], "dtype": name, "gemm": gemm})


def logprob_variants(w: Workload) -> list[Variant]:
    """Forward and backward of the log-prob reduction over the vocabulary at the response
    positions of the largest micro-batch (the unit the trainer runs it on), with and without
    the entropy: what the entropy costs on top."""
    vocab = w.policy.config.vocab_size
    tokens = max(sum(w.samples[i].response_ids.numel() for i in micro) for plan in w.plans for micro in plan)
    generator = torch.Generator(device=w.device).manual_seed(w.cfg.seed + 31)
    logits = torch.randn(tokens, vocab, device=w.device, generator=generator).to(compute_dtype(w))
    targets = torch.randint(0, vocab, (tokens,), device=w.device)

    def logprob_pass(with_entropy: bool) -> None:
        leaf = logits.detach().requires_grad_(True)
        logp = token_logprobs_and_entropy(leaf, targets)[0] if with_entropy else token_logprobs(leaf, targets)
        logp.sum().backward()

    return [Variant(f"kernel/logprobs{suffix}@{tokens}", "kernel", partial(logprob_pass, entropy), blocked=True,
                    info={"tokens": tokens, "vocab": vocab}) for suffix, entropy in (("", False), ("+entropy", True))]


def copy_variant(w: Workload) -> Variant:
    """A large copy: bytes read + written per second is the streaming bandwidth the
    approximation's floor is divided by."""
    source = torch.rand(w.options.bandwidth_mib * 2**20 // 4, device=w.device)
    target = torch.empty_like(source)
    return Variant("kernel/copy", "kernel", lambda: target.copy_(source), blocked=True,
                   info={"bytes": 2 * source.numel() * source.element_size()})


def kernel_inputs(w: Workload) -> dict[int, Flat]:
    """Flat tensors for the bandwidth floor: the batch's own size and the paper-scale sizes."""
    generator = torch.Generator().manual_seed(w.cfg.seed + 29)
    inputs = {}
    for n in sorted({sum(s.response_ids.numel() for s in w.samples), *w.options.kernel_tokens}):
        behave = -torch.rand(n, generator=generator) * 5
        target = behave + torch.randn(n, generator=generator) * 0.1
        versions = torch.full((n,), w.version - int(w.cfg.staleness), dtype=torch.long)
        inputs[n] = (behave.to(w.device), target.to(w.device), versions.to(w.device))
    return inputs


def approximation_kernel_variants(inputs: dict[int, Flat], version: int) -> list[Variant]:
    """Per size: `approximate_prox_logp` (inverse schedule) with and without its finite
    check, and the trainer's deferred check (`all_finite`, a flag on the device) alone."""
    variants = []
    for n, flat in inputs.items():
        for method in approximations():
            for check in (True, False):
                variants.append(Variant(
                    f"kernel/{method}-inverse@{n}" + ("" if check else "/no_check"), "kernel", blocked=True,
                    run=partial(approximate_prox_logp, *flat, version, method=method, check_finite=check),
                    info={"tokens": n, "method": method, "check_finite": check}))
        variants.append(Variant(f"kernel/finite_flag@{n}", "kernel", partial(all_finite, flat[0]), blocked=True,
                                info={"tokens": n}))
    return variants


def approximation_traffic(inputs: dict[int, Flat], version: int) -> dict[str, dict[str, Any]]:
    """Per `<method>@<tokens>`: the bytes a fused kernel would move (each input read once, the
    output written once, float32) and what the eager implementation moves, in how many aten ops."""
    out = {}
    for n, flat in inputs.items():
        for method in approximations():
            with TrafficCounter() as traffic:
                approximate_prox_logp(*flat, version, method=method, check_finite=True)
            minimal = sum(tensor.numel() * tensor.element_size() for tensor in flat) + n * 4
            out[f"{method}@{n}"] = {"tokens": n, "bytes_minimal": minimal, "bytes_eager": traffic.bytes,
                                    "aten_ops": traffic.ops, "largest_tensor_elements": traffic.largest}
    return out


def all_variants(w: Workload) -> tuple[list[Variant], dict[int, Flat]]:
    """Every variant in round order, and the flat inputs of the approximation kernels."""
    inputs = kernel_inputs(w)
    return [*([rollout_variant(w)] if w.options.rollout else []), *prox_variants(w),
            *(step_variant(w, label, trainer) for label, trainer in w.trainers.items()),
            *(optimizer_variants(w) if w.options.optimizer_kernels else []), *logprob_variants(w),
            matmul_peak_variant(w), copy_variant(w), *approximation_kernel_variants(inputs, w.version)], inputs
