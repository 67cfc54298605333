"""The built-in chat template: ChatML-style text, for the `random:` presets and tokenizers
that ship no chat template of their own. With tools it writes them in the hermes format:
a system block lists the functions as JSON and asks for calls as
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`; an assistant's earlier calls are
written the same way and a tool's result is a `tool` turn. Of the extra template variables
(`chat_template_kwargs`) it reads `enable_thinking`; like a Hugging Face template it
ignores the others."""

from __future__ import annotations

import json
from typing import Any

TOOLS_PREAMBLE = ("# Tools\n\nYou can call the functions listed in <tools></tools> below, whose parameters are "
                  "JSON schemas:\n<tools>\n")
TOOLS_INSTRUCTION = ("</tools>\n\nTo call a function, answer with a JSON object of its name and arguments inside "
                     "<tool_call></tool_call> tags, one block per call:\n<tool_call>\n"
                     '{"name": <function name>, "arguments": <arguments object>}\n</tool_call>')
EMPTY_THINKING = "<think>\n\n</think>\n\n"  # after the generation prompt when enable_thinking is false


def default_chat_template(messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                          tools: list[dict[str, Any]] | None = None, **template_kwargs: Any) -> str:
    turns = [_turn(message) for message in messages]
    if tools:
        block = TOOLS_PREAMBLE + "".join(json.dumps(tool, ensure_ascii=False) + "\n" for tool in tools) + \
            TOOLS_INSTRUCTION
        if messages and messages[0].get("role") in ("system", "developer"):
            first = messages[0]
            turns[0] = _turn({**first, "content": f"{content_text(first.get('content'))}\n\n{block}"})
        else:
            turns.insert(0, _turn({"role": "system", "content": block}))
    text = "".join(turns)
    if add_generation_prompt:
        text += "<|im_start|>assistant\n"
        if template_kwargs.get("enable_thinking") is False:
            text += EMPTY_THINKING
    return text


def _turn(message: dict[str, Any]) -> str:
    body = content_text(message.get("content"))
    for call in message.get("tool_calls") or ():
        function = call.get("function", {})
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):  # JSON text (or what the client sent): written as it is
            written = arguments
        else:
            written = json.dumps(arguments, ensure_ascii=False)
        name = json.dumps(function.get("name", ""), ensure_ascii=False)
        body += f'{chr(10) if body else ""}<tool_call>\n{{"name": {name}, "arguments": {written}}}\n</tool_call>'
    return f"<|im_start|>{message['role']}\n{body}<|im_end|>\n"


def content_text(content: Any) -> str:
    """A message's content as text: a string, or the text parts of an OpenAI content list."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content if isinstance(part, dict))
