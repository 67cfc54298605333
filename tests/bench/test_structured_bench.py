"""W-json's tools on CPU: the BPE tokenizer it writes spells JSON and loads through roseray's
loader, and the structured client against a real server measures valid constrained outputs."""

from __future__ import annotations

import asyncio
import contextlib
import json
from types import SimpleNamespace

import jsonschema
from fastapi import FastAPI, Request

from roseray.bench import json_tokenizer, structured
from roseray.config import EngineConfig
from roseray.models.loader import load_model_config
from roseray.tokenizer import load_tokenizer
from tests.models.hf_models import make_tiny_model
from tests.openai_api.helpers import serving, uvicorn_on_loopback


def test_json_tokenizer_spells_json_and_ends_both_engines_at_its_eos(tmp_path):
    path = make_tiny_model("qwen3", tmp_path / "m")
    size = json_tokenizer.write_tokenizer(path, vocab_size=600, max_bytes=300_000)
    assert 300 < size <= 600
    config = json.loads((path / "config.json").read_text())
    assert config["eos_token_id"] == 0
    tokenizer = load_tokenizer(str(path), load_model_config(str(path)))
    text = '{"records": [{"id": 1, "ok": true}]}'
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text
    assert tokenizer.eos_token_id == 0
    assert "<|im_start|>assistant" in tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])


def test_structured_client_measures_valid_outputs_against_a_server(capsys):
    config = EngineConfig(model="random:tiny", device="cpu", max_model_len=2048, num_kv_blocks=512)
    with serving(config) as server:
        rc = structured.main(["--base-url", server.url, "--concurrency", "2", "--requests-per-client", "2",
                              "--max-tokens", "1500", "--label", "cpu"])
    assert rc == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    constrained, free, cost = lines
    assert constrained["constrained"] and constrained["completed"] == constrained["valid"] == 4
    assert constrained["finish_length"] == 0 and constrained["sample"].startswith("{")
    assert not free["constrained"] and free["completed"] == 4 and free["finish_length"] == 4
    # each request runs free to its own constrained length: the same tokens, the same closed-loop tail
    assert free["mean_completion_tokens"] == constrained["mean_completion_tokens"]
    assert free["completion_tokens_min_max"] == constrained["completion_tokens_min_max"]
    assert "completion_tokens_by_request" not in constrained and "completion_tokens_by_request" not in free
    for run in (constrained, free):  # the engine's share, from roseray's /metrics
        engine = run["engine"]
        assert engine["steps"] > 0 and engine["ms_per_step"] > 0 and 0 < engine["busy"] <= 1.05
        assert 1 <= engine["tokens_per_step"] <= 2  # two clients at once
        assert engine["steps"] * engine["tokens_per_step"] >= run["output_tokens"] * 0.95
    assert cost["server"] == "cpu" and "constraint_cost" in cost


def test_structured_client_counts_only_outputs_that_parse_and_validate():
    validator = jsonschema.Draft202012Validator(structured.SCHEMA)
    record = {"id": 7, "name": "abcdefgh", "tags": ["red", "blue"], "ok": True}
    assert structured._valid(validator, json.dumps({"records": [record] * 8}, indent=2))
    assert not structured._valid(validator, json.dumps({"records": [record] * 7}))  # minItems 8
    assert not structured._valid(validator, json.dumps({"records": [{**record, "id": -1}] * 8}))
    assert not structured._valid(validator, '{"records": [')  # cut by max_tokens


def test_the_client_keeps_every_request_of_its_closed_loop_in_flight():
    """256 clients against a server that holds each request until all 256 are in (at most 10 s):
    all are in flight at once, each on its own connection (a shared httpx pool scans every
    connection per request: at 256 it kept at most 74 in flight)."""
    concurrency, hold_s = 256, 10.0
    in_flight, peak, peers, all_in = 0, 0, set(), None
    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"data": [{"id": "stub"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        nonlocal in_flight, peak, all_in
        body = await request.json()
        peers.add((request.client.host, request.client.port))
        in_flight += 1
        peak = max(peak, in_flight)
        all_in = all_in or asyncio.Event()  # made on the server's loop
        if in_flight == concurrency:
            all_in.set()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(all_in.wait(), hold_s)
        in_flight -= 1
        return {"choices": [{"finish_reason": "length", "message": {"content": "x"}}],
                "usage": {"completion_tokens": body["max_tokens"]}}

    with uvicorn_on_loopback(app) as port:
        args = SimpleNamespace(base_url=f"http://127.0.0.1:{port}", model="stub", temperature=1.0, compact=False,
                               requests_per_client=2)
        row, lengths = asyncio.run(structured.run_level(args, concurrency, False, [5] * (2 * concurrency)))
    assert row["completed"] == 2 * concurrency and row["output_tokens"] == 5 * 2 * concurrency
    assert len(lengths) == 2 * concurrency
    assert peak == concurrency and len(peers) == concurrency
