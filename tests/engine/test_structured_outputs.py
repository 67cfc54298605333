"""Grammar-constrained decoding in the engine: with random weights the grammar alone makes
every output valid (JSON schemas, regex, choice, EBNF), greedy and sampled, batched with
unconstrained requests, under chunked prefill, prefix caching and preemption; a spec that
cannot be compiled or enforced is a ValueError naming the construct."""

from __future__ import annotations

import json
import multiprocessing
import re
import sys
import threading
import time

import jsonschema
import numpy as np
import pytest
import torch
import xgrammar as xgr

from roseray.engine.grammar_workers import ACCEPTED, FILLED, GRAMMAR, MATCHER, STEP, MatcherHost
from roseray.engine.request import PLACEHOLDER
from roseray.engine.structured_output import (
    MAX_WHITESPACE,
    GrammarCompiler,
    RequestGrammar,
    WhitespaceTokens,
    batch_accept_token,
    bounds_whitespace,
    check_structured_outputs,
    forbid_whitespace,
    reasoning_ended,
)
from roseray.llm import LLM
from roseray.sampling_params import SamplingParams, StructuredOutputs
from tests.models.hf_models import make_tiny_model

SCHEMAS = {
    "nested_object": {
        "type": "object",
        "properties": {
            "user": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 999},
                                                      "name": {"type": "string", "minLength": 1, "maxLength": 6}},
                     "required": ["id", "name"], "additionalProperties": False},
            "active": {"type": "boolean"},
        },
        "required": ["user", "active"], "additionalProperties": False,
    },
    "bounded_array": {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5},
                      "minItems": 2, "maxItems": 4},
    "enum_and_const": {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]},
                                                        "version": {"const": 2}},
                       "required": ["colour", "version"], "additionalProperties": False},
    "any_of": {"type": "object", "properties": {"value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 50},
                                                                    {"type": "string", "maxLength": 4},
                                                                    {"type": "null"}]}},
               "required": ["value"], "additionalProperties": False},
    "refs": {"$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0,
                                                                        "maximum": 9}},
                                 "required": ["x"], "additionalProperties": False}},
             "type": "array", "items": {"$ref": "#/$defs/point"}, "minItems": 1, "maxItems": 3},
}
MAX_TOKENS = 400  # ample for the bounded schemas: an output that ends by length is a failure


@pytest.fixture(scope="module")
def byte_llm():
    """random:tiny: the byte tokenizer of the random presets."""
    return LLM("random:tiny", max_num_batched_tokens=64, seed=3)


@pytest.fixture(scope="module")
def hf_llm(tmp_path_factory):
    """A tiny Qwen3 with a Hugging Face byte-level BPE tokenizer, through the real loader."""
    path = make_tiny_model("qwen3", tmp_path_factory.mktemp("qwen3"))
    return LLM(str(path), max_num_batched_tokens=64, seed=5)


def _json_params(schema: dict, temperature: float, seed: int | None = None, max_tokens: int = MAX_TOKENS,
                 any_whitespace: bool = True) -> SamplingParams:
    return SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed,
                          structured_outputs=StructuredOutputs.json_schema(schema, any_whitespace))


def _assert_valid_json(output, schema: dict) -> None:
    completion = output.outputs[0]
    assert completion.finish_reason == "stop", (completion.finish_reason, completion.text)
    jsonschema.validate(json.loads(completion.text), schema)


@pytest.mark.parametrize("llm_name", ["byte_llm", "hf_llm"])
def test_json_schemas_always_validate_batched_with_unconstrained(llm_name, request):
    llm = request.getfixturevalue(llm_name)
    # The tiny Qwen3 has 128 positions, and its BPE vocabulary many whitespace tokens that random
    # weights pick often: it answers in compact JSON (no whitespace between tokens).
    max_tokens = min(MAX_TOKENS, llm.engine.max_model_len - 16)
    compact = llm_name == "hf_llm"
    prompts, params, schemas = [], [], []
    for i, schema in enumerate(SCHEMAS.values()):
        for temperature in (0.0, 1.0, 1.0):
            prompts.append(f"json {i}")
            params.append(_json_params(schema, temperature, max_tokens=max_tokens, any_whitespace=not compact))
            schemas.append(schema)
    free = [SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True) for _ in range(4)]
    outputs = llm.generate(prompts + ["unconstrained"] * 4, params + free, use_tqdm=False)
    for output, schema in zip(outputs, schemas):
        _assert_valid_json(output, schema)
    for output in outputs[len(prompts):]:  # the unconstrained neighbours are not held to any grammar
        assert len(output.outputs[0].token_ids) == 24
    llm.engine.check_integrity()


def test_json_object_regex_choice_and_grammar(byte_llm):
    regex = r"[a-c]{2,4}-\d{3}"
    choices = ["yes", "no", "maybe so"]
    grammar = 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?'
    specs = [StructuredOutputs("json_object"), StructuredOutputs("regex", regex), StructuredOutputs.choice(choices),
             StructuredOutputs("grammar", grammar)]
    compact = StructuredOutputs.json_schema(SCHEMAS["enum_and_const"], any_whitespace=False)
    params = [SamplingParams(temperature=t, max_tokens=MAX_TOKENS, structured_outputs=spec)
              for spec in specs for t in (0.0, 1.0)]
    params.append(SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, structured_outputs=compact))
    outputs = [o.outputs[0] for o in byte_llm.generate(["go"] * len(params), params, use_tqdm=False)]
    for completion in outputs:
        assert completion.finish_reason == "stop", completion
    # no whitespace choice left: the separators are fixed (", " and ": ")
    assert re.fullmatch(r'\{"colour": "(red|green|blue)", "version": 2\}', outputs[8].text), outputs[8].text
    assert all(isinstance(json.loads(c.text), dict) for c in outputs[0:2])
    assert all(re.fullmatch(regex, c.text) for c in outputs[2:4])
    assert all(c.text in choices for c in outputs[4:6])
    assert all(re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)", c.text) for c in outputs[6:8])


def test_max_tokens_still_cuts_a_constrained_output(byte_llm):
    # two tokens: the shortest JSON object ends with its third, the stop token after "{}" (three
    # tokens could end it, by chance, with "stop")
    params = SamplingParams(temperature=1.0, max_tokens=2, structured_outputs=StructuredOutputs("json_object"))
    completion = byte_llm.generate(["cut"], params, use_tqdm=False)[0].outputs[0]
    assert completion.finish_reason == "length" and len(completion.token_ids) == 2
    assert completion.text.startswith("{")


@pytest.mark.parametrize("overlap", [False, True])
def test_preempted_and_prefix_cached_constrained_requests_stay_valid(overlap):
    """Few KV blocks and a shared long prefix: requests are preempted (recomputed) and hit the
    prefix cache mid-grammar; every output still validates. With overlap, a request can be
    preempted while its step's sampling is held."""
    llm = LLM("random:tiny", num_kv_blocks=60, block_size=4, max_num_seqs=8, max_num_batched_tokens=32, seed=7,
              async_scheduling=overlap)
    schema = SCHEMAS["nested_object"]
    prefix = "a shared prompt, cached: "
    prompts = [f"{prefix}question {i}" for i in range(8)]
    params = [_json_params(schema, temperature=1.0, seed=i, max_tokens=120, any_whitespace=False) for i in range(8)]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    stats = llm.engine.get_stats()
    assert stats.num_preemptions_total > 0, "the scenario did not preempt"
    assert stats.prefix_cache_hits > 0, "the scenario did not hit the prefix cache"
    for output in outputs:
        _assert_valid_json(output, schema)
    llm.engine.check_integrity()


def test_seeded_constrained_sampling_is_reproducible(byte_llm):
    params = _json_params(SCHEMAS["any_of"], temperature=1.0, seed=1234)
    first = byte_llm.generate(["same"], params, use_tqdm=False)[0].outputs[0].text
    again = byte_llm.generate(["same"], params, use_tqdm=False)[0].outputs[0].text
    assert first == again


def test_aborted_constrained_requests_free_their_blocks_and_matchers(byte_llm):
    engine = byte_llm.engine
    for i in range(4):
        engine.add_request(f"abort-{i}", "to be aborted", _json_params(SCHEMAS["refs"], 1.0))
    engine.step()  # compiling or scheduled: both are aborted cleanly
    for _ in range(3):
        engine.step()
    for i in range(4):
        engine.abort_request(f"abort-{i}")
    while engine.has_unfinished_requests():
        engine.step()
    engine.check_integrity()
    assert engine.structured.num_requests == 0
    assert engine.get_stats().num_free_blocks == engine.get_stats().num_total_blocks


@pytest.mark.parametrize(("spec", "named"), [
    (StructuredOutputs.json_schema({"type": "object", "not": {"required": ["a"]}}), "'not'"),
    (StructuredOutputs.json_schema({"type": "array", "uniqueItems": True}), "'uniqueItems'"),
    (StructuredOutputs.json_schema({"type": "object", "patternProperties": {"^a": {}}}), "'patternProperties'"),
    (StructuredOutputs.json_schema({"type": "string", "format": "credit-card"}), "'credit-card'"),
    (StructuredOutputs.json_schema({"$ref": "https://example.com/schema.json"}), "local references"),
    (StructuredOutputs.json_schema({"type": "integer", "multipleOf": 3}), "'multipleOf'"),
    (StructuredOutputs.json_schema({"type": "wat"}), "wat"),
    (StructuredOutputs("json", '{"type": '), "not valid JSON"),
    (StructuredOutputs("regex", "(ab"), "parenthesis"),
    (StructuredOutputs("grammar", 'root ::= "a" |'), "EBNF"),
    (StructuredOutputs("choice", "[]"), "non-empty list"),
])
def test_unenforceable_specs_are_refused_by_name(spec, named):
    with pytest.raises(ValueError, match=re.escape(named)):
        check_structured_outputs(spec)


def test_engine_refuses_a_bad_spec_at_add(byte_llm):
    bad = SamplingParams(structured_outputs=StructuredOutputs("regex", "[z-a]"))
    with pytest.raises(ValueError, match="structured output"):
        byte_llm.engine.add_request("bad-spec", "x", bad)
    assert "bad-spec" not in byte_llm.engine.requests


def test_min_tokens_with_a_constraint_is_refused():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=2, structured_outputs=StructuredOutputs("json_object"))


def test_overlapped_steps_give_the_same_constrained_outputs(mask_ready):
    """With async scheduling (the GPU default) a constrained batch's mask is filled after the step
    before is processed, while this step's forward runs, and the next call samples through it
    before it schedules (mask ready) or after it prepared the next step (mask still filling): the
    same tokens as one step at a time, either way."""
    schema = SCHEMAS["nested_object"]
    prompts = [f"overlap {i}" for i in range(6)]
    params = [_json_params(schema, temperature=1.0, seed=i, max_tokens=200) if i % 2 else
              SamplingParams(temperature=1.0, seed=i, max_tokens=40, ignore_eos=True) for i in range(6)]
    results = []
    for overlap in (False, True):
        llm = LLM("random:tiny", async_scheduling=overlap, max_num_batched_tokens=16, seed=9)
        assert llm.engine.overlap is overlap
        llm.generate(["warm"], params[1], use_tqdm=False)  # compiled and cached: admitted at once below
        outputs = llm.generate(prompts, params, use_tqdm=False)
        results.append([o.outputs[0].token_ids for o in outputs])
        for output in outputs[1::2]:
            _assert_valid_json(output, schema)
        llm.engine.check_integrity()
    assert results[0] == results[1]


def test_a_held_sampling_goes_before_the_next_schedule_once_its_mask_is_filled(monkeypatch, mask_ready):
    """The device samples a held step while the host schedules and prepares the next one when the
    step's mask is ready; while it is still filling, the host does that work first (it overlaps
    the fill) and samples after."""
    llm = LLM("random:tiny", async_scheduling=True, seed=3)
    engine, events = llm.engine, []
    real_schedule, real_launch = engine.scheduler.schedule, engine.sampler.launch

    def schedule(*args, **kwargs):
        events.append("schedule")
        return real_schedule(*args, **kwargs)

    def launch(logits, requests, *args, grammar_mask=None, **kwargs):
        events.append("sample" if grammar_mask is None else "held sample")
        return real_launch(logits, requests, *args, grammar_mask=grammar_mask, **kwargs)

    monkeypatch.setattr(engine.scheduler, "schedule", schedule)
    monkeypatch.setattr(engine.sampler, "launch", launch)
    output = llm.generate(["held"], _json_params(SCHEMAS["nested_object"], 1.0, seed=4, max_tokens=400),
                          use_tqdm=False)[0]
    _assert_valid_json(output, SCHEMAS["nested_object"])
    held = [i for i, event in enumerate(events) if event == "held sample"]
    assert len(held) >= 10
    for i in held:  # each held sampling happens in a call that schedules once: before it or after it
        assert events[i + 1 if mask_ready else i - 1] == "schedule", events[max(0, i - 2):i + 3]


def test_the_grammar_waits_for_the_end_of_the_reasoning():
    """With a reasoning parser the grammar applies from the end marker on: tokens before it are free,
    the marker's last token switches the grammar on, the next token is the grammar's first."""
    llm = LLM("random:tiny", reasoning_parser="deepseek_r1")
    engine = llm.engine
    start, end = engine.structured.reasoning_markers
    assert end == engine.tokenizer.encode("</think>", add_special_tokens=False)
    choice = StructuredOutputs.choice(["ok"])
    req = engine.add_request("r", "think first", SamplingParams(max_tokens=64, structured_outputs=choice))
    structured = engine.structured
    structured.compiler.compile(choice)  # waits for the compile thread
    ready, failed = [], []
    for _ in range(400):  # and for a grammar worker to start
        ready, failed = structured.take_compiled(wait=True)
        if ready or failed:
            break
    assert ready == [req] and not failed
    engine.scheduler.add(req)  # as the engine's step does with a ready one
    grammar = req.grammar
    assert not grammar.active  # the prompt opened no reasoning it closed: the output reasons first

    def take(tokens: list[int]) -> None:  # as the engine's step gives its tokens, one step a token
        for token in tokens:
            index = len(req.output_token_ids)
            structured.settle(structured.accept_step([req], [token], [index]))
            req.output_token_ids.append(token)

    take([ord(c) for c in "hmm "] + end)
    assert grammar.active and not grammar.failed
    take(engine.tokenizer.encode("ok", add_special_tokens=False))
    assert not grammar.failed
    mask, rows = structured.mask([req]).result()
    allowed = ((mask[0].unsqueeze(1) >> torch.arange(32, dtype=torch.int32)) & 1).flatten().nonzero().flatten()
    assert rows == [0] and set(allowed.tolist()) <= compiler_stops(structured)  # "ok" is complete: only its end
    engine.abort_request(req.request_id)
    assert reasoning_ended(start + [5] + end + [6], start, end)  # a template that closed it: the grammar starts at once
    assert not reasoning_ended([1, 2] + start, start, end)


def compiler_stops(structured) -> set[int]:
    return set(structured.compiler.stop_token_ids)


@pytest.mark.parametrize("sampling", [
    dict(temperature=0.8, top_k=5), dict(temperature=1.0, top_p=0.7), dict(temperature=1.0, min_p=0.2),
    dict(temperature=1.0, repetition_penalty=1.5, presence_penalty=1.0, frequency_penalty=0.5),
    dict(temperature=0.0, logprobs=3), dict(temperature=1.0, seed=5, logprobs=0),
])
def test_every_sampling_mode_samples_through_the_mask(byte_llm, sampling):
    """The mask comes first: filters, penalties (which must not lift a -inf) and logprobs all see
    the masked logits, and a logprob row's sampled token is one the grammar allows."""
    schema = SCHEMAS["enum_and_const"]
    params = SamplingParams(max_tokens=MAX_TOKENS, structured_outputs=StructuredOutputs.json_schema(schema),
                            **sampling)
    outputs = byte_llm.generate(["mode a", "mode b"], params, use_tqdm=False)
    for output in outputs:
        _assert_valid_json(output, schema)
        completion = output.outputs[0]
        if sampling.get("logprobs") is not None:
            assert all(entry[token] > float("-inf") for entry, token in zip(completion.logprobs, completion.token_ids))


def test_structural_tag_outputs_follow_it(byte_llm):
    """xgrammar's structural tag: the output opens the tag, holds JSON valid for its schema, closes it."""
    args = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["a"],
            "additionalProperties": False}
    tag = {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<fn="], "tags": [
        {"begin": "<fn=get>", "content": {"type": "json_schema", "json_schema": args}, "end": "</fn>"}],
        "at_least_one": True, "stop_after_first": True}}
    params = SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, structured_outputs=StructuredOutputs(
        "structural_tag", json.dumps(tag)))
    for output in byte_llm.generate(["tag a", "tag b"], params, use_tqdm=False):
        completion = output.outputs[0]
        match = re.fullmatch(r"<fn=get>(.*)</fn>", completion.text, re.DOTALL)
        assert completion.finish_reason == "stop" and match, completion.text
        jsonschema.validate(json.loads(match.group(1)), args)


def test_compiled_grammars_are_cached_with_a_bound(byte_llm):
    compiler = GrammarCompiler(byte_llm.engine.tokenizer, byte_llm.engine.model_config.vocab_size, [511], max_cached=2)
    specs = [StructuredOutputs.choice([word]) for word in ("one", "two", "three")]
    first = compiler.compile(specs[0])
    assert compiler.compile(specs[0]) is first  # a hit: the same compiled grammar
    compiler.compile(specs[1])
    compiler.compile(specs[2])  # evicts the least recently used: specs[0]
    assert compiler.compile(specs[0]) is not first
    failed = compiler.submit(StructuredOutputs("regex", "("))
    with pytest.raises(ValueError, match="structured output"):
        failed.result()
    assert compiler.submit(StructuredOutputs("regex", "(")) is not failed  # a failure is not kept
    compiler.close()


class LocalMatcherHost:
    """A grammar worker's loop (MatcherHost) in this process, one matcher (slot 0), driven step by
    step through its real messages and replies."""

    def __init__(self, compiler: GrammarCompiler, spec: StructuredOutputs) -> None:
        self.conn, theirs = multiprocessing.Pipe()
        self.masks = torch.zeros((2, 1, (compiler.vocab_size + 31) // 32), dtype=torch.int32)
        self.host = MatcherHost(theirs, self.masks, compiler.info)
        compiled = compiler.compile(spec)
        assert self.host.handle(np.array([GRAMMAR, compiled.grammar_id], dtype=np.int32).tobytes()
                                + compiled.serialized.encode())
        assert self.host.handle(np.array([MATCHER, 0, compiled.grammar_id, bounds_whitespace(spec)], dtype=np.int32))
        self.matcher = self.host.matchers[0]
        self.step_number = 0

    def _step(self, accepts: list[int], fills: list[int]) -> np.ndarray:
        self.step_number += 1
        self.host.step(np.array([STEP, self.step_number, 0, len(accepts) // 2, len(fills) // 2, 1, *accepts,
                                 *fills], dtype=np.int32))  # (1: the verdicts asked for)
        return np.frombuffer(self.conn.recv_bytes(), dtype=np.int32)

    def accept(self, token: int) -> bool:
        reply = self._step([0, token], [])
        assert reply[0] == ACCEPTED
        return 0 not in reply[2:].tolist()

    def allowed(self) -> list[int]:
        assert self._step([], [0, 0])[0] == FILLED
        bits = (self.masks[0, 0].unsqueeze(1) >> torch.arange(32, dtype=torch.int32)) & 1
        return bits.flatten().nonzero().flatten().tolist()


def test_a_grammar_terminates_exactly_when_its_matcher_does(byte_llm):
    """RequestGrammar.terminated (the engine's, no call into xgrammar per token) agrees with the
    worker's matcher, token by token through the worker's batch accept."""
    engine = byte_llm.engine
    compiler = engine.structured.compiler
    worker = LocalMatcherHost(compiler, StructuredOutputs.choice(["ok"]))
    eos = engine.tokenizer.eos_token_id
    tokens = engine.tokenizer.encode("ok", add_special_tokens=False) + [eos]
    grammar = RequestGrammar(None, 0, compiler.stop_token_ids)
    for n, token in enumerate(tokens, start=1):
        assert worker.accept(token)
        grammar.took(token)
        assert grammar.terminated == worker.matcher.is_terminated() == (n == len(tokens))
    assert not worker.accept(eos)  # a token after the end: refused


def test_the_batch_accept_reads_its_verdicts_without_handing_the_gil_over(byte_llm):
    """Right verdicts, and they come back at once while another thread runs Python. A verdict
    read that released the GIL (xgrammar's own wrapper: two reads a row) lost it to that thread
    at about one read in ten, each loss a switch interval (here 50 ms): ~2.5 s for 256 rows,
    against one loss (the accept itself) for ours."""
    engine = byte_llm.engine
    compiler = engine.structured.compiler
    compiled = xgr.CompiledGrammar.deserialize_json(compiler.compile(StructuredOutputs.choice(["ok"])).serialized,
                                                    compiler.info)
    good, bad = (engine.tokenizer.encode(text, add_special_tokens=False)[0] for text in ("o", "x"))
    matchers = [xgr.GrammarMatcher(compiled) for _ in range(256)]
    tokens = [good if i % 2 else bad for i in range(256)]
    spinning = True

    def spin():
        while spinning:
            pass

    spinner, interval = threading.Thread(target=spin), sys.getswitchinterval()
    sys.setswitchinterval(0.05)
    spinner.start()
    try:
        time.sleep(0.1)  # the spinner holds the GIL now
        started = time.perf_counter()
        verdicts = batch_accept_token(matchers, tokens)
        elapsed = time.perf_counter() - started
    finally:
        spinning = False
        spinner.join()
        sys.setswitchinterval(interval)
    assert verdicts == [token == good for token in tokens]
    assert elapsed < 0.5, f"the verdicts took {elapsed:.2f} s: GIL hand-overs"


def test_whitespace_tokens_are_the_tokens_of_json_whitespace_only(hf_llm):
    """WhitespaceTokens: a token counts its bytes when they are all JSON whitespace, and `others`
    has exactly the other tokens' bits."""
    compiler = hf_llm.engine.structured.compiler
    table, pieces = WhitespaceTokens(compiler.info, compiler.vocab_size), compiler.info.decoded_vocab
    expected = [len(p) if p and set(p) <= set(b" \t\n\r") else 0 for p in pieces]
    assert table.chars[:len(expected)] == expected and any(expected)
    bits = ((torch.from_numpy(table.others).unsqueeze(1) >> torch.arange(32, dtype=torch.int32)) & 1).flatten()
    assert [bool(b) for b in bits[:len(expected)]] == [c == 0 for c in expected]


def test_forbid_whitespace_keeps_a_row_that_allows_nothing_else():
    others = np.array([~0b0110, -1], dtype=np.int32)  # tokens 1 and 2 are whitespace only
    host = torch.tensor([[0b1111, 5], [0b0110, 0], [0b0010, 7]], dtype=torch.int32)
    forbid_whitespace(host, [0, 1], others)
    assert host.tolist() == [[0b1001, 5], [0b0110, 0], [0b0010, 7]]  # row 2 was not asked for


def test_json_whitespace_runs_are_bounded_for_a_model_that_always_picks_whitespace(byte_llm):
    """A 'model' that takes a newline whenever the mask allows one, else the lowest token allowed:
    with the grammar's whitespace unbounded it would never end; cut at MAX_WHITESPACE characters a
    run by the worker (which counts the run from the tokens it takes), its JSON ends, parses and
    validates."""
    engine = byte_llm.engine
    schema = SCHEMAS["enum_and_const"]
    spec = StructuredOutputs.json_schema(schema)
    compiler = engine.structured.compiler
    worker = LocalMatcherHost(compiler, spec)
    grammar = RequestGrammar(None, 0, compiler.stop_token_ids)
    newline = engine.tokenizer.encode("\n", add_special_tokens=False)[0]
    tokens, runs, run = [], [], 0
    while not grammar.terminated:
        assert len(tokens) < 2000, "the output never ended"
        allowed = worker.allowed()
        token = newline if newline in allowed else allowed[0]
        assert worker.accept(token)
        grammar.took(token)
        run = run + 1 if token == newline else 0
        runs.append(run)
        tokens.append(token)
    assert max(runs) == MAX_WHITESPACE  # the byte tokenizer: a character a token
    text = engine.tokenizer.decode([t for t in tokens if t not in compiler.stop_token_ids])
    jsonschema.validate(json.loads(text), schema)


def test_overlap_with_penalised_and_constrained_requests_together():
    """Penalties turn overlap off step by step (their sampling needs every token on the host)
    while constrained steps hold their sampling: both at once stay valid and consistent."""
    llm = LLM("random:tiny", async_scheduling=True, max_num_batched_tokens=16, seed=4)
    schema = SCHEMAS["bounded_array"]
    params = [_json_params(schema, temperature=1.0, seed=i) for i in range(4)]
    params += [SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True, repetition_penalty=1.2,
                              presence_penalty=0.5, seed=i) for i in range(3)]
    params += [SamplingParams(temperature=0.0, max_tokens=25, ignore_eos=True)]
    outputs = llm.generate([f"mix {i}" for i in range(len(params))], params, use_tqdm=False)
    for output in outputs[:4]:
        _assert_valid_json(output, schema)
    assert [len(o.outputs[0].token_ids) for o in outputs[4:]] == [30, 30, 30, 25]
    llm.engine.check_integrity()
    assert not llm.engine.has_unfinished_requests()


def test_a_held_step_whose_sampling_fails_ends_its_requests_and_the_next_launch_leaves_them_out(
        monkeypatch, mask_ready):
    """With overlap a constrained step's sampling is held to the next call. When that sampling
    raises, the held step's requests end with an error (all of them: the step samples as one).
    If the mask was still filling, the call had scheduled and prepared the next step (with the
    held step's requests) before it sampled: that step is not launched (it would run them after
    their blocks were freed, leaving a placeholder in each), and a request whose prefill chunk was
    in it is scheduled again and gives its greedy tokens. If the mask was ready, the call samples
    first, so the step it then schedules leaves the ended requests out and runs the others."""
    late_prompt, late_params = "x" * 60, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    config = dict(num_kv_blocks=64, max_num_batched_tokens=16, seed=5, async_scheduling=True)
    expected = LLM("random:tiny", **config).generate(late_prompt, late_params, use_tqdm=False)[0].outputs[0].token_ids
    llm = LLM("random:tiny", **config)
    engine = llm.engine
    # the grammar compiled and its worker up: the constrained request is admitted with the other
    llm.generate(["warm"], _json_params(SCHEMAS["nested_object"], 1.0, seed=1, max_tokens=60), use_tqdm=False)
    real_launch, calls = engine.sampler.launch, []

    def failing_launch(logits, requests, *args, grammar_mask=None, **kwargs):
        if grammar_mask is not None:
            calls.append(len(requests))
            # prefilling in 16-token chunks when the failure comes: the dropped step has one (mask
            # filling), or the step scheduled right after the failure has the first (mask ready)
            if len(calls) == (3 if mask_ready else 2):
                engine.add_request("late", late_prompt, late_params)
            if len(calls) == 3:
                raise RuntimeError("sampler failure")
        return real_launch(logits, requests, *args, grammar_mask=grammar_mask, **kwargs)

    monkeypatch.setattr(engine.sampler, "launch", failing_launch)
    engine.add_request("json", "constrained", _json_params(SCHEMAS["nested_object"], 1.0, seed=1, max_tokens=60))
    engine.add_request("free", "unconstrained", SamplingParams(temperature=1.0, seed=2, max_tokens=40, ignore_eos=True))
    finished = {}
    for _ in range(400):
        for delta in engine.step():
            if delta.finished:
                finished[delta.request_id] = delta.request
        engine.check_integrity()
        if not engine.has_unfinished_requests():
            break
    assert len(calls) >= 3, "the constrained request's sampling was never held three times"
    for request_id in ("json", "free"):
        request = finished[request_id]
        assert request.status.name == "FINISHED_ERROR", request_id
        # ended, the request holds no token still to come (a launch after the end would add one)
        assert PLACEHOLDER not in request.token_ids, request_id
    late = finished["late"]
    assert late.status.name == "FINISHED_LENGTH" and list(late.output_token_ids) == list(expected)
    stats = engine.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks
