"""Incremental detokenization (multi-byte characters, equality with a full decode) and stop strings."""

import functools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from roseray.engine.detokenizer import (
    ByteDetokenizer,
    IncrementalDetokenizer,
    SpaceCleanUp,
    detokenizes_by_table,
    find_stop_string,
    last_safe_cut,
    make_detokenizer,
    prepare_detokenization,
)
from roseray.tokenizer import ByteTokenizer as PresetByteTokenizer

SPECIAL_ID = 256  # the toy tokenizer's one special token


class ByteTokenizer:
    """ids 0..255 are bytes; 256 is a special token; decoding replaces invalid UTF-8 with U+FFFD."""

    def __init__(self) -> None:
        self.decoded_lengths: list[int] = []

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        self.decoded_lengths.append(len(token_ids))
        parts, chunk = [], bytearray()
        for token_id in token_ids:
            if token_id < 256:
                chunk.append(token_id)
                continue
            parts.append(chunk.decode("utf-8", errors="replace"))
            chunk = bytearray()
            if not skip_special_tokens:
                parts.append("<|special|>")
        parts.append(chunk.decode("utf-8", errors="replace"))
        return "".join(parts)


def split_randomly(ids: list[int], rng: random.Random, max_chunk: int = 4) -> list[list[int]]:
    chunks, start = [], 0
    while start < len(ids):
        size = rng.randint(1, max_chunk)
        chunks.append(ids[start:start + size])
        start += size
    return chunks


TEXT = "héllo 世界 🙂 ok"


def test_multibyte_characters_split_across_steps_come_out_once_and_complete():
    tokenizer = ByteTokenizer()
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Prompt: "))
    deltas = [detok.step([token_id]) for token_id in tokenizer.encode(TEXT)]
    assert "".join(deltas) == TEXT == detok.output_text
    assert all("\ufffd" not in delta for delta in deltas)
    released = [d for d in deltas if d]
    assert "世" in released and "🙂" in released  # each released whole, in one step
    # The 4 bytes of 🙂: three steps release nothing, the fourth releases the character.
    emoji_start = len("héllo 世界 ".encode())
    assert deltas[emoji_start:emoji_start + 4] == ["", "", "", "🙂"]


def test_random_chunking_gives_the_same_text():
    tokenizer = ByteTokenizer()
    rng = random.Random(0)
    for _ in range(20):
        detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("a 世"))
        deltas = [detok.step(chunk) for chunk in split_randomly(tokenizer.encode(TEXT), rng)]
        assert "".join(deltas) == TEXT and "\ufffd" not in "".join(deltas)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 256), max_size=60), st.lists(st.integers(0, 255), max_size=8),
       st.booleans(), st.randoms(use_true_random=False))
def test_incremental_equals_full_decode_for_any_ids(output_ids, prompt_text_ids, skip_special, rng):
    tokenizer = ByteTokenizer()
    prompt_ids = tokenizer.encode(bytes(prompt_text_ids).decode("utf-8", errors="ignore"))  # a whole-char prompt
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=skip_special)
    text = "".join(detok.step(chunk) for chunk in split_randomly(output_ids, rng)) + detok.flush()
    assert text == detok.output_text == tokenizer.decode(output_ids, skip_special_tokens=skip_special)


def test_special_tokens_follow_skip_special_tokens():
    tokenizer = ByteTokenizer()
    ids = tokenizer.encode("ab") + [SPECIAL_ID] + tokenizer.encode("c")
    skipped = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=True)
    kept = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False)
    for token_id in ids:
        skipped.step([token_id])
        kept.step([token_id])
    assert skipped.output_text == "abc" and kept.output_text == "ab<|special|>c"


def test_cost_per_step_does_not_grow_with_length():
    tokenizer = ByteTokenizer()
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("x" * 1000))
    for token_id in tokenizer.encode("word " * 400 + "世界" * 100):
        detok.step([token_id])
    assert max(tokenizer.decoded_lengths) <= 8  # prompt context (5) + a held-back character


def test_flush_releases_an_incomplete_tail_as_replacement_char():
    tokenizer = ByteTokenizer()
    detok = IncrementalDetokenizer(tokenizer, [])
    assert detok.step(tokenizer.encode("ok") + tokenizer.encode("世")[:2]) == ""
    assert detok.flush() == "ok\ufffd"
    assert detok.flush() == ""


# --- stop strings ---------------------------------------------------------------------------


def run_with_stops(chunks: list[str], stops: list[str], include: bool) -> tuple[str, str | None, int]:
    """What the engine does: step, then look for a stop in the new text; cut and finish on a match."""
    tokenizer = ByteTokenizer()
    detok = IncrementalDetokenizer(tokenizer, [])
    for step, chunk in enumerate(chunks):
        new_text = detok.step(tokenizer.encode(chunk))
        found = find_stop_string(detok.output_text, len(new_text), stops, include)
        if found is not None:
            cut, stop = found
            return detok.output_text[:cut], stop, step
    return detok.output_text, None, len(chunks)


def test_stop_string_cuts_exactly_before_the_stop():
    text, stop, step = run_with_stops(["Hello", " world", ". STOP", " more"], ["STOP"], include=False)
    assert (text, stop, step) == ("Hello world. ", "STOP", 2)


def test_stop_string_included_when_asked():
    text, stop, _ = run_with_stops(["Hello", " world", ". STOP", " more"], ["STOP"], include=True)
    assert (text, stop) == ("Hello world. STOP", "STOP")


@pytest.mark.parametrize("include, expected", [(False, "Hello "), (True, "Hello STOP")])
def test_stop_string_straddling_two_steps(include, expected):
    text, stop, step = run_with_stops(["Hello ST", "OP more", "x"], ["STOP"], include)
    assert (text, stop, step) == (expected, "STOP", 1)


def test_stop_string_straddling_byte_steps_with_multibyte_stop():
    tokenizer = ByteTokenizer()
    detok = IncrementalDetokenizer(tokenizer, [])
    found = None
    for token_id in tokenizer.encode("abc 世界 def"):
        new_text = detok.step([token_id])
        found = find_stop_string(detok.output_text, len(new_text), ["界 d"], include_in_output=False)
        if found:
            break
    assert found == (5, "界 d") and detok.output_text[:found[0]] == "abc 世"


def test_earliest_stop_wins_and_old_matches_are_not_found_again():
    assert find_stop_string("one two three", 9, ["three", "two"], False) == (4, "two")
    assert find_stop_string("ab", 2, ["ab", "a"], True) == (2, "ab")  # same start: listed first
    assert find_stop_string("ab", 2, ["a", "ab"], True) == (1, "a")
    assert find_stop_string("STOP then", 5, ["STOP"], False) is None  # ended before the new text
    assert find_stop_string("xSTOP", 1, ["STOP"], False) == (1, "STOP")  # only its last char is new
    assert find_stop_string("anything", 0, ["any"], False) is None
    assert find_stop_string("text", 4, [], False) is None


def test_invalid_utf8_forever_is_released_and_stays_cheap():
    """A model that keeps emitting a lone continuation byte must not hold text back (and
    grow its decode window) forever: after a few tokens the U+FFFD is final."""
    calls = []

    class Counting:
        def decode(self, ids, skip_special_tokens=True):
            calls.append(len(ids))
            return bytes(ids).decode("utf-8", errors="replace")

    detok = IncrementalDetokenizer(Counting(), [104, 105])
    released = "".join(detok.step([0x80]) for _ in range(200))
    assert released.count("\ufffd") >= 190
    assert max(calls) <= 16  # the window stays small


# ---- the byte tokenizer's O(1) detokenizer -----------------------------------------------
PRESET_VOCAB = 600  # bytes, printable stand-ins above 255, three special tokens at the top


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, PRESET_VOCAB - 1), max_size=80), st.booleans(), st.randoms(use_true_random=False))
def test_byte_detokenizer_equals_full_decode_for_any_ids(output_ids, skip_special, rng):
    tokenizer = PresetByteTokenizer(PRESET_VOCAB)
    detok = make_detokenizer(tokenizer, tokenizer.encode("prompt 世"), skip_special)
    assert isinstance(detok, ByteDetokenizer)
    text = "".join(detok.step(chunk) for chunk in split_randomly(output_ids, rng)) + detok.flush()
    assert text == detok.output_text == tokenizer.decode(output_ids, skip_special_tokens=skip_special)


def test_byte_detokenizer_holds_an_incomplete_character_and_special_tokens_follow_the_flag():
    tokenizer = PresetByteTokenizer(PRESET_VOCAB)
    detok = make_detokenizer(tokenizer, [], skip_special_tokens=False)
    emoji = list("🙂".encode())
    assert [detok.step([b]) for b in emoji] == ["", "", "", "🙂"]
    assert detok.step([tokenizer.eos_token_id]) == "<|endoftext|>"
    assert make_detokenizer(tokenizer, [], skip_special_tokens=True).step([tokenizer.eos_token_id]) == ""
    with pytest.raises(ValueError, match="outside the vocabulary"):
        detok.step([PRESET_VOCAB])


def test_other_tokenizers_get_the_window_detokenizer():
    assert isinstance(make_detokenizer(ByteTokenizer(), [1, 2]), IncrementalDetokenizer)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, PRESET_VOCAB - 1), max_size=60), st.booleans())
def test_step_token_equals_step_of_one_token(output_ids, skip_special):
    """The engine's per-token fast path (`step_token`) releases exactly what `step([id])` does,
    for both detokenizers, including characters split across tokens and special tokens."""
    tokenizer = PresetByteTokenizer(PRESET_VOCAB)
    for make in (lambda: make_detokenizer(tokenizer, [1, 2], skip_special),
                 lambda: IncrementalDetokenizer(tokenizer, [1, 2], skip_special)):
        fast, slow = make(), make()
        assert [fast.step_token(t) for t in output_ids] == [slow.step([t]) for t in output_ids]
        assert fast.flush() == slow.flush() and fast.output_text == slow.output_text
    with pytest.raises(ValueError, match="outside the vocabulary"):
        make_detokenizer(tokenizer, []).step_token(PRESET_VOCAB)


# ---- Hugging Face byte-level BPE tokenizers: the same table detokenizer ----------------------
_HF_WORDS = ["the", "quick", "fox", "héllo", "naïve", "日本語", "世界", "🙂", "ok", "'s", "n't", "."]


def _hf_byte_level(clean_up: bool = False, decoder=None):
    """A byte-level BPE trained here, with special tokens and added tokens outside the
    byte-level alphabet (a space, CJK); `decoder` replaces its ByteLevel decoder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoder if decoder is not None else decoders.ByteLevel()
    corpus = [" ".join(rng.choice(_HF_WORDS) for _ in range(30)) for _ in range(300)]
    backend.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    hf = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>",
                                 clean_up_tokenization_spaces=clean_up)
    hf.add_tokens(["日本", " <tool>", "<think>"])
    if clean_up:  # transformers skips the clean-up for BPE unless told otherwise
        hf.clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output = True
    return hf


@functools.cache
def _hf_tokenizer():
    from roseray.tokenizer import HFTokenizer

    return HFTokenizer(_hf_byte_level(), "trained")


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 420), max_size=60), st.booleans(), st.randoms(use_true_random=False))
def test_a_byte_level_hf_tokenizer_is_detokenized_by_table_exactly_as_it_decodes(output_ids, skip_special, rng):
    """Any ids (multi-byte characters split over tokens, special and added tokens, ids past
    the tokenizer as a padded vocabulary samples them) in any chunks give hf.decode's text."""
    tokenizer = _hf_tokenizer()
    detok = make_detokenizer(tokenizer, tokenizer.encode("prompt 世"), skip_special)
    assert isinstance(detok, ByteDetokenizer)
    text = "".join(detok.step(chunk) for chunk in split_randomly(output_ids, rng)) + detok.flush()
    assert text == detok.output_text == tokenizer.hf.decode(output_ids, skip_special_tokens=skip_special)
    fast = make_detokenizer(tokenizer, [], skip_special)
    assert "".join(fast.step_token(t) for t in output_ids) + fast.flush() == text  # the engine's per-token path


def test_text_the_model_would_write_streams_by_table_and_special_tokens_follow_the_flag():
    tokenizer = _hf_tokenizer()
    text = "the naïve fox 日本語 🙂 <think> ok <tool>"
    ids = tokenizer.encode(text) + [tokenizer.eos_token_id]
    for skip, expected in ((True, text), (False, text + "<|endoftext|>")):
        detok = make_detokenizer(tokenizer, [], skip)
        assert "".join(detok.step_token(t) for t in ids) + detok.flush() == expected


@pytest.mark.parametrize("variant", ["clean_up", "strip"])
def test_a_tokenizer_whose_decode_is_not_its_bytes_keeps_the_window_detokenizer(variant):
    """A decode that cleans up spaces (" ." -> "."), or a decoder that is not ByteLevel alone,
    has no piece table: such a tokenizer keeps the window detokenizer."""
    from tokenizers import decoders

    from roseray.tokenizer import HFTokenizer

    hf = (_hf_byte_level(clean_up=True) if variant == "clean_up" else
          _hf_byte_level(decoder=decoders.Sequence([decoders.ByteLevel(), decoders.Strip(" ", 1, 0)])))
    tokenizer = HFTokenizer(hf, "trained")
    assert tokenizer.piece_table(True) is None and tokenizer.piece_table(False) is None
    assert isinstance(make_detokenizer(tokenizer, [], True), IncrementalDetokenizer)
    if variant == "clean_up":
        assert hf.decode(tokenizer.encode("ok . fox")) == "ok. fox"  # the clean-up is in force here


# ---- tokenizers whose decode cleans up spaces (" ." -> "."): the clean-up streamed ----------------
_CLEAN_UP_CHARS = " .,!?'nmtsrevax"


def _clean_up(text: str) -> str:
    from transformers import PreTrainedTokenizerBase

    return PreTrainedTokenizerBase.clean_up_tokenization(None, text)  # transformers' own, as decode applies it


@settings(max_examples=500, deadline=None)
@given(st.text(alphabet=_CLEAN_UP_CHARS, max_size=40), st.randoms(use_true_random=False))
def test_the_space_clean_up_streamed_in_any_pieces_equals_it_on_the_whole(text, rng):
    """Chains of the patterns (" ' " then " 's", " ' ." where " ." goes first, runs of spaces)
    cut anywhere: the cleaned pieces join to the clean-up of the whole."""
    spaces, pieces, start = SpaceCleanUp(_clean_up), [], 0
    while start < len(text):
        size = rng.randint(1, 4)
        pieces.append(spaces.push(text[start:start + size]))
        start += size
    assert "".join(pieces) + spaces.flush() == _clean_up(text)


def test_last_safe_cut_has_no_space_among_the_three_characters_before_it():
    assert last_safe_cut("") == 0 and last_safe_cut("abc") == 3 and last_safe_cut("a bcd") == 5
    assert last_safe_cut("ab c") == 2  # " c" is held: the space is among the 3 before any later cut
    assert last_safe_cut("abcd 'm") == 4 and last_safe_cut(" ' ") == 0


def _hf_unigram_clean_up():
    """A SentencePiece-like Unigram tokenizer (Metaspace) trained here, whose decode cleans up
    spaces (transformers applies the clean-up to it, unlike to BPE)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    backend = Tokenizer(models.Unigram())
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    corpus = [" ".join(rng.choice(_HF_WORDS) for _ in range(30)) for _ in range(300)]
    backend.train_from_iterator(corpus, trainers.UnigramTrainer(
        vocab_size=120, special_tokens=["<unk>", "</s>"], unk_token="<unk>", show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="</s>", unk_token="<unk>",
                                   clean_up_tokenization_spaces=True)


@pytest.fixture(scope="module", params=["byte_level_forced", "unigram"])
def clean_up_tokenizer(request):
    from roseray.tokenizer import HFTokenizer

    hf = _hf_byte_level(clean_up=True) if request.param == "byte_level_forced" else _hf_unigram_clean_up()
    return HFTokenizer(hf, request.param)


def test_a_tokenizer_that_cleans_up_spaces_streams_exactly_its_decode(clean_up_tokenizer):
    """Text with the clean-up's patterns, and random ids, streamed in random chunks and token by
    token: the text is `decode` of the ids, clean-up and all (300 of 300 differed before)."""
    tokenizer, rng = clean_up_tokenizer, random.Random(3)
    assert prepare_detokenization(tokenizer) == "by windowed decode calls, space clean-up streamed"
    words = ["the", "fox", "ok", "'s", "n't", ".", ",", "!", "?", "'", "'m", "'re", "'ve", " ", "日本語"]
    size = len(tokenizer.hf)
    for _ in range(150):
        ids = tokenizer.encode(rng.choice(["", " "]) + " ".join(rng.choice(words) for _ in range(10)),
                               add_special_tokens=False)
        ids += [rng.randrange(size) for _ in range(rng.randint(0, 6))]
        skip = rng.random() < 0.5
        expected = tokenizer.hf.decode(ids, skip_special_tokens=skip)
        detok = make_detokenizer(tokenizer, [], skip)  # no prompt: decode(ids) strips a Metaspace start
        assert isinstance(detok, IncrementalDetokenizer)
        text = "".join(detok.step(chunk) for chunk in split_randomly(ids, rng)) + detok.flush()
        assert text == detok.output_text == expected, ids
        one_by_one = make_detokenizer(tokenizer, [], skip)
        assert "".join(one_by_one.step_token(t) for t in ids) + one_by_one.flush() == expected, ids


def test_a_tokenizer_that_does_not_clean_up_or_has_its_own_clean_up_streams_no_clean_up(caplog):
    from transformers import PreTrainedTokenizerFast

    from roseray.tokenizer import HFTokenizer

    assert _hf_tokenizer().space_clean_up() is None  # decode's text is its bytes: nothing to clean
    assert HFTokenizer(_hf_byte_level(clean_up=False), "plain").space_clean_up() is None

    class OwnCleanUp(PreTrainedTokenizerFast):
        def clean_up_tokenization(self, text: str) -> str:
            return text.replace(" .", ".!")  # not transformers' clean-up: not streamed

    hf = _hf_unigram_clean_up()
    own = OwnCleanUp(tokenizer_object=hf.backend_tokenizer, eos_token="</s>", unk_token="<unk>",
                     clean_up_tokenization_spaces=True)
    with caplog.at_level("WARNING", logger="roseray.tokenizer"):
        assert HFTokenizer(own, "own").space_clean_up() is None
    assert "own space clean-up" in caplog.text


def test_which_detokenizer_a_tokenizer_gets_is_known_before_any_request():
    assert detokenizes_by_table(_hf_tokenizer()) and detokenizes_by_table(PresetByteTokenizer(PRESET_VOCAB))
    assert not detokenizes_by_table(ByteTokenizer())  # no piece table at all
    assert prepare_detokenization(_hf_tokenizer()) == "by table"
    assert prepare_detokenization(ByteTokenizer()) == "by windowed decode calls"


def test_an_engine_on_a_checkpoint_detokenizes_by_table_and_its_text_is_decode(tmp_path):
    """A tiny random Llama saved with its byte-level BPE tokenizer (model vocabulary 320,
    tokenizer 312: sampling reaches ids past the tokenizer): the engine's text, streamed by
    table, is the tokenizer's decode of the same ids."""
    from roseray.llm import LLM
    from roseray.sampling_params import SamplingParams
    from tests.models.hf_models import make_tiny_model

    llm = LLM(str(make_tiny_model("llama", tmp_path / "llama")), device="cpu", num_kv_blocks=64)
    assert llm.engine.detokenization == "by table"
    params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=40, ignore_eos=True, skip_special_tokens=skip)
              for seed in range(6) for skip in (True, False)]
    outs = llm.generate(["héllo 日本"] * len(params), params, use_tqdm=False)
    seen = set()
    for out, p in zip(outs, params):
        ids = out.outputs[0].token_ids
        seen.update(ids)
        assert out.outputs[0].text == llm.engine.tokenizer.hf.decode(ids, skip_special_tokens=p.skip_special_tokens)
    assert max(seen) >= len(llm.engine.tokenizer.hf)  # an id past the tokenizer was among them


def test_an_engine_whose_tokenizer_cleans_up_spaces_writes_its_decode(tmp_path):
    """The same tiny Llama with the Unigram tokenizer above (30 ids, the rest of the model's 320
    give no text): the engine streams the clean-up, and its text is decode's (the property
    tests above cover the clean-up's patterns, which random sampling seldom writes)."""
    from roseray.llm import LLM
    from roseray.sampling_params import SamplingParams
    from tests.models.hf_models import make_tiny_model

    path = make_tiny_model("llama", tmp_path / "llama")
    _hf_unigram_clean_up().save_pretrained(path)
    llm = LLM(str(path), device="cpu", num_kv_blocks=128)
    assert llm.engine.detokenization == "by windowed decode calls, space clean-up streamed"
    params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=110, ignore_eos=True) for seed in range(6)]
    outs = llm.generate(["ok . fox 's"] * len(params), params, use_tqdm=False)
    hf = llm.engine.tokenizer.hf
    assert [out.outputs[0].text for out in outs] == [hf.decode(out.outputs[0].token_ids, skip_special_tokens=True)
                                                     for out in outs]


# ---- SentencePiece-style tokenizers (Llama 2, Mistral): the table, text in context -------------------
def _hf_sentencepiece(decoder_steps=None):
    """A Llama-2-like tokenizer built here: BPE over "\u2581"-joined words with the 256 byte
    tokens "<0xXX>" in its vocabulary (characters it lacks, such as 🙂 and 世, are spelled in
    them), decoder Replace("\u2581", " "), ByteFallback, Fuse, Strip(" ", 1, 0) unless
    `decoder_steps` says otherwise; an added token."""
    import json

    from tokenizers import Tokenizer, decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    trained = Tokenizer(models.BPE())
    trained.normalizer = normalizer
    corpus = [" ".join(rng.choice(["the", "quick", "fox", "héllo", "naïve", "ok", "日本", "'s"]) for _ in range(30))
              for _ in range(300)]
    trained.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=200, show_progress=False))
    model = json.loads(trained.to_str())["model"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for token in sorted(model["vocab"], key=model["vocab"].get):
        vocab.setdefault(token, len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    backend = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    backend.normalizer = normalizer
    if decoder_steps is None:
        decoder_steps = [decoders.Strip(" ", 1, 0)]
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         *decoder_steps])
    hf = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    hf.add_tokens(["<think>"])
    return hf


@functools.cache
def _sp_tokenizer():
    from roseray.tokenizer import HFTokenizer

    return HFTokenizer(_hf_sentencepiece(), "sp")


_SP_TEXTS = ["the quick fox", "héllo 世界 🙂", "naïve  ok 日本語", "🙂🙂", "<think> ok", "x 's y", "  a"]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(_SP_TEXTS), min_size=1, max_size=4), st.lists(st.integers(0, 300), max_size=8),
       st.booleans(), st.randoms(use_true_random=False))
def test_a_sentencepiece_tokenizer_is_detokenized_by_table_as_it_decodes_in_context(texts, extra_ids, skip, rng):
    """Text spelled partly in byte tokens (🙂, 世), spaces, special and added tokens, in any
    chunks: the table gives what decode(prompt + ids) adds to decode(prompt), as the window
    detokenizer does (Strip removes a space only at the start of the prompt)."""
    tokenizer = _sp_tokenizer()
    segments = [tokenizer.encode(text, add_special_tokens=False) for text in texts]
    segments.append([t for t in extra_ids if not 3 + 0x80 <= t < 3 + 256])  # no lone byte of a multi-byte character
    segments.insert(rng.randrange(len(segments) + 1), [tokenizer.eos_token_id])  # not inside a character's bytes
    ids = [token_id for segment in segments for token_id in segment]
    prompt = tokenizer.encode("the prompt", add_special_tokens=True)
    expected = (tokenizer.hf.decode(prompt + ids, skip_special_tokens=skip)
                [len(tokenizer.hf.decode(prompt, skip_special_tokens=skip)):])
    detok = make_detokenizer(tokenizer, prompt, skip)
    assert isinstance(detok, ByteDetokenizer)
    assert "".join(detok.step(chunk) for chunk in split_randomly(ids, rng)) + detok.flush() == expected
    window = IncrementalDetokenizer(tokenizer, prompt, skip)  # the path such tokenizers took before
    assert "".join(window.step_token(t) for t in ids) + window.flush() == expected
    one_by_one = make_detokenizer(tokenizer, prompt, skip)
    assert "".join(one_by_one.step_token(t) for t in ids) + one_by_one.flush() == expected


def test_a_sentencepiece_table_differs_from_decode_only_where_streaming_must():
    """Documented: an invalid byte run gives U+FFFD per invalid sequence (ByteFallback: one per
    byte of the run); with no prompt the first space stays (decode strips it)."""
    tokenizer = _sp_tokenizer()
    assert prepare_detokenization(tokenizer) == "by table"
    detok = make_detokenizer(tokenizer, [], True)
    invalid = [3 + 0xF0, 3 + 0x9F, 3 + ord("a")]  # two bytes of a 4-byte character, then "a"
    assert detok.step(invalid) + detok.flush() == "\ufffda"
    assert tokenizer.hf.decode(invalid) == "\ufffd\ufffd\ufffd"
    ids = tokenizer.encode("the fox", add_special_tokens=False)
    fresh = make_detokenizer(tokenizer, [], True)
    assert fresh.step(ids) + fresh.flush() == " " + tokenizer.hf.decode(ids)


@pytest.mark.parametrize("steps", ["strip_end", "none_extra"])
def test_a_sentencepiece_decoder_outside_the_known_shape_keeps_the_window_or_gets_the_table(steps):
    from tokenizers import decoders

    from roseray.tokenizer import HFTokenizer

    if steps == "strip_end":  # a Strip at the end as well: not streamable by table
        tokenizer = HFTokenizer(_hf_sentencepiece([decoders.Strip(" ", 1, 1)]), "sp")
        assert tokenizer.piece_table(True) is None
        assert isinstance(make_detokenizer(tokenizer, [], True), IncrementalDetokenizer)
    else:  # no Strip at all (Gemma's shape): the table
        tokenizer = HFTokenizer(_hf_sentencepiece([]), "sp")
        assert detokenizes_by_table(tokenizer)
