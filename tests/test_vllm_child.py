"""The parts of a3po.rollout.vllm_child that need no vLLM: the child's environment and device,
and the wire format of samples. (The engine itself: tests/test_vllm.py and, under torchrun,
tests/test_distributed_async.py.)"""

from __future__ import annotations

import torch

from a3po.batch import Sample
from a3po.rollout.vllm_child import _from_wire, _to_wire, child_environment

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
