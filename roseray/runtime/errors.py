"""The errors the async engine raises to its callers (the server maps them to HTTP statuses)."""


class QueueFullError(RuntimeError):
    """The engine's waiting queue is at `max_waiting_requests` (HTTP 429)."""

    def __init__(self, num_waiting: int, limit: int, retry_after_s: int) -> None:
        super().__init__(f"the engine queue is full ({num_waiting} waiting, limit {limit}); retry later")
        self.retry_after_s = retry_after_s


class EngineUnavailableError(RuntimeError):
    """The engine does not take requests: not started, draining, stopped or dead (HTTP 503)."""


class EngineRequestError(RuntimeError):
    """The engine could not take or finish a request (HTTP 500)."""
