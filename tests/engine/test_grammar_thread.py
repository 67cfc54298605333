"""The matchers' work (a step's batch accept, the next mask's fill) runs on the grammar thread,
overlapping the engine thread's own host work, and changes nothing: the same tokens and finish
reasons as running it inline on the engine's thread, under preemption, prefix caching, an abort
mid-stream and the held sampling of async scheduling; an error of the grammar engine fails the
step's requests, not the engine."""

from __future__ import annotations

import threading
from concurrent.futures import Executor, Future

import pytest
import xgrammar as xgr

from roseray.engine import structured_output, structured_requests
from roseray.engine.structured_requests import GRAMMAR_THREAD
from roseray.llm import LLM
from roseray.sampling_params import SamplingParams, StructuredOutputs

SCHEMA = {"type": "object",
          "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 999},
                         "name": {"type": "string", "minLength": 1, "maxLength": 8},
                         "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}},
          "required": ["id", "name", "tags"], "additionalProperties": False}
ABORTED = "r5"


class InlineExecutor(Executor):
    """Runs each task at once on the caller's thread: the serial path."""

    def submit(self, fn, /, *args, **kwargs) -> Future:
        future = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as error:  # noqa: BLE001 - handed to the future, as a thread pool does
            future.set_exception(error)
        return future


@pytest.fixture
def xgrammar_callers(monkeypatch):
    """The names of the threads that call xgrammar's batch accept and batch fill."""
    callers = {"accept": set(), "fill": set()}
    accept, fill = structured_output.batch_accept_token, xgr.BatchGrammarMatcher.batch_fill_next_token_bitmask

    def recording_accept(*args, **kwargs):
        callers["accept"].add(threading.current_thread().name)
        return accept(*args, **kwargs)

    def recording_fill(self, *args, **kwargs):
        callers["fill"].add(threading.current_thread().name)
        return fill(self, *args, **kwargs)

    monkeypatch.setattr(structured_output, "batch_accept_token", recording_accept)
    monkeypatch.setattr(xgr.BatchGrammarMatcher, "batch_fill_next_token_bitmask", recording_fill)
    return callers


def _params(i: int) -> SamplingParams:
    seed = i if i % 3 else None  # seeded generators and the engine's own, both
    if i % 2:
        return SamplingParams(temperature=1.0, seed=seed, max_tokens=120,
                              structured_outputs=StructuredOutputs.json_schema(SCHEMA, any_whitespace=False))
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=30 + 7 * i, ignore_eos=i % 4 == 0)


def _run(serial: bool) -> tuple[dict[str, tuple[list[int], str]], int, int]:
    """Few KV blocks and a shared prefix under async scheduling (held constrained sampling), one
    constrained request aborted mid-stream: {request id: (tokens, finish reason)}, preemptions,
    the aborted request's tokens before its abort. `serial`: the grammar work inline on the engine
    thread, each mask filled when the engine asks for it (no fill right behind the accept)."""
    llm = LLM("random:tiny", num_kv_blocks=60, block_size=4, max_num_seqs=8, max_num_batched_tokens=32, seed=7,
              async_scheduling=True)
    engine = llm.engine
    if serial:
        structured = engine.structured
        structured.executor = InlineExecutor()
        accept_step = structured.accept_step
        structured.accept_step = lambda sampling, token_ids, output_index, next_sampling=None: accept_step(
            sampling, token_ids, output_index)
    llm.generate(["warm"], _params(1), use_tqdm=False)  # compiled and cached: admitted at once below
    for i in range(8):
        engine.add_request(f"r{i}", f"a shared prompt, cached: question {i}", _params(i))
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(8)}
    reasons: dict[str, str] = {}
    steps = 0
    while engine.has_unfinished_requests():
        for delta in engine.step():
            tokens[delta.request_id] += delta.new_token_ids
            if delta.finished:
                reasons[delta.request_id] = delta.finish_reason
        steps += 1
        if steps == 12:
            aborted_at = len(tokens[ABORTED])
            engine.abort_request(ABORTED)
    engine.check_integrity()
    assert engine.structured.num_requests == 0
    return {rid: (tokens[rid], reasons[rid]) for rid in tokens}, engine.get_stats().num_preemptions_total, aborted_at


def test_grammar_work_runs_on_its_thread_and_gives_the_serial_outputs(xgrammar_callers, monkeypatch):
    opened = []  # masks filled before the settle with rows of requests it finished
    result = structured_requests.PendingMask.result
    monkeypatch.setattr(structured_requests.PendingMask, "result", lambda self: opened.append(self.opened) or
                        result(self))
    threaded, preemptions, aborted_at = _run(serial=False)
    assert any(opened), "no request finished while the next mask was filled"
    assert xgrammar_callers["accept"] and xgrammar_callers["fill"]
    for calls in xgrammar_callers.values():
        assert all(name.startswith(GRAMMAR_THREAD) for name in calls), calls
    assert preemptions > 0, "the scenario did not preempt"
    assert 0 < aborted_at == len(threaded[ABORTED][0]) and threaded[ABORTED][1] == "abort", \
        "the abort was not mid-stream"
    assert {reason for rid, (_, reason) in threaded.items() if rid != ABORTED} >= {"stop", "length"}

    for calls in xgrammar_callers.values():
        calls.clear()
    serial, serial_preemptions, _ = _run(serial=True)
    assert xgrammar_callers["accept"] == xgrammar_callers["fill"] == {threading.current_thread().name}
    assert serial == threaded
    assert serial_preemptions == preemptions


@pytest.mark.parametrize("failing", ["batch_accept_token", "batch_fill_next_token_bitmask"])
def test_a_grammar_engine_error_fails_the_step_not_the_engine(monkeypatch, failing):
    llm = LLM("random:tiny", max_num_batched_tokens=64, seed=3, async_scheduling=True)
    engine = llm.engine
    llm.generate(["warm"], _params(1), use_tqdm=False)
    owner = structured_output if failing == "batch_accept_token" else xgr.BatchGrammarMatcher
    original = getattr(owner, failing)
    calls = 0

    def fails_once(*args, **kwargs):  # the third call, mid-stream
        nonlocal calls
        calls += 1
        if calls == 3:
            raise RuntimeError("xgrammar failed")
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, failing, fails_once)
    outputs = llm.generate(["one", "two", "three"], [_params(1), _params(3), _params(2)], use_tqdm=False)
    assert calls >= 3, "the grammar engine did not fail"
    assert [o.outputs[0].finish_reason for o in outputs[:2]] == ["error", "error"]
    assert outputs[2].outputs[0].finish_reason in ("stop", "length")  # unconstrained: not the grammar's step
    monkeypatch.undo()
    again = llm.generate(["after"], _params(1), use_tqdm=False)[0].outputs[0]  # the engine lives on
    assert again.finish_reason == "stop"
    engine.check_integrity()
