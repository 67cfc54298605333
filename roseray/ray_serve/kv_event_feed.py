"""An engine replica's KV cache events for the Router, one entry per routing-stats period.

Serve pulls `record_routing_stats` from each engine replica every stats period and pushes
the dict to the Routers; the replica adds `"kv"` to it: `{"batch": ...}`, the events of
its prefix cache since the previous period (KVEventBatch.to_dict: hashes as ints), or
`{"snapshot": ...}`, every cached hash (KVCacheSnapshot.to_dict). A snapshot goes instead
of the batch when the batch just drained says `resync` (the engine dropped a backlog, or
the log started on a cache that already held blocks), after a failed poll (its batch may
be lost), and every `snapshot_every` periods as a safety net: a Router that missed a
stats dict (Serve pushes the latest, not every one) sees a gap in the sequence, marks
the replica stale (kv_index.py) and waits for the next snapshot.

One feed per engine: every poll drains the engine's event log.
"""

from __future__ import annotations

import logging
from typing import Any

from roseray.runtime.errors import EngineUnavailableError

logger = logging.getLogger(__name__)


class KVEventFeed:
    """Polls an AsyncLLMEngine's KV cache events once per stats period (see the module docstring)."""

    def __init__(self, engine, snapshot_every: int) -> None:
        if snapshot_every < 1:
            raise ValueError(f"snapshot_every must be >= 1, got {snapshot_every}")
        self.engine = engine
        self.snapshot_every = snapshot_every
        self._periods = 0
        self._want_snapshot = False

    async def poll(self) -> dict[str, Any] | None:
        """This period's `{"batch": ...}` or `{"snapshot": ...}`; None when the engine did not answer."""
        self._periods += 1
        try:
            if not self._want_snapshot and self._periods % self.snapshot_every != 0:
                batch = await self.engine.kv_events()
                if not batch.resync:
                    return {"batch": batch.to_dict()}
            snapshot = await self.engine.kv_events(snapshot=True)
        except EngineUnavailableError as error:
            logger.debug("no KV events this period: %r", error)
            self._want_snapshot = True
            return None
        self._want_snapshot = False
        return {"snapshot": snapshot.to_dict()}
