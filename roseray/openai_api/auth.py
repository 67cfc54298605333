"""Optional API key: `Authorization: Bearer <key>` on every path but the probes.

A pure ASGI middleware (no per-request Starlette Request object, streaming untouched).
The key is compared in constant time: `hmac.compare_digest` of SHA-256 digests, so that
neither the key's bytes nor its length shape the time a wrong guess takes.
"""

from __future__ import annotations

import hashlib
import hmac
import json

from roseray.openai_api.errors import error_body

OPEN_PATHS = frozenset({"/health", "/ready"})


class ApiKeyMiddleware:
    def __init__(self, app, api_key: str) -> None:
        if not api_key:
            raise ValueError("api_key must be a non-empty string")
        self.app = app
        self._expected = _digest(b"bearer " + api_key.encode())

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        body = json.dumps(error_body(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                                     code="invalid_api_key")).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})

    def _authorized(self, scope) -> bool:
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                return hmac.compare_digest(_digest(scheme.lower() + b" " + token.strip()), self._expected)
        return False


def _digest(value: bytes) -> bytes:
    return hashlib.sha256(value).digest()
