"""Where the symmetric-memory all-reduce applies: never on CPU (gloo) or when asked for NCCL,
and an unknown method is an error naming the variable (the GPU behaviour is
test_gpu_symmetric_all_reduce.py's)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from roseray.envs import TP_ALL_REDUCE_ENV
from roseray.symmetric_all_reduce import symmetric_all_reduce


@pytest.fixture
def gloo_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_cpu_and_nccl_choice_leave_everything_to_the_group(gloo_group):
    assert symmetric_all_reduce(gloo_group, torch.device("cpu"), "symmetric") is None
    assert symmetric_all_reduce(gloo_group, torch.device("cpu"), "nccl") is None


def test_unknown_method_names_the_variable(gloo_group):
    with pytest.raises(ValueError, match=TP_ALL_REDUCE_ENV):
        symmetric_all_reduce(gloo_group, torch.device("cpu"), "ring")
