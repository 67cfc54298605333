"""Per-request metrics summed over the API processes of one server (`--api-processes N`).

Each API process observes only the requests it serves (TTFT, ITL, E2E, queue time,
token counts, request_success_total), but a scrape may reach any of them, and must see
every request. So every process writes its request samples as JSON to
`<directory>/api<index>.json` (written aside, then renamed: a reader never sees half a
file) at most every `PUBLISH_INTERVAL_S` when they changed, and once more on shutdown;
the process that answers /metrics adds its siblings' latest files to its own live values.
The siblings' part of a scrape is therefore up to `PUBLISH_INTERVAL_S` old. Cumulative
histogram buckets, sums, counts and counter totals all add up; `_created` samples are
left as they are. Engine gauges and counters need none of this: every process reads the
one engine's stats.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os

from prometheus_client import CollectorRegistry

logger = logging.getLogger(__name__)

PUBLISH_INTERVAL_S = 1.0

SampleKey = tuple[str, tuple[tuple[str, str], ...]]


def _samples(registry: CollectorRegistry) -> dict[SampleKey, float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in registry.collect() for s in family.samples if not s.name.endswith("_created")}


class MetricsShare:
    """This API process's side of the shared metrics directory."""

    def __init__(self, directory: str, index: int) -> None:
        self.directory = directory
        self.index = index
        self.path = os.path.join(directory, f"api{index}.json")
        self._published: str | None = None

    def publish(self, registry: CollectorRegistry) -> None:
        """Write this process's request samples (if they changed since the last write)."""
        text = json.dumps([[name, dict(labels), value] for (name, labels), value in _samples(registry).items()])
        if text == self._published:
            return
        temporary = f"{self.path}.{os.getpid()}.tmp"
        with open(temporary, "w") as f:
            f.write(text)
        os.replace(temporary, self.path)
        self._published = text

    async def publish_forever(self, registry: CollectorRegistry) -> None:
        """Publish every PUBLISH_INTERVAL_S until cancelled, and once more then."""
        try:
            while True:
                await asyncio.sleep(PUBLISH_INTERVAL_S)
                try:
                    self.publish(registry)
                except OSError:
                    logger.exception("could not write the metrics snapshot %s", self.path)
        finally:
            try:
                self.publish(registry)
            except OSError:
                pass

    def siblings(self) -> dict[SampleKey, float]:
        """The other processes' latest samples, summed."""
        total: dict[SampleKey, float] = {}
        try:
            names = os.listdir(self.directory)
        except OSError:
            return total
        for name in names:
            if not (name.startswith("api") and name.endswith(".json")) or name == os.path.basename(self.path):
                continue
            try:
                with open(os.path.join(self.directory, name)) as f:
                    entries = json.load(f)
            except (OSError, ValueError):
                continue  # gone or not written yet
            for sample_name, labels, value in entries:
                key = (sample_name, tuple(sorted(labels.items())))
                total[key] = total.get(key, 0.0) + value
        return total

    def summed(self, registry: CollectorRegistry) -> SummedRegistry:
        return SummedRegistry(registry, self.siblings())


class SummedRegistry:
    """`registry`'s families with the siblings' samples added (what generate_latest reads)."""

    def __init__(self, registry: CollectorRegistry, siblings: dict[SampleKey, float]) -> None:
        self.registry = registry
        self.siblings = siblings

    def collect(self):
        siblings = self.siblings
        for family in self.registry.collect():
            family.samples = [s._replace(value=s.value + siblings.get((s.name, tuple(sorted(s.labels.items()))), 0.0))
                              if not s.name.endswith("_created") else s for s in family.samples]
            yield family
