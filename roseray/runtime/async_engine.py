"""AsyncLLMEngine: an LLMEngine driven by a background thread, fed from asyncio.

The engine is not thread-safe, so exactly one thread (the engine loop) ever calls it.
Requests enter from the asyncio side through a command queue drained at the top of
each loop iteration; each request gets a `RequestStream` of its deltas. After every
step the loop makes ONE hand-off to asyncio (the whole step's admissions and deltas),
never one per token. Hand-offs queue up while the event loop is busy and are taken
together by one callback, whose streams flush once at its end: an attached stream (SSE)
then writes several steps' tokens in one `send`, so a server that falls behind does less
work per token instead of more. With no work the loop sleeps on an event (no spinning)
and wakes every `heartbeat_s` to prove it is alive.

An engine in another process (EngineProcessClient) is driven by the event loop itself when
`start()` runs on one: no loop thread. The loop reads each step's message when the output
pipe is readable and applies it right there (the same hand-off code). While the engine
is idle, the adds of one loop iteration go as one message at its end (a burst's first
step schedules them together); while it steps, each add goes at once: the engine process
takes commands between steps, and an add held to the end of an iteration that admits a
dozen requests and writes a step's streams misses steps it could have made (an HTTP burst
of 128 on the H100: mean queue time ~2.6 -> ~1.2 ms, BENCHMARKS.md). A thread would
have to win the GIL back from a busy event loop after every pipe read and write (a convoy):
while an API process admitted a burst, its adds reached the engine 1-4 ms late, and the
burst took steps more (issue 4).

A stream that is closed early (cancelled handler, client gone) aborts its request;
the abort is applied at the top of the next iteration, so its KV blocks are free
within one step.

Preemptions (KV cache full: the newest running request is recomputed later) are counted
by the scheduler and logged here, at most once per `preemption_log_interval_s`, with the
number since the last line. `check_integrity()` runs the engine's accounting check on
the loop thread, between two steps.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import enum
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from roseray import envs
from roseray.config import EngineConfig
from roseray.engine.engine import LLMEngine
from roseray.engine.request import RequestDelta
from roseray.runtime.engine_process import EngineProcessClient, freeze_startup_objects
from roseray.runtime.request_stream import EngineRequestError, EngineUnavailableError, QueueFullError, RequestStream
from roseray.sampling_params import SamplingParams

__all__ = ["AsyncLLMEngine", "AsyncEngineStats", "EngineRequestError", "EngineUnavailableError", "LoopState",
           "QueueFullError", "RequestStream"]

logger = logging.getLogger(__name__)

INTEGRITY_POLL_S = 0.002  # how often check_integrity looks for its reply, driven by the event loop


class LoopState(enum.Enum):
    NEW = "new"
    RUNNING = "running"
    DRAINING = "draining"
    STOPPED = "stopped"
    DEAD = "dead"  # the loop raised; the engine's state can no longer be trusted


class SteppableEngine(Protocol):
    """What AsyncLLMEngine needs from roseray.engine.engine.LLMEngine."""

    def add_request(self, request_id: str, prompt: str | list[int], sampling_params: SamplingParams, *,
                    arrival_time: float | None = None) -> Any: ...
    def abort_request(self, request_id: str) -> None: ...
    def step(self) -> list[RequestDelta]: ...
    def has_unfinished_requests(self) -> bool: ...
    def get_stats(self) -> Any: ...


@dataclass(frozen=True, slots=True)
class AsyncEngineStats:
    """A snapshot published by the engine loop after every iteration (read from any thread)."""

    num_running: int = 0
    num_waiting: int = 0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_hits: int = 0
    prefix_cache_queries: int = 0
    num_preemptions_total: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    num_steps_total: int = 0  # this loop's steps (with an engine process: the step messages it read)
    engine_steps_total: int = 0  # the engine's own, and where its time went (EngineStats)
    engine_step_seconds_total: float = 0.0
    engine_output_seconds_total: float = 0.0
    last_heartbeat: float = 0.0  # time.monotonic() of the loop's last step or idle wake-up

    @property
    def queue_depth(self) -> int:
        return self.num_running + self.num_waiting


class AsyncLLMEngine:
    """Owns the engine loop thread and the per-request streams.

    `add_request` must be awaited on one event loop (the first caller's), which is where
    every hand-off lands. `stats` may be read from any thread.
    """

    def __init__(self, engine: SteppableEngine, *, max_waiting_requests: int, retry_after_s: int = 1,
                 heartbeat_s: float = 1.0, stuck_after_s: float = 60.0, max_failed_steps: int = 3,
                 preemption_log_interval_s: float = 10.0, max_running: int = 0) -> None:
        self.engine = engine
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
        self.num_failed_steps = 0  # consecutive steps whose forward raised (engine.last_error changed)
        self._last_error_seen: BaseException | None = None
        self._commands: collections.deque = collections.deque()  # appended by asyncio, popped by the loop
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._state = LoopState.NEW
        self._stop = False
        self._streams: dict[str, RequestStream] = {}
        self._hand_offs: collections.deque = collections.deque()  # appended by the loop, taken by asyncio
        self._hand_offs_scheduled = False  # a callback that takes them is on its way to asyncio
        self._num_unacked = 0  # adds sent to the loop and not yet covered by a hand-off's stats
        self._queue_stats = AsyncEngineStats()  # stats as of the last hand-off (asyncio side)
        self.stats = AsyncEngineStats(last_heartbeat=time.monotonic())
        self.dead_error: BaseException | None = None
        # when the engine last made progress: an engine in another process says so itself
        self._heartbeat: Callable[[], float] = getattr(engine, "heartbeat", time.monotonic)
        # ends an engine process client's wait for a step message (any thread may call it)
        self._wake_engine: Callable[[], None] | None = getattr(engine, "wake", None)
        # driven by the event loop (an engine process client, started on a running loop)
        self._on_loop = False
        self._flush_scheduled = False  # a _flush_commands call is on its way
        self._tick: asyncio.TimerHandle | None = None
        self._num_steps = 0  # step messages read (the event loop's num_steps_total)
        self._flushed = [0, 0]  # adds sent since the last read of step messages, and before it
        # an A/B switch: "iteration" holds every add to the end of its loop iteration, as before the
        # adds of a stepping engine went at once
        self._hold_adds = envs.add_flush() == "iteration"

    @classmethod
    def from_engine_config(cls, config: EngineConfig, **kwargs) -> AsyncLLMEngine:
        """Load the model and wrap it; the loop starts with `start()`. With
        `config.engine_process` (the default on CUDA) the model lives in a child process
        (EngineProcessClient), else in this one (LLMEngine)."""
        engine = EngineProcessClient(config) if config.resolve_engine_process() else LLMEngine(config)
        return cls(engine, max_waiting_requests=config.max_waiting_requests, max_running=config.max_num_seqs,
                   **kwargs)

    # ---- lifecycle ------------------------------------------------------------------------
    def start(self) -> None:
        if self._state is not LoopState.NEW:
            return
        self._state = LoopState.RUNNING
        freeze_startup_objects()
        self.stats = self._snapshot(0)
        loop = _running_loop()
        if loop is not None and hasattr(self.engine, "read_outputs"):
            self._on_loop = True
            self._bind(loop)
            return
        self._thread = threading.Thread(target=self._run, name="roseray-engine-loop", daemon=True)
        self._thread.start()

    @property
    def state(self) -> LoopState:
        return self._state

    @property
    def is_ready(self) -> bool:
        return self._state is LoopState.RUNNING and self.is_alive

    @property
    def is_alive(self) -> bool:
        """The loop (thread, or event loop's reader) runs and has stepped or woken within `stuck_after_s`."""
        if self._on_loop:
            running = self._state in (LoopState.RUNNING, LoopState.DRAINING)
        else:
            running = self._thread is not None and self._thread.is_alive()
        return running and time.monotonic() - self.stats.last_heartbeat < self.stuck_after_s

    def check_health(self) -> None:
        """Raise if the loop is dead or stuck, or the model fails step after step (a sticky
        device error): Ray Serve's check_health contract, so that the replica is replaced."""
        if self._state is LoopState.DEAD:
            raise RuntimeError(f"engine loop died: {self.dead_error!r}")
        if self.num_failed_steps >= self.max_failed_steps:
            raise RuntimeError(f"the last {self.num_failed_steps} engine steps failed: "
                               f"{getattr(self.engine, 'last_error', None)!r}")
        if self._state in (LoopState.RUNNING, LoopState.DRAINING) and not self.is_alive:
            stalled = time.monotonic() - self.stats.last_heartbeat
            raise RuntimeError(f"engine loop is stuck: no step or heartbeat for {stalled:.1f} s "
                               f"(limit {self.stuck_after_s:.0f} s)")

    @property
    def num_active_requests(self) -> int:
        return len(self._streams)

    def run_on_engine_thread(self, fn: Callable[[SteppableEngine], Any]) -> asyncio.Future:
        """Run `fn(engine)` on the loop thread between two steps (where the engine may be
        touched); await the returned future for its result. Without a running loop thread
        (not started, stopped, dead, or driven by the event loop: call it from that loop)
        `fn` runs here, at once."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        if self._thread is None or not self._thread.is_alive() or self._stop:
            _run_call(fn, self.engine, future)
        else:
            self._commands.append(("call", fn, future))
            self._signal()
        return asyncio.wrap_future(future)

    async def check_integrity(self, timeout_s: float = 30.0) -> dict[str, int]:
        """Assert the engine's KV accounting (free + used = total, ref counts equal the block
        tables, no orphan rows or requests) on the loop thread; returns the block counts."""
        def counts(engine) -> dict[str, int]:
            s = engine.get_stats()
            return {"num_free_blocks": s.num_free_blocks, "num_total_blocks": s.num_total_blocks,
                    "num_running": s.num_running, "num_waiting": s.num_waiting}

        def check(engine) -> dict[str, int]:
            engine.check_integrity()
            return counts(engine)

        if self._on_loop and not self._stop:  # ask, and let the reader take the reply: the loop never waits
            engine = self.engine
            call_id = engine.send_integrity_check()
            deadline = time.monotonic() + timeout_s
            while not engine.integrity_replied(call_id):
                if self._state is LoopState.DEAD or time.monotonic() > deadline:
                    raise EngineUnavailableError(f"the engine process did not answer within {timeout_s:.0f} s")
                await asyncio.sleep(INTEGRITY_POLL_S)
            engine.take_integrity_reply(call_id)
            return counts(engine)
        return await asyncio.wait_for(self.run_on_engine_thread(check), timeout_s)

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
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 10.0)

    def stop(self) -> None:
        """Stop the loop thread (does not wait). Pending streams fail."""
        if self._state is not LoopState.DEAD:
            self._state = LoopState.STOPPED
        self._stop = True
        if self._on_loop:
            self._call_on_loop(self._stop_on_loop)
            return
        self._signal()

    # ---- requests (asyncio side) -----------------------------------------------------------
    async def add_request(self, request_id: str, prompt: str | list[int], sampling_params: SamplingParams,
                          *, arrival_time: float | None = None) -> RequestStream:
        """Queue a request; returns its stream once the engine accepted it.

        Raises QueueFullError (queue at its limit), EngineUnavailableError (not running),
        ValueError (the engine rejected the request: the message says why)."""
        if self._state is not LoopState.RUNNING:
            raise EngineUnavailableError(f"the engine is not accepting requests ({self._state.value})")
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            if self._loop is not None and self._loop.is_running():
                raise RuntimeError("AsyncLLMEngine is bound to another event loop")
            self._bind(loop)  # the first caller's loop, or a new one after the last stopped
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        # the adds the loop has not taken yet fill the free running slots first, then the queue
        running_room = max(0, self.max_running - self._queue_stats.num_running)
        num_waiting = max(0, self._queue_stats.num_waiting + self._num_unacked - running_room)
        if num_waiting >= self.max_waiting_requests:
            raise QueueFullError(num_waiting, self.max_waiting_requests, self.retry_after_s)
        stream = RequestStream(request_id, self, loop)
        self._streams[request_id] = stream
        self._num_unacked += 1
        arrival = time.monotonic() if arrival_time is None else arrival_time
        if self._on_loop:
            self._add_on_loop(stream, prompt, sampling_params, arrival)
            return stream
        self._commands.append(("add", request_id, prompt, sampling_params, arrival))
        self._signal()
        try:
            await stream._admitted
        except BaseException:
            if not stream.finished:  # cancelled while waiting for admission
                stream.close()
            self._streams.pop(request_id, None)
            raise
        return stream

    def _abort(self, request_id: str) -> None:
        if self._streams.pop(request_id, None) is not None and self._state is not LoopState.DEAD:
            if self._on_loop:
                if not self._stop:
                    self._engine_call(self.engine.abort_request, request_id)
                return
            self._commands.append(("abort", request_id))
            self._signal()

    def _signal(self) -> None:
        """A command is queued: wake the loop whether it sleeps idle (the event) or waits
        inside an engine process's step for the next step message (`engine.wake`), so the
        command reaches the engine before its next step instead of the one after."""
        self._wake.set()
        if self._wake_engine is not None:
            self._wake_engine()

    # ---- hand-off (runs on the event loop) ----------------------------------------------------
    def _take_hand_offs(self) -> None:
        """Apply every hand-off queued since the last call, then flush the streams they
        touched (cleared first: a hand-off queued meanwhile schedules another call)."""
        self._hand_offs_scheduled = False
        hand_offs, flushes = self._hand_offs, []
        while hand_offs:
            self._on_step(*hand_offs.popleft(), flushes)
        for stream in flushes:
            stream._flush()

    def _on_step(self, admissions: list[tuple[str, BaseException | None]], deltas: list[RequestDelta],
                 stats: AsyncEngineStats, num_drained: int, flushes: list[RequestStream]) -> None:
        self._num_unacked -= num_drained
        self._queue_stats = stats
        streams = self._streams
        for request_id, error in admissions:
            stream = streams.get(request_id)
            if stream is None:
                continue
            if error is not None:
                streams.pop(request_id, None)
                stream._fail(error)
            elif not stream._admitted.done():
                stream._admitted.set_result(None)
        for delta in deltas:
            stream = streams.get(delta.request_id)
            if stream is None:  # aborted by its reader; nobody listens
                continue
            if stream._push(delta):
                flushes.append(stream)
            if delta.finished:
                del streams[delta.request_id]

    def _on_dead(self, error: BaseException) -> None:
        for stream in list(self._streams.values()):
            stream._fail(EngineUnavailableError(f"the engine loop died: {error!r}"))
        self._streams.clear()

    # ---- driven by the event loop (an engine process client) ---------------------------------
    def _bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Deliver to `loop` from now on (driven by the event loop: read the engine there)."""
        if self._on_loop:
            if self._loop is not None:
                self._detach_loop()
            loop.add_reader(self.engine.outputs_fd, self._on_engine_output)
            self._tick = loop.call_later(self.heartbeat_s, self._on_tick)
        self._loop = loop

    def _add_on_loop(self, stream: RequestStream, prompt, sampling_params: SamplingParams, arrival: float) -> None:
        """Check the add and send it: now while the engine steps, else at this loop iteration's end."""
        request_id = stream.request_id
        try:
            self.engine.add_request(request_id, prompt, sampling_params, arrival_time=arrival)
        except BaseException as error:
            self._streams.pop(request_id, None)
            self._num_unacked -= 1
            stream._finished = True
            if isinstance(error, ValueError):
                raise
            logger.exception("add_request failed")
            raise EngineRequestError(f"the engine could not take this request ({type(error).__name__})") from None
        stream._admitted.set_result(None)
        if not self._hold_adds and self._engine_stepping():
            self._flush_commands()  # its next step takes it (see the module docstring)
        elif not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush_commands)

    def _engine_stepping(self) -> bool:
        """Whether the engine process has requests, as far as this side knows: its last
        stats say so, or adds went since the step messages before the last read."""
        stats = self.stats
        return bool(stats.num_running or stats.num_waiting or self._flushed[0] or self._flushed[1])

    def _flush_commands(self) -> None:
        self._flush_scheduled = False
        if not self._stop:
            self._flushed[0] += self._engine_call(self.engine.flush_commands) or 0

    def _engine_call(self, fn, *args):
        """fn(*args) on the engine client; a gone engine process ends the loop."""
        try:
            return fn(*args)
        except Exception as error:  # noqa: BLE001 - EngineProcessError: the pipe is gone
            self._die(error)
            return None

    def _on_engine_output(self) -> None:
        """The output pipe is readable (or the tick, or a call's reply came): apply what came."""
        if self._stop:
            return
        engine = self.engine
        read_before = engine.messages_read
        deltas = self._engine_call(engine.read_outputs)
        if deltas is None:
            return
        num_acked = 0
        if engine.messages_read != read_before:
            self._num_steps += engine.messages_read - read_before
            # the adds sent before the previous read are in these messages' stats
            num_acked, self._flushed = self._flushed[1], [0, self._flushed[0]]
        self._count_failed_step(deltas)
        self.stats = stats = self._snapshot(self._num_steps)
        if stats.num_preemptions_total != self._preemptions_logged:
            self._log_preemptions(stats)
        if deltas or num_acked:
            self._hand_offs.append(([], deltas, stats, num_acked))
            self._take_hand_offs()

    def _on_tick(self) -> None:
        """Every `heartbeat_s`: the stats (an idle engine sends none) and liveness."""
        self._on_engine_output()
        if not self._stop:
            self._tick = self._loop.call_later(self.heartbeat_s, self._on_tick)

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
            self._loop.remove_reader(self.engine.outputs_fd)
        except (RuntimeError, ValueError, OSError):  # the loop is closed already
            pass

    def _stop_on_loop(self) -> None:
        self._end_on_loop(EngineUnavailableError("the engine was stopped"))

    def _die(self, error: BaseException) -> None:
        if self._thread is not None:
            return
        logger.error("engine process lost: %r", error)
        self.dead_error = error
        self._state = LoopState.DEAD
        self._stop = True
        self._end_on_loop(error)

    def _end_on_loop(self, error: BaseException) -> None:
        """Stop reading the engine, fail the open streams with `error` and close the engine
        process in a thread (closing waits for it to exit: not on the event loop; shutdown
        joins that thread). Once only: the thread marks it done."""
        if self._thread is not None:
            return
        self._detach_loop()
        self._on_dead(error)
        self._thread = threading.Thread(target=self._close_engine, name="roseray-engine-close", daemon=True)
        self._thread.start()

    # ---- the loop (engine thread) ----------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        num_steps = 0
        try:
            while not self._stop:
                admissions: list[tuple[str, BaseException | None]] = []
                num_drained = self._drain_commands(admissions)
                if not engine.has_unfinished_requests():
                    self.stats = self._snapshot(num_steps)
                    if self.stats.num_preemptions_total != self._preemptions_logged:
                        self._log_preemptions(self.stats)  # the rest of a burst, once its interval is over
                    if admissions or num_drained:
                        self._hand_off(admissions, [], self.stats, num_drained)
                        continue
                    self._wake.wait(self.heartbeat_s)
                    self._wake.clear()
                    continue
                deltas = engine.step()
                num_steps += 1
                self._count_failed_step(deltas)
                self.stats = self._snapshot(num_steps)
                if self.stats.num_preemptions_total != self._preemptions_logged:
                    self._log_preemptions(self.stats)
                self._hand_off(admissions, deltas, self.stats, num_drained)
        except BaseException as error:  # noqa: BLE001 - the loop must report any failure
            logger.exception("engine loop died")
            self.dead_error = error
            self._state = LoopState.DEAD
            self._run_pending_calls()
            self._close_engine()
            self._call_loop(self._on_dead, error)
            return
        self._run_pending_calls()
        self._close_engine()
        if self._loop is not None:
            self._call_loop(self._on_dead, EngineUnavailableError("the engine was stopped"))

    def _run_pending_calls(self) -> None:
        """The loop is ending: answer the run_on_engine_thread calls it will never reach."""
        for command in list(self._commands):
            if command[0] == "call":
                _run_call(command[1], self.engine, command[2])

    def _close_engine(self) -> None:
        close = getattr(self.engine, "close", None)  # an engine process is stopped with the loop
        if close is not None:
            try:
                close()
            except Exception:  # noqa: BLE001 - the loop is ending anyway
                logger.exception("closing the engine failed")

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

    def _count_failed_step(self, deltas: list[RequestDelta]) -> None:
        error = getattr(self.engine, "last_error", None)
        if error is not None and error is not self._last_error_seen:
            self._last_error_seen = error
            self.num_failed_steps += 1
        elif any(delta.new_token_ids for delta in deltas):
            self.num_failed_steps = 0

    def _drain_commands(self, admissions: list) -> int:
        commands, engine, num_adds = self._commands, self.engine, 0
        while commands:
            command = commands.popleft()
            if command[0] == "add":
                _, request_id, prompt, params, arrival = command
                num_adds += 1
                try:
                    engine.add_request(request_id, prompt, params, arrival_time=arrival)
                    admissions.append((request_id, None))
                except ValueError as error:
                    admissions.append((request_id, error))
                except Exception as error:  # noqa: BLE001 - one bad request must not end the loop
                    logger.exception("add_request failed")
                    engine.abort_request(request_id)  # in case it got in before failing
                    admissions.append((request_id, EngineRequestError(
                        f"the engine could not take this request ({type(error).__name__})")))
            elif command[0] == "call":
                _run_call(command[1], engine, command[2])
            else:
                engine.abort_request(command[1])
        return num_adds

    def _snapshot(self, num_steps: int) -> AsyncEngineStats:
        s = self.engine.get_stats()
        return AsyncEngineStats(
            num_running=s.num_running, num_waiting=s.num_waiting, num_free_blocks=s.num_free_blocks,
            num_total_blocks=s.num_total_blocks, kv_cache_usage=s.kv_cache_usage,
            prefix_cache_hits=s.prefix_cache_hits, prefix_cache_queries=s.prefix_cache_queries,
            num_preemptions_total=s.num_preemptions_total, prompt_tokens_total=s.prompt_tokens_total,
            generation_tokens_total=s.generation_tokens_total, num_steps_total=num_steps,
            engine_steps_total=s.engine_steps_total, engine_step_seconds_total=s.step_seconds_total,
            engine_output_seconds_total=s.output_seconds_total, last_heartbeat=self._heartbeat())

    def _hand_off(self, admissions, deltas, stats, num_drained) -> None:
        if admissions or deltas or num_drained:
            self._hand_offs.append((admissions, deltas, stats, num_drained))
            if not self._hand_offs_scheduled:
                self._hand_offs_scheduled = True
                self._call_loop(self._take_hand_offs)

    def _call_loop(self, fn, *args) -> None:
        loop = self._loop
        if loop is None:
            return
        try:
            loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def _run_call(fn, engine, future: concurrent.futures.Future) -> None:
    """future's result (or error) of fn(engine), unless it was cancelled."""
    if future.set_running_or_notify_cancel():
        try:
            future.set_result(fn(engine))
        except BaseException as error:  # noqa: BLE001 - handed to the awaiting caller
            future.set_exception(error)
