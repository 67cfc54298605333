"""The per-request timeline (roseray/server/request_trace.py) and its reader
(scripts/burst_timeline.py): off unless ROSERAY_REQUEST_TRACE_DIR is set; events written when
the process is idle; the server records when a request reached its app and was admitted; the
reader splits bursts into events and legs."""

import importlib.util
import json
import os
import time

import httpx
import pytest

from roseray.config import EngineConfig
from roseray.server import request_trace
from roseray.server.request_trace import RequestTrace
from tests.test_server_api import MODEL, serving

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _burst_timeline():
    spec = importlib.util.spec_from_file_location("burst_timeline", os.path.join(ROOT, "scripts", "burst_timeline.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _events(path: str) -> list:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f]


def _wait_for(path: str, count: int) -> list:
    deadline = time.monotonic() + 5
    while len(events := _events(path)) < count:
        assert time.monotonic() < deadline, f"{len(events)} of {count} events written"
        time.sleep(0.05)
    return events


def test_off_without_the_environment_variable(monkeypatch):
    monkeypatch.delenv(request_trace.ENV, raising=False)
    assert request_trace.from_env("anything-off") is None


def test_events_are_written_once_the_process_is_idle(tmp_path):
    trace = RequestTrace(str(tmp_path), "unit")
    trace.record("a", "client_sent", 1.0)
    trace.record("a", "admitted")
    assert _wait_for(trace.path, 2)[0] == ["a", "client_sent", 1.0]
    trace.record("b", "client_sent", 2.0)  # appended, the earlier ones not written again
    events = _wait_for(trace.path, 3)
    assert [e[0] for e in events] == ["a", "a", "b"] and events[1][1] == "admitted"


def test_the_server_records_arrival_and_admission_by_request_id(tmp_path, monkeypatch):
    monkeypatch.setenv(request_trace.ENV, str(tmp_path))
    monkeypatch.setattr(request_trace, "_traces", {})  # this process's trace starts now, in tmp_path
    config = EngineConfig(model=MODEL, num_kv_blocks=64, max_model_len=512, max_num_seqs=8)
    with serving(config) as server:
        before = time.monotonic()
        response = httpx.post(f"{server.url}/v1/completions", headers={"x-request-id": "c1-0-7"},
                              json={"model": MODEL, "prompt": [1, 2], "max_tokens": 2}, timeout=30)
        assert response.status_code == 200
        events = _wait_for(os.path.join(tmp_path, f"api-{os.getpid()}.jsonl"), 2)
    assert [(e[0], e[1]) for e in events] == [("c1-0-7", "api_received"), ("c1-0-7", "admitted")]
    assert before <= events[0][2] <= events[1][2] <= time.monotonic()


def test_the_timeline_splits_bursts_into_events_and_legs(tmp_path):
    timeline = _burst_timeline()
    lines = []
    for burst in range(3):
        start = 100.0 * burst
        for i in range(4):  # request i: every event 1 ms later per request, each leg i+1 ms long
            t = start + i * 1e-3
            for event in timeline.EVENTS:
                lines.append([f"c9-{burst}-{i}", event, t])
                t += (i + 1) * 1e-3
    lines.append(["c9-1-99", "client_sent", 100.0])  # no other event: left out
    lines.append(["abc", "admitted", 5.0])  # not the load generator's
    with open(tmp_path / "x-1.jsonl", "w") as f:
        f.writelines(json.dumps(line) + "\n" for line in lines)
    result = timeline.timeline(timeline.bursts(timeline.load(str(tmp_path))), skip=1)
    assert result["bursts"] == 2 and result["requests"] == 8
    # the last request (i=3) sends 3 ms after the first and its legs are 4 ms each
    assert result["at"]["router_accepted"] == (pytest.approx(5.0), pytest.approx(7.0))  # p50: the upper middle
    assert result["at"]["client_first_token"] == (pytest.approx(17.0), pytest.approx(23.0))
    assert result["legs"]["api_received -> admitted"] == (pytest.approx(3.0), pytest.approx(4.0), pytest.approx(4.0))
    assert timeline.main([str(tmp_path), "--json", str(tmp_path / "out.json")]) == 0
    assert json.loads((tmp_path / "out.json").read_text())["requests"] == 8
