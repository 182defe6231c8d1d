"""Stop at the next step boundary on SIGUSR2/SIGTERM/SIGINT, checkpoint, then let the
previous handler act.

SLURM (through submitit) sends USR2 some time before preemption or timeout; submitit's own
handler requeues the job and exits the process at once. Exiting mid-step would lose the
work since the last checkpoint, so we only record the signal, finish the step, write
`last.pt`, and then call submitit's handler, which requeues; the requeued job resumes.
With no handler before ours (a local run or a local sweep getting SIGTERM), the process then
exits with 128 + the signal number, as the default action would have, so a local sweep
stops instead of starting its next run. A second Ctrl-C interrupts immediately.
"""

from __future__ import annotations

import logging
import signal
from types import FrameType
from typing import Any

log = logging.getLogger(__name__)

STOP_SIGNALS = tuple(s for s in (getattr(signal, "SIGUSR2", None), signal.SIGTERM, signal.SIGINT) if s is not None)


class GracefulStop:
    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> "GracefulStop":
        for signum in STOP_SIGNALS:
            try:
                self._previous[signum] = signal.signal(signum, self._handle)
            except ValueError:  # not the main thread: signals stay with whoever owns them
                pass
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum == signal.SIGINT and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signum = signum
        log.warning("caught %s: stopping after this step with a checkpoint", signal.Signals(signum).name)

    def hand_over(self) -> None:
        """After the checkpoint: run the handler that was installed before ours (submitit's
        requeue for USR2), as if the signal had just arrived."""
        if self.signum is None:
            return
        previous = self._previous.get(self.signum)
        self.__exit__()
        if callable(previous):
            _call_ignoring_sigterm(previous, self.signum)
        elif previous == signal.SIG_DFL:
            raise SystemExit(128 + self.signum)


def _call_ignoring_sigterm(handler: Any, signum: int) -> None:
    """Run `handler` with SIGTERM ignored, in this process and in the children it starts.

    submitit's handler runs `scontrol requeue`; SLURM then sends SIGTERM to every process of
    the job, that scontrol included. Killed before it exits, it fails the handler
    (CalledProcessError), and the job ends failed although it was requeued. An ignored
    signal stays ignored across exec, so scontrol finishes. We are stopping already, so the
    SIGTERM has nothing left to ask for."""
    before = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        handler(signum, None)
    finally:
        signal.signal(signal.SIGTERM, before)
