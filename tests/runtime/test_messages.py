"""The engine process's typed messages: every kind survives its encoding, a step message is
columnar with a single token sent bare, and the child's loop with one client (no prefix)
answers an add it cannot take with one finished delta instead of dying."""

import json
import os
import threading
import time
from multiprocessing.connection import Connection

import pytest

from roseray.config import EngineConfig
from roseray.engine.engine import LLMEngine
from roseray.engine.limits import RequestLimits
from roseray.engine.outputs import EngineStats, RequestDelta, RequestSummary
from roseray.runtime.engine_loop import apply_command, client_pipes, serve_clients
from roseray.runtime.messages import (
    AbortRequest,
    AddRequests,
    CheckIntegrity,
    EngineFailed,
    IntegrityReply,
    Ready,
    Start,
    StartFailed,
    StepOutputs,
    Stop,
    decode,
    sampling_overrides,
)
from roseray.sampling_params import SamplingParams

STATS = EngineStats(num_running=2, num_waiting=1, num_free_blocks=7, num_total_blocks=8, kv_cache_usage=0.125,
                    engine_steps_total=3, engine_step_seconds_total=0.5)

ROUND_TRIPS = [
    Start(EngineConfig(model="random:tiny", device="cpu", max_model_len=256)),
    AddRequests(["0", "1"], [[1, 2], [3]], [SamplingParams(), SamplingParams(temperature=0.0, stop=["x"], seed=4)],
                [1.5, 2.5]),
    AbortRequest("7"),
    CheckIntegrity(3),
    Stop(),
    Ready("m", RequestLimits(vocab_size=10, max_model_len=64, max_logprobs=5, num_blocks=4, block_size=16), 123,
          1, "1."),
    StartFailed("ValueError", "bad model"),
    EngineFailed("RuntimeError('tensor-parallel rank 1 exited (exit code -9)')"),
    StepOutputs(["0.1", "1.4"], [5, [6, 7]], ["a", "bc"], [1, 2], [[1, "stop", 2.0, 16, "x"]],
                [[0, [[[5, -0.5], [9, -1.25]]]]], STATS, [4, 2], "RuntimeError('x')", 12.5),
    IntegrityReply(3, None, STATS, 6),
]


@pytest.mark.parametrize("message", ROUND_TRIPS, ids=lambda m: type(m).__name__)
def test_every_message_kind_survives_its_encoding(message):
    assert decode(message.encode()) == message


def test_a_step_message_is_columnar_and_sends_a_single_token_bare():
    deltas = [RequestDelta("1", [5], "a", False, None, [{5: -0.5, 9: -1.25}], 1, 1, None),
              RequestDelta("2", [], "", True, "abort", None, 1, 0, RequestSummary(0.0, 1.0, 16, None)),
              RequestDelta("3", [6, 7], "bc", False, None, None, 1, 2, None)]
    step = StepOutputs.from_deltas(deltas, STATS, [3])
    assert step.token_ids == [5, [], [6, 7]]
    assert step.finished == [[1, "abort", 1.0, 16, None]] and step.logprobs == [[0, [[(5, -0.5), (9, -1.25)]]]]
    assert 0 <= time.monotonic() - step.sent_at < 5
    back = decode(step.encode())
    assert (back.request_ids, back.token_ids, back.texts, back.num_output_tokens) == (
        ["1", "2", "3"], [5, [], [6, 7]], ["a", "", "bc"], [1, 0, 2])
    assert back.stats == STATS and back.logprobs == [[0, [[[5, -0.5], [9, -1.25]]]]] and back.adds_applied == [3]


def test_sampling_params_travel_as_their_non_default_fields():
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    assert sampling_overrides(params) == {"temperature": 0.0, "max_tokens": 3, "ignore_eos": True}
    assert json.loads(AddRequests(["0"], [[1]], [params], [0.0]).encode())[3] == [sampling_overrides(params)]
    assert sampling_overrides(SamplingParams()) == {}


def test_decode_refuses_what_is_not_a_message():
    with pytest.raises(ValueError, match="not an engine message"):
        decode(b'["nonsense", 1]')


class OnePipePair:
    """The two ends of one client's pipe pair: the client's and (as ClientPipes) the engine's."""

    def __init__(self) -> None:
        cmd_r, cmd_w = os.pipe()
        out_r, out_w = os.pipe()
        self.commands, self.outputs = Connection(cmd_w, readable=False), Connection(out_r, writable=False)
        [self.engine_side] = client_pipes([(Connection(cmd_r, writable=False), Connection(out_w, readable=False))])


def test_a_request_the_engine_cannot_take_finishes_with_an_error():
    """The client validated it, yet the engine's add_request raised: the child reports it as
    one finished delta with reason "error" instead of dying."""
    class RefusingEngine:
        def add_request(self, *args, **kwargs):
            raise RuntimeError("out of something")

        def get_stats(self):
            return EngineStats(num_free_blocks=8, num_total_blocks=8)

    pipes = OnePipePair()
    add = AddRequests(["7"], [[1, 2]], [SamplingParams(max_tokens=4)], [0.0]).encode()
    assert not apply_command(RefusingEngine(), add, pipes.engine_side)
    step = decode(pipes.outputs.recv_bytes())
    assert (step.request_ids, step.token_ids, step.texts, step.num_output_tokens, step.error) == (
        ["7"], [[]], [""], [0], None)  # one client: the engine names the request by its handle alone
    assert step.finished == [[0, "error", None, 0, None]] and step.stats.num_free_blocks == 8
    assert step.adds_applied == [1]  # taken, if only to be refused: the stats show it (not as waiting)
    assert apply_command(RefusingEngine(), Stop().encode(), pipes.engine_side)


def test_one_client_is_served_by_the_same_loop_and_ends_it_with_stop():
    engine = LLMEngine(EngineConfig(model="random:tiny", device="cpu", num_kv_blocks=32, max_model_len=256,
                                    async_scheduling=False))
    pipes = OnePipePair()
    thread = threading.Thread(target=serve_clients, args=(engine, [pipes.engine_side]), daemon=True)
    thread.start()
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    pipes.commands.send_bytes(AddRequests(["0"], [[1, 2, 3]], [params], [time.monotonic()]).encode())
    tokens, finished = [], None
    while finished is None:
        step = decode(pipes.outputs.recv_bytes())
        assert set(step.request_ids) <= {"0"}
        tokens += [t for ids in step.token_ids for t in (ids if isinstance(ids, list) else [ids])]
        finished = step.finished[0] if step.finished else None
    assert len(tokens) == 5 and finished[1] == "length" and step.stats.num_running == 0 and step.adds_applied == [1]
    pipes.commands.send_bytes(CheckIntegrity(1).encode())
    reply = decode(pipes.outputs.recv_bytes())
    assert reply == IntegrityReply(1, None, reply.stats, 1) and reply.stats.num_free_blocks == 32
    pipes.commands.send_bytes(Stop().encode())
    thread.join(10)
    assert not thread.is_alive()  # the loop ends with its last client
