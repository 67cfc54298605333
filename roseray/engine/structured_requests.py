"""StructuredOutputManager: the engine's constrained requests, from compile to their last token.

A constrained request waits here (not in the scheduler) while its grammar compiles on the
compiler's thread, so the engine keeps stepping; `take_compiled` hands over the ready ones
with their matcher attached (`Request.grammar`). Per step, `mask` fills the bitmask of the
constrained rows it samples; `accept_step` gives the matchers a processed step's tokens, and
per token `advance` turns the grammar's end into a stop ("stop") and a refused token into an
error.

The matchers' work runs on one grammar thread, in order: xgrammar's batch accept and batch
fill release the GIL, so the engine's thread meanwhile does its own Python work: the step's
text and stop checks while the tokens are accepted, then, while the next step's mask is
filled right behind the accept, settling the step and scheduling and preparing the one after.
The engine joins a task where it needs its result: `settle` before it reads the verdicts,
`PendingMask.result` just before it samples through the mask. One thread at a time calls
into the matchers: that thread's tasks run in order, and the engine's thread fills a mask
itself (`mask(inline=True)`: it samples at once, nothing to overlap) or touches a grammar's
flags only once the last task is done; dropping a finished request's grammar (`release`)
leaves a running task its own reference.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from concurrent.futures import FIRST_COMPLETED, Executor, Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass

import torch

from roseray.engine.request import Request, RequestStatus
from roseray.engine.structured_output import (
    REASONING_MARKERS,
    GrammarBitmask,
    GrammarCompiler,
    RequestGrammar,
    accept_batch,
    bounds_whitespace,
    reasoning_ended,
)

logger = logging.getLogger(__name__)

COMPILE_WAIT_S = 0.05  # an engine with nothing but grammars compiling waits this long for one, per step
GRAMMAR_THREAD = "grammar-matcher"  # the name (prefix) of the thread the matchers run on


@dataclass(slots=True)
class PendingAccept:
    """A step's tokens being taken by its active grammars on the grammar thread."""

    future: Future
    grammars: list[RequestGrammar]


@dataclass(slots=True)
class PendingMask:
    """A step's grammar mask being filled on the grammar thread, for these sampling rows."""

    future: Future  # of the filled pinned host rows
    bitmask: GrammarBitmask
    rows: list[int]
    grammars: list[RequestGrammar]  # the rows'
    opened: list[int]  # mask rows whose request finished after the fill: all tokens allowed, as for no mask

    @property
    def ready(self) -> bool:
        """The fill is done (or failed): `result` would not wait."""
        return self.future.done()

    def result(self) -> tuple[torch.Tensor, list[int]] | None:
        """(bitmask [R, words] on the device, its R rows): waits for the fill and queues the copy
        on this thread. If the grammar engine failed, it is logged here, the rows sample
        unconstrained (None) and their requests end with an error when the token is processed
        (`advance`): the step and the engine go on."""
        try:
            host = self.future.result()
        except Exception:  # noqa: BLE001 - whatever xgrammar raised ends these requests, not the engine
            logger.exception("the grammar engine failed to fill a step's mask; its %d constrained requests fail",
                             len(self.grammars))
            for grammar in self.grammars:
                grammar.failed = True
            return None
        for j in self.opened:
            host[j].fill_(-1)
        return self.bitmask.to_device(host), self.rows


@dataclass(slots=True)
class _EarlyFill:
    """A mask filled right behind a step's accept, for the sampling rows of the step after it
    that were constrained then (`mask` keeps those still constrained once the step is settled)."""

    sampling: list[Request]
    rows: list[int]
    grammars: list[RequestGrammar]
    future: Future


def _started(started: threading.Event, fn, *args):
    started.set()
    return fn(*args)


class StructuredOutputManager:
    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int], max_rows: int, device: torch.device,
                 reasoning_parser: str | None = None) -> None:
        self.compiler = GrammarCompiler(tokenizer, vocab_size, stop_token_ids)
        self.bitmask = GrammarBitmask(max_rows, vocab_size, device)
        self.reasoning_markers = None  # (start, end) token ids of the reasoning, with a reasoning parser
        if reasoning_parser is not None:
            start, end = REASONING_MARKERS[reasoning_parser]
            self.reasoning_markers = (tokenizer.encode(start, add_special_tokens=False),
                                      tokenizer.encode(end, add_special_tokens=False))
        self._compiling: dict[str, tuple[Request, Future]] = {}
        self.num_requests = 0  # live constrained requests, compiled or not
        # the one thread that runs the matchers (any Executor that runs tasks in order will do)
        self.executor: Executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=GRAMMAR_THREAD)
        self._last_task: Future | None = None
        self._early_fill: _EarlyFill | None = None

    @property
    def num_compiling(self) -> int:
        return len(self._compiling)

    def compiling_ids(self) -> set[str]:
        return set(self._compiling)

    def add(self, req: Request) -> None:
        self._compiling[req.request_id] = (req, self.compiler.submit(req.sampling_params.structured_outputs))
        self.num_requests += 1

    def discard(self, req: Request) -> bool:
        """Forget a request still compiling (aborted); False if it is not."""
        return self._compiling.pop(req.request_id, None) is not None

    def take_compiled(self, wait: bool) -> tuple[list[Request], list[Request]]:
        """(requests whose grammar is ready, with their matcher; requests whose grammar failed).
        `wait`: the engine has nothing else to do, so wait a little for one rather than spin."""
        if wait:
            wait_futures([future for _, future in self._compiling.values()], timeout=COMPILE_WAIT_S,
                         return_when=FIRST_COMPLETED)
        ready, failed = [], []
        for request_id, (req, future) in list(self._compiling.items()):
            if not future.done():
                continue
            del self._compiling[request_id]
            error = future.exception()
            if error is not None:
                logger.warning("request %s: its grammar failed to compile: %s", request_id, error)
                failed.append(req)
                continue
            end_marker = None
            if self.reasoning_markers is not None:
                start, end = self.reasoning_markers
                end_marker = None if reasoning_ended(req.prompt_token_ids, start, end) else end
            whitespace = self.compiler.whitespace if bounds_whitespace(req.sampling_params.structured_outputs) else None
            req.grammar = RequestGrammar(future.result(), self.compiler.stop_token_ids, end_marker, whitespace)
            ready.append(req)
        return ready, failed

    def mask(self, sampling: list[Request], inline: bool = False) -> PendingMask | None:
        """The step's grammar mask, being filled on the grammar thread for the constrained rows
        it samples (after the tokens of the steps before, which that thread took first); None when
        no row is constrained any more (a finished request has no grammar). A fill `accept_step`
        started for these rows is used, with the rows of requests finished since opened (no mask
        on them, as if they were left out). `inline`: the caller samples at once, so there is
        nothing to overlap and the fill runs here, sparing the hand-over."""
        rows = [i for i, req in enumerate(sampling) if req.grammar is not None]
        early, self._early_fill = self._early_fill, None
        if not rows:
            return None
        if early is not None and early.sampling is sampling:
            live = set(rows)
            opened = [j for j, i in enumerate(early.rows) if i not in live]
            return PendingMask(early.future, self.bitmask, early.rows, early.grammars, opened)
        grammars = [sampling[i].grammar for i in rows]
        future = self._run_here(self.bitmask.fill_host, grammars) if inline else \
            self._submit(self.bitmask.fill_host, grammars)
        return PendingMask(future, self.bitmask, rows, grammars, [])

    def accept_step(self, sampling: list[Request], token_ids: list[int], output_index: list[int],
                    next_sampling: list[Request] | None = None) -> PendingAccept | None:
        """A processed step's tokens to the grammars of its live requests, before the engine's
        per-token loop (`settle`, then `advance`, read the outcome): the active ones take theirs
        in one batch on the grammar thread; an inactive one (reasoning first) looks here for the
        end marker, which the token at output_index[i] ends the output with. `next_sampling`:
        the sampling rows of the step launched after this one, whose mask (`mask`) the grammar
        thread then fills right away."""
        if self._last_task is not None:  # the flags written below are the last task's to read
            wait_futures([self._last_task])
        grammars, tokens = [], []
        for req, token, index in zip(sampling, token_ids, output_index):
            grammar = req.grammar
            if grammar is None or grammar.failed or req.status >= RequestStatus.FINISHED_STOPPED:
                continue  # (failed: its mask's fill did, and the request ends with this token)
            if grammar.active:
                grammars.append(grammar)
                tokens.append(token)
            else:
                tail = req.output_token_ids[max(0, index + 1 - len(grammar.end_marker)):index] + [token]
                grammar.accept(token, tail, len(tail))
        accepting = PendingAccept(self._submit(accept_batch, grammars, tokens), grammars) if grammars else None
        if next_sampling is not None:
            rows = [i for i, req in enumerate(next_sampling) if req.grammar is not None]
            if rows:
                next_grammars = [next_sampling[i].grammar for i in rows]
                future = self._submit(self.bitmask.fill_host, next_grammars, wait_start=accepting is None)
                self._early_fill = _EarlyFill(next_sampling, rows, next_grammars, future)
        return accepting

    @staticmethod
    def settle(accepting: PendingAccept | None) -> None:
        """Wait until the step's grammars took its tokens. If the grammar engine failed, it is
        logged here and the step's constrained requests end with an error (`advance`); the
        engine goes on."""
        if accepting is None:
            return
        try:
            accepting.future.result()
        except Exception:  # noqa: BLE001 - whatever xgrammar raised ends these requests, not the engine
            logger.exception("the grammar engine failed on a step's tokens; its %d constrained requests fail",
                             len(accepting.grammars))
            for grammar in accepting.grammars:
                grammar.failed = True

    def _run_here(self, fn, *args) -> Future:
        """fn(*args) on this thread, once the grammar thread is idle, as a done future."""
        if self._last_task is not None:
            wait_futures([self._last_task])
        future = Future()
        try:
            future.set_result(fn(*args))
        except Exception as error:  # noqa: BLE001 - raised where the result is read, as from the thread
            future.set_exception(error)
        return future

    def _submit(self, fn, *args, wait_start: bool = True) -> Future:
        """fn(*args) on the grammar thread; `wait_start`: returns once it has started (the thread
        is idle). A thread needs the GIL to start, which a busy engine thread would keep for up to
        the interpreter's switch interval (5 ms), a step's whole overlap. (A task queued behind
        another starts when the engine thread waits for that one, or sooner.)"""
        if not wait_start:
            self._last_task = self.executor.submit(fn, *args)
            return self._last_task
        started = threading.Event()
        self._last_task = self.executor.submit(_started, started, fn, *args)
        started.wait()
        return self._last_task

    @staticmethod
    def advance(req: Request, status: RequestStatus | None) -> RequestStatus | None:
        """What the request's grammar made of its newest token (accept_step): the grammar's end
        is a stop, a token it refused an error; otherwise `status` (the engine's own checks) stands."""
        grammar = req.grammar
        if grammar.failed:
            logger.error("request %s: its grammar refused a sampled token", req.request_id)
            return RequestStatus.FINISHED_ERROR
        if grammar.terminated:
            return RequestStatus.FINISHED_STOPPED
        return status

    def release(self, req: Request) -> None:
        """The request finished."""
        self._compiling.pop(req.request_id, None)
        req.grammar = None
        self.num_requests -= 1

    def check_integrity(self, live: list[Request], requests: Iterable[Request]) -> None:
        assert self.num_requests == sum(r.sampling_params.structured_outputs is not None for r in requests), \
            "constrained request count drifted"
        assert all(r.grammar is not None for r in live if r.sampling_params.structured_outputs is not None), \
            "a scheduled constrained request has no matcher"

    def close(self) -> None:
        self.compiler.close()
        self.executor.shutdown(wait=False, cancel_futures=True)
