"""InProcessEngineClient: the engine on a thread of this process.

The thread owns the engine (it is not thread-safe): it applies the event loop's commands
between steps, steps while there are requests, and sleeps on an event while there are
none (a tensor-parallel engine wakes every second to check its worker ranks: a dead one
ends the thread, which the event loop reports as the engine's death). Each step's deltas
go to the event loop through a deque, with one byte on a pipe (`outputs_fd`) when the
loop has not been told yet, so a loop that falls behind takes several steps' deltas in
one read. The engine's errors and stats travel with them.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from dataclasses import dataclass

from roseray.engine.engine import LLMEngine
from roseray.engine.kv_events import KVCacheSnapshot, KVEventBatch
from roseray.engine.outputs import EngineStats, RequestDelta
from roseray.runtime.engine_client import EngineClient, EngineError
from roseray.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Step:
    """One step's outputs, handed from the engine thread to the event loop."""

    deltas: list[RequestDelta]
    stats: EngineStats
    adds_applied: int
    error: BaseException | None  # the engine's latest failed step's error, if this step added one
    sent_at: float


@dataclass(slots=True)
class _Reply:
    call_id: int
    failure: str | None
    stats: EngineStats
    adds_applied: int


@dataclass(slots=True)
class _KVReply:
    call_id: int
    events: KVEventBatch | KVCacheSnapshot


@dataclass(slots=True)
class _Died:
    error: BaseException


class InProcessEngineClient(EngineClient):
    """An LLMEngine stepped by a thread of its own (see the module docstring)."""

    def __init__(self, engine: LLMEngine) -> None:
        super().__init__(engine.config, engine.tokenizer, engine.model_name, engine.limits)
        self.engine = engine
        self._requests: set[str] = set()  # added and not yet finished, as the event loop has read
        self._adds: list[tuple] = []  # held until flush_commands
        self._commands: collections.deque = collections.deque()  # event loop -> thread
        self._outbox: collections.deque = collections.deque()  # thread -> event loop
        self._wake = threading.Event()  # the thread sleeps on it while the engine is idle
        self._ready_r, self._ready_w = os.pipe()
        os.set_blocking(self._ready_r, False)
        os.set_blocking(self._ready_w, False)
        self._told = False  # a byte is on the pipe for what is in the outbox
        self._stats = engine.get_stats()
        self._applied = 0  # adds the engine thread has taken
        self._busy = False  # the engine has requests: the heartbeat is the thread's last iteration
        self._beat = time.monotonic()
        self._stop = False
        self._closed = False  # the thread has ended and the pipe is closed: the caller may touch the engine
        self._thread = threading.Thread(target=self._run, name="roseray-engine", daemon=True)
        self._thread.start()

    # ---- the event loop's side -----------------------------------------------------------------
    @property
    def outputs_fd(self) -> int:
        return self._ready_r

    def add_request(self, request_id: str, prompt: str | list[int], sampling_params: SamplingParams, *,
                    arrival_time: float | None = None) -> None:
        token_ids, arrival = self._admit(request_id, self._requests, prompt, sampling_params, arrival_time)
        self._adds.append((request_id, token_ids, sampling_params, arrival))
        self._requests.add(request_id)

    def flush_commands(self) -> int:
        num_adds = len(self._adds)
        if num_adds:
            self._command(None)
        return num_adds

    def abort_request(self, request_id: str) -> None:
        if request_id in self._requests:
            self._command(("abort", request_id))

    def read_outputs(self) -> list[RequestDelta]:
        if not self._closed:
            try:  # the bytes first, then the flag: whatever is posted after this read is told again
                while os.read(self._ready_r, 4096):
                    pass
            except BlockingIOError:
                pass
        self._told = False
        deltas: list[RequestDelta] = []
        outbox, now = self._outbox, time.monotonic()
        while outbox:
            item = outbox.popleft()
            if type(item) is _Step:
                self.num_steps_read += 1
                self._stats, self.num_adds_applied = item.stats, item.adds_applied
                if item.error is not None:
                    self.last_error = item.error
                if self.on_message_delay is not None:
                    self.on_message_delay(now - item.sent_at)
                deltas += item.deltas
            elif type(item) is _Reply:
                self._replies[item.call_id] = item.failure
                self._stats, self.num_adds_applied = item.stats, item.adds_applied
            elif type(item) is _KVReply:
                self._kv_replies[item.call_id] = item.events
            else:
                raise EngineError(f"the engine thread died: {item.error!r}") from item.error
        requests = self._requests
        for delta in deltas:
            if delta.finished:
                requests.discard(delta.request_id)
        return deltas

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def send_integrity_check(self) -> int:
        call_id = next(self._call_ids)
        self._command(("check_integrity", call_id))
        if self._closed:  # the thread has ended: the check runs here, its reply waits in the outbox
            self._apply_commands()
        return call_id

    def send_kv_events_request(self, snapshot: bool = False) -> int:
        call_id = next(self._call_ids)
        self._command(("kv_snapshot" if snapshot else "kv_events", call_id))
        if self._closed:  # the thread has ended: answered here, the reply waits in the outbox
            self._apply_commands()
        return call_id

    def heartbeat(self) -> float:
        return self._beat if self._busy else time.monotonic()

    def close(self, timeout_s: float = 10.0) -> None:
        self._stop = True
        self._wake.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.warning("the engine thread did not stop within %.0f s", timeout_s)
            return
        if self._closed:
            return
        self._closed = True
        for fd in (self._ready_r, self._ready_w):
            os.close(fd)

    def _command(self, command: tuple | None) -> None:
        """Send the held adds, then `command` (an abort or a check must not overtake an add)."""
        if self._adds:
            adds, self._adds = self._adds, []
            self._commands.append(("add", adds))
            self.num_adds_sent += len(adds)
        if command is not None:
            self._commands.append(command)
        self._wake.set()

    # ---- the engine thread ---------------------------------------------------------------------
    def _run(self) -> None:
        engine, reported = self.engine, None
        try:
            while not self._stop:
                self._beat = time.monotonic()
                if self._commands:
                    self._apply_commands()
                if not engine.has_unfinished_requests():
                    self._busy = False
                    # a tensor-parallel engine wakes now and then to check its workers: a dead rank
                    # ends this thread (the event loop dies with its error) with no request to find it
                    self._wake.wait(engine.check_workers())
                    self._wake.clear()
                    continue
                self._busy = True
                deltas = engine.step()
                error = engine.last_error
                new_error = error if error is not None and error is not reported else None
                reported = error
                self._post(_Step(deltas, engine.get_stats(), self._applied, new_error, time.monotonic()))
                if new_error is not None:  # a failed step: was it a dead rank? (then the requests left fail too)
                    engine.check_workers()
            # stopped: what was asked before is done, then every request is aborted (as an engine
            # process does for a client that stops), which frees their blocks
            self._apply_commands()
            for request_id in list(engine.requests):
                engine.abort_request(request_id)
        except BaseException as error:  # noqa: BLE001 - the event loop must learn of any failure
            logger.exception("the engine thread died")
            self._post(_Died(error))

    def _apply_commands(self) -> None:
        engine, commands, refused = self.engine, self._commands, []
        while commands:
            kind, argument = commands.popleft()
            if kind == "add":
                for request_id, token_ids, params, arrival in argument:
                    try:
                        engine.add_request(request_id, token_ids, params, arrival_time=arrival)
                    except Exception:  # noqa: BLE001 - checked before; report it as a failed request
                        logger.exception("add_request failed")
                        engine.abort_request(request_id)  # in case it got in before failing
                        refused.append(RequestDelta.refused(request_id, len(token_ids), arrival))
                self._applied += len(argument)
            elif kind == "abort":
                engine.abort_request(argument)
            elif kind == "kv_events":
                self._post(_KVReply(argument, engine.drain_kv_events()))
            elif kind == "kv_snapshot":
                self._post(_KVReply(argument, engine.kv_cache_snapshot()))
            else:
                try:
                    engine.check_integrity()
                    failure = None
                except AssertionError as error:
                    failure = str(error) or "integrity check failed"
                self._post(_Reply(argument, failure, engine.get_stats(), self._applied))
        if refused:
            self._post(_Step(refused, engine.get_stats(), self._applied, None, time.monotonic()))

    def _post(self, item: _Step | _Reply | _KVReply | _Died) -> None:
        self._outbox.append(item)
        if not self._told and not self._closed:
            self._told = True
            try:
                os.write(self._ready_w, b"\0")
            except (BlockingIOError, OSError):  # full: the loop has bytes to read already; closed: nobody reads
                pass
