"""The trainer of a run's config: the one place the learner reads the RunConfig. The trainer itself
(a3po.learner.trainer.Trainer) receives its parts: the `train` group, the method's anchor, the
schedule, objective and correction bound once to their checked parameters, the temperature, the
resolved precision and, with `train.log_prox_errors`, the fidelity telemetry."""

from __future__ import annotations

import torch

from a3po.distributed import SINGLE, DistInfo
from a3po.learner.anchors import build_anchor
from a3po.learner.fidelity import FidelityRecorder
from a3po.learner.trainer import Trainer
from a3po.maths.corrections import CORRECTIONS
from a3po.maths.objectives import OBJECTIVES
from a3po.maths.proximal import ALGOS
from a3po.maths.schedules import SCHEDULES
from a3po.run_config import RunConfig
from a3po.timer import PhaseTimer

__all__ = ["trainer_from"]


def trainer_from(cfg: RunConfig, policy: torch.nn.Module, *, pad_id: int, device: torch.device, timer: PhaseTimer,
                 dist: DistInfo = SINGLE) -> Trainer:
    """The trainer of the run's config: the method's anchor, the schedule, the objective and the
    correction bound once to their checked parameters (the step checks nothing again)."""
    method = ALGOS.lookup(cfg.algo.name)
    objective, correction = OBJECTIVES.bind(cfg.objective.as_dict()), CORRECTIONS.bind(cfg.correction.as_dict())
    anchor = build_anchor(method, method.check(cfg.algo.as_dict(), "algo"), SCHEDULES.bind(cfg.schedule.as_dict()), device)
    schedules = ({name: dict(params or {}) for name, params in cfg.train.prox_error_schedules.items()}
                 if cfg.train.log_prox_errors else {})
    fidelity = (FidelityRecorder(schedules, objective, correction, cfg.train.grad_fidelity_every, timer, policy.parameters)
                if schedules else None)
    return Trainer(policy, cfg.train, anchor=anchor, objective=objective, correction=correction,
                   temperature=cfg.rollout.temperature, precision=cfg.precision, pad_id=pad_id, device=device,
                   timer=timer, dist=dist, fidelity=fidelity)
