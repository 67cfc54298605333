"""LLMEngine: schedule -> run -> sample -> update, one step at a time.

Not thread-safe: one thread owns an engine (the caller of `step`: LLM, the engine
process's loop, or the in-process engine client's thread).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from roseray.config import EngineConfig
from roseray.engine.block_manager import BlockManager
from roseray.engine.cpu_threads import limit_cpu_threads
from roseray.engine.detokenizer import find_stop_string, make_detokenizer, prepare_detokenization
from roseray.engine.kv_events import KVCacheSnapshot, KVEventBatch
from roseray.engine.limits import RequestLimits
from roseray.engine.model_runner import ModelRunner
from roseray.engine.outputs import EngineStats, RequestDelta
from roseray.engine.request import FINISH_REASONS, PLACEHOLDER, Request, RequestStatus
from roseray.engine.sampler import PendingSample, Sampler
from roseray.engine.scheduler import Scheduler, SchedulerOutput
from roseray.engine.structured_output import check_structured_outputs
from roseray.engine.structured_requests import PendingMask, StructuredOutputManager
from roseray.engine.tensor_parallel_workers import TensorParallelWorkers
from roseray.layers.kv_fp8 import kv_cache_dtype_name
from roseray.models.loader import load_model, load_model_config, resolve_max_model_len
from roseray.sampling_params import SamplingParams
from roseray.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class LaunchedStep:
    """A step whose forward is launched; `sample` once its sampling is too (in flight: the host
    has not processed its tokens yet)."""

    batch: SchedulerOutput
    logits: torch.Tensor  # [len(sampling), vocab] on the device
    argmax: torch.Tensor | None  # the logits' argmax when the forward computed it
    sampling: list[Request]  # requests that sample a token, in row order
    chunks: list[Request]  # requests the step computed a prefill chunk for without sampling
    output_index: list[int]  # where each sampled token goes in its request's output
    constrained: bool  # some sampling request has a grammar: its mask needs the previous step's tokens
    grammar_mask: PendingMask | None = None  # being filled by the grammar workers; joined when it samples
    sample: PendingSample | None = None


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        started = time.perf_counter()
        self.config = config
        self.device = config.resolve_device()
        limit_cpu_threads(self.device)
        torch.manual_seed(config.seed)
        self.model_config = load_model_config(config.model, revision=config.revision, load_format=config.load_format)
        self.dtype = config.resolve_dtype(self.model_config.torch_dtype, self.device)
        self.max_model_len = resolve_max_model_len(self.model_config, config)
        self.model_name = config.model
        self.tokenizer = load_tokenizer(config.tokenizer, self.model_config)
        self.detokenization = prepare_detokenization(self.tokenizer)  # now, not in the first request's step
        # tensor parallelism: the workers start now and load their shards beside this rank's
        self.tp_workers = TensorParallelWorkers(config) if config.tensor_parallel_size > 1 else None
        model = load_model(self.model_config, config.model, self.device, self.dtype, seed=config.seed,
                           load_format=config.load_format, quantization=config.quantization)
        self.runner = ModelRunner(config, self.model_config, model, self.device, self.dtype, self.max_model_len)
        if self.tp_workers is not None:
            self.tp_workers.attach(self.runner)
        self.block_manager = BlockManager(self.runner.num_blocks, config.block_size, config.max_num_seqs,
                                          self.runner.max_blocks_per_seq, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   self.max_model_len)
        self.sampler = Sampler(seed=config.seed)
        self.limits = RequestLimits(self.model_config.vocab_size, self.max_model_len, config.max_logprobs,
                                    self.block_manager.num_blocks, config.block_size)
        self.runner.warm_up()
        if self.device.type == "cuda":
            self.sampler.warm_up(self.runner.logits_for_warm_up())
        self.runner.capture_cuda_graphs()
        eos = self.model_config.eos_token_ids or [self.tokenizer.eos_token_id]
        self.eos_token_ids = frozenset(t for t in eos if t is not None)
        self.structured = StructuredOutputManager(self.tokenizer, self.model_config.vocab_size,
                                                  sorted(self.eos_token_ids), config.max_num_seqs, self.device,
                                                  config.reasoning_parser, config.resolve_grammar_workers())
        self.requests: dict[str, Request] = {}
        self._pending_deltas: list[RequestDelta] = []  # aborts to report on the next step
        self.last_error: BaseException | None = None
        self.overlap = config.async_scheduling if config.async_scheduling is not None else self.device.type == "cuda"
        self._in_flight: LaunchedStep | None = None  # sampled, not processed
        self._held: LaunchedStep | None = None  # a constrained step's forward, its sampling held to the next step
        self._num_penalty_requests = 0  # running requests whose sampling needs host-side history
        self._num_not_plain_greedy = 0  # requests that need more than an argmax of the logits
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.engine_steps_total = 0
        self.step_seconds_total = 0.0  # inside step()
        self.output_seconds_total = 0.0  # added by whoever sends the deltas on (the engine process's loop)
        self._log_startup(time.perf_counter() - started)

    def _log_startup(self, seconds: float) -> None:
        capacity = self.runner.num_blocks * self.config.block_size
        gib = self.runner.num_blocks * self.runner.bytes_per_block / 2**30
        mc = self.model_config
        logger.info("model %s (%s, %d layers, hidden %d, vocab %d) as %s on %s, attention backend %s, "
                    "loaded in %.1f s; detokenizing %s", self.model_name, mc.hf_architecture or mc.architecture,
                    mc.num_hidden_layers, mc.hidden_size, mc.vocab_size, str(self.dtype).removeprefix("torch."),
                    self.device, self.runner.backend.name, seconds, self.detokenization)
        logger.info("KV cache: %d blocks x %d = %d tokens (%.2f GiB, %s); max concurrency at max_model_len %d: "
                    "%.2fx; max_num_seqs %d, max_num_batched_tokens %d, prefix caching %s, CUDA graphs %s",
                    self.runner.num_blocks, self.config.block_size, capacity, gib,
                    kv_cache_dtype_name(self.runner.kv_cache_dtype), self.max_model_len,
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
        max_tokens = self.limits.check(token_ids, sampling_params)
        structured = sampling_params.structured_outputs
        if structured is not None:
            check_structured_outputs(structured)  # ValueError: the caller's 400
        req = Request(request_id, token_ids, sampling_params, prompt=prompt_text, eos_token_ids=self.eos_token_ids,
                      max_tokens=max_tokens, arrival_time=arrival_time)
        if stream_text or sampling_params.stop:
            req.detokenizer = make_detokenizer(self.tokenizer, token_ids, sampling_params.skip_special_tokens)
        self.requests[request_id] = req
        if structured is None:
            self.scheduler.add(req)
        else:  # scheduled once its grammar is compiled (on the compiler's thread)
            self.structured.add(req)
        if sampling_params.needs_penalties:
            self._num_penalty_requests += 1
        if not sampling_params.is_plain_greedy:
            self._num_not_plain_greedy += 1
        self.prompt_tokens_total += len(token_ids)
        return req

    def abort_request(self, request_id: str) -> None:
        req = self.requests.pop(request_id, None)
        if req is None:
            return
        if not self.structured.discard(req):
            self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
        self._finalize(req, RequestStatus.FINISHED_ABORTED)
        self._pending_deltas.append(self._delta(req, [], "", None, True))

    def has_unfinished_requests(self) -> bool:
        return (bool(self.requests) or bool(self._pending_deltas) or self._in_flight is not None
                or self._held is not None)

    def check_workers(self) -> float | None:
        """RuntimeError naming a tensor-parallel rank that exited (the engine's loop ends on it: every later
        step would fail); else how long an idle loop may wait before checking again (None: one rank)."""
        return None if self.tp_workers is None else self.tp_workers.check()

    def _admit_compiled(self, deltas: list[RequestDelta]) -> None:
        """Schedule the constrained requests whose grammar is ready; end those whose grammar failed."""
        idle = (not self.scheduler.running and not self.scheduler.waiting and self._in_flight is None
                and self._held is None)
        ready, failed = self.structured.take_compiled(wait=idle)
        for req in ready:
            self.scheduler.add(req)
        for req in failed:
            self.requests.pop(req.request_id, None)
            self._finalize(req, RequestStatus.FINISHED_ERROR)
            deltas.append(self._delta(req, [], "", None, True))

    # ---- the step ------------------------------------------------------------------------
    def step(self) -> list[RequestDelta]:
        """Schedule and launch the next batch, then process the results of the batch launched before it. With
        overlap on, the GPU runs batch N+1 while the host turns batch N's tokens into text and stop decisions;
        off, each batch is processed right after its own launch. A constrained batch samples through a grammar
        mask that needs batch N's tokens: its sampling is held to the next call (DESIGN.md)."""
        started = time.perf_counter()
        try:
            deltas = self._step()
        finally:  # a rank died and its group's abort left garbage (NCCL; rank_watchdog.py): fail, naming the rank
            if self.tp_workers is not None:
                self.tp_workers.watchdog.raise_if_void()
        self.engine_steps_total += 1
        self.step_seconds_total += time.perf_counter() - started
        return deltas

    def _step(self) -> list[RequestDelta]:
        deltas, self._pending_deltas = self._pending_deltas, []
        if self.structured.num_compiling:
            self._admit_compiled(deltas)
        in_flight, self._in_flight = self._in_flight, None
        held, self._held = self._held, None
        if in_flight is not None and not self._can_overlap():
            deltas += self._process(in_flight)
            in_flight = None
        if held is not None and (held.grammar_mask is None or held.grammar_mask.ready):  # sampled as we prepare
            in_flight, held = self._sample(held, deltas), None
        batch = self.scheduler.schedule()
        launch = self._prepare(batch, deltas) if batch else None
        if held is not None:  # a constrained step whose mask was still filling: sampled after this host work
            in_flight = self._sample(held, deltas)
            launch = launch if in_flight is not None else None  # failed, ending its requests: none run (rescheduled)
        forward = self._forward(batch, launch, in_flight, deltas) if launch is not None else None
        launched = None
        if forward is not None and not forward.constrained:
            launched = self._sample(forward, deltas)
        if in_flight is not None:  # (the grammar workers fill the forward's mask right behind the accept)
            deltas += self._process(in_flight, forward.sampling if forward is not None else None)
        if forward is not None and forward.constrained and (forward.chunks or
                                                            not all(r.is_finished for r in forward.sampling)):
            # Its grammars needed the tokens just processed: the mask is filled by the grammar workers
            # while the GPU runs its forward. With overlap its sampling is held to the next call, which
            # launches it first if the fill is done. (A step whose requests all finished samples nothing.)
            forward.grammar_mask = self.structured.mask(forward.sampling)
            if self.overlap:
                self._held = forward
            else:
                launched = self._sample(forward, deltas)
        if launched is not None and not self._can_overlap():
            deltas += self._process(launched)
            launched = None
        self._in_flight = launched
        return deltas

    def _can_overlap(self) -> bool:
        return self.overlap and self._num_penalty_requests == 0  # penalties need every sampled token on the host

    def _prepare(self, batch: SchedulerOutput, deltas: list[RequestDelta]):
        """The host's part of `batch`'s forward (runner.prepare_run); None if it failed."""
        try:
            return self.runner.prepare_run(batch, self.block_manager)
        except Exception as exc:  # end this step's requests, keep the engine
            self._step_failed(exc, batch.requests, deltas)
            return None

    def _forward(self, batch: SchedulerOutput, launch, in_flight: LaunchedStep | None,
                 deltas: list[RequestDelta]) -> LaunchedStep | None:
        """Launch `batch`'s forward on the device and advance every request as if its new token
        had arrived (a PLACEHOLDER until the results are processed); None if it failed (its
        requests are ended)."""
        reqs = batch.requests
        try:
            logits, sample_mask, argmax = launch(in_flight.sample.token_ids if in_flight else None)
            if sample_mask.all():  # decode steps: every request samples
                sampling, chunks = reqs, []
            else:
                mask = sample_mask.tolist()
                sampling = [r for r, m in zip(reqs, mask) if m]
                chunks = [r for r, m in zip(reqs, mask) if not m]
        except Exception as exc:  # the model failed: end this step's requests, keep the engine
            self._step_failed(exc, reqs, deltas)
            return None
        for req, num_new in zip(reqs, batch.num_new_tokens):
            req.num_computed_tokens += num_new
        output_index = []
        for row, req in enumerate(sampling):
            req.sample_row = row
            req.num_pending += 1
            output_index.append(len(req.output_token_ids))
            req.token_ids.append(PLACEHOLDER)
            req.output_token_ids.append(PLACEHOLDER)
        constrained = self.structured.num_requests > 0 and any(r.grammar is not None for r in sampling)
        return LaunchedStep(batch, logits, argmax, sampling, chunks, output_index, constrained)

    def _step_failed(self, exc: Exception, reqs: list[Request], deltas: list[RequestDelta]) -> None:
        logger.exception("engine step failed; finishing its %d requests with an error", len(reqs))
        self.last_error = exc
        deltas += self._fail(reqs)

    def _sample(self, forward: LaunchedStep, deltas: list[RequestDelta]) -> LaunchedStep | None:
        """Sample the forward's logits on the device, through its grammar mask if it has one."""
        sampling, mask = forward.sampling, forward.grammar_mask
        try:  # (the mask's fill is joined here)
            forward.sample = self.sampler.launch(forward.logits, sampling,
                                                 all_plain_greedy=self._num_not_plain_greedy == 0,
                                                 argmax=forward.argmax, grammar_mask=mask and mask.result())
        except Exception as exc:  # the sampler failed: end this step's requests, keep the engine
            self._step_failed(exc, [r for r in forward.batch.requests if not r.is_finished], deltas)
            return None
        if forward.constrained:  # requests may have finished since the forward: their tokens are dropped
            for req in sampling:
                if req.is_finished and req.sampling_params.seed is not None:
                    self.sampler.release(req)  # the generator the sampler made for it again
        return forward

    def _process(self, step: LaunchedStep, next_sampling: list[Request] | None = None) -> list[RequestDelta]:
        """A launched step's sampled tokens to request updates and deltas (the host's per-token hot
        loop: attribute reads and list writes). While the grammars take the tokens on their thread,
        a first pass does what needs no verdict of theirs; a second settles each row with them."""
        sampled = step.sample.result()
        accepting = self.structured.accept_step(step.sampling, sampled.token_ids, step.output_index,
                                                next_sampling) if self.structured.num_requests else None
        now, logprobs = time.monotonic(), sampled.logprobs
        max_model_len, finished_stopped = self.max_model_len, RequestStatus.FINISHED_STOPPED
        rows = []  # (request, token, new text, new logprobs, the engine's stop decision, its length now)
        for i, (req, token, index) in enumerate(zip(step.sampling, sampled.token_ids, step.output_index)):
            if req.status >= finished_stopped:
                continue  # aborted or stopped while this step ran: its token is dropped
            req.num_pending -= 1
            req.output_token_ids[index] = token
            num_prompt = req.num_prompt_tokens
            req.token_ids[num_prompt + index] = token
            if req.first_token_time is None:
                req.first_token_time = now
            req.last_token_time = now
            new_logprobs = None
            if logprobs is not None and req.logprobs is not None:
                new_logprobs = [logprobs[i]]
                req.logprobs.append(logprobs[i])
                req.cumulative_logprob += logprobs[i].get(token, 0.0)
            num_output = index + 1
            status = None
            if num_output >= req.max_tokens or token in req.stop_ids or num_prompt + num_output >= max_model_len:
                status = self._check_stop(req, token, num_output)
            new_text = "" if req.detokenizer is None else req.detokenizer.step_token(token)
            if new_text:
                if req.sampling_params.stop:
                    new_text, status = self._check_stop_strings(req, new_text, status)
                else:
                    req.output_text += new_text
            rows.append((req, token, new_text, new_logprobs, status, num_prompt + num_output))
        self.structured.settle(accepting)
        deltas, finished, statuses = [], [], []
        caching, block_size, commit = (self.config.enable_prefix_caching, self.config.block_size,
                                       self.block_manager.commit_full_blocks)
        for req, token, new_text, new_logprobs, status, length in rows:
            if (g := req.grammar) is not None and (g.terminated or g.failed) and not isinstance(req.stop_reason, str):
                status = self.structured.advance(req, status)  # its end or failure (a str reason: a stop string's)
            if status is not None:  # a token launched after the stop is dropped by _finalize
                finished.append(req)
                statuses.append(status)
                self._finalize(req, status)
            # every token up to this one is known now: publish the blocks it completes
            if caching and length // block_size > req.num_committed_blocks and req.status == RequestStatus.RUNNING:
                commit(req, length)
            deltas.append(RequestDelta(req.request_id, [token], new_text, status is not None, req.finish_reason,
                                       new_logprobs, req.num_prompt_tokens, len(req.output_token_ids), req))
        self.generation_tokens_total += len(deltas)
        if caching:
            for req in step.chunks:  # prefill chunks that sampled nothing
                if req.status == RequestStatus.RUNNING \
                        and req.num_computed_tokens // block_size > req.num_committed_blocks:
                    commit(req, len(req.token_ids) - req.num_pending)
        if finished:
            self.scheduler.finish_many(finished, statuses)
            for req in finished:
                del self.requests[req.request_id]
        return deltas

    def _check_stop(self, req: Request, token: int, num_output: int) -> RequestStatus | None:
        if num_output >= req.sampling_params.min_tokens:
            if token in req.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token in req.stop_token_ids:
                req.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if num_output >= req.max_tokens or req.num_prompt_tokens + num_output >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _check_stop_strings(self, req: Request, new_text: str, status: RequestStatus | None):
        """Append `new_text` to the output and cut it at the first stop string."""
        params = req.sampling_params
        text = req.output_text + new_text
        if len(req.output_token_ids) - req.num_pending >= params.min_tokens:
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
        if req.num_pending:  # tokens still in flight are dropped with the request
            del req.output_token_ids[len(req.output_token_ids) - req.num_pending:]
            del req.token_ids[len(req.token_ids) - req.num_pending:]
            req.num_pending = 0
        if req.sampling_params.needs_penalties:
            self._num_penalty_requests -= 1
        if not req.sampling_params.is_plain_greedy:
            self._num_not_plain_greedy -= 1
        if req.sampling_params.structured_outputs is not None:
            self.structured.release(req)
        if req.sampling_params.seed is not None:
            self.sampler.release(req)
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
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting) + self.structured.num_compiling,
            num_free_blocks=bm.num_free_blocks, num_total_blocks=bm.num_blocks, kv_cache_usage=bm.usage,
            prefix_cache_hits=bm.prefix_cache_hits, prefix_cache_queries=bm.prefix_cache_queries,
            num_preemptions_total=self.scheduler.num_preemptions_total,
            prompt_tokens_total=self.prompt_tokens_total, generation_tokens_total=self.generation_tokens_total,
            engine_steps_total=self.engine_steps_total, engine_step_seconds_total=self.step_seconds_total,
            engine_output_seconds_total=self.output_seconds_total)

    def drain_kv_events(self) -> KVEventBatch:
        """The prefix cache's changes since the last call (kv_events.py); the first call starts recording."""
        return self.block_manager.drain_kv_events()

    def kv_cache_snapshot(self) -> KVCacheSnapshot:
        """(epoch, seq, every cached chain hash): what a consumer that lost events resyncs from."""
        return self.block_manager.kv_cache_snapshot()

    def check_integrity(self) -> None:
        live = list(self.scheduler.running) + list(self.scheduler.waiting)
        self.block_manager.check_integrity(live)
        assert {r.request_id for r in live} | self.structured.compiling_ids() == set(self.requests), \
            "request table disagrees with the scheduler"
        self.structured.check_integrity(live, self.requests.values())
        params = [r.sampling_params for r in self.requests.values()]
        assert self._num_penalty_requests == sum(p.needs_penalties for p in params), "penalty count drifted"
        assert self._num_not_plain_greedy == sum(not p.is_plain_greedy for p in params), "sampling count drifted"
        assert self.sampler.seeded_request_ids() <= set(self.requests), "a finished request's generator is kept"
