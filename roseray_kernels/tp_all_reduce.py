"""A one-shot all-reduce over symmetric memory that a host thread can abort (2..8 GPUs, NVLink).

Every rank holds a symmetric buffer that every other rank can read and write through its own
pointer to it (torch's `torch.distributed._symmetric_memory`: `empty` + `rendezvous` map each
rank's allocation into every rank's address space), and each buffer comes with a signal pad of
int32 slots that peers signal into. One launch per call, the same grid on every rank; program p
of every rank handles the same slice of the tensor (blocks p, p + grid, p + 2 grid, ...):

  (a) copy its slice of x into its own buffer;
  (b) barrier with program p of every peer: signal each peer (slot [p, my_rank] of the peer's
      pad, a system-scope release) and wait for each peer's signal (slot [p, peer] of my pad,
      a system-scope acquire), so that the peers' copies of the slice are visible;
  (c) sum the slice of every rank's buffer (rank order, fp32) and store it, rounded, to out.

Signals are consumed: a signal is a compare-and-swap 0 -> 1 on the receiver's slot (retried while
the slot still holds the previous call's unconsumed 1), and the receiver's wait is a compare-and-
swap 1 -> 0. So each slot holds at most one pending signal, and after a call completes on every
rank every slot used is 0 again: the pads need no reset, and a CUDA graph of the call replays any
number of times.

One barrier per call, not two (a second one would keep a rank from overwriting its buffer while
a peer still reads it): the buffer has two halves and call k uses half k % 2 (`state` holds the
parity of the calls made, the same on every rank, for every rank makes the same calls). A rank
can only reach call k + 2, the next write into the half its peers read in call k, after its call
k + 1's barrier, which needs every peer's call k + 1 to have started, which happens after the
peer's call k ended (a stream runs its kernels one after the other). The last program to finish
flips the parity; every program reads it before it counts itself finished, so all programs of a
call agree on the half. tp_all_reduce_norm.py's fused kernel shares the protocol and the state.

Abort: every wait also reads an abort flag, every POLL_EVERY spins, and returns once it is set
(the output is then garbage; the caller raises). The flag lives in pinned host memory that the
kernel reads through its device-mapped address (Triton's launcher resolves a pinned tensor's
device pointer): a host thread sets it with a plain store, no CUDA call, so that nothing it does
queues behind the kernel that waits (a copy into device memory would, on the waiting stream, and
may on another behind the device's work). The kernel reads it with a volatile load (system scope,
past the caches), so the host's store is seen; the reads cross PCIe, hence only every POLL_EVERY
spins, which a barrier whose peers arrive within microseconds never reaches. A kernel that waits
on a live peer is ended by the flag just the same (the group is dead either way).

The grid is at most one program per SM (`max_programs`): program p of a rank waits for program p
of every peer, so every program of the launch must be able to be resident at once, or a rank's
waiting programs could keep its peer's from ever starting.

Rounding: bf16 inputs are summed in fp32 in rank order and rounded once, which on two ranks is
what NCCL's sum gives (one add); fp32 likewise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

DTYPES = (torch.bfloat16, torch.float32)
BLOCK_BYTES = 8192  # the bytes of x one program moves per step of its loop (16 B per thread and load)
NUM_WARPS = 8
POLL_EVERY = 256  # spins of a wait between two reads of the abort flag (host memory, over PCIe)
PARITY = tl.constexpr(0)  # the int32 slots of `state`: the parity of the calls made (which half is this call's),
FINISHED = tl.constexpr(1)  # and the programs of the current call that have finished


@dataclass(frozen=True)
class PeerBuffers:
    """What the kernel needs of a group's symmetric memory, every pointer fixed for the group's life
    (so that CUDA graphs capture the calls).

    buffer_ptrs: int64 [world_size] on the device, the address of each rank's buffer (two halves of
    half_bytes each, this rank's at index rank); signal_pad_ptrs: int64 [world_size] likewise, each
    rank's pad of at least max_programs * world_size int32 slots, all 0 before the first call;
    state: int32 [2] on the device, zeros at first (see PARITY, FINISHED); abort_flag: int32 [1] in
    pinned host memory, 0 until the host aborts."""

    rank: int
    world_size: int
    buffer_ptrs: torch.Tensor
    signal_pad_ptrs: torch.Tensor
    half_bytes: int
    state: torch.Tensor
    abort_flag: torch.Tensor
    max_programs: int


def signal_pad_bytes(max_programs: int, world_size: int) -> int:
    """The bytes of a rank's signal pad the kernel uses: one int32 slot per program and peer."""
    return max_programs * world_size * 4


def takes(x: torch.Tensor, peers: PeerBuffers) -> bool:
    """x is a tensor the kernel reduces: float32 or bfloat16, contiguous, nbytes a multiple of 16, no
    more than half the buffer."""
    return x.dtype in DTYPES and x.is_contiguous() and x.nbytes % 16 == 0 and 0 < x.nbytes <= peers.half_bytes


def one_shot_all_reduce(x: torch.Tensor, peers: PeerBuffers) -> torch.Tensor:
    """The sum over the ranks of x (a new tensor); every rank calls it with the same shape and dtype,
    in the same order relative to its other calls."""
    if not takes(x, peers):
        raise ValueError(f"one_shot_all_reduce takes a contiguous float32/bfloat16 tensor of a multiple of 16 bytes "
                         f"up to {peers.half_bytes} bytes, got {x.dtype} {tuple(x.shape)}")
    out = torch.empty_like(x)
    block = BLOCK_BYTES // x.element_size()
    grid = min(triton.cdiv(x.numel(), block), peers.max_programs)
    _one_shot_all_reduce_kernel[(grid,)](
        x, out, peers.buffer_ptrs, peers.signal_pad_ptrs, peers.state, peers.abort_flag,
        x.nbytes // 16, peers.half_bytes // x.element_size(),
        RANK=peers.rank, WORLD=peers.world_size, WORLD_P2=triton.next_power_of_2(peers.world_size),
        VECTOR=16 // x.element_size(), BLOCK=block, POLL_EVERY=POLL_EVERY, THREADS=NUM_WARPS * 32, num_warps=NUM_WARPS)
    return out


def all_reduce_reference(xs: list[torch.Tensor]) -> torch.Tensor:
    """What the kernel returns for the ranks' tensors `xs` (rank order): the fp32 sum, rounded once."""
    total = torch.zeros_like(xs[0], dtype=torch.float32)
    for x in xs:
        total += x.float()
    return total.to(xs[0].dtype)


@triton.jit
def _swap_until_done(slots, pending, EXPECTED: tl.constexpr, DESIRED: tl.constexpr, SEM: tl.constexpr,
                     abort_ptr, POLL_EVERY: tl.constexpr, THREADS: tl.constexpr):
    """Compare-and-swap EXPECTED -> DESIRED (system scope, SEM order) on each lane of `slots` that is
    `pending`, again and again on the lanes that fail, until every lane has succeeded once: 0 then;
    or the abort flag's value (not 0) once it is seen set. A lane that is not pending compares with
    -1, which no slot ever holds: it writes nothing (its slot must still be a valid address). Every
    thread of the program sees the same results (Triton hands each atomic's result to all threads
    through shared memory), so all of them leave the loop together."""
    aborted = tl.zeros([], dtype=tl.int32)
    spins = 0
    while (tl.max(pending.to(tl.int32), axis=0) != 0) & (aborted == 0):
        old = tl.atomic_cas(slots, tl.where(pending, EXPECTED, -1), tl.full(slots.shape, DESIRED, tl.int32),
                            sem=SEM, scope="sys")
        pending = pending & (old != EXPECTED)
        spins += 1
        if spins % POLL_EVERY == 0:
            aborted = _abort_flag(abort_ptr, THREADS)
    return aborted


@triton.jit
def _abort_flag(abort_ptr, THREADS: tl.constexpr):
    """The abort flag as one value for the whole program. Every thread reads it (volatile: system scope,
    from host memory, no cache), and threads may read it either side of the host's store; the max
    across them (through shared memory) is what every thread then goes by, for threads that disagree
    would part ways at the next bar.sync."""
    flags = tl.load(abort_ptr + tl.zeros([THREADS], dtype=tl.int32), volatile=True)
    return tl.max(flags, axis=0)


@triton.jit
def barrier_with_peers(signal_pad_ptrs, abort_ptr, slot, RANK: tl.constexpr, WORLD: tl.constexpr,
                        WORLD_P2: tl.constexpr, POLL_EVERY: tl.constexpr, THREADS: tl.constexpr):
    """Program `slot` of this rank meets program `slot` of every peer: everything this program's
    threads wrote before is visible to the peers' programs after, and theirs to this one. Returns
    the abort flag's value if it was seen set (the barrier then did not complete), else 0."""
    tl.debug_barrier()  # every thread's writes (the copy-in) come before the release below
    lane = tl.arange(0, WORLD_P2)  # one lane per rank, padded to a power of two
    is_peer = (lane < WORLD) & (lane != RANK)
    lane_rank = tl.where(is_peer, lane, RANK)  # the lanes that are no peer stand on my own pad
    pads = tl.load(signal_pad_ptrs + lane_rank).to(tl.pointer_type(tl.int32))
    my_pad = tl.load(signal_pad_ptrs + RANK).to(tl.pointer_type(tl.int32))
    # slot [slot, RANK] of each peer's pad is mine to signal; the same slot of my own pad, where the
    # lanes that are no peer point, is never signalled by anyone
    signal_slots = pads + slot * WORLD + RANK
    wait_slots = my_pad + slot * WORLD + lane_rank  # [slot, peer]: each peer's signal to me
    aborted = _swap_until_done(signal_slots, is_peer, 0, 1, "release", abort_ptr, POLL_EVERY, THREADS)
    if aborted == 0:
        aborted = _swap_until_done(wait_slots, is_peer, 1, 0, "acquire", abort_ptr, POLL_EVERY, THREADS)
    tl.debug_barrier()  # no thread reads the peers' buffers before the acquire above
    return aborted


@triton.jit(do_not_specialize=["num_vectors"])  # one compile for every size (numel's alignment is VECTOR's)
def _one_shot_all_reduce_kernel(
    x_ptr,  # [numel] this rank's tensor
    out_ptr,  # [numel] the sum
    buffer_ptrs,  # int64 [WORLD]: each rank's symmetric buffer (two halves of half_elements)
    signal_pad_ptrs,  # int64 [WORLD]: each rank's signal pad, int32 slots [program, rank]
    state_ptr,  # int32 [2]: PARITY (calls made, mod 2), FINISHED (programs of this call done)
    abort_ptr,  # int32 [1], pinned host memory: not 0 once the host aborts
    num_vectors,  # x's 16-byte vectors (numel / VECTOR)
    half_elements,
    RANK: tl.constexpr, WORLD: tl.constexpr, WORLD_P2: tl.constexpr, VECTOR: tl.constexpr, BLOCK: tl.constexpr,
    POLL_EVERY: tl.constexpr, THREADS: tl.constexpr,
):
    # numel as a multiple of VECTOR, the block starts as multiples of BLOCK and the buffers as 16-byte
    # aligned, so that the masked loads and stores move 16 bytes each (the peers' pointers come from
    # integers, of which Triton knows no alignment)
    numel = num_vectors * VECTOR
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    dtype = x_ptr.dtype.element_ty
    parity = call_parity(state_ptr)
    half = parity.to(tl.int64) * half_elements
    mine = tl.multiple_of(tl.load(buffer_ptrs + RANK).to(tl.pointer_type(dtype)) + half, 16)
    for start in range(pid * BLOCK, numel, programs * BLOCK):  # (a) my slice into my buffer
        offs = tl.multiple_of(start, BLOCK) + tl.arange(0, BLOCK)
        mask = offs < numel
        tl.store(mine + offs, tl.load(x_ptr + offs, mask=mask), mask=mask)
    aborted = barrier_with_peers(signal_pad_ptrs, abort_ptr, pid, RANK, WORLD, WORLD_P2, POLL_EVERY,  # (b)
                                 THREADS)
    if aborted == 0:  # (c) the sum of the slice over every rank's buffer
        for start in range(pid * BLOCK, numel, programs * BLOCK):
            offs = tl.multiple_of(start, BLOCK) + tl.arange(0, BLOCK)
            mask = offs < numel
            total = tl.zeros([BLOCK], dtype=tl.float32)
            for r in tl.static_range(WORLD):
                buffer = tl.multiple_of(tl.load(buffer_ptrs + r).to(tl.pointer_type(dtype)) + half, 16)
                total += tl.load(buffer + offs, mask=mask).to(tl.float32)
            tl.store(out_ptr + offs, total.to(out_ptr.dtype.element_ty), mask=mask)
    finish_call(state_ptr, parity)


@triton.jit
def call_parity(state_ptr):
    """Which buffer half this call uses (0 or 1): read by every program at its start."""
    return tl.load(state_ptr + PARITY)


@triton.jit
def finish_call(state_ptr, parity):
    """Every program's last step: the last program of the call to get here flips the parity (every
    program read it before its add here: acq_rel orders that read first); the next launch on this
    stream sees both stores."""
    finished = tl.atomic_add(state_ptr + FINISHED, 1, sem="acq_rel", scope="gpu")
    if finished == tl.num_programs(0) - 1:
        tl.store(state_ptr + FINISHED, 0)
        tl.store(state_ptr + PARITY, 1 - parity)
