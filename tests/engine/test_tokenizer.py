"""Tokenizers: the byte tokenizer of random presets and the wrapper over HF tokenizers."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from roseray.models.loader import load_model_config
from roseray.models.presets import preset_config
from roseray.tokenizer import ByteTokenizer, HFTokenizer, default_chat_template, load_tokenizer
from tests.models.hf_models import CHAT_TEMPLATE, make_tiny_model

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "héllo 🙂"}]


@pytest.fixture(scope="module")
def byte_tokenizer() -> ByteTokenizer:
    tokenizer = load_tokenizer("random:tiny", preset_config("random:tiny"))
    assert isinstance(tokenizer, ByteTokenizer)
    return tokenizer


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("tok"))


def test_byte_tokenizer_round_trips_multibyte_utf8(byte_tokenizer):
    text = "naïve café 日本語 🙂 done"
    ids = byte_tokenizer.encode(text)
    assert ids[:5] == list(b"na\xc3\xafv") and all(0 <= i < 256 for i in ids)
    assert byte_tokenizer.decode(ids) == text


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_byte_tokenizer_round_trips_any_text(text):
    tokenizer = ByteTokenizer(512)
    assert tokenizer.decode(tokenizer.encode(text), skip_special_tokens=False) == text


def test_incomplete_utf8_decodes_to_a_trailing_replacement_char(byte_tokenizer):
    ids = byte_tokenizer.encode("a🙂")
    assert byte_tokenizer.decode(ids[:-1]) == "a\ufffd"
    assert byte_tokenizer.decode(ids) == "a🙂"


def test_byte_tokenizer_specials_and_eos_match_the_preset(byte_tokenizer):
    config = preset_config("random:tiny")
    assert byte_tokenizer.vocab_size == config.vocab_size == 512
    assert byte_tokenizer.eos_token_id == config.vocab_size - 1 == config.eos_token_ids[0]
    assert byte_tokenizer.all_special_ids == [509, 510, 511]
    ids = byte_tokenizer.encode("hi<|endoftext|>")
    assert ids == [104, 105, 511]
    assert byte_tokenizer.decode(ids) == "hi"
    assert byte_tokenizer.decode(ids, skip_special_tokens=False) == "hi<|endoftext|>"


def test_ids_above_bytes_decode_to_printable_ascii(byte_tokenizer):
    text = byte_tokenizer.decode(list(range(256, 509)))
    assert len(text) == 253 and all(" " <= ch <= "~" for ch in text)
    assert text[:3] == " !\"" and byte_tokenizer.decode([256 + 95]) == " "  # deterministic, wraps around
    with pytest.raises(ValueError, match="outside the vocabulary"):
        byte_tokenizer.decode([512])


def test_byte_tokenizer_needs_room_for_bytes_and_specials():
    with pytest.raises(ValueError, match="vocab_size >= 259"):
        ByteTokenizer(258)


def test_default_chat_template_for_the_byte_tokenizer(byte_tokenizer):
    text = byte_tokenizer.apply_chat_template(MESSAGES)
    assert text == (
        "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhéllo 🙂<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = byte_tokenizer.encode(text)
    assert ids[0] == 510 and ids.count(510) == 3 and ids.count(509) == 2  # specials are single tokens
    assert not byte_tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=False).endswith("assistant\n")


def test_default_chat_template_takes_openai_content_parts():
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert default_chat_template([{"role": "user", "content": parts}], False) == "<|im_start|>user\nab<|im_end|>\n"


def test_hf_wrapper_on_the_tiny_saved_tokenizer(tiny_dir):
    tokenizer = load_tokenizer(str(tiny_dir), load_model_config(str(tiny_dir)))
    assert isinstance(tokenizer, HFTokenizer)
    assert tokenizer.name == str(tiny_dir)
    assert tokenizer.eos_token_id == 0 and tokenizer.vocab_size == len(tokenizer.hf)
    assert set(tokenizer.all_special_ids) == {0, 1, 2}
    text = "hello world, naïve 日本語"
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    assert len(ids) < len(text.encode())  # merges were learned
    assert tokenizer.decode([*ids, 0]) == text
    assert tokenizer.decode([*ids, 0], skip_special_tokens=False).endswith("<|endoftext|>")


def test_hf_wrapper_uses_the_tokenizers_own_chat_template(tiny_dir):
    tokenizer = load_tokenizer(str(tiny_dir), load_model_config(str(tiny_dir)))
    assert tokenizer.hf.chat_template == CHAT_TEMPLATE
    text = tokenizer.apply_chat_template(MESSAGES)
    assert text == default_chat_template(MESSAGES)  # the tiny template is ChatML too
    assert tokenizer.encode(text)[0] == 1  # <|im_start|> is one special token


def test_hf_wrapper_falls_back_to_the_default_chat_template(tiny_dir):
    tokenizer = load_tokenizer(str(tiny_dir), load_model_config(str(tiny_dir)))
    tokenizer.hf.chat_template = None
    assert tokenizer.apply_chat_template(MESSAGES) == default_chat_template(MESSAGES)


def test_missing_tokenizer_directory_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tokenizer(str(tmp_path / "absent"), preset_config("random:tiny"))
