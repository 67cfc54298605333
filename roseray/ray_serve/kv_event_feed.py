"""An engine replica's KV cache events for the Router, one entry per routing-stats period.

Serve pulls `record_routing_stats` from each engine replica every stats period and pushes
the dict to the Routers; the replica adds `"kv": {"recent": [...]}` to it: this period's
entry and the ones of the `window - 1` periods before, oldest first. An entry is
`{"batch": ...}`, the events of its prefix cache since the previous period
(KVEventBatch.to_dict: hashes as ints), or `{"snapshot": ...}`, every cached hash
(KVCacheSnapshot.to_dict). Serve's controller polls the replicas and the Routers get the
latest stats by long poll, so a Router misses a dict now and then: the window lets it
apply the batches it missed (in sequence) instead of losing its view until a snapshot.

A snapshot goes instead of the batch when the batch just drained says `resync` (the engine
dropped a backlog, or the log started on a cache that already held blocks), after a
failed poll (its batch may be lost), and every `snapshot_every` periods as a safety net
for a Router that missed more than the window (kv_index.py marks it stale until then).

One feed per engine: every poll drains the engine's event log.
"""

from __future__ import annotations

import collections
import logging
from typing import Any

from roseray.runtime.errors import EngineUnavailableError

logger = logging.getLogger(__name__)


class KVEventFeed:
    """Polls an AsyncLLMEngine's KV cache events once per stats period (see the module docstring)."""

    def __init__(self, engine, snapshot_every: int, window: int = 8) -> None:
        if snapshot_every < 1 or window < 1:
            raise ValueError(f"snapshot_every and window must be >= 1, got {snapshot_every} and {window}")
        self.engine = engine
        self.snapshot_every = snapshot_every
        self._periods = 0
        self._want_snapshot = False
        self._recent: collections.deque[dict[str, Any]] = collections.deque(maxlen=window)

    async def poll(self) -> dict[str, Any]:
        """`{"recent": [entry, ...]}`: the last `window` periods' entries (this one's last, unless
        the engine did not answer now)."""
        self._periods += 1
        try:
            self._recent.append(await self._entry())
        except EngineUnavailableError as error:
            logger.debug("no KV events this period: %r", error)
            self._want_snapshot = True
        return {"recent": list(self._recent)}

    async def _entry(self) -> dict[str, Any]:
        if not self._want_snapshot and self._periods % self.snapshot_every != 0:
            batch = await self.engine.kv_events()
            if not batch.resync:
                return {"batch": batch.to_dict()}
        snapshot = await self.engine.kv_events(snapshot=True)
        self._want_snapshot = False
        return {"snapshot": snapshot.to_dict()}
