"""One engine child shared by several clients (`roseray serve --api-processes N`): each
client's requests live in their own namespace (f"{client}.{handle}" in the engine and in
step messages), every step is encoded once and sent to each client with a request in it
(idle clients get only the stats), a client that stops or goes away has only its requests
aborted (their blocks freed), and the child ends with its last client. CPU, random:tiny."""

import fcntl
import os
import threading
import time
from multiprocessing.connection import Connection

import pytest

from roseray.config import EngineConfig
from roseray.engine.engine import LLMEngine
from roseray.engine.outputs import EngineStats
from roseray.runtime import engine_process
from roseray.runtime.engine_loop import ClientPipes, client_pipes, frame, serve_clients
from roseray.runtime.engine_process import COMMAND_PIPE_BYTES, OUTPUT_PIPE_BYTES, spawn_engine_process, widen_pipe
from roseray.runtime.messages import AddRequests, CheckIntegrity, IntegrityReply, StepOutputs, Stop, decode
from roseray.runtime.process_client import EngineProcessClient
from roseray.sampling_params import SamplingParams
from tests.runtime.client_helpers import check_integrity, run_to_end

PARAMS = {"temperature": 0.0, "ignore_eos": True}


def config(**overrides) -> EngineConfig:
    values = dict(model="random:tiny", device="cpu", num_kv_blocks=64, max_model_len=512, max_num_seqs=8,
                  async_scheduling=False)
    return EngineConfig(**{**values, **overrides})


class Pipes:
    """The client's ends of one client's pipe pair to `serve_clients` (run in a thread)."""

    def __init__(self) -> None:
        cmd_r, cmd_w = os.pipe()
        out_r, out_w = os.pipe()
        self.commands, self.outputs = Connection(cmd_w, readable=False), Connection(out_r, writable=False)
        self.child_ends = (Connection(cmd_r, writable=False), Connection(out_w, readable=False))

    def send(self, message) -> None:
        self.commands.send_bytes(message.encode())

    def add(self, prompt: list[int], max_tokens: int) -> None:
        """One request, handle "0" (each client its own namespace)."""
        self.send(AddRequests(["0"], [prompt], [SamplingParams(**PARAMS, max_tokens=max_tokens)], [0.0]))

    def read(self):
        return decode(self.outputs.recv_bytes())

    def read_until_finished(self, handles: set[str]) -> tuple[list, dict]:
        """Step messages until every request named in `handles` finished: (the messages, name -> delta
        fields); other clients' deltas in the messages are left out."""
        messages, outputs = [], {h: {"tokens": [], "reason": None} for h in handles}
        while any(outputs[h]["reason"] is None for h in handles):
            message = self.read()
            messages.append(message)
            if not isinstance(message, StepOutputs):
                continue
            for name, tokens in zip(message.request_ids, message.token_ids):
                if name in outputs:
                    outputs[name]["tokens"] += tokens if isinstance(tokens, list) else [tokens]
            for index, reason, *_ in message.finished:
                if message.request_ids[index] in outputs:
                    outputs[message.request_ids[index]]["reason"] = reason
        return messages, outputs


@pytest.fixture
def engine():
    return LLMEngine(config())


def start(engine, clients: list[Pipes]) -> threading.Thread:
    shared = client_pipes([pipes.child_ends for pipes in clients])
    thread = threading.Thread(target=serve_clients, args=(engine, shared), daemon=True)
    thread.start()
    return thread


def test_each_client_gets_only_its_own_deltas_from_a_shared_step(engine):
    a, b = Pipes(), Pipes()
    # the same handles from both clients, all admitted before the first step: one batch
    a.send(AddRequests(["0", "1"], [[1, 2, 3], [4, 5]], [SamplingParams(**PARAMS, max_tokens=6),
                                                        SamplingParams(**PARAMS, max_tokens=4)], [0.0, 0.0]))
    b.add([1, 2, 3], 5)
    thread = start(engine, [a, b])
    a_messages, a_out = a.read_until_finished({"0.0", "0.1"})
    b_messages, b_out = b.read_until_finished({"1.0"})
    assert a_messages[0].request_ids == ["0.0", "0.1", "1.0"]  # the first step ran all three
    assert a_messages[:len(b_messages)] == b_messages  # each step encoded once: the same message to both
    # a's requests and b's are kept apart by their prefixes: same handle, same prompt, different requests
    assert [len(a_out["0.0"]["tokens"]), len(a_out["0.1"]["tokens"]), len(b_out["1.0"]["tokens"])] == [6, 4, 5]
    assert b_out["1.0"]["tokens"] == a_out["0.0"]["tokens"][:5]  # same prompt, greedy: same tokens
    assert {a_out["0.0"]["reason"], a_out["0.1"]["reason"], b_out["1.0"]["reason"]} == {"length"}
    # b finished first: after its last step it gets no deltas, but the stats of the engine going idle
    assert all(set(m.request_ids) <= {"0.0", "0.1"} for m in a_messages[len(b_messages):])
    while b.outputs.poll(0.5):
        b_messages.append(b.read())
    assert b_messages[-1].request_ids == [] and b_messages[-1].stats == a_messages[-1].stats
    assert a_messages[-1].stats.num_running == 0
    a.send(Stop())
    b.send(Stop())
    thread.join(10)
    assert not thread.is_alive()  # the child's loop ends with its last client


def test_a_client_that_stops_or_goes_away_has_only_its_requests_aborted(engine):
    a, b, c = Pipes(), Pipes(), Pipes()
    a.add([1, 2, 3], 400)
    b.add([7, 8], 30)
    c.add([9, 9], 400)
    thread = start(engine, [a, b, c])
    assert a.read().request_ids == ["0.0", "1.0", "2.0"]  # running
    a.send(Stop())
    c.commands.close()  # c's process died: the child reads the end of its pipe
    _, b_out = b.read_until_finished({"1.0"})
    assert b_out["1.0"]["reason"] == "length" and len(b_out["1.0"]["tokens"]) == 30
    b.send(CheckIntegrity(1))
    reply = next(m for m in iter(b.read, None) if isinstance(m, IntegrityReply))
    assert (reply.call_id, reply.failure) == (1, None)
    stats = reply.stats  # nothing running, every block free: a's and c's were aborted
    assert stats.num_running == 0 and stats.num_free_blocks == stats.num_total_blocks
    assert not engine.requests
    b.send(Stop())
    thread.join(10)
    assert not thread.is_alive()


def test_an_idle_client_gets_the_stats_now_and_then_and_when_the_engine_goes_idle(engine):
    busy, idle = Pipes(), Pipes()
    busy.add([1, 2], 20)
    thread = start(engine, [busy, idle])
    busy.read_until_finished({"0.0"})
    last = None
    while idle.outputs.poll(1.0):
        last = idle.read()
        assert isinstance(last, StepOutputs) and last.request_ids == []  # never another client's deltas
    assert last is not None and last.stats.num_running == 0  # the last stats it got: the engine idle
    busy.send(Stop())
    idle.send(Stop())
    thread.join(10)


def test_clients_over_a_spawned_shared_child():
    """EngineProcessClient over the pipes of a child started for two clients: both get Ready,
    generate independently, and the child exits when both have closed."""
    process, fds = spawn_engine_process(config(), num_clients=2)
    first, second = (EngineProcessClient(config(), pipe_fds=pair) for pair in fds)
    try:
        assert first.pid == second.pid == process.pid
        first.add_request("x", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
        # the same request id in another client; it finishes first and asks for logprobs, so the
        # messages both read carry extras for a delta that is not the first client's
        second.add_request("x", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=1))
        results = {}
        for client, name in ((first, "first"), (second, "second")):
            deltas = run_to_end(client)
            results[name] = [t for d in deltas for t in d.new_token_ids]
            assert deltas[-1].finished and deltas[-1].request_id == "x"
            assert all(d.request_id == "x" for d in deltas) and [d.finished for d in deltas].count(True) == 1
            assert all((d.new_logprobs is not None) == (name == "second") for d in deltas)
        assert len(results["first"]) == 5 and results["second"] == results["first"][:3]
        check_integrity(first)
    finally:
        first.close()
        second.close()
    assert process.wait(10) == 0


@pytest.mark.skipif(not hasattr(fcntl, "F_GETPIPE_SZ"), reason="Linux pipe sizes")
def test_output_pipes_hold_many_steps_of_a_shared_engine():
    """Every busy client gets the whole step, so an output pipe must hold many steps before
    a client that falls behind stalls the child (widen_pipe, in spawn_engine_process); a
    command pipe holds a burst of adds, which an event loop writes itself without waiting for
    the child's next step."""
    read_end, write_end = os.pipe()
    try:
        assert widen_pipe(write_end, OUTPUT_PIPE_BYTES) >= OUTPUT_PIPE_BYTES
        assert fcntl.fcntl(read_end, fcntl.F_GETPIPE_SZ) >= OUTPUT_PIPE_BYTES  # one pipe, both ends
    finally:
        os.close(read_end)
        os.close(write_end)
    process, fds = spawn_engine_process(config(), num_clients=2)
    try:
        for commands_fd, outputs_fd in fds:
            assert fcntl.fcntl(outputs_fd, fcntl.F_GETPIPE_SZ) >= OUTPUT_PIPE_BYTES
            assert fcntl.fcntl(commands_fd, fcntl.F_GETPIPE_SZ) >= COMMAND_PIPE_BYTES
    finally:
        for commands_fd, outputs_fd in fds:
            os.close(commands_fd)
            os.close(outputs_fd)
        process.wait(60)


@pytest.mark.skipif(not hasattr(fcntl, "F_GETPIPE_SZ"), reason="Linux pipe sizes")
def test_a_pipe_that_cannot_grow_keeps_its_size(monkeypatch):
    real = fcntl.fcntl

    def refusing(fd, command, *args):
        if command == fcntl.F_SETPIPE_SZ:
            raise PermissionError("past the user's pipe pages")
        return real(fd, command, *args)

    monkeypatch.setattr(engine_process.fcntl, "fcntl", refusing)
    read_end, write_end = os.pipe()
    try:
        assert widen_pipe(write_end, OUTPUT_PIPE_BYTES) == real(read_end, fcntl.F_GETPIPE_SZ)
    finally:
        os.close(read_end)
        os.close(write_end)


def test_a_message_framed_once_reads_back_through_the_clients_connection():
    """serve_clients frames each step's message once and writes the same bytes to every
    client's pipe with os.write; each client reads it with Connection.recv_bytes, empty and
    larger-than-the-pipe messages included."""
    out_r, out_w = os.pipe()
    reader = Connection(out_r, writable=False)
    client = ClientPipes(0, Connection(os.pipe()[0], writable=False), Connection(out_w, readable=False), "", {}, [0])
    step = StepOutputs(["0.1"], [7], ["a"], [1], [], [], EngineStats(), [0], None, time.monotonic())
    messages = [b"", b"x", step.encode(), os.urandom(200_000)]
    writer = threading.Thread(target=lambda: [client.send_framed(frame(m), 0.0) for m in messages])
    writer.start()
    try:
        assert [reader.recv_bytes() for _ in messages] == messages
    finally:
        writer.join(10)
    client.send(b"reply")  # a reply is framed the same way
    assert reader.recv_bytes() == b"reply"
