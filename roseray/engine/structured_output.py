"""Grammar-constrained decoding: a StructuredOutputs turned into a per-request matcher and
the token bitmask the sampler applies.

The grammar engine is xgrammar (DESIGN.md says why): its compiler turns a JSON schema, a
regular expression, a choice, an EBNF grammar or a structural tag into a CompiledGrammar for
this tokenizer; a GrammarMatcher per request walks it token by token and fills the next
token's allowed set as a bitmask of int32 words.

- `check_structured_outputs` parses a spec without the tokenizer (cheap): the API process
  calls it so that a spec that cannot be compiled or enforced is a 400 before the request
  reaches the engine. Keywords xgrammar would silently not enforce (UNENFORCED_KEYWORDS)
  are refused by name.
- `GrammarCompiler` compiles on a worker thread (the engine keeps stepping meanwhile) and
  keeps up to `max_cached` compiled grammars by (kind, spec), least recently used first out,
  each as xgrammar's JSON for the grammar workers (grammar_workers.py), which hold the matchers
  and bound the runs of whitespace (WhitespaceTokens).
- `RequestGrammar` is the engine's side of one request's matcher: where it lives and what the
  engine reads per token. With a reasoning parser it is inactive until the output ends the
  reasoning (its end marker's token ids), unless the prompt already did.
"""

from __future__ import annotations

import itertools
import json
import logging
import re
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch
import tvm_ffi
import xgrammar as xgr
from xgrammar.base import _core as xgrammar_core

from roseray.sampling_params import StructuredOutputs

logger = logging.getLogger(__name__)

# JSON with any_whitespace: once a run of whitespace-only tokens has this many characters, the
# next token is not whitespace only (WhitespaceTokens), so a model that loops on newlines cannot
# fill max_tokens with them
MAX_WHITESPACE = 20
MAX_CACHED_GRAMMARS = 256
# JSON schema keywords that constrain a value but that xgrammar does not enforce: a schema using
# one is refused rather than answered with output that may break it
UNENFORCED_KEYWORDS = frozenset({
    "not", "if", "then", "else", "dependentSchemas", "dependentRequired", "dependencies", "uniqueItems",
    "contains", "minContains", "maxContains", "patternProperties", "propertyNames", "unevaluatedProperties",
    "unevaluatedItems", "multipleOf", "minProperties", "maxProperties", "$dynamicRef", "$recursiveRef",
    "contentMediaType", "contentEncoding", "contentSchema",
})
# string formats xgrammar enforces; any other format is refused
ENFORCED_FORMATS = frozenset({"email", "date", "time", "date-time", "duration", "uuid", "ipv4", "ipv6", "hostname",
                              "uri", "uri-reference", "uri-template", "json-pointer", "relative-json-pointer"})
_SCHEMA_MAPS = ("properties", "$defs", "definitions")  # keywords whose values map names to schemas
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")  # keywords whose values are lists of schemas
_XGRAMMAR_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")  # "[12:00:00] /path/file.cc:83: " of its errors
# xgrammar's bindings (tvm_ffi) release the GIL around every call, even an array's item read, and
# its batch accept's wrapper reads the verdicts item by item. Each hand-over back waits until the
# thread holding the GIL blocks or the interpreter's switch interval (5 ms) ends, so while the
# engine's thread ran Python the verdicts of 64 rows took 58 ms (0.15 ms with the GIL kept).
# batch_accept_token reads them through this handle of our own, which keeps the GIL.
_VERDICT = tvm_ffi.get_global_func("ffi.ArrayGetItem")
_VERDICT.release_gil = False


@lru_cache(maxsize=MAX_CACHED_GRAMMARS)  # specs repeat (one schema for many requests); a failure is not kept
def check_structured_outputs(spec: StructuredOutputs) -> None:
    """Raise ValueError (naming what is wrong) unless `spec` compiles and is enforceable."""
    try:
        _parse(spec)
    except ValueError:
        raise
    except Exception as error:  # noqa: BLE001 - xgrammar raises RuntimeError (and others) with a message
        raise ValueError(f"structured output ({spec.kind}): {_xgrammar_message(error)}") from None


def _parse(spec: StructuredOutputs) -> xgr.Grammar:
    kind = spec.kind
    if kind == "json":
        try:
            schema = json.loads(spec.spec)
        except json.JSONDecodeError as error:
            raise ValueError(f"structured output (json): the schema is not valid JSON ({error})") from None
        if not isinstance(schema, (dict, bool)):
            raise ValueError("structured output (json): the schema must be a JSON object")
        _check_schema(schema, "#")
        return json_schema_grammar(spec.spec, spec.any_whitespace)
    if kind == "json_object":
        return json_schema_grammar(_ANY_OBJECT, spec.any_whitespace)
    if kind == "regex":
        return xgr.Grammar.from_regex(spec.spec)
    if kind == "choice":
        return xgr.Grammar.from_ebnf(_choice_ebnf(spec.spec))
    if kind == "grammar":
        return xgr.Grammar.from_ebnf(spec.spec)
    return xgr.Grammar.from_structural_tag(spec.spec)


def json_schema_grammar(schema: str, any_whitespace: bool = True) -> xgr.Grammar:
    """The schema's grammar, with its string characters made JSON's: xgrammar's rule for the
    characters of a string with minLength/maxLength admits raw U+0000..U+001F, which JSON
    forbids unescaped, and its string rules admit the UTF-8 encodings of surrogates
    (U+D800..U+DFFF), which are not UTF-8 (a decoder replaces them, so the text would break the
    schema's length bounds). Whitespace runs are bounded outside the grammar (WhitespaceTokens):
    xgrammar's own bound (max_whitespace_cnt) made every mask fill ~7x dearer."""
    grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=any_whitespace)
    text = str(grammar)
    fixed = text.replace(_LOOSE_STRING_CHARACTER, _STRING_CHARACTER).replace(_BASIC_STRING_CHARACTER,
                                                                              _STRING_CHARACTER)
    return grammar if fixed == text else xgr.Grammar.from_ebnf(fixed)


_ANY_OBJECT = '{"type": "object"}'  # json_object: any JSON object
# the character classes of strings as xgrammar prints them, and what replaces both
_LOOSE_STRING_CHARACTER = r'[^\"\\\r\n]'
_BASIC_STRING_CHARACTER = r'[^\0-\x1f\"\\\r\n]'
_STRING_CHARACTER = r'[^\0-\x1f\"\\\r\n\uD800-\uDFFF]'


def _choice_ebnf(spec: str) -> str:
    try:
        options = json.loads(spec)
    except json.JSONDecodeError:
        options = None
    if not isinstance(options, list) or not options or not all(isinstance(o, str) and o for o in options):
        raise ValueError("structured output (choice): choice must be a non-empty list of non-empty strings")
    return "root ::= " + " | ".join(json.dumps(option, ensure_ascii=False) for option in options)


def _check_schema(schema: object, path: str) -> None:
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise ValueError(f"structured output (json): {path} is not a schema (an object or a boolean)")
    for keyword, value in schema.items():
        if keyword in UNENFORCED_KEYWORDS:
            raise ValueError(f"structured output (json): the schema keyword {keyword!r} (at {path}) is not "
                             "supported: the grammar engine cannot enforce it")
        if keyword == "format" and value not in ENFORCED_FORMATS:
            raise ValueError(f"structured output (json): the string format {value!r} (at {path}) is not supported "
                             f"(supported: {', '.join(sorted(ENFORCED_FORMATS))})")
        if keyword == "$ref" and not (isinstance(value, str) and value.startswith("#")):
            raise ValueError(f"structured output (json): only local references ('#/...') are supported, got "
                             f"$ref {value!r} (at {path})")
        if keyword in _SCHEMA_MAPS and isinstance(value, dict):
            for name, sub in value.items():
                _check_schema(sub, f"{path}/{keyword}/{name}")
        elif keyword in _SCHEMA_LISTS and isinstance(value, list):
            for i, sub in enumerate(value):
                _check_schema(sub, f"{path}/{keyword}/{i}")
        elif keyword in ("items", "additionalProperties", "additionalItems") and isinstance(value, (dict, bool)):
            _check_schema(value, f"{path}/{keyword}")


def bounds_whitespace(spec: StructuredOutputs) -> bool:
    """JSON whose whitespace the grammar leaves free: its runs are bounded (WhitespaceTokens)."""
    return spec.kind in ("json", "json_object") and spec.any_whitespace


def _xgrammar_message(error: BaseException) -> str:
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return _XGRAMMAR_PREFIX.sub("", text)


@dataclass(frozen=True, slots=True)
class CompiledSpec:
    """A compiled grammar as the grammar workers take it: xgrammar's JSON (~1 MB for a JSON schema
    and a 150k vocabulary), and an id of its own for the workers' caches."""

    grammar_id: int
    serialized: str


class GrammarCompiler:
    """Compiles StructuredOutputs for one tokenizer on a worker thread, with a bounded cache."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int], *,
                 max_cached: int = MAX_CACHED_GRAMMARS, threads: int = 2) -> None:
        self.vocab_size = vocab_size
        self.stop_token_ids = frozenset(stop_token_ids)
        self.info = _tokenizer_info(tokenizer, vocab_size, stop_token_ids)
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=threads)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compiler")
        self._cache: OrderedDict[StructuredOutputs, Future] = OrderedDict()
        self.max_cached = max_cached
        self._grammar_ids = itertools.count()

    def run_in_background(self, fn, *args) -> Future:
        """fn(*args) on the compiler's thread."""
        return self._pool.submit(fn, *args)

    def submit(self, spec: StructuredOutputs) -> Future:
        """A future of the CompiledSpec (its exception: ValueError saying why it failed)."""
        future = self._cache.get(spec)
        if future is not None and not (future.done() and future.exception() is not None):
            self._cache.move_to_end(spec)
            return future
        future = self._pool.submit(self._compile, spec)
        self._cache[spec] = future
        while len(self._cache) > self.max_cached:
            self._cache.popitem(last=False)
        return future

    def compile(self, spec: StructuredOutputs) -> CompiledSpec:
        return self.submit(spec).result()

    def _compile(self, spec: StructuredOutputs) -> CompiledSpec:
        """(The engine checked `spec` before it asked.) Serialized here, on the compiler's thread."""
        return CompiledSpec(next(self._grammar_ids), self._compile_grammar(spec).serialize_json())

    def _compile_grammar(self, spec: StructuredOutputs) -> xgr.CompiledGrammar:
        try:
            if spec.kind in ("json", "json_object"):
                schema = spec.spec if spec.kind == "json" else _ANY_OBJECT
                return self._compiler.compile_grammar(json_schema_grammar(schema, spec.any_whitespace))
            if spec.kind == "regex":
                return self._compiler.compile_regex(spec.spec)
            if spec.kind == "choice":
                return self._compiler.compile_grammar(_choice_ebnf(spec.spec))
            if spec.kind == "grammar":
                return self._compiler.compile_grammar(spec.spec)
            return self._compiler.compile_structural_tag(spec.spec)
        except Exception as error:  # noqa: BLE001 - xgrammar's errors, reworded
            raise ValueError(f"structured output ({spec.kind}): {_xgrammar_message(error)}") from None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _tokenizer_info(tokenizer, vocab_size: int, stop_token_ids: list[int]) -> xgr.TokenizerInfo:
    """xgrammar's view of the tokenizer: a Hugging Face one as it is, any other by its pieces' bytes."""
    hf = getattr(tokenizer, "hf", None)
    if hf is not None:
        return xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
    pieces = tokenizer.piece_table(skip_special_tokens=True)  # specials are b"": never allowed in text
    if pieces is None:
        raise ValueError(f"{tokenizer.name}: structured outputs need a Hugging Face tokenizer or a piece table")
    return xgr.TokenizerInfo(pieces, xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=stop_token_ids)


class WhitespaceTokens:
    """The tokens whose text is JSON whitespace only (spaces, tabs, newlines, carriage returns):
    `chars[token]` is such a token's length in bytes (0 for any other token), and `others` the
    bitmask of every other token, which a row's mask is cut to once its run of whitespace is
    exhausted (the grammar worker counts each bounded request's run). The bound holds inside
    strings too: there a run can go on only with a token that is not whitespace alone."""

    def __init__(self, info: xgr.TokenizerInfo, vocab_size: int) -> None:
        chars = [0] * vocab_size
        for token, piece in enumerate(info.decoded_vocab[:vocab_size]):
            if piece and not piece.strip(b" \t\n\r"):
                chars[token] = len(piece)
        self.chars = chars  # a list: read once a token, faster than an array's item
        ids = np.flatnonzero(np.asarray(chars))
        words = np.zeros((vocab_size + 31) // 32, dtype=np.uint32)
        np.bitwise_or.at(words, ids // 32, np.left_shift(np.uint32(1), (ids % 32).astype(np.uint32)))
        self.others = (~words).view(np.int32)


def forbid_whitespace(host: torch.Tensor, rows: list[int], others: np.ndarray) -> None:
    """Cut mask rows `rows` of `host` (on the CPU) to the tokens that are not whitespace only, in
    place; a row that allowed nothing else (a string pattern of spaces) is left as it was. In numpy:
    a few small ops, 7x faster than torch's here."""
    array = host.numpy()
    allowed = array[rows]
    kept = allowed & others
    nothing_else = ~kept.any(axis=1)
    if nothing_else.any():
        kept[nothing_else] = allowed[nothing_else]
    array[rows] = kept


class RequestGrammar:
    """The engine's side of one request's matcher (which a grammar worker holds): where it is,
    whether it constrains yet (reasoning first, with a parser) and what the engine reads per token."""

    __slots__ = ("worker", "slot", "active", "end_marker", "failed", "terminated", "stop_token_ids", "masked",
                 "mask_row")

    def __init__(self, worker, slot: int, stop_token_ids: frozenset[int], end_marker: list[int] | None = None) -> None:
        self.worker = worker  # grammar_workers.GrammarWorker
        self.slot = slot  # the matcher's number there
        self.stop_token_ids = stop_token_ids  # the compiler's: the grammar ends by accepting one
        self.end_marker = end_marker  # the reasoning's end: the grammar applies after these tokens
        self.active = not end_marker
        # the matcher refused a token, or its worker failed: set when the engine reads that worker's reply
        self.failed = False
        # the matcher accepted a stop token, which is the only way it terminates (so no call asks it)
        self.terminated = False
        # its next token is sampled through a mask row filled for it, which its matcher cannot refuse: the
        # engine need not wait for that verdict
        self.masked = False
        self.mask_row = -1  # its row in the mask planned last

    def took(self, token: int) -> None:
        """The matcher takes `token` (sent to it this step; a refusal sets `failed` when it is read)."""
        self.terminated = token in self.stop_token_ids

    def look_for_end(self, output_token_ids: list[int], num_output: int) -> None:
        """Inactive: become active if the output's first `num_output` tokens end with the end marker."""
        marker = self.end_marker
        if num_output >= len(marker) and output_token_ids[num_output - len(marker):num_output] == marker:
            self.active = True


def batch_accept_token(matchers: list[xgr.GrammarMatcher], tokens: list[int]) -> list[bool]:
    """xgrammar's BatchGrammarMatcher.batch_accept_token (one call that releases the GIL), its
    verdicts read with the GIL kept (_VERDICT; xgrammar is pinned, so its binding is stable)."""
    verdicts = xgrammar_core.BatchGrammarMatcher.batch_accept_token([m._handle for m in matchers], tokens, False)
    return [bool(_VERDICT(verdicts, i)) for i in range(len(matchers))]


# the reasoning parsers' markers (roseray.config.REASONING_PARSERS): where the grammar starts
REASONING_MARKERS = {"qwen3": ("<think>", "</think>"), "deepseek_r1": ("<think>", "</think>")}


def reasoning_ended(prompt_token_ids: list[int], start_marker: list[int], end_marker: list[int]) -> bool:
    """The prompt closes its reasoning already (its last end marker follows its last start
    marker): a template that opened and closed an empty one (Qwen3's enable_thinking=False)."""
    return _last_index(prompt_token_ids, end_marker) > _last_index(prompt_token_ids, start_marker)


def _last_index(token_ids: list[int], marker: list[int]) -> int:
    n = len(marker)
    for i in range(len(token_ids) - n, -1, -1):
        if token_ids[i:i + n] == marker:
            return i
    return -1
