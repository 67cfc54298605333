"""Router tickets: proof that a request came through roseray's router.

The router signs `(x-request-id, expiry)` with an HMAC key shared with the engine
replicas and returns the ticket in its `request_headers`; HAProxy strips any
client-sent `x-serve-router-*` header and sets the router's, so a client cannot forge
one, and the engine refuses generation requests without a valid ticket (a request sent
straight to an engine replica's port). Tickets expire after `ttl_s`; they are bound to
the request id, not to a replica, so HAProxy may still redispatch on a connect failure.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time

# The `x-serve-router-` prefix is what HAProxy strips from client requests.
TICKET_HEADER = "x-serve-router-roseray-ticket"
REQUEST_ID_HEADER = "x-request-id"
_VERSION = "v1"


def new_secret() -> str:
    return secrets.token_hex(32)


class TicketSigner:
    def __init__(self, secret: str, ttl_s: float = 60.0) -> None:
        if len(secret) < 16:
            raise ValueError("the ticket secret must be at least 16 characters")
        self._key = secret.encode()
        self.ttl_s = ttl_s

    def _mac(self, request_id: str, expiry: int) -> str:
        message = f"roseray-ticket|{_VERSION}|{request_id}|{expiry}".encode()
        return hmac.new(self._key, message, hashlib.sha256).hexdigest()

    def sign(self, request_id: str, now: float | None = None) -> str:
        if not request_id:
            raise ValueError("a ticket needs a request id")
        expiry = int((time.time() if now is None else now) + self.ttl_s)
        return f"{_VERSION}.{expiry}.{self._mac(request_id, expiry)}"

    def check_request(self, request) -> str | None:
        """verify() of a request's own ticket and request id headers (an engine's request_guard)."""
        headers = request.headers
        return self.verify(headers.get(TICKET_HEADER), headers.get(REQUEST_ID_HEADER))

    def verify(self, ticket: str | None, request_id: str | None, now: float | None = None) -> str | None:
        """None when the ticket is valid for this request id, else why it is not."""
        if not ticket:
            return "missing router ticket: send requests through the roseray router, not to an engine replica"
        if not request_id:
            return "missing x-request-id"
        version, _, rest = ticket.partition(".")
        expiry_text, _, mac = rest.partition(".")
        if version != _VERSION or not expiry_text.isdigit() or not mac:
            return "malformed router ticket"
        expiry = int(expiry_text)
        if not hmac.compare_digest(mac, self._mac(request_id, expiry)):
            return "invalid router ticket"
        if expiry < (time.time() if now is None else now):
            return "expired router ticket"
        return None
