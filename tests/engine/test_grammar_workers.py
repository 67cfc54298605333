"""The matchers' work (a step's batch accept, the next mask's fill) runs in grammar worker
processes and changes nothing: the same tokens and finish reasons with one worker or three
(requests spread over them), under preemption, prefix caching, an abort mid-stream and the held
sampling of async scheduling. A worker that fails a step, or dies, fails its requests, not the
engine; the workers stop with the engine."""

from __future__ import annotations

import json
import os
import signal
import time

import numpy as np
import pytest

from roseray.engine import grammar_workers, structured_requests
from roseray.engine.grammar_workers import FREE, SHM_DIR
from roseray.engine.request import Request, RequestStatus
from roseray.llm import LLM
from roseray.sampling_params import SamplingParams, StructuredOutputs
from tests.waiting import wait_until

SCHEMA = {"type": "object",
          "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 999},
                         "name": {"type": "string", "minLength": 1, "maxLength": 8},
                         "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}},
          "required": ["id", "name", "tags"], "additionalProperties": False}
ABORTED = "r5"


def _params(i: int) -> SamplingParams:
    seed = i if i % 3 else None  # seeded generators and the engine's own, both
    if i % 2:
        return SamplingParams(temperature=1.0, seed=seed, max_tokens=120,
                              structured_outputs=StructuredOutputs.json_schema(SCHEMA, any_whitespace=False))
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=30 + 7 * i, ignore_eos=i % 4 == 0)


def _run(num_workers: int) -> tuple[dict[str, tuple[list[int], str]], int, int, set[int]]:
    """Few KV blocks and a shared prefix under async scheduling (held constrained sampling), one
    constrained request aborted mid-stream: {request id: (tokens, finish reason)}, preemptions,
    the aborted request's tokens before its abort, the workers that held a matcher."""
    llm = LLM("random:tiny", num_kv_blocks=60, block_size=4, max_num_seqs=8, max_num_batched_tokens=32, seed=7,
              async_scheduling=True, grammar_workers=num_workers)
    engine = llm.engine
    llm.generate(["warm"], _params(1), use_tqdm=False)  # compiled, workers up: admitted at once below
    workers = engine.structured.workers.workers
    assert len(workers) == num_workers and all(w.process.pid != os.getpid() and w.process.is_alive() for w in workers)
    for i in range(8):
        engine.add_request(f"r{i}", f"a shared prompt, cached: question {i}", _params(i))
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(8)}
    reasons: dict[str, str] = {}
    used: set[int] = set()
    steps = 0
    while engine.has_unfinished_requests():
        for delta in engine.step():
            tokens[delta.request_id] += delta.new_token_ids
            if delta.finished:
                reasons[delta.request_id] = delta.finish_reason
        used |= {w.index for w in workers if w.slots}
        steps += 1
        if steps == 12:
            aborted_at = len(tokens[ABORTED])
            engine.abort_request(ABORTED)
    engine.check_integrity()
    assert engine.structured.num_requests == 0 and not any(w.slots for w in workers)
    preemptions = engine.get_stats().num_preemptions_total
    engine.structured.close()
    return {rid: (tokens[rid], reasons[rid]) for rid in tokens}, preemptions, aborted_at, used


def test_grammar_work_runs_in_worker_processes_and_gives_the_same_outputs(monkeypatch):
    opened = []  # masks filled before the settle with rows of requests it finished
    result = structured_requests.PendingMask.result
    monkeypatch.setattr(structured_requests.PendingMask, "result", lambda self: opened.append(list(self.opened))
                        or result(self))
    one, preemptions, aborted_at, used = _run(num_workers=1)
    assert any(opened), "no request finished while the next mask was filled"
    assert preemptions > 0, "the scenario did not preempt"
    assert 0 < aborted_at == len(one[ABORTED][0]) and one[ABORTED][1] == "abort", "the abort was not mid-stream"
    assert {reason for rid, (_, reason) in one.items() if rid != ABORTED} >= {"stop", "length"}

    three, three_preemptions, _, used = _run(num_workers=3)
    assert len(used) >= 2, "the requests were not spread over the workers"
    assert three == one
    assert three_preemptions == preemptions


def _constrained(seed: int) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=200,
                          structured_outputs=StructuredOutputs.json_schema(SCHEMA, any_whitespace=False))


def _step_until_done(engine, on_step) -> dict[str, str]:
    reasons, steps = {}, 0
    while engine.has_unfinished_requests():
        for delta in engine.step():
            if delta.finished:
                reasons[delta.request_id] = delta.finish_reason
        steps += 1
        on_step(steps)
    engine.check_integrity()
    return reasons


@pytest.mark.parametrize("failure", ["dies", "fails a step"])
def test_a_failing_grammar_worker_fails_its_requests_not_the_engine(failure):
    """Two workers, two constrained requests on each, an unconstrained one: one worker is killed
    (or loses a matcher, so that its next batch accept raises) mid-stream. Its requests end with
    an error; the other worker's and the unconstrained one finish as usual; the engine goes on
    and serves a constrained request again (a dead worker is started again)."""
    llm = LLM("random:tiny", seed=3, async_scheduling=True, grammar_workers=2)
    engine = llm.engine
    llm.generate(["warm"], _constrained(0), use_tqdm=False)
    for i in range(4):
        engine.add_request(f"c{i}", f"constrained {i}", _constrained(i + 1))
    engine.add_request("free", "unconstrained", SamplingParams(temperature=1.0, max_tokens=60, ignore_eos=True))
    workers = engine.structured.workers.workers
    victim, owned = workers[0], []

    def on_step(steps: int) -> None:
        if steps != 6:
            return
        owned.extend(g for g in victim.slots.values())
        assert len(owned) == 2, "the requests were not two a worker"
        if failure == "dies":
            os.kill(victim.process.pid, signal.SIGKILL)
        else:  # the matcher goes behind the engine's back: the worker's next accept has no such slot
            victim.send(np.array([FREE, owned[0].slot], dtype=np.int32))

    reasons = _step_until_done(engine, on_step)
    failed = {rid for rid, reason in reasons.items() if reason == "error"}
    assert len(failed) == 2 and failed < {f"c{i}" for i in range(4)}, reasons
    assert reasons["free"] == "length"
    assert all(reasons[f"c{i}"] == "stop" for i in range(4) if f"c{i}" not in failed), reasons
    assert engine.structured.num_requests == 0
    again = llm.generate(["again", "and again"], [_constrained(7), _constrained(8)], use_tqdm=False)
    assert [o.outputs[0].finish_reason for o in again] == ["stop", "stop"]
    if failure == "dies":
        assert workers[0] is not victim and workers[0].process.is_alive()


def test_the_workers_and_their_buffers_go_with_the_engine():
    llm = LLM("random:tiny", seed=3, grammar_workers=2)
    structured = llm.engine.structured
    assert not structured.workers.workers, "workers started before any constrained request"
    llm.generate(["x"], _constrained(1), use_tqdm=False)
    processes = [w.process for w in structured.workers.workers]
    shm = os.path.join(SHM_DIR, structured.workers._shm.name)
    assert all(p.is_alive() for p in processes) and os.path.exists(shm)
    structured.close()
    assert all(p.exitcode is not None for p in processes) and not os.path.exists(shm)


def _exits_at_once(*args) -> None:
    os._exit(3)


def test_workers_that_cannot_start_fail_their_requests_not_the_engine(monkeypatch):
    monkeypatch.setattr(grammar_workers, "worker_main", _exits_at_once)
    llm = LLM("random:tiny", seed=3, grammar_workers=1)
    outputs = llm.generate(["json", "free"], [_constrained(1), SamplingParams(max_tokens=5, ignore_eos=True)],
                           use_tqdm=False)
    assert [o.outputs[0].finish_reason for o in outputs] == ["error", "length"]
    assert llm.engine.structured.num_requests == 0
    llm.engine.check_integrity()


def test_a_worker_keeps_a_bounded_set_of_grammars_and_gets_one_again_when_needed(monkeypatch):
    """With room for one compiled grammar a worker, every new grammar evicts the last (its live
    matchers keep theirs), and a grammar asked for again is sent again: the outputs still follow
    their grammars, run after run and batched together."""
    monkeypatch.setattr(grammar_workers, "MAX_WORKER_GRAMMARS", 1)
    llm = LLM("random:tiny", seed=3, grammar_workers=1)
    choices = [["alpha", "beta"], ["gamma", "delta"], ["alpha", "beta"]]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=20, structured_outputs=StructuredOutputs.choice(c))
              for i, c in enumerate(choices)]
    for run in (params, params[::-1]):
        for one in run:  # one at a time: each admission swaps the worker's grammar
            text = llm.generate(["pick"], one, use_tqdm=False)[0].outputs[0].text
            assert text in json.loads(one.structured_outputs.spec)
        outputs = llm.generate(["a", "b", "c"], run, use_tqdm=False)  # together: matchers outlive eviction
        for output, one in zip(outputs, run):
            assert output.outputs[0].text in json.loads(one.structured_outputs.spec)
    assert len(llm.engine.structured.workers.workers[0].grammar_ids) == 1



def test_a_mask_reads_ready_only_once_its_fill_is_done():
    """PendingMask.ready (which decides whether a held sampling goes before the next schedule)
    polls the workers' replies without waiting: False while the worker is stopped mid-way, True
    once it filled the rows; `result` then has them."""
    llm = LLM("random:tiny", seed=3, async_scheduling=False, grammar_workers=1)
    engine = llm.engine
    llm.generate(["warm"], _constrained(0), use_tqdm=False)
    engine.add_request("r", "a mask", _constrained(1))
    while engine.requests["r"].grammar is None:
        engine.step()
    req = engine.requests["r"]
    process = req.grammar.worker.process
    os.kill(process.pid, signal.SIGSTOP)
    try:
        mask = engine.structured.mask([req])
        time.sleep(0.2)
        assert not mask.ready
    finally:
        os.kill(process.pid, signal.SIGCONT)
    wait_until(lambda: mask.ready, timeout=10, message="the mask's fill")
    rows_mask, rows = mask.result()
    assert rows == [0] and (rows_mask[0] != -1).any()  # the grammar allows some tokens, not all
    engine.abort_request("r")
    engine.step()
    engine.check_integrity()


def test_the_engine_waits_for_verdicts_only_of_tokens_sampled_without_a_mask_row():
    """A matcher cannot refuse a token its own mask row allowed, so `settle` returns at once when
    every token of the step was sampled through a row filled for its grammar; a refusal is still
    marked when the worker's reply is read (here: with the next mask) and ends the request. A token
    sampled without a row (none was filled for it) is waited for: refused, it fails at `settle`."""
    llm = LLM("random:tiny", seed=3, grammar_workers=1)
    engine, manager = llm.engine, llm.engine.structured
    llm.generate(["warm"], _constrained(0), use_tqdm=False)  # the worker is up
    params = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputs.choice(["ok"]))
    masked, unmasked = (Request(rid, [1, 2, 3], params, max_tokens=8) for rid in ("masked", "unmasked"))
    for req in (masked, unmasked):
        manager.add(req)
    ready = []
    while len(ready) < 2:
        ready += manager.take_compiled(wait=True)[0]
    bad = engine.tokenizer.encode("x", add_special_tokens=False)[0]

    manager.mask([masked]).result()  # a row filled for it: its token is sampled through the mask
    manager.settle(manager.accept_step([masked], [bad], [0]))
    assert not masked.grammar.failed  # not waited for: its verdict is still in the pipe
    manager.mask([masked]).result()
    assert masked.grammar.failed and manager.advance(masked, None) == RequestStatus.FINISHED_ERROR

    accepting = manager.accept_step([unmasked], [bad], [0])
    assert accepting.unmasked
    manager.settle(accepting)
    assert unmasked.grammar.failed
    for req in (masked, unmasked):
        manager.release(req)
    manager.close()
