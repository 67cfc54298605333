"""The engine loop in its own process, and the client that stands in for it.

Why: in one process the engine thread and the server's asyncio streams share one GIL,
so every streamed token's Python (stream wake-ups, SSE framing) delays the next engine
step. Here a child process owns the model and steps it back to back; the server process
keeps only the client (`EngineProcessClient`), which `AsyncLLMEngine` drives exactly as
it drives an in-process `LLMEngine` (same `add_request` / `abort_request` / `step`
contract), so streams, admission, 429/503, drain and health work unchanged.

Wire: two OS pipes to a `python -m roseray.runtime.engine_process` child (no
multiprocessing start-method magic, no pickle: every message is a JSON list framed by
`multiprocessing.connection.Connection`):

    client -> engine   ["add", [[handle, token_ids, sampling_params, arrival_time], ...]]
                       ["abort", handle]  ["check_integrity", call_id]  ["stop"]
    engine -> client   ["ready", info] | ["failed", error_type, message]      (once, at start)
                       ["step", names, token_ids, texts, num_outputs, extras, stats, error, sent_at]
                                                          (after every step with requests)
                       ["reply", call_id, error_message_or_null, stats]

The client holds back adds until `flush_commands` (or any other command) and sends them as
one "add" (an abort never overtakes its add). The async engine flushes at the end of a loop
iteration while the engine is idle, so a burst of new requests costs one message and one
wake-up of the child, which applies all of them before its next step and so schedules them
as one batch; while the engine steps it flushes each add at once (async_engine.py).
`sampling_params` holds only the fields that differ from SamplingParams' defaults.

Requests are named by short handles ("0", "1", ...) that the client maps back to the
server's request ids; step messages name them prefix + handle (the prefix is "" with one
client). A step message is columnar (one list per field, the common delta
costs a name, a token id (bare when the delta has exactly one: flat ints encode ~2.5x
faster than one-element lists; else the list), a text and a count); `extras` holds the rare parts by
delta index: [index, finished, finish_reason, logprobs, summary] (see `encode_step`).
`error` is the repr of the engine's `last_error` when a step failed. The child
sends while it has requests and blocks on its command pipe when idle. If the server
process dies, the child's next read or write fails and it exits; if the child dies,
`step()` raises and the async engine reports the loop dead (503, health fails).

Several clients (`roseray serve --api-processes N`: N API processes in front of one
engine): the child gets one pipe pair per client (`--commands-fd`/`--outputs-fd`
repeated; the config comes first on the first client's command pipe) and runs
`serve_clients` instead of `serve_engine`. Each client sends its own handles; in the
engine, and in every step message, they are f"{client}.{handle}" ("ready" tells each
client its prefix, f"{client}."). A step is encoded once, as with one client, and the same
message goes to every client that had a request in it; each keeps the deltas under its
own prefix. (Splitting the deltas by client cost the child a grouping pass, an encoding
per client and a smaller message each: ~100 against ~60 us per step of 128 deltas for
four clients on the dev box, and the child's loop is the one that bounds a step. The
clients, which run beside it, decode the whole message instead. For the same reason the
message is framed once (`frame`) and written to each client's pipe with one os.write, and
the command pipes are watched by one poll object kept across steps: with four clients the
dev box's loop went from ~157 to ~138 us per step of 128 deltas. `serve_engine`, for one
client, keeps its poll object across steps too: ~123 -> ~117 us.) A client with no request
in the engine gets a step message without deltas, with the engine-wide stats, at most
every `IDLE_STATS_INTERVAL_S`, so its stats stay fresh. A reply goes to the client that
asked. A client's "stop" or a broken pipe detaches it and aborts its requests (their KV
blocks are freed); the child exits when no client is left. With one client nothing of
this runs: `serve_engine` and its messages are as they were (the prefix is "").
"""

from __future__ import annotations

import argparse
import atexit
import dataclasses
import fcntl
import gc
import json
import logging
import os
import select
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection

from roseray.config import EngineConfig
from roseray.engine.engine import EngineStats, LLMEngine
from roseray.engine.request import RequestDelta, RequestLimits, RequestSummary
from roseray.models.loader import load_model_config
from roseray.sampling_params import SamplingParams
from roseray.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

_SAMPLING_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams))
_SAMPLING_DEFAULTS = tuple((name, getattr(SamplingParams(), name)) for name in _SAMPLING_FIELDS)
_STATS_FIELDS = ("num_running", "num_waiting", "num_free_blocks", "num_total_blocks", "kv_cache_usage",
                 "prefix_cache_hits", "prefix_cache_queries", "num_preemptions_total", "prompt_tokens_total",
                 "generation_tokens_total", "engine_steps_total", "step_seconds_total", "output_seconds_total")
_json_encode = json.JSONEncoder(separators=(",", ":")).encode
_LENGTH = struct.Struct("!i")  # multiprocessing.connection's frame header (messages under 2 GiB)
IDLE_STATS_INTERVAL_S = 0.25  # several clients: how often one with no requests still gets the stats
# An output pipe holds this much before the child's write blocks: a step of 128 deltas is ~3.2 KB
# and every busy client gets the whole step, so Linux's 64 KiB default is only ~20 steps (~13 ms
# at 0.65 ms a step) of a client falling behind (a burst of admissions, a pause) before it stalls
# the engine for every client; 512 KiB is ~160 steps
OUTPUT_PIPE_BYTES = 512 * 1024
# The command pipe: an event loop that drives its engine process writes a loop iteration's adds
# itself, and a write that does not fit waits (blocking that loop) until the child reads commands
# between two steps. 512 KiB holds a burst of ~128 adds of 512-token prompts (~4 KB of JSON each).
COMMAND_PIPE_BYTES = 512 * 1024


def _dumps(message) -> bytes:
    return _json_encode(message).encode()


def frame(data: bytes) -> bytes:
    """`data` framed as `Connection.send_bytes` frames it (its length as 4 bytes, big-endian,
    then the bytes), to write to a pipe as it is: a step's message is framed once and written
    to each client's pipe with one os.write (~2 us less per client than send_bytes)."""
    return _LENGTH.pack(len(data)) + data


def _loads(data: bytes):
    return json.loads(data)


class EngineProcessError(RuntimeError):
    """The engine process failed a step (carries its error's repr) or went away."""


def freeze_startup_objects() -> None:
    """Move everything alive after start-up (the model, torch, the tokenizer) out of the
    garbage collector's view: a full collection then scans only what steps allocate,
    instead of pausing a step for milliseconds. At exit they go back (gc.unfreeze), so that
    the interpreter's teardown frees them: frozen objects of Triton's nanobind extension would
    otherwise be reported as ~30 "nanobind: leaked ..." lines."""
    gc.collect()
    gc.freeze()
    atexit.unregister(gc.unfreeze)  # once, however often this runs
    atexit.register(gc.unfreeze)


# ---- the child ---------------------------------------------------------------------------
def step_extras(deltas: list[RequestDelta]) -> list[list]:
    """The rare parts of a step's deltas, by index: [index, finished, finish_reason,
    logprobs, summary] for each delta that finished or carries logprobs."""
    extras = []
    for index, delta in enumerate(deltas):
        if delta.finished or delta.new_logprobs is not None:
            logprobs = delta.new_logprobs
            if logprobs is not None:
                logprobs = [list(entry.items()) for entry in logprobs]
            summary = None
            if delta.finished:
                req = delta.request
                summary = [req.first_scheduled_time, req.num_cached_tokens, req.stop_reason]
            extras.append([index, delta.finished, delta.finish_reason, logprobs, summary])
    return extras


def encode_step(deltas: list[RequestDelta], stats: list, error: str | None, extras: list[list] | None = None) -> bytes:
    """One step's deltas as a columnar JSON message, named by their request ids in the
    engine (the client's handles, under its prefix); `extras`: step_extras(deltas), when
    the caller has it already."""
    if extras is None:
        extras = step_extras(deltas)
    tokens = [d.new_token_ids[0] if len(d.new_token_ids) == 1 else d.new_token_ids for d in deltas]
    return _dumps(["step", [d.request_id for d in deltas], tokens,
                    [d.new_text for d in deltas], [d.num_output_tokens for d in deltas], extras, stats,
                    error, time.monotonic()])  # when it was sent: the client's on_message_delay


def _new_error(engine, reported: BaseException | None) -> tuple[str | None, BaseException | None]:
    """(the repr of the engine's last error, that error) when it is not `reported` yet;
    else (None, reported): each failed step's error goes to the clients once."""
    error = engine.last_error
    if error is not None and error is not reported:
        return repr(error), error
    return None, reported


def _stats(engine) -> list:
    s = engine.get_stats()
    return [getattr(s, name) for name in _STATS_FIELDS]


def serve_engine(engine, commands: Connection, outputs: Connection) -> None:
    """Step `engine` while it has requests, apply commands between steps, send every
    step's deltas. Returns on "stop" or when the server's end of a pipe is gone."""
    send, recv = outputs.send_bytes, commands.recv_bytes
    waiting = select.poll()  # one poll object across steps (Connection.poll builds a selector per call)
    waiting.register(commands.fileno(), select.POLLIN)
    last_error = None
    while True:
        if not engine.has_unfinished_requests():
            if _apply(engine, _loads(recv()), send):  # idle: block until told something
                return
        while waiting.poll(0):  # a command (or the pipe's end) is there
            if _apply(engine, _loads(recv()), send):
                return
        if not engine.has_unfinished_requests():
            continue
        deltas = engine.step()
        stepped = time.perf_counter()
        error_text, last_error = _new_error(engine, last_error)
        send(encode_step(deltas, _stats(engine), error_text))
        engine.output_seconds_total += time.perf_counter() - stepped


def _apply(engine, command: list, send, client: SharedEngineClient | None = None) -> bool:
    """Apply one command (of `client`, when the engine has several); True means stop."""
    kind = command[0]
    if kind == "add":
        failed = []
        for handle, token_ids, params, arrival in command[1]:
            request_id = handle if client is None else client.engine_id(handle)
            try:
                engine.add_request(request_id, token_ids, SamplingParams(**params), arrival_time=arrival)
            except Exception:  # noqa: BLE001 - the client checked it; report it as a failed request
                logger.exception("add_request failed in the engine process")
                failed.append(RequestDelta(request_id, [], "", True, "error", None, len(token_ids), 0,
                                           RequestSummary(arrival)))
                continue
            if client is not None:
                client.added(request_id)
        if failed:
            send(encode_step(failed, _stats(engine), None))
    elif kind == "abort":
        engine.abort_request(command[1] if client is None else client.engine_id(command[1]))
    elif kind == "check_integrity":
        try:
            engine.check_integrity()
            failure = None
        except AssertionError as error:
            failure = str(error) or "integrity check failed"
        send(_dumps(["reply", command[1], failure, _stats(engine)]))
    elif kind == "stop":
        return True
    return False


# ---- several clients (API processes) share the child ------------------------------------------
class SharedEngineClient:
    """One client of an engine child that serves several: its pipes and its requests,
    which the engine knows as f"{index}.{handle}"."""

    def __init__(self, index: int, commands: Connection, outputs: Connection,
                 owners: dict[str, SharedEngineClient]) -> None:
        self.index = index
        self.commands, self.outputs = commands, outputs
        self.commands_fd, self._outputs_fd = commands.fileno(), outputs.fileno()
        self.prefix = f"{index}."  # of its requests' ids in the engine
        self.requests: set[str] = set()  # its requests' ids in the engine
        self.owners = owners  # engine request id -> its client, shared by all clients
        self.last_sent = float("-inf")
        # is a command there? (Connection.poll builds a selector per call: ~7 against ~0.5 us, paid per
        # message, and while the engine steps each add is a message of its own: async_engine.py)
        self._commands_ready = select.poll()
        self._commands_ready.register(self.commands_fd, select.POLLIN)

    def has_command(self) -> bool:
        """A command (or the pipe's end) is there to read."""
        return bool(self._commands_ready.poll(0))

    def engine_id(self, handle: str) -> str:
        return self.prefix + handle

    def added(self, request_id: str) -> None:
        self.requests.add(request_id)
        self.owners[request_id] = self

    def send(self, data: bytes) -> None:
        self.send_framed(frame(data), time.monotonic())

    def send_framed(self, framed: bytes, now: float) -> None:
        """Write a message framed by `frame` (a step's message is framed once for every client)."""
        written = os.write(self._outputs_fd, framed)
        while written < len(framed):  # a blocking pipe writes it all, unless a signal cut the write short
            written += os.write(self._outputs_fd, framed[written:])
        self.last_sent = now

    def detach(self, engine) -> None:
        """The client is gone or stopped: abort its requests (their blocks are freed at once;
        their abort deltas then find no owner) and close its pipes."""
        for request_id in self.requests:
            engine.abort_request(request_id)
            self.owners.pop(request_id, None)
        self.requests.clear()
        for connection in (self.commands, self.outputs):
            try:
                connection.close()
            except OSError:
                pass


def serve_clients(engine, clients: list[SharedEngineClient]) -> None:
    """`serve_engine` for several clients: step while any has requests, apply each
    client's commands between steps, send each step's message to every client with a
    request in it. Returns when every client has stopped or gone away."""
    live = {client.commands_fd: client for client in clients}
    owners = clients[0].owners
    last_error = None
    # one poll object for the command pipes, kept across steps (multiprocessing's wait() builds a
    # selector per call: ~7 against ~0.4 us per step for five clients on the dev box)
    commands = select.poll()
    for fd in live:
        commands.register(fd, select.POLLIN)

    def detach(client: SharedEngineClient) -> None:
        logger.info("API process %d detached from the engine (%d request(s) aborted)", client.index,
                    len(client.requests))
        if live.pop(client.commands_fd, None) is not None:
            commands.unregister(client.commands_fd)
        client.detach(engine)

    while live:
        for fd, _ in commands.poll(None if not engine.has_unfinished_requests() else 0):
            client = live[fd]  # only its own client detaches in this loop
            connection = client.commands
            try:
                while client.has_command():
                    if _apply(engine, _loads(connection.recv_bytes()), client.send, client):
                        raise EOFError  # "stop"
            except (EOFError, OSError):
                detach(client)
        if not engine.has_unfinished_requests():
            continue
        # who gets this step: every client with a request in it (before its finished ones are
        # struck off below), the others only the stats, now and then and when the engine goes idle
        busy = [client for client in live.values() if client.requests]
        deltas = engine.step()
        stepped = time.perf_counter()
        error_text, last_error = _new_error(engine, last_error)
        stats = _stats(engine)
        extras = step_extras(deltas)
        message = encode_step(deltas, stats, error_text, extras)
        for index, finished, *_ in extras:  # the finished ones are among the extras: no pass over every delta
            if finished:
                request_id = deltas[index].request_id
                client = owners.pop(request_id, None)
                if client is not None:  # None: its client detached
                    client.requests.discard(request_id)
        everyone = error_text is not None or not engine.has_unfinished_requests()
        now = time.monotonic()
        framed, stats_only = frame(message), None
        for client in list(live.values()):
            if client in busy:
                data = framed
            elif everyone or now - client.last_sent >= IDLE_STATS_INTERVAL_S:
                if stats_only is None:
                    stats_only = frame(encode_step([], stats, error_text))
                data = stats_only
            else:
                continue
            try:
                client.send_framed(data, now)
            except OSError:
                detach(client)
        engine.output_seconds_total += time.perf_counter() - stepped


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="roseray's engine process (started by EngineProcessClient, "
                                                 "or by `roseray serve --api-processes N`)")
    parser.add_argument("--commands-fd", type=int, action="append", required=True,
                        help="a client's command pipe (repeat with --outputs-fd for each client)")
    parser.add_argument("--outputs-fd", type=int, action="append", required=True)
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    if len(args.commands_fd) != len(args.outputs_fd):
        parser.error("give one --outputs-fd per --commands-fd")
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s engine-process %(name)s: %(message)s")
    pipes = [(Connection(c, writable=False), Connection(o, readable=False))
             for c, o in zip(args.commands_fd, args.outputs_fd)]
    try:
        config = EngineConfig(**_loads(pipes[0][0].recv_bytes()))  # the config comes first, from the first client
        engine = LLMEngine(config)
    except Exception as error:  # noqa: BLE001 - reported to the clients, which raise it
        logger.exception("the engine process could not start")
        for _, outputs in pipes:
            _send_quietly(outputs, _dumps(["failed", type(error).__name__, str(error)]))
        return 1
    freeze_startup_objects()
    info = {"model_name": engine.model_name, "limits": dataclasses.asdict(engine.limits), "pid": os.getpid()}
    for index, (_, outputs) in enumerate(pipes):  # each client its prefix: the requests' ids in step messages
        _send_quietly(outputs, _dumps(["ready", {**info, "client_prefix": f"{index}." if len(pipes) > 1 else ""}]))
    try:
        if len(pipes) == 1:
            serve_engine(engine, *pipes[0])
        else:
            owners: dict[str, SharedEngineClient] = {}
            serve_clients(engine, [SharedEngineClient(i, c, o, owners) for i, (c, o) in enumerate(pipes)])
    except (EOFError, BrokenPipeError, ConnectionResetError):
        logger.info("the server process is gone; the engine process exits")
    return 0


def _send_quietly(outputs: Connection, data: bytes) -> None:
    try:
        outputs.send_bytes(data)
    except OSError:  # that client is gone; serve_clients detaches it
        pass


def widen_pipe(fd: int, size: int) -> int:
    """Ask Linux to let the pipe of `fd` hold `size` bytes; returns what it holds now. Best
    effort: elsewhere, or past /proc/sys/fs/pipe-max-size or the user's pipe pages, the pipe
    keeps its size (a log line says so)."""
    set_size, get_size = getattr(fcntl, "F_SETPIPE_SZ", None), getattr(fcntl, "F_GETPIPE_SZ", None)
    if set_size is None or get_size is None:
        return 0
    try:
        return fcntl.fcntl(fd, set_size, size)
    except OSError as error:
        logger.info("could not grow an engine pipe to %d bytes (%s)", size, error)
        return fcntl.fcntl(fd, get_size)


def spawn_engine_process(config: EngineConfig, num_clients: int = 1) -> tuple[subprocess.Popen, list[tuple[int, int]]]:
    """Start `python -m roseray.runtime.engine_process` with one pipe pair per client and
    send it the config (first, on the first client's command pipe). Returns the process
    and each client's (command pipe write end, output pipe read end); its ends are closed
    here. The child runs in a session of its own: a terminal's Ctrl-C reaches whoever
    started it, which stops it."""
    child_fds, client_fds, argv = [], [], []
    for _ in range(num_clients):
        cmd_r, cmd_w = os.pipe()
        out_r, out_w = os.pipe()
        widen_pipe(out_w, OUTPUT_PIPE_BYTES)
        widen_pipe(cmd_w, COMMAND_PIPE_BYTES)
        child_fds += [cmd_r, out_w]
        client_fds.append((cmd_w, out_r))
        argv += ["--commands-fd", str(cmd_r), "--outputs-fd", str(out_w)]
    level = logging.getLevelName(logging.getLogger("roseray").getEffectiveLevel())
    process = subprocess.Popen(
        [sys.executable, "-m", "roseray.runtime.engine_process", *argv,
         "--log-level", level if isinstance(level, str) else "INFO"],
        pass_fds=child_fds, stdin=subprocess.DEVNULL, start_new_session=True)
    for fd in child_fds:
        os.close(fd)
    with Connection(os.dup(client_fds[0][0]), readable=False) as first:  # a Connection closes its fd
        first.send_bytes(_dumps(dataclasses.asdict(config)))
    return process, client_fds


# ---- the client (in the server process) ----------------------------------------------------
class EngineProcessClient:
    """Starts the engine process and speaks for it: what AsyncLLMEngine's loop thread calls
    (`add_request`, `abort_request`, `step`, `has_unfinished_requests`, `get_stats`,
    `check_integrity`, `last_error`) plus what the server reads (`model_name`,
    `max_model_len`, `config`, `tokenizer`). One thread calls it: the async engine's loop
    thread, or its event loop, which then reads a step's message when `outputs_fd` is
    readable (`read_outputs`) and sends the adds of a loop iteration with `flush_commands`.
    `wake()` may come from any thread.

    `EngineProcessClient(config)` spawns a child of its own; `connect(config, ...)` speaks
    over the pipes of a child that another process started for several clients (the
    supervisor of `roseray serve --api-processes N`), which it then neither waits for nor
    kills: it only sends "stop"."""

    def __init__(self, config: EngineConfig, *, poll_s: float = 0.01, start_timeout_s: float | None = None,
                 pipe_fds: tuple[int, int] | None = None) -> None:
        self.config = config
        self.model_config = load_model_config(config.model, revision=config.revision)
        self.tokenizer = load_tokenizer(config.tokenizer, self.model_config)
        self.poll_s = poll_s
        self.last_error: BaseException | None = None
        self._handles: dict[str, str] = {}  # request id -> its handle in the engine process
        # name in step messages (prefix + handle) -> (request id, prompt length, arrival)
        self._requests: dict[str, tuple[str, int, float]] = {}
        self._next_handle = 0
        self._backlog: list[RequestDelta] = []  # step deltas read while waiting for a reply
        self._adds: list[list] = []  # adds not sent yet: they go as one message (`_flush_adds`)
        self._stats = None
        self._last_message = time.monotonic()
        # called with the seconds from the engine process sending each step message to this client
        # reading it (one time.monotonic() clock for all processes of a host): a client thread that
        # waits for the GIL while its event loop admits a burst, or falls behind, reads late
        self.on_message_delay: Callable[[float], None] | None = None
        self._replies: dict[int, list] = {}
        self._next_call = 0
        self._closed = False
        # wake(): a byte here ends step()'s wait for a step message (the loop has a command to send)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._wake_pending = False  # a byte is on its way: one per wait is enough
        self._wake_lock = threading.Lock()  # wake() against close(): never a write to a closed (reused) fd
        if pipe_fds is None:
            self._process, self._commands, self._outputs = self._spawn(config)
        else:  # a shared child: the process is not ours
            self._process = None
            self._commands = Connection(pipe_fds[0], readable=False)
            self._outputs = Connection(pipe_fds[1], writable=False)
        self._outputs_fd = self._outputs.fileno()
        self._output_poller = select.poll()  # read_outputs(): is a message there now?
        self._output_poller.register(self._outputs_fd, select.POLLIN)
        self.messages_read = 0  # messages read so far (steps' and replies)
        self._poller = select.poll()  # step()'s wait: one poll(2) on both pipes
        self._poller.register(self._outputs_fd, select.POLLIN)
        self._poller.register(self._wake_r, select.POLLIN)
        info = self._wait_ready(start_timeout_s)
        self._prefix: str = info["client_prefix"]  # of this client's requests' ids in step messages
        self.model_name: str = info["model_name"]
        self.limits = RequestLimits(**info["limits"])
        self.max_model_len = self.limits.max_model_len
        self.pid: int = info["pid"]

    @classmethod
    def connect(cls, config: EngineConfig, commands_fd: int, outputs_fd: int, **kwargs) -> EngineProcessClient:
        """A client over the command pipe's write end and the output pipe's read end of an
        engine child already started; waits for its "ready"."""
        return cls(config, pipe_fds=(commands_fd, outputs_fd), **kwargs)

    @staticmethod
    def _spawn(config: EngineConfig):
        process, [(commands_fd, outputs_fd)] = spawn_engine_process(config)
        return process, Connection(commands_fd, readable=False), Connection(outputs_fd, writable=False)

    def _wait_ready(self, timeout_s: float | None) -> dict:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self._outputs.poll(0.5):
            if self._process is not None and self._process.poll() is not None:
                raise EngineProcessError(f"the engine process exited with code {self._process.returncode} "
                                         "before it was ready (its log says why)")
            if deadline is not None and time.monotonic() > deadline:
                self.close()
                raise EngineProcessError(f"the engine process was not ready within {timeout_s:.0f} s")
        try:
            message = _loads(self._outputs.recv_bytes())
        except (EOFError, OSError):
            raise EngineProcessError("the engine process exited before it was ready (its log says why)") from None
        if message[0] == "failed":
            if self._process is not None:
                self._process.wait(10)
            error_type = ValueError if message[1] == "ValueError" else EngineProcessError
            raise error_type(message[2])
        return message[1]

    # ---- what AsyncLLMEngine calls (its loop thread) -----------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int], sampling_params: SamplingParams, *,
                    arrival_time: float | None = None) -> None:
        if request_id in self._handles:
            raise ValueError(f"request id {request_id!r} is already in use")
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        self.limits.check(token_ids, sampling_params)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        params = {name: value for name, default in _SAMPLING_DEFAULTS
                  if (value := getattr(sampling_params, name)) != default}
        handle = str(self._next_handle)
        self._next_handle += 1
        self._adds.append([handle, token_ids, params, arrival])
        self._handles[request_id] = handle
        self._requests[self._prefix + handle] = (request_id, len(token_ids), arrival)

    def abort_request(self, request_id: str) -> None:
        handle = self._handles.get(request_id)
        if handle is not None:
            self._send(["abort", handle])

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests) or bool(self._backlog)

    def step(self) -> list[RequestDelta]:
        """Send the adds held back, then return every delta the engine process sent since
        the last call (several steps' worth when this side fell behind); [] when nothing
        arrived within `poll_s` or `wake()` was called meanwhile."""
        if self._adds:
            self._flush_adds()
        deltas, self._backlog = self._backlog, []
        if not self._readable(0 if deltas else self.poll_s * 1000):
            if not deltas:
                self._check_alive()
            return deltas
        self._read(deltas)
        while self._readable(0):
            self._read(deltas)
        return deltas

    # ---- what AsyncLLMEngine calls when its event loop drives this client (no loop thread) -----
    @property
    def outputs_fd(self) -> int:
        """The output pipe: readable when the engine process has sent a message."""
        return self._outputs_fd

    def read_outputs(self) -> list[RequestDelta]:
        """Every delta the engine process has sent so far (and any read earlier while waiting
        for a reply), without waiting: the event loop calls this when `outputs_fd` is readable."""
        deltas, self._backlog = self._backlog, []
        while self._output_poller.poll(0):
            self._read(deltas)
        return deltas

    def flush_commands(self) -> int:
        """Send the adds held back as one message; returns how many went."""
        if not self._adds:
            return 0
        num_adds = len(self._adds)
        self._flush_adds()
        return num_adds

    def _readable(self, timeout_ms: float) -> bool:
        """Whether the output pipe has a message (or its end), waiting up to `timeout_ms`
        for it or a wake(): one poll(2) on both pipes (a wake is taken here)."""
        ready = dict(self._poller.poll(timeout_ms))
        if self._wake_r in ready:
            self._wake_pending = False  # before the read: a wake() after it writes again
            self._drain_wake()
        return self._outputs_fd in ready

    def wake(self) -> None:
        """End a wait in step() now (from any thread): the async engine has a command for
        the engine process (an add, an abort) that should reach it before its next step;
        otherwise it would wait for this step's message, and miss the next step too."""
        if self._wake_pending:
            return
        with self._wake_lock:
            if self._closed:
                return
            self._wake_pending = True
            try:
                os.write(self._wake_w, b"\0")
            except BlockingIOError:  # the pipe is full: bytes are there already
                pass

    def _drain_wake(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass

    def get_stats(self):
        if not self._requests:  # idle: the loop does not step, so read what a shared child sent meanwhile
            while self._outputs.poll():
                self._read(self._backlog)
        if self._stats is None:
            return EngineStats(0, 0, self.limits.num_blocks, self.limits.num_blocks, 0.0, 0, 0, 0, 0, 0)
        return EngineStats(*self._stats)

    def check_integrity(self, timeout_s: float = 30.0) -> None:
        """The engine's accounting check, run in the engine process between two steps."""
        call_id = self.send_integrity_check()
        deadline = time.monotonic() + timeout_s
        while call_id not in self._replies:
            if not self._outputs.poll(max(0.0, deadline - time.monotonic())):
                raise EngineProcessError(f"the engine process did not answer within {timeout_s:.0f} s")
            self._read(self._backlog)
        self.take_integrity_reply(call_id)

    def send_integrity_check(self) -> int:
        """Ask for the accounting check without waiting; its reply comes with the step
        messages (`take_integrity_reply` once `integrity_replied`)."""
        call_id = self._next_call
        self._next_call += 1
        self._send(["check_integrity", call_id])
        return call_id

    def integrity_replied(self, call_id: int) -> bool:
        return call_id in self._replies

    def take_integrity_reply(self, call_id: int) -> None:
        """AssertionError when the check failed."""
        failure = self._replies.pop(call_id)
        if failure is not None:
            raise AssertionError(failure)

    def heartbeat(self) -> float:
        """When the engine process last showed progress (now when it has nothing to do)."""
        return self._last_message if self._requests else time.monotonic()

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the engine process (it finishes the step it is in)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._commands.send_bytes(_dumps(["stop"]))
        except OSError:
            pass
        if self._process is not None:
            try:
                self._process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        self._commands.close()
        self._outputs.close()
        with self._wake_lock:
            os.close(self._wake_r)
            os.close(self._wake_w)

    # ---- internals ---------------------------------------------------------------------------
    def _flush_adds(self) -> None:
        adds, self._adds = self._adds, []
        self._write(["add", adds])

    def _send(self, message: list) -> None:
        if self._adds:  # an abort or a call must not overtake an add
            self._flush_adds()
        self._write(message)

    def _write(self, message: list) -> None:
        try:
            self._commands.send_bytes(_dumps(message))
        except OSError as error:
            raise EngineProcessError(f"the engine process is gone ({error})") from None

    def _check_alive(self) -> None:
        # a shared child is not ours to poll: its death shows as the end of its output pipe
        if self._process is not None and self._process.poll() is not None:
            raise EngineProcessError(f"the engine process exited with code {self._process.returncode}")

    def _read(self, deltas: list[RequestDelta]) -> None:
        try:
            message = _loads(self._outputs.recv_bytes())
        except (EOFError, OSError):
            code = self._process.poll() if self._process is not None else None
            raise EngineProcessError(f"the engine process is gone (exit code {code})") from None
        self._last_message = read_at = time.monotonic()
        self.messages_read += 1
        if message[0] == "reply":
            _, call_id, failure, self._stats = message
            self._replies[call_id] = failure
            return
        _, names, token_ids, texts, num_outputs, extras, self._stats, error, sent_at = message
        if self.on_message_delay is not None:
            self.on_message_delay(read_at - sent_at)
        if error is not None:
            self.last_error = EngineProcessError(error)
        requests = self._requests
        found = {} if extras else None  # the message's index -> our delta (for the extras)
        for index, (name, tokens, text, num_output) in enumerate(zip(names, token_ids, texts, num_outputs)):
            request = requests.get(name)
            if request is None:  # another client's (a shared engine sends each step to all of them)
                continue
            request_id, num_prompt, _ = request
            if tokens.__class__ is not list:  # one token id, sent bare
                tokens = [tokens]
            delta = RequestDelta(request_id, tokens, text, False, None, None, num_prompt, num_output, None)
            deltas.append(delta)
            if found is not None:
                found[index] = delta
        for index, finished, reason, logprobs, summary in extras:
            delta = found.get(index)
            if delta is None:
                continue
            if logprobs is not None:
                delta.new_logprobs = [{int(token): value for token, value in entry} for entry in logprobs]
            if finished:
                delta.finished, delta.finish_reason = True, reason
                del self._handles[delta.request_id]
                delta.request = RequestSummary(requests.pop(names[index])[2], *summary)


if __name__ == "__main__":
    raise SystemExit(main())
