"""Structured outputs under load, against any OpenAI-compatible server (roseray or vLLM).

    python -m roseray.bench structured --base-url http://127.0.0.1:8000 --concurrency 64 256

For each concurrency level, a closed loop of that many clients sends chat completions with a
`json_schema` response format (SCHEMA: a fixed-size array of records, so every output has
about the same length and ends by the grammar), then the same requests unconstrained, each with
`max_tokens` set to its own constrained completion's length and `ignore_eos`, so both runs
generate the same tokens per request and their closed loops the same tail (with every request
at the mean length instead, the constrained run's spread of lengths alone made its last clients
straggle: 3-5% of "cost" in a simulation of W-json's lengths). Reported per run: output tok/s
(from the usage the server returns, over the wall time), requests completed, the completion
lengths, and for constrained runs how many outputs parse and validate against the schema (checked
after the run's clock stops: in the loop, the client's own work delayed its next requests). The
cost of the constraint is 1 - constrained tok/s / unconstrained tok/s. From a roseray server's
/metrics, each run also reports its engine's steps, tokens a step, ms a step (the step's own host
work and the device time it waits on) and ms a step sending outputs, and how busy the engine was.
`--compact` sends vLLM's
`structured_outputs: {"json": ..., "disable_any_whitespace": true}` instead of a response
format (the JSON has no free whitespace). One JSON line per run on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import ssl
import time

import httpx
import jsonschema
from tqdm import tqdm

RECORD = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 0, "maximum": 9999},
    "name": {"type": "string", "minLength": 8, "maxLength": 8},
    "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 2, "maxItems": 2},
    "ok": {"type": "boolean"}}, "required": ["id", "name", "tags", "ok"], "additionalProperties": False}
SCHEMA = {"type": "object", "properties": {"records": {"type": "array", "items": RECORD, "minItems": 8, "maxItems": 8}},
          "required": ["records"], "additionalProperties": False}
PROMPT = "List eight inventory records as JSON: id, an eight-letter name, two colour tags and a status. Request {i}."
TIMEOUT_S = 600.0
# a roseray server's engine counters (/metrics), read around each run: where its time went
ENGINE_COUNTERS = {"steps": "roseray:engine_steps_total", "step_s": "roseray:engine_step_seconds_total",
                   "output_s": "roseray:engine_output_seconds_total", "tokens": "roseray:generation_tokens_total"}
SAMPLE_CHARS = 160  # of one output, in each run's line: what the server generated


def _body(args, i: int, constrained: bool, max_tokens: int) -> dict:
    body = {"model": args.model, "messages": [{"role": "user", "content": PROMPT.format(i=i)}],
            "temperature": args.temperature, "max_tokens": max_tokens}
    if not constrained:
        body["ignore_eos"] = True
    elif args.compact:
        body["structured_outputs"] = {"json": SCHEMA, "disable_any_whitespace": True}
    else:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "records", "schema": SCHEMA,
                                                                          "strict": True}}
    return body


async def run_level(args, concurrency: int, constrained: bool, max_tokens: list[int]) -> tuple[dict, dict[int, int]]:
    """One closed-loop run: `concurrency` clients, `args.requests_per_client` requests each;
    request i asks for max_tokens[i]. (The run's row, each completed request's completion tokens.)"""
    num_requests = concurrency * args.requests_per_client
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(num_requests):
        queue.put_nowait(i)
    results: list[dict] = []
    label = f"{'json' if constrained else 'free'} x{concurrency}"
    # a client (and connection) per worker: httpx's shared pool scans every connection for each
    # request, which at 256 connections kept the client itself from sending at the closed loop's pace
    # (one TLS context for all: httpx makes one per client otherwise, ~50 ms each)
    one, tls = httpx.Limits(max_connections=1, max_keepalive_connections=1), ssl.create_default_context()
    clients = [httpx.AsyncClient(base_url=args.base_url, timeout=TIMEOUT_S, limits=one, verify=tls)
               for _ in range(concurrency)]
    try:
        with tqdm(total=num_requests, desc=label, leave=False) as bar:
            async def worker(client: httpx.AsyncClient) -> None:
                while not queue.empty():
                    i = queue.get_nowait()
                    try:
                        response = await client.post("/v1/chat/completions",
                                                     json=_body(args, i, constrained, max_tokens[i]))
                    except httpx.HTTPError as error:  # counted as not completed, and the run goes on
                        results.append({"index": i, "status": 0, "error": f"{type(error).__name__}: {error}"})
                    else:
                        results.append({"index": i, **_result(response)})
                    bar.update()

            # every client connected before the clock starts, as a long-running app's are (opening 256
            # connections at once otherwise staggers the first requests' arrival over the run's start)
            await asyncio.gather(*[client.get("/v1/models") for client in clients])
            before = await _engine_counters(clients[0])
            started = time.monotonic()
            await asyncio.gather(*[worker(client) for client in clients])
            seconds = time.monotonic() - started
            after = await _engine_counters(clients[0])
    finally:
        await asyncio.gather(*[client.aclose() for client in clients])
    ok = [r for r in results if r["status"] == 200]
    failed = [r for r in results if r["status"] != 200]
    if constrained:  # checked once the clock stopped: the client's own work would delay its next requests
        validator = jsonschema.Draft202012Validator(SCHEMA)
        for r in ok:
            r["valid"] = _valid(validator, r["text"])
    lengths = {r["index"]: r["completion_tokens"] for r in ok}
    tokens = sum(lengths.values())
    row = {"constrained": constrained, "concurrency": concurrency, "requests": num_requests, "completed": len(ok),
            "valid": sum(r["valid"] for r in ok) if constrained else None,
            "finish_length": sum(r["finish_reason"] == "length" for r in ok),
            "output_tokens": tokens, "seconds": round(seconds, 3), "output_tok_s": round(tokens / seconds, 1),
            "mean_completion_tokens": round(tokens / max(len(ok), 1), 1),
            "completion_tokens_min_max": [min(lengths.values(), default=0), max(lengths.values(), default=0)],
            "engine": _engine_share(before, after, seconds),
            "sample": ok[0]["text"][:SAMPLE_CHARS] if ok else None,
            "first_error": failed[0]["error"][:SAMPLE_CHARS] if failed else None}
    return row, lengths


async def _engine_counters(client: httpx.AsyncClient) -> dict[str, float] | None:
    """The server's ENGINE_COUNTERS, or None if it has none (not roseray, or no /metrics)."""
    try:
        response = await client.get("/metrics")
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    values = {}
    for line in response.text.splitlines():
        name, _, value = line.partition("{")
        for key, metric in ENGINE_COUNTERS.items():
            if name == metric:
                values[key] = float(value.rsplit(" ", 1)[-1])
    return values if len(values) == len(ENGINE_COUNTERS) else None


def _engine_share(before: dict | None, after: dict | None, seconds: float) -> dict | None:
    """Over one run: the engine's steps, tokens a step (its mean batch), ms a step, ms a step spent
    handing outputs to the API processes, and the share of the wall time it was doing either."""
    if before is None or after is None or after["steps"] <= before["steps"]:
        return None
    delta = {key: after[key] - before[key] for key in ENGINE_COUNTERS}
    steps = delta["steps"]
    return {"steps": int(steps), "tokens_per_step": round(delta["tokens"] / steps, 1),
            "ms_per_step": round(delta["step_s"] / steps * 1e3, 3),
            "output_ms_per_step": round(delta["output_s"] / steps * 1e3, 3),
            "busy": round((delta["step_s"] + delta["output_s"]) / seconds, 3)}


def _result(response: httpx.Response) -> dict:
    if response.status_code != 200:
        return {"status": response.status_code, "error": response.text[:300]}
    body = response.json()
    choice = body["choices"][0]
    return {"status": 200, "completion_tokens": body["usage"]["completion_tokens"],
            "finish_reason": choice["finish_reason"], "text": choice["message"]["content"] or ""}


def _valid(validator: jsonschema.protocols.Validator, text: str) -> bool:
    try:
        validator.validate(json.loads(text))
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


async def run(args) -> list[dict]:
    rows = []
    warm_up = min(args.concurrency)
    await run_level(args, warm_up, True, [args.max_tokens] * warm_up * args.requests_per_client)  # compile, caches
    for concurrency in args.concurrency:
        num_requests = concurrency * args.requests_per_client
        constrained, lengths = await run_level(args, concurrency, True, [args.max_tokens] * num_requests)
        mean = max(1, round(constrained["mean_completion_tokens"]))  # for a request that failed
        free, _ = await run_level(args, concurrency, False, [lengths.get(i, mean) for i in range(num_requests)])
        for row in (constrained, free):
            row["server"] = args.label
            rows.append(row)
            print(json.dumps(row), flush=True)
        cost = 1 - constrained["output_tok_s"] / max(free["output_tok_s"], 1e-9)
        print(json.dumps({"server": args.label, "concurrency": concurrency, "constraint_cost": round(cost, 4)}),
              flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m roseray.bench structured", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server (no /v1)")
    parser.add_argument("--model", default=None, help="the model name to send (default: the server's first)")
    parser.add_argument("--label", default="server", help="a name for this server in the output")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[64, 256], help="clients at once, per run")
    parser.add_argument("--requests-per-client", type=int, default=2, help="requests each client sends per run")
    parser.add_argument("--max-tokens", type=int, default=1024, help="the constrained requests' max_tokens")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--compact", action="store_true",
                        help="vLLM's structured_outputs with disable_any_whitespace instead of response_format")
    args = parser.parse_args(argv)
    if args.model is None:
        args.model = httpx.get(f"{args.base_url}/v1/models", timeout=30).json()["data"][0]["id"]
    asyncio.run(run(args))
    return 0
