"""AsyncLLMEngine: requests in from asyncio, a stream of deltas out per request.

The event loop drives an EngineClient (engine_client.py), wherever the engine runs: it
watches the client's `outputs_fd` and, when it is readable, makes ONE hand-off of
everything that arrived (one or several engine steps' deltas), never one per token; the
streams it touched flush once at its end, so an attached stream (SSE) writes several
steps' tokens in one `send` when the server falls behind, doing less work per token
instead of more. A timer every `heartbeat_s` refreshes the stats while the engine is idle.

Adds are checked by the client at once (ValueError: the caller's 400). While the engine is
idle the adds of one loop iteration go as one command at its end, so a burst of admissions
costs one message and the engine schedules it as one batch; while it steps, each add goes
at once: the engine takes commands between steps, and an add held to the end of an
iteration that admits and writes a lot would miss steps it could have made.

A stream closed early (cancelled handler, client gone) aborts its request, which frees
its KV blocks before the engine's next step. Preemptions (KV cache full: the newest
running request is recomputed later) are logged at most once per
`preemption_log_interval_s`, with the number since the last line.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import threading
import time
from dataclasses import dataclass

from roseray import envs
from roseray.config import EngineConfig
from roseray.engine.kv_events import KVCacheSnapshot, KVEventBatch
from roseray.engine.outputs import ENGINE_STATS_FIELDS, EngineStats, RequestDelta
from roseray.runtime.engine_client import EngineClient
from roseray.runtime.engine_process import freeze_startup_objects
from roseray.runtime.errors import EngineRequestError, EngineUnavailableError, QueueFullError
from roseray.runtime.request_stream import RequestStream
from roseray.runtime.transports import make_engine_client
from roseray.sampling_params import SamplingParams

__all__ = ["AsyncLLMEngine", "AsyncEngineStats", "EngineRequestError", "EngineUnavailableError", "LoopState",
           "QueueFullError", "RequestStream"]

logger = logging.getLogger(__name__)

INTEGRITY_POLL_S = 0.002  # how often check_integrity (and kv_events) looks for its reply


class LoopState(enum.Enum):
    NEW = "new"
    RUNNING = "running"
    DRAINING = "draining"
    STOPPED = "stopped"
    DEAD = "dead"  # the engine failed or went away; its state can no longer be trusted


@dataclass(frozen=True, slots=True)
class AsyncEngineStats(EngineStats):
    """The engine's stats as of the last hand-off, with the async engine's own (read from any thread)."""

    num_steps_total: int = 0  # engine steps whose outputs this async engine read
    last_heartbeat: float = 0.0  # time.monotonic() of the engine's last sign of progress

    @classmethod
    def of(cls, stats: EngineStats, num_steps_total: int, last_heartbeat: float) -> AsyncEngineStats:
        return cls(*[getattr(stats, name) for name in ENGINE_STATS_FIELDS], num_steps_total, last_heartbeat)


class AsyncLLMEngine:
    """The per-request streams over one EngineClient, driven by one event loop: the first
    caller's of `add_request` (or the loop `start()` runs on). `stats` may be read from any thread."""

    def __init__(self, client: EngineClient, *, max_waiting_requests: int, retry_after_s: int = 1,
                 heartbeat_s: float = 1.0, stuck_after_s: float = 60.0, max_failed_steps: int = 3,
                 preemption_log_interval_s: float = 10.0, max_running: int = 0) -> None:
        self.client = client
        # requests the engine runs at once (max_num_seqs): that many new requests do not queue
        self.max_running = max_running
        self.preemption_log_interval_s = preemption_log_interval_s
        self._preemptions_logged = 0  # num_preemptions_total as of the last preemption log line
        self._preemption_logged_at = float("-inf")
        self.max_waiting_requests = max_waiting_requests
        self.retry_after_s = retry_after_s
        self.heartbeat_s = heartbeat_s
        self.stuck_after_s = stuck_after_s
        self.max_failed_steps = max_failed_steps  # consecutive failed model steps before check_health fails
        self.num_failed_steps = 0  # consecutive reads with a new engine error
        self._last_error_seen: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._state = LoopState.NEW
        self._stop = False
        self._streams: dict[str, RequestStream] = {}
        self._num_added = 0  # adds the client took (held or sent)
        self.stats = AsyncEngineStats(last_heartbeat=time.monotonic())
        self.dead_error: BaseException | None = None
        self._flush_scheduled = False  # a _flush_commands call is on its way
        self._tick: asyncio.TimerHandle | None = None
        self._num_steps = 0  # engine steps read
        self._closer: threading.Thread | None = None  # closes the client once the engine stops
        self._client_closed = threading.Event()
        # an A/B switch: "iteration" holds every add to the end of its loop iteration, as before the
        # adds of a stepping engine went at once
        self._hold_adds = envs.add_flush() == "iteration"

    @classmethod
    def from_engine_config(cls, config: EngineConfig, *, pipe_fds: tuple[int, int] | None = None,
                           **kwargs) -> AsyncLLMEngine:
        """Load the model behind the client make_engine_client picks (`pipe_fds`: a pipe pair
        to a shared engine process) and wrap it; requests are taken once `start()` ran."""
        return cls(make_engine_client(config, pipe_fds=pipe_fds), max_waiting_requests=config.max_waiting_requests,
                   max_running=config.max_num_seqs, **kwargs)

    # ---- lifecycle ------------------------------------------------------------------------
    def start(self) -> None:
        """Take requests from now on; started on a running event loop, the engine is read there
        at once, else from the first `add_request`'s loop."""
        if self._state is not LoopState.NEW:
            return
        self._state = LoopState.RUNNING
        freeze_startup_objects()
        self.stats = self._snapshot()
        loop = _running_loop()
        if loop is not None:
            self._bind(loop)

    @property
    def state(self) -> LoopState:
        return self._state

    @property
    def is_ready(self) -> bool:
        return self._state is LoopState.RUNNING and self.is_alive

    @property
    def is_alive(self) -> bool:
        """Running, and the engine showed progress (or was idle) within `stuck_after_s`."""
        return (self._state in (LoopState.RUNNING, LoopState.DRAINING)
                and time.monotonic() - self.client.heartbeat() < self.stuck_after_s)

    def check_health(self) -> None:
        """Raise if the engine is dead or stuck, or fails step after step (a sticky device
        error): Ray Serve's check_health contract, so that the replica is replaced."""
        if self._state is LoopState.DEAD:
            raise RuntimeError(f"engine loop died: {self.dead_error!r}")
        if self.num_failed_steps >= self.max_failed_steps:
            raise RuntimeError(f"the last {self.num_failed_steps} engine steps failed: {self.client.last_error!r}")
        if self._state in (LoopState.RUNNING, LoopState.DRAINING) and not self.is_alive:
            stalled = time.monotonic() - self.client.heartbeat()
            raise RuntimeError(f"engine loop is stuck: no step or heartbeat for {stalled:.1f} s "
                               f"(limit {self.stuck_after_s:.0f} s)")

    @property
    def num_active_requests(self) -> int:
        return len(self._streams)

    async def check_integrity(self, timeout_s: float = 30.0) -> dict[str, int]:
        """Assert the engine's KV accounting (free + used = total, ref counts equal the block
        tables, no orphan rows or requests) between two of its steps; returns the block counts."""
        if self._stop:  # closed: an engine that outlives its client (on a thread of this process) still answers
            await asyncio.to_thread(self.wait_stopped)
            return self._check_closed_engine()
        loop = self._loop
        if loop is not None and loop.is_running() and loop is not asyncio.get_running_loop():
            # called from another thread's loop (a test, a tool): ask on the loop that reads the engine
            asked = asyncio.run_coroutine_threadsafe(self.check_integrity(timeout_s), loop)
            return await asyncio.wrap_future(asked)
        self._bind_here()
        client = self.client
        call_id = self._engine_call(client.send_integrity_check)
        await self._wait_for_reply(call_id, client.integrity_replied, timeout_s)
        client.take_integrity_reply(call_id)
        return self._block_counts()

    async def kv_events(self, snapshot: bool = False, timeout_s: float = 10.0) -> KVEventBatch | KVCacheSnapshot:
        """The engine's KV cache events since the previous call (a KVEventBatch), or with `snapshot`
        a KVCacheSnapshot of its whole prefix cache, taken between two steps: what a Ray replica
        sends the Router's cache index. One consumer per engine (each call drains the log)."""
        if self._stop:
            raise EngineUnavailableError(f"the engine is not running ({self._state.value})")
        loop = self._loop
        if loop is not None and loop.is_running() and loop is not asyncio.get_running_loop():
            asked = asyncio.run_coroutine_threadsafe(self.kv_events(snapshot, timeout_s), loop)
            return await asyncio.wrap_future(asked)
        self._bind_here()
        client = self.client
        call_id = self._engine_call(client.send_kv_events_request, snapshot)
        await self._wait_for_reply(call_id, client.kv_events_replied, timeout_s)
        return client.take_kv_events(call_id)

    async def _wait_for_reply(self, call_id: int | None, replied, timeout_s: float) -> None:
        """Until `replied(call_id)` (the outputs' reader files the engine's reply); EngineUnavailableError
        when the engine dies or does not answer within `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while call_id is None or not replied(call_id):
            if self._state is LoopState.DEAD or time.monotonic() > deadline:
                raise EngineUnavailableError(f"the engine did not answer within {timeout_s:.0f} s")
            await asyncio.sleep(INTEGRITY_POLL_S)

    def _check_closed_engine(self) -> dict[str, int]:
        client = self.client
        try:
            call_id = client.send_integrity_check()
            client.read_outputs()
            replied = client.integrity_replied(call_id)
        except Exception as error:  # noqa: BLE001 - EngineError: the engine went with its client
            raise EngineUnavailableError(f"the engine is not running ({self._state.value})") from error
        if not replied:
            raise EngineUnavailableError(f"the engine is not running ({self._state.value})")
        client.take_integrity_reply(call_id)
        return self._block_counts()

    def _block_counts(self) -> dict[str, int]:
        s = self.client.get_stats()
        return {"num_free_blocks": s.num_free_blocks, "num_total_blocks": s.num_total_blocks,
                "num_running": s.num_running, "num_waiting": s.num_waiting}

    async def drain(self, timeout_s: float) -> None:
        """Refuse new requests, let running ones finish for up to `timeout_s`, abort the rest."""
        if self._state is LoopState.RUNNING:
            self._state = LoopState.DRAINING
        deadline = time.monotonic() + timeout_s
        while self._streams and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for stream in list(self._streams.values()):
            stream._fail(EngineUnavailableError("the server is shutting down"))
            self._abort(stream.request_id)

    async def shutdown(self, drain_timeout_s: float = 0.0) -> None:
        await self.drain(drain_timeout_s)
        self.stop()
        await asyncio.to_thread(self.wait_stopped, 10.0)

    def stop(self) -> None:
        """Stop reading the engine and close it (in a thread: see wait_stopped). Pending streams fail."""
        if self._state is not LoopState.DEAD:
            self._state = LoopState.STOPPED
        self._stop = True
        self._call_on_loop(self._stop_on_loop)

    def wait_stopped(self, timeout_s: float = 10.0) -> None:
        """Wait up to `timeout_s` for the engine to be closed after stop() or its death (from any thread)."""
        if self._stop:
            self._client_closed.wait(timeout_s)

    # ---- requests ------------------------------------------------------------------------------
    async def add_request(self, request_id: str, prompt: str | list[int], sampling_params: SamplingParams,
                          *, arrival_time: float | None = None) -> RequestStream:
        """Queue a request; returns its stream.

        Raises QueueFullError (queue at its limit), EngineUnavailableError (not running),
        ValueError (the request can never run: the message says why), EngineRequestError
        (the engine could not take it)."""
        if self._state is not LoopState.RUNNING:
            raise EngineUnavailableError(f"the engine is not accepting requests ({self._state.value})")
        loop = self._bind_here()
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        # the adds the stats do not show yet fill the free running slots first, then the queue
        stats = self.stats
        running_room = max(0, self.max_running - stats.num_running)
        num_waiting = max(0, stats.num_waiting + self._num_added - self.client.num_adds_applied - running_room)
        if num_waiting >= self.max_waiting_requests:
            raise QueueFullError(num_waiting, self.max_waiting_requests, self.retry_after_s)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        try:
            self.client.add_request(request_id, prompt, sampling_params, arrival_time=arrival)
        except ValueError:
            raise
        except Exception as error:  # noqa: BLE001 - one bad request must not end the engine
            logger.exception("add_request failed")
            raise EngineRequestError(f"the engine could not take this request ({type(error).__name__})") from None
        stream = RequestStream(request_id, self._abort, loop)
        self._streams[request_id] = stream
        self._num_added += 1
        if not self._hold_adds and self._engine_stepping():
            self._flush_commands()  # its next step takes it (see the module docstring)
        elif not self._flush_scheduled:
            self._flush_scheduled = True
            loop.call_soon(self._flush_commands)
        return stream

    def _abort(self, request_id: str) -> None:
        if self._streams.pop(request_id, None) is not None and not self._stop:
            self._engine_call(self.client.abort_request, request_id)

    def _engine_stepping(self) -> bool:
        """Whether the engine has requests, as far as this side knows: its last stats say so,
        or it has not taken every add sent yet."""
        stats = self.stats
        client = self.client
        return bool(stats.num_running or stats.num_waiting or client.num_adds_sent > client.num_adds_applied)

    def _flush_commands(self) -> None:
        self._flush_scheduled = False
        if not self._stop:
            self._engine_call(self.client.flush_commands)

    def _engine_call(self, fn, *args):
        """fn(*args) on the client; an engine that is gone ends the loop (and returns None)."""
        try:
            return fn(*args)
        except Exception as error:  # noqa: BLE001 - EngineError: its process or thread is gone
            self._die(error)
            return None

    # ---- reading the engine (the event loop) ---------------------------------------------------
    def _bind_here(self) -> asyncio.AbstractEventLoop:
        """The running loop, which reads the engine from now on (the first caller's, or a new
        one after the last stopped)."""
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            if self._loop is not None and self._loop.is_running():
                raise RuntimeError("AsyncLLMEngine is bound to another event loop")
            self._bind(loop)
        return loop

    def _bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self._detach_loop()
        loop.add_reader(self.client.outputs_fd, self._on_engine_output)
        self._tick = loop.call_later(self.heartbeat_s, self._on_tick)
        self._loop = loop

    def _on_engine_output(self) -> None:
        """Outputs arrived (or the tick, or a check's reply): hand off what came."""
        if self._stop:
            return
        client = self.client
        read_before = client.num_steps_read
        deltas = self._engine_call(client.read_outputs)
        if deltas is None:
            return
        self._num_steps += client.num_steps_read - read_before
        self._count_failed_step(deltas)
        self.stats = stats = self._snapshot()
        if stats.num_preemptions_total != self._preemptions_logged:
            self._log_preemptions(stats)
        if deltas:
            self._hand_off(deltas)

    def _hand_off(self, deltas: list[RequestDelta]) -> None:
        """Push every delta to its stream, then flush the streams that asked for it once."""
        streams, flushes = self._streams, []
        for delta in deltas:
            stream = streams.get(delta.request_id)
            if stream is None:  # aborted by its reader; nobody listens
                continue
            if stream._push(delta):
                flushes.append(stream)
            if delta.finished:
                del streams[delta.request_id]
        for stream in flushes:
            stream._flush()

    def _on_tick(self) -> None:
        """Every `heartbeat_s`: the stats (an idle engine sends none) and liveness."""
        self._on_engine_output()
        if not self._stop:
            self._tick = self._loop.call_later(self.heartbeat_s, self._on_tick)

    def _snapshot(self) -> AsyncEngineStats:
        return AsyncEngineStats.of(self.client.get_stats(), self._num_steps, self.client.heartbeat())

    def _count_failed_step(self, deltas: list[RequestDelta]) -> None:
        error = self.client.last_error
        if error is not None and error is not self._last_error_seen:
            self._last_error_seen = error
            self.num_failed_steps += 1
        elif any(delta.new_token_ids for delta in deltas):
            self.num_failed_steps = 0

    def _log_preemptions(self, stats: AsyncEngineStats) -> None:
        now = time.monotonic()
        if now - self._preemption_logged_at < self.preemption_log_interval_s:
            return
        new = stats.num_preemptions_total - self._preemptions_logged
        self._preemptions_logged, self._preemption_logged_at = stats.num_preemptions_total, now
        logger.warning("KV cache full: %d request(s) preempted (recomputed later) since the last report, "
                       "%d in total; %d running, %d waiting, %d of %d blocks free", new,
                       stats.num_preemptions_total, stats.num_running, stats.num_waiting, stats.num_free_blocks,
                       stats.num_total_blocks)

    # ---- the end -------------------------------------------------------------------------------
    def _call_on_loop(self, fn) -> None:
        """fn() on the event loop: now when called there or while it is not running."""
        loop = self._loop
        if loop is not None and loop.is_running() and _running_loop() is not loop:
            loop.call_soon_threadsafe(fn)
        else:
            fn()

    def _detach_loop(self) -> None:
        if self._tick is not None:
            self._tick.cancel()
            self._tick = None
        if self._loop is None:
            return
        try:
            self._loop.remove_reader(self.client.outputs_fd)
        except (RuntimeError, ValueError, OSError):  # the loop is closed already
            pass

    def _stop_on_loop(self) -> None:
        self._end(EngineUnavailableError("the engine was stopped"))

    def _die(self, error: BaseException) -> None:
        if self._closer is not None:
            return
        logger.error("engine lost: %r", error)
        self.dead_error = error
        self._state = LoopState.DEAD
        self._stop = True
        self._end(error)

    def _end(self, error: BaseException) -> None:
        """Stop reading the engine, fail the open streams with `error` and close the client in
        a thread (closing waits for the engine to stop: not on the event loop). Once only."""
        if self._closer is not None:
            return
        self._detach_loop()
        for stream in list(self._streams.values()):
            stream._fail(EngineUnavailableError(f"the engine loop died: {error!r}"))
        self._streams.clear()
        self._closer = threading.Thread(target=self._close_client, name="roseray-engine-close", daemon=True)
        self._closer.start()

    def _close_client(self) -> None:
        try:
            self.client.close()
        except Exception:  # noqa: BLE001 - the engine is ending anyway
            logger.exception("closing the engine failed")
        finally:
            self._client_closed.set()


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
