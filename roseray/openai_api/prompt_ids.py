"""A request body's prompt as the engine gets it: token ids (and a chat's rendered text).

One function for the OpenAI app (which admits the request) and the Ray Router (which hashes
the prompt's blocks to find the replica whose prefix cache holds them): both must turn
the same body into the same token ids, or the Router's block chain would not be the engine's.
"""

from __future__ import annotations

from roseray.openai_api.protocol import ChatCompletionRequest, CompletionRequest
from roseray.tokenizer import Tokenizer


def prompt_ids(body: CompletionRequest | ChatCompletionRequest, tokenizer: Tokenizer) -> tuple[list[int], str | None]:
    """(the prompt's token ids, the chat template's text or None for a completion). A chat's
    messages go through the tokenizer's chat template, then the tokenizer; a completion's
    text prompt through the tokenizer, its token-id prompt as it is. ValueError (or
    UnicodeError) for what cannot be rendered or encoded."""
    if isinstance(body, ChatCompletionRequest):
        text = tokenizer.apply_chat_template(body.template_messages(), add_generation_prompt=body.add_generation_prompt,
                                             tools=body.template_tools(), **(body.chat_template_kwargs or {}))
        return tokenizer.encode(text, add_special_tokens=body.add_special_tokens), text
    prompt = body.single_prompt()
    if isinstance(prompt, str):
        return tokenizer.encode(prompt, add_special_tokens=body.add_special_tokens), None
    return list(prompt), None
