"""The pre-registered hypotheses the study reports decide, as data: each label, the page that
registers it and the words a report heads its verdict with. A report writes `titled(label)`
and never spells a hypothesis out itself (tests/test_analysis_layout.py checks that each label
is on its page)."""

from __future__ import annotations

from typing import NamedTuple


class Hypothesis(NamedTuple):
    page: str  # the pre-registration, below docs/studies/
    text: str  # as the report heads its verdict


HYPOTHESES = {
    "H-S2a": Hypothesis("alpha_schedules.md",
                        "step_start vs inverse, per-seed paired difference, mean over steps >= d; 95% t interval"),
    "H-S2b": Hypothesis("alpha_schedules.md", "step_start clips no more than recompute where inverse clips more"),
    "H-S2c": Hypothesis("alpha_schedules.md", "fitted below step_start, log-prob error, held-out seeds"),
    "H-S3a": Hypothesis("mechanism.md", "the inverse - recompute clip gap falls as m grows"),
    "H-S3b": Hypothesis("mechanism.md", "the direction follows the drift"),
    "H-S3c": Hypothesis("mechanism.md", "step_start clips no more than recompute at every m"),
    "H-S3d": Hypothesis("mechanism.md", "on the same batches the inverse anchor clips more than recompute's, m = 2 and 8"),
    "H-S4a": Hypothesis("corrections.md", "m2po keeps the token ESS higher under recompute"),
    "H-S4b": Hypothesis("corrections.md", "every masking correction lowers the IW max under recompute"),
    "H-S4c": Hypothesis("corrections.md", "A-3PO's anchor alone keeps the token ESS higher than recompute's"),
    "H-S4d": Hypothesis("corrections.md", "seq_mis at 0.5-2 lowers loglinear's held-out reward"),
    "H-P1": Hypothesis("precision.md", "the findings survive"),
    "H-P2": Hypothesis("precision.md", "does bf16 move the effect's size?"),
}


def titled(label: str) -> str:
    """`H-S3a (the inverse - recompute clip gap falls as m grows)`: a verdict's head."""
    return f"{label} ({HYPOTHESES[label].text})"
