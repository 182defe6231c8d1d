"""GracefulStop: a stop signal is recorded, not acted on, until the step ends; then the
handler that was there before ours acts (submitit's requeue on SLURM), or the process exits
as the signal's default action would have.

These run in pytest's main thread, sending signals to this process; each test restores the
handlers it changed. On the local cluster: tests/test_slurm_training.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from a3po.run.preemption import GracefulStop

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGUSR2"), reason="needs POSIX signals")

# A child that SIGTERMs itself while it runs: what `scontrol requeue` meets when SLURM kills
# the requeued job's processes before scontrol has exited.
SELF_TERMINATING_CHILD = [
    sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGTERM); print('survived')",
]


@pytest.fixture
def restore_handlers():
    saved = {s: signal.getsignal(s) for s in (signal.SIGUSR2, signal.SIGTERM, signal.SIGINT)}
    yield
    for signum, handler in saved.items():
        signal.signal(signum, handler)


def test_a_signal_is_recorded_and_the_step_goes_on(restore_handlers):
    with GracefulStop() as stop:
        assert not stop.requested
        os.kill(os.getpid(), signal.SIGUSR2)
        assert stop.requested and stop.signum == signal.SIGUSR2


def test_handing_over_removes_ours_then_runs_the_previous_handler(restore_handlers):
    seen = []
    signal.signal(signal.SIGUSR2, lambda signum, frame: seen.append((signum, signal.getsignal(signal.SIGUSR2))))
    previous = signal.getsignal(signal.SIGUSR2)
    with GracefulStop() as stop:
        os.kill(os.getpid(), signal.SIGUSR2)
        assert seen == []
        stop.hand_over()
    assert seen == [(signal.SIGUSR2, previous)]


def test_a_child_of_the_previous_handler_survives_the_jobs_sigterm(restore_handlers):
    """submitit's handler runs `scontrol requeue`, and SLURM SIGTERMs the whole job while
    scontrol may still run; killed, it made the handler raise and the job end failed."""
    results = []

    def requeue(signum, frame):
        results.append(subprocess.run(SELF_TERMINATING_CHILD, capture_output=True, text=True))

    signal.signal(signal.SIGUSR2, requeue)
    sigterm_before = signal.getsignal(signal.SIGTERM)
    with GracefulStop() as stop:
        os.kill(os.getpid(), signal.SIGUSR2)
        stop.hand_over()
    assert (results[0].returncode, results[0].stdout.strip()) == (0, "survived")
    assert signal.getsignal(signal.SIGTERM) == sigterm_before


def test_without_a_child_ignoring_it_the_sigterm_kills_the_child(restore_handlers):
    """The premise of the test above: the child's self-SIGTERM is fatal when not ignored."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    result = subprocess.run(SELF_TERMINATING_CHILD, capture_output=True, text=True)
    assert result.returncode == -signal.SIGTERM and result.stdout == ""


def test_with_no_previous_handler_hand_over_exits_as_the_signal_would(restore_handlers):
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    with GracefulStop() as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        with pytest.raises(SystemExit) as exited:
            stop.hand_over()
    assert exited.value.code == 128 + signal.SIGTERM


def test_no_signal_means_hand_over_does_nothing(restore_handlers):
    with GracefulStop() as stop:
        stop.hand_over()
    assert not stop.requested


def test_a_second_ctrl_c_interrupts_at_once(restore_handlers):
    with GracefulStop():
        os.kill(os.getpid(), signal.SIGINT)
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
