"""Decoding from a KV cache: appending new keys and values in place, and merging split results.

* ``append``: one thread block per new row (batch b, key/value head h, row
  r), its threads along d: row r of ``new`` goes to row ``cache_seqlens[b] +
  r`` of the cache.  Elements move as they are (float32, or 16-bit words),
  with any strides whose last dimension is contiguous.  The lengths are read
  where they lie (on the GPU, the host never waits for them): an entry whose
  length is out of range (negative, or its new keys past N_max) gets no
  append, and the forward gives it no keys and NaN in its rows of O and lse
  (``common.sequence_bounds``).  A paged cache's row goes where the entry's
  row of the block table says (``common.cache_rows``); a row whose page is
  outside the pool is not written (the forward gives that entry NaN rows).
* ``merge`` (flash-decoding): with few queries and many keys, the forward
  splits each query tile's keys between ``splits`` thread blocks
  (``forward.py``, SPLIT), each leaving its O_s (normalised by its own l_s)
  and lse_s.  Then lse = log sum_s exp(lse_s) and O = sum_s exp(lse_s - lse)
  O_s, computed by the last of the tile's blocks to finish
  (``last_to_arrive``, ``tile_merger``), in the same launch: a merge kernel
  of its own took 2.8-3.1 us of GPU time a step on the H200, and a step is
  1.3-1.6 us shorter without it (1.07-1.12x at batches of 1 and 2;
  ``experiments/tuning/results/decode_breakdown_h200.md``, 2026-12-04).
  A split that saw no key has lse_s = -inf and weighs nothing; a row that saw
  none at all gets O = 0, lse = -inf, as everywhere; NaN (an overflowing
  entry's) stays NaN.  The splits are summed in their order, whichever
  finished last: the same bits every call.
"""
import math
from functools import lru_cache

import numpy as np
from numba import cuda, float32, int64, uint32

from ...runtime.launch import Kernel, Launch, inlined_device_function
from .common import NEG_INF, cache_rows, entry_fits, operand_extent, paging_arguments
from .fragments import sixteen_bit_ops
from .primitives import load_vec4_l2, load_word_l2

#: Threads per block of the append kernel (along d; d <= 256).
APPEND_THREADS = 64


@lru_cache(maxsize=None)
def make_append(ELEMENT, PAGED=False):
    """The append kernel for elements of numpy dtype ``ELEMENT`` (float32, or uint16 for 16-bit data), into a
    contiguous cache or (PAGED) a pool of pages c_sp apart (its c_sb is 0: the table says where an entry's rows are)."""
    row_start, _ = cache_rows(PAGED)

    def kernel(CACHE, NEW, SEQLENS, c_sb, c_sh, c_sn, n_sb, n_sh, n_sn, kv_heads, n_new, n_max, head_dim, PAGES,
               pages_sb, page_size, num_pages, c_sp):
        row = cuda.blockIdx.x                 # (b, h, r), r fastest
        r = row % n_new
        h = (row // n_new) % kv_heads
        b = row // (n_new * kv_heads)
        held = int64(SEQLENS[b])
        if not entry_fits(held, n_new, n_max):   # lengths the host did not check (on the GPU): no write
            return
        pages = (PAGES, b * pages_sb, page_size, num_pages)
        start, inside = row_start(b * c_sb + h * c_sh, held + r, c_sp, c_sn, pages)
        if not inside:   # a page outside the pool (a table the host did not check): no write
            return
        for x in range(cuda.threadIdx.x, head_dim, APPEND_THREADS):
            CACHE[start + x] = NEW[b * n_sb + h * n_sh + r * n_sn + x]

    return Kernel(kernel, f"append_kv_{np.dtype(ELEMENT).name}" + ("_paged" if PAGED else ""),
                  arrays=dict(CACHE=ELEMENT, NEW=ELEMENT, SEQLENS=np.int32, PAGES=np.int32))


def append_launch(cache_shape, cache_strides, new_shape, new_strides, dtype, paging=None):
    """A ``Launch`` of the append kernel; per call: (CACHE, NEW, SEQLENS) for k, then again for v, each followed by
    the block table for a paged cache (``paging``, a ``_validation.Paging``)."""
    element = np.float32 if dtype == "float32" else np.uint16
    batch, kv_heads, n_new, head_dim = new_shape
    extents = dict(CACHE=operand_extent(cache_shape, cache_strides), NEW=operand_extent(new_shape, new_strides),
                   SEQLENS=batch)
    if paging is not None:
        extents.update(PAGES=paging.table_extent)
    return Launch(make_append(element, paging is not None), batch * kv_heads * n_new, APPEND_THREADS, 0,
                  dict(c_sb=0 if paging else cache_strides.batch, c_sp=cache_strides.batch if paging else 0,
                       c_sh=cache_strides.head, c_sn=cache_strides.row,
                       n_sb=new_strides.batch, n_sh=new_strides.head, n_sn=new_strides.row, kv_heads=kv_heads,
                       n_new=n_new, n_max=cache_shape[2] if paging is None else paging.keys, head_dim=head_dim,
                       **paging_arguments(paging)),
                  ("CACHE", "NEW", "SEQLENS") + (() if paging is None else ("PAGES",)), extents)


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


#: Splits whose lse and partial O a merging thread loads at once (loaded one after another, each waited for
#: before the next, a merge took one L2 latency per split: 24 at (B, H_q, H_kv) = (1, 32, 8), 24 splits).
MERGE_GROUP = 16


@inlined_device_function
def last_to_arrive(ARRIVALS, tile, splits, tid):
    """Whether this block is the last of the ``splits`` blocks sharing query tile ``tile`` to get here, every
    one of them having written its partial results; called by all the block's threads.

    ARRIVALS[tile] counts the arrivals modulo ``splits``: ``atomic.inc`` wraps it to 0 on the last one, so
    it is ready for the next call without a reset (a buffer per stream: ``api._CachePlan``).  The fences make
    every block's partial results visible to the last one: each thread's before its block arrives, and the
    last block's loads after it has seen the count (the threadFenceReduction pattern of CUDA's samples)."""
    cuda.threadfence()
    cuda.syncthreads()          # every thread's fence done before thread 0 arrives for the block
    last = 0
    if tid == 0:
        last = 1 if cuda.atomic.inc(ARRIVALS, tile, uint32(splits - 1)) == uint32(splits - 1) else 0
        cuda.threadfence()
    return cuda.syncthreads_or(last) != 0


def tile_merger(PRECISION, D_PAD, THREADS):
    """merge_tile(PARTIAL_O, PARTIAL_LSE, O, LSE, first_row, n_rows, splits, rows, head_dim, tid): rows
    first_row .. first_row + n_rows - 1 of O (C-contiguous (rows, head_dim), ``PRECISION``'s type) and LSE
    from the splits' partial results, by the ``THREADS`` threads of the last split's block.

    Each thread takes four columns of a row at a time and reads MERGE_GROUP splits' lse and partial O at
    once (``load_word_l2``, ``load_vec4_l2``: other blocks wrote them), branch-free: past the last split it
    reads that split again and weighs it 0.  Within a group the max of the lse gives the shift m; a later
    group with a larger max rescales what came before by exp(m_old - m_new), as the online softmax does (one
    group, MERGE_GROUP splits or fewer, is the usual case and reads memory once).  A NaN lse gives its split
    a NaN weight whatever the max made of it, and so the row's O and lse; a split that saw no key has lse
    -inf and weighs 0 (its O is never multiplied: 0 * NaN must not reach the row); a row no split saw a key
    of gets O = 0, lse = -inf."""
    as_output, _ = output_element(PRECISION)
    QUADS = D_PAD // 4          # four-column chunks per partial row

    @inlined_device_function
    def merge_tile(PARTIAL_O, PARTIAL_LSE, O, LSE, first_row, n_rows, splits, rows, head_dim, tid):
        lse_of = cuda.local.array(MERGE_GROUP, float32)    # constant indices only: registers
        o_of = cuda.local.array((MERGE_GROUP, 4), float32)
        acc = cuda.local.array(4, float32)
        for chunk in range(tid, n_rows * QUADS, THREADS):
            row = first_row + chunk // QUADS
            x = chunk % QUADS * 4
            if x >= head_dim:
                continue
            m = float32(NEG_INF)
            total = float32(0)
            for e in range(4):
                acc[e] = float32(0)
            for first in range(0, splits, MERGE_GROUP):
                for i in range(MERGE_GROUP):   # the group's loads first, with no branch: in flight together
                    split = min(first + i, splits - 1)
                    lse_of[i] = load_word_l2(PARTIAL_LSE, split * rows + row)
                    o_of[i, 0], o_of[i, 1], o_of[i, 2], o_of[i, 3] = load_vec4_l2(PARTIAL_O,
                                                                                  (split * rows + row) * D_PAD + x)
                m_new = m
                for i in range(MERGE_GROUP):
                    if first + i < splits:
                        m_new = max(m_new, lse_of[i])
                shift = m_new if m_new != float32(NEG_INF) else float32(0)   # no key yet: every weight 0
                rescale = math.exp(m - shift)    # m = -inf: 0 (nothing before, or only empty splits)
                total *= rescale
                for e in range(4):
                    acc[e] *= rescale
                for i in range(MERGE_GROUP):
                    weight = math.exp(lse_of[i] - shift) if first + i < splits else float32(0)
                    total += weight
                    if weight != float32(0):
                        for e in range(4):
                            acc[e] += weight * o_of[i, e]
                m = m_new
            inverse = float32(1) / total if total != float32(0) else float32(0)
            for e in range(4):
                if x + e < head_dim:
                    O[row * head_dim + x + e] = as_output(acc[e] * inverse)
            if x == 0:
                LSE[row] = m + math.log(total) if total != float32(0) else float32(NEG_INF)

    return merge_tile


__all__ = ["MERGE_GROUP", "append_launch", "last_to_arrive", "make_append", "tile_merger"]
