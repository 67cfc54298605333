"""Tokenizers behind one small interface: a thin wrapper over a Hugging Face tokenizer for
real models, and a byte-level tokenizer for `random:` presets.

Byte tokenizer ids: 0..255 are UTF-8 bytes; the top three ids are special tokens
(`<|endoftext|>` = vocab_size - 1 is EOS, `<|im_start|>`, `<|im_end|>` for the chat
template); every other id >= 256 decodes to one printable ASCII character, so the output of
a random model is readable. Invalid or incomplete UTF-8 decodes with U+FFFD
(errors="replace"), which an incremental detokenizer reads as "character not finished".

A tokenizer whose `piece_table` gives every token's bytes is detokenized by table lookup
(detokenizer.ByteDetokenizer) instead of two `decode` calls per token: the byte tokenizer
always, a Hugging Face byte-level BPE tokenizer (GPT-2, Llama 3, Qwen) when its `decode` is
checked to be exactly the UTF-8 decoding of its tokens' bytes (`byte_level_pieces`), and a
SentencePiece-style one (Llama 2, Mistral) when its decode in context is checked to be that
(`sentencepiece_pieces`).
"""

from __future__ import annotations

import json
import logging
import random
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from roseray.chat_template import default_chat_template
from roseray.config import ModelConfig
from roseray.models.loader import resolve_model_path
from roseray.models.presets import is_preset

logger = logging.getLogger(__name__)

_PRINTABLE_FIRST, _NUM_PRINTABLE = 32, 95  # ' ' .. '~'
# byte_level_pieces' check: random id sequences decoded both ways, and text whose decode a
# tokenization-space clean-up would change
_CHECK_SEQUENCES, _CHECK_MAX_LEN = 300, 12
_CLEAN_UP_PROBE = "a . b , c ! d ? e 's f n't g 're h 've i 'm j 'll k 'd"
_UNKNOWN = object()


# arguments of transformers' apply_chat_template: a request's chat_template_kwargs may not set them
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs", "tokenizer", "processor_kwargs"})


def check_template_kwargs(template_kwargs: dict[str, Any]) -> None:
    """ValueError naming chat_template_kwargs when one of them is an argument of the rendering itself."""
    reserved = sorted(RESERVED_TEMPLATE_KWARGS.intersection(template_kwargs))
    if reserved:
        raise ValueError(f"chat_template_kwargs may not set {', '.join(reserved)}: the server decides "
                         f"{'it' if len(reserved) == 1 else 'them'}")


class Tokenizer:
    """What the engine and the server use of a tokenizer."""

    name: str
    eos_token_id: int | None
    vocab_size: int
    all_special_ids: list[int]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        raise NotImplementedError

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True, clean_up_spaces: bool = True) -> str:
        """The text of `token_ids`; `clean_up_spaces=False` leaves out `space_clean_up()`."""
        raise NotImplementedError

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None, **template_kwargs: Any) -> str:
        """The prompt text of `messages`, with `tools` (OpenAI's shape) and the extra template
        variables `template_kwargs` (e.g. enable_thinking) given to the chat template.
        ValueError when the template refuses the conversation."""
        raise NotImplementedError

    def space_clean_up(self) -> Callable[[str], str] | None:
        """The space clean-up that `decode` applies to its whole text last (Hugging Face's
        clean_up_tokenization: " ." -> ".", " n't" -> "n't", ...), when it applies one whose
        patterns each start with a space and span at most 4 characters (detokenizer.SpaceCleanUp
        streams exactly that kind); else None."""
        return None

    def piece_table(self, skip_special_tokens: bool = True) -> list[bytes] | None:
        """Every token id's bytes, when decoding is their UTF-8 (the table detokenizer), else None."""
        return None

    def ascii_table(self, skip_special_tokens: bool = True) -> list[str | None]:
        """The text of every token whose bytes are ASCII (None for the others); needs a piece table."""
        cache = self.__dict__.setdefault("_ascii", {})
        table = cache.get(skip_special_tokens)
        if table is None:
            pieces = self.piece_table(skip_special_tokens)
            if pieces is None:
                raise ValueError(f"{self.name}: no piece table (decode is not its tokens' bytes joined)")
            table = cache[skip_special_tokens] = ascii_of(pieces)
        return table


class ByteTokenizer(Tokenizer):
    SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids vocab-1, vocab-2, vocab-3

    def __init__(self, vocab_size: int, name: str = "byte") -> None:
        if vocab_size < 256 + len(self.SPECIAL_TOKENS):
            minimum = 256 + len(self.SPECIAL_TOKENS)
            raise ValueError(f"the byte tokenizer needs vocab_size >= {minimum}; got {vocab_size}")
        self.name, self.vocab_size = name, vocab_size
        self.special_ids = {token: vocab_size - 1 - i for i, token in enumerate(self.SPECIAL_TOKENS)}
        self.special_text = {token_id: token.encode() for token, token_id in self.special_ids.items()}
        self.eos_token_id = self.special_ids["<|endoftext|>"]
        self.all_special_ids = sorted(self.special_ids.values())
        self._special_pattern = re.compile("(" + "|".join(map(re.escape, self.SPECIAL_TOKENS)) + ")")
        self._pieces: dict[bool, list[bytes]] = {}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """UTF-8 bytes, with special-token strings mapped to their ids. Adds no BOS (like Qwen
        or GPT-2), so `add_special_tokens` changes nothing here."""
        ids: list[int] = []
        for piece in self._special_pattern.split(text):
            if piece in self.special_ids:
                ids.append(self.special_ids[piece])
            elif piece:
                ids.extend(piece.encode("utf-8"))
        return ids

    def piece_table(self, skip_special_tokens: bool = True) -> list[bytes]:
        """The bytes of every token id, indexed by id (what `decode` concatenates)."""
        table = self._pieces.get(skip_special_tokens)
        if table is None:
            table = [bytes([token_id]) for token_id in range(256)]
            table += [bytes([_PRINTABLE_FIRST + (token_id - 256) % _NUM_PRINTABLE])
                      for token_id in range(256, self.vocab_size)]
            for token_id, text in self.special_text.items():
                table[token_id] = b"" if skip_special_tokens else text
            self._pieces[skip_special_tokens] = table
        return table

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True, clean_up_spaces: bool = True) -> str:
        out = bytearray()  # no space clean-up to leave out
        for token_id in token_ids:
            if 0 <= token_id < 256:
                out.append(token_id)
            elif token_id in self.special_text:
                out += b"" if skip_special_tokens else self.special_text[token_id]
            elif 256 <= token_id < self.vocab_size:
                out.append(_PRINTABLE_FIRST + (token_id - 256) % _NUM_PRINTABLE)
            else:
                raise ValueError(f"token id {token_id} is outside the vocabulary [0, {self.vocab_size})")
        return out.decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None, **template_kwargs: Any) -> str:
        check_template_kwargs(template_kwargs)
        return default_chat_template(messages, add_generation_prompt, tools, **template_kwargs)


def ascii_of(pieces: list[bytes]) -> list[str | None]:
    """The text of every piece that is ASCII (None for the others)."""
    return [piece.decode("ascii") if piece.isascii() else None for piece in pieces]


def byte_level_alphabet() -> dict[str, int]:
    """The byte of each character of GPT-2's byte-level alphabet (which byte-level BPE
    tokenizers write their tokens in): printable Latin-1 bytes are themselves, the other 68
    bytes are U+0100 onwards, in byte order."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    char_of = {byte: chr(byte) for byte in kept}
    for offset, byte in enumerate(b for b in range(256) if b not in char_of):
        char_of[byte] = chr(256 + offset)
    return {char: byte for byte, char in char_of.items()}


def byte_level_pieces(hf: PreTrainedTokenizerBase, skip_special_tokens: bool) -> list[bytes] | None:
    """Every token id's bytes (indexed by id; b"" for a skipped special token or an id with no
    token) when `hf.decode(ids)` is exactly the UTF-8 decoding, errors replaced, of the ids'
    bytes joined, for any ids; else None. That holds for a fast tokenizer whose decoder is
    ByteLevel alone and whose `decode` cleans up no spaces: each token is written in the
    byte-level alphabet, an added token not in it stands for its own UTF-8. Checked here, not
    assumed: random id sequences (special and added tokens among them) and a text that a
    space clean-up would change must decode the same both ways."""
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None:
        return None
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    if decoder.get("type") != "ByteLevel":
        return None
    byte_of = byte_level_alphabet()
    to_latin1 = str.maketrans({char: chr(byte) for char, byte in byte_of.items()})  # then .encode("latin-1")
    outside = str.maketrans(dict.fromkeys(byte_of))  # what is left of a token outside the alphabet
    special = {token_id for token_id, token in hf.added_tokens_decoder.items() if token.special}
    size = max(len(hf), max(hf.added_tokens_decoder, default=-1) + 1)  # an added token may sit past a gap
    pieces = []
    for token_id, token in enumerate(hf.convert_ids_to_tokens(list(range(size)))):
        if token is None or (skip_special_tokens and token_id in special):
            pieces.append(b"")
        elif token.translate(outside):  # not in the alphabet: its own UTF-8
            pieces.append(token.encode("utf-8"))
        else:
            pieces.append(token.translate(to_latin1).encode("latin-1"))

    def same(ids: list[int]) -> bool:
        by_table = b"".join(pieces[token_id] for token_id in ids).decode("utf-8", errors="replace")
        return hf.decode(ids, skip_special_tokens=skip_special_tokens) == by_table

    rng = random.Random(0)
    added = sorted(hf.added_tokens_decoder)
    probes = [hf.encode(_CLEAN_UP_PROBE, add_special_tokens=False)]
    for _ in range(_CHECK_SEQUENCES):
        ids = [rng.randrange(len(pieces)) for _ in range(rng.randint(1, _CHECK_MAX_LEN))]
        if added and rng.random() < 0.3:
            ids.insert(rng.randrange(len(ids) + 1), rng.choice(added))
        probes.append(ids)
    if not all(same(ids) for ids in probes):
        logger.info("%s: decode is not its tokens' bytes joined; text comes from decode calls",
                    type(hf).__name__)
        return None
    return pieces


_SENTENCEPIECE_STEPS = [{"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
                        {"type": "ByteFallback"}, {"type": "Fuse"}]
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
# text that a SentencePiece check decodes: multi-byte characters that such vocabularies often
# spell in byte tokens, special and added tokens, spaces where a Strip decoder could act
_SENTENCEPIECE_PROBES = ("héllo 世界 🙂 naïve", "  two  spaces", "日本語 ok", "🙂🙂 a", "x")


def sentencepiece_pieces(hf: PreTrainedTokenizerBase, skip_special_tokens: bool) -> list[bytes] | None:
    """Every token id's bytes for a SentencePiece-style fast tokenizer (Llama 2, Mistral,
    TinyLlama, Gemma: decoder Replace("\u2581", " "), ByteFallback, Fuse, optionally a
    Strip of leading spaces): a token's text with "\u2581" as a space, a byte token
    "<0xXX>" its byte, b"" for a skipped special token. Their UTF-8 decoding is a token's
    text in context, what `decode(context + ids)` adds to `decode(context)`: the Strip acts
    only at the very start of a text, which in a stream is the prompt's. Two cases differ
    from a whole decode, by design of streaming: a request with no prompt keeps its first
    space, and a run of byte tokens that is not valid UTF-8 gives one U+FFFD per invalid
    sequence, where ByteFallback gives one per byte of the whole run. Checked here on text
    in context (probes spelled with byte tokens among them), else None."""
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None:
        return None
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    steps = decoder.get("decoders") if decoder.get("type") == "Sequence" else None
    if not steps or steps[:3] != _SENTENCEPIECE_STEPS or not all(
            step.get("type") == "Strip" and step.get("content") == " " and step.get("stop") == 0 for step in steps[3:]):
        return None
    special = {token_id for token_id, token in hf.added_tokens_decoder.items() if token.special}
    size = max(len(hf), max(hf.added_tokens_decoder, default=-1) + 1)
    pieces = []
    for token_id, token in enumerate(hf.convert_ids_to_tokens(list(range(size)))):
        byte = _BYTE_TOKEN.fullmatch(token) if token is not None else None
        if token is None or (skip_special_tokens and token_id in special):
            pieces.append(b"")
        elif byte is not None and token_id not in hf.added_tokens_decoder:
            pieces.append(bytes([int(byte.group(1), 16)]))
        else:
            pieces.append(token.replace("\u2581", " ").encode("utf-8"))
    context = hf.encode("a", add_special_tokens=False)
    context_text = hf.decode(context, skip_special_tokens=skip_special_tokens)
    rng = random.Random(0)
    texts = [hf.encode(text, add_special_tokens=False) for text in _SENTENCEPIECE_PROBES]
    # random ids, but valid UTF-8 throughout: no byte token of a multi-byte character on its own
    whole = [token_id for token_id, piece in enumerate(pieces) if len(piece) != 1 or piece.isascii()]
    probes = list(texts)
    for _ in range(_CHECK_SEQUENCES):
        ids = [rng.choice(whole) for _ in range(rng.randint(1, _CHECK_MAX_LEN))]
        cut = rng.randrange(len(ids) + 1)
        probes.append(ids[:cut] + rng.choice(texts) + ids[cut:])
    for ids in probes:
        in_context = hf.decode(context + ids, skip_special_tokens=skip_special_tokens)
        if in_context != context_text + b"".join(pieces[token_id] for token_id in ids).decode("utf-8", "replace"):
            logger.info("%s: decode in context is not its tokens' bytes joined; text comes from decode calls",
                        type(hf).__name__)
            return None
    return pieces


class HFTokenizer(Tokenizer):
    """A thin wrapper over a transformers tokenizer (`.hf` is the wrapped one)."""

    skips_unknown_ids = True  # decode gives no text for an id past the tokenizer (a padded vocabulary's)

    def __init__(self, hf: PreTrainedTokenizerBase, name: str, fallback_eos_token_id: int | None = None) -> None:
        self.hf, self.name = hf, name
        self.eos_token_id = hf.eos_token_id if hf.eos_token_id is not None else fallback_eos_token_id
        self.vocab_size = len(hf)
        self.all_special_ids = list(hf.all_special_ids)
        self._pieces: dict[bool, list[bytes] | None] = {}
        self._clean_up: Callable[[str], str] | None | object = _UNKNOWN  # space_clean_up(), once checked

    def piece_table(self, skip_special_tokens: bool = True) -> list[bytes] | None:
        """Every token's bytes, when decoding is their UTF-8 (byte_level_pieces), else None."""
        if skip_special_tokens not in self._pieces:
            self._pieces[skip_special_tokens] = (byte_level_pieces(self.hf, skip_special_tokens)
                                                 or sentencepiece_pieces(self.hf, skip_special_tokens))
        return self._pieces[skip_special_tokens]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.hf.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True, clean_up_spaces: bool = True) -> str:
        if clean_up_spaces:
            return self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens)
        return self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)

    def space_clean_up(self) -> Callable[[str], str] | None:
        """`hf.clean_up_tokenization` when `decode` applies it (checked on a text it would change:
        transformers skips it for BPE tokenizers unless forced) and it is transformers' own;
        a tokenizer class's own clean-up is not streamed (text around its spaces may then
        differ from `decode`: logged once)."""
        if self._clean_up is _UNKNOWN:
            probe = self.hf.encode(_CLEAN_UP_PROBE, add_special_tokens=False)
            applied = self.decode(probe) != self.decode(probe, clean_up_spaces=False)
            standard = type(self.hf).clean_up_tokenization is PreTrainedTokenizerBase.clean_up_tokenization
            if applied and not standard:
                logger.warning("%s: decode applies the tokenizer's own space clean-up; streamed text may differ "
                               "from decode around spaces", type(self.hf).__name__)
            self._clean_up = self.hf.clean_up_tokenization if applied and standard else None
        return self._clean_up

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None, **template_kwargs: Any) -> str:
        check_template_kwargs(template_kwargs)
        if not self.hf.chat_template:
            return default_chat_template(messages, add_generation_prompt, tools, **template_kwargs)
        try:
            return self.hf.apply_chat_template(messages, tools=tools, tokenize=False,
                                               add_generation_prompt=add_generation_prompt, **template_kwargs)
        except (TemplateError, TypeError, AttributeError, KeyError, IndexError) as error:  # raise_exception, or a
            # message the template cannot render (a string where it iterates an object, ...)
            raise ValueError(f"messages cannot be rendered by the chat template: {error}") from None


def load_tokenizer(name: str, model_config: ModelConfig, revision: str | None = None) -> Tokenizer:
    """The byte tokenizer for `random:` presets; else the HF tokenizer of a local directory or
    of a hub id in the local cache (never downloaded, and never with a checkpoint's own code)."""
    if is_preset(name):
        return ByteTokenizer(model_config.vocab_size, name)
    path: Path = resolve_model_path(name, revision)
    try:
        hf = AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError) as exc:
        raise ValueError(f"could not load a tokenizer from {path}: {exc}") from exc
    fallback_eos = model_config.eos_token_ids[0] if model_config.eos_token_ids else None
    return HFTokenizer(hf, name, fallback_eos)
