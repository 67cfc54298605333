"""The routing simulator's model of one engine step's GPU time (replaces the model forward).

step time = base_s
          + token_s        x tokens in the step (prefill chunk tokens + one per decode)
          + seq_s          x sequences that sample a token (lm_head row, sampler)
          + attn_pair_s    x prefill attention pairs: per chunk, chunk x (prefix + chunk / 2)
          + decode_ctx_s   x total context of the decoding sequences (KV bytes read)

PROVISIONAL: fit to be replaced by a GPU fit (prefill time by chunk tokens and prefix length,
decode step by batch and context). The coefficients are derived by hand from H100 figures
already measured for roseray on the Qwen3-0.6B geometry (28 layers, 16 q / 8 KV heads of 128,
bf16; BENCHMARKS.md):

- decode_ctx_s = 40 ns per context token: paged decode attention at 256 sequences x 1024
  tokens takes 373.7 us per layer (95% of copy bandwidth); x 28 layers / 262,144 tokens.
- attn_pair_s = 0.9 ns per (query, key) pair: prefill attention ran 4 x 2048 fresh at 238
  TFLOP/s and 8 chunks of 512 on a 3584-token prefix at 272 TFLOP/s; a pair is 16 heads x 128
  x 4 FLOP per layer, x 28 layers = 229 kFLOP, at ~255 TFLOP/s.
- token_s = 6 us per token: the serving sweep's knee (512-token chunks, 24 req/s, TPOT 9.6
  ms with ~55 decodes of ~2.3k context) leaves ~4.6 ms for a 512-token chunk's matmuls and
  the step's fixed cost after its decode attention (~5 ms): ~1 ms fixed + 512 x ~7 us. At
  0.88 GFLOP per token (0.44 B non-embedding parameters) 6 us is ~150 TFLOP/s: small GEMMs.
- seq_s = 2 us per sampled sequence: the lm_head (151,936 x 1024) per sampled row at ~400
  TFLOP/s is ~0.8 us; sampling and the host's per-request work make up the rest.
- base_s = 1 ms: the weights read once per step (1.2 GB at 3 TB/s: 0.4 ms) plus launches.

Check against W-nano (256 requests, inputs and outputs of 100-1024, 18,941 output tok/s):
a decode step of 256 at a mean context of ~840 is 1 + 1.5 + 0.5 + 8.6 ms = 11.6 ms, 22k
tok/s before the prefill steps and the shrinking batch of the tail: the right size, not a fit.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path


@dataclass(frozen=True)
class StepTimeModel:
    base_s: float = 1.0e-3
    token_s: float = 6.0e-6
    seq_s: float = 2.0e-6
    attn_pair_s: float = 0.9e-9
    decode_ctx_s: float = 40e-9
    source: str = "provisional: hand-derived from H100 Qwen3-0.6B figures in BENCHMARKS.md"

    def step_seconds(self, num_tokens: int, num_sampled: int, attn_pairs: float, decode_context: int) -> float:
        """One step: `num_tokens` computed, `num_sampled` sequences sampled, `attn_pairs`
        prefill (query, key) pairs, `decode_context` tokens of KV read by the decodes."""
        return (self.base_s + self.token_s * num_tokens + self.seq_s * num_sampled
                + self.attn_pair_s * attn_pairs + self.decode_ctx_s * decode_context)

    def prefill_seconds(self, num_tokens: int, prefix_tokens: int) -> float:
        """The marginal cost of prefilling `num_tokens` after `prefix_tokens` already cached."""
        return self.token_s * num_tokens + self.attn_pair_s * num_tokens * (prefix_tokens + num_tokens / 2)

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
