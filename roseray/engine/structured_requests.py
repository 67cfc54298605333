"""StructuredOutputManager: the engine's constrained requests, from compile to their last token.

A constrained request waits here (not in the scheduler) while its grammar compiles on the
compiler's thread, so the engine keeps stepping; `take_compiled` hands over the ready ones with
a matcher on a grammar worker process (grammar_workers.py) and its engine side attached
(`Request.grammar`). Per step, `accept_step` sends each worker its rows' tokens and, with the
sampling rows of the step launched after it, the fill of that step's mask right behind them;
`settle` waits for the verdicts only when a token was sampled without a mask row filled for it
(a matcher never refuses a token its mask allowed; a refusal read later still fails its request);
`mask` gives the step's mask (`PendingMask.result` waits for the workers' fills and copies it to
the device once, on a CUDA stream of its own: beside the forward still running). Per token
`advance` turns the grammar's end into a stop ("stop") and a failure into an error.

The engine's thread does no matcher work: the workers accept and fill while it processes the
step's tokens, settles the step and schedules and prepares the next one. What the engine needs
per token without a round trip it keeps itself (RequestGrammar): the grammar ends exactly when
its matcher accepts a stop token. Its per-row work is one pass over a step's rows to send the
tokens and one to plan the next mask's fill.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass

import torch

from roseray.engine.grammar_workers import ACCEPTED, FILLED, GrammarWorker, GrammarWorkers, WorkerError
from roseray.engine.request import Request, RequestStatus
from roseray.engine.structured_output import (
    REASONING_MARKERS,
    GrammarCompiler,
    RequestGrammar,
    bounds_whitespace,
    reasoning_ended,
)

logger = logging.getLogger(__name__)

COMPILE_WAIT_S = 0.05  # an engine with nothing but grammars compiling waits this long for one, per step


@dataclass(slots=True)
class PendingAccept:
    """A step's tokens being taken by its active grammars on their workers, some of them sampled
    without a mask row for them (`unmasked`): their verdicts are waited for."""

    step: int
    workers: list[GrammarWorker]
    unmasked: bool


@dataclass(slots=True)
class PendingMask:
    """A step's grammar mask being filled by the workers, for these sampling rows."""

    step: int
    workers: list[GrammarWorker]  # those filling rows of it
    host: torch.Tensor  # [len(rows), words]: the rows of a shared buffer
    rows: list[int]
    grammars: list[RequestGrammar]  # the rows'
    opened: list[int]  # mask rows whose request finished after the fill: all tokens allowed, as for no mask
    device: torch.device
    copy_stream: torch.cuda.Stream | None  # CUDA: the copy runs beside the forward still on the device

    @property
    def ready(self) -> bool:
        """The fill is done (or failed): `result` would not wait."""
        return all(worker.has_reply(self.step, FILLED) for worker in self.workers)

    def result(self) -> tuple[torch.Tensor, list[int]]:
        """(bitmask [R, words] on the device, its R rows): waits for the fills and queues the copy on
        the copy stream (CUDA), which the current stream then waits for: the copy overlaps whatever
        that stream still runs (the forward), and the sampling that reads the mask follows it. A worker
        that failed its rows is logged here, its rows sample unconstrained and their requests end
        with an error when the token is processed (`advance`): the step goes on."""
        for worker in self.workers:
            try:
                worker.reply(self.step, FILLED)
            except WorkerError:  # (logged as it was read, its requests' grammars marked failed)
                self.opened.extend(j for j, grammar in enumerate(self.grammars) if grammar.worker is worker)
        for j in self.opened:
            self.host[j].fill_(-1)
        if self.copy_stream is None:
            return self.host.clone(), self.rows
        with torch.cuda.stream(self.copy_stream):
            bitmask = self.host.to(self.device, non_blocking=True)
        sampling_stream = torch.cuda.current_stream(self.device)
        sampling_stream.wait_stream(self.copy_stream)
        bitmask.record_stream(sampling_stream)  # freed only once the sampling that reads it ran
        return bitmask, self.rows


@dataclass(slots=True)
class _EarlyFill:
    """A mask filled right behind a step's accept, for the sampling rows of the step after it
    that were constrained then (`mask` keeps those still constrained once the step is settled)."""

    sampling: list[Request]
    mask: PendingMask
    released: list[RequestGrammar]  # grammars of requests finished since


class StructuredOutputManager:
    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int], max_rows: int, device: torch.device,
                 reasoning_parser: str | None = None, num_workers: int = 1) -> None:
        self.compiler = GrammarCompiler(tokenizer, vocab_size, stop_token_ids)
        self.workers = GrammarWorkers(num_workers, max_rows, (vocab_size + 31) // 32, device)
        self.device = device
        self.copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.reasoning_markers = None  # (start, end) token ids of the reasoning, with a reasoning parser
        if reasoning_parser is not None:
            start, end = REASONING_MARKERS[reasoning_parser]
            self.reasoning_markers = (tokenizer.encode(start, add_special_tokens=False),
                                      tokenizer.encode(end, add_special_tokens=False))
        self._compiling: dict[str, tuple[Request, Future]] = {}
        self.num_requests = 0  # live constrained requests, compiled or not
        self._starting: Future | None = None  # the workers' start, on the compiler's thread
        self._step = 0  # numbers the messages to the workers
        self._turn = 0  # the shared mask buffer the next mask is filled in
        self._early_fill: _EarlyFill | None = None
        self._released: list[RequestGrammar] = []  # grammars of requests finished since the last fill was planned

    @property
    def num_compiling(self) -> int:
        return len(self._compiling)

    def compiling_ids(self) -> set[str]:
        return set(self._compiling)

    def add(self, req: Request) -> None:
        if self._starting is None:  # the first constrained request: the workers load while it compiles
            self._starting = self.compiler.run_in_background(self.workers.start, self.compiler.info)
        self._compiling[req.request_id] = (req, self.compiler.submit(req.sampling_params.structured_outputs))
        self.num_requests += 1

    def discard(self, req: Request) -> bool:
        """Forget a request still compiling (aborted); False if it is not."""
        return self._compiling.pop(req.request_id, None) is not None

    def take_compiled(self, wait: bool) -> tuple[list[Request], list[Request]]:
        """(requests whose grammar is ready, with their matcher on a worker; requests whose grammar
        failed). `wait`: the engine has nothing else to do, so wait a little for one rather than spin."""
        if wait:
            waiting = [future for _, future in self._compiling.values()]
            if not self._starting.done():
                waiting.append(self._starting)
            wait_futures(waiting, timeout=COMPILE_WAIT_S, return_when=FIRST_COMPLETED)
        ready, failed = [], []
        start_error = self._starting.exception() if self._starting.done() else None
        for request_id, (req, future) in list(self._compiling.items()):
            if not future.done():
                continue
            error = future.exception()
            if error is not None or start_error is not None:
                del self._compiling[request_id]
                if error is not None:
                    logger.warning("request %s: its grammar failed to compile: %s", request_id, error)
                else:
                    logger.error("request %s: the grammar workers failed to start: %s", request_id, start_error)
                failed.append(req)
                continue
            if not self._starting.done():
                break
            compiled = future.result()
            try:
                placed = self.workers.take(compiled.grammar_id, compiled.serialized,
                                           bounds_whitespace(req.sampling_params.structured_outputs))
            except WorkerError as error:
                del self._compiling[request_id]
                logger.error("request %s: no grammar worker for it: %s", request_id, error)
                failed.append(req)
                continue
            if placed is None:  # no worker is ready yet
                if wait:
                    self.workers.wait_ready(COMPILE_WAIT_S)
                break
            del self._compiling[request_id]
            end_marker = None
            if self.reasoning_markers is not None:
                start, end = self.reasoning_markers
                end_marker = None if reasoning_ended(req.prompt_token_ids, start, end) else end
            worker, slot = placed
            req.grammar = worker.slots[slot] = RequestGrammar(worker, slot, self.compiler.stop_token_ids, end_marker)
            ready.append(req)
        return ready, failed

    def mask(self, sampling: list[Request]) -> PendingMask | None:
        """The step's grammar mask, being filled by the workers for the constrained rows it samples
        (after the tokens of the steps before, which they took first); None when no row is
        constrained any more (a finished request has no grammar). A fill `accept_step` started for
        these rows is used, with the rows of requests finished since opened (no mask on them, as if
        they were left out)."""
        early, self._early_fill = self._early_fill, None
        if early is not None and early.sampling is sampling:
            mask = early.mask
            grammars = mask.grammars
            mask.opened = [j for g in early.released if (j := g.mask_row) < len(grammars) and grammars[j] is g]
            if len(mask.opened) < len(mask.rows):
                return mask
        if early is not None:
            self._drop(early.mask)
        fills: list[list[int]] = [[] for _ in self.workers.workers]
        self._step += 1
        mask = self._plan_fill(sampling, fills)
        if mask is not None:
            for worker, worker_fills in zip(self.workers.workers, fills):
                if worker_fills:
                    worker.send_step(self._step, self._turn, [], worker_fills, False)
        return mask

    def accept_step(self, sampling: list[Request], token_ids: list[int], output_index: list[int],
                    next_sampling: list[Request] | None = None) -> PendingAccept | None:
        """A processed step's tokens to the grammars of its live requests, before the engine's
        per-token loop (`settle`, then `advance`, read the outcome): the active ones' workers take
        theirs in one batch each; an inactive one (reasoning first) looks here for the end marker,
        which the token at output_index[i] ends the output with. `next_sampling`: the sampling
        rows of the step launched after this one, whose mask (`mask`) the workers then fill."""
        if self._early_fill is not None:  # no step sampled through it (its requests all finished)
            self._drop(self._early_fill.mask)
            self._early_fill = None
        self._step += 1
        workers = self.workers.workers
        accepts: list[list[int]] = [[] for _ in workers]  # per worker (by index): slot, token, ...
        fills: list[list[int]] = [[] for _ in workers]  # per worker: slot, mask row, ...
        unmasked = False
        finished_stopped = RequestStatus.FINISHED_STOPPED
        for req, token, index in zip(sampling, token_ids, output_index):
            grammar = req.grammar
            if grammar is None or grammar.failed or req.status >= finished_stopped:
                continue  # (failed: its mask's fill did, and the request ends with this token)
            if grammar.active:
                plan = accepts[grammar.worker.index]
                plan.append(grammar.slot)
                plan.append(token)
                grammar.took(token)
                if not grammar.masked:
                    unmasked = True
                grammar.masked = False
            else:
                tail = req.output_token_ids[max(0, index + 1 - len(grammar.end_marker)):index] + [token]
                grammar.look_for_end(tail, len(tail))
        filling = [w for w, a in zip(workers, accepts) if a]
        accepting = PendingAccept(self._step, filling, unmasked) if filling else None
        if next_sampling is not None:
            mask = self._plan_fill(next_sampling, fills)
            if mask is not None:
                self._early_fill = _EarlyFill(next_sampling, mask, self._released)
        for worker, worker_accepts, worker_fills in zip(workers, accepts, fills):
            if worker_accepts or worker_fills:
                worker.send_step(self._step, self._turn, worker_accepts, worker_fills, unmasked)
        return accepting

    def _plan_fill(self, sampling: list[Request], fills: list[list[int]]) -> PendingMask | None:
        """Add the fill of `sampling`'s constrained rows to the workers' fills (by worker index), in
        the next shared buffer (two, used in turn: a step's copy may still be queued when the next one
        fills); a row whose grammar does not constrain (inactive, ended, failed) allows every token.
        None if no row is constrained."""
        rows, grammars, unconstrained = [], [], []
        for i, req in enumerate(sampling):
            grammar = req.grammar
            if grammar is None:
                continue
            j = grammar.mask_row = len(rows)
            rows.append(i)
            grammars.append(grammar)
            if grammar.active and not grammar.terminated and not grammar.failed:
                plan = fills[grammar.worker.index]
                plan.append(grammar.slot)
                plan.append(j)
                grammar.masked = True
            else:
                unconstrained.append(j)
        if not rows:
            return None
        self._turn ^= 1
        self._released = []
        host = self.workers.masks[self._turn][:len(rows)]
        for j in unconstrained:
            host[j].fill_(-1)
        filling = [w for w, f in zip(self.workers.workers, fills) if f]
        return PendingMask(self._step, filling, host, rows, grammars, [], self.device, self.copy_stream)

    @staticmethod
    def _drop(mask: PendingMask) -> None:
        """Wait out a fill nobody samples through: the engine writes rows of the same buffer two
        fills later, and a worker that took no part in the fill between could still be in this one."""
        for worker in mask.workers:
            try:
                worker.reply(mask.step, FILLED)
            except WorkerError:
                pass

    @staticmethod
    def settle(accepting: PendingAccept | None) -> None:
        """Wait until the step's grammars took its tokens, when one was sampled without a mask row
        for it: a refused token, or a worker that failed, ends its request with an error (`advance`);
        the engine goes on. Otherwise the verdicts are read with the workers' next replies."""
        if accepting is None or not accepting.unmasked:
            return
        for worker in accepting.workers:
            try:
                worker.reply(accepting.step, ACCEPTED)
            except WorkerError:  # (logged as it was read, its requests' grammars marked failed)
                pass

    @staticmethod
    def advance(req: Request, status: RequestStatus | None) -> RequestStatus | None:
        """What the request's grammar made of its newest token (accept_step): the grammar's end
        is a stop, a token it refused an error; otherwise `status` (the engine's own checks) stands."""
        grammar = req.grammar
        if grammar.failed:
            logger.error("request %s: its grammar refused a sampled token or its worker failed", req.request_id)
            return RequestStatus.FINISHED_ERROR
        if grammar.terminated:
            return RequestStatus.FINISHED_STOPPED
        return status

    def release(self, req: Request) -> None:
        """The request finished: its matcher goes (after any step its worker is still on)."""
        self._compiling.pop(req.request_id, None)
        if req.grammar is not None:
            req.grammar.worker.free(req.grammar.slot)
            self._released.append(req.grammar)
        req.grammar = None
        self.num_requests -= 1

    def check_integrity(self, live: list[Request], requests: Iterable[Request]) -> None:
        assert self.num_requests == sum(r.sampling_params.structured_outputs is not None for r in requests), \
            "constrained request count drifted"
        assert all(r.grammar is not None for r in live if r.sampling_params.structured_outputs is not None), \
            "a scheduled constrained request has no matcher"

    def close(self) -> None:
        self.compiler.close()
        self.workers.close()
