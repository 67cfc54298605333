"""The serving comparison (python -m roseray.bench serving): the HTTP bursts from client
processes, the pairs' alternation with an in-process engine, and the figures it reports."""

import asyncio
import contextlib
import json
import threading
import time

import pytest
from aiohttp import web

from roseray import cli
from roseray.bench import serving, stream
from roseray.bench.serving_client import http_bursts, one_stream, seed_request
from roseray.bench.stream_connection import StreamConnection
from tests.bench.helpers import small_seed_workload


@contextlib.contextmanager
def completions_server(handler):
    """An aiohttp app answering POST /v1/completions with `handler` on a loopback port, in a
    thread of its own (client processes reach it over TCP); yields the port."""
    loop = asyncio.new_event_loop()
    listening = threading.Event()
    port: list[int] = []
    stop = asyncio.Event()

    async def main():
        app = web.Application()
        app.router.add_post("/v1/completions", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port.append(site._server.sockets[0].getsockname()[1])
        listening.set()
        await stop.wait()
        await runner.cleanup()

    thread = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
    thread.start()
    try:
        assert listening.wait(30), "the test server did not start"
        yield port[0]
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(30)


def fake_completions(requests: list):
    """A handler that streams `max_tokens` one-token events, then the usage event, and
    records each request's (max_tokens, arrival time)."""
    async def handler(request):
        body = await request.json()
        requests.append((body["max_tokens"], time.monotonic()))
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        for _ in range(body["max_tokens"]):
            await response.write(b'data: {"id":"a","choices":[{"text":"x"}]}\n\n')
            await asyncio.sleep(0.001)  # a server generating tokens: the behaviour the benchmark measures
        usage = {"id": "a", "choices": [], "usage": {"completion_tokens": body["max_tokens"]}}
        await response.write(f"data: {json.dumps(usage, separators=(',', ':'))}\n\ndata: [DONE]\n\n".encode())
        return response

    return handler


def test_http_bursts_start_each_burst_together_between_the_callers_hooks():
    """Two client processes share 3 streams; a burst's requests all arrive after the hook
    before it and before the hook after it, and only after every connection warmed up."""
    requests, hooks = [], []
    with completions_server(fake_completions(requests)) as port:
        bursts = list(http_bursts(port, "m", 3, 5, processes=2, passes=2,
                                  beside=lambda index, done: hooks.append((index, done, time.monotonic()))))
    assert [(index, done) for index, done, _ in hooks] == [(0, False), (0, True), (1, False), (1, True)]
    assert [count for count, _ in requests[:3]] == [2, 2, 2]  # the warm-up: one short request per connection
    timed = requests[3:]
    assert [count for count, _ in timed] == [5] * 6
    for index, (streams, started, ended) in enumerate(bursts):
        assert len(streams) == 3 and started < ended
        arrivals = [at for _, at in timed[3 * index:3 * index + 3]]
        assert hooks[2 * index][2] < min(arrivals) and max(arrivals) < hooks[2 * index + 1][2]
        for sent, event_times, tokens in streams:
            assert tokens == 5 and len(event_times) == 5 and sent < event_times[0]


def test_http_bursts_stop_at_once_when_the_server_refuses():
    async def refuse(request):
        return web.json_response({"error": {"message": "no"}}, status=503)

    started = time.monotonic()
    with completions_server(refuse) as port, pytest.raises(RuntimeError, match="client process failed"):
        list(http_bursts(port, "m", 2, 5, processes=1, passes=2))
    assert time.monotonic() - started < 60  # not the barrier's timeout


def test_the_load_generator_counts_whole_events_however_the_reads_split_them():
    """Each stream is read in whatever pieces arrive (here aiohttp frames it in chunks of its
    own): an event split across two reads counts once, when its end arrives; the usage event
    gives the token count."""
    pieces = [b'data: {"id":"a","choices":[{"text":"x"}]}\n\ndata: {"id"', b':"a","choices":[{"text":"y"}]}\n',
              b'\ndata: {"id":"a","choices":[{"text":"z"}]}\n\n',
              b'data: {"id":"a","choices":[],"usage":{"completion_tokens":3}}\n\ndata: [DONE]\n\n']

    async def handler(request):
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        for piece in pieces:
            await response.write(piece)
            await asyncio.sleep(0.02)  # separate reads: the behaviour under test
        return response

    async def run(port):
        connection = await StreamConnection.open("127.0.0.1", port)
        try:
            return await one_stream(connection, seed_request(port, "m", 3))
        finally:
            connection.close()

    with completions_server(handler) as port:
        sent, times, tokens = asyncio.run(run(port))
    assert tokens == 3 and len(times) == 3
    assert sent <= times[0] < times[1] <= times[2]  # y is stamped when its end arrives, after x


def test_summarize_reports_throughput_and_latencies_of_a_burst():
    # two streams sent at 0 and 0.1 s, events at these times, 3 and 2 tokens
    result = serving.summarize([(0.0, [0.5, 0.6, 0.8], 3), (0.1, [0.4, 1.0], 2)], 10.0, 11.0)
    assert result["completion_tokens"] == 5
    assert result["wall_s"] == pytest.approx(1.0)  # first send to last event
    assert result["throughput_tok_s"] == pytest.approx(5.0)
    assert result["ttft_ms"]["p50"] == pytest.approx(400.0)  # TTFTs 500 and 300 ms
    assert result["tpot_ms"]["p50"] == pytest.approx(375.0)  # per stream: 150 and 600 ms
    assert result["itl_ms"]["p50"] == pytest.approx(200.0)  # gaps 100, 200, 600 ms
    assert result["itl_ms"]["p99"] == pytest.approx(592.0)
    assert (result["started_unix"], result["ended_unix"]) == (10.0, 11.0)


def test_engine_flags_give_the_server_the_in_process_engines_config():
    assert serving.engine_flags({"max_num_seqs": 4, "enable_prefix_caching": False, "num_kv_blocks": 64,
                                 "dtype": None}) == ["--max-num-seqs", "4", "--no-enable-prefix-caching",
                                                     "--num-kv-blocks", "64"]
    with pytest.raises(ValueError, match="not_a_field"):
        serving.engine_flags({"not_a_field": 1})
    # as `roseray serve` reads them
    fields = {"max_num_seqs": 4, "enable_prefix_caching": False, "num_kv_blocks": 64, "device": "cpu",
              "enforce_eager": True, "gpu_memory_utilization": 0.5}
    parsed = vars(cli.build_parser().parse_args(["serve", "--model", "m", *serving.engine_flags(fields)]))
    assert {name: parsed[name] for name in fields} == fields


def test_pairs_alternate_which_side_goes_first_and_leave_the_first_pair_out(monkeypatch, capsys):
    """Each HTTP burst is paired with a burst on a real in-process engine, back to back, the
    two sides taking turns at going first; the first pair warms both and is left out of the
    medians and the ratios."""
    monkeypatch.setattr(stream, "seed_workload", small_seed_workload)
    order = []
    real_burst = stream.SeedEngine.burst

    def burst(self):
        order.append("in-process")
        return real_burst(self)

    monkeypatch.setattr(stream.SeedEngine, "burst", burst)
    http_tok_s = [1.0, 2.0, 3.0, 4.0]

    def fake_http_bursts(port, model, n, max_tokens, processes, passes, beside=None):
        for index, tok_s in enumerate(http_tok_s[:passes]):
            beside(index, False)
            order.append("http")
            beside(index, True)
            # n streams sent at 0, whose last events give tok_s
            yield [(0.0, [n * max_tokens / tok_s], max_tokens)] * n, 0.0, 0.0

    monkeypatch.setattr(serving, "http_bursts", fake_http_bursts)
    result = serving.measure_pairs(1, "random:tiny", 3, 4, 1, 4, {"device": "cpu"})
    assert order == ["http", "in-process", "in-process", "http"] * 2
    inproc = result["in_process"]["all_passes"]
    assert len(inproc) == 4 and all(run["completion_tokens"] == 3 * 4 for run in inproc)
    assert result["http"]["warm_passes"] == 3 and result["http"]["passes_tok_s"] == pytest.approx([2.0, 3.0, 4.0])
    assert result["http"]["throughput_tok_s"] == pytest.approx(3.0)
    assert result["in_process"]["passes_tok_s"] == [run["throughput_tok_s"] for run in inproc[1:]]
    expected = [h / i["throughput_tok_s"] for h, i in zip(http_tok_s[1:], inproc[1:])]
    assert result["pair_ratios"] == pytest.approx(expected)
    assert result["median_pair_ratio"] == pytest.approx(sorted(expected)[1])
    assert result["http_over_in_process"] == pytest.approx(3.0 / result["in_process"]["throughput_tok_s"])
    out = capsys.readouterr().out
    assert "pair 4/4: HTTP 4 tok/s" in out and "HTTP / in-process:" in out and "median of the pairs'" in out
