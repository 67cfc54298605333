"""What the load generator sends and when: Poisson arrival times shared by every user (and
every locust process), and each request's prompt and output length drawn from ranges.

Everything is a pure function of (seed, request index k): request k has the same arrival
time, prompt length, prompt content and output length whatever the number of users or
processes, so two runs of the same options send the same workload. Prompts are random
(nothing is downloaded, and the prefix cache finds nothing to share between requests).
"""

from __future__ import annotations

import random
import string
from dataclasses import dataclass

PROMPT_STYLES = ("auto", "ids", "words", "chars")

# Short, frequent English words: each is about one token (with its leading space) in the
# BPE vocabularies of GPT-2, Llama 3 and Qwen. Byte-level tokenizers (roseray's random:*
# presets) count bytes instead: use the "chars" style with them.
WORDS = tuple("""
the of and to in is that for it as was with be by on not he this are or his from at which but have an
they you were her all she there would their we him been has when who will more no if out so said what up
its about into than them can only other new some could time these two may then do first any my now such
like our over man me even most made after also did many before must through back years where much your
way well down should because each just those people how too little state good very make world still own
see men work long get here between both life being under never day same another know while last might us
great old year off come since against go came right used take three
""".split())

_CHARS = string.ascii_lowercase + string.digits + "     "  # spaces make word-like runs


def parse_range(text: str, minimum: int = 1) -> tuple[int, int]:
    """"128:4096" -> (128, 4096), both ends included; "64" -> (64, 64)."""
    parts = str(text).split(":")
    try:
        lo, hi = (int(parts[0]), int(parts[0])) if len(parts) == 1 else (int(parts[0]), int(parts[1]))
    except ValueError:
        raise ValueError(f"expected MIN:MAX or N (integers), got {text!r}") from None
    if len(parts) > 2 or lo < minimum or hi < lo:
        raise ValueError(f"expected MIN:MAX with {minimum} <= MIN <= MAX, got {text!r}")
    return lo, hi


class PoissonArrivals:
    """Arrival times (seconds from the start) of one Poisson process at `rate` requests/s.
    With several load processes, process `slot` of `num_slots` takes arrivals k with
    k % num_slots == slot: together they send exactly the single process's schedule."""

    def __init__(self, rate: float, seed: int, slot: int = 0, num_slots: int = 1) -> None:
        if rate <= 0:
            raise ValueError(f"the request rate must be > 0, got {rate}")
        if not 0 <= slot < num_slots:
            raise ValueError(f"slot {slot} is not in [0, {num_slots})")
        self.rate, self.slot, self.num_slots = rate, slot, num_slots
        self._rng = random.Random(seed)
        self._t = 0.0
        self._k = -1

    def next(self) -> tuple[int, float]:
        """(k, offset in s) of this process's next arrival."""
        while True:
            self._t += self._rng.expovariate(self.rate)
            self._k += 1
            if self._k % self.num_slots == self.slot:
                return self._k, self._t


class ClosedLoopIndex:
    """Request indexes of the closed loop (no arrival times): this process's k in turn."""

    def __init__(self, slot: int = 0, num_slots: int = 1) -> None:
        self.slot, self.num_slots, self._i = slot, num_slots, 0

    def next(self) -> int:
        k = self.slot + self._i * self.num_slots
        self._i += 1
        return k


@dataclass(frozen=True)
class RequestShape:
    index: int
    prompt_tokens: int  # asked for; the server's usage says what it counted
    output_tokens: int  # max_tokens (exact with ignore_eos)
    prompt: str | list[int]


class Workload:
    """Request k's prompt and output length, drawn uniformly from the ranges (inclusive).
    With `long_every` = n > 0, every n-th request (k % n == n - 1) draws its prompt length
    from `long_range` instead: a skewed mix, e.g. one request in eight with 4096 tokens."""

    def __init__(self, seed: int, prompt_range: tuple[int, int], output_range: tuple[int, int],
                 prompt_style: str = "words", token_id_range: tuple[int, int] = (0, 255), long_every: int = 0,
                 long_range: tuple[int, int] = (4096, 4096)) -> None:
        if prompt_style not in PROMPT_STYLES or prompt_style == "auto":
            raise ValueError(f"prompt style must be one of ids, words, chars; got {prompt_style!r}")
        if long_every < 0:
            raise ValueError(f"long_every must be >= 0 (0: off), got {long_every}")
        self.seed = seed
        self.prompt_range, self.output_range = prompt_range, output_range
        self.prompt_style = prompt_style
        self.token_id_range = token_id_range
        self.long_every, self.long_range = long_every, long_range

    def is_long(self, k: int) -> bool:
        return self.long_every > 0 and k % self.long_every == self.long_every - 1

    def shape(self, k: int) -> RequestShape:
        rng = random.Random(self.seed * 1_000_003 + k)
        num_prompt = rng.randint(*(self.long_range if self.is_long(k) else self.prompt_range))
        num_output = rng.randint(*self.output_range)
        return RequestShape(k, num_prompt, num_output, self._prompt(rng, num_prompt))

    def _prompt(self, rng: random.Random, n: int) -> str | list[int]:
        if self.prompt_style == "ids":
            lo, hi = self.token_id_range
            return [rng.randint(lo, hi) for _ in range(n)]
        if self.prompt_style == "chars":
            return "".join(rng.choices(_CHARS, k=n))
        return " ".join(rng.choices(WORDS, k=n))


def resolve_prompt_style(style: str, api: str) -> str:
    """"auto" is token ids for /v1/completions (exact lengths) and words for chat."""
    if style not in PROMPT_STYLES:
        raise ValueError(f"prompt style must be one of {', '.join(PROMPT_STYLES)}; got {style!r}")
    if style == "auto":
        return "ids" if api == "completions" else "words"
    if style == "ids" and api != "completions":
        raise ValueError("the ids prompt style needs --api completions (chat messages are text)")
    return style
