"""Every pre-registered study's tests and hypotheses, as data: one declaration per study in
`STUDIES`, in one form (`Hypothesis`), under the study's one name (conf/experiment/<name>.yaml,
docs/studies/<name>.md, analysis/studies/<name>.py, docs/reports/<name>.md). A test judged in a
Holm family (S6 on) has a family kind and reads one per-run column (`analysis.studies` judges
it); a hypothesis decided by its study's own registered rule (S2-S5) has the kind `rule` and is
decided in its study's module, which heads its verdict with `titled(label)` and never spells a
hypothesis out itself (tests/test_analysis_layout.py checks that, and that each label is on its
page).

The declarations sit here, not in each study's module, because more than one module reads
them: studies never import each other, and S2's fidelity verdicts (H-S2a, H-S2c) are written by
`analysis.anchor.tracking` for the alpha-schedule and approx_quality reports alike, S3's H-S3d
by `analysis.anchor.clip_rates`.

S1's claims are the one special case (`analysis.claims.paper.CLAIMS`): they are the A-3PO
paper's claims, judged by `python -m analysis.report` in every context of any sweep (not only
S1's), each with how its effect is formed and shown, the paper's value and effect size (fields
no registered test has), and S2-S5 reuse them as the metrics of their contrasts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

__all__ = ["FAMILY_KINDS", "RULE", "Hypothesis", "STUDIES", "HYPOTHESES", "declared", "titled"]

FAMILY_KINDS = ("direction", "two_sided", "equivalence", "one_sample")  # judged raw and under Holm
RULE = "rule"  # decided by its study's own registered rule (its module), in no family


@dataclass(frozen=True)
class Hypothesis:
    label: str                # the pre-registration's name for it (H-S3a, R, a, T1, ...)
    text: str                 # in words: what a family test reads, what a rule's hypothesis claims
    column: str = ""          # a family test: the per-run column
    kind: str = RULE          # one of FAMILY_KINDS, or RULE
    sign: int = 0             # direction: +1 treated higher, -1 treated lower
    scale: str = "difference"  # or "log_ratio": log(baseline / treated)
    margin: float = 0.0       # equivalence: the band's half-width, in the column's units

    def __post_init__(self) -> None:
        if self.kind not in (*FAMILY_KINDS, RULE):
            raise ValueError(f"{self.label}: kind {self.kind!r}; allowed: {', '.join((*FAMILY_KINDS, RULE))}")
        if self.kind == "direction" and self.sign not in (-1, 1):
            raise ValueError(f"{self.label}: a direction test needs sign +1 or -1")
        if self.kind == "equivalence" and not self.margin > 0:
            raise ValueError(f"{self.label}: an equivalence test needs a margin > 0")


S6_REWARD = "held-out reward, mean of the last two evals"
STUDIES: dict[str, tuple[Hypothesis, ...]] = {
    "alpha_schedules": (  # S2
        Hypothesis("H-S2a", "step_start vs inverse, per-seed paired difference, mean over steps >= d; 95% t interval"),
        Hypothesis("H-S2b", "step_start clips no more than recompute where inverse clips more"),
        Hypothesis("H-S2c", "fitted below step_start, log-prob error, held-out seeds"),
    ),
    "mechanism": (  # S3
        Hypothesis("H-S3a", "the inverse - recompute clip gap falls as m grows"),
        Hypothesis("H-S3b", "the direction follows the drift"),
        Hypothesis("H-S3c", "step_start clips no more than recompute at every m"),
        Hypothesis("H-S3d", "on the same batches the inverse anchor clips more than recompute's, m = 2 and 8"),
    ),
    "corrections": (  # S4
        Hypothesis("H-S4a", "m2po keeps the token ESS higher under recompute"),
        Hypothesis("H-S4b", "every masking correction lowers the IW max under recompute"),
        Hypothesis("H-S4c", "A-3PO's anchor alone keeps the token ESS higher than recompute's"),
        Hypothesis("H-S4d", "seq_mis at 0.5-2 lowers loglinear's held-out reward"),
    ),
    "precision": (  # S5
        Hypothesis("H-P1", "the findings survive"),
        Hypothesis("H-P2", "does bf16 move the effect's size?"),
    ),
    "s6": (  # each loglinear arm against recompute; R's margin is absolute reward
        Hypothesis("R", S6_REWARD, "last_evals_reward", "equivalence", margin=0.12),
        Hypothesis("R'", S6_REWARD, "last_evals_reward", "two_sided"),
        Hypothesis("a", "prox-logp time, steady (log recompute / loglinear)", "prox_time_s", "direction", +1, "log_ratio"),
        Hypothesis("b'", "training CPU time (log recompute / loglinear)", "cpu_time_s", "direction", +1, "log_ratio"),
        Hypothesis("d", "entropy, steady", "entropy", "direction", +1),
        Hypothesis("e", "IW max (pi_theta / pi_prox), steady", "iw_max", "direction", -1),
        Hypothesis("f", "IW min (pi_theta / pi_prox), steady", "iw_min", "direction", +1),
        Hypothesis("g", "clip ratio, steady", "clip_ratio", "direction", -1),
        Hypothesis("T1", "total ratio pi_theta / pi_behave max, steady", "total_ratio_max", "two_sided"),
        Hypothesis("T2", "total ratio pi_theta / pi_behave min, steady", "total_ratio_min", "two_sided"),
        Hypothesis("T3", "ESS of the total ratio, steady", "ess_total", "two_sided"),
        Hypothesis("T4", "KL(pi_behave || pi_theta) (k3), steady", "kl_k3", "two_sided"),
        Hypothesis("T5", "gradient norm, steady", "grad_norm", "two_sided"),
        Hypothesis("C1", "anchor effect: own anchor's clip rate - recompute's anchor's, same batches", "anchor_effect",
                   "one_sample"),
        Hypothesis("C2", "trajectory effect: recompute's anchor's clip rate on loglinear's batches - recompute's",
                   "clip_recompute_anchor", "two_sided"),
    ),
    "final_reward": (  # S7: R alone in its family; R' descriptive, judged apart
        Hypothesis("R", S6_REWARD, "last_evals_reward", "equivalence", margin=0.12),
        Hypothesis("R'", S6_REWARD, "last_evals_reward", "two_sided"),
    ),
    "s8": (  # per loglinear arm, primed for the second; b's margin is 2% of recompute's mean reward
        Hypothesis("a", "last_evals_reward", "last", "two_sided"),
        Hypothesis("b", "last_evals_reward, ±2% of recompute's", "last", "equivalence", margin=0.02),
        Hypothesis("c", "early_reward (evals after steps 10-50)", "early", "two_sided"),
    ),
}


def declared(study: str, label: str) -> Hypothesis:
    """One test or hypothesis of a study's declaration."""
    return next(test for test in STUDIES[study] if test.label == label)


class Registered(NamedTuple):
    page: str  # the pre-registration, below docs/studies/
    text: str  # as the report heads its verdict


# the hypotheses a report heads a verdict with (`titled`): every RULE one, each label once
HYPOTHESES = {test.label: Registered(f"{study}.md", test.text)
              for study, tests in STUDIES.items() for test in tests if test.kind == RULE}


def titled(label: str) -> str:
    """`H-S3a (the inverse - recompute clip gap falls as m grows)`: a verdict's head."""
    return f"{label} ({HYPOTHESES[label].text})"
