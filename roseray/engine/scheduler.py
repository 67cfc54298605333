"""Continuous batching: which requests run this step, and how many tokens each.

Order of a step, within `max_num_batched_tokens`:
1. decodes of running requests (one token each), oldest first;
2. the next chunk of running requests still in prefill;
3. new requests from the waiting queue, FCFS, as chunks (a long prompt is split across
   steps and mixed with running decodes, which keeps the tail inter-token latency flat).
When the KV blocks run out, the newest running request is preempted by recompute: its
blocks are freed and it goes back to the front of the waiting queue.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from roseray.engine.block_manager import BlockManager
from roseray.engine.request import Request, RequestStatus


@dataclass
class SchedulerOutput:
    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)  # per request, tokens computed this step
    num_preempted: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __len__(self) -> int:
        return len(self.requests)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int) -> None:
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the last is the newest
        self.num_preemptions_total = 0
        self._step = 0  # stamps `Request.scheduled_step`

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def schedule(self) -> SchedulerOutput:
        self._step += 1
        step, out = self._step, SchedulerOutput()
        budget = self.max_num_batched_tokens
        block_size, max_model_len = self.block_manager.block_size, self.max_model_len
        prefilling: list[Request] = []

        # 1. decodes of running requests, oldest first (the common case: no allocation)
        running_status = RequestStatus.RUNNING
        scheduled, num_new_tokens = out.requests, out.num_new_tokens
        for req in list(self.running):  # a copy: _reserve may preempt
            if req.status != running_status:
                continue  # preempted earlier in this loop
            num_tokens = len(req.token_ids)
            num_computed = req.num_computed_tokens
            if num_tokens - num_computed > 1:
                prefilling.append(req)
                continue
            if len(req.output_token_ids) >= req.max_tokens or num_tokens >= max_model_len:
                continue  # its last token is being sampled by the step in flight
            if budget == 0:
                break
            if num_computed >= req.num_blocks * block_size and not self._reserve(req, 1, out):
                continue
            req.scheduled_step = step
            scheduled.append(req)
            num_new_tokens.append(1)
            budget -= 1

        # 2. the next chunk of running requests still in prefill
        for req in prefilling:
            if budget == 0:
                break
            if req.status != RequestStatus.RUNNING:
                continue
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            if not self._reserve(req, num_new, out):
                continue
            req.scheduled_step = step
            out.requests.append(req)
            out.num_new_tokens.append(num_new)
            budget -= num_new

        # 3. waiting requests, FCFS; none are admitted in a step that had to preempt.
        while self.waiting and budget > 0 and not out.num_preempted and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            if not self.block_manager.allocate_prefix(req, budget):
                break
            self.waiting.popleft()
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            req.status = RequestStatus.RUNNING
            req.scheduled_step = step
            if req.first_scheduled_time is None:  # the end of its queue time (a preempted one keeps the first)
                req.first_scheduled_time = time.monotonic()
            self.running.append(req)
            out.requests.append(req)
            out.num_new_tokens.append(num_new)
            budget -= num_new
        return out

    def _reserve(self, req: Request, num_new: int, out: SchedulerOutput) -> bool:
        """Find blocks for `num_new` tokens of `req`, preempting the newest running
        requests not yet scheduled this step if needed. False if `req` cannot run now
        (it may have been preempted itself)."""
        while not self.block_manager.append_slots(req, num_new):
            victim = next((r for r in reversed(self.running) if r.scheduled_step != self._step), None)
            if victim is None:
                return False
            self._preempt(victim)
            out.num_preempted += 1
            if victim is req:
                return False
        return True

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.block_manager.free(req)
        req.status = RequestStatus.WAITING
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.appendleft(req)

    def finish(self, req: Request, status: RequestStatus) -> None:
        """Take a request out of scheduling for good and free its blocks."""
        self.finish_many([req], [status])

    def finish_many(self, reqs: list[Request], statuses: list[RequestStatus]) -> None:
        """Finish several requests at once (one pass over `running`)."""
        done = {id(r) for r in reqs if r.status == RequestStatus.RUNNING}
        if done:
            self.running = [r for r in self.running if id(r) not in done]
        for req, status in zip(reqs, statuses):
            if req.status == RequestStatus.WAITING:  # queued, or preempted while its last token was in flight
                self.waiting.remove(req)
            self.block_manager.release(req)
            req.status = status
