"""The CPU threads torch may use in a GPU engine's processes (rank 0's and each worker rank's)."""

from __future__ import annotations

import logging

import torch

from roseray import envs

logger = logging.getLogger(__name__)


def limit_cpu_threads(device: torch.device) -> None:
    """A GPU engine runs torch on one CPU thread unless OMP_NUM_THREADS says otherwise: its host ops
    are small, and idle OpenMP workers spin on the cores that the grammar matchers' threads (and the
    other ranks' processes) need. Two threads' xgrammar accepts ran no faster than one beside torch's
    spinning pool."""
    if device.type != "cuda" or envs.omp_num_threads() is not None:
        return
    threads = torch.get_num_threads()
    if threads > 1:
        torch.set_num_threads(1)
        logger.info("torch CPU threads: %d -> 1 for a GPU engine (set %s to choose)", threads,
                    envs.OMP_NUM_THREADS_ENV)
