"""How fast can Numba kernels stream device memory through ``cp.async``?  The bound under decoding.

Decoding one token against a KV cache reads every key and value once and does little else, so its speed
is the speed at which its blocks can pull bytes into shared memory.  On the H200 our decoding kernel's
split forward ran at 80% of DRAM throughput while L2 throughput was at 89% (ncu, 2026-12-02,
``results/decode_ncu_h200.md``), short of cuDNN's ~91%.  This experiment times the copying alone, the way
the fast kernels copy (each lane 16 bytes per ``cp.async``, a warp's copies contiguous, STAGES buffers per
block with STAGES - 1 tiles in flight, one commit group per tile), over the bytes of issue 16's case, for
block shapes like the decoding kernel's (one warp, six blocks per multiprocessor) and bigger ones, with
and without the ``.L2::128B`` / ``.L2::256B`` prefetch hint (``primitives.copy_async16_prefetching``).
Each thread reads back one word of each chunk it copied, so the copies cannot be skipped.  Beside them,
torch's own read of the same bytes (a sum) and copy (read + write), as references.  Needs a GPU and torch.

    PYTHONPATH=$PWD python3 experiments/cp_async_stream.py [--out experiments/results]
"""
import argparse
import os
import statistics
from functools import lru_cache

import numpy as np
from numba import cuda, uint32

from numba_flash.kernels.fast.primitives import (copy_async16, copy_async16_prefetching, copy_async_commit,
                                                 copy_async_wait, load_word)
from numba_flash.runtime.device import device_limits
from numba_flash.runtime.launch import Kernel, Launch

#: Issue 16's decoding case: (B, H_kv, N, d) = (16, 8, 8192, 128) float16, K and V.
BYTES = 2 * 16 * 8 * 8192 * 128 * 2
CHUNKS = 8   # 16-byte copies per thread per tile: a one-warp tile is 4 KB (the decoding kernel's K + V tile: 8 KB)
#: (warps per block, blocks per multiprocessor, buffers, L2 prefetch bytes or None)
#: (shared memory per multiprocessor: at most 192 KB here, of the H200's 228)
VARIANTS = [(1, 6, 2, None), (1, 6, 2, 256), (1, 6, 4, None), (1, 6, 4, 128), (1, 6, 4, 256),
            (1, 12, 4, None), (1, 12, 4, 256), (4, 4, 2, None), (4, 3, 4, None), (4, 3, 4, 256), (8, 2, 3, None),
            (8, 2, 3, 256)]


@lru_cache(maxsize=None)
def make_stream(WARPS, STAGES, PREFETCH):
    THREADS = 32 * WARPS
    TILE_WORDS = THREADS * CHUNKS * 4
    copy = copy_async16 if PREFETCH is None else copy_async16_prefetching[PREFETCH]
    wait_oldest = copy_async_wait(STAGES - 2)

    def stream(X, out, tiles):
        tid = cuda.threadIdx.x
        first = cuda.blockIdx.x * tiles * TILE_WORDS   # this block's words: tiles whole tiles
        smem = cuda.shared.array(0, uint32)
        seen = uint32(0)
        for x in range(STAGES - 1):   # the pipeline's prologue
            if x < tiles:
                for c in range(CHUNKS):   # chunk c of every lane: a warp's 32 copies are 512 contiguous bytes
                    word = (c * THREADS + tid) * 4
                    copy(smem, (x % STAGES) * TILE_WORDS + word, X, first + x * TILE_WORDS + word, True)
            copy_async_commit()
        for j in range(tiles):
            wait_oldest()   # tile j has landed (for this thread: it reads only its own copies)
            ahead = j + STAGES - 1
            if ahead < tiles:   # into the buffer tile j - 1 used, which this thread has read
                for c in range(CHUNKS):
                    word = (c * THREADS + tid) * 4
                    copy(smem, (ahead % STAGES) * TILE_WORDS + word, X, first + ahead * TILE_WORDS + word, True)
            copy_async_commit()
            for c in range(CHUNKS):
                seen ^= load_word(smem, (j % STAGES) * TILE_WORDS + (c * THREADS + tid) * 4)
        out[cuda.blockIdx.x * THREADS + tid] = seen

    name = f"cp_async_stream_{WARPS}w_{STAGES}s" + ("" if PREFETCH is None else f"_l2_{PREFETCH}")
    return Kernel(stream, name, arrays=dict(X=np.uint32, out=np.uint32)), TILE_WORDS * 4 * STAGES


def event_ms(torch, call, repeats=20):
    samples = []
    for i in range(repeats + 3):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        call()
        end.record()
        end.synchronize()
        if i >= 3:
            samples.append(begin.elapsed_time(end))
    return statistics.median(samples)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="folder for the markdown table")
    args = parser.parse_args()
    import torch

    sms = device_limits().multiprocessors
    x = torch.empty(BYTES // 4, dtype=torch.int32, device="cuda").random_()
    rows = [("torch sum (read)", event_ms(torch, lambda: x.sum())),
            ("torch clone (read + write, bytes counted once)", event_ms(torch, lambda: x.clone()))]
    for warps, per_sm, stages, prefetch in VARIANTS:
        kernel, shared = make_stream(warps, stages, prefetch)
        blocks = sms * per_sm
        tile_bytes = 32 * warps * CHUNKS * 16
        tiles = BYTES // (blocks * tile_bytes)   # each block whole tiles; the rest of the bytes unread
        out = torch.empty(blocks * 32 * warps, dtype=torch.int32, device="cuda")
        launch = Launch(kernel, blocks, 32 * warps, shared, dict(tiles=tiles), ("X", "out"),
                        dict(X=BYTES // 4, out=blocks * 32 * warps))
        stream = torch.cuda.current_stream().cuda_stream
        ms = event_ms(torch, lambda: launch(stream, x, out))
        hint = "no hint" if prefetch is None else f"L2::{prefetch}B"
        rows.append((f"{warps} warp(s) x {per_sm} blocks/SM, {stages} buffers, {hint}",
                     ms * BYTES / (blocks * tiles * tile_bytes)))
    lines = ["| copy | ms per 537 MB | GB/s |", "|---|---|---|"]
    lines += [f"| {name} | {ms:.4f} | {BYTES / ms / 1e6:.0f} |" for name, ms in rows]
    table = "\n".join(lines)
    print(table, flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "cp_async_stream_h200.md"), "w") as f:
            f.write("# Streaming device memory through cp.async\n\n"
                    "Command: `python3 experiments/cp_async_stream.py`  \n"
                    f"Device: {device_limits().name}  \nCUDA events, median of 20; times scaled to the whole "
                    f"537 MB where a variant reads whole tiles only (at most a tile per block short).\n\n{table}\n")


if __name__ == "__main__":
    main()
