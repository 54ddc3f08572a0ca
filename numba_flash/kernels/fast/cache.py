"""Decoding from a KV cache: appending new keys and values in place, and merging split results.

* ``append``: one thread block per new row (batch b, key/value head h, row
  r), its threads along d: row r of ``new`` goes to row ``cache_seqlens[b] +
  r`` of the cache.  Elements move as they are (float32, or 16-bit words),
  with any strides whose last dimension is contiguous.  The lengths are read
  where they lie (on the GPU, the host never waits for them): an entry whose
  length is out of range (negative, or its new keys past N_max) gets no
  append, and the forward gives it no keys and NaN in its rows of O and lse
  (``common.sequence_bounds``).
* ``merge`` (flash-decoding): with few queries and many keys, the forward
  splits each query tile's keys between ``splits`` thread blocks
  (``forward.py``, SPLIT), each leaving its O_s (normalised by its own l_s)
  and lse_s.  Then lse = log sum_s exp(lse_s) and O = sum_s exp(lse_s - lse)
  O_s: one thread block per output row, its threads along d (``make_merge``).  A split that
  saw no key has lse_s = -inf and weighs nothing; a row that saw none at all
  gets O = 0, lse = -inf, as everywhere; NaN (an overflowing entry's) stays NaN.
"""
import math
from functools import lru_cache

import numpy as np
from numba import cuda, float32, int64, uint32

from ...runtime.launch import Kernel, Launch, inlined_device_function
from ...tiling import cdiv
from .common import NEG_INF, entry_fits, operand_extent
from .fragments import sixteen_bit_ops
from .primitives import load_word, shfl_xor

#: Threads per block of the append kernel (along d; d <= 256).
APPEND_THREADS = 64


@lru_cache(maxsize=None)
def make_append(ELEMENT):
    """The append kernel for elements of numpy dtype ``ELEMENT`` (float32, or uint16 for 16-bit data)."""

    def kernel(CACHE, NEW, SEQLENS, c_sb, c_sh, c_sn, n_sb, n_sh, n_sn, kv_heads, n_new, n_max, head_dim):
        row = cuda.blockIdx.x                 # (b, h, r), r fastest
        r = row % n_new
        h = (row // n_new) % kv_heads
        b = row // (n_new * kv_heads)
        held = int64(SEQLENS[b])
        if not entry_fits(held, n_new, n_max):   # lengths the host did not check (on the GPU): no write
            return
        for x in range(cuda.threadIdx.x, head_dim, APPEND_THREADS):
            CACHE[b * c_sb + h * c_sh + (held + r) * c_sn + x] = NEW[b * n_sb + h * n_sh + r * n_sn + x]

    return Kernel(kernel, f"append_kv_{np.dtype(ELEMENT).name}",
                  arrays=dict(CACHE=ELEMENT, NEW=ELEMENT, SEQLENS=np.int32))


def append_launch(cache_shape, cache_strides, new_shape, new_strides, dtype):
    """A ``Launch`` of the append kernel; per call: (CACHE, NEW, SEQLENS) for k, then again for v."""
    element = np.float32 if dtype == "float32" else np.uint16
    batch, kv_heads, n_new, head_dim = new_shape
    return Launch(make_append(element), batch * kv_heads * n_new, APPEND_THREADS, 0,
                  dict(c_sb=cache_strides.batch, c_sh=cache_strides.head, c_sn=cache_strides.row,
                       n_sb=new_strides.batch, n_sh=new_strides.head, n_sn=new_strides.row, kv_heads=kv_heads,
                       n_new=n_new, n_max=cache_shape[2], head_dim=head_dim),
                  ("CACHE", "NEW", "SEQLENS"),
                  dict(CACHE=operand_extent(cache_shape, cache_strides), NEW=operand_extent(new_shape, new_strides),
                       SEQLENS=batch))


def output_element(PRECISION):
    """(as_output, element): a device function writing a float32 as an element of O in ``PRECISION``'s type
    (itself, or a 16-bit word), and the NumPy dtype of O's elements as the kernels see them."""
    SIXTEEN = PRECISION != "tf32x3"
    pack = sixteen_bit_ops(PRECISION)[1] if SIXTEEN else None

    @inlined_device_function
    def as_output(value):
        if SIXTEEN:
            return pack(value, float32(0)) & uint32(0xFFFF)
        return value

    return as_output, (np.uint16 if SIXTEEN else np.float32)


#: Threads per block of the merge kernel (along d).
MERGE_THREADS = 128
#: Splits whose partial O a thread of the merge has in flight at once (read one per loop step, each load was
#: waited for before the next: 24 L2 latencies per row at (B, H_q, H_kv) = (1, 32, 8), 24 splits).
MERGE_GROUP = 16


@lru_cache(maxsize=None)
def make_merge(PRECISION):
    """The merge kernel writing O in ``PRECISION``'s type (float32 words, or 16-bit words for f16 / bf16).

    One block per row.  Warp 0 reads the splits' lse (lane s: splits s, s + 32, ...), reduces the max by
    shuffles, and leaves each split's weight exp(lse_s - m) in shared memory, then their sum; after the block
    barrier every thread sums its columns of O over the splits, MERGE_GROUP splits' loads at a time.  A NaN
    lse (an overflowing entry's, or a split that met a NaN) makes its weight NaN whatever the max made of it,
    and so the row's sum, O and lse."""
    as_output, element = output_element(PRECISION)

    @inlined_device_function
    def warp_max(value):
        for lane_mask in (16, 8, 4, 2, 1):
            value = max(value, shfl_xor(value, lane_mask))
        return value

    @inlined_device_function
    def warp_sum(value):
        for lane_mask in (16, 8, 4, 2, 1):
            value += shfl_xor(value, lane_mask)
        return value

    def kernel(PARTIAL_O, PARTIAL_LSE, O, LSE, splits, rows, d_pad, head_dim):
        row = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        # Each split's weight, 0 up to a whole number of groups (``padded``), then their sum and m.
        padded = (splits + MERGE_GROUP - 1) // MERGE_GROUP * MERGE_GROUP
        weights = cuda.shared.array(0, float32)
        if tid < 32:
            m = float32(NEG_INF)
            for split in range(tid, splits, 32):
                m = max(m, PARTIAL_LSE[split * rows + row])
            m = warp_max(m)
            shift = m if m != float32(NEG_INF) else float32(0)   # no key anywhere: every weight exp(-inf) = 0
            total = float32(0)
            for split in range(tid, padded, 32):
                weight = math.exp(PARTIAL_LSE[split * rows + row] - shift) if split < splits else float32(0)
                weights[split] = weight
                total += weight
            total = warp_sum(total)
            if tid == 0:
                weights[padded] = total
                weights[padded + 1] = shift
        cuda.syncthreads()
        total = weights[padded]
        inverse = float32(1) / total if total != float32(0) else float32(0)
        values = cuda.local.array(MERGE_GROUP, float32)   # constant indices only: registers
        split_words = rows * d_pad                          # from one split's partial O to the next's
        for x in range(tid, head_dim, MERGE_THREADS):
            acc = float32(0)
            for first in range(0, splits, MERGE_GROUP):
                for i in range(MERGE_GROUP):   # the group's loads first, with no branch: in flight together
                    split = min(first + i, splits - 1)   # past the last split: its value again, weighed 0
                    values[i] = load_word(PARTIAL_O, split * split_words + row * d_pad + x)
                for i in range(MERGE_GROUP):
                    weight = weights[first + i]
                    # an empty split's O is 0, but 0 * NaN must not reach the row
                    acc += weight * values[i] if weight != float32(0) else float32(0)
            O[row * head_dim + x] = as_output(acc * inverse)
        if tid == 0:
            LSE[row] = weights[padded + 1] + math.log(total) if total != float32(0) else float32(NEG_INF)

    # The launch bound lets ptxas spend registers on a group's loads: left alone (it aims at full occupancy,
    # 36 registers) it issued each load after the last one's product, one L2 latency per split in turn.
    return Kernel(kernel, f"merge_splits_{PRECISION}",
                  arrays=dict(PARTIAL_O=np.float32, PARTIAL_LSE=np.float32, O=element, LSE=np.float32),
                  launch_bounds=(MERGE_THREADS, 4))


def merge_launch(rows, splits, d_pad, head_dim, precision):
    """A ``Launch`` of the merge kernel; per call: (PARTIAL_O, PARTIAL_LSE, O, LSE), O and LSE C-contiguous
    (rows, head_dim) and (rows,)."""
    return Launch(make_merge(precision), rows, MERGE_THREADS, 4 * (cdiv(splits, MERGE_GROUP) * MERGE_GROUP + 2),
                  dict(splits=splits, rows=rows, d_pad=d_pad, head_dim=head_dim),
                  ("PARTIAL_O", "PARTIAL_LSE", "O", "LSE"),
                  dict(PARTIAL_O=splits * rows * d_pad, PARTIAL_LSE=splits * rows, O=rows * head_dim, LSE=rows))


#: One-warp blocks per multiprocessor that the default split fills: one whole wave and no more.  On the H200 at
#: (B, H_kv) = (16, 8), d = 128, float16 (GPU time, 2026-12-02, ``results/decode_h200.md``), one-warp blocks of
#: (16, 16) tiles: 6 splits (768 blocks) 0.151-0.152 ms in three rows, 8 (1024) 0.156-0.157 in four, 12 and more
#: 0.165-0.174; the best of every tile, buffer and split count tried was within 1% of 0.151 ms.  (2026-11-30,
#: when a decoding block held 255 registers: 8 splits 0.25 ms, 9, a second wave, 0.33.)
SPLIT_WARPS_PER_MULTIPROCESSOR = 6


def decode_splits(blocks, key_tiles, multiprocessors, key_warps=1, most=32):
    """How many blocks should share a query tile's keys: as many as fill one wave without starting a second,
    no more than leave every warp a key tile, at most ``most``.  A wave: one block per multiprocessor where the
    blocks' warps take turns along the keys (``key_warps`` > 1: a block's buffers hold most of a
    multiprocessor's shared memory, and unsplit calls run so), else ``SPLIT_WARPS_PER_MULTIPROCESSOR`` one-warp
    blocks.  On the H200 (float16, d = 128, (16, 32) tiles, lengths on the GPU, 2026-12-03,
    ``results/decode_breakdown_h200.md``), one block per multiprocessor against the six warps per multiprocessor
    that key-warp blocks once shared with one-warp blocks (and their (16, 16) tiles): (B, H_q, H_kv, N) =
    (1, 32, 8, 8192) 16 splits 0.0189 ms against 24 splits' 0.0197 (cuDNN 0.0187), (4, 32, 8, 32768) 4 splits
    0.1277 against 6 splits' 0.1402 (cuDNN 0.1271), (2, 32, 8, 4096) 8 splits 0.0186 against 12 splits' 0.0196
    (cuDNN 0.0180)."""
    per_wave = multiprocessors if key_warps > 1 else SPLIT_WARPS_PER_MULTIPROCESSOR * multiprocessors
    fitting = per_wave // max(1, blocks)
    return max(1, min(most, cdiv(key_tiles, key_warps), fitting))


__all__ = ["append_launch", "decode_splits", "make_append", "make_merge", "merge_launch"]
