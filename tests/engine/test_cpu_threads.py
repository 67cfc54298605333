"""A GPU engine (each of its ranks) runs torch on one CPU thread unless OMP_NUM_THREADS is set; a CPU engine keeps
torch's threads (its model runs on them)."""

from __future__ import annotations

import pytest
import torch

from roseray import envs
from roseray.engine.cpu_threads import limit_cpu_threads


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize(("device", "omp", "expected"), [("cuda", None, 1), ("cuda", "3", None), ("cpu", None, None)])
def test_a_gpu_engine_runs_torch_on_one_cpu_thread(device, omp, expected, monkeypatch, restore_threads):
    if omp is None:
        monkeypatch.delenv(envs.OMP_NUM_THREADS_ENV, raising=False)
    else:
        monkeypatch.setenv(envs.OMP_NUM_THREADS_ENV, omp)
    torch.set_num_threads(2)
    limit_cpu_threads(torch.device(device))
    assert torch.get_num_threads() == (expected or 2)


def test_omp_num_threads_is_a_positive_int_or_none(monkeypatch):
    for value, parsed in (("4", 4), ("0", None), ("x", None), ("", None)):
        monkeypatch.setenv(envs.OMP_NUM_THREADS_ENV, value)
        assert envs.omp_num_threads() == parsed
