"""Errors in the OpenAI shape: {"error": {"message", "type", "param", "code"}}.

Every failure the API returns goes through `error_response`: 400 for any invalid
request (FastAPI's 422 is converted, with a message naming the field; code "unknown_field"
for a field roseray does not know, "unsupported_field" for one it refuses), 401 bad API key,
404 unknown model or route, 413 body over the size limit (roseray.openai_api.body_limit),
429 + Retry-After when the engine queue is full, 500 when the engine failed the request,
503 + Retry-After while not ready or draining.
"""

from __future__ import annotations

import difflib
import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from roseray.openai_api.protocol import KNOWN_FIELDS, REFUSED_FIELDS

logger = logging.getLogger(__name__)

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """Raise anywhere in a route to answer with an OpenAI-shaped error."""

    def __init__(self, status_code: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers


def error_body(status_code: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPE_BY_STATUS.get(status_code, "server_error"),
                      "param": param, "code": code}}


def error_response(status_code: int, message: str, *, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status_code, message, param, code), status_code=status_code, headers=headers)


_LEADING_FIELD = re.compile(r"^([a-z_]+) ")
_FASTAPI_PARSE_ERROR = "There was an error parsing the body"  # FastAPI: not UTF-8, or nested too deep
PARSE_ERROR_MESSAGE = "the request body is not valid JSON (send one UTF-8 encoded JSON object)"


def param_of(message: str, known: set[str] | frozenset[str]) -> str | None:
    """The field a validation message starts with ("top_p must be ..." -> "top_p")."""
    match = _LEADING_FIELD.match(message)
    return match.group(1) if match and match.group(1) in known else None


def _is_union_tag(part: object) -> bool:
    """pydantic names the member of a union in `loc` ("str", "list[constrained-int]",
    "ChatMessage"); roseray's field names are lower-case identifiers."""
    if not isinstance(part, str):
        return False
    return any(c in part for c in "[-") or part[:1].isupper() or part in ("str", "int", "float", "bool", "list",
                                                                          "dict", "none")


def _field_path(error: dict) -> str | None:
    parts = [str(p) for p in error.get("loc", ()) if p != "body" and not _is_union_tag(p)]
    return ".".join(parts) or None


def _validation_message(exc: RequestValidationError,
                        content_type: str = "application/json") -> tuple[str, str | None, str | None]:
    """(message, param, code) of a body that does not validate."""
    errors = exc.errors()
    if not errors:
        return "invalid request body", None, None
    if any(e.get("type") == "json_invalid" for e in errors):
        return PARSE_ERROR_MESSAGE, None, None
    fields = {(_field_path(e) or "").split(".")[0] for e in errors}
    more = f" (and {len(fields) - 1} more invalid field(s))" if len(fields) > 1 else ""
    refusal = _refusal(errors)
    if refusal is not None:
        return refusal[0] + more, refusal[1], refusal[2]
    # A value that fails every member of a union yields one error per member: the one that
    # is not a plain type mismatch names the real problem ("stop": "" is a str, but empty).
    first = next((e for e in errors if not str(e.get("type", "")).endswith("_type")), errors[0])
    param = _field_path(first)
    if first.get("type") == "missing":
        if param is None:
            return "the request body is empty: send a JSON object", None, None
        return f"missing required field {param!r}", param, None
    if param is None and first.get("type") in ("model_attributes_type", "dict_type", "model_type"):
        if "json" not in content_type:
            return "the request body must be a JSON object sent as content-type: application/json", None, None
        return "the request body must be a JSON object", None, None
    message = first.get("msg", "invalid value")
    return (f"{param}: {message}{more}" if param else f"{message}{more}"), param, None


_NESTED_DEPTH = {"messages": 3, "structured_outputs": 2}  # where a refused field of a nested object sits


def _refusal(errors: list[dict]) -> tuple[str, str, str] | None:
    """(message, param, code) when a field is one roseray refuses (protocol.py), or unknown.
    A refused field is named first: {"response_format": {"type": "json_schema", "json_schema":
    ...}} is a refused response_format, not an unknown field inside it."""
    paths = [(error, path) for error in errors if (path := _field_path(error)) is not None]
    for error, path in paths:
        if error.get("type") == "extra_forbidden":  # a field of the other route
            continue
        parts = path.split(".")
        # a refused field of the body, of one of its messages ("messages.0.x") or of its
        # structured_outputs object ("structured_outputs.backend")
        depth = _NESTED_DEPTH.get(parts[0], 1) if len(parts) >= _NESTED_DEPTH.get(parts[0], 1) else 1
        name = parts[depth - 1]
        if name in REFUSED_FIELDS:
            return f"{name} is not supported ({REFUSED_FIELDS[name]})", ".".join(parts[:depth]), "unsupported_field"
    for error, path in paths:
        if error.get("type") == "extra_forbidden":
            hint = ""
            if path in KNOWN_FIELDS:
                hint = "it is a field of the other generation route; "
            elif "." not in path:
                close = difflib.get_close_matches(path, KNOWN_FIELDS, n=1, cutoff=0.75)
                hint = f"did you mean {close[0]!r}? " if close else ""
            return (f"unknown field {path!r} ({hint}fields roseray does not know are refused, not ignored; "
                    f"see docs/request-fields.md)", path, "unknown_field")
    return None


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status_code, exc.message, param=exc.param, code=exc.code, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param, code = _validation_message(exc, request.headers.get("content-type", "").lower())
        return error_response(400, message, param=param, code=code)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else "request failed"
        if exc.status_code == 404:
            message = "not found"
        elif exc.status_code == 400 and message == _FASTAPI_PARSE_ERROR:
            message = PARSE_ERROR_MESSAGE
        headers = dict(exc.headers) if exc.headers else None
        return error_response(exc.status_code, message, headers=headers)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error in the API")
        return error_response(500, f"internal server error ({type(exc).__name__})")
