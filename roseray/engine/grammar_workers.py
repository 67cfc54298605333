"""GrammarWorkers: the matchers of constrained requests, in worker processes.

xgrammar's batch accept costs ~11 us a row and a mask row's fill ~7 (one thread, a JSON schema,
a 134k vocabulary): 4 ms a step at 240 rows, on the path from one step's sampling to the next
one's. On a thread of the engine's process that work shared the GIL with the engine's own host
work, and threads split xgrammar's accept poorly (1.2-1.4x for two); processes split it fully.
So each worker process owns the matchers of its share of the requests (the least loaded one
takes a new request, once all are up) and, per step, takes its rows' tokens, then fills its rows
of the next mask straight into a shared buffer (two, used in turn) that the engine copies to the
device.

The engine side sends each worker one message a step and reads its replies, keyed by step:
`FILLED` before it samples through the mask; `ACCEPTED` (the slots whose token the grammar
refused) comes only when the step asked for the verdicts (a token sampled without a mask row for
it: the engine waits for them before it settles the step) or a token was refused (a matcher
cannot refuse a token its own mask allowed, so this one is not waited for). Whenever a reply is
read, its refusals and failures are marked on their requests' grammars, and a reply nobody
waits for is then dropped.
Messages are int32 arrays (a compiled grammar: xgrammar's own JSON); nothing is pickled. A worker
that fails a part of a step says so (`FAILED` with that part's slots and the error's line): those
requests end with an error, the engine goes on. A worker that dies takes its requests with it,
and is started again for the next one. Each worker also bounds its JSON requests' runs of
whitespace (WhitespaceTokens), from the tokens it takes.

Workers start with the first constrained request (their start, ~4 s of imports, overlaps its
compile), die with the engine's process (PDEATHSIG) and stop when the engine is collected.
"""

from __future__ import annotations

import itertools
import logging
import mmap
import multiprocessing as mp
import os
import signal
import weakref
from collections import OrderedDict
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_connections
from multiprocessing.shared_memory import SharedMemory

import numpy as np
import torch
import xgrammar as xgr

from roseray.engine.parent_death import die_with
from roseray.engine.structured_output import MAX_WHITESPACE, WhitespaceTokens, batch_accept_token, forbid_whitespace

logger = logging.getLogger(__name__)

# engine -> worker
GRAMMAR, DROP_GRAMMAR, MATCHER, FREE, STEP, STOP = range(6)
# worker -> engine
READY, ACCEPTED, FILLED, FAILED = range(4)
STOP_TIMEOUT_S = 5.0
# compiled grammars a worker keeps (~0.5-1 MB each with a 150k vocabulary): one evicted is sent again
MAX_WORKER_GRAMMARS = 64
HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context
SHM_DIR = "/dev/shm"  # where Linux keeps POSIX shared memory (SharedMemory's) as files


class WorkerError(RuntimeError):
    """A worker failed a step's part (its message) or died."""


class GrammarWorker:
    """The engine's handle on one worker process: its connection, its requests (slot -> the
    request's grammar), the grammars it holds and the replies read but not yet asked for."""

    def __init__(self, index: int, process, conn: Connection) -> None:
        self.index = index
        self.process = process
        self.conn = conn
        self.ready = False
        self.dead = False
        self.slots: dict[int, object] = {}
        self.grammar_ids: OrderedDict[int, None] = OrderedDict()  # what it holds, least recently used first
        self._received: dict[tuple[int, int], bytes | WorkerError] = {}  # (step, ACCEPTED / FILLED) -> reply

    def send(self, message: np.ndarray | bytes) -> None:
        if self.dead:
            return
        try:
            self.conn.send_bytes(message)
        except (OSError, EOFError):
            self._died()

    def send_step(self, step: int, turn: int, accepts: list[int], fills: list[int], verdicts: bool) -> None:
        """Step `step` (increasing): `accepts` are (slot, token) pairs, flat; `fills` (slot, mask
        row) pairs, flat, into mask buffer `turn`. The worker answers ACCEPTED (the refused slots) if
        `verdicts` or it refused one, then FILLED if there are fills."""
        message = np.empty(6 + len(accepts) + len(fills), dtype=np.int32)
        message[:6] = (STEP, step, turn, len(accepts) // 2, len(fills) // 2, verdicts)
        message[6:6 + len(accepts)] = accepts
        message[6 + len(accepts):] = fills
        self.send(message)

    def free(self, slot: int) -> None:
        """The request at `slot` finished: its matcher goes."""
        self.slots.pop(slot, None)
        self.send(np.array([FREE, slot], dtype=np.int32))

    def has_reply(self, step: int, kind: int) -> bool:
        """Step `step`'s reply `kind` is in (or the worker died): `reply` would not wait."""
        while (step, kind) not in self._received and not self.dead and self._poll():
            self._read()
        return (step, kind) in self._received or self.dead

    def reply(self, step: int, kind: int) -> np.ndarray:
        """Wait for step `step`'s reply `kind`; its int32 payload. Replies of earlier steps nobody
        asked for are dropped (what they said is marked already). Raises WorkerError if the worker
        failed that part or died (its requests' grammars are marked failed)."""
        while (step, kind) not in self._received:
            if self.dead:
                raise WorkerError(f"grammar worker {self.index} died")
            self._read()
        reply = self._received.pop((step, kind))
        for key in [key for key in self._received if key[0] < step]:
            del self._received[key]
        if isinstance(reply, WorkerError):
            raise reply
        return np.frombuffer(reply, dtype=np.int32)[2:]

    def check_ready(self) -> bool:
        while not self.ready and not self.dead and self._poll():
            self._read()
        return self.ready

    def _poll(self) -> bool:
        try:
            return self.conn.poll()
        except (OSError, EOFError):
            self._died()
            return False

    def _read(self) -> None:
        try:
            data = self.conn.recv_bytes()
        except (OSError, EOFError):
            self._died()
            return
        kind, step = np.frombuffer(data[:8], dtype=np.int32).tolist()  # every reply starts (kind, step)
        if kind == READY:
            self.ready = True
        elif kind == FAILED:  # (FAILED, step, part, n, the part's n slots, the error's line)
            part, n = np.frombuffer(data[8:16], dtype=np.int32).tolist()
            error = WorkerError(data[16 + 4 * n:].decode(errors="replace"))
            logger.error("%s; its %d constrained requests of step %d fail", error, n, step)
            self._fail(np.frombuffer(data[16:16 + 4 * n], dtype=np.int32).tolist())
            self._received[(step, part)] = error
        else:
            if kind == ACCEPTED and len(data) > 8:  # the slots whose token was refused
                self._fail(np.frombuffer(data[8:], dtype=np.int32).tolist())
            self._received[(step, kind)] = data

    def _fail(self, slots: list[int]) -> None:
        for slot in slots:
            grammar = self.slots.get(slot)
            if grammar is not None:
                grammar.failed = True

    def _died(self) -> None:
        if not self.dead:
            logger.error("grammar worker %d (pid %s) died; its %d constrained requests fail", self.index,
                         self.process.pid, len(self.slots))
            self._fail(list(self.slots))
        self.dead = True


class GrammarWorkers:
    """The worker processes and the shared mask buffers they fill ([2, max_rows, words] int32, pinned
    where the device is CUDA)."""

    def __init__(self, num_workers: int, max_rows: int, num_words: int, device: torch.device) -> None:
        self.num_workers = num_workers
        self.shape = (2, max_rows, num_words)
        self.device = device
        self.masks: torch.Tensor | None = None  # from `start` on
        self.workers: list[GrammarWorker] = []
        self._slots = itertools.count()
        self._start_args: tuple | None = None
        self._finalizer: weakref.finalize | None = None

    def start(self, tokenizer_info: xgr.TokenizerInfo) -> None:
        """Make the shared buffers and start every worker (they load in the background; `take` waits
        for none). Call once, off the engine's thread: serializing the tokenizer's info takes ~0.2 s
        for a 150k vocabulary, and pinning the buffers a few ms."""
        shm = SharedMemory(create=True, size=int(np.prod(self.shape)) * 4)
        masks = torch.from_numpy(np.ndarray(self.shape, dtype=np.int32, buffer=shm.buf))
        masks.fill_(-1)
        pinned = self.device.type == "cuda"
        if pinned:  # a non-blocking copy to the device needs page-locked memory
            with torch.cuda.device(self.device):
                torch.cuda.check_error(torch.cuda.cudart().cudaHostRegister(masks.data_ptr(), masks.nbytes,
                                                                            HOST_REGISTER_PORTABLE))
        self._shm, self.masks = shm, masks
        self._finalizer = weakref.finalize(self, _close, self.workers, shm, masks, pinned)
        self._start_args = (tokenizer_info.serialize_json(),)
        self.workers.extend(self._spawn(index) for index in range(self.num_workers))

    def _spawn(self, index: int) -> GrammarWorker:
        context = mp.get_context("spawn")
        ours, theirs = context.Pipe()
        process = context.Process(target=worker_main, name=f"roseray-grammar-{index}", daemon=True,
                                  args=(theirs, self._shm.name, self.shape, *self._start_args,
                                        os.getpid()))
        process.start()
        theirs.close()
        return GrammarWorker(index, process, ours)

    def wait_ready(self, timeout_s: float) -> None:
        """Wait up to `timeout_s` for the workers to be ready (an engine with nothing else to do)."""
        starting = [w.conn for w in self.workers if not w.check_ready() and not w.dead]
        if starting:
            wait_connections(starting, timeout=timeout_s)

    def take(self, grammar_id: int, serialized: str, bounds_whitespace: bool) -> tuple[GrammarWorker, int] | None:
        """A matcher of the compiled grammar for a new request, on the least loaded worker: (worker,
        slot); None while a worker is not ready yet. `bounds_whitespace`: the worker bounds the
        request's runs of whitespace (JSON with any whitespace). A dead worker is started again
        here; one that died before it was ever ready raises WorkerError (it would only die again)."""
        for i, worker in enumerate(self.workers):
            if worker.dead and not worker.ready:
                raise WorkerError(f"grammar worker {i} exited before it was ready (exit code "
                                  f"{worker.process.exitcode}); see its error above")
            if worker.dead and not worker.slots:
                worker.process.join(0)
                self.workers[i] = self._spawn(i)
        live = [w for w in self.workers if not w.dead]  # (a dead one with requests left: started again after)
        if not live or not all([w.check_ready() for w in live]):  # all: the first ready would take a whole burst
            return None
        worker = min(live, key=lambda w: len(w.slots))
        if grammar_id in worker.grammar_ids:
            worker.grammar_ids.move_to_end(grammar_id)
        else:
            worker.send(np.array([GRAMMAR, grammar_id], dtype=np.int32).tobytes() + serialized.encode())
            worker.grammar_ids[grammar_id] = None
            while len(worker.grammar_ids) > MAX_WORKER_GRAMMARS:  # its live matchers keep theirs
                dropped, _ = worker.grammar_ids.popitem(last=False)
                worker.send(np.array([DROP_GRAMMAR, dropped], dtype=np.int32))
        slot = next(self._slots)
        worker.send(np.array([MATCHER, slot, grammar_id, bounds_whitespace], dtype=np.int32))
        return worker, slot

    def close(self) -> None:
        """Stop the workers and free the buffers (also when the engine is collected)."""
        if self._finalizer is not None:
            self._finalizer()



def _close(workers: list[GrammarWorker], shm: SharedMemory, masks: torch.Tensor, pinned: bool) -> None:
    for worker in workers:
        try:  # (one stopped already, by multiprocessing's exit, has nothing to say)
            worker.conn.send_bytes(np.array([STOP], dtype=np.int32))
        except (OSError, EOFError):
            pass
    for worker in workers:
        worker.process.join(STOP_TIMEOUT_S)
        if worker.process.is_alive():
            worker.process.kill()
            worker.process.join(STOP_TIMEOUT_S)
        worker.conn.close()
    if pinned:
        torch.cuda.cudart().cudaHostUnregister(masks.data_ptr())
    try:
        shm.close()
    except BufferError:  # the engine's tensors still view it: the mapping goes with them
        pass
    shm.unlink()


# ---- the worker process ------------------------------------------------------------------------
def worker_main(conn: Connection, shm_name: str, mask_shape: tuple[int, int, int], tokenizer_info: str,
                parent: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the engine's to handle: it stops us
    die_with(parent)
    torch.set_num_threads(1)
    # mapped as a file, not through SharedMemory: that would register it with the engine's resource
    # tracker a second time, and the engine's unlink would then find it gone
    fd = os.open(os.path.join(SHM_DIR, shm_name), os.O_RDWR)
    try:
        buffer = mmap.mmap(fd, int(np.prod(mask_shape)) * 4)
    finally:
        os.close(fd)
    masks = torch.from_numpy(np.ndarray(mask_shape, dtype=np.int32, buffer=buffer))
    MatcherHost(conn, masks, xgr.TokenizerInfo.deserialize_json(tokenizer_info)).serve()


class MatcherHost:
    """A worker's loop: its matchers by slot, the compiled grammars they come from by id, and the
    run of whitespace that ends each bounded request's output (slot -> characters)."""

    def __init__(self, conn: Connection, masks: torch.Tensor, info: xgr.TokenizerInfo) -> None:
        self.conn = conn
        self.masks = masks
        self.info = info
        self.whitespace = WhitespaceTokens(info, info.vocab_size)
        self.grammars: dict[int, xgr.CompiledGrammar] = {}
        self.matchers: dict[int, xgr.GrammarMatcher] = {}
        self.runs: dict[int, int] = {}
        self.batch = xgr.BatchGrammarMatcher(max_threads=1)

    def serve(self) -> None:
        self._reply(READY)
        while True:
            try:
                data = self.conn.recv_bytes()
            except (OSError, EOFError):  # the engine went
                return
            if not self.handle(data):
                return

    def handle(self, data: bytes) -> bool:
        """One message from the engine; False for STOP."""
        op = int(np.frombuffer(data[:4], dtype=np.int32)[0])
        message = np.frombuffer(data, dtype=np.int32) if op != GRAMMAR else np.frombuffer(data[:8], dtype=np.int32)
        if op == STEP:
            self.step(message)
        elif op == MATCHER:
            grammar = self.grammars.get(int(message[2]))
            if grammar is not None:  # (else the slot is missing, and its first step fails)
                self.matchers[int(message[1])] = xgr.GrammarMatcher(grammar)
                if message[3]:
                    self.runs[int(message[1])] = 0
        elif op == FREE:
            self.matchers.pop(int(message[1]), None)
            self.runs.pop(int(message[1]), None)
        elif op == GRAMMAR:
            self.grammars[int(message[1])] = xgr.CompiledGrammar.deserialize_json(data[8:].decode(), self.info)
        elif op == DROP_GRAMMAR:
            self.grammars.pop(int(message[1]), None)
        else:
            return False
        return True

    def step(self, message: np.ndarray) -> None:
        step, turn, num_accepts, num_fills, verdicts = (int(v) for v in message[1:6])
        accepts = message[6:6 + 2 * num_accepts].reshape(-1, 2)
        fills = message[6 + 2 * num_accepts:].reshape(-1, 2)
        if num_accepts:
            slots, tokens = accepts[:, 0].tolist(), accepts[:, 1].tolist()
            try:
                accepted = batch_accept_token([self.matchers[s] for s in slots], tokens)
                refused = [s for s, ok in zip(slots, accepted) if not ok]
                if refused or verdicts:
                    self._reply(ACCEPTED, step, refused)
            except Exception as error:  # noqa: BLE001 - told to the engine, which fails these requests
                self._failed(step, ACCEPTED, slots, error)
            if self.runs:
                runs, chars = self.runs, self.whitespace.chars
                for slot, token in zip(slots, tokens):
                    if slot in runs:
                        runs[slot] = runs[slot] + chars[token] if chars[token] else 0
        if num_fills:
            slots, rows = fills[:, 0].tolist(), fills[:, 1].tolist()
            try:
                host = self.masks[turn]
                self.batch.batch_fill_next_token_bitmask([self.matchers[s] for s in slots], host, rows)
                runs = self.runs
                exhausted = [row for slot, row in zip(slots, rows) if runs.get(slot, 0) >= MAX_WHITESPACE]
                if exhausted:
                    forbid_whitespace(host, exhausted, self.whitespace.others)
                self._reply(FILLED, step)
            except Exception as error:  # noqa: BLE001 - told to the engine, which fails these requests
                self._failed(step, FILLED, slots, error)

    def _reply(self, kind: int, step: int = -1, payload: list[int] = ()) -> None:
        self.conn.send_bytes(np.array([kind, step, *payload], dtype=np.int32))

    def _failed(self, step: int, part: int, slots: list[int], error: BaseException) -> None:
        what = "the batch accept" if part == ACCEPTED else "the mask fill"
        line = f"grammar worker (pid {os.getpid()}): {what} failed: {type(error).__name__}: {error}"
        self.conn.send_bytes(np.array([FAILED, step, part, len(slots), *slots], dtype=np.int32).tobytes()
                             + line.encode())
