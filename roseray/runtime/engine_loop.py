"""The engine process's loop: one engine serving N >= 1 clients, each over a pipe pair.

A client is the server process, or with `--api-processes N` one of N API processes (and a
Ray replica's own). The loop steps the engine while it has requests, applies the clients'
commands between steps (and blocks on the command pipes while idle: a tensor-parallel
engine wakes every second to check its worker ranks, and a dead rank ends the loop with its
error, as a failed step that a dead rank caused does), and sends each step's
`StepOutputs` to every client that had a request in it: encoded and framed once, the same
bytes to each. The engine names a request by its client's prefix and the client's handle
(f"{index}.{handle}"; just the handle with one client), so each client keeps the deltas
under its own prefix and skips the others'. A client with no request in the engine gets a
message without deltas (the engine-wide stats) at most every IDLE_STATS_INTERVAL_S, and
when the engine goes idle or a step fails. A client's Stop or a broken pipe detaches it
and aborts its requests (their KV blocks are freed); the loop ends with its last client.
"""

from __future__ import annotations

import logging
import os
import select
import struct
import time
from multiprocessing.connection import Connection

from roseray.engine.engine import LLMEngine
from roseray.engine.outputs import RequestDelta
from roseray.runtime.messages import (
    AbortRequest,
    AddRequests,
    CheckIntegrity,
    GetKVEvents,
    IntegrityReply,
    KVEventsReply,
    StepOutputs,
    Stop,
    decode,
)

logger = logging.getLogger(__name__)

IDLE_STATS_INTERVAL_S = 0.25  # how often a client with no requests still gets the engine's stats
_LENGTH = struct.Struct("!i")  # multiprocessing.connection's frame header (messages under 2 GiB)


def frame(data: bytes) -> bytes:
    """`data` framed as `Connection.send_bytes` frames it (its length as 4 bytes, big-endian,
    then the bytes), to write to a pipe as it is: a step's message is framed once and
    written to each client's pipe with one os.write."""
    return _LENGTH.pack(len(data)) + data


class ClientPipes:
    """The engine's side of one client: its pipes and its requests, which the engine
    knows as prefix + handle."""

    def __init__(self, index: int, commands: Connection, outputs: Connection, prefix: str,
                 owners: dict[str, ClientPipes], adds_applied: list[int]) -> None:
        self.index = index
        self.commands, self.outputs = commands, outputs
        self.commands_fd, self._outputs_fd = commands.fileno(), outputs.fileno()
        self.prefix = prefix
        self.requests: set[str] = set()  # its requests' ids in the engine
        self.owners = owners  # engine request id -> its client, shared by all clients
        self.adds_applied = adds_applied  # every client's count of adds taken, by index, shared
        self.last_sent = float("-inf")
        # is a command there? (one poll object kept: Connection.poll builds a selector per call)
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
        """Write a message framed by `frame`."""
        written = os.write(self._outputs_fd, framed)
        while written < len(framed):  # a blocking pipe writes it all, unless a signal cut the write short
            written += os.write(self._outputs_fd, framed[written:])
        self.last_sent = now

    def detach(self, engine: LLMEngine) -> None:
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


def client_pipes(pipes: list[tuple[Connection, Connection]]) -> list[ClientPipes]:
    """One ClientPipes per (command, output) pipe pair; the prefix is "" with one client."""
    owners: dict[str, ClientPipes] = {}
    adds_applied = [0] * len(pipes)
    return [ClientPipes(index, commands, outputs, f"{index}." if len(pipes) > 1 else "", owners, adds_applied)
            for index, (commands, outputs) in enumerate(pipes)]


def apply_command(engine: LLMEngine, data: bytes, client: ClientPipes) -> bool:
    """Apply one command of `client`; True means the client stopped."""
    match decode(data):
        case AddRequests() as adds:
            failed = []
            for handle, token_ids, params, arrival in zip(adds.handles, adds.token_ids, adds.params,
                                                          adds.arrival_times):
                request_id = client.engine_id(handle)
                try:
                    engine.add_request(request_id, token_ids, params, arrival_time=arrival)
                except Exception:  # noqa: BLE001 - the client checked it; report it as a failed request
                    logger.exception("add_request failed in the engine process")
                    failed.append(RequestDelta.refused(request_id, len(token_ids), arrival))
                    continue
                client.added(request_id)
            client.adds_applied[client.index] += len(adds.handles)
            if failed:
                client.send(StepOutputs.from_deltas(failed, engine.get_stats(), client.adds_applied).encode())
        case AbortRequest(handle):
            engine.abort_request(client.engine_id(handle))
        case CheckIntegrity(call_id):
            try:
                engine.check_integrity()
                failure = None
            except AssertionError as error:
                failure = str(error) or "integrity check failed"
            client.send(IntegrityReply(call_id, failure, engine.get_stats(),
                                       client.adds_applied[client.index]).encode())
        case GetKVEvents(call_id, snapshot):
            events = engine.kv_cache_snapshot() if snapshot else engine.drain_kv_events()
            client.send(KVEventsReply(call_id, events).encode())
        case Stop():
            return True
        case other:
            raise ValueError(f"not a command: {other!r}")
    return False


def new_error(engine: LLMEngine, reported: BaseException | None) -> tuple[str | None, BaseException | None]:
    """(the repr of the engine's last error, that error) when it is not `reported` yet;
    else (None, reported): each failed step's error goes to the clients once."""
    error = engine.last_error
    if error is not None and error is not reported:
        return repr(error), error
    return None, reported


def serve_clients(engine: LLMEngine, clients: list[ClientPipes]) -> None:
    """Step while any client has requests, apply each client's commands between steps, send
    each step's message to every client with a request in it. Returns when every client has
    stopped or gone away."""
    live = {client.commands_fd: client for client in clients}
    owners, adds_applied = clients[0].owners, clients[0].adds_applied
    last_error = None
    commands = select.poll()  # one poll object for the command pipes, kept across steps
    for fd in live:
        commands.register(fd, select.POLLIN)

    def detach(client: ClientPipes) -> None:
        if len(clients) > 1:
            logger.info("API process %d detached from the engine (%d request(s) aborted)", client.index,
                        len(client.requests))
        if live.pop(client.commands_fd, None) is not None:
            commands.unregister(client.commands_fd)
        client.detach(engine)

    while live:
        if engine.has_unfinished_requests():
            timeout_ms = 0
        else:  # idle: a tensor-parallel engine wakes now and then to check its workers (a dead rank raises)
            check_s = engine.check_workers()
            timeout_ms = None if check_s is None else int(check_s * 1000)
        for fd, _ in commands.poll(timeout_ms):
            client = live[fd]  # only its own client detaches in this loop
            try:
                while client.has_command():
                    if apply_command(engine, client.commands.recv_bytes(), client):
                        raise EOFError  # Stop
            except (EOFError, OSError):
                detach(client)
        if not engine.has_unfinished_requests():
            continue
        # who gets this step: every client with a request in it (before its finished ones are
        # struck off below), the others only the stats, now and then and when the engine goes idle
        busy = [client for client in live.values() if client.requests]
        deltas = engine.step()
        stepped = time.perf_counter()
        error_text, last_error = new_error(engine, last_error)
        step = StepOutputs.from_deltas(deltas, engine.get_stats(), adds_applied, error_text)
        for finished in step.finished:  # no pass over every delta
            request_id = deltas[finished[0]].request_id
            client = owners.pop(request_id, None)
            if client is not None:  # None: its client detached
                client.requests.discard(request_id)
        everyone = error_text is not None or not engine.has_unfinished_requests()
        now = time.monotonic()
        framed, stats_only = frame(step.encode()), None
        for client in list(live.values()):
            if client in busy:
                data = framed
            elif everyone or now - client.last_sent >= IDLE_STATS_INTERVAL_S:
                if stats_only is None:
                    stats_only = frame(StepOutputs.from_deltas([], step.stats, adds_applied, error_text).encode())
                data = stats_only
            else:
                continue
            try:
                client.send_framed(data, now)
            except OSError:
                detach(client)
        engine.output_seconds_total += time.perf_counter() - stepped
        if error_text is not None:  # a failed step: was it a dead rank? (then the requests left fail too)
            engine.check_workers()
