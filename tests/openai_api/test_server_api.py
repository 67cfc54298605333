"""The OpenAI HTTP API over the real engine (random:tiny), served by uvicorn on loopback:
completions and chat, streamed and whole, usage, logprobs, OpenAI-shaped errors
(400/401/404/429), disconnects freeing blocks, the replica header, /metrics."""

import json
import socket

import httpx
import pytest

from roseray.config import EngineConfig
from tests.openai_api.helpers import MODEL, REPLICA, assert_openai_error, serving, sse_events, wait_until_idle
from tests.waiting import wait_until


@pytest.fixture(scope="module")
def server():
    with serving(EngineConfig(model=MODEL, num_kv_blocks=64, max_model_len=512, max_num_seqs=8),
                 step_delay_s=0.002) as s:
        yield s


@pytest.fixture()
def client(server):
    with httpx.Client(base_url=server.url, timeout=30) as c:
        yield c


def test_completion_whole_and_streamed_agree_with_usage(server, client):
    body = {"model": MODEL, "prompt": "Hello, roseray", "max_tokens": 7, "temperature": 0, "ignore_eos": True}
    whole = client.post("/v1/completions", json=body)
    assert whole.status_code == 200 and whole.headers["x-roseray-replica"] == REPLICA
    result = whole.json()
    assert result["object"] == "text_completion" and result["model"] == MODEL
    num_prompt = len(server.tokenizer.encode("Hello, roseray"))
    assert result["usage"] == {"prompt_tokens": num_prompt, "completion_tokens": 7, "total_tokens": num_prompt + 7}
    assert result["choices"][0]["finish_reason"] == "length"

    streamed = client.post("/v1/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}})
    assert streamed.status_code == 200 and streamed.headers["content-type"].startswith("text/event-stream")
    assert streamed.headers["x-roseray-replica"] == REPLICA
    events = sse_events(streamed.text)
    assert all(e["usage"] is None for e in events[:-1])
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 7
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == result["choices"][0]["text"]
    assert events[-2]["choices"][0]["finish_reason"] == "length"


def test_chat_whole_and_streamed(client):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Hi there"}]
    body = {"model": MODEL, "messages": messages, "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    whole = client.post("/v1/chat/completions", json=body).json()
    assert whole["object"] == "chat.completion"
    message = whole["choices"][0]["message"]
    assert message["role"] == "assistant" and whole["usage"]["completion_tokens"] == 5

    events = sse_events(client.post("/v1/chat/completions", json={**body, "stream": True}).text)
    assert events[0]["object"] == "chat.completion.chunk"
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events) == message["content"]
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert all("usage" not in e for e in events)  # include_usage not asked


def test_logprobs_completion_and_chat(client):
    completion = client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 4, "logprobs": 3,
                                                      "ignore_eos": True}).json()
    logprobs = completion["choices"][0]["logprobs"]
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == len(logprobs["top_logprobs"]) == 4
    assert all(lp <= 0 for lp in logprobs["token_logprobs"])
    assert all(len(top) >= 3 for top in logprobs["top_logprobs"])
    assert "".join(logprobs["tokens"]) == completion["choices"][0]["text"]

    chat = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 3,
                                                     "logprobs": True, "top_logprobs": 2, "ignore_eos": True}).json()
    content = chat["choices"][0]["logprobs"]["content"]
    assert len(content) == 3
    assert all(len(c["top_logprobs"]) == 2 and c["logprob"] <= 0 for c in content)
    top = content[0]["top_logprobs"]
    assert top[0]["logprob"] >= top[1]["logprob"]


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": "x", "temperature": -1}, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 100_000}, None),
    ("/v1/completions", {"prompt": [10**6]}, "prompt"),
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": "x", "n": 2}, "n"),
    ("/v1/completions", {"prompt": ["a", "b"]}, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "many"}, "max_tokens"),
    ("/v1/completions", {}, "prompt"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True,
                              "top_logprobs": 99}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
     "tools.0.function"),
])
def test_invalid_requests_are_400_in_openai_shape(client, path, body, param):
    error = assert_openai_error(client.post(path, json=body), 400, param)
    assert error["type"] == "invalid_request_error"


def test_malformed_json_is_400(client):
    response = client.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert "JSON" in assert_openai_error(response, 400)["message"]


def test_unknown_model_and_route_are_404(client):
    error = assert_openai_error(client.post("/v1/completions", json={"model": "gpt-17", "prompt": "x"}), 404, "model")
    assert error["code"] == "model_not_found"
    assert_openai_error(client.get("/v1/models/gpt-17"), 404)
    assert_openai_error(client.get("/v2/nothing"), 404)


def test_models_health_ready(client):
    models = client.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL] and models["data"][0]["max_model_len"] == 512
    assert client.get(f"/v1/models/{MODEL}").json()["id"] == MODEL
    for path in ("/health", "/ready"):
        response = client.get(path)
        assert response.status_code == 200 and response.headers["x-roseray-replica"] == REPLICA


def test_streaming_disconnect_aborts_and_frees_blocks(server, client):
    engine = server.engine
    before = engine.stats.generation_tokens_total
    body = {"prompt": "a long one", "max_tokens": 450, "ignore_eos": True, "stream": True}
    with client.stream("POST", "/v1/completions", json=body) as response:
        lines = response.iter_lines()
        for _ in range(6):
            next(lines)
        assert engine.stats.num_running == 1
    # leaving the block closed the connection mid-stream
    generated = wait_until_idle(engine, timeout_s=0.5).generation_tokens_total - before
    assert generated < 450  # aborted, not run to the end


def test_whole_request_disconnect_aborts_and_frees_blocks(server):
    engine = server.engine
    before = engine.stats.generation_tokens_total
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        body = json.dumps({"prompt": "wait for me", "max_tokens": 450, "ignore_eos": True}).encode()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n%s" % (len(body), body))
        wait_until(lambda: engine.stats.generation_tokens_total >= before + 5, message="the request is generating")
    generated = wait_until_idle(engine, timeout_s=0.5).generation_tokens_total - before
    assert generated < 450  # aborted, not run to the end


def test_metrics_expose_vllm_style_names_after_traffic(client):
    client.post("/v1/completions", json={"prompt": "metrics", "max_tokens": 3, "ignore_eos": True})
    text = client.get("/metrics").text
    for name in ("roseray:time_to_first_token_seconds_bucket", "roseray:inter_token_latency_seconds_bucket",
                 "roseray:e2e_request_latency_seconds_count", "roseray:request_queue_time_seconds_count",
                 "roseray:num_requests_running", "roseray:num_requests_waiting", "roseray:kv_cache_usage_perc",
                 "roseray:prefix_cache_queries_total", "roseray:prefix_cache_hits_total",
                 "roseray:prompt_tokens_total", "roseray:generation_tokens_total",
                 "roseray:num_preemptions_total", 'roseray:request_success_total{finished_reason="length"'):
        assert name in text, name
    for name in ("roseray:e2e_request_latency_seconds_count", "roseray:request_queue_time_seconds_count",
                 "roseray:engine_steps_total", "roseray:engine_step_seconds_total"):
        count = next(line for line in text.split("\n") if line.startswith(name))
        assert float(count.split()[-1]) > 0, name
    # an engine in a thread of this process hands its outputs on in-process: no output time
    assert "roseray:engine_output_seconds_total{" in text


@pytest.fixture(scope="module")
def tiny_queue_server():
    config = EngineConfig(model=MODEL, num_kv_blocks=64, max_model_len=512, max_num_seqs=1, max_waiting_requests=1)
    with serving(config, step_delay_s=0.01, api_key="sesame",
                 request_guard=lambda request: "not routed" if "x-test-unrouted" in request.headers else None) as s:
        yield s


def test_api_key_guards_all_but_probes(tiny_queue_server):
    with httpx.Client(base_url=tiny_queue_server.url, timeout=30) as c:
        assert_openai_error(c.get("/v1/models"), 401)
        assert_openai_error(c.post("/v1/completions", json={"prompt": "x"}, headers={"authorization": "Bearer no"}),
                            401)
        assert_openai_error(c.get("/metrics"), 401)
        assert c.get("/health").status_code == 200 and c.get("/ready").status_code == 200
        assert c.get("/v1/models", headers={"authorization": "Bearer sesame"}).status_code == 200


def test_full_queue_is_429_with_retry_after_before_any_body(tiny_queue_server):
    auth = {"authorization": "Bearer sesame"}
    long = {"prompt": "x", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=tiny_queue_server.url, timeout=30, headers=auth) as c:
        with c.stream("POST", "/v1/completions", json=long) as running:
            lines = running.iter_lines()  # keep a reference: a collected iterator closes the stream
            next(lines)  # running: the one slot is taken
            with c.stream("POST", "/v1/completions", json=long) as waiting:
                assert waiting.status_code == 200  # admitted, waits in the queue
                refused = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
                error = assert_openai_error(refused, 429)
                assert error["code"] == "queue_full"
                assert int(refused.headers["retry-after"]) >= 1
    wait_until_idle(tiny_queue_server.engine)


def test_a_refused_request_guard_is_503_with_retry_after(tiny_queue_server):
    headers = {"authorization": "Bearer sesame", "x-test-unrouted": "1"}
    with httpx.Client(base_url=tiny_queue_server.url, timeout=30, headers=headers) as c:
        refused = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert assert_openai_error(refused, 503)["code"] == "not_routed"
        assert refused.headers["retry-after"] == "1"
        assert c.get("/v1/models").status_code == 200  # only generation is guarded
