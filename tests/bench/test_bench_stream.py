"""The W-seed measurement's own parts: several bursts with the median one reported, and
the engine process's CPU time and run-queue wait read from /proc."""

import asyncio
import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from roseray.bench import stream
from roseray.bench.common import cpu_and_wait_s, engine_cpu_use, involuntary_switches
from roseray.sampling_params import SamplingParams

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/PID/schedstat")


def _run(tok_s: float) -> dict:
    return {"throughput_tok_s": tok_s, "ttft_ms": {"p50": tok_s / 1e3}}


def test_median_pass_reports_the_middle_burst_and_every_burst():
    chosen = stream.median_pass([_run(150e3), _run(90e3), _run(180e3)])
    assert chosen["throughput_tok_s"] == 150e3
    assert chosen["ttft_ms"] == {"p50": 150.0}  # the whole pass, not a mix of passes
    assert chosen["passes_tok_s"] == [150e3, 90e3, 180e3]  # in the order they ran
    assert stream.median_pass([_run(1.0), _run(2.0)])["throughput_tok_s"] == 2.0  # the upper of two
    assert stream.median_pass([_run(7.0)])["passes_tok_s"] == [7.0]


@linux_only
def test_cpu_and_wait_s_counts_this_process_cpu_time():
    before = cpu_and_wait_s(os.getpid())
    deadline = time.process_time() + 0.05
    while time.process_time() < deadline:
        pass
    after = cpu_and_wait_s(os.getpid())
    assert after[0] - before[0] >= 0.03
    assert after[1] >= before[1] >= 0.0
    assert cpu_and_wait_s(2**22 + 12345) is None  # no such process


@linux_only
def test_engine_cpu_use_fills_its_dict_only_with_a_process():
    with engine_cpu_use(None) as nothing:
        pass
    assert nothing == {}
    with engine_cpu_use(os.getpid()) as found:
        deadline = time.process_time() + 0.03
        while time.process_time() < deadline:
            pass
    # (migrations where the kernel has /proc/PID/sched)
    assert set(found) - {"engine_process_migrations"} == {"engine_process_cpu_s", "engine_process_runqueue_wait_s",
                                                          "engine_process_involuntary_switches", "engine_process_last_cpu"}
    assert found["engine_process_cpu_s"] > 0.0 and found["engine_process_involuntary_switches"] >= 0
    assert found["engine_process_last_cpu"] in os.sched_getaffinity(0)


@linux_only
def test_involuntary_switches_counts_a_busy_process_taken_off_its_cpu():
    """Two spinning processes pinned to one CPU take it from each other."""
    spin = ("import os, time; os.sched_setaffinity(0, {%d}); print(flush=True); end = time.monotonic() + 3\n"
            "while time.monotonic() < end: pass" % min(os.sched_getaffinity(0)))
    spinners = [subprocess.Popen([sys.executable, "-c", spin], stdout=subprocess.PIPE) for _ in range(2)]
    try:
        for spinner in spinners:
            spinner.stdout.readline()  # pinned and spinning
        before = [involuntary_switches(p.pid) for p in spinners]
        time.sleep(0.5)
        after = [involuntary_switches(p.pid) for p in spinners]
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()
    assert sum(a - b for a, b in zip(after, before)) > 0
    assert involuntary_switches(2**22 + 12345) is None  # no such process


@linux_only
def test_run_seed_measures_several_bursts_on_one_engine_process(monkeypatch):
    # W-seed's prompt token is GPT-2's; the tiny preset's vocabulary is smaller
    def small_workload(num_requests, max_tokens):
        return ([[7] for _ in range(num_requests)],
                [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens) for _ in range(num_requests)])

    monkeypatch.setattr(stream, "seed_workload", small_workload)
    result = stream.run_seed("random:tiny", 3, {"device": "cpu", "engine_process": True}, passes=3, max_tokens=4)
    assert len(result["passes_tok_s"]) == 3
    assert result["throughput_tok_s"] == sorted(result["passes_tok_s"])[1]
    assert result["completion_tokens"] == 3 * 4  # one burst's tokens, not the three passes' sum
    assert result["engine_process"] is True
    assert result["engine_process_cpu_s"] > 0.0  # the child's, read while it served this pass
    assert result["engine_process_runqueue_wait_s"] >= 0.0


def _load_script(name: str):
    """scripts/<name>.py as a module."""
    path = Path(__file__).resolve().parents[2] / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _http_burst(tok_s: float) -> dict:
    ms = {"p50": 1.0, "p95": 1.0, "p99": 1.0}
    return {"throughput_tok_s": tok_s, "ttft_ms": ms, "itl_ms": ms, "tpot_ms": ms, "chunk_gap_ms": ms,
            "gaps_under_50us_fraction": 0.0, "events_per_chunk": 1.0}


@linux_only
def test_interleaved_comparison_pairs_each_http_burst_with_an_in_process_burst(monkeypatch, capsys):
    """Each HTTP burst is paired with an in-process burst on a real engine, the two taking
    turns at going first; the first pair warms both and is left out of the medians and the
    ratios."""
    module = _load_script("http_vs_inprocess")
    monkeypatch.setattr(stream, "seed_workload", lambda n, max_tokens: ([[7] for _ in range(n)], [
        SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens) for _ in range(n)]))
    order = []
    real_burst = stream.SeedEngine.burst

    def burst(self, timeline=False):
        order.append("in-process")
        return real_burst(self, timeline)

    monkeypatch.setattr(stream.SeedEngine, "burst", burst)
    http_tok_s = [1.0, 2.0, 3.0, 4.0]

    def fake_bursts(port, model, n, max_tokens, processes, passes, engine_pid, host=None, beside=None):
        assert host is not None  # the same HostCPU reads both sides' bursts
        for index, tok_s in enumerate(http_tok_s[:passes]):
            beside(index, False)
            started = time.time()
            order.append("http")
            ended = time.time()
            beside(index, True)  # the in-process burst runs next to the HTTP burst, before the server's reads
            yield {**_http_burst(tok_s), "host_cpu_ms": {"HAProxy": tok_s, "load generator": 10 * tok_s},
                   "started_unix": started, "ended_unix": ended}

    monkeypatch.setattr(module, "_bursts", fake_bursts)
    result = module.measure_interleaved(1, "random:tiny", 3, 4, 1, 4, None, {"device": "cpu"})
    assert order == ["http", "in-process", "in-process", "http"] * 2
    inproc = result["in_process"]["all_passes"]
    assert len(inproc) == 4 and all(run["completion_tokens"] == 3 * 4 for run in inproc)
    assert result["http"]["warm_passes"] == 3 and result["http"]["passes_tok_s"] == [2.0, 3.0, 4.0]
    assert result["in_process"]["passes_tok_s"] == [run["throughput_tok_s"] for run in inproc[1:]]
    expected = [h / i["throughput_tok_s"] for h, i in zip(http_tok_s[1:], inproc[1:])]
    assert result["pair_ratios"] == pytest.approx(expected)
    assert result["median_pair_ratio"] == pytest.approx(sorted(expected)[1])
    out = capsys.readouterr().out
    assert "pair 4/4: HTTP 4 tok/s" in out and "pairs: HTTP / in-process" in out
    assert 0 <= result["pair_gap_ms_median"] < 1000  # a pair's bursts are next to each other
    assert inproc[1]["engine_steps"] >= 4 and inproc[1]["engine_step_us"] > 0  # the engine's own time, per burst
    # every process's CPU by role, median over the warm bursts (a role a burst lacks counts 0)
    assert result["http_host_cpu_ms_median"] == {"load generator": 30.0, "HAProxy": 3.0, "all": 33.0}
    assert "host CPU per HTTP burst (median ms): load generator 30, HAProxy 3, all 33" in out
    if sys.platform.startswith("linux"):
        assert all(run["host_cpu_ms"]["benchmark process"] > 0 for run in inproc)  # the engine runs here on CPU
        assert "host CPU per in-process burst" in out


def test_engine_time_is_read_from_metrics_and_split_per_step():
    from roseray.bench.common import engine_time_from_metrics, engine_time_split

    page = ('# TYPE roseray:engine_steps_total counter\nroseray:engine_steps_total{model_name="m"} 110.0\n'
            'roseray:engine_step_seconds_total{model_name="m"} 0.5\n'
            'roseray:engine_output_seconds_total{model_name="m"} 0.05\n')
    after = engine_time_from_metrics(page)
    assert after == (110.0, 0.5, 0.05)
    assert engine_time_from_metrics("roseray:engine_steps_total{} 1\n") is None  # not all three
    split = engine_time_split((10.0, 0.1, 0.01), after)
    assert split["engine_steps"] == 100
    assert split["engine_step_us"] == pytest.approx(4000.0) and split["engine_output_us"] == pytest.approx(400.0)
    assert engine_time_split(None, after) == {} and engine_time_split(after, after) == {}


def test_server_request_times_are_read_from_histograms_and_averaged_per_burst():
    from roseray.bench.common import histogram_totals, server_time_split

    def page(ttft_sum, ttft_count, queue_sum):
        return ('# TYPE roseray:time_to_first_token_seconds histogram\n'
                'roseray:time_to_first_token_seconds_bucket{le="0.01",model_name="m"} 3.0\n'
                f'roseray:time_to_first_token_seconds_sum{{model_name="m"}} {ttft_sum}\n'
                f'roseray:time_to_first_token_seconds_count{{model_name="m"}} {ttft_count}\n'
                f'roseray:time_to_first_token_seconds_created{{model_name="m"}} 1.7e9\n'
                f'roseray:request_queue_time_seconds_sum{{model_name="m"}} {queue_sum}\n'
                f'roseray:request_queue_time_seconds_count{{model_name="m"}} {ttft_count}\n'
                'roseray:e2e_request_latency_seconds_sum{model_name="m"} 9.0\n'
                f'roseray:engine_message_delay_seconds_sum{{model_name="m"}} {ttft_count * 1e-4}\n'
                f'roseray:engine_message_delay_seconds_count{{model_name="m"}} {ttft_count * 2}\n')

    before, after = histogram_totals(page(0.5, 10, 0.1)), histogram_totals(page(0.9, 18, 0.14))
    assert before == {"roseray:time_to_first_token_seconds": (0.5, 10.0),
                      "roseray:request_queue_time_seconds": (0.1, 10.0),
                      "roseray:engine_message_delay_seconds": (pytest.approx(1e-3), 20.0)}  # the others left out
    split = server_time_split(before, after)
    assert split["server_ttft_mean_ms"] == pytest.approx(50.0) and split["server_queue_mean_ms"] == pytest.approx(5.0)
    assert split["message_delay_mean_ms"] == pytest.approx(0.05)  # 0.8 ms over 16 messages
    assert server_time_split(after, after) == {} and server_time_split({}, after) == {}
    assert histogram_totals("") == {}


def test_the_load_generator_counts_whole_events_however_the_reads_split_them():
    """http_vs_inprocess reads each stream in whatever pieces arrive (here from aiohttp's
    server, which frames a stream in chunks of its own): an event split across two reads
    counts once, when its end arrives; the usage event gives the token count."""
    from aiohttp import web
    from aiohttp.test_utils import TestServer

    module = _load_script("http_vs_inprocess")
    pieces = [b'data: {"id":"a","choices":[{"text":"x"}]}\n\ndata: {"id"', b':"a","choices":[{"text":"y"}]}\n',
              b'\ndata: {"id":"a","choices":[{"text":"z"}]}\n\n',
              b'data: {"id":"a","choices":[],"usage":{"completion_tokens":3}}\n\ndata: [DONE]\n\n']

    async def handler(request):
        response = web.StreamResponse(headers={"content-type": "text/event-stream", "x-roseray-replica": "r/api2"})
        await response.prepare(request)
        for piece in pieces:
            await response.write(piece)
            await asyncio.sleep(0.02)  # separate reads
        return response

    async def run():
        app = web.Application()
        app.router.add_post("/v1/completions", handler)
        async with TestServer(app) as server:
            connection = await module.StreamConnection.open(server.host, server.port)
            try:
                return await module._one(connection, module._request(server.port, "m", 3))
            finally:
                connection.close()

    sent, times, tokens, served_by = asyncio.run(run())
    assert tokens == 3 and served_by == "r/api2" and len(times) == 3
    assert sent <= times[0] < times[1] <= times[2]  # y is stamped when its end arrives, after x
