"""Starting and stopping `serve run serve_config.yaml` on one machine, with real Ray and HAProxy:
a stop leaves no process and frees the port, an idle stop is quick, `make stop` stops a server
started in the background."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from roseray.ray_serve.background import alive, haproxy_pids
from tests.ray_serve.serve_run import REPO, SMALL_ENGINE, ServeRun, port_is_free
from tests.waiting import wait_until

pytestmark = pytest.mark.ray

STOP_S = 45  # a stop with streams in flight: everything gone and the port free
IDLE_STOP_S = 5  # a stop with nothing in flight, from the signal to `serve run`'s exit
STARTUP_ANSWER_S = 60  # a POST during startup gets its answer (a 503 or a 200) within this


@pytest.fixture
def serve_run(tmp_path):
    run = ServeRun(tmp_path)
    try:
        yield run
    finally:
        run.cleanup()


class Stream(threading.Thread):
    """One streaming completion, read until it ends; `first` is set at its first event."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.first = threading.Event()
        self.finished_at: float | None = None
        self.done_event = False
        self.status: int | None = None
        self.events = 0
        self.error = ""

    def run(self) -> None:
        body = {"model": SMALL_ENGINE["model"], "prompt": "a long story", "max_tokens": 1000, "stream": True,
                "ignore_eos": True}
        try:
            with httpx.stream("POST", f"{self.url}/v1/completions", json=body, timeout=60) as reply:
                self.status = reply.status_code
                if reply.status_code != 200:
                    self.error = reply.read().decode(errors="replace")
                for line in reply.iter_lines():
                    if line.startswith("data: "):
                        self.events += 1
                        self.first.set()
                        self.done_event = self.done_event or line == "data: [DONE]"
        except httpx.HTTPError:
            pass  # the server went away mid-stream: expected here
        finally:
            self.finished_at = time.monotonic()
            self.first.set()


def test_sigterm_to_make_serve_mid_stream_stops_everything_and_frees_the_port(serve_run):
    """The signal goes to make, as `kill <make's pid>` or a supervisor sends it: make passes SIGTERM
    to its command only (a shell around `serve run` died and left it running), and `serve run`
    itself would exit at once on SIGTERM, cutting the streams: roseray.ray_serve.foreground turns
    it into Serve's graceful stop, whose drain ends the streams."""
    serve_run.start_make()
    serve_run.wait_serving()
    haproxy = haproxy_pids(serve_run.state_dir)
    assert haproxy, "no HAProxy of this run's directory is running"
    assert not port_is_free(serve_run.port)
    streams = [Stream(serve_run.url) for _ in range(2)]  # the KV cache holds two
    for stream in streams:
        stream.start()
    for stream in streams:
        assert stream.first.wait(60), "no stream started"
    signalled = time.monotonic()
    assert all(s.status == 200 for s in streams), [(s.status, s.error) for s in streams]
    assert any(s.finished_at is None for s in streams), \
        f"every stream ended before the stop: nothing in flight ({[s.events for s in streams]} events)"
    serve_run.signal_and_wait(signal.SIGTERM, STOP_S)
    assert "Got KeyboardInterrupt, shutting down" in serve_run.log(), "not Serve's graceful stop"
    for stream in streams:
        stream.join(10)
        assert stream.finished_at is not None, "a stream outlived the server"
    left = serve_run.wait_no_leftovers(max(0.0, STOP_S - (time.monotonic() - signalled)))
    assert not left, "still running after SIGTERM:\n" + "\n".join(left)
    assert port_is_free(serve_run.port), f"port {serve_run.port} is still taken"
    assert time.monotonic() - signalled <= STOP_S


def _startup_answer(url: str) -> tuple[str, int | None, dict, str]:
    """(what, status, headers, body) of one POST during startup; status None: no connection. The
    first request a replica serves can take over 10 s on a loaded 2-core CI machine (it did, in
    the whole suite's run): the probe waits for an answer, and the loop's deadline bounds it."""
    try:
        reply = httpx.post(f"{url}/v1/completions", timeout=STARTUP_ANSWER_S,
                           json={"model": SMALL_ENGINE["model"], "prompt": "hi", "max_tokens": 1})
    except httpx.ConnectError:
        return "refused", None, {}, ""
    return "answer", reply.status_code, dict(reply.headers), reply.text


def test_starting_answers_503_then_logs_ready_once_and_an_idle_stop_is_quick(serve_run):
    """While it starts, what answers is HAProxy (haproxy_env's wrapper: a 503 in the OpenAI error
    shape with Retry-After, where Ray answers a plain-text 404) or an engine (200); then one
    "roseray ready at" line. An idle SIGINT then ends `serve run` within IDLE_STOP_S."""
    serve_run.start()
    answers = []
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        assert serve_run.process.poll() is None, serve_run.log()[-4000:]
        answer = _startup_answer(serve_run.url)
        answers.append(answer)
        if answer[1] == 200:
            break
        time.sleep(0.1)  # sampling what clients get while it starts: the answers before the 200 are under test
    assert answers[-1][1] == 200, answers[-1]
    unavailable = [a for a in answers if a[0] == "answer" and a[1] != 200]
    assert unavailable, "HAProxy never answered before the app served (no 503 seen)"
    for _, status, headers, body in unavailable:
        assert status == 503, (status, body)
        assert headers.get("retry-after") == "1", headers
        assert set(json.loads(body)["error"]) == {"message", "type", "param", "code"}, body
    wanted = (f"roseray ready at {serve_run.url} (model {SMALL_ENGINE['model']}, 1 replicas, "
              f"KV capacity {SMALL_ENGINE['num_kv_blocks'] * SMALL_ENGINE['block_size']} tokens)")
    wait_until(lambda: wanted in serve_run.log(), timeout=60, interval=0.05, message=lambda: serve_run.log()[-3000:])
    assert serve_run.log().count("roseray ready at") == 1
    elapsed = serve_run.signal_and_wait(signal.SIGINT, 60)
    assert elapsed <= IDLE_STOP_S, f"an idle stop took {elapsed:.1f} s:\n{serve_run.log()[-3000:]}"
    assert "Controller failed to shut down" not in serve_run.log()
    left = serve_run.wait_no_leftovers(STOP_S)
    assert not left, "still running after SIGINT:\n" + "\n".join(left)
    assert port_is_free(serve_run.port)


def _background(serve_run, *args: str) -> subprocess.CompletedProcess:
    """`python -m roseray.ray_serve.background ...`, what `make serve-bg` / `make stop` run."""
    run_dir = str(serve_run.config.parent / "run")
    return subprocess.run([sys.executable, "-m", "roseray.ray_serve.background", "--run-dir", run_dir,
                           "--dir", serve_run.state_dir, *args], cwd=REPO, env=serve_run.env,
                          capture_output=True, text=True, timeout=120)


def test_make_stop_stops_a_background_server(serve_run):
    """`make serve-bg`, then `make stop` with a stream in flight."""
    started = _background(serve_run, "start", str(serve_run.config))
    assert started.returncode == 0, started.stderr
    pid_file = serve_run.config.parent / "run" / "serve.pid"
    serve_run.process = _Adopted(int(pid_file.read_text()))  # for leftovers() and cleanup()
    serve_run.log_path = serve_run.config.parent / "run" / "serve.log"
    serve_run.wait_serving()
    stream = Stream(serve_run.url)
    stream.start()
    assert stream.first.wait(60) and stream.status == 200, (stream.status, stream.error)
    assert stream.finished_at is None, "the stream ended before the stop: nothing in flight"
    began = time.monotonic()
    stopped = _background(serve_run, "stop")
    assert stopped.returncode == 0, stopped.stderr
    assert "stopped pid" in stopped.stdout
    left = serve_run.wait_no_leftovers(1)
    assert not left, "still running after `stop`:\n" + "\n".join(left)
    assert port_is_free(serve_run.port)
    assert time.monotonic() - began <= STOP_S
    assert not pid_file.exists()
    again = _background(serve_run, "stop")
    assert again.returncode == 0 and "nothing to stop" in again.stdout


class _Adopted:
    """A Popen-like view of a process this test did not start (the background `serve run`)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def poll(self) -> int | None:
        return None if alive(self.pid) else 0

    def wait(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
