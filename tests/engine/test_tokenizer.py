"""Tokenizers: the byte tokenizer of random presets and the wrapper over HF tokenizers."""

from __future__ import annotations

import json

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


# ---- tools, tool calls and template variables ------------------------------------------------------------------
CITY = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the weather", "parameters": CITY}}]
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
HISTORY = [{"role": "user", "content": "weather in Paris?"},
           {"role": "assistant", "content": "", "tool_calls": [CALL]},
           {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
# a template that iterates a call's arguments as an object (as Llama 3's and Hermes' templates do); transformers
# renders with trim_blocks, so the newline after a block tag is dropped
TOOLS_TEMPLATE = (
    "{% if tools %}TOOLS:{% for t in tools %}[{{ t['function']['name'] }}]{% endfor %}\n{% endif %}"
    "{% for m in messages %}{{ m['role'] }}:{{ m['content'] }}"
    "{% for c in m.get('tool_calls', []) %} CALL {{ c['function']['name'] }}"
    "{% for k, v in c['function']['arguments'].items() %} {{ k }}={{ v }}{% endfor %}{% endfor %}"
    "{% if m.get('tool_call_id') %} (for {{ m['tool_call_id'] }}){% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% if enable_thinking is false %}<nothink>{% endif %}{% endif %}"
)


def test_the_default_template_renders_tools_calls_and_results(byte_tokenizer):
    text = byte_tokenizer.apply_chat_template([{"role": "system", "content": "be brief"}, *HISTORY], tools=TOOLS)
    system = text[:text.index("<|im_end|>")]
    assert system.startswith("<|im_start|>system\nbe brief\n\n# Tools") and text.count("<|im_start|>system") == 1
    assert json.dumps(TOOLS[0]) in system and "<tool_call>" in system  # the tools, and how to call them
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            "</tool_call><|im_end|>\n") in text
    assert text.endswith("<|im_start|>tool\nsunny<|im_end|>\n<|im_start|>assistant\n")
    no_system = byte_tokenizer.apply_chat_template(HISTORY, tools=TOOLS)
    assert no_system.startswith("<|im_start|>system\n# Tools")
    assert byte_tokenizer.apply_chat_template(MESSAGES, tools=None) == default_chat_template(MESSAGES)


def test_the_default_template_reads_enable_thinking_and_ignores_other_variables(byte_tokenizer):
    plain = byte_tokenizer.apply_chat_template(MESSAGES)
    assert byte_tokenizer.apply_chat_template(MESSAGES, enable_thinking=False) == plain + "<think>\n\n</think>\n\n"
    assert byte_tokenizer.apply_chat_template(MESSAGES, enable_thinking=True, custom=[1]) == plain
    with pytest.raises(ValueError, match="chat_template_kwargs may not set tokenize"):
        byte_tokenizer.apply_chat_template(MESSAGES, tokenize=True)


def test_an_hf_template_gets_the_tools_the_calls_and_its_variables(tiny_dir):
    tokenizer = load_tokenizer(str(tiny_dir), load_model_config(str(tiny_dir)))
    tokenizer.hf.chat_template = TOOLS_TEMPLATE
    text = tokenizer.apply_chat_template(HISTORY, tools=TOOLS, enable_thinking=False)
    assert text == ("TOOLS:[get_weather]user:weather in Paris?assistant: CALL get_weather city=Paris"
                    "tool:sunny (for call_1)assistant:<nothink>")
    with pytest.raises(ValueError, match="chat_template_kwargs may not set return_dict, tokenize"):
        tokenizer.apply_chat_template(HISTORY, tokenize=True, return_dict=True)


def test_a_template_that_refuses_the_conversation_is_a_value_error(tiny_dir):
    tokenizer = load_tokenizer(str(tiny_dir), load_model_config(str(tiny_dir)))
    tokenizer.hf.chat_template = "{{ raise_exception('no user message') }}"
    with pytest.raises(ValueError, match="messages cannot be rendered by the chat template: no user message"):
        tokenizer.apply_chat_template(MESSAGES)
