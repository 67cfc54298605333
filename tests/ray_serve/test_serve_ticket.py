"""Router tickets: the engine accepts only requests the router signed, for that request id,
before expiry, with the shared secret."""

import pytest

from roseray.ray_serve.ticket import TICKET_HEADER, TicketSigner, new_secret


def test_a_signed_ticket_verifies_for_its_request_id_only():
    signer = TicketSigner(new_secret(), ttl_s=30)
    ticket = signer.sign("req-1", now=1000.0)
    assert signer.verify(ticket, "req-1", now=1010.0) is None
    assert "invalid" in signer.verify(ticket, "req-2", now=1010.0)


def test_expired_forged_missing_and_malformed_tickets_are_refused():
    signer = TicketSigner(new_secret(), ttl_s=30)
    ticket = signer.sign("req-1", now=1000.0)
    assert "expired" in signer.verify(ticket, "req-1", now=1031.0)
    other = TicketSigner(new_secret()).sign("req-1", now=1000.0)
    assert "invalid" in signer.verify(other, "req-1", now=1001.0)
    version, expiry, mac = ticket.split(".")
    assert "invalid" in signer.verify(f"{version}.{int(expiry) + 3600}.{mac}", "req-1", now=1001.0)  # extended
    assert "missing router ticket" in signer.verify(None, "req-1")
    assert "missing x-request-id" in signer.verify(ticket, "")
    for bad in ("garbage", "v1.x.abc", "v2.99999999999.abc", "v1.99999999999."):
        assert "malformed" in signer.verify(bad, "req-1")


def test_ticket_header_is_in_the_namespace_haproxy_strips_from_clients():
    assert TICKET_HEADER.startswith("x-serve-router-")


def test_short_secrets_and_empty_request_ids_are_refused():
    with pytest.raises(ValueError):
        TicketSigner("short")
    with pytest.raises(ValueError):
        TicketSigner(new_secret()).sign("")
