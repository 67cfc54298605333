"""The model tests call models directly: they run the torch attention backend, whatever an
engine built earlier in the process (e.g. a GPU test's, which sets the Triton one) left set."""

from __future__ import annotations

import pytest

from roseray.layers.attention import TorchAttentionBackend, set_attention_backend


@pytest.fixture(autouse=True)
def torch_attention_backend():
    set_attention_backend(TorchAttentionBackend())
    yield
