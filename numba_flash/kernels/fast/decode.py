"""Decoding: a handful of query rows against a long KV cache, read at memory speed on the CUDA cores.

One step of generation attends ``ROWS`` query rows (the query heads of one
key/value head, packed: ``_validation.check_cache_args``) to every key of a
cache entry.  There is almost no arithmetic per byte (4 multiply-adds per
element of K and of V for a group of 4), so the kernel's one job is to keep
enough loads in flight to read K and V at the memory's bandwidth.  The tiled
flash2 kernel does not: its smallest tile has 16 query rows for the mma's
sake, and a one-warp block that stages tiles through shared memory reads at
half the bandwidth at best (results/decode_h200.md).

Work and threads
----------------
* A block takes one (batch entry b, head h) and one split of b's keys
  (flash-decoding: ``splits`` blocks share an entry's keys, each leaving its
  partial O and lse for ``cache.py``'s merge).  Its keys go in tiles of
  ``KEY_TILE``, with the online softmax of Algorithm 1 between tiles.
* A key row is ``ROW_CHUNKS`` 16-byte chunks; ``LANES`` neighbouring lanes
  share it, one chunk each (two for float32 at d > 128), so a warp reads
  ``32 / LANES`` whole rows per load and a block ``SLOTS`` rows.  Every
  thread loads ``UNROLL`` rows' chunks before it uses any: the loads in
  flight are what sets the speed.
* Each lane keeps its chunk of every query row in registers (pre-scaled by
  scale * log2 e, so that logits are in log2 units) and the matching chunk
  of each row's output accumulator.

One key tile, four steps
------------------------
1. ``logits``: S[r, j] = q_r . k_j: a lane's share of the dot product, then
   a butterfly over the row's LANES lanes; keys past the split's end get -inf.
2. ``row_statistics`` (warp w takes rows w, w + WARPS, ...): the tile's row
   max, the new running max m, P = exp2(S - m) in place, the tile's row sum,
   and alpha = exp2(m_old - m); l = alpha l + sum.
3. Every thread rescales its accumulators by alpha.
4. ``accumulate_values``: acc_r += P[r, j] v_j over the thread's key rows.

At the end, the accumulators of the SLOTS key slots are summed (a butterfly
within the warp, shared memory across warps) and O = acc / l, lse = m / log2 e
+ log l go out in float32 as the split's partial result.

Departures from the tiled kernels: float32 products on the CUDA cores (no
tf32 or 16-bit rounding of P: more accurate), no masks (one query per head
sees the whole cache; causal calls with several rows take the tiled path).
NaN follows IEEE arithmetic: a NaN logit or value reaches every row that
sees it, as in torch; keys past the end are never loaded.
"""
import math
from functools import lru_cache

import numpy as np
from numba import cuda, float32, int64, uint32

from ...runtime.launch import Kernel, Launch, inlined_device_function
from ...tiling import cdiv, padded_head_dim
from .common import LOG2_E, NEG_INF, ceil_div, chunk_loader, operand_extent, words_per_chunk_row
from .fragments import widening
from .primitives import WARP_SIZE, exp2, load_word, shfl_xor, store_word

#: Threads per block.
THREADS = 128
WARPS = THREADS // WARP_SIZE
#: Keys per tile of the online softmax (at least SLOTS * UNROLL; see ``decode_layout``).
KEY_TILE = 128
#: Key rows whose chunks each thread has in flight at once.
UNROLL = 4
#: The most query rows a block serves; more take the tiled flash2 kernel (their products belong on tensor cores).
MAX_ROWS = 8
#: Blocks per multiprocessor that the default split aims for.
BLOCKS_PER_MULTIPROCESSOR = 4


def decode_layout(d_pad, sixteen_bit):
    """(LANES, CHUNKS_PER_LANE, SLOTS, KEYS): lanes per key row, chunks each, key rows at once, keys per tile."""
    row_chunks = words_per_chunk_row(d_pad, sixteen_bit)
    lanes = min(WARP_SIZE, 1 << (row_chunks - 1).bit_length())
    slots = THREADS // lanes
    return lanes, cdiv(row_chunks, lanes), slots, max(KEY_TILE, slots * UNROLL)


def decode_smem_words(rows, d_pad, sixteen_bit):
    """Shared words: the tile's logits (rows x KEYS), later the warps' accumulators (WARPS x rows x d_pad), and
    three statistics per row (m, l, alpha)."""
    keys = decode_layout(d_pad, sixteen_bit)[3]
    return max(rows * keys, WARPS * rows * d_pad) + 3 * rows


@lru_cache(maxsize=None)
def make_decode(ROWS, D_PAD, PRECISION, VEC):
    """The decoding kernel for ROWS query rows, head dim D_PAD (padded), a precision and VEC (16-byte rows)."""
    SIXTEEN = PRECISION != "tf32x3"
    CHUNK = 8 if SIXTEEN else 4                  # elements per 16-byte chunk
    LANES, CPL, SLOTS, KEYS = decode_layout(D_PAD, SIXTEEN)
    ELEMENTS = CPL * CHUNK                       # of a row, per lane
    ROUNDS = KEYS // (SLOTS * UNROLL)            # load rounds per tile
    SLOTS_PER_WARP = WARP_SIZE // LANES
    RED = 0                                      # the warps' accumulators (after the last tile)
    S = 0                                        # logits, then weights (rows x KEYS), same words as RED
    STATS = max(ROWS * KEYS, WARPS * ROWS * D_PAD)
    M, L, ALPHA = STATS, STATS + ROWS, STATS + 2 * ROWS
    load_chunk = chunk_loader(PRECISION, VEC)
    widen = widening(PRECISION)

    @inlined_device_function
    def widen_chunk(values, at, w0, w1, w2, w3):
        """The chunk's words as float32 elements at values[at ...]."""
        if SIXTEEN:
            values[at], values[at + 1] = widen(w0), widen(w0 >> uint32(16))
            values[at + 2], values[at + 3] = widen(w1), widen(w1 >> uint32(16))
            values[at + 4], values[at + 5] = widen(w2), widen(w2 >> uint32(16))
            values[at + 6], values[at + 7] = widen(w3), widen(w3 >> uint32(16))
        else:
            values[at], values[at + 1], values[at + 2], values[at + 3] = w0, w1, w2, w3

    @inlined_device_function
    def fetch_rows(words, X, base, stride, first_key, k_hi, slot, sub, head_dim):
        """The lane's chunks of UNROLL key rows first_key + u SLOTS + slot into words (UNROLL, CPL, 4)."""
        for u in range(UNROLL):
            key = first_key + u * SLOTS + slot
            for c in range(CPL):
                w0, w1, w2, w3 = load_chunk(X, base + key * stride, (sub + c * LANES) * CHUNK, head_dim,
                                            key < k_hi)
                words[u, c, 0], words[u, c, 1], words[u, c, 2], words[u, c, 3] = w0, w1, w2, w3

    @inlined_device_function
    def butterfly_sum(x, first, last):
        """x summed over the lanes that differ from this one in bits first .. last - 1 of the lane index."""
        bit = first
        while bit < last:
            x += shfl_xor(x, bit)
            bit *= 2
        return x

    @inlined_device_function
    def logits(smem, q, words, values, K, k_base, k_sn, t0, k_hi, slot, sub, head_dim):
        """Step 1: S[r, j] for the tile's keys t0 .. t0 + KEYS - 1 (-inf past k_hi)."""
        for round_ in range(ROUNDS):
            first_key = t0 + round_ * SLOTS * UNROLL
            fetch_rows(words, K, k_base, k_sn, first_key, k_hi, slot, sub, head_dim)
            for u in range(UNROLL):
                for c in range(CPL):
                    widen_chunk(values, c * CHUNK, words[u, c, 0], words[u, c, 1], words[u, c, 2], words[u, c, 3])
                key = first_key + u * SLOTS + slot
                for r in range(ROWS):
                    dot = float32(0)
                    for e in range(ELEMENTS):
                        dot += q[r, e] * values[e]
                    dot = butterfly_sum(dot, 1, LANES)
                    if sub == 0:
                        store_word(smem, S + r * KEYS + (key - t0), dot if key < k_hi else float32(NEG_INF))

    @inlined_device_function
    def row_statistics(smem, warp, lane):
        """Step 2 for the rows of this warp: P = exp2(S - m_new) in place, m, l and alpha updated."""
        for r in range(warp, ROWS, WARPS):
            tile_max = float32(NEG_INF)
            for x in range(lane, KEYS, WARP_SIZE):
                tile_max = max(tile_max, load_word(smem, S + r * KEYS + x))
            bit = 1
            while bit < WARP_SIZE:
                tile_max = max(tile_max, shfl_xor(tile_max, bit))
                bit *= 2
            m_old = load_word(smem, M + r)
            m_new = max(m_old, tile_max)
            shift = m_new if m_new != float32(NEG_INF) else float32(0)   # no key seen yet: every weight is 0
            total = float32(0)
            for x in range(lane, KEYS, WARP_SIZE):
                p = exp2(load_word(smem, S + r * KEYS + x) - shift)
                store_word(smem, S + r * KEYS + x, p)
                total += p
            total = butterfly_sum(total, 1, WARP_SIZE)
            if lane == 0:
                alpha = exp2(m_old - shift)
                store_word(smem, ALPHA + r, alpha)
                store_word(smem, L + r, alpha * load_word(smem, L + r) + total)
                store_word(smem, M + r, m_new)

    @inlined_device_function
    def accumulate_values(smem, acc, words, values, V, v_base, v_sn, t0, k_hi, slot, sub, head_dim):
        """Step 4: acc_r += P[r, j] v_j over the thread's key rows of the tile (V past k_hi is never read)."""
        for round_ in range(ROUNDS):
            first_key = t0 + round_ * SLOTS * UNROLL
            fetch_rows(words, V, v_base, v_sn, first_key, k_hi, slot, sub, head_dim)
            for u in range(UNROLL):
                for c in range(CPL):
                    widen_chunk(values, c * CHUNK, words[u, c, 0], words[u, c, 1], words[u, c, 2], words[u, c, 3])
                key = first_key + u * SLOTS + slot
                for r in range(ROWS):
                    p = load_word(smem, S + r * KEYS + (key - t0))
                    for e in range(ELEMENTS):
                        acc[r, e] += p * values[e]

    def kernel(Q, K, V, PARTIAL_O, PARTIAL_LSE, k_bounds, q_sb, q_sh, q_sn, k_sb, k_sh, k_sn, v_sb, v_sh, v_sn,
               heads, group, head_dim, scale_log2, splits, rows):
        # Block (b, h, split), split fastest.  Entry b holds keys k_bounds[2b] .. k_bounds[2b + 1] - 1; query
        # row r of head h is at b q_sb + h q_sh + r q_sn and reads key/value head h // group.  The partial
        # results of split s for row (b heads + h) ROWS + r are at s rows (+ that row) (x D_PAD for O).
        split = cuda.blockIdx.x % splits
        bh = cuda.blockIdx.x // splits
        h = bh % heads
        b = bh // heads
        tid = cuda.threadIdx.x
        warp = tid // WARP_SIZE
        lane = tid % WARP_SIZE
        sub = lane % LANES                           # which chunk(s) of a row this lane holds
        slot = warp * SLOTS_PER_WARP + lane // LANES  # which of the SLOTS rows in progress it helps with
        k_first = int64(k_bounds[2 * b])
        n_keys = int64(k_bounds[2 * b + 1]) - k_first
        share = ceil_div(ceil_div(n_keys, splits), KEYS) * KEYS   # whole tiles per split
        k_lo = split * share
        k_hi = min(n_keys, k_lo + share)
        k_base = b * k_sb + (h // group) * k_sh + k_first * k_sn
        v_base = b * v_sb + (h // group) * v_sh + k_first * v_sn
        smem = cuda.shared.array(0, float32)

        q = cuda.local.array((ROWS, ELEMENTS), float32)
        acc = cuda.local.array((ROWS, ELEMENTS), float32)
        values = cuda.local.array(ELEMENTS, float32)
        words = cuda.local.array((UNROLL, CPL, 4), uint32 if SIXTEEN else float32)
        c_log2 = float32(scale_log2)
        for r in range(ROWS):
            for c in range(CPL):
                w0, w1, w2, w3 = load_chunk(Q, b * q_sb + h * q_sh + r * q_sn, (sub + c * LANES) * CHUNK, head_dim,
                                            True)
                widen_chunk(values, c * CHUNK, w0, w1, w2, w3)
            for e in range(ELEMENTS):
                q[r, e] = values[e] * c_log2
                acc[r, e] = float32(0)
        if tid < ROWS:
            store_word(smem, M + tid, float32(NEG_INF))
            store_word(smem, L + tid, float32(0))
        cuda.syncthreads()   # the statistics are set before any warp updates them

        for t0 in range(k_lo, k_hi, KEYS):
            logits(smem, q, words, values, K, k_base, k_sn, t0, k_hi, slot, sub, head_dim)
            cuda.syncthreads()   # every logit of the tile is in S before the row statistics read it
            row_statistics(smem, warp, lane)
            cuda.syncthreads()   # P, alpha and l are final before any thread reads them
            for r in range(ROWS):
                alpha = load_word(smem, ALPHA + r)
                for e in range(ELEMENTS):
                    acc[r, e] *= alpha
            accumulate_values(smem, acc, words, values, V, v_base, v_sn, t0, k_hi, slot, sub, head_dim)
            cuda.syncthreads()   # every thread has read P before the next tile's logits overwrite S

        # The SLOTS partial accumulators of each row: summed within the warp, then across warps in shared memory.
        for r in range(ROWS):
            for e in range(ELEMENTS):
                acc[r, e] = butterfly_sum(acc[r, e], LANES, WARP_SIZE)
        if lane < LANES:
            for r in range(ROWS):
                for c in range(CPL):
                    column = (sub + c * LANES) * CHUNK
                    if column < D_PAD:
                        for e in range(CHUNK):
                            store_word(smem, RED + (warp * ROWS + r) * D_PAD + column + e, acc[r, c * CHUNK + e])
        cuda.syncthreads()   # every warp's accumulators are in shared memory before they are summed
        out_row = split * rows + bh * ROWS
        for x in range(tid, ROWS * head_dim, THREADS):
            r = x // head_dim
            column = x % head_dim
            total = float32(0)
            for w in range(WARPS):
                total += load_word(smem, RED + (w * ROWS + r) * D_PAD + column)
            l_row = load_word(smem, L + r)
            # l is 0 only for a split that saw no key (its weight in the merge is 0 too); NaN stays NaN.
            PARTIAL_O[(out_row + r) * D_PAD + column] = total / l_row if l_row != float32(0) else float32(0)
        if tid < ROWS:
            l_row = load_word(smem, L + tid)
            PARTIAL_LSE[out_row + tid] = (load_word(smem, M + tid) * float32(1 / LOG2_E) + math.log(l_row)
                                          if l_row != float32(0) else float32(NEG_INF))

    data = ((np.uint32 if VEC else np.uint16) if SIXTEEN else np.float32)
    return Kernel(kernel, f"decode_r{ROWS}_d{D_PAD}_{PRECISION}" + ("" if VEC else "_scalar"),
                  arrays=dict(Q=data, K=data, V=data, PARTIAL_O=np.float32, PARTIAL_LSE=np.float32,
                              k_bounds=np.int32),
                  floats=("scale_log2",))


def decode_launch(call, splits):
    """A ``Launch`` of the decoding kernel for a validated cache call (``check_cache_args``) with at most MAX_ROWS
    query rows per head; per call: (Q, K, V, PARTIAL_O, PARTIAL_LSE, k_bounds), partial results as for
    ``cache.merge_launch``: float32 (splits, rows, d_pad) and (splits, rows), rows = batch * heads * n_q."""
    sixteen = call.precision != "tf32x3"
    d_pad = padded_head_dim(call.head_dim, call.precision)
    kernel = make_decode(call.n_q, d_pad, call.precision, call.vec)
    qs, ks, vs = call.strides
    pairs = sixteen and call.vec
    q_shape, kv_shape = call.kernel_shapes
    rows = call.batch_heads * call.n_q
    return Launch(kernel, call.batch_heads * splits, THREADS, 4 * decode_smem_words(call.n_q, d_pad, sixteen),
                  dict(q_sb=qs.batch, q_sh=qs.head, q_sn=qs.row, k_sb=ks.batch, k_sh=ks.head, k_sn=ks.row,
                       v_sb=vs.batch, v_sh=vs.head, v_sn=vs.row, heads=call.heads, group=call.group,
                       head_dim=call.head_dim, scale_log2=call.scale * LOG2_E, splits=splits, rows=rows),
                  ("Q", "K", "V", "PARTIAL_O", "PARTIAL_LSE", "k_bounds"),
                  dict(Q=operand_extent(q_shape, qs, pairs), K=operand_extent(kv_shape, ks, pairs),
                       V=operand_extent(kv_shape, vs, pairs), PARTIAL_O=splits * rows * d_pad,
                       PARTIAL_LSE=splits * rows, k_bounds=call.varlen.k_bounds_size))


def decode_splits(blocks, n_keys, multiprocessors, most=64):
    """Splits of each entry's keys for the decoding kernel: about ``BLOCKS_PER_MULTIPROCESSOR`` blocks per
    multiprocessor, a whole key tile each at least, at most ``most``."""
    wanted = -(-BLOCKS_PER_MULTIPROCESSOR * multiprocessors // max(1, blocks))
    return max(1, min(most, cdiv(n_keys, KEY_TILE), wanted))


__all__ = ["MAX_ROWS", "decode_launch", "decode_layout", "decode_smem_words", "decode_splits", "make_decode"]
