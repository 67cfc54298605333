"""Logits processors: the stages that change a step's logits before a token is drawn
(grammar masks, penalties, min_tokens, top-k/top-p, min-p), each in place on a batch, and the host->device
copies they and the sampler share."""

from __future__ import annotations

import itertools

import numpy as np
import torch

from roseray.engine.request import Request


class PromptTokenCache:
    """Each penalised request's prompt token ids on the device, copied once, not every step.

    Only the requests of the latest call stay cached; one that comes back later is copied again.
    """

    def __init__(self) -> None:
        self._entries: dict[str, tuple[Request, torch.Tensor]] = {}

    def flat_prompt_ids(self, requests: list[Request], device: torch.device) -> torch.Tensor:
        """The requests' prompt ids, concatenated: [sum of prompt lengths] int64."""
        entries: dict[str, tuple[Request, torch.Tensor]] = {}
        for req in requests:
            entry = self._entries.get(req.request_id)
            if entry is None or entry[0] is not req:
                entry = (req, array_to_device(np.asarray(req.prompt_token_ids, dtype=np.int64), device))
            entries[req.request_id] = entry
        self._entries = entries
        return torch.cat([entries[req.request_id][1] for req in requests])


def apply_penalties(logits: torch.Tensor, requests: list[Request], rows: list[int],
                    prompt_cache: PromptTokenCache | None = None) -> None:
    """Repetition (prompt + output, HF semantics), then frequency and presence (output, OpenAI)."""
    device, vocab_size = logits.device, logits.shape[1]
    row_index = to_device(rows, torch.int64, device)
    penalised = logits.index_select(0, row_index)  # [P, V]
    output_ids = [r.output_token_ids for r in requests]
    output_counts = token_counts(_flat_ids(output_ids, device), [len(ids) for ids in output_ids], vocab_size)
    repetition = [r.sampling_params.repetition_penalty for r in requests]
    if any(value != 1.0 for value in repetition):
        prompt_lengths = [len(r.prompt_token_ids) if rp != 1.0 else 0 for r, rp in zip(requests, repetition)]
        repeating = [r for r, rp in zip(requests, repetition) if rp != 1.0]
        prompt_ids = (prompt_cache or PromptTokenCache()).flat_prompt_ids(repeating, device)
        seen = (token_counts(prompt_ids, prompt_lengths, vocab_size) + output_counts) > 0
        repetition_t = to_device(repetition, torch.float32, device).unsqueeze(1)
        scaled = torch.where(penalised > 0, penalised / repetition_t, penalised * repetition_t)
        penalised = torch.where(seen, scaled, penalised)
    frequency = to_device([r.sampling_params.frequency_penalty for r in requests], torch.float32, device)
    presence = to_device([r.sampling_params.presence_penalty for r in requests], torch.float32, device)
    penalised -= frequency.unsqueeze(1) * output_counts + presence.unsqueeze(1) * (output_counts > 0)
    logits.index_copy_(0, row_index, penalised)


def token_counts(flat_token_ids: torch.Tensor, lengths: list[int], vocab_size: int) -> torch.Tensor:
    """Occurrences of each token id per row: [len(lengths), vocab_size] float32.

    `flat_token_ids` holds the rows' ids one row after another, lengths[i] of them for row i.
    """
    device, num_rows, num_tokens = flat_token_ids.device, len(lengths), flat_token_ids.numel()
    counts = torch.zeros(num_rows * vocab_size, dtype=torch.float32, device=device)
    if num_tokens:
        row_ids = torch.repeat_interleave(torch.arange(num_rows, device=device),
                                          to_device(lengths, torch.int64, device), output_size=num_tokens)
        in_vocab = (flat_token_ids >= 0) & (flat_token_ids < vocab_size)  # ids beyond the logits count nowhere
        flat_index = row_ids * vocab_size + flat_token_ids.clamp(0, vocab_size - 1)
        counts.scatter_add_(0, flat_index, in_vocab.to(torch.float32))
    return counts.view(num_rows, vocab_size)


def _flat_ids(token_id_lists: list[list[int]], device: torch.device) -> torch.Tensor:
    num_tokens = sum(len(ids) for ids in token_id_lists)
    flat = np.fromiter(itertools.chain.from_iterable(token_id_lists), dtype=np.int64, count=num_tokens)
    return array_to_device(flat, device)


def mask_min_tokens(logits: torch.Tensor, requests: list[Request], rows: list[int]) -> None:
    """Rows still below min_tokens may not end: their EOS and stop token ids get -inf."""
    vocab_size = logits.shape[1]
    masked_rows: list[int] = []
    masked_token_ids: list[int] = []
    for row, req in zip(rows, requests):
        blocked = [t for t in req.eos_token_ids | req.stop_token_ids if t < vocab_size]
        masked_rows.extend([row] * len(blocked))
        masked_token_ids.extend(blocked)
    if masked_token_ids:
        index = (to_device(masked_rows, torch.int64, logits.device),
                 to_device(masked_token_ids, torch.int64, logits.device))
        blocked_logits = torch.full((len(masked_token_ids),), float("-inf"), device=logits.device)
        logits.index_put_(index, blocked_logits)


def apply_top_k_top_p(logits: torch.Tensor, top_ks: torch.Tensor | None, top_ps: torch.Tensor | None,
                      num_candidates: int) -> None:
    """Top-k, then nucleus (top-p) on what is left, in place, as value cutoffs per row.

    Top-p keeps the smallest run of most likely tokens whose probability reaches top_p
    (always the top token). Both filters mask by value (`logit < cutoff`), so ties with a
    cutoff are kept and the result does not depend on how a sort orders equal values.
    Only the `num_candidates` largest logits per row are sorted: that is every row's top-k
    when all rows have one (vocab size otherwise).
    """
    if num_candidates < logits.shape[1]:
        candidates = logits.topk(num_candidates, dim=-1).values  # [B, C], descending
    else:
        candidates = logits.sort(dim=-1, descending=True).values  # [B, V]
    if top_ks is not None:
        kth_value = candidates.gather(1, (top_ks - 1).unsqueeze(1))  # [B, 1]
        logits.masked_fill_(logits < kth_value, float("-inf"))
    if top_ps is None:
        return
    # Normalised over the row left by top-k (not over the candidates, which may hold more than
    # the row's k): the same probabilities whatever the candidate count of the batch.
    candidate_probs = (candidates - logits.logsumexp(dim=-1, keepdim=True)).exp()  # [B, C]
    mass_before = candidate_probs.cumsum(dim=-1) - candidate_probs  # probability ranked above each
    # >= 1: the top has 0 above, unless top_p itself rounds to 0 in float32 (top_p < 1.2e-38)
    num_kept = (mass_before < top_ps.unsqueeze(1)).sum(dim=-1, keepdim=True).clamp_(min=1)
    cutoff = candidates.gather(1, num_kept - 1)  # [B, 1]
    logits.masked_fill_(logits < cutoff, float("-inf"))


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """Grammar masks, in place: in logits row rows[i], the tokens whose bit in bitmask[i] (int32
    words, bit j of word w = token 32w + j) is clear get -inf, as do tokens past the mask. The
    reference of (and CPU path beside) the Triton kernel roseray_kernels.token_bitmask."""
    if bitmask.shape[0] == 0:
        return
    vocab_size = logits.shape[1]
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(2) >> shifts) & 1).flatten(1).bool()  # [R, 32 * W]
    if allowed.shape[1] < vocab_size:
        pad = torch.zeros(allowed.shape[0], vocab_size - allowed.shape[1], dtype=torch.bool, device=allowed.device)
        allowed = torch.cat([allowed, pad], dim=1)
    masked = logits.index_select(0, rows).masked_fill_(~allowed[:, :vocab_size], float("-inf"))
    logits.index_copy_(0, rows, masked)


def apply_min_p(probs: torch.Tensor, min_ps: torch.Tensor) -> None:
    """Drop tokens less likely than min_p times the row's most likely token."""
    threshold = min_ps.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)  # [B, 1]
    probs.masked_fill_(probs < threshold, 0.0)


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list as a tensor on `device`, without blocking the host on the GPU stream."""
    if device.type == "cpu":
        return torch.tensor(values, dtype=dtype)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def array_to_device(values: np.ndarray, device: torch.device) -> torch.Tensor:
    """Like to_device for a numpy array (numpy builds long token lists faster than torch.tensor)."""
    tensor = torch.from_numpy(values)
    if device.type == "cpu":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)
