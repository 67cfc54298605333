"""Engine behaviour on random:tiny: admission, chunking, abort, stops, seeds, outputs."""

from __future__ import annotations

import pytest

from roseray import LLM, SamplingParams
from roseray.config import EngineConfig
from roseray.engine.engine import LLMEngine
from roseray.engine.piecewise_graphs import token_buckets


@pytest.fixture(scope="module")
def llm():
    return LLM("random:tiny", device="cpu", block_size=4, max_model_len=256, num_kv_blocks=64)


def greedy(n, **kw):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)


def test_generate_returns_outputs_in_prompt_order(llm):
    outs = llm.generate(["abc", [5, 6, 7, 8], "a longer prompt of text"], greedy(5), use_tqdm=False)
    assert [o.prompt_token_ids for o in outs][1] == [5, 6, 7, 8]
    assert [len(o.outputs[0].token_ids) for o in outs] == [5, 5, 5]
    assert all(o.outputs[0].finish_reason == "length" and o.finished for o in outs)
    assert outs[0].prompt == "abc" and outs[0].prompt_token_ids == llm.tokenizer.encode("abc")
    assert outs[0].outputs[0].text == llm.tokenizer.decode(outs[0].outputs[0].token_ids)


def test_one_sampling_params_per_prompt(llm):
    outs = llm.generate([[1, 2], [3, 4]], [greedy(2), greedy(7)], use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [2, 7]
    with pytest.raises(ValueError, match="2 SamplingParams for 1 prompts"):
        llm.generate([[1]], [greedy(1), greedy(1)], use_tqdm=False)


def test_request_that_can_never_fit_is_refused_with_both_numbers(llm):
    with pytest.raises(ValueError,
                       match=r"prompt \(3 tokens\) \+ max_tokens \(300\) = 303 tokens exceeds max_model_len \(256\)"):
        llm.generate([[1, 2, 3]], greedy(300), use_tqdm=False)
    small = LLM("random:tiny", device="cpu", block_size=4, num_kv_blocks=8)  # 32 tokens of KV
    with pytest.raises(ValueError, match="can never fit in the KV cache"):
        small.generate([[1] * 20], greedy(20), use_tqdm=False)
    assert not small.engine.has_unfinished_requests()
    small.engine.check_integrity()


def test_bad_prompts_are_refused(llm):
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], greedy(1), use_tqdm=False)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([[1, 10**6]], greedy(1), use_tqdm=False)
    llm.engine.check_integrity()
    assert not llm.engine.has_unfinished_requests()


def test_chunked_prefill_mixes_with_running_decodes():
    engine = LLMEngine(EngineConfig(model="random:tiny", device="cpu", block_size=4, max_num_batched_tokens=8,
                                    num_kv_blocks=64))
    engine.add_request("short", [1, 2, 3], greedy(20))
    engine.step()  # prefill of "short"; it decodes from now on
    engine.add_request("long", list(range(1, 31)), greedy(4))
    batch = engine.scheduler.schedule()
    assert batch.requests[0].request_id == "short" and batch.num_new_tokens[0] == 1  # decode first
    assert batch.requests[1].request_id == "long" and batch.num_new_tokens[1] == 7  # then a chunk within budget
    assert batch.num_tokens == 8


def test_abort_frees_blocks_and_reports_once():
    engine = LLMEngine(EngineConfig(model="random:tiny", device="cpu", block_size=4, num_kv_blocks=32))
    engine.add_request("a", list(range(1, 20)), greedy(50))
    engine.add_request("b", [1, 2], greedy(50))
    engine.step()
    assert engine.block_manager.num_free_blocks < 32
    engine.abort_request("a")
    engine.abort_request("a")  # idempotent
    deltas = engine.step()
    aborted = [d for d in deltas if d.request_id == "a"]
    assert len(aborted) == 1 and aborted[0].finished and aborted[0].finish_reason == "abort"
    engine.abort_request("b")
    engine.step()
    engine.check_integrity()
    assert engine.block_manager.num_free_blocks == 32 and not engine.has_unfinished_requests()


def test_stop_token_ids_and_min_tokens(llm):
    base = llm.generate([[9, 8, 7]], greedy(10), use_tqdm=False)[0].outputs[0].token_ids
    stop_at = base[3]
    out = llm.generate([[9, 8, 7]], greedy(10, stop_token_ids=[stop_at]), use_tqdm=False)[0].outputs[0]
    first = base.index(stop_at)
    assert out.token_ids == base[: first + 1] and out.finish_reason == "stop" and out.stop_reason == stop_at
    late = llm.generate([[9, 8, 7]], greedy(10, stop_token_ids=[stop_at], min_tokens=first + 2),
                        use_tqdm=False)[0].outputs[0]
    assert len(late.token_ids) >= first + 2  # the stop token is masked until min_tokens are out
    assert late.token_ids[first] != stop_at and late.token_ids[:first] == base[:first]


def test_stop_string_cuts_text_exactly(llm):
    full = llm.generate(["hello"], greedy(24), use_tqdm=False)[0].outputs[0]
    text = full.text
    stop = next((text[i:i + 2] for i in range(3, len(text) - 2) if "\ufffd" not in text[i:i + 2]), None)
    if stop is None:
        pytest.skip("random output has no clean two-character stop string")
    out = llm.generate(["hello"], greedy(24, stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert out.text == text[: text.index(stop)] and out.finish_reason == "stop" and out.stop_reason == stop
    kept = llm.generate(["hello"], greedy(24, stop=[stop], include_stop_str_in_output=True), use_tqdm=False)[0]
    assert kept.outputs[0].text == text[: text.index(stop) + len(stop)]


def test_seeded_sampling_is_reproducible_alone_and_in_a_batch(llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=12, ignore_eos=True)
    alone = llm.generate([[1, 2, 3]], params, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    batch = llm.generate([[4, 5], [1, 2, 3], [6]], [others, params, others], use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone
    llm.engine.check_integrity()  # no generator kept for a finished request


def test_logprobs_are_returned_per_token(llm):
    out = llm.generate([[1, 2, 3]], greedy(4, logprobs=3), use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == 4
    for token, entry in zip(out.token_ids, out.logprobs):
        assert token in entry and len(entry) >= 3
        assert max(entry.values()) == pytest.approx(entry[token])  # greedy picks the most likely
    assert out.cumulative_logprob == pytest.approx(sum(e[t] for t, e in zip(out.token_ids, out.logprobs)))


def test_failing_forward_ends_requests_with_error_and_engine_recovers():
    engine = LLMEngine(EngineConfig(model="random:tiny", device="cpu", block_size=4, num_kv_blocks=32))
    real_forward = engine.runner.model.forward

    def broken(*args, **kwargs):
        raise RuntimeError("injected fault")

    engine.runner.model.forward = broken
    engine.add_request("x", [1, 2, 3], greedy(5))
    deltas = engine.step()
    assert [(d.request_id, d.finish_reason) for d in deltas] == [("x", "error")]
    assert isinstance(engine.last_error, RuntimeError)
    engine.check_integrity()
    assert engine.block_manager.num_free_blocks == 32
    engine.runner.model.forward = real_forward
    engine.add_request("y", [1, 2, 3], greedy(5))
    while engine.has_unfinished_requests():
        deltas = engine.step()
    assert deltas[-1].finish_reason == "length" and deltas[-1].num_output_tokens == 5


def test_overlapped_steps_give_the_same_outputs():
    """With async scheduling the host processes step N while step N+1 runs; outputs,
    texts and finish reasons must equal the step-by-step engine's, stops included."""
    base = LLM("random:tiny", device="cpu", block_size=4, num_kv_blocks=40, max_num_batched_tokens=16)
    probe = base.generate([[9, 8, 7]], greedy(12), use_tqdm=False)[0].outputs[0]
    prompts = [[9, 8, 7], list(range(1, 30)), [5] * 11, [42], list(range(100, 140)), [7, 7]]
    params = [
        greedy(12, stop_token_ids=[probe.token_ids[4]]),
        SamplingParams(temperature=0.9, seed=7, max_tokens=20, ignore_eos=True, logprobs=2),
        greedy(9, stop=[probe.text[5:7]] if len(probe.text) > 7 else None),
        SamplingParams(temperature=1.0, seed=3, max_tokens=15, min_tokens=5, ignore_eos=True),
        greedy(30),
        SamplingParams(temperature=0.0, max_tokens=10, repetition_penalty=1.3, ignore_eos=True),
    ]
    results = []
    for overlap in (False, True):
        llm = LLM("random:tiny", device="cpu", block_size=4, num_kv_blocks=40, max_num_batched_tokens=16,
                  async_scheduling=overlap)
        outs = llm.generate(prompts, params, use_tqdm=False)
        llm.engine.check_integrity()
        assert llm.engine.block_manager.num_free_blocks == 40
        results.append([(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason,
                         o.outputs[0].logprobs) for o in outs])
    assert results[0] == results[1]
    assert results[1][0][2] == "stop" and results[1][4][2] == "length"


def test_abort_while_a_step_is_in_flight():
    engine = LLMEngine(EngineConfig(model="random:tiny", device="cpu", block_size=4, num_kv_blocks=32,
                                    async_scheduling=True))
    engine.add_request("a", [1, 2, 3], greedy(50))
    engine.add_request("b", [4, 5, 6], greedy(5))
    engine.step()  # launches the prefill; its tokens are still in flight
    engine.abort_request("a")
    finished = {}
    while engine.has_unfinished_requests():
        for d in engine.step():
            if d.finished:
                finished[d.request_id] = (d.finish_reason, d.num_output_tokens)
    assert finished == {"a": ("abort", 0), "b": ("length", 5)}
    engine.check_integrity()
    assert engine.block_manager.num_free_blocks == 32


def test_a_prompt_that_fills_max_model_len_is_refused_not_fatal(llm):
    """With max_tokens unset the output budget is max_model_len - prompt: a prompt that
    leaves none must be refused at admission, not crash the first step."""
    with pytest.raises(ValueError,
                       match=r"the prompt \(256 tokens\) leaves no room for output within max_model_len \(256\)"):
        llm.generate([[1] * 256], SamplingParams(max_tokens=None), use_tqdm=False)
    assert llm.generate([[1] * 250], SamplingParams(max_tokens=None, temperature=0.0, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].finish_reason == "length"


def test_logprobs_beyond_the_engine_limit_are_refused():
    engine = LLMEngine(EngineConfig(model="random:tiny", device="cpu", num_kv_blocks=16, max_logprobs=2))
    with pytest.raises(ValueError, match="logprobs must be at most 2, got 3"):
        engine.add_request("x", [1, 2], greedy(2, logprobs=3))
    assert not engine.has_unfinished_requests()


def test_piecewise_token_buckets_and_cpu_runs_eagerly():
    assert token_buckets(512) == [32, 64, 128, 256, 512]
    assert token_buckets(600) == [32, 64, 128, 256, 512, 576, 600]
    large = token_buckets(8192)
    assert len(large) == 37 and large[-1] == 8192 and large == sorted(set(large))
    # past 512 tokens a step is padded by less than 1/8 of its tokens (it was up to 2x)
    for tokens in range(513, 8193, 7):
        bucket = next(b for b in large if b >= tokens)
        assert bucket - tokens < tokens / 8, (tokens, bucket)
    assert token_buckets(16) == [16]
    llm = LLM("random:tiny", device="cpu", num_kv_blocks=32)
    assert llm.engine.runner.piecewise is None and not llm.engine.runner.graphs
    with pytest.raises(ValueError, match="cuda_graph_max_tokens"):
        LLM("random:tiny", device="cpu", cuda_graph_max_tokens=-1)


@pytest.mark.parametrize("pad", [0, 3])
def test_decode_step_inputs_match_a_per_request_reference(pad):
    """ModelRunner.prepare_decode (one token per request, CUDA-graph padding) lays out ids,
    positions, slots, lengths, in-flight source rows and block tables exactly as the
    definitions say, for requests of different lengths crossing block boundaries."""
    engine = LLMEngine(EngineConfig(model="random:tiny", device="cpu", num_kv_blocks=64, block_size=4,
                                    max_num_seqs=8, async_scheduling=False))
    for i, length in enumerate([1, 3, 4, 7, 9]):
        engine.add_request(f"d{i}", list(range(1, length + 1)), SamplingParams(temperature=0.0, max_tokens=20,
                                                                               ignore_eos=True))
    for _ in range(3):
        engine.step()
    batch = engine.scheduler.schedule()
    assert batch.num_tokens == len(batch) == 5
    n, bs = len(batch), 4
    batch.requests[2].token_ids[-1] = -1  # a placeholder: the step in flight samples it
    batch.requests[2].sample_row = 6
    used, cols, max_len = engine.runner.prepare_decode(batch, engine.block_manager, n + pad)
    host, lay = engine.runner._host, engine.runner.decode_layout
    table = engine.block_manager.block_tables
    assert max_len == max(r.num_computed_tokens for r in batch.requests) + 1 and cols == -(-max_len // bs)
    for i, req in enumerate(batch.requests):
        pos = req.num_computed_tokens
        assert host[lay.ids + i] == req.token_ids[pos] and host[lay.pos + i] == pos
        assert host[lay.slot + i] == table[req.row, pos // bs] * bs + pos % bs
        assert host[lay.lens + i] == pos + 1
        assert host[lay.src + i] == (6 if i == 2 else -1)
        row = host[lay.tables + i * cols: lay.tables + (i + 1) * cols]
        assert row.tolist() == table[req.row, :cols].tolist()
    assert used == lay.tables + (n + pad) * cols
    for start, value in ((lay.slot, -1), (lay.lens, 0), (lay.src, -1)):
        assert host[start + n: start + n + pad].tolist() == [value] * pad
