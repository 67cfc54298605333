"""The routing simulator's model of one engine step's time (replaces the model forward), and
its fit to measured steps.

step time = base_s
          + token_s        x tokens in the step (prefill chunk tokens + one per decode)
          + seq_s          x sequences that sample a token (lm_head row, sampler)
          + attn_pair_s    x prefill attention pairs: per chunk, chunk x (prefix + chunk / 2)
          + decode_ctx_s   x total context of the decoding sequences (KV bytes read)
          + prefill_ctx_s  x total context of the prefill chunks (prefix + chunk: the KV each
                             chunk's attention walks, one query tile after another)

A step's terms come from the batch the real Scheduler formed (`step_shape`), the same way for
the simulator and for the measurements. The coefficients come from `python -m roseray.bench
step-time` (step_time_fit.py): roseray's real engine on a GPU runs steps of controlled shapes
(prefill chunks after cached prefixes, decode batches at given contexts, both mixed), and
`fit_step_time` fits the six coefficients by non-negative least squares on relative error;
the JSON it writes records the fit's relative error (`fit_rel_err_*`) and its `source` (model,
GPU, date). `routing-sim --step-model fit.json` loads it.

The defaults, until such a fit is loaded, are derived by hand from H100 figures measured for
roseray on the Qwen3-0.6B geometry (28 layers, 16 q / 8 KV heads of 128, bf16; BENCHMARKS.md):

- decode_ctx_s = 40 ns per context token: paged decode attention at 256 sequences x 1024
  tokens takes 373.7 us per layer (95% of copy bandwidth); x 28 layers / 262,144 tokens.
- attn_pair_s = 0.9 ns per (query, key) pair: prefill attention ran 4 x 2048 fresh at 238
  TFLOP/s and 8 chunks of 512 on a 3584-token prefix at 272 TFLOP/s; a pair is 16 heads x 128
  x 4 FLOP per layer, x 28 layers = 229 kFLOP, at ~255 TFLOP/s.
- token_s = 6 us per token: the serving sweep's knee (512-token chunks, 24 req/s, TPOT 9.6
  ms with ~55 decodes of ~2.3k context) leaves ~4.6 ms for a 512-token chunk's matmuls and
  the step's fixed cost after its decode attention (~5 ms): ~1 ms fixed + 512 x ~7 us.
- seq_s = 2 us per sampled sequence: the lm_head row and the sampler's and host's per-request work.
- base_s = 1 ms: the weights read once per step (1.2 GB at 3 TB/s: 0.4 ms) plus launches.
- prefill_ctx_s = 0: not in the hand-derived model. The first H100 fit (2026-11-26) found it:
  a chunk of 128 or 512 tokens costs ~0.75 us more per token of cached prefix, whatever its size,
  where the pairs alone predict 0.1-0.4 us: few query tiles walk a long prefix serially.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np

COEFFICIENTS = ("base_s", "token_s", "seq_s", "attn_pair_s", "decode_ctx_s", "prefill_ctx_s")


@dataclass(frozen=True)
class StepShape:
    """What a step's time depends on (the model's terms besides the constant)."""

    num_tokens: int
    num_sampled: int
    attn_pairs: float
    decode_context: int
    prefill_context: int = 0

    def terms(self) -> tuple[float, ...]:
        """The values that multiply COEFFICIENTS, in order."""
        return (1.0, float(self.num_tokens), float(self.num_sampled), float(self.attn_pairs),
                float(self.decode_context), float(self.prefill_context))


def step_shape(batch) -> StepShape:
    """The shape of a SchedulerOutput just scheduled (before its tokens are counted as computed):
    a request whose new tokens reach its length samples; one new token after the prompt is a
    decode reading `computed + 1` tokens of KV; anything else is a prefill chunk, reading
    `computed + num_new`."""
    num_sampled, pairs, decode_ctx, prefill_ctx = 0, 0.0, 0, 0
    for req, num_new in zip(batch.requests, batch.num_new_tokens):
        computed = req.num_computed_tokens
        if computed + num_new == req.num_tokens:
            num_sampled += 1
        if num_new == 1 and computed >= req.num_prompt_tokens:
            decode_ctx += computed + 1
        else:
            pairs += num_new * (computed + num_new / 2)
            prefill_ctx += computed + num_new
    return StepShape(batch.num_tokens, num_sampled, pairs, decode_ctx, prefill_ctx)


@dataclass(frozen=True)
class StepTimeModel:
    base_s: float = 1.0e-3
    token_s: float = 6.0e-6
    seq_s: float = 2.0e-6
    attn_pair_s: float = 0.9e-9
    decode_ctx_s: float = 40e-9
    prefill_ctx_s: float = 0.0
    source: str = "provisional: hand-derived from H100 Qwen3-0.6B figures in BENCHMARKS.md"
    # a fit's relative error |predicted - measured| / measured over its points (None: not fitted)
    fit_rel_err_p50: float | None = None
    fit_rel_err_p90: float | None = None
    fit_rel_err_max: float | None = None
    fit_points: int = 0

    def step_seconds(self, num_tokens: int, num_sampled: int, attn_pairs: float, decode_context: int,
                     prefill_context: int = 0) -> float:
        """One step: `num_tokens` computed, `num_sampled` sequences sampled, `attn_pairs`
        prefill (query, key) pairs, `decode_context` tokens of KV read by the decodes,
        `prefill_context` by the prefill chunks."""
        return (self.base_s + self.token_s * num_tokens + self.seq_s * num_sampled
                + self.attn_pair_s * attn_pairs + self.decode_ctx_s * decode_context
                + self.prefill_ctx_s * prefill_context)

    def shape_seconds(self, shape: StepShape) -> float:
        return self.step_seconds(shape.num_tokens, shape.num_sampled, shape.attn_pairs, shape.decode_context,
                                 shape.prefill_context)

    def prefill_seconds(self, num_tokens: int, prefix_tokens: int) -> float:
        """The marginal cost of prefilling `num_tokens` after `prefix_tokens` already cached (one chunk)."""
        return (self.token_s * num_tokens + self.attn_pair_s * num_tokens * (prefix_tokens + num_tokens / 2)
                + self.prefill_ctx_s * (prefix_tokens + num_tokens))

    def decode_seconds_per_seq(self, context: int) -> float:
        """What one more decoding sequence of `context` tokens adds to every step."""
        return self.token_s + self.seq_s + self.decode_ctx_s * context

    def to_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def from_json(cls, path: str | Path) -> StepTimeModel:
        """A model from a JSON object of coefficients (e.g. a GPU fit); unknown keys are an error,
        missing ones keep the provisional values."""
        data = json.loads(Path(path).read_text())
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown step-time coefficients in {path}: {sorted(unknown)}")
        return cls(**data)


def nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """argmin ||a x - b|| over x >= 0, exactly, for a handful of columns: the best of the
    unconstrained least-squares solutions on every subset of columns that come out non-negative
    (the optimum is one of them: its positive entries solve the problem restricted to them)."""
    n = a.shape[1]
    best, best_err = np.zeros(n), float(np.sum(b * b))
    for size in range(1, n + 1):
        for subset in itertools.combinations(range(n), size):
            cols = list(subset)
            x_sub, *_ = np.linalg.lstsq(a[:, cols], b, rcond=None)
            if np.any(x_sub < 0):
                continue
            x = np.zeros(n)
            x[cols] = x_sub
            err = float(np.sum((a @ x - b) ** 2))
            if err < best_err:
                best, best_err = x, err
    return best


def relative_errors(model: StepTimeModel, shapes: list[StepShape], seconds) -> np.ndarray:
    predicted = np.array([model.shape_seconds(s) for s in shapes])
    measured = np.asarray(seconds, dtype=float)
    return np.abs(predicted - measured) / measured


def fit_step_time(shapes: list[StepShape], seconds, source: str = "fit") -> StepTimeModel:
    """StepTimeModel's coefficients (all >= 0) that minimize the squared relative error of the
    predicted step times over the measured ones; the fit's error recorded in the model."""
    measured = np.asarray(seconds, dtype=float)
    if len(shapes) != measured.size or measured.size == 0 or np.any(measured <= 0):
        raise ValueError("need one positive measured time per step shape")
    a = np.array([s.terms() for s in shapes]) / measured[:, None]  # rows scaled: relative residuals
    scale = np.abs(a).max(axis=0)
    scale[scale == 0] = 1.0  # a term no point has: its coefficient stays 0
    x = nnls(a / scale, np.ones(measured.size)) / scale
    model = StepTimeModel(**dict(zip(COEFFICIENTS, (float(v) for v in x))), source=source)
    errors = relative_errors(model, shapes, measured)
    return StepTimeModel(**{**asdict(model), "fit_rel_err_p50": float(np.percentile(errors, 50)),
                            "fit_rel_err_p90": float(np.percentile(errors, 90)),
                            "fit_rel_err_max": float(errors.max()), "fit_points": int(measured.size)})
