"""Load test of roseray's OpenAI API: TTFT, ITL, TPOT and E2E per replica under open-loop load.

    locust -f locustfile.py --headless -H http://127.0.0.1:8000 -u 64 -r 64 -t 60s \\
        --request-rate 4 --prompt-tokens 128:512 --output-tokens 64:256 --report-dir locust-report

Each request streams /v1/completions (or /v1/chat/completions with --api chat) with
stream_options.include_usage and continuous usage stats, and reads the SSE body as it
arrives. The `x-roseray-replica` response header names the engine replica; every good
request fires locust events per replica and for "all replicas": TTFT, TPOT, E2E and one
ITL event per gap between content chunks. Failures (an HTTP error, a stream with no token,
a stream cut before [DONE], no usage, a short output under ignore_eos) are locust failures
with their reason.

Arrivals: --arrival poisson (default) sends requests at Poisson times of --request-rate
per second, shared by all users and all --processes; -u only caps how many are in flight
(set it above rate x E2E). --arrival closed: each user sends its next request as soon as
the previous one ends. Request k's arrival time, prompt and output length depend only on
--seed and k; --long-prompt-every N gives every N-th request a long prompt (a skewed mix).

At the end (test stop) locust's processes send their exact samples to the master, and
the master (or the single process) writes <report-dir>/summary.json, itl_cdf.png and
itl_over_time.png (see roseray/bench/locust_report.py). Requests in flight when the run
stops are allowed --drain-timeout seconds to finish, so long requests are not dropped.
`python -m roseray.bench.locust_report runs/*/summary.json` tabulates several runs.
"""

from __future__ import annotations

import json
import logging
import os
import time

import gevent
import psutil
from gevent.event import Event
from locust import HttpUser, events, task
from locust.runners import MasterRunner, WorkerRunner

from roseray.bench.load_shape import ClosedLoopIndex, PoissonArrivals, Workload, parse_range, resolve_prompt_style
from roseray.bench.locust_report import ClientMonitor, SampleBook, summarize, write_report
from roseray.bench.sse_stream import StreamResult, body_chunks, read_stream

logger = logging.getLogger("roseray.locust")

REPLICA_HEADER = "x-roseray-replica"
ALL = "all replicas"
FLUSH_PERIOD_S = 2.0  # workers send their samples to the master this often
MONITOR_PERIOD_S = 0.05  # event-loop lag probe; CPU is read every 10th probe


@events.init_command_line_parser.add_listener
def add_options(parser) -> None:
    add = parser.add_argument
    add("--api", choices=["completions", "chat"], default="completions",
        help="completions: POST /v1/completions; chat: POST /v1/chat/completions")
    add("--model", default="", help="the model id sent as \"model\" (default: none sent; the server's own)")
    add("--arrival", choices=["poisson", "closed"], default="poisson",
        help="poisson: open loop at --request-rate shared by all users; closed: back to back per user")
    add("--request-rate", type=float, default=1.0, help="requests per second, all users and processes together")
    add("--prompt-tokens", default="128:512", help="prompt length range MIN:MAX (uniform, inclusive) or N")
    add("--output-tokens", default="64:256", help="output length range MIN:MAX (max_tokens) or N")
    add("--prompt-style", choices=["auto", "ids", "words", "chars"], default="auto",
        help="ids: random token ids (completions only, exact length); words: random English words, about one "
             "token each in BPE vocabularies; chars: random characters, one token each for byte-level "
             "tokenizers (random:* models); auto: ids for completions, words for chat")
    add("--token-ids", default="0:255", help="token id range of the ids prompt style")
    add("--long-prompt-every", type=int, default=0,
        help="N > 0: every N-th request takes its prompt length from --long-prompt-tokens (a skewed mix)")
    add("--long-prompt-tokens", default="4096", help="prompt length range of those requests, MIN:MAX or N")
    add("--ignore-eos", choices=["on", "off"], default="on", help="on: every output has exactly max_tokens")
    add("--temperature", type=float, default=0.0, help="sampling temperature sent with each request")
    add("--continuous-usage", choices=["on", "off"], default="on",
        help="on: ask for usage in every chunk (exact tokens per chunk); off: count chunks with text")
    add("--extra-body", default="", help="JSON object merged into every request body, e.g. '{\"top_p\": 0.9}'")
    add("--api-key", default="", help="sent as Authorization: Bearer <key>")
    add("--seed", type=int, default=0, help="seed of arrival times, lengths and prompts")
    add("--warmup", type=float, default=0.0, help="seconds from the start whose requests are left out of the report")
    add("--drain-timeout", type=float, default=30.0,
        help="at stop, seconds that requests in flight get to finish (then they are dropped)")
    add("--read-timeout", type=float, default=300.0, help="seconds without a byte before a stream is cut")
    add("--report-dir", default="locust-report", help="where summary.json and the PNG plots are written")
    add("--itl-events", choices=["on", "off"], default="on",
        help="off: no locust event per ITL gap (saves client CPU; the report keeps every sample)")
    add("--save-samples", choices=["on", "off"], default="off", help="on: also write every sample to samples.npz")


class Run:
    """This process's state for the current test run."""

    def __init__(self) -> None:
        self.book = SampleBook()
        self.monitor = ClientMonitor("local")
        self.options = None
        self.workload: Workload | None = None
        self.extra_body: dict = {}
        self.arrivals: PoissonArrivals | ClosedLoopIndex | None = None
        self.plan = {"slot": 0, "num_slots": 1, "t0": time.time()}
        self.measure_start = 0.0
        self.stopping_at = 0.0
        self.draining = False
        self.in_flight = 0
        self.final_sent = False
        self.participants: list[str] = []  # master: the workers of this run
        self.finals: dict[str, dict] = {}  # master: worker id -> its monitor summary
        self.all_finals = Event()

    def configure(self, options) -> None:
        """Build the workload and schedule from the options and this process's plan."""
        self.options = options
        style = resolve_prompt_style(options.prompt_style, options.api)
        self.workload = Workload(options.seed, parse_range(options.prompt_tokens), parse_range(options.output_tokens),
                                 style, parse_range(options.token_ids, minimum=0), options.long_prompt_every,
                                 parse_range(options.long_prompt_tokens))
        if options.request_rate <= 0 or options.drain_timeout < 0 or options.warmup < 0:
            raise ValueError("--request-rate must be > 0, --drain-timeout and --warmup >= 0")
        self.extra_body = json.loads(options.extra_body) if options.extra_body else {}
        if not isinstance(self.extra_body, dict):
            raise ValueError("--extra-body must be a JSON object")
        slot, n = self.plan["slot"], self.plan["num_slots"]
        self.arrivals = (PoissonArrivals(options.request_rate, options.seed, slot, n) if options.arrival == "poisson"
                         else ClosedLoopIndex(slot, n))
        self.measure_start = self.plan["t0"] + options.warmup
        self.book = SampleBook()
        self.draining, self.in_flight, self.final_sent, self.stopping_at = False, 0, False, 0.0

    def claim(self) -> tuple[int, float | None]:
        """The next request index of this process and its due wall time (None: closed loop)."""
        if isinstance(self.arrivals, PoissonArrivals):
            k, offset = self.arrivals.next()
            return k, self.plan["t0"] + offset
        return self.arrivals.next(), None

    def drain(self, timeout_s: float) -> None:
        """Stop sending; wait (bounded) for the requests in flight."""
        self.draining = True
        deadline = time.monotonic() + timeout_s
        while self.in_flight and time.monotonic() < deadline:
            gevent.sleep(0.05)


RUN = Run()


def options_record(options) -> dict:
    names = ("api", "model", "arrival", "request_rate", "prompt_style", "ignore_eos", "temperature",
             "continuous_usage", "seed", "warmup", "drain_timeout", "extra_body", "num_users", "spawn_rate",
             "run_time", "processes", "host", "token_ids", "read_timeout", "long_prompt_every",
             "long_prompt_tokens")
    record = {name: getattr(options, name, None) for name in names}
    record["prompt_tokens"] = list(parse_range(options.prompt_tokens))
    record["output_tokens"] = list(parse_range(options.output_tokens))
    record["long_prompt_tokens"] = list(parse_range(options.long_prompt_tokens))
    record["prompt_style"] = resolve_prompt_style(options.prompt_style, options.api)
    return record


def request_body(shape, options, extra_body: dict) -> dict:
    body = {"max_tokens": shape.output_tokens, "stream": True, "temperature": options.temperature,
            "ignore_eos": options.ignore_eos == "on",
            "stream_options": {"include_usage": True, "continuous_usage_stats": options.continuous_usage == "on"}}
    if options.api == "chat":
        body["messages"] = [{"role": "user", "content": shape.prompt}]
    else:
        body["prompt"] = shape.prompt
    if options.model:
        body["model"] = options.model
    body.update(extra_body)
    return body


def http_error(response) -> StreamResult:
    """A StreamResult for a non-200 answer (status 0: no answer at all)."""
    status = response.status_code
    if status == 0:
        return StreamResult(status=0).fail("connection error", f"{type(response.error).__name__}: {response.error}")
    try:
        message = response.json()["error"]["message"]
    except Exception:  # noqa: BLE001 - any body: keep its start
        message = response.text[:200]
    reason = response.headers.get("X-Serve-Reason")  # HAProxy's, when Ray's ingress router failed
    detail = str(message)[:200] + (f" (X-Serve-Reason: {reason})" if reason else "")
    return StreamResult(status=status).fail(f"HTTP {status}", detail)


class OpenAIStreamUser(HttpUser):
    """One concurrent client. Open loop: between requests it waits for the next arrival of
    the shared Poisson schedule that no other user took yet."""

    def on_start(self) -> None:
        self.slot: tuple[int, float | None] | None = None

    def wait_time(self) -> float:
        if RUN.draining:
            return 3600.0  # stopping: wait to be stopped
        self.slot = RUN.claim()
        due = self.slot[1]
        return 0.0 if due is None else max(0.0, due - time.time())

    @task
    def stream_one(self) -> None:
        if self.slot is None:  # a user's first task runs before any wait_time
            self.slot = RUN.claim()
            if self.slot[1] is not None:
                gevent.sleep(max(0.0, self.slot[1] - time.time()))
        (k, due), self.slot = self.slot, None
        if RUN.draining:
            return
        self.send(k, due)

    def send(self, k: int, due: float | None) -> None:
        options, book = RUN.options, RUN.book
        shape = RUN.workload.shape(k)
        path = "/v1/chat/completions" if options.api == "chat" else "/v1/completions"
        headers = {"Content-Type": "application/json"}
        if options.api_key:
            headers["Authorization"] = f"Bearer {options.api_key}"
        payload = json.dumps(request_body(shape, options, RUN.extra_body), separators=(",", ":")).encode()
        sent_at = time.time()
        measured = sent_at >= RUN.measure_start
        if measured:
            book.on_sent(sent_at, None if due is None else sent_at - due)
        else:
            book.warmup_requests += 1
        RUN.in_flight += 1
        try:
            t_sent = time.perf_counter()
            with self.client.post(path, data=payload, headers=headers, stream=True, catch_response=True, name=path,
                                  timeout=(10.0, options.read_timeout)) as response:
                replica = response.headers.get(REPLICA_HEADER, "unknown")
                if response.status_code == 200:
                    result = read_stream(body_chunks(response.raw), t_sent,
                                         expected_tokens=shape.output_tokens if options.ignore_eos == "on" else None)
                else:
                    result = http_error(response)
                elapsed = result.e2e if result.ok else time.perf_counter() - t_sent
                response.request_meta["response_time"] = elapsed * 1e3
                if result.ok:
                    response.success()
                else:
                    response.failure(result.error)
                if response.raw is not None:
                    response.close()  # after a failed stream: drops the connection, so the server aborts
        finally:
            RUN.in_flight -= 1
        if not measured:
            return
        book.on_result(replica, sent_at, t_sent, result)
        if result.ok:
            self.fire_metrics(replica, result)

    def fire_metrics(self, replica: str, result: StreamResult) -> None:
        fire = self.environment.events.request.fire
        per_request = [("TTFT", result.ttft), ("E2E", result.e2e), ("TPOT", result.tpot)]
        for name in (replica, ALL):
            for kind, seconds in per_request:
                if seconds is not None:
                    fire(request_type=kind, name=name, response_time=seconds * 1e3, response_length=0,
                         exception=None, context={})
            if RUN.options.itl_events == "on":
                for gap in result.itl:
                    fire(request_type="ITL", name=name, response_time=gap * 1e3, response_length=0,
                         exception=None, context={})


# ---- the run's life cycle in each kind of process ------------------------------------------------

def monitor_loop(environment) -> None:
    """Sample this process's CPU use and event-loop lag while a test runs."""
    process = psutil.Process()
    process.cpu_percent(None)
    i = 0
    while True:
        t = time.perf_counter()
        gevent.sleep(MONITOR_PERIOD_S)
        if RUN.options is None or RUN.final_sent or time.time() < RUN.measure_start:
            continue  # measured: from the start of measurement to this process's end
        RUN.monitor.loop_lag.append(max(0.0, time.perf_counter() - t - MONITOR_PERIOD_S))
        i += 1
        if i % 10 == 0:
            RUN.monitor.cpu_percent.append(process.cpu_percent(None))


def send_samples(environment, final: bool) -> None:
    """Worker: send what was recorded since the last send (with `final`, the monitor too)."""
    data = {"final": final, "samples": RUN.book.drain()}
    if final:
        RUN.monitor.locust_cpu_warning = bool(environment.runner.cpu_warning_emitted)
        data["monitor"] = RUN.monitor.summary()
        RUN.final_sent = True
    environment.runner.send_message("roseray_samples", data)


def flush_loop(environment) -> None:
    while not RUN.final_sent:
        gevent.sleep(FLUSH_PERIOD_S)
        if not RUN.final_sent:
            send_samples(environment, final=False)


def on_plan(environment, msg, **_) -> None:  # worker, from the master before its users spawn
    RUN.plan = msg.data


def on_drain(environment, msg, **_) -> None:  # worker, from the master when the run stops
    if RUN.options is not None:  # None: this worker got no users, so no test started here
        RUN.drain(RUN.options.drain_timeout)
    if not RUN.final_sent:
        send_samples(environment, final=True)


def on_samples(environment, msg, **_) -> None:  # master, from each worker
    RUN.book.merge(msg.data["samples"])
    if msg.data["final"]:
        RUN.finals[msg.node_id] = msg.data["monitor"]
        if all(worker in RUN.finals for worker in RUN.participants):
            RUN.all_finals.set()


@events.init.add_listener
def on_init(environment, **_) -> None:
    runner = environment.runner
    if isinstance(runner, MasterRunner):
        runner.register_message("roseray_samples", on_samples)
        RUN.monitor = ClientMonitor("master")
    elif isinstance(runner, WorkerRunner):
        runner.register_message("roseray_plan", on_plan)
        runner.register_message("roseray_drain", on_drain, concurrent=True)
        RUN.monitor = ClientMonitor(f"worker pid {os.getpid()}")
    if environment.parsed_options is not None:
        try:  # a bad option fails here, before anything starts
            Run().configure(environment.parsed_options)
        except ValueError as error:
            logger.error("bad option: %s", error)
            raise SystemExit(2) from None
    gevent.spawn(monitor_loop, environment)


@events.test_start.add_listener
def on_test_start(environment, **_) -> None:
    runner, options = environment.runner, environment.parsed_options
    RUN.monitor = ClientMonitor(RUN.monitor.role)
    if isinstance(runner, MasterRunner):
        workers = runner.clients.ready + runner.clients.spawning + runner.clients.running
        RUN.participants = sorted(w.id for w in workers)
        RUN.finals, RUN.all_finals = {}, Event()
        t0 = time.time() + 0.2  # the plans reach the workers before their spawn messages
        if not RUN.participants:
            RUN.all_finals.set()
        for slot, worker in enumerate(RUN.participants):
            runner.send_message("roseray_plan", {"slot": slot, "num_slots": len(RUN.participants), "t0": t0},
                                client_id=worker)
        RUN.plan = {"slot": 0, "num_slots": 1, "t0": t0}
        if options.num_users and options.num_users < len(RUN.participants):
            logger.warning("fewer users (%d) than worker processes (%d): the arrivals of workers without users are "
                           "never sent", options.num_users, len(RUN.participants))
    elif not isinstance(runner, WorkerRunner):
        RUN.plan = {"slot": 0, "num_slots": 1, "t0": time.time()}
    try:
        RUN.configure(options)
    except ValueError as error:  # options changed in the web UI
        logger.error("bad option: %s; stopping", error)
        RUN.options = None
        gevent.spawn(runner.quit)
        return
    if isinstance(runner, WorkerRunner):
        gevent.spawn(flush_loop, environment)


@events.test_stopping.add_listener
def on_test_stopping(environment, **_) -> None:
    runner = environment.runner
    if isinstance(runner, WorkerRunner) or RUN.options is None:
        return
    RUN.stopping_at = time.time()
    if isinstance(runner, MasterRunner):
        for worker in RUN.participants:
            runner.send_message("roseray_drain", None, client_id=worker)
        if not RUN.all_finals.wait(RUN.options.drain_timeout + 10.0):
            logger.warning("final samples missing from worker(s): %s",
                           [w for w in RUN.participants if w not in RUN.finals])
    else:
        RUN.drain(RUN.options.drain_timeout)


@events.test_stop.add_listener
def on_test_stop(environment, **_) -> None:
    runner = environment.runner
    if RUN.options is None:
        return
    if isinstance(runner, WorkerRunner):
        if not RUN.final_sent:  # stopped without the master's drain message
            send_samples(environment, final=True)
        return
    RUN.final_sent = True  # stops the monitor
    if isinstance(runner, MasterRunner):
        RUN.monitor.locust_cpu_warning = bool(runner.cpu_warning_emitted)
        processes = [RUN.monitor.summary()] + [RUN.finals[w] for w in RUN.participants if w in RUN.finals]
        workers = {"expected": len(RUN.participants), "reported": len(RUN.finals),
                   "missing": [w for w in RUN.participants if w not in RUN.finals]}
    else:
        RUN.monitor.locust_cpu_warning = bool(runner.cpu_warning_emitted)
        processes, workers = [RUN.monitor.summary()], None
    summary = summarize(RUN.book, window=(RUN.measure_start, RUN.stopping_at or time.time()),
                        options=options_record(RUN.options), processes=processes, workers=workers)
    summary = write_report(RUN.book, RUN.options.report_dir, summary, save_samples=RUN.options.save_samples == "on")
    log_summary(summary)


def log_summary(summary: dict) -> None:
    def cell(stats, q):
        return f"{stats[q]:9.2f}" if stats else f"{'-':>9}"

    lines = [f"roseray report: {summary['files']['summary']}",
             f"{'replica':<28}{'reqs':>6} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>9} {'ITL p99':>9} "
             f"{'ITL p99.9':>9} {'TPOT p50':>9} {'E2E p99':>9}  (ms)"]
    for name, m in [*summary["replicas"].items(), ("all replicas", summary["total"])]:
        lines.append(f"{name[:27]:<28}{m['requests']:>6} {cell(m['ttft_ms'], 'p50')} {cell(m['ttft_ms'], 'p99')} "
                     f"{cell(m['itl_ms'], 'p50')} {cell(m['itl_ms'], 'p99')} {cell(m['itl_ms'], 'p99.9')} "
                     f"{cell(m['tpot_ms'], 'p50')} {cell(m['e2e_ms'], 'p99')}")
    total = summary["total"]
    if total["itl_zero_gaps"]["count"]:
        lines.append(f"{100 * total['itl_zero_gaps']['share']:.1f}% of ITL gaps are 0 (chunks that arrived together); "
                     f"tokens per chunk: mean {total['tokens_per_chunk']['mean']:.2f}")
    rate, tp = summary["request_rate"], summary["throughput"]
    lines.append(f"sent {rate['sent_per_s']:.2f} req/s (target {rate['target']}), {tp['output_tokens_per_s']:.1f} "
                 f"output tok/s, failures {summary['failures']['by_status'] or 0}, "
                 f"client CPU-bound: {summary['client']['cpu_bound']}, "
                 f"client timestamps late: {summary['client']['timestamps_late']}")
    failures = summary["failures"]
    lines.extend(f"failures: {n} x {reason}" for reason, n in failures["by_reason"].items())
    lines.extend(f"  e.g. {example}" for example in failures["examples"][:5])
    lines.extend(f"warning: {w}" for w in summary["warnings"])
    logger.info("\n".join(lines))
