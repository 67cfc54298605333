"""Seeded workloads of the routing simulator: who arrives when, with which prompt.

Arrivals are Poisson; the rate ramps linearly from `ramp_start` x QPS to QPS over the first
`ramp_s` seconds (llm-d ramps its multi-tenant load the same way, so that caches fill while
the load grows), then holds. A workload is a list of light request specs; the token ids of a
prompt are made when the simulator admits it (`prompt_ids`) and dropped when it finishes:
thousands of 6k-token prompts would not fit in memory at once.

- multi-tenant (llm-d's shape): T tenants, each a shared prefix of ~6k tokens; a request is
  its tenant's prefix + a unique suffix of a few hundred tokens; outputs 100-300 tokens.
- multi-turn chat: sessions of K turns; turn k's prompt is turn k-1's prompt + its answer +
  a new user message (the answer ids are the ones the simulator emits for turn k-1). Turns
  follow each other `turn_gap_s` apart whether or not the previous one has finished.
- no-sharing: random prompts of the multi-tenant's length and outputs: nothing to cache.

Token ids are drawn from [1, vocab): VOCAB fits the Qwen3 vocabulary (151,936); a replay on a
model with a smaller one (routing_replay.py, the tests' tiny models) passes its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

VOCAB = 150_000


@dataclass(frozen=True)
class ArrivalShape:
    qps: float
    duration_s: float
    ramp_s: float = 0.0
    ramp_start: float = 0.1  # the rate at t=0, as a fraction of qps

    def rate(self, t: float) -> float:
        if self.ramp_s <= 0 or t >= self.ramp_s:
            return self.qps
        return self.qps * (self.ramp_start + (1 - self.ramp_start) * t / self.ramp_s)

    def arrivals(self, rng: np.random.Generator, qps_scale: float = 1.0) -> list[float]:
        """Poisson arrival times at `qps_scale` x the shape's rate (by thinning)."""
        peak = self.qps * qps_scale
        if peak <= 0:
            return []
        times, t = [], 0.0
        while True:
            t += rng.exponential(1.0 / peak)
            if t >= self.duration_s:
                return times
            if rng.random() * self.qps <= self.rate(t):
                times.append(t)


@dataclass(frozen=True)
class SimRequestSpec:
    request_id: str
    arrival_s: float
    max_tokens: int
    group: int  # the tenant or session; -1 for none
    turn: int = 0
    seed: int = 0


def _ids(seed: tuple[int, ...], count: int, vocab: int = VOCAB) -> list[int]:
    return np.random.default_rng(seed).integers(1, vocab, size=count).tolist()


class MultiTenantWorkload:
    name = "multi-tenant"

    def __init__(self, shape: ArrivalShape, *, tenants: int = 150, prefix_tokens: int = 6000,
                 suffix_tokens: tuple[int, int] = (200, 400), output_tokens: tuple[int, int] = (100, 300),
                 seed: int = 0, vocab: int = VOCAB) -> None:
        self.seed, self.suffix_tokens, self.vocab = seed, suffix_tokens, vocab
        rng = np.random.default_rng((seed, 1))
        self._prefixes = [_ids((seed, 2, t), prefix_tokens, vocab) for t in range(tenants)]
        self.specs = [SimRequestSpec(f"mt-{i}", t, int(rng.integers(output_tokens[0], output_tokens[1] + 1)),
                                     int(rng.integers(tenants)), seed=i)
                      for i, t in enumerate(shape.arrivals(rng))]

    def prompt_ids(self, spec: SimRequestSpec) -> list[int]:
        rng = np.random.default_rng((self.seed, 3, spec.seed))
        suffix = rng.integers(1, self.vocab, size=int(rng.integers(self.suffix_tokens[0], self.suffix_tokens[1] + 1)))
        return self._prefixes[spec.group] + suffix.tolist()

    def output_ids(self, spec: SimRequestSpec) -> list[int] | None:
        return None


class NoSharingWorkload:
    name = "no-sharing"

    def __init__(self, shape: ArrivalShape, *, prompt_tokens: tuple[int, int] = (6200, 6400),
                 output_tokens: tuple[int, int] = (100, 300), seed: int = 0, vocab: int = VOCAB) -> None:
        self.seed, self.prompt_tokens, self.vocab = seed, prompt_tokens, vocab
        rng = np.random.default_rng((seed, 1))
        self.specs = [SimRequestSpec(f"ns-{i}", t, int(rng.integers(output_tokens[0], output_tokens[1] + 1)), -1,
                                     seed=i)
                      for i, t in enumerate(shape.arrivals(rng))]

    def prompt_ids(self, spec: SimRequestSpec) -> list[int]:
        rng = np.random.default_rng((self.seed, 3, spec.seed))
        return rng.integers(1, self.vocab, size=int(rng.integers(self.prompt_tokens[0],
                                                            self.prompt_tokens[1] + 1))).tolist()

    def output_ids(self, spec: SimRequestSpec) -> list[int] | None:
        return None


class MultiTurnWorkload:
    name = "multi-turn"

    def __init__(self, shape: ArrivalShape, *, turns: int = 5, first_tokens: tuple[int, int] = (1000, 3000),
                 user_tokens: tuple[int, int] = (50, 300), output_tokens: tuple[int, int] = (100, 300),
                 turn_gap_s: float = 8.0, seed: int = 0, vocab: int = VOCAB) -> None:
        self.seed, self.first_tokens, self.user_tokens, self.vocab = seed, first_tokens, user_tokens, vocab
        self.output_tokens = output_tokens
        rng = np.random.default_rng((seed, 1))
        specs = []
        for session, start in enumerate(shape.arrivals(rng, qps_scale=1.0 / turns)):
            for turn in range(turns):
                specs.append(SimRequestSpec(f"mc-{session}-{turn}", start + turn * turn_gap_s,
                                            self._answer_len(session, turn), session, turn))
        self.specs = sorted(specs, key=lambda s: s.arrival_s)

    def _answer_len(self, session: int, turn: int) -> int:
        rng = np.random.default_rng((self.seed, 4, session, turn))
        return int(rng.integers(self.output_tokens[0], self.output_tokens[1] + 1))

    def _piece(self, kind: int, session: int, turn: int, bounds: tuple[int, int], count: int | None = None):
        rng = np.random.default_rng((self.seed, kind, session, turn))
        n = count if count is not None else int(rng.integers(bounds[0], bounds[1] + 1))
        return rng.integers(1, self.vocab, size=n).tolist()

    def _answer(self, session: int, turn: int) -> list[int]:
        return self._piece(6, session, turn, (0, 0), self._answer_len(session, turn))

    def prompt_ids(self, spec: SimRequestSpec) -> list[int]:
        ids = self._piece(5, spec.group, 0, self.first_tokens)
        for turn in range(1, spec.turn + 1):
            ids += self._answer(spec.group, turn - 1) + self._piece(5, spec.group, turn, self.user_tokens)
        return ids

    def output_ids(self, spec: SimRequestSpec) -> list[int] | None:
        return self._answer(spec.group, spec.turn)


WORKLOADS = {w.name: w for w in (MultiTenantWorkload, MultiTurnWorkload, NoSharingWorkload)}
