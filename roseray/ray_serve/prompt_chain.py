"""The Router's exact routing hint: a request's prompt block chain as the engine will hash it.

The cache-aware policy compares a request's chain with each replica's cached chain hashes
(kv_index.py), so the chain must be the engine's: block_hash.py over the prompt's token ids,
which the Router computes with the engine's own tokenizer and the OpenAI app's own
body -> token ids function (openai_api/prompt_ids.py: a chat's messages through the chat
template). The body is the one HAProxy forwarded, possibly cut at its buffer size
(routing.hint_from_body closes the JSON where it was cut): then the prompt's head is
tokenized — for a chat, the rendered template up to where the cut last message's text
ends — and the chain's last full block is dropped (the tokens at the cut may merge
differently in the full prompt). The prompt-size estimate is scaled to the full body.

Chains are cached by the prompt's fields (LRU), so a repeated prompt is tokenized once.
Tokenizing costs about 1.5-3 ms per 1,000 tokens (an HF fast tokenizer on one shared CPU
core; the hashing is under 5% of it): the Router runs long prompts on a worker thread
(`hint` is thread-safe), where the Rust tokenizer releases the GIL.
A body this cannot read (no prompt, a schema error) gets routing.hint_from_body's size
estimate and no chain.
"""

from __future__ import annotations

import collections
import hashlib
import json
import math
import threading
from typing import Any

from pydantic import ValidationError

from roseray.engine.block_hash import block_chain
from roseray.openai_api.prompt_ids import prompt_ids
from roseray.openai_api.protocol import ChatCompletionRequest, CompletionRequest
from roseray.ray_serve.json_head import loads_or_head
from roseray.ray_serve.routing import HintConfig, RoutingHint, _truncation_scale, hint_from_body
from roseray.tokenizer import Tokenizer

# the body fields that decide the prompt's token ids
PROMPT_FIELDS = ("messages", "prompt", "tools", "chat_template_kwargs", "add_generation_prompt", "add_special_tokens")


class PromptChainer:
    """RoutingHints with the engine's block chain, from request bodies (see the module docstring)."""

    def __init__(self, tokenizer: Tokenizer, config: HintConfig, cache_size: int = 4096) -> None:
        self.tokenizer = tokenizer
        self.config = config
        self.cache_size = cache_size
        self._cache: collections.OrderedDict[bytes, tuple[tuple[int, ...], int]] = collections.OrderedDict()
        self._cache_lock = threading.Lock()

    def hint(self, body: bytes, truncated: str | None = None) -> RoutingHint:
        """The request's hint: its prompt's chain, prompt blocks and the blocks it needs in all."""
        try:
            data, parsed, cut = json.loads(body), len(body), False
        except ValueError:
            (data, parsed), cut = loads_or_head(body), True
        if not isinstance(data, dict):
            return hint_from_body(b"", None, self.config)
        found = self._chain(data, cut)
        if found is None:
            fallback = hint_from_body(body, None, self.config, truncated)
            return RoutingHint(fallback.need_blocks, ())
        chain, num_tokens = found
        scale = _truncation_scale(truncated, parsed, len(body)) if cut or truncated else 1.0
        prompt_tokens = math.ceil(num_tokens * scale)
        max_tokens = next((data[key] for key in ("max_completion_tokens", "max_tokens")
                           if isinstance(data.get(key), int) and data[key] > 0), 0)
        size = self.config.block_size
        return RoutingHint(need_blocks=max(1, math.ceil((prompt_tokens + max_tokens) / size)), prefix_hashes=chain,
                           prompt_blocks=math.ceil(prompt_tokens / size))

    def _chain(self, data: dict, cut: bool) -> tuple[tuple[int, ...], int] | None:
        """(the chain, the prompt's token count) for the prompt in `data`; None if it has none."""
        fields = {name: data[name] for name in PROMPT_FIELDS if name in data}
        key = hashlib.blake2b(json.dumps([fields, cut], sort_keys=True).encode(), digest_size=16).digest()
        with self._cache_lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                return cached
        token_ids = self._token_ids(data, cut)
        if token_ids is None:
            return None
        chain = block_chain(token_ids, self.config.block_size)
        if cut and chain:
            chain.pop()
        found = (tuple(chain), len(token_ids))
        with self._cache_lock:
            self._cache[key] = found
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return found

    def _token_ids(self, data: dict, cut: bool) -> list[int] | None:
        try:
            if "messages" in data:
                chat = ChatCompletionRequest.model_validate(data)
                token_ids, text = prompt_ids(chat, self.tokenizer)
                if not cut:
                    return token_ids
                head = _rendered_head(text, chat.messages[-1].for_template().get("content"))
                return None if head is None else self.tokenizer.encode(head, add_special_tokens=chat.add_special_tokens)
            return prompt_ids(CompletionRequest.model_validate(data), self.tokenizer)[0]
        except (ValidationError, ValueError, UnicodeError, TypeError):
            return None


def _rendered_head(text: str, last_content: Any) -> str | None:
    """The chat template's text up to the end of the (cut) last message's text: what the
    full prompt's rendering starts with. None when that text cannot be found in it."""
    if isinstance(last_content, list):
        last_content = "".join(p.get("text", "") for p in last_content if isinstance(p, dict))
    if not isinstance(last_content, str) or not last_content:
        return None
    at = text.rfind(last_content)
    return None if at < 0 else text[:at + len(last_content)]
