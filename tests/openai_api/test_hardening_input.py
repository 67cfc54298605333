"""Bad input (issue 6): every malformed or out-of-range request is a 400 in the OpenAI error
shape naming its field (404 for an unknown model, 413 for an oversized body), none of them
reaches the engine, and a normal request is served afterwards with the KV accounting intact.

Served by uvicorn on loopback over random:tiny (max_model_len 128, vocabulary 512), so
the requests go through a real HTTP stack, chunked bodies included."""

import asyncio
import json
import socket

import httpx
import pytest

from roseray.config import EngineConfig
from tests.openai_api.helpers import MODEL, assert_openai_error, serving, wait_until_idle

MAX_MODEL_LEN = 128
VOCAB = 512  # random:tiny's byte-level vocabulary
MAX_LOGPROBS = 5  # the engine's max_logprobs, below SamplingParams' own cap of 20
MAX_BODY_BYTES = 64 * 1024
CHAT = [{"role": "user", "content": "x"}]


@pytest.fixture(scope="module")
def server():
    config = EngineConfig(model=MODEL, num_kv_blocks=64, max_model_len=MAX_MODEL_LEN, max_num_seqs=8,
                          max_logprobs=MAX_LOGPROBS)
    with serving(config, max_body_bytes=MAX_BODY_BYTES) as s:  # the app takes max_logprobs from the engine
        yield s


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=30) as c:
        yield c


def post_raw(client, path: str, body: bytes, content_type: str = "application/json") -> httpx.Response:
    return client.post(path, content=body, headers={"content-type": content_type})


# ---- the body itself ----------------------------------------------------------------------------------
@pytest.mark.parametrize("body,content_type,says", [
    (b'{"prompt": "x", "max_tokens": ', "application/json", "not valid JSON"),  # malformed JSON
    (b'{"prompt": "\xff\xfe caf\xe9"}', "application/json", "UTF-8"),  # not UTF-8
    (b"[1, 2, 3]", "application/json", "JSON object"),  # not an object
    (b'"a string"', "application/json", "JSON object"),
    (b"null", "application/json", "JSON object"),
    (b"42", "application/json", "JSON object"),
    (b"", "application/json", "empty"),
    (b"[" * 5_000 + b"]" * 5_000, "application/json", "not valid JSON"),  # nested past the parser's limit
    (b'{"prompt": "x"}', "text/plain", "application/json"),  # an object, but not sent as JSON
])
def test_a_body_that_is_no_json_object_is_400(client, body, content_type, says):
    for path in ("/v1/completions", "/v1/chat/completions"):
        error = assert_openai_error(post_raw(client, path, body, content_type), 400)
        assert error["type"] == "invalid_request_error" and says in error["message"], error


# ---- fields ---------------------------------------------------------------------------------------------
COMPLETION_CASES = [
    # missing or wrong-typed fields (types are strict: no "5" for 5, no "yes" for true)
    ({}, "prompt", "missing"),
    ({"prompt": {"text": "x"}}, "prompt", "valid"),
    ({"prompt": "x", "max_tokens": "5"}, "max_tokens", "integer"),
    ({"prompt": "x", "max_tokens": 2.5}, "max_tokens", "integer"),
    ({"prompt": "x", "stream": "yes"}, "stream", "boolean"),
    ({"prompt": "x", "temperature": "hot"}, "temperature", "number"),
    ({"prompt": "x", "model": 7}, "model", "string"),
    ({"prompt": "x", "stop_token_ids": "2"}, "stop_token_ids", "list"),
    ({"prompt": "x", "stream_options": 5}, "stream_options", "dictionary"),
    # numbers: NaN and infinities (Python's json parses them), ranges
    ({"prompt": "x", "temperature": float("nan")}, "temperature", "finite"),
    ({"prompt": "x", "top_p": float("inf")}, "top_p", "finite"),
    ({"prompt": "x", "presence_penalty": float("-inf")}, "presence_penalty", "finite"),
    ({"prompt": "x", "min_p": float("nan")}, "min_p", "finite"),
    ({"prompt": "x", "max_tokens": -1}, "max_tokens", "greater than or equal to 1"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
    ({"prompt": "x", "temperature": -0.5}, "temperature", "greater than or equal to 0"),
    ({"prompt": "x", "top_p": 0}, "top_p", "greater than 0"),
    ({"prompt": "x", "top_p": 1.5}, "top_p", "less than or equal to 1"),
    ({"prompt": "x", "top_k": -2}, "top_k", "greater than or equal to -1"),
    ({"prompt": "x", "presence_penalty": 2.5}, "presence_penalty", "less than or equal to 2"),
    ({"prompt": "x", "frequency_penalty": -2.01}, "frequency_penalty", "greater than or equal to -2"),
    ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty", "greater than 0"),
    ({"prompt": "x", "repetition_penalty": 2.5}, "repetition_penalty", "less than or equal to 2"),
    ({"prompt": "x", "min_tokens": -1}, "min_tokens", "greater than or equal to 0"),
    ({"prompt": "x", "max_tokens": 3, "min_tokens": 4}, "min_tokens", "max_tokens"),
    # stop strings
    ({"prompt": "x", "stop": ""}, "stop", "at least 1 character"),
    ({"prompt": "x", "stop": ["ok", ""]}, "stop.1", "at least 1 character"),
    ({"prompt": "x", "stop": [f"s{i}" for i in range(17)]}, "stop", "at most 16"),
    ({"prompt": "x", "stop_token_ids": [-1]}, "stop_token_ids.0", "greater than or equal to 0"),
    # prompts: out of the vocabulary, empty, batched, not Unicode
    ({"prompt": [1, VOCAB]}, "prompt", f"outside the vocabulary [0, {VOCAB})"),
    ({"prompt": [10**30]}, "prompt", "outside the vocabulary"),
    ({"prompt": [[5, -1]]}, "prompt.0.1", "greater than or equal to 0"),
    ({"prompt": ""}, "prompt", "empty"),
    ({"prompt": []}, "prompt", "empty"),
    ({"prompt": [[]]}, "prompt", "empty"),
    ({"prompt": ["a", "b"]}, "prompt", "batched"),
    ({"prompt": "a\ud800b"}, "prompt", "Unicode"),
    # n and logprobs over their limits (the engine's max_logprobs, then the hard cap)
    ({"prompt": "x", "n": 2}, "n", "less than or equal to 1"),
    ({"prompt": "x", "n": 0}, "n", "greater than or equal to 1"),
    ({"prompt": "x", "logprobs": MAX_LOGPROBS + 1}, "logprobs", f"at most {MAX_LOGPROBS}"),
    ({"prompt": "x", "logprobs": 21}, "logprobs", "less than or equal to 20"),
    ({"prompt": "x", "logprobs": -1}, "logprobs", "greater than or equal to 0"),
    # unsupported features are named, not ignored
    ({"prompt": "x", "echo": True}, "echo", "not supported"),
    ({"prompt": "x", "best_of": 2}, "best_of", "best_of"),
    ({"prompt": "x", "logit_bias": {"1": 5}}, "logit_bias", "not supported"),
]

CHAT_CASES = [
    ({}, "messages", "missing"),
    ({"messages": "hi"}, "messages", "list"),
    ({"messages": []}, "messages", "at least 1"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role", "user"),
    ({"messages": [{"content": "x"}]}, "messages.0.role", "missing"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content", "string"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages",
     "only text"),
    ({"messages": [{"role": "user", "content": "a\ud800"}]}, "messages", "Unicode"),
    ({"messages": CHAT, "max_completion_tokens": -5}, "max_completion_tokens", "greater than or equal to 1"),
    ({"messages": CHAT, "temperature": float("nan")}, "temperature", "finite"),
    ({"messages": CHAT, "logprobs": True, "top_logprobs": MAX_LOGPROBS + 1}, "top_logprobs",
     f"at most {MAX_LOGPROBS}"),
    ({"messages": CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs", "less than or equal to 20"),
    ({"messages": CHAT, "top_logprobs": 2}, "top_logprobs", "logprobs=true"),
    ({"messages": CHAT, "n": 3}, "n", "less than or equal to 1"),
    ({"messages": CHAT, "tools": [{"type": "function"}]}, "tools.0.function", "missing"),
    ({"messages": CHAT, "response_format": {"type": "xml"}}, "response_format", "json_schema"),
    ({"messages": CHAT, "tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice", "'g'"),
]


def _json(body: dict) -> bytes:
    return json.dumps(body).encode()  # allow_nan: NaN/Infinity as Python's json writes them


@pytest.mark.parametrize("body,param,says", COMPLETION_CASES)
def test_invalid_completion_fields_are_400_naming_the_field(client, body, param, says):
    error = assert_openai_error(post_raw(client, "/v1/completions", _json(body)), 400, param)
    assert says in error["message"], error


@pytest.mark.parametrize("body,param,says", CHAT_CASES)
def test_invalid_chat_fields_are_400_naming_the_field(client, body, param, says):
    error = assert_openai_error(post_raw(client, "/v1/chat/completions", _json(body)), 400, param)
    assert says in error["message"], error


# ---- lengths: the message states both numbers --------------------------------------------------------
@pytest.mark.parametrize("prompt_tokens,max_tokens", [(100, 29), (1, 10**30)])
def test_prompt_plus_max_tokens_beyond_max_model_len_states_both_numbers(client, prompt_tokens, max_tokens):
    body = {"prompt": [65] * prompt_tokens, "max_tokens": max_tokens}
    error = assert_openai_error(client.post("/v1/completions", json=body), 400)
    message = error["message"]
    assert f"prompt ({prompt_tokens} tokens)" in message and f"max_tokens ({max_tokens})" in message
    assert f"max_model_len ({MAX_MODEL_LEN})" in message


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": [65] * MAX_MODEL_LEN, "max_tokens": None}),
    ("/v1/completions", {"prompt": "y" * (MAX_MODEL_LEN + 50), "max_tokens": None}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "z" * 200}]}),  # max_tokens unset
])
def test_a_prompt_that_fills_max_model_len_is_400_even_without_max_tokens(server, client, path, body):
    """Left unset, max_tokens defaults to what the prompt leaves; a prompt that leaves nothing
    once killed the engine loop (its block table overflowed on the first step)."""
    error = assert_openai_error(client.post(path, json=body), 400)
    assert "tokens" in error["message"] and f"max_model_len ({MAX_MODEL_LEN})" in error["message"], error
    assert server.engine.is_ready and client.get("/health").status_code == 200


def test_a_prompt_that_fits_exactly_is_served(client):
    body = {"prompt": [65] * (MAX_MODEL_LEN - 4), "max_tokens": 4, "ignore_eos": True}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 4


def test_top_p_too_small_for_float32_is_served_as_the_top_token(client):
    """5e-324 is a valid top_p in (0, 1] but rounds to 0 in the sampler's float32; it used
    to end the request with an engine error (found by the schemathesis test)."""
    body = {"prompt": "abc", "max_tokens": 3, "top_p": 5e-324, "temperature": 1.0, "ignore_eos": True}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    greedy = client.post("/v1/completions", json={**body, "top_p": 1.0, "temperature": 0}).json()
    assert response.json()["choices"][0]["text"] == greedy["choices"][0]["text"]  # only the top token is kept


# ---- model and size ------------------------------------------------------------------------------------
@pytest.mark.parametrize("path,body", [("/v1/completions", {"model": "gpt-17", "prompt": "x"}),
                                       ("/v1/chat/completions", {"model": "gpt-17", "messages": CHAT})])
def test_unknown_model_is_404(client, path, body):
    error = assert_openai_error(client.post(path, json=body), 404, "model")
    assert error["code"] == "model_not_found" and "gpt-17" in error["message"]


def test_a_body_over_the_limit_is_413_before_it_is_read(server, client):
    big = _json({"prompt": "x" * MAX_BODY_BYTES})
    error = assert_openai_error(post_raw(client, "/v1/completions", big), 413)
    assert str(MAX_BODY_BYTES) in error["message"] and error["code"] == "request_too_large"
    # chunked (no content-length): refused as soon as it passes the limit
    def chunks():
        yield b'{"prompt": "'
        for _ in range(2 * MAX_BODY_BYTES // 4096):
            yield b"x" * 4096
        yield b'"}'

    response = client.post("/v1/chat/completions", content=chunks(), headers={"content-type": "application/json"})
    assert_openai_error(response, 413)
    # a declared length over the limit is refused without waiting for the body
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n{" % (10 * MAX_BODY_BYTES))
        head = sock.recv(4096)
    assert head.startswith(b"HTTP/1.1 413"), head[:200]
    # just under the limit is fine (a 400 here: the prompt is longer than max_model_len)
    near = _json({"prompt": "x" * (MAX_BODY_BYTES - 100)})
    assert len(near) <= MAX_BODY_BYTES
    assert_openai_error(post_raw(client, "/v1/completions", near), 400, "prompt")


# ---- nothing else is disturbed -------------------------------------------------------------------------
def test_after_all_the_bad_input_a_normal_request_is_served_and_the_kv_is_intact(server, client):
    before = server.engine.stats
    for body, _, _ in COMPLETION_CASES[:10]:
        post_raw(client, "/v1/completions", _json(body))
    assert server.engine.stats.prompt_tokens_total == before.prompt_tokens_total  # none reached the engine
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    for path, payload in (("/v1/completions", body),
                          ("/v1/chat/completions", {**body, "messages": CHAT, "prompt": None})):
        response = client.post(path, json={k: v for k, v in payload.items() if v is not None})
        assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 6
    idle = wait_until_idle(server.engine)
    counts = asyncio.run(server.engine.check_integrity())
    assert counts["num_free_blocks"] == counts["num_total_blocks"] == idle.num_total_blocks
    assert client.get("/health").status_code == 200 and client.get("/ready").status_code == 200
