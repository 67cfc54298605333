"""StructuredOutputManager: the engine's constrained requests, from compile to their last token.

A constrained request waits here (not in the scheduler) while its grammar compiles on the
compiler's thread, so the engine keeps stepping; `take_compiled` hands over the ready ones
with their matcher attached (`Request.grammar`). Per step, `mask` fills the bitmask of the
constrained rows it samples; per processed token, `advance` moves the request's matcher and
turns the grammar's end into a stop ("stop") and a refused token into an error.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import wait as wait_futures

import torch

from roseray.engine.request import Request, RequestStatus
from roseray.engine.structured_output import (
    REASONING_MARKERS,
    GrammarBitmask,
    GrammarCompiler,
    RequestGrammar,
    accept_batch,
    reasoning_ended,
)

logger = logging.getLogger(__name__)

COMPILE_WAIT_S = 0.05  # an engine with nothing but grammars compiling waits this long for one, per step


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
            req.grammar = RequestGrammar(future.result(), self.compiler.stop_token_ids, end_marker)
            ready.append(req)
        return ready, failed

    def mask(self, sampling: list[Request]) -> tuple[torch.Tensor, list[int]] | None:
        """The step's grammar mask: (bitmask [R, words] on the device, the R sampling rows it is for);
        None when no row is constrained any more (a finished request has no grammar)."""
        rows = [i for i, req in enumerate(sampling) if req.grammar is not None]
        if not rows:
            return None
        return self.bitmask.fill([sampling[i].grammar for i in rows]), rows

    @staticmethod
    def accept_step(sampling: list[Request], token_ids: list[int], output_index: list[int]) -> None:
        """A processed step's tokens to the grammars of its live requests, before the engine's
        per-token loop (whose `advance` reads the outcome): the active ones take theirs in one
        batch; an inactive one (reasoning first) looks for the end marker, which the token at
        output_index[i] ends the output with."""
        grammars, tokens = [], []
        for req, token, index in zip(sampling, token_ids, output_index):
            grammar = req.grammar
            if grammar is None or req.status >= RequestStatus.FINISHED_STOPPED:
                continue
            if grammar.active:
                grammars.append(grammar)
                tokens.append(token)
            else:
                tail = req.output_token_ids[max(0, index + 1 - len(grammar.end_marker)):index] + [token]
                grammar.accept(token, tail, len(tail))
        accept_batch(grammars, tokens)

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
