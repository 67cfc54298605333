"""EngineProcessClient: the engine in a child process (engine_process.py), over a pipe pair.

Requests are named by short handles ("0", "1", ...) that this client maps back to the
server's request ids; the engine names them by this client's prefix and the handle (the
prefix comes with Ready). Adds are held and sent as one AddRequests by flush_commands; an
abort or an integrity check sends them first. Every step message is read whole and the
deltas under this client's prefix are kept (a shared engine sends each step to every
client that had a request in it). If the child dies, the output pipe ends: read_outputs
raises EngineError and the async engine reports the loop dead (503, health fails); so does
an EngineFailed message (the engine ended on an error, e.g. a dead tensor-parallel rank).
"""

from __future__ import annotations

import select
import subprocess
import time
from multiprocessing.connection import Connection

from roseray.config import EngineConfig
from roseray.engine.outputs import RequestDelta, RequestSummary
from roseray.models.loader import load_model_config
from roseray.runtime.engine_client import EngineClient, EngineError
from roseray.runtime.engine_process import spawn_engine_process
from roseray.runtime.messages import (
    AbortRequest,
    AddRequests,
    CheckIntegrity,
    EngineFailed,
    GetKVEvents,
    IntegrityReply,
    KVEventsReply,
    Ready,
    StartFailed,
    StepOutputs,
    Stop,
    decode,
)
from roseray.sampling_params import SamplingParams
from roseray.tokenizer import load_tokenizer


class EngineProcessClient(EngineClient):
    """`EngineProcessClient(config)` spawns a child of its own; `pipe_fds` (the command pipe's
    write end, the output pipe's read end) speaks to a child that another process started
    for several clients (the supervisor of `roseray serve --api-processes N`, a Ray
    replica), which this client then neither waits for nor kills: it only sends Stop."""

    def __init__(self, config: EngineConfig, *, pipe_fds: tuple[int, int] | None = None,
                 start_timeout_s: float | None = None) -> None:
        model_config = load_model_config(config.model, revision=config.revision, load_format=config.load_format)
        tokenizer = load_tokenizer(config.tokenizer, model_config)
        if pipe_fds is None:
            self._process, pipe_fds = self._spawn(config)
        else:  # a shared child: the process is not ours
            self._process = None
        self._commands = Connection(pipe_fds[0], readable=False)
        self._outputs = Connection(pipe_fds[1], writable=False)
        self._outputs_fd = self._outputs.fileno()
        self._output_poller = select.poll()  # read_outputs(): is a message there now?
        self._output_poller.register(self._outputs_fd, select.POLLIN)
        self._closed = False
        ready = self._wait_ready(start_timeout_s)
        super().__init__(config, tokenizer, ready.model_name, ready.limits)
        self._prefix = ready.client_prefix  # of this client's requests' names in step messages
        self._index = ready.client_index  # of this client's count in StepOutputs.adds_applied
        self.pid = ready.pid
        self._handles: dict[str, str] = {}  # request id -> its handle
        # name in step messages (prefix + handle) -> (request id, prompt length, arrival)
        self._requests: dict[str, tuple[str, int, float]] = {}
        self._next_handle = 0
        self._adds = AddRequests([], [], [], [])  # held until flush_commands
        self._last_message = time.monotonic()

    @staticmethod
    def _spawn(config: EngineConfig) -> tuple[subprocess.Popen, tuple[int, int]]:
        process, [pipe_fds] = spawn_engine_process(config)
        return process, pipe_fds

    def _wait_ready(self, timeout_s: float | None) -> Ready:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self._outputs.poll(0.5):
            if self._process is not None and self._process.poll() is not None:
                raise EngineError(f"the engine process exited with code {self._process.returncode} "
                                  "before it was ready (its log says why)")
            if deadline is not None and time.monotonic() > deadline:
                self.close()
                raise EngineError(f"the engine process was not ready within {timeout_s:.0f} s")
        try:
            message = decode(self._outputs.recv_bytes())
        except (EOFError, OSError):
            raise EngineError("the engine process exited before it was ready (its log says why)") from None
        if isinstance(message, StartFailed):
            if self._process is not None:
                self._process.wait(10)
            raise (ValueError if message.error_type == "ValueError" else EngineError)(message.message)
        if not isinstance(message, Ready):
            raise EngineError(f"the engine process sent {type(message).__name__} before Ready")
        return message

    # ---- EngineClient ------------------------------------------------------------------------
    @property
    def outputs_fd(self) -> int:
        return self._outputs_fd

    def add_request(self, request_id: str, prompt: str | list[int], sampling_params: SamplingParams, *,
                    arrival_time: float | None = None) -> None:
        token_ids, arrival = self._admit(request_id, self._handles, prompt, sampling_params, arrival_time)
        handle = str(self._next_handle)
        self._next_handle += 1
        adds = self._adds
        adds.handles.append(handle)
        adds.token_ids.append(token_ids)
        adds.params.append(sampling_params)
        adds.arrival_times.append(arrival)
        self._handles[request_id] = handle
        self._requests[self._prefix + handle] = (request_id, len(token_ids), arrival)

    def flush_commands(self) -> int:
        num_adds = len(self._adds.handles)
        if num_adds:
            self._flush_adds()
        return num_adds

    def abort_request(self, request_id: str) -> None:
        handle = self._handles.get(request_id)
        if handle is not None:
            self._send(AbortRequest(handle).encode())

    def read_outputs(self) -> list[RequestDelta]:
        deltas: list[RequestDelta] = []
        while self._output_poller.poll(0):
            self._read(deltas)
        return deltas

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def send_integrity_check(self) -> int:
        call_id = next(self._call_ids)
        self._send(CheckIntegrity(call_id).encode())
        return call_id

    def send_kv_events_request(self, snapshot: bool = False) -> int:
        call_id = next(self._call_ids)
        self._send(GetKVEvents(call_id, snapshot).encode())
        return call_id

    def heartbeat(self) -> float:
        return self._last_message if self._requests else time.monotonic()

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the engine process (it finishes the step it is in); a shared one goes on
        while it has other clients."""
        if self._closed:
            return
        self._closed = True
        try:
            self._commands.send_bytes(Stop().encode())
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

    # ---- internals ---------------------------------------------------------------------------
    def _flush_adds(self) -> None:
        adds, self._adds = self._adds, AddRequests([], [], [], [])
        self._write(adds.encode())
        self.num_adds_sent += len(adds.handles)

    def _send(self, data: bytes) -> None:
        if self._adds.handles:  # an abort or a check must not overtake an add
            self._flush_adds()
        self._write(data)

    def _write(self, data: bytes) -> None:
        try:
            self._commands.send_bytes(data)
        except OSError as error:
            raise EngineError(f"the engine process is gone ({error})") from None

    def _read(self, deltas: list[RequestDelta]) -> None:
        try:
            message = decode(self._outputs.recv_bytes())
        except (EOFError, OSError):
            code = self._process.poll() if self._process is not None else None
            raise EngineError(f"the engine process is gone (exit code {code})") from None
        self._last_message = read_at = time.monotonic()
        if type(message) is not StepOutputs:
            self._read_other(message)
            return
        step: StepOutputs = message
        self.num_steps_read += 1
        self._stats, self.num_adds_applied = step.stats, step.adds_applied[self._index]
        if self.on_message_delay is not None:
            self.on_message_delay(read_at - step.sent_at)
        if step.error is not None:
            self.last_error = EngineError(step.error)
        requests = self._requests
        found = {} if step.finished or step.logprobs else None  # the message's index -> our delta
        for index, (name, tokens, text, num_output) in enumerate(
                zip(step.request_ids, step.token_ids, step.texts, step.num_output_tokens)):
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
        if found is None:
            return
        for index, logprobs in step.logprobs:
            delta = found.get(index)
            if delta is not None:
                delta.new_logprobs = [{int(token): value for token, value in entry} for entry in logprobs]
        for index, reason, first_scheduled_time, num_cached_tokens, stop_reason in step.finished:
            delta = found.get(index)
            if delta is None:
                continue
            delta.finished, delta.finish_reason = True, reason
            del self._handles[delta.request_id]
            arrival = requests.pop(step.request_ids[index])[2]
            delta.request = RequestSummary(arrival, first_scheduled_time, num_cached_tokens, stop_reason)

    def _read_other(self, message) -> None:
        """A reply, or the engine's end on an error (EngineError naming it: the async engine dies with it)."""
        if type(message) is IntegrityReply:
            self._replies[message.call_id] = message.failure
            self._stats, self.num_adds_applied = message.stats, message.adds_applied
        elif type(message) is KVEventsReply:
            self._kv_replies[message.call_id] = message.events
        elif type(message) is EngineFailed:
            raise EngineError(f"the engine process ended on an error: {message.message}")
        else:
            raise EngineError(f"the engine process sent {type(message).__name__} after Ready")
