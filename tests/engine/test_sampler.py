"""Sampler: greedy, filters (top-k/top-p/min-p), seeds, penalties, min_tokens, logprobs."""

import math
import warnings
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from roseray.engine.logits_processors import apply_penalties
from roseray.engine.request import Request
from roseray.engine.sampler import Sampler
from roseray.layers import fused
from roseray.sampling_params import SamplingParams

EOS = 3


def make_request(params: SamplingParams, prompt=(5, 6), output=(), eos=frozenset({EOS}), rid="r") -> Request:
    req = Request(rid, list(prompt), params, eos_token_ids=eos, max_tokens=params.max_tokens or 64)
    for token_id in output:
        append_token(req, token_id)
    return req


def append_token(req: Request, token_id: int) -> None:
    req.output_token_ids.append(token_id)
    req.token_ids.append(token_id)


def random_logits(batch_size: int, vocab_size: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch_size, vocab_size, generator=torch.Generator().manual_seed(seed)) * 3


# --- greedy ---------------------------------------------------------------------------


def test_greedy_is_argmax_and_fast_path_has_no_logprobs():
    logits = random_logits(8, 100)
    requests = [make_request(SamplingParams(temperature=0.0)) for _ in range(7)]
    requests.append(make_request(SamplingParams(temperature=0.7, top_k=1)))  # top_k=1 is greedy too
    out = Sampler()(logits, requests)
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.logprobs is None and out.sampled_logprobs is None


def test_temperature_zero_rows_are_greedy_in_a_mixed_batch():
    logits = random_logits(6, 50, seed=1)
    sampled = SamplingParams(temperature=5.0)  # flat enough that argmax is rarely drawn by chance
    requests = [make_request(SamplingParams(temperature=0.0) if i % 2 == 0 else sampled) for i in range(6)]
    argmax = logits.argmax(dim=-1).tolist()
    sampler = Sampler(seed=0)
    sampled_rows_differ = 0
    for _ in range(50):
        out = sampler(logits, requests)
        assert [out.token_ids[i] for i in (0, 2, 4)] == [argmax[i] for i in (0, 2, 4)]
        sampled_rows_differ += sum(out.token_ids[i] != argmax[i] for i in (1, 3, 5))
    assert sampled_rows_differ > 50  # the other rows really are sampled


@pytest.mark.parametrize("all_plain_greedy", [False, True])
def test_greedy_over_bf16_logits_is_the_fp32_argmax_first_index_on_ties(all_plain_greedy):
    """GPT-2 hands over bf16 logits (no fp32 copy): the argmax must be the one of their fp32 upcast."""
    logits = random_logits(5, 300, seed=2).to(torch.bfloat16)
    logits[1, 7] = logits[1, 250] = logits[1].max() + 1  # a tie: the first index
    logits[3, -1] = logits[3].max() + 1
    requests = [make_request(SamplingParams(temperature=0.0)) for _ in range(5)]
    out = Sampler().launch(logits, requests, all_plain_greedy=all_plain_greedy).result()
    assert out.token_ids == logits.float().argmax(dim=-1).tolist()
    assert out.token_ids[1] == 7 and out.token_ids[3] == 299


def test_bf16_logits_with_penalties_logprobs_and_sampling_match_their_fp32_upcast():
    """Every stage past the plain argmax works on an fp32 copy: bf16 logits give what their
    fp32 upcast gives, seed for seed."""
    logits = random_logits(4, 60, seed=3).to(torch.bfloat16)
    requests = [make_request(SamplingParams(temperature=0.0, logprobs=3, repetition_penalty=1.3), output=[1, 2]),
                make_request(SamplingParams(temperature=0.8, top_k=20, seed=5)),
                make_request(SamplingParams(temperature=1.2, top_p=0.9, logprobs=2, seed=6)),
                make_request(SamplingParams(temperature=0.0, min_tokens=3), output=[4])]
    got = Sampler(seed=0)(logits, requests)
    want = Sampler(seed=0)(logits.float(), requests)
    assert got.token_ids == want.token_ids
    assert got.logprobs == want.logprobs and got.sampled_logprobs == want.sampled_logprobs


def test_sampler_does_not_modify_the_callers_logits():
    logits = random_logits(2, 20)
    before = logits.clone()
    requests = [make_request(SamplingParams(temperature=0.5, top_p=0.5, repetition_penalty=1.5, min_tokens=2)),
                make_request(SamplingParams(temperature=0.0, frequency_penalty=1.0), output=[1, 1])]
    Sampler(seed=0)(logits, requests)
    assert torch.equal(logits, before)


# --- filters never emit excluded tokens -------------------------------------------------


def allowed_tokens(logits_row: torch.Tensor, params: SamplingParams, tol: float = 1e-4) -> set[int]:
    """Tokens the filters may emit, with tolerance for ties and float32 rounding (float64 reference)."""
    scaled = (logits_row / torch.tensor(params.temperature, dtype=torch.float32)).double()
    vocab_size = scaled.numel()
    num_greater = (scaled.unsqueeze(0) > scaled.unsqueeze(1)).sum(dim=1)  # [V]: tokens strictly above
    top_k = params.top_k if params.top_k >= 1 else vocab_size
    in_top_k = num_greater < top_k
    probs = torch.where(in_top_k, scaled, torch.tensor(-math.inf, dtype=torch.float64)).softmax(dim=0)
    mass_greater = ((probs.unsqueeze(0) > probs.unsqueeze(1)) * probs.unsqueeze(0)).sum(dim=1)
    in_top_p = mass_greater < params.top_p + tol if params.top_p < 1.0 else torch.ones_like(in_top_k)
    above_min_p = (scaled - scaled.max()).exp() >= params.min_p - tol
    return set(torch.nonzero(in_top_k & in_top_p & above_min_p).flatten().tolist())


filter_cases = st.integers(1, 40).flatmap(lambda vocab_size: st.tuples(
    st.lists(st.floats(-8, 8, width=32) | st.sampled_from([0.0, 1.0, 2.5]),  # ties on purpose
             min_size=vocab_size, max_size=vocab_size),
    st.floats(0.05, 3.0),
    st.sampled_from([-1, 0]) | st.integers(1, vocab_size + 2),
    st.sampled_from([1.0]) | st.floats(0.01, 1.0),
    st.sampled_from([0.0]) | st.floats(0.0, 1.0),
    st.integers(0, 2**32),
    st.sampled_from([-1]) | st.integers(1, vocab_size),  # top_k of other rows in the batch
))


@settings(max_examples=300, deadline=None)
@given(filter_cases)
def test_filters_never_emit_excluded_tokens(case):
    values, temperature, top_k, top_p, min_p, seed, other_top_k = case
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    logits_row = torch.tensor(values, dtype=torch.float32)
    allowed = allowed_tokens(logits_row, params)
    assert int(logits_row.argmax()) in allowed  # the top token always survives
    num_draws = 48
    other = SamplingParams(temperature=1.0, top_k=other_top_k, top_p=0.8)  # changes the candidate count
    requests = [make_request(params) for _ in range(num_draws)] + [make_request(other) for _ in range(16)]
    out = Sampler(seed=seed)(logits_row.expand(len(requests), -1).contiguous(), requests)
    assert set(out.token_ids[:num_draws]) <= allowed


def test_top_p_keeps_the_smallest_nucleus_and_samples_in_proportion():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().expand(4000, -1).contiguous()
    requests = [make_request(SamplingParams(top_p=0.7)) for _ in range(4000)]
    counts = Counter(Sampler(seed=1)(logits, requests).token_ids)
    assert set(counts) == {0, 1}  # 0.5 < 0.7, 0.5 + 0.3 >= 0.7
    assert abs(counts[0] / 4000 - 0.5 / 0.8) < 0.04
    requests = [make_request(SamplingParams(top_p=0.45)) for _ in range(200)]
    assert set(Sampler(seed=1)(logits[:200], requests).token_ids) == {0}  # at least the top token


def test_top_p_after_top_k_uses_the_renormalised_top_k_in_a_mixed_batch():
    probs = torch.tensor([0.4, 0.3, 0.2, 0.05, 0.03, 0.02])
    logits = probs.log().expand(600, -1).contiguous()
    top_2 = SamplingParams(top_k=2, top_p=0.5)  # within the top 2: 0.57, 0.43 -> token 0 alone reaches 0.5
    top_4 = SamplingParams(top_k=4)  # makes 4 candidates per row
    requests = [make_request(top_2 if i % 2 == 0 else top_4) for i in range(600)]
    token_ids = Sampler(seed=4)(logits, requests).token_ids
    assert set(token_ids[0::2]) == {0}
    assert set(token_ids[1::2]) == {0, 1, 2, 3}


def test_top_k_and_min_p_exclude_and_plain_sampling_follows_softmax():
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    logits = probs.log().expand(4000, -1).contiguous()
    top_k = Sampler(seed=2)(logits, [make_request(SamplingParams(top_k=2)) for _ in range(4000)]).token_ids
    assert set(top_k) == {0, 1}
    min_p = Sampler(seed=2)(logits, [make_request(SamplingParams(min_p=0.6)) for _ in range(4000)]).token_ids
    assert set(min_p) == {0, 1}  # 0.2 < 0.6 * 0.4
    plain = Counter(Sampler(seed=2)(logits, [make_request(SamplingParams()) for _ in range(4000)]).token_ids)
    for token_id, p in enumerate(probs.tolist()):
        assert abs(plain[token_id] / 4000 - p) < 0.03


# --- seeds ----------------------------------------------------------------------------


DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])]
# (device, fused): the torch path and the Triton Gumbel-max path (interpreted on CPU, which only
# a machine without CUDA sets up: conftest.py).
DEVICE_PATHS = [("cpu", False),
                pytest.param("cpu", True, marks=pytest.mark.skipif(
                    torch.cuda.is_available(), reason="the Triton interpreter is set up only without CUDA")),
                *[pytest.param("cuda", fused, marks=[pytest.mark.gpu, pytest.mark.skipif(
                    not torch.cuda.is_available(), reason="needs CUDA")]) for fused in (False, True)]]
FUSED_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # where the fused-path tests run


def step_logits(step: int, vocab_size: int = 500) -> torch.Tensor:
    return torch.randn(vocab_size, generator=torch.Generator().manual_seed(1000 + step))  # [V]


def generate_alone(params: SamplingParams, num_steps: int, device: str, fused: bool | None = None) -> list[int]:
    req = make_request(params, rid="alone")
    sampler = Sampler(seed=12345, fused=fused)
    for step in range(num_steps):
        token_id = sampler(step_logits(step).unsqueeze(0).to(device), [req]).token_ids[0]
        append_token(req, token_id)
    return req.output_token_ids


@pytest.mark.parametrize("device,fused", DEVICE_PATHS)
def test_seeded_requests_give_the_same_tokens_alone_and_in_any_batch(device, fused):
    num_steps = 10
    nucleus = SamplingParams(temperature=1.2, top_p=0.95, seed=42)
    top_k_nucleus = SamplingParams(temperature=0.9, top_k=40, top_p=0.9, min_p=0.02, seed=5, repetition_penalty=1.3)
    alone = {"nucleus": generate_alone(nucleus, num_steps, device, fused),
             "top_k_nucleus": generate_alone(top_k_nucleus, num_steps, device, fused)}
    assert generate_alone(nucleus, num_steps, device, fused) == alone["nucleus"]
    assert generate_alone(SamplingParams(temperature=1.2, top_p=0.95, seed=43), num_steps, device,
                          fused) != alone["nucleus"]

    targets = {name: make_request(params, rid=name) for name, params in
               (("nucleus", nucleus), ("top_k_nucleus", top_k_nucleus))}
    others = {
        "unseeded": make_request(SamplingParams(temperature=1.0), rid="unseeded"),
        "top_k_same_seed": make_request(SamplingParams(temperature=0.8, top_k=20, seed=42), rid="top_k_same_seed"),
        "greedy": make_request(SamplingParams(temperature=0.0), rid="greedy"),
        "seeded": make_request(SamplingParams(temperature=1.5, seed=7, presence_penalty=1.0), rid="seeded"),
        "logprobs": make_request(SamplingParams(temperature=1.0, logprobs=2), rid="logprobs"),
    }
    # Batches change every step: members come and go, targets move rows, and the top-k/top-p
    # candidate count changes (all rows with top-k: 40 candidates; otherwise the whole vocab).
    batches = [["top_k_nucleus", "greedy", "top_k_same_seed"], ["unseeded", "nucleus", "top_k_nucleus", "logprobs"],
               ["nucleus"], ["greedy", "top_k_same_seed", "top_k_nucleus", "seeded", "nucleus"],
               ["top_k_nucleus"], ["logprobs", "nucleus", "unseeded", "greedy", "seeded", "top_k_nucleus"]]
    sampler = Sampler(fused=fused)  # a different shared seed must not matter
    step = 0
    while any(len(t.output_token_ids) < num_steps for t in targets.values()):
        batch = [targets.get(name) or others[name] for name in batches[step % len(batches)]]
        batch = [r for r in batch if r.request_id not in targets or len(r.output_token_ids) < num_steps]
        logits = torch.stack([step_logits(len(r.output_token_ids)) if r.request_id in targets else torch.randn(500)
                              for r in batch])
        out = sampler(logits.to(device), batch)
        for req, token_id in zip(batch, out.token_ids):
            append_token(req, token_id)
        step += 1
    assert {name: t.output_token_ids for name, t in targets.items()} == alone


@pytest.mark.parametrize("fused", [False, True])
def test_unseeded_sampler_seed_makes_runs_repeatable(fused):
    logits = random_logits(16, 300, seed=3).to(FUSED_DEVICE if fused else "cpu")
    requests = [make_request(SamplingParams()) for _ in range(16)]
    first = Sampler(seed=9, fused=fused)(logits, requests).token_ids
    assert first == Sampler(seed=9, fused=fused)(logits, requests).token_ids
    assert first != Sampler(seed=10, fused=fused)(logits, requests).token_ids


def test_a_seeded_request_keeps_its_generator_until_released():
    """The sampler keeps a seeded request's generator by request id: its draws go on from
    step to step, and once the request is released the same id starts afresh."""
    logits = random_logits(1, 50, seed=7)
    sampler, params = Sampler(seed=0), SamplingParams(temperature=5.0, seed=11)
    first = [sampler(logits, [make_request(params, rid="s")]).token_ids[0] for _ in range(20)]
    assert len(set(first)) > 1  # one generator drawn on: different tokens step after step
    sampler.release(make_request(params, rid="s"))
    again = [sampler(logits, [make_request(params, rid="s")]).token_ids[0] for _ in range(20)]
    assert again == first


# --- the fused Gumbel-max path (Triton; interpreted on CPU) -----------------------------------


def test_fused_path_plain_sampling_follows_softmax_over_temperature():
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    logits = probs.log().expand(4000, -1).contiguous().to(FUSED_DEVICE)
    temperature = 0.6
    requests = [make_request(SamplingParams(temperature=temperature)) for _ in range(4000)]
    counts = Counter(Sampler(seed=2, fused=True)(logits, requests).token_ids)
    expected = torch.softmax(probs.log() / temperature, dim=0).tolist()
    chi_square = sum((counts[t] - 4000 * p) ** 2 / (4000 * p) for t, p in enumerate(expected))
    assert set(counts) <= {0, 1, 2, 3} and chi_square < 16.3  # 3 degrees of freedom: P(chi2 > 16.3) = 0.001


def test_fused_path_keeps_greedy_rows_exact_and_merges_the_other_rows():
    logits = random_logits(8, 64, seed=6)
    requests = [
        make_request(SamplingParams(temperature=0.0)),  # plain greedy: the kernel's argmax
        make_request(SamplingParams(temperature=5.0)),  # plain sampled: the kernel
        make_request(SamplingParams(temperature=0.0, presence_penalty=0.5), output=[10]),  # 10 -> 11
        make_request(SamplingParams(temperature=0.7, logprobs=3)),  # full path, with logprobs
        make_request(SamplingParams(temperature=0.9, top_k=1)),  # greedy by top_k
        make_request(SamplingParams(temperature=0.8, top_k=2)),  # full path: top-2 only
        make_request(SamplingParams(temperature=1.0, min_tokens=2), output=[]),  # EOS blocked
        make_request(SamplingParams(temperature=5.0)),
    ]
    logits[2, 10], logits[2, 11] = 50.0, 49.9
    logits[6, EOS] = 50.0  # would always win without min_tokens
    logits = logits.to(FUSED_DEVICE)
    fused, reference = Sampler(seed=0, fused=True), Sampler(seed=0, fused=False)
    argmax = logits.argmax(dim=-1).tolist()
    sampled_differ = 0
    for _ in range(10):
        out = fused(logits, requests)
        want = reference(logits, requests)
        assert out.token_ids[0] == argmax[0] and out.token_ids[4] == argmax[4]
        assert out.token_ids[2] == want.token_ids[2] == 11  # the penalty applied
        assert out.token_ids[5] in set(logits[5].cpu().topk(2).indices.tolist())
        assert out.token_ids[6] != EOS
        raw = logits[3].cpu().log_softmax(dim=-1)
        assert list(out.logprobs[3])[:3] == raw.topk(3).indices.tolist()
        assert out.sampled_logprobs[3] == pytest.approx(float(raw[out.token_ids[3]]))
        assert all(out.logprobs[row] is None for row in (0, 1, 2, 4, 5, 6, 7))
        sampled_differ += (out.token_ids[1] != argmax[1]) + (out.token_ids[7] != argmax[7])
    assert sampled_differ > 10  # the temperature-5 rows really are sampled


# --- penalties and min_tokens -----------------------------------------------------------


def test_penalties_match_a_hand_computed_example():
    logits = torch.tensor([[2.0, -1.0, 0.5, 1.0, -2.0]])
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    req = make_request(params, prompt=[0, 4], output=[1, 1, 3], eos=frozenset())
    apply_penalties(logits, [req], [0])
    # repetition on prompt+output {0, 1, 3, 4}: positive / 2, negative * 2; token 2 unseen.
    # frequency/presence on output only: token 1 (twice) -= 2*0.5 + 0.25, token 3 (once) -= 0.5 + 0.25.
    expected = [2.0 / 2, -1.0 * 2 - 1.0 - 0.25, 0.5, 1.0 / 2 - 0.5 - 0.25, -2.0 * 2]
    assert logits[0].tolist() == pytest.approx(expected)


def test_penalties_apply_only_to_their_rows_and_steer_greedy():
    logits = torch.tensor([[3.0, 2.9, 0.0, 0.0], [3.0, 2.9, 0.0, 0.0]])
    penalised = make_request(SamplingParams(temperature=0.0, presence_penalty=0.5), output=[0], eos=frozenset())
    plain = make_request(SamplingParams(temperature=0.0), output=[0], eos=frozenset())
    assert Sampler()(logits, [penalised, plain]).token_ids == [1, 0]
    rows = logits.clone()
    apply_penalties(rows, [penalised], [0])
    assert rows[1].tolist() == logits[1].tolist() and rows[0, 0] == pytest.approx(2.5)


def test_min_tokens_blocks_eos_and_stop_token_ids_until_reached():
    logits = torch.tensor([[0.0, 1.0, 5.0, 9.0, 8.0]])  # EOS (3) best, stop token 4 next
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[4])
    req = make_request(params, eos=frozenset({EOS}))
    sampler = Sampler()
    for _ in range(3):
        token_id = sampler(logits, [req]).token_ids[0]
        assert token_id == 2
        append_token(req, token_id)
    assert sampler(logits, [req]).token_ids[0] == EOS


def test_min_tokens_holds_for_sampled_rows():
    logits = torch.tensor([[0.0, 0.0, 0.0, 6.0]]).expand(500, -1).contiguous()
    requests = [make_request(SamplingParams(min_tokens=1)) for _ in range(500)]
    assert EOS not in Sampler(seed=0)(logits, requests).token_ids


# --- logprobs -----------------------------------------------------------------------------


def test_logprobs_top_n_are_raw_log_softmax_sorted_with_the_sampled_token():
    logits = random_logits(3, 64, seed=5)
    requests = [make_request(SamplingParams(temperature=0.7, logprobs=5, frequency_penalty=1.0), output=[7]),
                make_request(SamplingParams(temperature=0.9)),
                make_request(SamplingParams(temperature=1.0, logprobs=0))]
    out = Sampler(seed=0)(logits, requests)
    raw = logits.log_softmax(dim=-1)
    assert out.logprobs[1] is None and out.sampled_logprobs[1] is None
    entry = out.logprobs[0]
    top5 = raw[0].topk(5)
    assert list(entry)[:5] == top5.indices.tolist()
    assert list(entry.values())[:5] == pytest.approx(top5.values.tolist())
    assert list(entry.values()) == sorted(entry.values(), reverse=True)
    sampled = out.token_ids[0]
    assert entry[sampled] == pytest.approx(float(raw[0, sampled]))
    assert out.sampled_logprobs[0] == pytest.approx(float(raw[0, sampled]))
    assert out.logprobs[2] == {out.token_ids[2]: pytest.approx(float(raw[2, out.token_ids[2]]))}


def test_logprobs_list_a_sampled_token_outside_the_top_n_last():
    logits = torch.tensor([[4.0, 3.0, 1.0, 0.0]])
    req = make_request(SamplingParams(temperature=0.0, logprobs=1, repetition_penalty=2.0), output=[0],
                       prompt=[], eos=frozenset())
    out = Sampler()(logits, [req])  # penalty: token 0 -> 2.0, so greedy picks 1 (rank 2 in raw logprobs)
    raw = logits.log_softmax(dim=-1)[0]
    assert out.token_ids == [1]
    assert list(out.logprobs[0].items()) == [(0, pytest.approx(float(raw[0]))), (1, pytest.approx(float(raw[1])))]


# --- device ---------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_one_device_to_host_sync_per_call_on_gpu():
    device = torch.device("cuda")
    logits = random_logits(6, 1000, seed=7).to(device)
    requests = [
        make_request(SamplingParams(temperature=0.0)),
        make_request(SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05, seed=3)),
        make_request(SamplingParams(temperature=1.0, repetition_penalty=1.2, presence_penalty=0.5), output=[1, 2]),
        make_request(SamplingParams(temperature=1.0, logprobs=5, min_tokens=4)),
        make_request(SamplingParams(temperature=0.5, top_k=10)),
        make_request(SamplingParams(temperature=0.0, logprobs=0, frequency_penalty=1.0), output=[9]),
    ]
    plain = [make_request(SamplingParams(temperature=0.6)), make_request(SamplingParams(temperature=0.0))]
    for sampler, batch in [(Sampler(seed=0), b) for b in (requests, requests[:1], requests[1:2])] + [
            (Sampler(seed=0, fused=True), b) for b in (requests, plain, plain[:1] + requests[1:])]:
        sampler(logits[: len(batch)], batch)  # warm-up: generators, pinned memory pool, kernels
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                sampler(logits[: len(batch)], batch)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        syncs = [w for w in caught if "called a synchronizing CUDA operation" in str(w.message)]
        # At most the final wait for the host copy (an event wait, which the debug mode may not count).
        assert len(syncs) <= 1, [str(w.message) for w in syncs]


def test_cached_prompt_ids_follow_the_request_not_just_its_id():
    logits = torch.tensor([[3.0, 2.9, 2.8, 0.0]])
    sampler = Sampler()
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    first = make_request(params, prompt=[0], eos=frozenset(), rid="same-id")
    assert [sampler(logits, [first]).token_ids[0] for _ in range(2)] == [1, 1]  # second call: cached
    second = make_request(params, prompt=[1], eos=frozenset(), rid="same-id")  # a new request, same id
    assert sampler(logits, [second]).token_ids == [0]
    both = make_request(params, prompt=[0, 1], eos=frozenset(), rid="other")
    assert sampler(logits.expand(2, -1), [second, both]).token_ids == [0, 2]


def test_top_p_that_rounds_to_zero_in_float32_keeps_the_top_token():
    import torch as _torch

    from roseray.engine.logits_processors import apply_top_k_top_p

    logits = _torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    apply_top_k_top_p(logits, None, _torch.tensor([5e-324], dtype=_torch.float32), num_candidates=4)
    kept = _torch.isfinite(logits[0]).nonzero().flatten().tolist()
    assert kept == [1]


@pytest.mark.skipif(not fused.HAVE_TRITON, reason="needs Triton")
def test_warm_up_row_counts_cover_every_kernel_variant():
    """Sampler.warm_up runs one batch per compiled variant of the fused kernels: every batch
    size up to the maximum must need a variant one of those row counts compiled."""
    import triton

    from roseray_kernels.sampling import split_columns, variant_row_counts

    for max_rows, vocab in ((256, 151936), (128, 50257), (7, 512)):
        counts = variant_row_counts(max_rows, vocab)
        key = lambda n: triton.next_power_of_2(triton.cdiv(vocab, split_columns(n, vocab)))  # noqa: E731
        assert counts[0] == 1 and counts == sorted(set(counts)) and counts[-1] <= max_rows
        assert {key(n) for n in range(1, max_rows + 1)} == {key(n) for n in counts}
