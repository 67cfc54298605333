"""The W-seed stream benchmark's own parts: several bursts on one engine, the median one reported."""

import pytest

from roseray.bench import stream
from tests.bench.helpers import small_seed_workload


def _run(tok_s: float) -> dict:
    return {"throughput_tok_s": tok_s, "ttft_ms": {"p50": tok_s / 1e3}}


def test_median_pass_reports_the_middle_burst_and_every_burst():
    chosen = stream.median_pass([_run(150e3), _run(90e3), _run(180e3)])
    assert chosen["throughput_tok_s"] == 150e3
    assert chosen["ttft_ms"] == {"p50": 150.0}  # the whole pass, not a mix of passes
    assert chosen["passes_tok_s"] == [150e3, 90e3, 180e3]  # in the order they ran
    assert stream.median_pass([_run(1.0), _run(2.0)])["throughput_tok_s"] == 2.0  # the upper of two
    assert stream.median_pass([_run(7.0)])["passes_tok_s"] == [7.0]


@pytest.mark.parametrize("engine_process", [False, True], ids=["engine-thread", "engine-process"])
def test_run_seed_measures_several_bursts_on_one_engine(monkeypatch, engine_process):
    monkeypatch.setattr(stream, "seed_workload", small_seed_workload)
    result = stream.run_seed("random:tiny", 3, {"device": "cpu", "engine_process": engine_process}, passes=3,
                             max_tokens=4)
    assert len(result["passes_tok_s"]) == 3 and all(t > 0 for t in result["passes_tok_s"])
    assert result["throughput_tok_s"] == sorted(result["passes_tok_s"])[1]
    assert result["completion_tokens"] == 3 * 4  # one burst's tokens, not the three passes' sum
    assert result["engine_process"] is engine_process
    assert result["ttft_ms"]["p50"] > 0 and result["tpot_ms"]["p50"] > 0
    assert result["started_unix"] < result["ended_unix"]
