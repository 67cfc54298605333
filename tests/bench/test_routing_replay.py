"""routing-replay: the simulator's workload sent to a real server (the OpenAI app over a tiny
random engine on the CPU), every request answered in full, the summary in routing-sim's keys,
and the comparison with the simulator's prediction."""

from __future__ import annotations

import json

from roseray.bench.routing_replay import compare, engine_replica
from roseray.bench.routing_replay import main as replay_main
from roseray.bench.routing_sim_cli import COLUMNS
from roseray.config import EngineConfig
from tests.openai_api.helpers import REPLICA, serving

KV_BLOCKS = 256


def test_replay_against_a_server_and_compare_with_the_simulator(tmp_path, capsys):
    out = tmp_path / "replay.json"
    config = EngineConfig(model="random:tiny", device="cpu", num_kv_blocks=KV_BLOCKS, max_model_len=512,
                          max_num_batched_tokens=256)
    with serving(config) as server:
        code = replay_main(["--url", server.url, "--vocab", "512", "--tenants", "2", "--prefix-tokens", "64",
                            "--suffix-tokens", "8:24", "--output-tokens", "3:6", "--qps", "6", "--duration", "2",
                            "--ramp", "0", "--warmup", "1", "--compare-sim", "--replicas", "1", "--policy",
                            "power_of_two", "--kv-blocks", str(KV_BLOCKS), "--max-num-batched-tokens", "256",
                            "--max-model-len", "512", "--out", str(out)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    result = json.loads(out.read_text())
    measured, simulated = result["measured"], result["simulated"]
    assert measured["requests"] >= 5 and measured["finished"] == measured["requests"]  # each got max_tokens
    assert measured["num_errors"] == 0 and measured["idle_ttft_ms"] > 0 and measured["replicas_seen"] == [REPLICA]
    assert {name for name, _ in COLUMNS} <= set(measured) and {name for name, _ in COLUMNS} <= set(simulated)
    assert simulated["requests"] == measured["requests"] and simulated["finished"] == simulated["requests"]
    assert 0 < measured["ttft_p50_s"] <= measured["ttft_p90_s"] and measured["output_tok_s"] > 0
    assert [r["metric"] for r in result["comparison"]][:2] == ["ttft_p50_s", "ttft_p90_s"]
    assert result["verdict"] in ("PASS", "FAIL") and "| ttft_p90_s |" in printed
    assert simulated["async_scheduling"] == "on" and simulated["server_latency_ms"] >= 0
    # the saved run compared again, no server: same measurement, the simulator with other options
    again = tmp_path / "again.json"
    assert replay_main(["--measured", str(out), "--async-scheduling", "off", "--out", str(again)]) == 0
    second = json.loads(again.read_text())
    assert second["measured"] == measured and second["args"]["qps"] == 6 and second["args"]["tenants"] == 2
    assert second["simulated"]["requests"] == measured["requests"]
    assert second["simulated"]["async_scheduling"] == "off" and "server latency" in capsys.readouterr().out


def test_load_spread_counts_engine_replicas_not_api_processes():
    assert engine_replica("Engine#ab12/api3") == "Engine#ab12" and engine_replica("test-replica-0") == "test-replica-0"


def test_compare_checks_ttft_p50_and_p90_only():
    measured = {"ttft_p50_s": 1.0, "ttft_p90_s": 2.0, "ttft_p99_s": 3.0, "itl_p99_ms": 10.0, "output_tok_s": 100.0}
    simulated = {**measured, "ttft_p50_s": 1.2, "ttft_p90_s": 1.4, "ttft_p99_s": 30.0}
    rows = {r["metric"]: r for r in compare(simulated, measured, 0.25)}
    assert rows["ttft_p50_s"]["check"] == "PASS" and rows["ttft_p90_s"]["check"] == "FAIL"
    assert rows["ttft_p99_s"]["check"] == "-" and abs(rows["ttft_p90_s"]["error"] + 0.3) < 1e-9
