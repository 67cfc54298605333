"""API processes of a Ray Serve engine replica: several processes write its streams, on its port.

Why: an API process spends microseconds of CPU per streamed token. At 128 streams and a
sub-millisecond engine step one process cannot write every stream every step and sends
several steps per write, so clients see tokens in bursts. `roseray serve --api-processes
N` (openai_api/api_processes.py) spreads the writing over N processes with SO_REUSEPORT. A
Serve replica is one actor whose HTTP server Serve starts itself, after the constructor, on
a port the controller allocates, without SO_REUSEPORT; and in that actor every request
crosses from Serve's loop to the user code's. So N API processes take over that server's
listening socket: once the controller lists the replica's port (`wiring.own_http_port`,
replica_port.py), the replica finds the socket among its file descriptors and hands it to N processes
(replica_api_worker.py, subprocess pass_fds). When all of them serve, the replica closes its
own copy of the socket (`wiring.close_serve_listener`): from then on the N processes accept
every connection from the one queue (each goes to whichever process accepts it first).

One replica with api_processes=N:

    replica actor: the app (index 0: Serve's fallback proxy path, and every connection
      |            until the API processes serve), record_routing_stats, check_health
      |- engine child (engine_loop.py serve_clients: one pipe pair per API process, and the actor's)
      |- API processes 1..N: the same app and ticket check; /-/healthz as Serve answers it

Request metrics are shared (metrics_share.py): /metrics from any process counts them all.
Until the API processes serve (a few seconds after the replica starts) the replica's own
server takes every connection, and HAProxy may keep those it opened then for later requests.

What a request on an API process does not get: Serve's per-request wrapper (Serve's ingress
metrics, http_options.request_timeout_s, Serve's count of the replica's ongoing requests;
roseray's Router ranks by the engine's own stats, which count every request, while Ray's
power_of_two policy sees only the actor's share).

Shutdown: when Serve stops the replica, the app's lifespan sends SIGTERM to the API
processes, which drain as `roseray serve` does, drains its own requests, waits for them,
then for the engine child (which exits after its last client). If the actor's process dies,
the API processes' lifeline pipe ends and they drain and stop; the engine child follows.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import select
import shutil
import signal
import subprocess
import tempfile
import threading
import time

from roseray.openai_api.api_processes import APIProcessSettings, Supervisor, spawn_api_worker
from roseray.openai_api.api_worker import connect_async_engine
from roseray.ray_serve import wiring
from roseray.ray_serve.replica_port import TIMEOUT_S, listening_socket_fd, wait_until_listed
from roseray.runtime.async_engine import AsyncLLMEngine
from roseray.runtime.engine_process import spawn_engine_process

logger = logging.getLogger(__name__)

WORKER_MODULE = "roseray.ray_serve.replica_api_worker"


def start_shared_engine(settings: APIProcessSettings, *, app_name: str) -> tuple[AsyncLLMEngine, ReplicaAPIProcesses]:
    """Start the engine child with a client for the replica and one for each of
    `settings.server.api_processes` API processes; the replica's AsyncLLMEngine (client 0, not
    started) and the API processes (not started), which get `settings`."""
    config, server = settings.engine, settings.server
    engine_process, pipes = spawn_engine_process(config, server.api_processes + 1)
    try:
        engine = connect_async_engine(config, *pipes[0], stuck_after_s=server.stuck_after_s)
    except BaseException:
        engine_process.kill()
        engine_process.wait()
        for commands_fd, outputs_fd in pipes[1:]:
            os.close(commands_fd)
            os.close(outputs_fd)
        raise
    processes = ReplicaAPIProcesses(engine_process, pipes[1:], settings, app_name=app_name,
                                    metrics_dir=tempfile.mkdtemp(prefix="roseray-metrics-"))
    return engine, processes


class ReplicaAPIProcesses:
    """The API processes of one engine replica (see the module docstring). The replica keeps
    client 0 of `engine_process` for itself; `pipes` are clients 1..N, one per API process."""

    def __init__(self, engine_process: subprocess.Popen, pipes: list[tuple[int, int]], settings: APIProcessSettings,
                 *, app_name: str, metrics_dir: str) -> None:
        self.engine_process = engine_process
        self.workers: list[subprocess.Popen] = []
        self.error: str | None = None  # why they could not start
        self.app_name = app_name
        self.metrics_dir = metrics_dir
        self.drain_timeout_s = settings.server.drain_timeout_s
        self._pipes = pipes
        self._settings = settings
        self._lifeline_r, self._lifeline_w = os.pipe()  # the workers stop when the write end closes
        self._lock = threading.Lock()
        self._stopping = False
        self._thread = threading.Thread(target=self._start_when_listed, name="roseray-api-processes", daemon=True)

    def start(self) -> None:
        """Start the API processes once Serve's server listens (in a thread: that is after
        the replica's constructor returns)."""
        self._thread.start()

    def check(self) -> None:
        """Raise (Serve's check_health: the replica is replaced) if an API process or the
        engine child has died, or the API processes could not start."""
        if self.error is not None:
            raise RuntimeError(f"the replica's API processes did not start: {self.error}")
        if self.engine_process.poll() is not None:
            raise RuntimeError(f"the engine process exited with code {self.engine_process.returncode}")
        for index, worker in enumerate(self.workers, start=1):
            if worker.poll() is not None and not self._stopping:
                raise RuntimeError(f"API process {index} (pid {worker.pid}) exited with code {worker.returncode}")

    def around_lifespan(self, lifespan):
        """Wrap the app's lifespan: on shutdown, start the API processes' drain before the
        replica's own, then wait for them and for the engine child."""
        @contextlib.asynccontextmanager
        async def wrapped(app):
            async with lifespan(app) as state:
                yield state
                self._signal_stop()
            await asyncio.to_thread(self._wait_stopped)
        return wrapped

    # ---- internals ---------------------------------------------------------------------------
    def _start_when_listed(self) -> None:
        try:
            port = wait_until_listed(lambda: wiring.own_http_port(self.app_name), lambda: self._stopping)
            if port is None:
                return
            socket_fd = listening_socket_fd(port)
            deadline = time.monotonic() + TIMEOUT_S
            ready = []
            with self._lock:
                index = 0
                while self._pipes and not self._stopping:
                    commands_fd, outputs_fd = self._pipes.pop(0)  # spawn_api_worker closes them
                    ready_r, ready_w = os.pipe()
                    ready.append(ready_r)
                    index += 1
                    self.workers.append(spawn_api_worker(WORKER_MODULE, index, socket_fd, commands_fd, outputs_fd,
                                                         self._lifeline_r, self.metrics_dir, self._settings,
                                                         ready_fd=ready_w))
            self._wait_ready(ready, deadline)
            if self._stopping:
                return
            if wiring.close_serve_listener(port):
                logger.info("%d API processes serve this replica's port %d (pids %s)", len(self.workers), port,
                            " ".join(str(w.pid) for w in self.workers))
            else:
                logger.warning("%d API processes share this replica's port %d with Serve's own server, which "
                               "could not be closed (a Ray upgrade?)", len(self.workers), port)
        except Exception as error:  # noqa: BLE001 - reported by check_health
            self.error = repr(error)
            logger.error("the replica's API processes did not start: %r", error)
        finally:
            for commands_fd, outputs_fd in self._pipes:  # never handed over: the engine child drops those clients
                os.close(commands_fd)
                os.close(outputs_fd)
            self._pipes = []
            os.close(self._lifeline_r)

    def _wait_ready(self, ready_fds: list[int], deadline: float) -> None:
        """Until each API process has said that it serves (its ready pipe: one byte)."""
        try:
            for worker, fd in zip(self.workers, ready_fds):
                while not select.select([fd], [], [], 0.5)[0]:
                    if worker.poll() is not None:
                        raise RuntimeError(f"API process pid {worker.pid} exited with code {worker.returncode} "
                                           "before it served")
                    if self._stopping:
                        return
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"API process pid {worker.pid} did not serve in time")
                if os.read(fd, 1) != b"1":
                    raise RuntimeError(f"API process pid {worker.pid} failed to start")
        finally:
            for fd in ready_fds:
                os.close(fd)

    def _signal_stop(self) -> None:
        with self._lock:
            self._stopping = True
            for worker in self.workers:
                if worker.poll() is None:
                    worker.send_signal(signal.SIGTERM)  # each drains its own requests

    def _wait_stopped(self) -> None:
        self._signal_stop()
        supervisor = Supervisor(self.engine_process, self.workers, self.drain_timeout_s)
        supervisor.wait_workers()
        supervisor.wait_engine()  # the replica's own client has closed by now (the app's lifespan)
        os.close(self._lifeline_w)
        shutil.rmtree(self.metrics_dir, ignore_errors=True)
