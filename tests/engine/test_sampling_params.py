"""SamplingParams validation: every rule rejects bad values with a message naming the field."""

import math

import pytest

from roseray.sampling_params import MAX_LOGPROBS, SamplingParams


def test_defaults_are_valid_and_normalised():
    params = SamplingParams()
    assert params.n == 1 and params.temperature == 1.0 and params.top_k == -1 and params.max_tokens == 16
    assert params.stop == [] and params.stop_token_ids == []
    assert not params.is_greedy and not params.needs_penalties


@pytest.mark.parametrize("kwargs, field", [
    (dict(n=2), "n must be 1"),
    (dict(n=0), "n must be 1"),
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=math.inf), "temperature"),
    (dict(temperature=math.nan), "temperature"),
    (dict(temperature="1"), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.01), "top_p"),
    (dict(top_p=math.nan), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(top_k=1.5), "top_k"),
    (dict(min_p=-0.01), "min_p"),
    (dict(min_p=1.5), "min_p"),
    (dict(min_p=math.nan), "min_p"),
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(presence_penalty=-2.01), "presence_penalty"),
    (dict(presence_penalty=math.inf), "presence_penalty"),
    (dict(frequency_penalty=-3.0), "frequency_penalty"),
    (dict(frequency_penalty=math.nan), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(repetition_penalty=2.1), "repetition_penalty"),
    (dict(repetition_penalty=-math.inf), "repetition_penalty"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=2.0), "max_tokens"),
    (dict(min_tokens=-1), "min_tokens"),
    (dict(min_tokens=17, max_tokens=16), "min_tokens must be <= max_tokens"),
    (dict(stop=""), "stop"),
    (dict(stop=["ok", ""]), "stop"),
    (dict(stop=["ok", 3]), "stop"),
    (dict(stop=7), "stop"),
    (dict(stop=[f"s{i}" for i in range(17)]), "at most 16"),
    (dict(stop_token_ids=[1, -1]), "stop_token_ids"),
    (dict(stop_token_ids=[1.0]), "stop_token_ids"),
    (dict(stop_token_ids=5), "stop_token_ids"),
    (dict(logprobs=-1), "logprobs"),
    (dict(logprobs=MAX_LOGPROBS + 1), "logprobs"),
    (dict(seed=1.5), "seed"),
    (dict(seed="7"), "seed"),
    (dict(ignore_eos="yes"), "ignore_eos"),
])
def test_invalid_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_error_message_states_the_allowed_range():
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\], got 0.0"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match=r"repetition_penalty must be in \(0, 2.0\]"):
        SamplingParams(repetition_penalty=3.0)


@pytest.mark.parametrize("kwargs", [
    dict(temperature=0), dict(temperature=2), dict(top_p=1), dict(top_p=1e-6), dict(top_k=0),
    dict(top_k=1), dict(top_k=50), dict(min_p=0), dict(min_p=1), dict(presence_penalty=-2),
    dict(frequency_penalty=2), dict(repetition_penalty=2), dict(repetition_penalty=0.01),
    dict(max_tokens=None, min_tokens=1000), dict(max_tokens=1), dict(min_tokens=16), dict(logprobs=0),
    dict(logprobs=MAX_LOGPROBS), dict(seed=-5), dict(seed=2**70), dict(stop_token_ids=[0, 2]),
])
def test_boundary_values_are_accepted(kwargs):
    SamplingParams(**kwargs)


def test_stop_is_normalised_to_a_list():
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop=[f"s{i}" for i in range(16)]).stop[-1] == "s15"
    assert SamplingParams(stop_token_ids=(3, 4)).stop_token_ids == [3, 4]


def test_is_greedy():
    assert SamplingParams(temperature=0.0).is_greedy
    assert SamplingParams(temperature=0.8, top_k=1).is_greedy
    assert not SamplingParams(temperature=0.8, top_k=2).is_greedy
    assert not SamplingParams(temperature=1e-3).is_greedy


def test_needs_penalties():
    assert not SamplingParams().needs_penalties
    assert SamplingParams(presence_penalty=0.1).needs_penalties
    assert SamplingParams(frequency_penalty=-0.1).needs_penalties
    assert SamplingParams(repetition_penalty=1.1).needs_penalties
