"""Kernel tests: on a machine without CUDA the Triton kernels run in its interpreter, which
tests/conftest.py switches on before Triton is first imported; every kernel test checks that
it really is the interpreter (a kernel compiled for a missing GPU would fail confusingly)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _interpreter_on_cpu():
    import triton

    if not torch.cuda.is_available():
        assert type(triton.language.sum).__name__ == "InterpretedFunction", (
            "Triton was imported before TRITON_INTERPRET=1 was set (tests/conftest.py sets it)")
