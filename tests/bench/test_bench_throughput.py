"""`python -m roseray.bench throughput` on a tiny checkpoint on CPU: --kv-cache-dtype reaches the engine."""

from __future__ import annotations

import json

import pytest

from roseray.bench import throughput
from roseray.sampling_params import SamplingParams


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_kv_cache_dtype_reaches_the_engine(tiny_checkpoint, tmp_path, monkeypatch, kv_cache_dtype):
    engines = []
    real_llm = throughput.LLM

    def recording_llm(*args, **kwargs):
        llm = real_llm(*args, **kwargs)
        engines.append(llm.engine)
        return llm

    monkeypatch.setattr(throughput, "LLM", recording_llm)
    # W-nano's token ids exceed the tiny vocabulary: a few short requests instead
    monkeypatch.setattr(throughput, "nano_workload",
                        lambda n: ([[5, 6, 7, 8]] * n, SamplingParams(max_tokens=4, ignore_eos=True)))
    out = tmp_path / "result.json"
    argv = ["--model", str(tiny_checkpoint("llama")), "--num-seqs", "2", "--out", str(out)]
    assert throughput.main(argv + ["--kv-cache-dtype", kv_cache_dtype]) == 0
    result = json.loads(out.read_text())
    assert result["engine_args"]["kv_cache_dtype"] == kv_cache_dtype
    assert engines[0].config.kv_cache_dtype == kv_cache_dtype
    assert str(engines[0].runner.kv_cache.dtype) == ("torch.float8_e4m3fn" if kv_cache_dtype == "fp8" else
                                                     "torch.float32")
    assert result["output_tokens"] > 0
