"""Batched sampling on the logits' device.

One call turns the last-position logits of a step (`[batch, vocab]`, row i belongs to
requests[i]) into one token per request. Order of work, each stage only when some row
needs it:

    grammar masks (the tokens a constrained request's grammar forbids get -inf)
    -> raw logprobs (log_softmax of the model's logits, vLLM's default)
    -> repetition, frequency, presence penalties
    -> min_tokens: EOS and stop token ids masked to -inf
    -> greedy rows: argmax
    -> temperature -> top-k -> top-p -> min-p -> exponential race (argmax(probs / Exp(1)))

Fast path (on CUDA): rows that need only greedy or plain temperature sampling (no filters,
penalties, min_tokens, logprobs or seed) are sampled by one Gumbel-max pass of Triton over
the logits (roseray_kernels.sampling: argmax(logits / T + Gumbel noise), the distribution of
the exponential race, no [B, V] temporaries), keyed by a seed drawn on the device from the
shared generator. Any other rows of the batch go through the full path above on their own
and are merged in before the one host copy.

The logits come in the model's dtype (bf16 on GPUs; GPT-2's compute_logits does not upcast):
greedy argmaxes and the Gumbel-max kernel read them as they are (upcasting bf16 to fp32 is
exact, so the index is the same), every other stage works on an fp32 copy.

Every per-request parameter becomes one tensor per call, built from a Python list and
copied host->device without blocking; the only device->host copy is the final `.tolist()`.
A seeded request draws its row's noise from its own generator (kept here by request id
until `release`), so its tokens do not depend on the batch it is in; unseeded rows share
the sampler's. The stages that change the logits live in logits_processors.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from roseray.engine.logits_processors import (
    PromptTokenCache,
    apply_min_p,
    apply_penalties,
    apply_token_bitmask,
    apply_top_k_top_p,
    mask_min_tokens,
    to_device,
)
from roseray.engine.request import Request
from roseray.layers import fused

SAMPLING_EPS = 1e-5  # temperatures below this sample greedily (dividing by them overflows)
SEED_MODULUS = 2**64  # torch generators take seeds in [0, 2**64)
# Batches of at least this many logits (rows x vocab) take the fused path by default: below it the
# fused path's extra host time per call outweighs what its kernels save (BENCHMARKS.md)
FUSED_MIN_ELEMENTS = 2**24


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]
    # per request: {token_id: logprob} for the top-N and the sampled token, sorted by
    # logprob (descending); None for requests without `logprobs`. None when no request asked.
    logprobs: list[dict[int, float] | None] | None = None
    # per request: logprob of the sampled token (for the cumulative logprob), or None.
    sampled_logprobs: list[float | None] | None = None


@dataclass(slots=True)
class BatchParams:
    """Per-row sampling parameters of one call, gathered from the requests once."""

    is_greedy: list[bool]
    temperatures: list[float]  # 1.0 on greedy rows
    top_ks: list[int]  # vocab size when off; 1 on greedy rows (unused there)
    top_ps: list[float]  # inf when off, so rounding in the cumulative sum never drops a token
    min_ps: list[float]
    penalty_rows: list[int]
    min_tokens_rows: list[int]  # rows still below min_tokens with EOS/stop ids to block
    logprob_rows: list[int]
    num_logprobs: list[int]  # top-N of each logprob row, aligned with logprob_rows
    seeded_rows: list[int]  # sampled (non-greedy) rows with a seed
    plain: list[bool]  # greedy or temperature alone: what the fused Gumbel-max kernel samples

    @classmethod
    def from_requests(cls, requests: list[Request], vocab_size: int) -> BatchParams:
        p = cls([], [], [], [], [], [], [], [], [], [], [])
        for row, req in enumerate(requests):
            sp = req.sampling_params
            greedy = sp.is_greedy or sp.temperature < SAMPLING_EPS
            p.is_greedy.append(greedy)
            p.temperatures.append(1.0 if greedy else sp.temperature)
            p.top_ks.append(1 if greedy else (min(sp.top_k, vocab_size) if sp.top_k >= 1 else vocab_size))
            p.top_ps.append(sp.top_p if sp.top_p < 1.0 and not greedy else float("inf"))
            p.min_ps.append(0.0 if greedy else sp.min_p)
            if sp.needs_penalties:
                p.penalty_rows.append(row)
            if len(req.output_token_ids) < sp.min_tokens and (req.eos_token_ids or req.stop_token_ids):
                p.min_tokens_rows.append(row)
            if sp.logprobs is not None:
                p.logprob_rows.append(row)
                p.num_logprobs.append(sp.logprobs)
            if sp.seed is not None and not greedy:
                p.seeded_rows.append(row)
            p.plain.append(not sp.needs_penalties and sp.logprobs is None
                           and (not p.min_tokens_rows or p.min_tokens_rows[-1] != row)
                           and (greedy or (sp.seed is None and p.top_ks[-1] == vocab_size
                                           and p.top_ps[-1] == float("inf") and p.min_ps[-1] == 0.0)))
        return p

    @property
    def all_greedy(self) -> bool:
        return all(self.is_greedy)

    @property
    def argmax_is_enough(self) -> bool:
        """Argmax of the raw logits is this step's whole answer: every row greedy, none
        penalised, asking for logprobs, or still below its min_tokens (the per-step form of
        SamplingParams.is_plain_greedy: a row past its min_tokens counts too)."""
        return (self.all_greedy and not self.penalty_rows and not self.min_tokens_rows
                and not self.logprob_rows)


class Sampler:
    """`Sampler()(logits [B, V], requests) -> SamplerOutput`; `seed` fixes the shared generator.

    `fused`: sample the plain rows with the Triton Gumbel-max kernel; None (the default) = when
    the logits are on CUDA and hold at least FUSED_MIN_ELEMENTS values. (On CPU the kernel runs
    only under TRITON_INTERPRET=1: tests.)
    """

    def __init__(self, seed: int | None = None, fused: bool | None = None) -> None:
        self.seed = seed
        self.fused = fused
        self._generators: dict[torch.device, torch.Generator] = {}
        self._request_generators: dict[str, torch.Generator] = {}  # seeded requests' own, by request id
        self._prompt_cache = PromptTokenCache()

    def warm_up(self, logits: torch.Tensor) -> None:
        """Compile the fused sampling kernels for every variant that batches of up to
        `logits.shape[0]` rows of logits like these (dtype, row stride) launch: Triton compiles at
        the first launch, which would otherwise stall the first steps that sample this way."""
        if not (logits.is_cuda and fused.HAVE_TRITON and self.fused is not False and logits.stride(1) == 1):
            return
        seed = torch.zeros(1, dtype=torch.int64, device=logits.device)
        for num_rows in fused.variant_row_counts(logits.shape[0], logits.shape[1]):
            temperatures = torch.ones(num_rows, dtype=torch.float32, device=logits.device)
            fused.gumbel_max_sample(logits[:num_rows], temperatures, seed)

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> SamplerOutput:
        return self.launch(logits, requests).result()

    def launch(self, logits: torch.Tensor, requests: list[Request], all_plain_greedy: bool = False,
               argmax: torch.Tensor | None = None,
               grammar_mask: tuple[torch.Tensor, list[int]] | None = None) -> PendingSample:
        """Sample on the device and start the copy of the results to the host; nothing
        waits for the GPU until `PendingSample.result()`. `all_plain_greedy`: the caller
        knows every request wants the argmax alone (skips gathering per-row parameters).
        `argmax`: the logits' argmax when the caller has it already (a decode step's forward
        computes it), int64 on the logits' device. `grammar_mask`: (bitmask [R, words] int32
        on the logits' device, the R rows it constrains): those rows' forbidden tokens get
        -inf in `logits` itself, before any other stage."""
        if logits.dim() != 2 or logits.shape[0] != len(requests):
            raise ValueError(f"logits must be [len(requests)={len(requests)}, vocab], got {tuple(logits.shape)}")
        if grammar_mask is not None:
            bitmask, rows = grammar_mask
            row_index = to_device(rows, torch.int64, logits.device)
            with torch.inference_mode():  # the model's logits are an inference tensor
                if fused.use_triton(logits) and logits.stride(1) == 1:
                    fused.apply_token_bitmask_(logits, bitmask, row_index)
                else:
                    apply_token_bitmask(logits, bitmask, row_index)
            argmax = None  # of the logits before the mask
        if all_plain_greedy:
            token_ids = logits.argmax(dim=-1) if argmax is None else argmax
            return PendingSample(token_ids, token_ids, None, None)
        params = BatchParams.from_requests(requests, logits.shape[1])
        if params.argmax_is_enough:
            token_ids = logits.argmax(dim=-1) if argmax is None else argmax
            return PendingSample(token_ids, token_ids, None, params)
        if self._uses_fused(logits) and any(params.plain):
            token_ids, raw_logprobs = self._sample_fused(logits, requests, params)
        else:
            token_ids, raw_logprobs = self._sample_full(logits, requests, params)
        packed, max_top_n = _pack(token_ids, raw_logprobs, params)
        return PendingSample(token_ids, packed, max_top_n, params)

    def _uses_fused(self, logits: torch.Tensor) -> bool:
        if self.fused is None:
            wanted = logits.is_cuda and logits.numel() >= FUSED_MIN_ELEMENTS
        else:
            wanted = self.fused
        return wanted and fused.HAVE_TRITON and logits.stride(1) == 1

    def _sample_full(self, logits: torch.Tensor, requests: list[Request],
                     params: BatchParams) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Every stage: token ids [B] int64 and the raw logprobs of the logprob rows, on the device."""
        raw_logprobs = _raw_logprobs(logits, params.logprob_rows)  # [num_logprob_rows, V] or None
        logits = logits.to(torch.float32, copy=True)  # [B, V], modified in place from here
        if params.penalty_rows:
            apply_penalties(logits, [requests[i] for i in params.penalty_rows], params.penalty_rows,
                            self._prompt_cache)
        if params.min_tokens_rows:
            mask_min_tokens(logits, [requests[i] for i in params.min_tokens_rows], params.min_tokens_rows)
        return self._sample(logits, requests, params), raw_logprobs

    def _sample_fused(self, logits: torch.Tensor, requests: list[Request],
                      params: BatchParams) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The Gumbel-max kernel over every row, then the full path on the other rows, merged in."""
        device = logits.device
        # The kernel's temperature: 0 = argmax (greedy rows, and the rows the full path overwrites).
        temperatures = [t if plain and not greedy else 0.0
                        for greedy, plain, t in zip(params.is_greedy, params.plain, params.temperatures)]
        seed = torch.randint(0, 2**62, (1,), dtype=torch.int64, device=device,
                             generator=self._shared_generator(device))
        token_ids = fused.gumbel_max_sample(logits, to_device(temperatures, torch.float32, device), seed)
        other_rows = [row for row, plain in enumerate(params.plain) if not plain]
        if not other_rows:
            return token_ids, None
        other_requests = [requests[row] for row in other_rows]
        row_index = to_device(other_rows, torch.int64, device)
        other_params = BatchParams.from_requests(other_requests, logits.shape[1])
        other_token_ids, raw_logprobs = self._sample_full(logits.index_select(0, row_index), other_requests,
                                                          other_params)
        token_ids.index_copy_(0, row_index, other_token_ids)
        # Every logprob row is among the other rows, in the same order: raw_logprobs lines up with params.
        return token_ids, raw_logprobs

    def _sample(self, logits: torch.Tensor, requests: list[Request], params: BatchParams) -> torch.Tensor:
        if params.all_greedy:
            return logits.argmax(dim=-1)
        device = logits.device
        greedy_token_ids = logits.argmax(dim=-1) if any(params.is_greedy) else None
        logits.div_(to_device(params.temperatures, torch.float32, device).unsqueeze(1))
        top_ks = to_device(params.top_ks, torch.int64, device) if _uses_top_k(params, logits.shape[1]) else None
        top_ps = to_device(params.top_ps, torch.float32, device) if _uses_top_p(params) else None
        if top_ks is not None or top_ps is not None:
            apply_top_k_top_p(logits, top_ks, top_ps, num_candidates=max(params.top_ks))
        probs = logits.softmax(dim=-1)  # [B, V]
        if any(min_p > 0.0 for min_p in params.min_ps):
            apply_min_p(probs, to_device(params.min_ps, torch.float32, device))
        noise = self._exponential_noise(probs, requests, params)
        sampled_token_ids = probs.div_(noise).argmax(dim=-1)
        if greedy_token_ids is None:
            return sampled_token_ids
        is_greedy = to_device(params.is_greedy, torch.bool, device)
        return torch.where(is_greedy, greedy_token_ids, sampled_token_ids)

    def _exponential_noise(self, probs: torch.Tensor, requests: list[Request], params: BatchParams) -> torch.Tensor:
        """Exp(1) noise per row: seeded rows from their request's generator, the rest shared."""
        noise = torch.empty_like(probs)  # [B, V]
        num_sampled_rows = len(params.is_greedy) - sum(params.is_greedy)
        if num_sampled_rows > len(params.seeded_rows):
            noise.exponential_(generator=self._shared_generator(probs.device))
        else:
            noise.fill_(1.0)
        for row in params.seeded_rows:
            noise[row].exponential_(generator=self._request_generator(requests[row], probs.device))
        # A zero draw would turn an excluded token's 0 probability into 0/0 = NaN, which argmax picks.
        return noise.clamp_min_(torch.finfo(noise.dtype).tiny)

    def _request_generator(self, request: Request, device: torch.device) -> torch.Generator:
        """The request's own generator, made on first use from sampling_params.seed."""
        generator = self._request_generators.get(request.request_id)
        if generator is None:
            generator = torch.Generator(device=device)
            generator.manual_seed(request.sampling_params.seed % SEED_MODULUS)
            self._request_generators[request.request_id] = generator
        return generator

    def release(self, request: Request) -> None:
        """The request is finished: forget its generator (its id may come again)."""
        self._request_generators.pop(request.request_id, None)

    def seeded_request_ids(self) -> set[str]:
        """The requests whose generators are kept (for the engine's integrity check)."""
        return set(self._request_generators)

    def _shared_generator(self, device: torch.device) -> torch.Generator:
        generator = self._generators.get(device)
        if generator is None:
            generator = torch.Generator(device=device)
            if self.seed is None:
                generator.seed()
            else:
                generator.manual_seed(self.seed % SEED_MODULUS)
            self._generators[device] = generator
        return generator


def _uses_top_k(params: BatchParams, vocab_size: int) -> bool:
    return any(k < vocab_size for k, greedy in zip(params.top_ks, params.is_greedy) if not greedy)


def _uses_top_p(params: BatchParams) -> bool:
    return any(p < 1.0 for p in params.top_ps)


def _raw_logprobs(logits: torch.Tensor, rows: list[int]) -> torch.Tensor | None:
    if not rows:
        return None
    row_index = to_device(rows, torch.int64, logits.device)
    return logits.index_select(0, row_index).to(torch.float32).log_softmax(dim=-1)  # [R, V]


class PendingSample:
    """Sampled token ids on the device (`token_ids`, for the next step's inputs) and
    their copy on the way to the host; `result()` waits for that copy only."""

    def __init__(self, token_ids: torch.Tensor, packed: torch.Tensor, max_top_n: int | None,
                 params: BatchParams | None) -> None:
        self.token_ids = token_ids  # [B] int64, on the device
        self._max_top_n, self._params = max_top_n, params
        if packed.is_cuda:
            self._host = packed.to("cpu", non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record()
        else:  # a copy: the tokens may be a view of a buffer the next step overwrites (decode_tokens)
            self._host, self._ready = packed.clone(), None

    def result(self) -> SamplerOutput:
        if self._ready is not None:
            self._ready.synchronize()
        values = self._host.tolist()
        if self._max_top_n is None:
            return SamplerOutput(token_ids=values)
        return _unpack(values, self._params, self._max_top_n)


def _pack(token_ids: torch.Tensor, raw_logprobs: torch.Tensor | None, params: BatchParams):
    """Everything the host needs in one tensor: token ids, and for logprob rows the sampled
    and top-N logprobs, packed into float64 (exact for token ids and float32 logprobs)."""
    if raw_logprobs is None:
        return token_ids, None
    max_top_n = min(max(params.num_logprobs), raw_logprobs.shape[1])
    row_index = to_device(params.logprob_rows, torch.int64, token_ids.device)
    sampled = raw_logprobs.gather(1, token_ids.index_select(0, row_index).unsqueeze(1)).squeeze(1)  # [R]
    top_values, top_token_ids = raw_logprobs.topk(max_top_n, dim=-1)  # [R, max_top_n], descending
    packed = torch.cat([token_ids.double(), sampled.double(),
                        top_values.double().flatten(), top_token_ids.double().flatten()])
    return packed, max_top_n


def _unpack(packed: list[float], params: BatchParams, max_top_n: int) -> SamplerOutput:
    batch_size, num_rows = len(params.is_greedy), len(params.logprob_rows)
    token_id_list = [int(t) for t in packed[:batch_size]]
    sampled_list = packed[batch_size:batch_size + num_rows]
    values_start = batch_size + num_rows
    ids_start = values_start + num_rows * max_top_n
    logprobs: list[dict[int, float] | None] = [None] * batch_size
    sampled_logprobs: list[float | None] = [None] * batch_size
    for j, (row, top_n) in enumerate(zip(params.logprob_rows, params.num_logprobs)):
        offset = j * max_top_n
        top_n = min(top_n, max_top_n)
        top_ids = packed[ids_start + offset:ids_start + offset + top_n]
        top_vals = packed[values_start + offset:values_start + offset + top_n]
        entry = {int(t): v for t, v in zip(top_ids, top_vals)}
        entry.setdefault(token_id_list[row], sampled_list[j])  # ranks below the top-N: last
        logprobs[row] = entry
        sampled_logprobs[row] = sampled_list[j]
    return SamplerOutput(token_ids=token_id_list, logprobs=logprobs, sampled_logprobs=sampled_logprobs)
