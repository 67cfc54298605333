"""LLMEngine: schedule -> run -> sample -> update, one step at a time.

Not thread-safe: one thread owns an engine (the caller of `step`, or the background
loop of AsyncLLMEngine).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from roseray.config import EngineConfig
from roseray.engine.block_manager import BlockManager
from roseray.engine.detokenizer import IncrementalDetokenizer, find_stop_string
from roseray.engine.model_runner import ModelRunner
from roseray.engine.request import FINISH_REASONS, Request, RequestDelta, RequestStatus
from roseray.engine.sampler import Sampler
from roseray.engine.scheduler import Scheduler
from roseray.models.loader import load_model, load_model_config
from roseray.sampling_params import SamplingParams
from roseray.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    kv_cache_usage: float
    prefix_cache_hits: int
    prefix_cache_queries: int
    num_preemptions_total: int
    prompt_tokens_total: int
    generation_tokens_total: int


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        started = time.perf_counter()
        self.config = config
        self.device = config.resolve_device()
        torch.manual_seed(config.seed)
        self.model_config = load_model_config(config.model, revision=config.revision)
        self.dtype = config.resolve_dtype(self.model_config.torch_dtype, self.device)
        self.max_model_len = self._resolve_max_model_len()
        self.model_name = config.model
        self.tokenizer = load_tokenizer(config.tokenizer, self.model_config)
        model = load_model(self.model_config, config.model, self.device, self.dtype, seed=config.seed)
        self.runner = ModelRunner(config, self.model_config, model, self.device, self.dtype, self.max_model_len)
        self.block_manager = BlockManager(self.runner.num_blocks, config.block_size, config.max_num_seqs,
                                          self.runner.max_blocks_per_seq, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens)
        self.sampler = Sampler(seed=config.seed)
        self.runner.warm_up()
        self.runner.capture_cuda_graphs()
        eos = self.model_config.eos_token_ids or [self.tokenizer.eos_token_id]
        self.eos_token_ids = frozenset(t for t in eos if t is not None)
        self.requests: dict[str, Request] = {}
        self._pending_deltas: list[RequestDelta] = []  # aborts to report on the next step
        self.last_error: BaseException | None = None
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self._log_startup(time.perf_counter() - started)

    def _resolve_max_model_len(self) -> int:
        limit = self.model_config.max_position_embeddings
        if self.config.max_model_len is None:
            return limit
        if self.config.max_model_len > limit:
            raise ValueError(f"max_model_len={self.config.max_model_len} exceeds the model's "
                             f"max_position_embeddings={limit}")
        return self.config.max_model_len

    def _log_startup(self, seconds: float) -> None:
        capacity = self.runner.num_blocks * self.config.block_size
        gib = self.runner.num_blocks * self.runner.bytes_per_block / 2**30
        mc = self.model_config
        logger.info("model %s (%s, %d layers, hidden %d, vocab %d) as %s on %s, attention backend %s, loaded in %.1f s",
                    self.model_name, mc.hf_architecture or mc.architecture, mc.num_hidden_layers, mc.hidden_size,
                    mc.vocab_size, str(self.dtype).removeprefix("torch."), self.device, self.runner.backend.name, seconds)
        logger.info("KV cache: %d blocks x %d = %d tokens (%.2f GiB); max concurrency at max_model_len %d: %.2fx; "
                    "max_num_seqs %d, max_num_batched_tokens %d, prefix caching %s, CUDA graphs %s",
                    self.runner.num_blocks, self.config.block_size, capacity, gib, self.max_model_len,
                    capacity / self.max_model_len, self.config.max_num_seqs, self.config.max_num_batched_tokens,
                    "on" if self.config.enable_prefix_caching else "off", "on" if self.runner.graphs else "off")

    @property
    def kv_capacity_tokens(self) -> int:
        return self.runner.num_blocks * self.config.block_size

    # ---- requests ----------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int], sampling_params: SamplingParams, *,
                    arrival_time: float | None = None, stream_text: bool = True) -> Request:
        """Queue a request. Raises ValueError for a request that is invalid or can never
        fit. With `stream_text=False` text is produced only at the end (offline use),
        unless stop strings need it earlier."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if isinstance(prompt, str):
            prompt_text, token_ids = prompt, self.tokenizer.encode(prompt)
        else:
            prompt_text, token_ids = None, [int(t) for t in prompt]
        self._validate_prompt(token_ids)
        max_tokens = sampling_params.max_tokens
        if max_tokens is None:
            max_tokens = self.max_model_len - len(token_ids)
        total = len(token_ids) + max_tokens
        if total > self.max_model_len:
            raise ValueError(f"prompt ({len(token_ids)} tokens) + max_tokens ({max_tokens}) = {total} tokens "
                             f"exceeds max_model_len ({self.max_model_len})")
        if self.block_manager.blocks_needed(total) > self.block_manager.num_blocks:
            raise ValueError(f"prompt ({len(token_ids)} tokens) + max_tokens ({max_tokens}) = {total} tokens can "
                             f"never fit in the KV cache ({self.kv_capacity_tokens} tokens)")
        req = Request(request_id, token_ids, sampling_params, prompt=prompt_text, eos_token_ids=self.eos_token_ids,
                      max_tokens=max_tokens, arrival_time=arrival_time)
        if stream_text or sampling_params.stop:
            req.detokenizer = IncrementalDetokenizer(self.tokenizer, token_ids, sampling_params.skip_special_tokens)
        self.requests[request_id] = req
        self.scheduler.add(req)
        self.prompt_tokens_total += len(token_ids)
        return req

    def _validate_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError("the prompt is empty: give at least one token")
        vocab = self.model_config.vocab_size
        bad = next((t for t in token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad} is outside the vocabulary [0, {vocab})")

    def abort_request(self, request_id: str) -> None:
        req = self.requests.pop(request_id, None)
        if req is None:
            return
        self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
        self._finalize(req, RequestStatus.FINISHED_ABORTED)
        self._pending_deltas.append(self._delta(req, [], "", None, True))

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or bool(self._pending_deltas)

    # ---- the step ------------------------------------------------------------------------
    def step(self) -> list[RequestDelta]:
        deltas, self._pending_deltas = self._pending_deltas, []
        batch = self.scheduler.schedule()
        if not batch:
            return deltas
        try:
            logits, sample_mask = self.runner.run(batch, self.block_manager)
            sampling = [r for r, m in zip(batch.requests, sample_mask.tolist()) if m]
            sampled = self.sampler(logits, sampling)
        except Exception as exc:  # the model or sampler failed: end this step's requests, keep the engine
            logger.exception("engine step failed; finishing its %d requests with an error", len(batch))
            self.last_error = exc
            return deltas + self._fail(batch.requests)

        commit = self.block_manager.commit_full_blocks
        for req, num_new in zip(batch.requests, batch.num_new_tokens):
            req.num_computed_tokens += num_new
            commit(req)
        now = time.monotonic()
        finished, statuses = [], []
        logprobs = sampled.logprobs
        for i, (req, token) in enumerate(zip(sampling, sampled.token_ids)):
            req.token_ids.append(token)
            req.output_token_ids.append(token)
            if req.first_token_time is None:
                req.first_token_time = now
            req.last_token_time = now
            new_logprobs = None
            if req.logprobs is not None and logprobs is not None:
                new_logprobs = [logprobs[i]]
                req.logprobs.append(logprobs[i])
                req.cumulative_logprob += logprobs[i].get(token, 0.0)
            status = self._check_stop(req, token)
            new_text = req.detokenizer.step([token]) if req.detokenizer is not None else ""
            if new_text and req.sampling_params.stop:
                new_text, status = self._check_stop_strings(req, new_text, status)
            elif new_text:
                req.output_text += new_text
            if status is not None:
                finished.append(req)
                statuses.append(status)
                self._finalize(req, status)
            deltas.append(self._delta(req, [token], new_text, new_logprobs, status is not None))
        self.generation_tokens_total += len(sampling)
        if finished:
            self.scheduler.finish_many(finished, statuses)
            for req in finished:
                del self.requests[req.request_id]
        return deltas

    def _check_stop(self, req: Request, token: int) -> RequestStatus | None:
        num_output = len(req.output_token_ids)
        if num_output >= req.sampling_params.min_tokens:
            if token in req.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token in req.stop_token_ids:
                req.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if num_output >= req.max_tokens or len(req.token_ids) >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _check_stop_strings(self, req: Request, new_text: str, status: RequestStatus | None):
        """Append `new_text` to the output and cut it at the first stop string."""
        params = req.sampling_params
        text = req.output_text + new_text
        if len(req.output_token_ids) >= params.min_tokens:
            match = find_stop_string(text, len(new_text), params.stop, params.include_stop_str_in_output)
            if match is not None:
                cut, stop = match
                req.stop_reason = stop
                new_text = new_text[: max(0, cut - len(req.output_text))]
                req.output_text = text[:cut]
                return new_text, RequestStatus.FINISHED_STOPPED
        req.output_text = text
        return new_text, status

    def _finalize(self, req: Request, status: RequestStatus) -> None:
        req.finish_reason = FINISH_REASONS[status]
        req.finished_time = time.monotonic()

    def _fail(self, reqs: list[Request]) -> list[RequestDelta]:
        deltas = []
        for req in reqs:
            self.requests.pop(req.request_id, None)
            self.scheduler.finish(req, RequestStatus.FINISHED_ERROR)
            self._finalize(req, RequestStatus.FINISHED_ERROR)
            deltas.append(self._delta(req, [], "", None, True))
        return deltas

    @staticmethod
    def _delta(req: Request, token_ids: list[int], text: str, logprobs, finished: bool) -> RequestDelta:
        return RequestDelta(req.request_id, token_ids, text, finished, req.finish_reason, logprobs,
                            req.num_prompt_tokens, len(req.output_token_ids), req)

    # ---- observability -----------------------------------------------------------------
    def get_stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            num_free_blocks=bm.num_free_blocks, num_total_blocks=bm.num_blocks, kv_cache_usage=bm.usage,
            prefix_cache_hits=bm.prefix_cache_hits, prefix_cache_queries=bm.prefix_cache_queries,
            num_preemptions_total=self.scheduler.num_preemptions_total,
            prompt_tokens_total=self.prompt_tokens_total, generation_tokens_total=self.generation_tokens_total)

    def check_integrity(self) -> None:
        live = list(self.scheduler.running) + list(self.scheduler.waiting)
        self.block_manager.check_integrity(live)
        assert {r.request_id for r in live} == set(self.requests), "request table disagrees with the scheduler"
