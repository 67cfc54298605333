"""OpenAI response bodies built from engine deltas: completion and chat, whole and as
SSE chunks, usage and logprobs.

Bodies are plain dicts serialised with json.dumps: a streamed request costs one small
dict per engine step, so pydantic models are kept off this path.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from functools import lru_cache
from json.encoder import encode_basestring  # the C string encoder json.dumps uses (ensure_ascii=False)

from roseray.engine.outputs import RequestDelta
from roseray.openai_api.chat_output import ChatOutput

SSE_DONE = b"data: [DONE]\n\n"
# json.dumps with any option builds a new JSONEncoder per call; every request's first and last events pay that
_encode_json = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode


def sse_event(body: dict) -> bytes:
    return b"data: " + _encode_json(body).encode() + b"\n\n"


def usage(num_prompt_tokens: int, num_output_tokens: int, num_cached_tokens: int = 0) -> dict:
    body = {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_output_tokens,
            "total_tokens": num_prompt_tokens + num_output_tokens}
    if num_cached_tokens:
        body["prompt_tokens_details"] = {"cached_tokens": num_cached_tokens}
    return body


class TokenText:
    """Token id -> its text, cached (a logprobs request decodes every sampled token)."""

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self._decode = lru_cache(maxsize=1 << 16)(lambda token_id: decode([token_id]))

    def __call__(self, token_id: int) -> str:
        return self._decode(token_id)


class ResponseBuilder:
    """Builds one request's response bodies; `kind` is "completion" or "chat". A chat
    request whose output is parsed (reasoning, tool calls) has a ChatOutput: its text goes
    through that, off the plain path."""

    def __init__(self, kind: str, request_id: str, model: str, token_text: TokenText, *,
                 num_top_logprobs: int | None = None, include_usage: bool = False,
                 continuous_usage: bool = False, chat_output: ChatOutput | None = None) -> None:
        self.kind = kind
        self.request_id = request_id
        self.model = model
        self.created = int(time.time())
        self.token_text = token_text
        self.num_top_logprobs = num_top_logprobs  # None = no logprobs asked
        self.include_usage = include_usage
        self.continuous_usage = continuous_usage and include_usage
        self.text_offset = 0  # completions' logprobs.text_offset
        self.sent_role = kind != "chat"  # a chat stream opens with the assistant role
        self.chat_output = chat_output
        self._parsed = chat_output.stream() if chat_output is not None else None  # used when streaming
        # The common event (new text, not the last, no logprobs, no running usage) is this
        # prefix + the JSON string of the text + this suffix: no dict, no json.dumps.
        self._text_event = None
        if num_top_logprobs is None and not self.continuous_usage and chat_output is None:
            marker = "\x00MARK\x00"
            choice = ({"index": 0, "delta": {"content": marker}, "logprobs": None, "finish_reason": None}
                      if kind == "chat" else {"index": 0, "text": marker, "logprobs": None, "finish_reason": None})
            event = sse_event(self._chunk([choice], None, include_usage))
            prefix, suffix = event.split(json.dumps(marker).encode())
            self._text_event = (prefix, suffix)

    # ---- logprobs ----------------------------------------------------------------------------
    def _completion_logprobs(self, token_ids: list[int], logprobs: list[dict[int, float]]) -> dict:
        text = self.token_text
        tokens, token_logprobs, top, offsets = [], [], [], []
        for token_id, entry in zip(token_ids, logprobs):
            token = text(token_id)
            tokens.append(token)
            token_logprobs.append(entry.get(token_id))
            top.append({text(t): lp for t, lp in entry.items()})
            offsets.append(self.text_offset)
            self.text_offset += len(token)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}

    def _chat_logprobs(self, token_ids: list[int], logprobs: list[dict[int, float]]) -> dict:
        text, num_top = self.token_text, self.num_top_logprobs or 0
        content = []
        for token_id, entry in zip(token_ids, logprobs):
            token = text(token_id)
            top = [{"token": text(t), "logprob": lp, "bytes": list(text(t).encode())}
                   for t, lp in list(entry.items())[:num_top]]
            content.append({"token": token, "logprob": entry.get(token_id), "bytes": list(token.encode()),
                            "top_logprobs": top})
        return {"content": content}

    def logprobs(self, token_ids: list[int], logprobs: list[dict[int, float]] | None) -> dict | None:
        if self.num_top_logprobs is None or logprobs is None:
            return None
        if self.kind == "chat":
            return self._chat_logprobs(token_ids, logprobs)
        return self._completion_logprobs(token_ids, logprobs)

    # ---- streaming -----------------------------------------------------------------------------
    def _chunk(self, choices: list[dict], usage_body: dict | None = None, with_usage_key: bool = False) -> dict:
        body = {"id": self.request_id, "object": "chat.completion.chunk" if self.kind == "chat" else "text_completion",
                "created": self.created, "model": self.model, "choices": choices}
        if with_usage_key:
            body["usage"] = usage_body
        return body

    def _template_event(self, text: str) -> bytes:
        prefix, suffix = self._text_event
        return prefix + encode_basestring(text).encode() + suffix

    def delta_event(self, delta: RequestDelta) -> bytes:
        """The SSE bytes of one delta that does not end the stream (the per-step hot path)."""
        if self._text_event is not None and delta.new_text and self.sent_role:
            return self._template_event(delta.new_text)
        return self.stream_chunks((delta,))

    def stream_chunks(self, deltas: Sequence[RequestDelta]) -> bytes:
        """SSE events for the deltas of one read (usually one engine step)."""
        events = []
        if self.kind == "chat" and not self.sent_role:
            self.sent_role = True
            events.append(sse_event(self._chunk(
                [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}],
                None, self.include_usage)))
        if self._parsed is not None:
            return self._parsed_chunks(deltas, events)
        templated = self._text_event is not None
        for delta in deltas:
            if templated and delta.new_text and not delta.finished:
                events.append(self._template_event(delta.new_text))
                continue
            if not delta.new_token_ids and not delta.new_text and not delta.finished:
                continue
            finish = delta.finish_reason if delta.finished else None
            logprobs = self.logprobs(delta.new_token_ids, delta.new_logprobs)
            if self.kind == "chat":
                choice = {"index": 0, "delta": {"content": delta.new_text} if delta.new_text else {},
                          "logprobs": logprobs, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": delta.new_text, "logprobs": logprobs, "finish_reason": finish}
            running_usage = (usage(delta.num_prompt_tokens, delta.num_output_tokens)
                             if self.continuous_usage else None)
            events.append(sse_event(self._chunk([choice], running_usage, self.include_usage)))
        return b"".join(events)

    def _parsed_chunks(self, deltas: Sequence[RequestDelta], events: list[bytes]) -> bytes:
        """stream_chunks of a request with a ChatOutput: its deltas carry reasoning, content and
        tool calls as the parsers find them; the last one says "tool_calls" when calls were made."""
        parsed = self._parsed
        for delta in deltas:
            body = parsed.feed(delta.new_text) if delta.new_text else {}
            finish = None
            if delta.finished:
                finish = parsed.finish(delta.finish_reason, body)
            logprobs = self.logprobs(delta.new_token_ids, delta.new_logprobs)
            if not body and not delta.finished and logprobs is None:
                continue  # a parser holds the text back (a tag may be starting)
            running_usage = (usage(delta.num_prompt_tokens, delta.num_output_tokens)
                             if self.continuous_usage else None)
            choice = {"index": 0, "delta": body, "logprobs": logprobs, "finish_reason": finish}
            events.append(sse_event(self._chunk([choice], running_usage, self.include_usage)))
        return b"".join(events)

    def stream_end(self, last: RequestDelta | None) -> bytes:
        events = []
        if self.include_usage and last is not None:
            events.append(sse_event(self._chunk([], usage(last.num_prompt_tokens, last.num_output_tokens,
                                                          last.request.num_cached_tokens), True)))
        events.append(SSE_DONE)
        return b"".join(events)

    # ---- whole response ------------------------------------------------------------------------
    def full_response(self, text: str, token_ids: list[int], logprobs: list[dict[int, float]] | None,
                      last: RequestDelta) -> dict:
        finish = last.finish_reason
        lp = self.logprobs(token_ids, logprobs) if logprobs is not None else None
        if self.kind == "chat":
            message = {"role": "assistant", "content": text}
            if self.chat_output is not None:
                message, finish = self.chat_output.message(text, finish)
            choice = {"index": 0, "message": message, "logprobs": lp, "finish_reason": finish,
                      "stop_reason": last.request.stop_reason}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": lp, "finish_reason": finish,
                      "stop_reason": last.request.stop_reason}
            obj = "text_completion"
        return {"id": self.request_id, "object": obj, "created": self.created, "model": self.model,
                "choices": [choice],
                "usage": usage(last.num_prompt_tokens, last.num_output_tokens, last.request.num_cached_tokens)}

