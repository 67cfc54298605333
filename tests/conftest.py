"""Test-suite setup. Without a GPU, Triton kernels run under its interpreter; the
variable must be set before anything imports triton (transformers does, via torch)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
