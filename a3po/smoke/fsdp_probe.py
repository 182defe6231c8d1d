"""The smoke's `fsdp2-nccl-1rank` item: FSDP2 over nccl on one GPU, where two ranks cannot run.

`a3po.distributed.wrap_fsdp` at world 1 against the same model unwrapped (a 3-layer llama of
hidden 128, random tokens, 3 AdamW steps at lr 1e-3): in fp32 the losses, gradients and weights
must agree (with activation checkpointing too), and `train.fsdp_mixed_precision`'s bf16 gathers
must stay close to autocast bf16 with float32 master weights. On a CPU it runs over gloo (the
test suite's path)."""

from __future__ import annotations

import copy
import os
from typing import Any

import torch

__all__ = ["fsdp_one_rank"]

STEPS, LR = 3, 1e-3


def _train(model: torch.nn.Module, ids: torch.Tensor, device: str, autocast: bool) -> dict[str, Any]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for _ in range(STEPS):
        with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        grads = {n: _full(p.grad).float().clone() for n, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    return {"losses": losses, "grads": grads, "weights": {n: _full(p.detach()).float() for n, p in model.named_parameters()}}


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _compare(case: str, reference: dict[str, Any], wrapped: dict[str, Any]) -> dict[str, Any]:
    return {"case": case, "losses_ref": reference["losses"], "losses": wrapped["losses"],
            "max_grad": max(float(g.abs().max()) for g in reference["grads"].values()),
            "max_grad_diff": max(float((reference["grads"][n] - g).abs().max()) for n, g in wrapped["grads"].items()),
            "max_weight_diff": max(float((reference["weights"][n] - w).abs().max()) for n, w in wrapped["weights"].items())}


def fsdp_one_rank() -> dict[str, Any]:
    """The three comparisons and the master weights' dtypes, with the backend that ran them."""
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    from a3po.distributed import wrap_fsdp
    from a3po.models.loading import enable_activation_checkpointing

    device = "cuda" if torch.cuda.is_available() else "cpu"
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29531"), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0")
    if device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if device == "cuda" else "gloo")
    try:
        config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                             num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
        torch.manual_seed(0)
        base = LlamaForCausalLM(config).to(device).float()
        ids = torch.randint(0, 512, (4, 48), device=device)
        reference = _train(copy.deepcopy(base), ids, device, autocast=False)
        cases = []
        for case, checkpointing in (("fsdp2 fp32", False), ("fsdp2 fp32 + activation checkpointing", True)):
            model = copy.deepcopy(base)
            if checkpointing:
                enable_activation_checkpointing(model)
                model.train()
            wrap_fsdp(model)
            cases.append(_compare(case, reference, _train(model, ids, device, autocast=False)))
        mixed = copy.deepcopy(base)
        wrap_fsdp(mixed, mixed_precision=True)
        cases.append(_compare("fsdp2 mixed precision vs autocast bf16", _train(copy.deepcopy(base), ids, device, True),
                              _train(mixed, ids, device, autocast=False)))
        return {"backend": dist.get_backend(), "device": device, "cases": cases,
                "master_dtypes": sorted({str(p.dtype) for p in mixed.parameters()})}
    finally:
        dist.destroy_process_group()
