"""The rollout's weights in the dtype its matmuls compute in (a3po.rollout.decode says why)."""

from __future__ import annotations

import copy

import torch

__all__ = ["ComputeWeights"]


class ComputeWeights:
    """The rollout's module, its weights as the compute dtype wants them.

    - float32 (`dtype` None) and not `private`: the policy itself, nothing to copy or cast.
    - otherwise a copy whose nn.Linear weights and biases are stored in `dtype` (the autocast
      dtype), everything else (norms, embeddings) as in the policy. Under autocast a linear
      layer computes with its weights cast to that dtype, so the copy's logits equal the
      policy's bit for bit, minus the casts. A tied output layer (SmolLM2's lm_head shares the
      embedding) is untied: the embedding stays float32, as autocast leaves it.
    - not `private` (the engine samples between the trainer's steps): the parameters that need
      no cast are the policy's own tensors, shared; `private` (generation concurrent with
      training, `HFCopyEngine`): every tensor is the copy's own.

    `refresh(policy)` copies the policy's current weights in (casting), one pass over the
    parameters: the weight sync. `load_state` does it from a state dict (a staged update)."""

    def __init__(self, policy: torch.nn.Module, dtype: torch.dtype | None, *, private: bool = False) -> None:
        self.dtype = dtype
        self.private = private
        self.module = policy if dtype is None and not private else self._copy(policy, dtype, share=not private)

    @staticmethod
    def _copy(policy: torch.nn.Module, dtype: torch.dtype | None, *, share: bool) -> torch.nn.Module:
        memo: dict[int, torch.Tensor] = {}
        shared = _shared_parameter_ids(policy)
        linear = {id(p) for m in policy.modules() if isinstance(m, torch.nn.Linear) for p in (m.weight, m.bias)
                  if p is not None}
        for param in policy.parameters():
            if dtype is not None and id(param) in linear and id(param) not in shared:
                memo[id(param)] = torch.nn.Parameter(param.detach().to(dtype), requires_grad=param.requires_grad)
            elif share and (id(param) not in linear or id(param) in shared):
                memo[id(param)] = param  # a tied output layer gets a tensor of its own below
        module_copy = copy.deepcopy(policy, memo)
        if dtype is not None:
            for module in module_copy.modules():  # a tied output layer: a compute-dtype tensor of its own
                if isinstance(module, torch.nn.Linear):
                    for name in ("weight", "bias"):
                        param = getattr(module, name)
                        if param is not None and param.dtype != dtype:
                            setattr(module, name, torch.nn.Parameter(param.detach().to(dtype),
                                                                     requires_grad=param.requires_grad))
        return module_copy

    @staticmethod
    def _pairs_of(policy: torch.nn.Module, module_copy: torch.nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
        source = dict(policy.named_parameters(remove_duplicate=False))
        return [(source[name], param) for name, param in module_copy.named_parameters(remove_duplicate=False)
                if source[name] is not param]

    @torch.no_grad()
    def refresh(self, policy: torch.nn.Module) -> None:
        """Load `policy`'s current weights (nothing to do where the module is the policy)."""
        if self.module is not policy and self.dtype is None and not self.private:
            self.module = policy
        elif self.module is not policy:
            for source, target in self._pairs_of(policy, self.module):
                target.copy_(source)

    @torch.no_grad()
    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        """Load a state dict (the async engine's staged update), casting where the copy's
        tensors are of the compute dtype; a tied weight's one entry feeds both its copies."""
        for name, tensor in self.module.named_parameters(remove_duplicate=False):
            source = state.get(name)
            if source is None:  # an untied output layer: the state dict holds the tie once
                source = state[_tied_source(self.module, name)]
            tensor.copy_(source)
        for name, tensor in self.module.named_buffers(remove_duplicate=False):
            if name in state:  # a non-persistent buffer (rotary frequencies) is not in it, and never changes
                tensor.copy_(state[name])


def _shared_parameter_ids(policy: torch.nn.Module) -> set[int]:
    seen: dict[int, int] = {}
    for _, param in policy.named_parameters(remove_duplicate=False):
        seen[id(param)] = seen.get(id(param), 0) + 1
    return {key for key, count in seen.items() if count > 1}


def _tied_source(module: torch.nn.Module, name: str) -> str:
    keys = getattr(module, "_tied_weights_keys", None) or {}
    if isinstance(keys, dict) and name in keys:
        return keys[name]
    raise KeyError(f"{name} is missing from the state dict and is not a tied weight of {type(module).__name__}")
