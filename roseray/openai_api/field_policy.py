"""How a request field declares roseray's policy for it (docs/request-fields.md): honoured,
ignored (`ignored`: it cannot change the output) or refused (`refused`: only the value that
changes nothing is admitted), and the error of a value roseray cannot honour."""

from __future__ import annotations

from pydantic import Field

REFUSED_KEY = "x-roseray-refused"  # in a refused field's schema: why it is refused
IGNORED_KEY = "x-roseray-ignored"  # in an ignored field's schema: true


class UnsupportedFieldError(ValueError):
    """A request field roseray does not implement, or a value it cannot honour; `param` names it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def ignored(default=None):
    """A field that cannot change the output: accepted (with its OpenAI or vLLM type) and dropped."""
    return Field(default, description="Accepted and ignored: it cannot change the output.",
                 json_schema_extra={IGNORED_KEY: True})


def refused(reason: str, default=None):
    """A field roseray cannot honour: its annotation admits only the neutral value."""
    return Field(default, description=f"Not supported ({reason}): only the value that changes nothing is "
                                      "accepted.", json_schema_extra={REFUSED_KEY: reason})
