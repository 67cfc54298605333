"""`roseray serve --api-processes N`: N API processes in front of one engine process.

Why: an API process spends microseconds of CPU per streamed token, most of it in the socket
write and the event loop's C code; at 128 streams and a sub-millisecond engine step one
process cannot write every stream every step, falls behind, and sends two steps per
write (clients see 2-token chunks). Several processes share the writing.

This process is a small supervisor. Before it starts anything it binds N listening
sockets to host:port with SO_REUSEPORT (bind errors surface at once; the kernel spreads
connections evenly over them). It then starts ONE engine child (engine_process.py) with a
pipe pair per API process, and N API processes (api_worker.py), each given its socket,
its pipe pair, a settings pipe (APIProcessSettings as JSON) and a lifeline pipe (subprocess
pass_fds: no pickle). It
forwards SIGTERM/SIGINT to the API processes (each drains its own requests), waits for
them, then for the engine child, which exits when its last client has gone. If an API
process or the engine child dies unexpectedly, it stops the rest and exits with 1; if the
supervisor itself dies, the lifeline ends and the API processes stop, then the engine.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from roseray.config import EngineConfig, ServerConfig
from roseray.openai_api.listen import bind_reuseport_sockets
from roseray.runtime.engine_process import spawn_engine_process

logger = logging.getLogger(__name__)

POLL_S = 0.1  # how often the supervisor looks at its children
ENGINE_EXIT_TIMEOUT_S = 10.0  # the engine child exits this soon after its last client


@dataclasses.dataclass
class APIProcessSettings:
    """What an API process is told through its settings pipe: JSON of these fields (no pickle;
    the API key and the ticket secret stay off the command line)."""

    engine: EngineConfig
    server: ServerConfig
    replica_name: str | None = None  # a Ray engine replica's API process: the replica's name
    ticket_secret: str | None = None  # a Ray engine replica's API process: the Router's ticket key

    def encode(self) -> bytes:
        return json.dumps(dataclasses.asdict(self)).encode()

    @classmethod
    def decode(cls, data: bytes) -> APIProcessSettings:
        fields = json.loads(data)
        return cls(engine=EngineConfig(**fields.pop("engine")), server=ServerConfig(**fields.pop("server")),
                   **fields)


def run_api_processes(engine_config: EngineConfig, config: ServerConfig) -> int:
    """Serve with `config.api_processes` API processes until SIGTERM/SIGINT; the exit code (0
    after a signal, 1 when a child died)."""
    sockets = bind_reuseport_sockets(config.host, config.port, config.api_processes)
    config = dataclasses.replace(config, port=sockets[0].getsockname()[1])  # port 0: the one the kernel picked
    metrics_dir = tempfile.mkdtemp(prefix="roseray-metrics-")
    engine, pipes = spawn_engine_process(engine_config, config.api_processes)
    lifeline_r, lifeline_w = os.pipe()  # the supervisor keeps the write end until it exits
    settings = APIProcessSettings(engine_config, config)
    workers = []
    try:
        for index, (sock, (commands_fd, outputs_fd)) in enumerate(zip(sockets, pipes)):
            workers.append(spawn_api_worker("roseray.openai_api.api_worker", index, sock.fileno(), commands_fd,
                                            outputs_fd, lifeline_r, metrics_dir, settings))
        os.close(lifeline_r)
        logger.info("%d API processes on %s:%d (pids %s), one engine process (pid %d)", config.api_processes,
                    config.host, config.port, " ".join(str(w.pid) for w in workers), engine.pid)
        return Supervisor(engine, workers, config.drain_timeout_s).run()
    finally:
        for sock in sockets:
            sock.close()
        for process in [*workers, engine]:
            if process.poll() is None:
                process.kill()
                process.wait()
        os.close(lifeline_w)
        shutil.rmtree(metrics_dir, ignore_errors=True)


def spawn_api_worker(module: str, index: int, socket_fd: int, commands_fd: int, outputs_fd: int, lifeline_fd: int,
                     metrics_dir: str, settings: APIProcessSettings, ready_fd: int | None = None) -> subprocess.Popen:
    """`python -m module` (api_worker.py, or ray_serve/replica_api_worker.py) given its listening
    socket, its engine pipe pair (closed here: the worker's now), the lifeline's read end,
    its settings (written to a pipe: no secrets on the command line) and, optionally, a
    pipe's write end (closed here) on which it says when it serves."""
    settings_r, settings_w = os.pipe()
    ready = () if ready_fd is None else (ready_fd,)
    fds = (socket_fd, commands_fd, outputs_fd, settings_r, lifeline_fd) + ready
    process = subprocess.Popen(
        [sys.executable, "-m", module, "--index", str(index), "--socket-fd", str(socket_fd),
         "--commands-fd", str(commands_fd), "--outputs-fd", str(outputs_fd), "--settings-fd", str(settings_r),
         "--lifeline-fd", str(lifeline_fd), "--metrics-dir", metrics_dir,
         *(("--ready-fd", str(ready_fd)) if ready else ())],
        pass_fds=fds, stdin=subprocess.DEVNULL, start_new_session=True)
    for fd in (commands_fd, outputs_fd, settings_r) + ready:  # the worker's now
        os.close(fd)
    with os.fdopen(settings_w, "wb") as f:  # read by the worker at start (a pipe buffer holds it meanwhile)
        f.write(settings.encode())
    return process


class Supervisor:
    """Watches the engine child and the API processes; forwards stop signals."""

    def __init__(self, engine: subprocess.Popen, workers: list[subprocess.Popen], drain_timeout_s: float) -> None:
        self.engine = engine
        self.workers = workers
        self.drain_timeout_s = drain_timeout_s
        self.stopping = False

    def _forward(self, signum: int, _frame) -> None:
        if not self.stopping:
            logger.info("%s: stopping the API processes (each drains its requests)", signal.Signals(signum).name)
        self.stopping = True
        for worker in self.workers:
            if worker.poll() is None:
                worker.send_signal(signum)  # a second SIGINT makes them skip the rest of the drain

    def run(self) -> int:
        previous = {s: signal.signal(s, self._forward) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            failed = self._watch()
            if failed:
                self._forward(signal.SIGTERM, None)
            self.wait_workers()
            self.wait_engine()
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
        return 1 if failed else 0

    def _watch(self) -> bool:
        """Until a stop signal (False) or a child's unexpected death (True)."""
        while not self.stopping:
            for index, worker in enumerate(self.workers):
                if worker.poll() is not None:
                    logger.error("API process %d (pid %d) exited with code %s: stopping the server", index,
                                 worker.pid, worker.returncode)
                    return True
            if self.engine.poll() is not None:
                logger.error("the engine process (pid %d) exited with code %s: stopping the server", self.engine.pid,
                             self.engine.returncode)
                return True
            time.sleep(POLL_S)
        return False

    def wait_workers(self) -> None:
        deadline = time.monotonic() + self.drain_timeout_s + 15.0  # the drain, then uvicorn's own shutdown
        for worker in self.workers:
            try:
                worker.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.error("API process pid %d did not stop in time: killed", worker.pid)
                worker.kill()
                worker.wait()

    def wait_engine(self) -> None:
        try:  # its clients are gone: their pipes ended
            self.engine.wait(ENGINE_EXIT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            logger.error("the engine process did not stop in time: killed")
            self.engine.kill()
            self.engine.wait()
