"""What an engine can take: a request's checks against the model and the KV cache."""

from __future__ import annotations

from dataclasses import dataclass

from roseray.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """What an engine can take; checks a request before it is queued (the engine and every
    engine client run the same checks, so all refuse with the same message)."""

    vocab_size: int
    max_model_len: int
    max_logprobs: int
    num_blocks: int
    block_size: int

    def check(self, token_ids: list[int], params: SamplingParams) -> int:
        """Raise ValueError for a request that is invalid or can never fit; returns its max_tokens."""
        if not token_ids:
            raise ValueError("the prompt is empty: give at least one token")
        vocab = self.vocab_size
        bad = next((t for t in token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad} is outside the vocabulary [0, {vocab})")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(f"the prompt ({len(token_ids)} tokens) leaves no room for output within "
                             f"max_model_len ({self.max_model_len})")
        if params.logprobs is not None and params.logprobs > self.max_logprobs:
            raise ValueError(f"logprobs must be at most {self.max_logprobs}, got {params.logprobs}")
        max_tokens = params.max_tokens
        if max_tokens is None:
            max_tokens = self.max_model_len - len(token_ids)
        total = len(token_ids) + max_tokens
        if total > self.max_model_len:
            raise ValueError(f"prompt ({len(token_ids)} tokens) + max_tokens ({max_tokens}) = {total} tokens "
                             f"exceeds max_model_len ({self.max_model_len})")
        capacity = self.num_blocks * self.block_size  # whole blocks: fits iff its blocks do
        if total > capacity:
            raise ValueError(f"prompt ({len(token_ids)} tokens) + max_tokens ({max_tokens}) = {total} tokens can "
                             f"never fit in the KV cache ({capacity} tokens)")
        return max_tokens
