"""How fast can Numba kernels stream device memory, through ``cp.async`` or the bulk copy engine?  The bound under
decoding.

Decoding one token against a KV cache reads every key and value once and does little else, so its speed
is the speed at which its blocks can pull bytes into shared memory.  On the H200 our decoding kernel's
split forward ran at 80% of DRAM throughput while L2 throughput was at 89% (ncu, 2026-12-02,
``results/decode_ncu_h200.md``), short of cuDNN's ~91%.  This experiment times the copying alone, the way
the fast kernels copy (each lane 16 bytes per ``cp.async``, a warp's copies contiguous, STAGES buffers per
block with STAGES - 1 tiles in flight, one commit group per tile), over the bytes of issue 16's case, for
block shapes like the decoding kernel's (one warp, six blocks per multiprocessor) and bigger ones, with
and without the ``.L2::128B`` / ``.L2::256B`` prefetch hint (``primitives.copy_async16_prefetching``).
Each thread reads back one word of each chunk it copied, so the copies cannot be skipped.  Two orders: each
block its own contiguous run of tiles (as the decoding kernel's splits read their keys), or interleaved
(block b's x-th tile is tile x * blocks + b: the blocks running at one time read neighbouring tiles).

Then the same bytes through Hopper's bulk copy engine (``cp.async.bulk`` completing on an mbarrier,
``kernels/hopper/bulk.py``): one thread per copy, whole tiles in one copy or row by row into rows padded
by 16 bytes (the layout the decoding kernel's ldmatrix reads without bank conflicts), several buffers
deep, and every thread reading one word of each 16 bytes that landed.  Then cuDNN's own arrangement for
issue 16's case (``PAIRED_VARIANTS``; on the H200 no faster than the rest, 0.1267 ms at best): 128 blocks of
four warps, one per (b, h_kv), each reading its head's K and V as two streams in turn in block-wide tiles.
Beside them, torch's own read of the same bytes (a sum) and copy (read + write), as references.  Every row is
timed twice: over one buffer again and again, and over ROTATE buffers in turn, so that what the 50 MB L2 kept of the
last pass cannot serve the next one (the way a model's layers each read their own cache).  Needs a GPU and
torch.

    PYTHONPATH=$PWD python3 experiments/tuning/cp_async_stream.py [--out experiments/tuning/results]
"""
import argparse
import os
import statistics
from functools import lru_cache

import numpy as np
from numba import cuda, uint32

from numba_flash.kernels.fast.primitives import (copy_async16, copy_async16_prefetching, copy_async_commit,
                                                 copy_async_wait, load_word)
from numba_flash.kernels.hopper.bulk import (BARRIER_BYTES, barrier_expect_bytes, barrier_init, barrier_wait,
                                             bulk_copy, fence_barrier_init)
from numba_flash.runtime.device import device_limits
from numba_flash.runtime.launch import Kernel, Launch, inlined_device_function

#: Issue 16's decoding case: (B, H_kv, N, d) = (16, 8, 8192, 128) float16, K and V.
BYTES = 2 * 16 * 8 * 8192 * 128 * 2
CHUNKS = 8   # 16-byte copies per thread per tile: a one-warp tile is 4 KB (the decoding kernel's K + V tile: 8 KB)
#: (warps per block, blocks per multiprocessor, buffers, L2 prefetch bytes or None)
#: (shared memory per multiprocessor: at most 216 KB here, of the H200's 228)
#: (the last, interleaved: whether the blocks' tiles interleave)
VARIANTS = [(1, 6, 2, None, False), (1, 6, 4, None, False), (1, 6, 4, None, True), (1, 6, 4, 128, False),
            (1, 6, 4, 256, False), (1, 6, 6, None, False), (1, 6, 6, None, True), (1, 12, 4, None, False),
            (1, 12, 4, None, True), (4, 4, 2, None, False), (4, 4, 2, None, True), (4, 3, 4, None, False),
            (8, 2, 3, None, False), (8, 2, 3, None, True)]
#: cuDNN's decoding kernel's arrangement (ncu, 2026-12-02, ``results/decode_key_warps_h200.md``): one block of four
#: warps per (b, h_kv), 128 in all (four multiprocessors idle), each reading its head's K and V as two streams in
#: turn, 128-key tiles (32 KB at d = 128) copied by all four warps.  (warps, buffers per stream, chunks per thread)
PAIRED_VARIANTS = [(4, 2, 16), (4, 3, 8), (4, 2, 8), (8, 2, 8), (8, 3, 4)]
PAIRED_BLOCKS = 16 * 8   # (B, H_kv) of issue 16's case: a block streams one head's 2 MB of K and 2 MB of V
#: Buffers of BYTES read in turn by the rotating timing.
ROTATE = 4
#: Bulk copies: (warps per block, blocks per multiprocessor, buffers, tile bytes, bytes per copy, rows padded).
#: One-warp blocks of 8 KB tiles are the decoding kernel's (16 keys of K and of V at d = 128, 256-byte rows).
BULK_VARIANTS = [(1, 6, 2, 4096, 4096, False), (1, 6, 2, 8192, 256, True), (1, 6, 3, 8192, 256, True),
                 (1, 6, 4, 8192, 256, True), (1, 6, 4, 8192, 8192, False), (1, 8, 3, 8192, 256, True),
                 (1, 3, 4, 16384, 256, True), (1, 3, 4, 16384, 16384, False), (1, 2, 3, 32768, 32768, False),
                 (4, 2, 3, 32768, 256, True), (4, 2, 6, 16384, 16384, False)]


@lru_cache(maxsize=None)
def make_stream(WARPS, STAGES, PREFETCH, INTERLEAVED):
    THREADS = 32 * WARPS
    TILE_WORDS = THREADS * CHUNKS * 4
    copy = copy_async16 if PREFETCH is None else copy_async16_prefetching[PREFETCH]
    wait_oldest = copy_async_wait(STAGES - 2)

    @inlined_device_function
    def tile_word(x, tiles_per_block):
        """The first word of this block's x-th tile."""
        if INTERLEAVED:
            return (x * cuda.gridDim.x + cuda.blockIdx.x) * TILE_WORDS
        return (cuda.blockIdx.x * tiles_per_block + x) * TILE_WORDS

    def stream(X, out, tiles):
        tid = cuda.threadIdx.x
        smem = cuda.shared.array(0, uint32)
        seen = uint32(0)
        for x in range(STAGES - 1):   # the pipeline's prologue
            if x < tiles:
                for c in range(CHUNKS):   # chunk c of every lane: a warp's 32 copies are 512 contiguous bytes
                    word = (c * THREADS + tid) * 4
                    copy(smem, (x % STAGES) * TILE_WORDS + word, X, tile_word(x, tiles) + word, True)
            copy_async_commit()
        for j in range(tiles):
            wait_oldest()   # tile j has landed (for this thread: it reads only its own copies)
            ahead = j + STAGES - 1
            if ahead < tiles:   # into the buffer tile j - 1 used, which this thread has read
                for c in range(CHUNKS):
                    word = (c * THREADS + tid) * 4
                    copy(smem, (ahead % STAGES) * TILE_WORDS + word, X, tile_word(ahead, tiles) + word, True)
            copy_async_commit()
            for c in range(CHUNKS):
                seen ^= load_word(smem, (j % STAGES) * TILE_WORDS + (c * THREADS + tid) * 4)
        out[cuda.blockIdx.x * THREADS + tid] = seen

    name = (f"cp_async_stream_{WARPS}w_{STAGES}s" + ("" if PREFETCH is None else f"_l2_{PREFETCH}")
            + ("_interleaved" if INTERLEAVED else ""))
    return Kernel(stream, name, arrays=dict(X=np.uint32, out=np.uint32)), TILE_WORDS * 4 * STAGES


@lru_cache(maxsize=None)
def make_paired_stream(WARPS, STAGES, CHUNKS_PER_THREAD):
    """Each block streams the K and V halves of X at its own offset as two streams in turn (K tile x, V tile x,
    K tile x + 1, ...; ``tiles`` of each), STAGES buffers per stream, STAGES - 1 tiles of each in flight; every
    thread copies CHUNKS_PER_THREAD 16-byte chunks of each tile (a warp's 32 copies contiguous)."""
    THREADS = 32 * WARPS
    TILE_WORDS = THREADS * CHUNKS_PER_THREAD * 4
    wait_oldest_pair = copy_async_wait(STAGES - 1)   # pair j landed; the STAGES - 1 pairs after it may fly on

    @inlined_device_function
    def start_pair(smem, X, x, tiles, tid):
        """K tile x and V tile x of this block into their streams' buffers for x, one commit group."""
        for half in range(2):
            at = (half * STAGES + x % STAGES) * TILE_WORDS
            first = half * (X.shape[0] // 2) + (cuda.blockIdx.x * tiles + x) * TILE_WORDS
            for c in range(CHUNKS_PER_THREAD):
                word = (c * THREADS + tid) * 4
                copy_async16(smem, at + word, X, first + word, True)
        copy_async_commit()

    def stream(X, out, tiles):
        tid = cuda.threadIdx.x
        smem = cuda.shared.array(0, uint32)
        seen = uint32(0)
        for x in range(STAGES):   # the prologue: STAGES pairs started (empty groups past the last tile)
            if x < tiles:
                start_pair(smem, X, x, tiles, tid)
            else:
                copy_async_commit()
        for j in range(tiles):
            wait_oldest_pair()
            cuda.syncthreads()   # every thread's chunks of pair j landed (a block-wide tile, as cuDNN's)
            for half in range(2):
                for c in range(CHUNKS_PER_THREAD):
                    seen ^= load_word(smem, (half * STAGES + j % STAGES) * TILE_WORDS + (c * THREADS + tid) * 4)
            cuda.syncthreads()   # every thread done with pair j's buffers before they take pair j + STAGES
            if j + STAGES < tiles:
                start_pair(smem, X, j + STAGES, tiles, tid)
            else:
                copy_async_commit()
        out[cuda.blockIdx.x * THREADS + tid] = seen

    name = f"paired_stream_{WARPS}w_{STAGES}s_{CHUNKS_PER_THREAD}c"
    return Kernel(stream, name, arrays=dict(X=np.uint32, out=np.uint32)), 2 * STAGES * TILE_WORDS * 4


@lru_cache(maxsize=None)
def make_bulk_stream(WARPS, STAGES, TILE_BYTES, COPY_BYTES, PADDED):
    """Each block streams ``tiles`` tiles of TILE_BYTES through STAGES shared buffers, STAGES - 1 in flight,
    each tile in TILE_BYTES / COPY_BYTES bulk copies issued by the first warp's lanes; shared rows of
    COPY_BYTES, 16 bytes apart more when PADDED."""
    THREADS = 32 * WARPS
    COPIES = TILE_BYTES // COPY_BYTES
    COPY_WORDS, PITCH_WORDS = COPY_BYTES // 4, (COPY_BYTES + (16 if PADDED else 0)) // 4
    BUFFER_WORDS = COPIES * PITCH_WORDS
    TILE_WORDS = TILE_BYTES // 4
    CHUNKS_PER_THREAD = TILE_BYTES // 16 // THREADS
    BARRIERS = STAGES * BUFFER_WORDS   # one mbarrier per buffer after them
    assert COPY_BYTES % 16 == 0 and TILE_BYTES % COPY_BYTES == 0 and TILE_BYTES % (16 * THREADS) == 0

    def stream(X, out, tiles):
        tid = cuda.threadIdx.x
        first = cuda.blockIdx.x * tiles * TILE_WORDS
        smem = cuda.shared.array(0, uint32)
        if tid < STAGES:
            barrier_init(smem, BARRIERS + 2 * tid, 1)
        fence_barrier_init()
        cuda.syncthreads()   # the barriers initialised, for the copy engine and every thread
        seen = uint32(0)
        for j in range(-(STAGES - 1), tiles):
            ahead = j + STAGES - 1   # into the buffer tile j - 1 used: every thread read it before this barrier
            if j >= 0:
                cuda.syncthreads()
            if tid < 32 and ahead < tiles:
                buffer = ahead % STAGES
                if tid == 0:
                    barrier_expect_bytes(smem, BARRIERS + 2 * buffer, TILE_BYTES)
                for c in range(tid, COPIES, 32):
                    bulk_copy(smem, buffer * BUFFER_WORDS + c * PITCH_WORDS, X, first + ahead * TILE_WORDS
                              + c * COPY_WORDS, COPY_BYTES, smem, BARRIERS + 2 * buffer)
            if j >= 0:
                buffer = j % STAGES
                barrier_wait(smem, BARRIERS + 2 * buffer, (j // STAGES) & 1)
                for c in range(CHUNKS_PER_THREAD):
                    chunk = c * THREADS + tid     # 16-byte chunk of the tile
                    row, within = chunk // (COPY_BYTES // 16), chunk % (COPY_BYTES // 16)
                    seen ^= load_word(smem, buffer * BUFFER_WORDS + row * PITCH_WORDS + within * 4)
        out[cuda.blockIdx.x * THREADS + tid] = seen

    name = f"bulk_stream_{WARPS}w_{STAGES}s_{TILE_BYTES}b_by{COPY_BYTES}" + ("_padded" if PADDED else "")
    kernel = Kernel(stream, name, arrays=dict(X=np.uint32, out=np.uint32))
    return kernel, STAGES * BUFFER_WORDS * 4 + STAGES * BARRIER_BYTES


def event_ms(torch, call, repeats=20):
    """Median ms of ``call(i)`` for i = 0, 1, ... (after 3 untimed calls): the call picks its buffer by i."""
    samples = []
    for i in range(repeats + 3):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        call(i)
        end.record()
        end.synchronize()
        if i >= 3:
            samples.append(begin.elapsed_time(end))
    return statistics.median(samples)


def streamed_ms(torch, xs, kernel, shared, warps, blocks, tile_bytes):
    """A streaming kernel's times (ms over xs[0] again and again, ms over the buffers xs in turn), each of
    ``blocks`` blocks taking whole tiles (the rest of the bytes unread), scaled to the whole of a buffer."""
    tiles = BYTES // (blocks * tile_bytes)
    out = torch.empty(blocks * 32 * warps, dtype=torch.int32, device="cuda")
    launch = Launch(kernel, blocks, 32 * warps, shared, dict(tiles=tiles), ("X", "out"),
                    dict(X=BYTES // 4, out=blocks * 32 * warps))
    stream = torch.cuda.current_stream().cuda_stream
    scale = BYTES / (blocks * tiles * tile_bytes)
    return tuple(event_ms(torch, lambda i: launch(stream, xs[i % rotate], out)) * scale for rotate in (1, len(xs)))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="folder for the markdown table")
    args = parser.parse_args()
    import torch

    sms = device_limits().multiprocessors
    xs = [torch.empty(BYTES // 4, dtype=torch.int32, device="cuda").random_() for _ in range(ROTATE)]

    def both(call):
        return tuple(event_ms(torch, lambda i: call(xs[i % rotate])) for rotate in (1, ROTATE))

    rows = [("torch sum (read)", both(lambda x: x.sum())),
            ("torch clone (read + write, bytes counted once)", both(lambda x: x.clone()))]
    for warps, per_sm, stages, prefetch, interleaved in VARIANTS:
        kernel, shared = make_stream(warps, stages, prefetch, interleaved)
        tile_bytes = 32 * warps * CHUNKS * 16
        hint = "no hint" if prefetch is None else f"L2::{prefetch}B"
        rows.append((f"{warps} warp(s) x {per_sm} blocks/SM, {stages} buffers, {hint}"
                     + (", interleaved" if interleaved else ""),
                     streamed_ms(torch, xs, kernel, shared, warps, sms * per_sm, tile_bytes)))
    for warps, stages, chunks in PAIRED_VARIANTS:
        kernel, shared = make_paired_stream(warps, stages, chunks)
        pair_bytes = 2 * 32 * warps * chunks * 16
        rows.append((f"paired (cuDNN's layout): {warps} warp(s) x {PAIRED_BLOCKS} blocks, K and V tiles of "
                     f"{pair_bytes // 2048} KB in turn, {stages} buffer(s) each",
                     streamed_ms(torch, xs, kernel, shared, warps, PAIRED_BLOCKS, pair_bytes)))
    for warps, per_sm, stages, tile_bytes, copy_bytes, padded in BULK_VARIANTS:
        kernel, shared = make_bulk_stream(warps, stages, tile_bytes, copy_bytes, padded)
        rows.append((f"bulk: {warps} warp(s) x {per_sm} blocks/SM, {stages} buffers of {tile_bytes // 1024} KB, "
                     f"{copy_bytes} B per copy" + (", rows padded" if padded else ""),
                     streamed_ms(torch, xs, kernel, shared, warps, sms * per_sm, tile_bytes)))
    lines = [f"| copy | ms per 537 MB, one buffer | GB/s | ms, {ROTATE} buffers in turn | GB/s |",
             "|---|---|---|---|---|"]
    lines += [f"| {name} | {one:.4f} | {BYTES / one / 1e6:.0f} | {turn:.4f} | {BYTES / turn / 1e6:.0f} |"
              for name, (one, turn) in rows]
    table = "\n".join(lines)
    print(table, flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "cp_async_stream_h200.md"), "w") as f:
            f.write("# Streaming device memory through cp.async and the bulk copy engine\n\n"
                    "Command: `python3 experiments/tuning/cp_async_stream.py`  \n"
                    f"Device: {device_limits().name}  \nCUDA events, median of 20; times scaled to the whole "
                    f"537 MB where a variant reads whole tiles only (at most a tile per block short).\n\n{table}\n")


if __name__ == "__main__":
    main()
