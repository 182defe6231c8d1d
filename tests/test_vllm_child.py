"""The parts of a3po.rollout.vllm_child that need no vLLM: the child's environment and device,
the wire format of samples, and a child that SLURM's stop signals do not end (a spawned process
started and set up as the engine's child is, serving a trivial pipe loop); and, with vLLM, the
engine's child itself after a USR2. (The engine otherwise: tests/test_vllm.py and, under
torchrun, tests/test_distributed_async.py; preempted on SLURM: tests/test_slurm_preemption_vllm.py.)"""

from __future__ import annotations

import multiprocessing
import os
import signal
from pathlib import Path

import pytest
import torch

from a3po.batch import Sample
from a3po.rollout.vllm_child import (STOP_SIGNALS, _from_wire, _to_wire, child_environment, ignore_stop_signals,
                                     start_child)

TORCHRUN = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "29500", "GROUP_RANK": "0", "ROLE_RANK": "0", "ROLE_WORLD_SIZE": "2",
            "TORCHELASTIC_RUN_ID": "none", "TORCHELASTIC_RESTART_COUNT": "0"}


def test_the_child_sees_no_torchrun_world_and_keeps_everything_else():
    env, device = child_environment({**TORCHRUN, "PATH": "/bin", "OMP_NUM_THREADS": "1"}, "cpu")
    assert env == {"PATH": "/bin", "OMP_NUM_THREADS": "1"}
    assert device == "cpu"


def test_a_cuda_rollout_device_is_the_only_gpu_the_child_sees():
    env, device = child_environment({**TORCHRUN, "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}, "cuda:7")
    assert (env["CUDA_VISIBLE_DEVICES"], device) == ("7", "cuda:0")
    env, device = child_environment({"CUDA_VISIBLE_DEVICES": "4, 6"}, "cuda:1")  # an index into the visible list
    assert (env["CUDA_VISIBLE_DEVICES"], device) == ("6", "cuda:0")
    env, device = child_environment({}, "cuda:3")  # no list: every GPU is visible
    assert (env["CUDA_VISIBLE_DEVICES"], device) == ("3", "cuda:0")
    env, device = child_environment({}, "cuda")
    assert (env["CUDA_VISIBLE_DEVICES"], device) == ("0", "cuda:0")


def test_a_sample_crosses_the_pipe_unchanged():
    sample = Sample(prompt_ids=torch.tensor([5, 6, 7]), response_ids=torch.tensor([8, 9]),
                    behave_logp=torch.tensor([-0.25, -1.5]), versions=torch.tensor([3, 4]), finished=True)
    wire = _to_wire(sample)
    assert not any(isinstance(v, torch.Tensor) for v in wire.values())  # by value, no shared memory
    back = _from_wire(wire)
    for name in ("prompt_ids", "response_ids", "behave_logp", "versions"):
        assert torch.equal(getattr(back, name), getattr(sample, name))
        assert getattr(back, name).dtype == getattr(sample, name).dtype
    assert back.finished is True


def _echo_child(conn, hold: bool) -> None:
    """`_serve`'s shape without vLLM: the stop signals ignored first, then every message
    answered with this process's id, until "close" or the parent's end of the pipe closes.
    `hold`: wait for a first message before that, i.e. a child still starting up."""
    if hold:
        conn.recv()
    ignore_stop_signals()
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return
        if message == "close":
            return
        conn.send((message, os.getpid()))


def _started(hold: bool):
    """An `_echo_child` started as the engine starts its child (`start_child`), and our end of
    its pipe."""
    context = multiprocessing.get_context("spawn")
    here, there = context.Pipe()
    process = context.Process(target=_echo_child, args=(there, hold), name="a3po-vllm-test")
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    start_child(process)
    assert signal.pthread_sigmask(signal.SIG_BLOCK, []) == mask  # ours as it was
    there.close()
    return process, here


def _pending(pid: int) -> set[int]:
    """The signals sent to the process and not yet delivered (its shared pending set)."""
    line = next(row for row in Path(f"/proc/{pid}/status").read_text().splitlines() if row.startswith("ShdPnd:"))
    bits = int(line.split()[1], 16)
    return {signum for signum in STOP_SIGNALS if bits >> (signum - 1) & 1}


def _send_stop_signals(pid: int) -> None:
    for signum in STOP_SIGNALS:
        os.kill(pid, signum)


def test_stop_signals_do_not_end_the_child_which_ends_when_told():
    process, conn = _started(hold=False)
    try:
        conn.send("ready?")
        assert conn.recv() == ("ready?", process.pid)  # past ignore_stop_signals
        _send_stop_signals(process.pid)
        conn.send("still there?")
        assert conn.recv() == ("still there?", process.pid)
        assert process.is_alive() and _pending(process.pid) == set()  # ignored, not held back
        conn.send("close")
        process.join(30)
        assert process.exitcode == 0
    finally:
        conn.close()
        process.kill()


def test_a_stop_signal_during_the_childs_start_up_waits_and_is_then_discarded():
    """The window before the child's target runs (spawn's start-up), held open: the signals
    wait, blocked, and never end the child; it ends when the parent's end of the pipe closes.
    (Also where this is the process's first spawn, which starts multiprocessing's resource
    tracker: run alone, this test covers that.)"""
    process, conn = _started(hold=True)
    try:
        _send_stop_signals(process.pid)
        assert _pending(process.pid) == set(STOP_SIGNALS)
        conn.send("go on")
        conn.send("still there?")
        assert conn.recv() == ("still there?", process.pid)
        assert process.is_alive() and _pending(process.pid) == set()
    finally:
        conn.close()
    process.join(30)
    assert process.exitcode == 0


@pytest.mark.vllm
def test_the_engine_child_survives_stop_signals_and_still_generates_and_updates():
    """The real child (vLLM on CPU, the tiny model): after USR2, TERM and INT a weight update
    and a generation still work, and close still ends it."""
    pytest.importorskip("vllm")
    from test_vllm import _config

    from a3po.models import load_policy
    from a3po.rollout.vllm_child import ChildVLLMEngine

    cfg = _config()
    cfg.rollout.max_new_tokens = 4
    policy, tokenizer = load_policy(cfg.model, seed=0)
    child = ChildVLLMEngine(cfg.rollout, policy, tokenizer, "cpu")
    process = child._process
    try:
        _send_stop_signals(process.pid)
        child.update_weights(policy, 5)
        groups = child.generate([tokenizer("What is 2 + 3?").input_ids], 2, seed=1)
        assert process.is_alive() and [len(group) for group in groups] == [2]
        assert all(len(s.behave_logp) == len(s.response_ids) and torch.all(s.versions == 5) for s in groups[0])
    finally:
        child.close()
    assert process.exitcode == 0


def test_a_child_that_does_not_end_when_closed_is_killed(monkeypatch):
    """SIGTERM (Process.terminate) no longer ends the child: the engine's last resort is SIGKILL."""
    from a3po.rollout import vllm_child

    process, conn = _started(hold=False)
    conn.send("ready?")
    assert conn.recv() == ("ready?", process.pid)
    engine = object.__new__(vllm_child.ChildVLLMEngine)  # the engine's shutdown, minus vLLM
    engine._process, engine._gen, engine._ctrl = process, conn, conn  # our end stays open: it never ends
    monkeypatch.setattr(vllm_child, "CLOSE_TIMEOUT_S", 0.5)
    engine._stop()
    assert process.exitcode == -signal.SIGKILL and engine._process is None
