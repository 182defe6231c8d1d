"""The contention flag holds a run's CPU time against its wall time times the threads it used
(analysis.scalars.contended): a 2-thread run beside a CPU hog is flagged, which the old rule
(wall / CPU > 1.25, blind to threads) missed."""

from __future__ import annotations

import subprocess
import sys
import time

import pandas as pd
import pytest
import torch

from analysis.scalars import contended, contention_rule


def test_the_rule_counts_threads():
    # one thread: the old rule, unchanged (reports of one-thread runs read as before)
    assert contended(10.0, 8.0) is False and contended(10.0, 7.9) is True
    # two threads, both cores used: CPU 2 x wall
    assert contended(10.0, 19.0, threads=2) is False
    # two threads that got one core between them: wall/CPU 1.0, which the old rule passed
    assert contended(10.0, 10.0) is False and contended(10.0, 10.0, threads=2) is True
    # unknown thread counts (runs logged before machine/threads) count as one
    assert contended(10.0, 10.0, threads=float("nan")) is False
    assert contention_rule(pd.DataFrame({"threads": [1.0, 1.0]})) == "wall/CPU > 1.25, under 0.8 of a core"
    assert contention_rule(pd.DataFrame({"threads": [1.0, 2.0]})).startswith("wall x threads / CPU > 1.25")


def _two_thread_work(seconds: float) -> tuple[float, float]:
    """GEMMs on 2 torch threads for about `seconds`: the wall and CPU time the trainer's loop
    measures (time.perf_counter, time.process_time)."""
    a = torch.randn(768, 768)
    wall, cpu = time.perf_counter(), time.process_time()
    while time.perf_counter() - wall < seconds:
        a = torch.tanh(a @ a)
    return time.perf_counter() - wall, time.process_time() - cpu


def test_a_two_thread_run_beside_a_cpu_hog_is_flagged():
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        time.sleep(0.3)  # the hogs are running
        wall, cpu = _two_thread_work(3.0)
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
        torch.set_num_threads(threads)
    # two hogs and two threads on this machine's cores: the run gets about half of what its threads could use
    assert contended(wall, cpu, threads=2), f"wall {wall:.2f} s, CPU {cpu:.2f} s"


def test_a_run_logs_the_threads_it_ran_with(tiny_cfg):
    from analysis.load import load_runs
    from analysis.scalars import run_scalars
    from a3po.run.main import run, run_dir_of
    from a3po.run.metrics_log import read_metrics

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        cfg = tiny_cfg("train.total_steps=2", "train.eval_every=0")
        run(cfg)
    finally:
        torch.set_num_threads(threads)
    records = read_metrics(run_dir_of(cfg) / "metrics.jsonl")
    assert [r["machine/threads"] for r in records] == [2.0, 2.0]
    scalars = run_scalars(load_runs(run_dir_of(cfg)))
    assert scalars["threads"].tolist() == [2.0]
    assert scalars["contended"].tolist() == [contended(scalars["train_time_s"].iloc[0],
                                                       scalars["cpu_time_s"].iloc[0], threads=2)]
    # the demo's summary states the threads rule where a run used several threads
    from analysis.summary import THREADS_NOTE, summary_markdown, summary_table
    assert THREADS_NOTE in summary_markdown(summary_table(load_runs(run_dir_of(cfg))))
