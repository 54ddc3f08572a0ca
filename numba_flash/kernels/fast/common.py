"""What flash2's forward and backward kernels share: where a block works, how tiles move, masks, dropout, NaN.

Everything here is a small device function (inlined) or a factory of them
for compile-time constants; ``forward.py`` and ``backward.py`` read as a
sequence of these steps.

Operands in device memory
-------------------------
q, k, v, o (and dO, dQ, dK, dV) reach the kernels as flat arrays of 32-bit
words (float32 elements, or 16-bit elements as packed pairs when rows are
16-byte aligned: ``VEC``) or of single 16-bit words (``uint16``, any head
dim), plus element strides for batch, head and row: the last dimension must
be contiguous, the others may be anything (a (B, N, H, d) tensor viewed as
(B, H, N, d) needs no copy).  Row ``r`` of head ``h`` of batch ``b`` starts at
element ``b * s_b + h * s_h + r * s_n``.  With grouped-query attention, query
head h reads key/value head ``h // group``.

A 16-byte "chunk" is four words: 4 float32, or 8 16-bit elements.  Tiles move
chunk by chunk, every thread of the block taking every THREADS-th chunk:
through registers (``tile_movers``: a tile in flight while the block computes
on the previous one; 3xTF32 splits it on the way), or, for 16-bit pairs, by
``cp.async`` straight into shared memory (``tile_copier``: no registers held,
one instruction per chunk instead of a load and a store).

NaN
---
IEEE arithmetic already gives NaN to every output row that sees a NaN
through a logit (q, k) or through an *allowed* weight times a value.  The
one leak is a masked weight: it is exactly 0, and the tensor cores compute
0 * NaN = NaN, so a NaN value row would reach rows that may not attend to it
whenever they share a partly masked tile (the diagonal of a causal mask, a
block mask's partial tiles).  In such tiles only, ``sanitize_row``
replaces NaN elements of the streamed operand by 0 in
shared memory and flag their rows, and the mask step turns the allowed
entries of flagged rows into NaN: exactly the rows allowed to see a NaN get
one.  Fully visible tiles need none of this.
"""
import math
from functools import lru_cache

import numpy as np
from numba import cuda, float32, int64, uint32, uint64

from ...dropout import NO_DROPOUT, kernel_args, philox_device
from ...runtime.arrays import extent, placeholder
from ...runtime.launch import inlined_device_function
from ...sparsity.mod_tiles import mod_mask_arguments
from ...sparsity.tile_lists import mask_arguments
from ...tiling import ROWS_PER_WARP, cdiv, row_stride
from .fragments import split_tf32, swizzle
from .primitives import copy_async16, copy_async_wait_all, load_vec4, load_word, store_vec4

NEG_INF = -math.inf
LOG2_E = 1.4426950408889634


#: ``tiling.cdiv`` compiled for the device: one ceiling division for host and kernels.
ceil_div = inlined_device_function(cdiv)


def words_per_chunk_row(d_pad, sixteen_bit):
    """16-byte chunks per row of a tile."""
    return d_pad // (8 if sixteen_bit else 4)


def chunk_iterations(rows, d_pad, sixteen_bit, threads):
    """How many chunks each thread moves for a tile of ``rows``."""
    return cdiv(rows * words_per_chunk_row(d_pad, sixteen_bit), threads)


# ---------------------------------------------------------------- host side: a call's fixed arguments

def operand_extent(shape, strides, pairs=False):
    """Elements a kernel may touch of an operand (..., H, N, d) with ``Strides`` (32-bit words with ``pairs``)."""
    batch = int(np.prod(shape[:-3], dtype=np.int64))
    heads = shape[-3] if len(shape) > 2 else 1
    elements = extent((batch, heads, shape[-2], shape[-1]), (strides.batch, strides.head, strides.row, 1))
    return cdiv(elements, 2) if pairs else elements


def word_extent(call):
    """extent(shape, strides) for the call's operands: 16-bit data moves as pairs with VEC."""
    pairs = call.precision != "tf32x3" and call.vec
    return lambda shape, strides: operand_extent(shape, strides, pairs)


def dropout_arguments(call):
    """The dropout parameters that stay fixed (the seed changes per call)."""
    keep_threshold, keep_scale, _, _ = kernel_args(call.dropout_p, 0) if call.dropout_p > 0 else NO_DROPOUT
    return dict(keep_threshold=keep_threshold, keep_scale=keep_scale)


def has_tile_lists(call):
    """Whether a call's kernels visit listed tiles (HAS_MASK): a block mask's, or a batched call's mask_mod
    classified.  (Packed sequences and KV caches have per-call lengths that the plan does not know: their kernels
    test a mask_mod on every tile's elements.)"""
    return call.block_mask is not None or (mask_mod_of(call) is not None and call.varlen is None)


def mask_mod_of(call):
    return call.mods[1] if call.mods else None


def _mask_lists(call, tiles, role):
    causal_offset = call.causal_offset if call.causal else None
    if mask_mod_of(call) is not None:   # the mask_mod's tiles classified on the host (``sparsity/mod_tiles.py``)
        return mod_mask_arguments(mask_mod_of(call), call.block_mask, call.q_shape[:-2], call.n_q, call.n_k, tiles,
                                  causal_offset, role)
    return mask_arguments(call.block_mask, call.q_shape[:-2], call.n_q, call.n_k, tiles, causal_offset, role)


def block_mask_arguments(call, tiles, role):
    """A call's block mask as a fast kernel's arguments for ``role`` (``sparsity/tile_lists.py``), or placeholders."""
    if not has_tile_lists(call):
        return dict(tile_offsets=placeholder(np.int32), tile_entries=placeholder(np.int32),
                    tile_order=placeholder(np.int32), M=placeholder(np.uint8), mask_rows=1, mask_cols=1, mask_t_r=1,
                    mask_t_c=1)
    lists = _mask_lists(call, tiles, role)
    order = placeholder(np.int32) if lists.tile_order is None else lists.tile_order
    return dict(tile_offsets=lists.tile_offsets, tile_entries=lists.tile_entries, tile_order=order, M=lists.layout,
                mask_rows=lists.mask_rows, mask_cols=lists.mask_cols, mask_t_r=lists.mask_t_r, mask_t_c=lists.mask_t_c)


def partly_masked_tiles(call, tiles, role):
    """What a partly covered tile that ``role`` visits tests (a kernel's PARTLY_MASKED, ``tile_lists.MaskArguments.
    partly``): False where none is (no mask, or a block mask whose blocks are unions of whole kernel tiles),
    ``tile_lists.LAYOUT`` where the block mask cuts one (its entries tested against the layout), ``tile_lists.
    MASK_MOD_ALONE`` where only a mask_mod does."""
    return has_tile_lists(call) and _mask_lists(call, tiles, role).partly


def sequence_arguments(call):
    """A call's per-batch bounds, as the kernels' fixed arguments (``sequence_bounds``): the steps through the
    bounds arrays (which come per call), the causal alignment and lse's strides.  Placeholders without them."""
    if call.varlen is None:
        return dict(q_bounds=placeholder(np.int32), k_bounds=placeholder(np.int32), q_step=0, k_step=0,
                    bottom_right=0, lse_sb=0, lse_sh=0, new_keys=0)
    sequences = call.varlen
    fixed = dict(q_step=sequences.q_step, k_step=sequences.k_step, bottom_right=int(sequences.bottom_right),
                 lse_sb=sequences.lse_strides[0], lse_sh=sequences.lse_strides[1], new_keys=sequences.new_keys)
    if sequences.kv_cache:   # the queries' bounds are the call's own: no array to read
        fixed["q_bounds"] = placeholder(np.int32)
    return fixed


def sequence_arrays(call):
    """(names, extents): a call's per-batch bounds arrays (``sequence_bounds``), which its launches take per call
    after their operands: q_bounds and k_bounds for packed sequences, k_bounds alone for a KV cache (its queries'
    bounds are the call's own), none without per-batch lengths."""
    if call.varlen is None:
        return (), {}
    names = ("k_bounds",) if call.varlen.kv_cache else ("q_bounds", "k_bounds")
    return names, dict(q_bounds=call.varlen.q_bounds_size, k_bounds=call.varlen.k_bounds_size)


def lse_slabs(call):
    """Slabs of N_q rows of lse (and the backward's D): one per (batch, head); a packed call has one per head over
    all its sequences (flash-attn's (H_q, total_q))."""
    return call.heads if call.varlen is not None and call.varlen.packed else call.batch_heads


def paging_arguments(paging):
    """A paged cache's ``Paging`` as the kernels' fixed arguments (``cache_rows``; the block table comes per call as
    PAGES), or placeholders for contiguous operands (None)."""
    if paging is None:
        return dict(PAGES=placeholder(np.int32), pages_sb=0, page_size=1, num_pages=0)
    return dict(pages_sb=paging.table_stride, page_size=paging.page_size, num_pages=paging.pages)


def sequence_mode(call):
    """The kernels' VARLEN for a call (``sequence_bounds``): False, True (bounds arrays) or "cache"."""
    if call.varlen is None:
        return False
    return "cache" if call.varlen.kv_cache else True


def kernel_name(base, blocks, d_pad, precision, vec, causal, has_mask, has_dropout, varlen=False):
    """A readable name for one specialisation (what profilers show)."""
    return (f"{base}_{blocks[0]}x{blocks[1]}_d{d_pad}_{precision}" + ("_causal" if causal else "")
            + ("" if vec else "_scalar") + ("_sparse" if has_mask else "") + ("_dropout" if has_dropout else "")
            + ({"cache": "_kv_cache", True: "_varlen", False: ""}[varlen]))


@inlined_device_function
def tile_coordinates(block_id, tiles, heads, rank_major=False, narrow=False):
    """A 1-D grid of ``tiles`` blocks per (batch, head) decoded: (tile, head, batch, batch*heads index).

    Usually the tiles of one head are neighbours: neighbouring blocks work on
    one head and share its K and V in L2.  Causal grids, whose tiles differ in
    work, are ``rank_major``: block i runs tile i // BH of head i % BH (BH =
    batch*heads), so that every head's tile of rank 0 (the kernel makes it
    its longest) is dispatched before any of rank 1, and the shortest tiles
    fill the tail: longest-processing-time-first scheduling.  One head's tiles
    together leave the last heads' longest tiles to start when most of the
    work is done (a list-scheduling model of 264 block slots puts the cost
    at 12-15% of a causal forward: experiments/tuning/results/causal_schedule.md).
    The grid is limited only by gridDim.x (2^31 - 1), not by gridDim.y's 65535.

    ``narrow`` (decoding): in unsigned 32-bit arithmetic, where Python's floor division of int64 costs a branch, a call
    for wide operands and sign fixes per division, and decoding's one block per multiprocessor waits for them before its
    first copy.  With the kv head's division narrowed too (``forward.py``), a decoding block's first copy comes after
    192 SASS instructions instead of 460, and a call's fixed cost fell from 7.92 to 7.50 us on the H200
    (experiments/tuning/results/decode_breakdown_h200.md, 2026-12-03).  Not everywhere: NVVM 13 fails to compile seven
    block-sparse and varlen kernels with it (ERROR_COMPILATION).
    """
    if narrow:
        block, tiles, heads = uint32(block_id), uint32(tiles), uint32(heads)
        if rank_major:
            batch_heads = uint32(cuda.gridDim.x) // tiles
            tile = block // batch_heads
            bh = block - tile * batch_heads
        else:
            bh = block // tiles
            tile = block - bh * tiles
        b = bh // heads
        return int64(tile), int64(bh - b * heads), int64(b), int64(bh)
    if rank_major:
        batch_heads = cuda.gridDim.x // tiles
        tile = block_id // batch_heads
        bh = block_id % batch_heads
    else:
        tile = block_id % tiles
        bh = block_id // tiles
    return tile, bh % heads, bh // heads, bh


@inlined_device_function
def entry_fits(held, n_new, n_max):
    """Whether a cache entry holding ``held`` keys takes ``n_new`` more within its ``n_max`` rows."""
    return held >= 0 and held + n_new <= n_max


@lru_cache(maxsize=None)
def sequence_bounds(VARLEN):
    """(sequence, lse_row): where batch entry b's rows are, as two device functions.

    ``sequence(b, q_bounds, q_step, k_bounds, k_step, n_q, n_k, causal_offset, bottom_right, new_keys)``
    returns (q_first, k_first, n_q, n_k, causal_offset): b's first query and key rows (row r of b is at
    ``b * s_b + (first + r) * s_n``), its lengths and causal offset.  ``lse_row(bh, b, h, q_first, rows,
    lse_sb, lse_sh)`` is where head h's lse (and D) rows of b start, ``rows`` being the kernel's n_q.

    * Without VARLEN the call's own: every batch entry has n_q queries and n_k keys, lse is
      (batch * heads, n_q); the functions compile to nothing new.
    * With VARLEN, per-batch bounds: b's queries are rows q_bounds[b * q_step] .. q_bounds[b * q_step + 1] - 1
      (keys likewise), its causal mask aligned bottom-right when ``bottom_right`` (key j visible to query i
      iff j <= i + N_k,b - N_q,b), its lse row r of head h at b * lse_sb + h * lse_sh + q_first + r.
      flash-attn's packed batches: cumulative bounds (step 1) into rows with batch stride 0, lse
      (heads, total_q).
    * VARLEN "cache" (a KV cache, the forward only): k_bounds holds each entry's length before the call,
      cache_seqlens, read where it lies (on the GPU, so that the host never waits for it): b's keys are
      0 .. cache_seqlens[b] + new_keys - 1 of its n_k rows, its queries the call's n_q.  An entry whose
      keys would not fit (``entry_fits``: a negative length, or new keys past n_k) gets n_k = -1: it sees
      no key, and the forward writes NaN in its rows (a loud result where reading past the cache would be
      a silent one: the host cannot raise without reading the lengths).
    """
    KV_CACHE = VARLEN == "cache"

    @inlined_device_function
    def sequence(b, q_bounds, q_step, k_bounds, k_step, n_q, n_k, causal_offset, bottom_right, new_keys):
        if KV_CACHE:
            held = int64(k_bounds[b])
            n_k_b = held + new_keys if entry_fits(held, new_keys, n_k) else int64(-1)
            return int64(0), int64(0), n_q, n_k_b, causal_offset + bottom_right * (n_k_b - n_q)
        if VARLEN:
            q_first = int64(q_bounds[b * q_step])
            k_first = int64(k_bounds[b * k_step])
            n_q_b = int64(q_bounds[b * q_step + 1]) - q_first
            n_k_b = int64(k_bounds[b * k_step + 1]) - k_first
            return q_first, k_first, n_q_b, n_k_b, causal_offset + bottom_right * (n_k_b - n_q_b)
        return int64(0), int64(0), n_q, n_k, causal_offset

    @inlined_device_function
    def lse_row(bh, b, h, q_first, rows, lse_sb, lse_sh):
        if VARLEN:
            return b * lse_sb + h * lse_sh + q_first
        return bh * rows

    return sequence, lse_row


@lru_cache(maxsize=None)
def cache_rows(PAGED):
    """(row_start, pages_fit): where a KV cache keeps an entry's key rows, as two device functions: the one step in
    which a paged cache differs from a contiguous one.

    ``pages`` = (PAGES, table_row, page_size, num_pages): with PAGED the block table (flat int32), where the entry's
    row of it starts, and the pool's page size and number of pages; unused otherwise.

    * ``row_start(head, j, s_page, s_n, pages)`` -> (start, inside): the element where logical key row j of an
      entry's head starts, and whether it lies in the cache.  A contiguous cache (B, H_kv, N_max, d): ``head`` is
      the head's row 0 (b s_b + h s_h) and row j is at head + j s_n, always inside.  PAGED, a pool (num_pages,
      H_kv, page_size, d) of page stride ``s_page``: row j is row j % page_size of page p = PAGES[table_row + j //
      page_size], at p s_page + head + (j % page_size) s_n, ``head`` being h s_h.  It is inside iff 0 <= p <
      num_pages; a page outside gives page 0's row (an address that exists) for the caller to read nothing from.
    * ``pages_fit(pages, n_keys, tid, threads)`` (PAGED; called by all ``threads`` threads of the block, as it ends
      in a barrier): whether every page that keys 0 .. n_keys - 1 lie in is inside the pool, each thread checking
      every threads-th of the entry's table entries.
    """

    @inlined_device_function
    def row_start(head, j, s_page, s_n, pages):
        if not PAGED:
            return head + j * s_n, True
        PAGES, table_row, page_size, num_pages = pages
        index = uint32(j) // uint32(page_size)    # 32-bit: a 64-bit division is a call with sign fixes
        page = int64(PAGES[table_row + index])
        inside = page >= 0 and page < num_pages
        return (page if inside else int64(0)) * s_page + head + (j - int64(index) * page_size) * s_n, inside

    @inlined_device_function
    def pages_fit(pages, n_keys, tid, threads):
        PAGES, table_row, page_size, num_pages = pages
        outside = 0
        for i in range(tid, ceil_div(n_keys, page_size), threads):
            page = PAGES[table_row + i]
            if page < 0 or page >= num_pages:
                outside = 1
        return cuda.syncthreads_or(outside) == 0

    return row_start, pages_fit


@inlined_device_function
def keys_end(row, n_q, n_k, causal, causal_offset):
    """The keys that query ``row`` may see by the sequence bounds and the causal mask: 0 .. keys_end - 1."""
    if row >= n_q:
        return 0
    return min(n_k, row + causal_offset + 1) if causal else n_k


@inlined_device_function
def allowed_below(end, row, key, partly_masked, M, bh, mask_rows, mask_cols, mask_t_r, mask_t_c):
    """``allowed`` with the row's ``keys_end`` computed once for all its keys."""
    if key >= end:
        return False
    if partly_masked:
        return load_word(M, (bh * mask_t_r + row // mask_rows) * mask_t_c + key // mask_cols) != 0
    return True


@inlined_device_function
def allowed(row, key, n_q, n_k, causal, causal_offset, partly_masked, M, bh, mask_rows, mask_cols, mask_t_r,
            mask_t_c):
    """Whether query ``row`` may attend to ``key``: inside both sequences, causal (key <= row + causal_offset),
    and the block mask's element (i, j) where the tile is only partly covered by it."""
    return allowed_below(keys_end(row, n_q, n_k, causal, causal_offset), row, key, partly_masked, M, bh, mask_rows,
                         mask_cols, mask_t_r, mask_t_c)


@inlined_device_function
def dropout_words(row, first_key, bh, seed0, seed1, t):
    """The generator words deciding keys first_key and first_key + 1 (first_key even) of ``row``.

    One Philox call covers four keys; a lane's two columns 2t, 2t + 1 are its
    words 2 (t & 1) and 2 (t & 1) + 1 (see ``numba_flash/dropout.py``).
    """
    w0, w1, w2, w3 = philox_device(uint32(first_key // 4), uint32(row), uint32(bh), uint32(0), uint32(seed0),
                                   uint32(seed1))
    return (w2, w3) if t & 1 else (w0, w1)


@lru_cache(maxsize=None)
def lane_flags(COLUMN_TILES):
    """flags(smem, FLAGS, t): the NaN flags of a lane's fragment columns (2t and 2t + 1 of each 8-wide tile),
    as bit 2 tile + e of one word: read once per tile, so that the masking loops index no shared memory."""

    @inlined_device_function
    def flags(smem, FLAGS, t):
        bits = uint64(0)
        for tile in range(COLUMN_TILES):
            for e in range(2):
                if load_word(smem, FLAGS + tile * 8 + 2 * t + e) != uint32(0):
                    bits |= uint64(1) << uint64(2 * tile + e)
        return bits

    return flags


@inlined_device_function
def is_nan_f32_bits(bits):
    return (bits & uint32(0x7F800000)) == uint32(0x7F800000) and (bits & uint32(0x007FFFFF)) != uint32(0)


#: The bits of +infinity in each 16-bit precision: every exponent bit set, no mantissa bit.
INFINITY_BITS = {"f16": 0x7C00, "bf16": 0x7F80}


@lru_cache(maxsize=None)
def nan_tests(PRECISION):
    """(low-half NaN?, high-half NaN?) for a packed 16-bit pair, or the float32/tf32 word test twice."""
    if PRECISION == "tf32x3":
        return is_nan_f32_bits, is_nan_f32_bits
    EXPONENT = INFINITY_BITS[PRECISION]     # all exponent bits set; a NaN has a mantissa besides
    MANTISSA = 0x7FFF ^ EXPONENT

    @inlined_device_function
    def low_is_nan(word):
        return (word & uint32(EXPONENT)) == uint32(EXPONENT) and (word & uint32(MANTISSA)) != uint32(0)

    @inlined_device_function
    def high_is_nan(word):
        return low_is_nan(word >> uint32(16))

    return low_is_nan, high_is_nan


@lru_cache(maxsize=None)
def pair_has_nan(PRECISION):
    """``has_nan(word)``: whether either 16-bit element of a packed pair is NaN, in three integer operations.  A
    NaN's magnitude (its low 15 bits) exceeds the infinity's, so adding 0x7FFF - infinity to each magnitude sets
    bit 15 exactly for NaN; no sum carries into the other half (at most 0x7FFF + 0x3FF)."""
    MAGNITUDES, SIGNS = uint32(0x7FFF7FFF), uint32(0x80008000)
    ABOVE_INFINITY = uint32((0x7FFF - INFINITY_BITS[PRECISION]) * 0x10001)   # in both halves

    @inlined_device_function
    def has_nan(word):
        return ((word & MAGNITUDES) + ABOVE_INFINITY) & SIGNS != uint32(0)

    return has_nan


@lru_cache(maxsize=None)
def nan_cleaner(PRECISION):
    """``cleaned(word)``: ``word`` with its NaN elements set to 0, and 1 if it had any (else 0)."""
    SIXTEEN = PRECISION != "tf32x3"
    low_is_nan, high_is_nan = nan_tests(PRECISION)

    @inlined_device_function
    def cleaned(word):
        found = uint32(0)
        if SIXTEEN:
            if low_is_nan(word):
                word &= uint32(0xFFFF0000)
                found = uint32(1)
            if high_is_nan(word):
                word &= uint32(0xFFFF)
                found = uint32(1)
        elif low_is_nan(word):
            word = uint32(0)
            found = uint32(1)
        return word, found

    return cleaned


@lru_cache(maxsize=None)
def chunk_loader(PRECISION, VEC):
    """``load_chunk(X, row_start, c, head_dim, row_ok)``: one 16-byte chunk of a row as four words (module
    docstring), zeros past ``head_dim`` or when not ``row_ok``; a 16-byte load with VEC."""
    SIXTEEN = PRECISION != "tf32x3"

    @inlined_device_function
    def load_chunk(X, row_start, c, head_dim, row_ok):
        """Words c/CHUNK .. + 3 of a row starting at element row_start (columns c..), zeros outside."""
        if SIXTEEN:
            if VEC:  # X holds pairs (uint32); d is a multiple of 8 and rows are 16-byte aligned
                if row_ok and c < head_dim:
                    return load_vec4(X, (row_start + c) // 2)
                return uint32(0), uint32(0), uint32(0), uint32(0)
            w = cuda.local.array(4, uint32)  # X holds single 16-bit words (uint16): pack them here
            for i in range(4):
                lo = uint32(load_word(X, row_start + c + 2 * i)) if row_ok and c + 2 * i < head_dim else uint32(0)
                hi = (uint32(load_word(X, row_start + c + 2 * i + 1))
                      if row_ok and c + 2 * i + 1 < head_dim else uint32(0))
                w[i] = lo | (hi << uint32(16))
            return w[0], w[1], w[2], w[3]
        if VEC:  # d is a multiple of 4: a chunk is wholly inside the row or wholly padding
            if row_ok and c < head_dim:
                return load_vec4(X, row_start + c)
            return float32(0), float32(0), float32(0), float32(0)
        x = cuda.local.array(4, float32)
        for i in range(4):
            x[i] = load_word(X, row_start + c + i) if row_ok and c + i < head_dim else float32(0)
        return x[0], x[1], x[2], x[3]

    return load_chunk


@lru_cache(maxsize=None)
def tile_movers(ROWS, D_PAD, PRECISION, VEC, THREADS, SWIZZLED=False):
    """(ITERS, fetch_rows, commit_rows, sanitize_row): device functions that move a tile of ROWS rows
    between device and shared memory (see the module docstring), row-major in shared memory.

    * ``fetch_rows(regs, X, base, stride, rows_valid, head_dim, tid)``: each thread's chunks of rows
      base, base + stride, ... (zeros past ``rows_valid`` and past ``head_dim``) into ``regs``
      ((ITERS, 4) words): global loads that can be in flight while the block computes;
    * ``commit_rows(smem, regs, HI, LO, tid)``: those chunks into a row-major tile (tf32: split into
      hi and lo halves at HI and LO; 16-bit: pairs along d at HI);
    * ``sanitize_row(smem, HI, r)``: NaN elements of row r of a tile in shared memory to 0; it returns
      whether there were any, for the caller's flags (the module docstring says why).  Callers give
      every row to some thread, rows tid, tid + THREADS, ... (a tile may have more rows than the block
      has threads: 64 keys for the 32 threads of 16 query rows).

    SWIZZLED: the tile's rows are unpadded and swizzled (``tiling.swizzled_rows``).
    """
    SIXTEEN = PRECISION != "tf32x3"
    RS = row_stride(D_PAD, SIXTEEN, SWIZZLED)
    ROW_CHUNKS = words_per_chunk_row(D_PAD, SIXTEEN)
    CHUNK = 8 if SIXTEEN else 4                 # elements per chunk
    ROW_UNITS = ROWS * ROW_CHUNKS
    ROW_ITERS = chunk_iterations(ROWS, D_PAD, SIXTEEN, THREADS)
    cleaned = nan_cleaner(PRECISION)
    load_chunk = chunk_loader(PRECISION, VEC)

    @inlined_device_function
    def fetch_rows(regs, X, base, stride, rows_valid, head_dim, tid):
        for i in range(ROW_ITERS):
            e = tid + i * THREADS
            r = e // ROW_CHUNKS
            w0, w1, w2, w3 = load_chunk(X, base + r * stride, (e % ROW_CHUNKS) * CHUNK, head_dim,
                                        e < ROW_UNITS and r < rows_valid)
            regs[i, 0], regs[i, 1], regs[i, 2], regs[i, 3] = w0, w1, w2, w3

    @inlined_device_function
    def commit_rows(smem, regs, HI, LO, tid):
        for i in range(ROW_ITERS):
            e = tid + i * THREADS
            if e < ROW_UNITS:
                row, chunk = e // ROW_CHUNKS, e % ROW_CHUNKS
                at = row * RS + 4 * (swizzle(chunk, row) if SWIZZLED else chunk)
                if SIXTEEN:
                    store_vec4(smem, HI + at, regs[i, 0], regs[i, 1], regs[i, 2], regs[i, 3])
                else:
                    h0, l0 = split_tf32(regs[i, 0])
                    h1, l1 = split_tf32(regs[i, 1])
                    h2, l2 = split_tf32(regs[i, 2])
                    h3, l3 = split_tf32(regs[i, 3])
                    store_vec4(smem, HI + at, h0, h1, h2, h3)
                    store_vec4(smem, LO + at, l0, l1, l2, l3)

    @inlined_device_function
    def sanitize_row(smem, HI, r):
        """NaN elements of row r of the row-major tile at HI to 0; returns 1 if there were any.

        The row's data words (not its bank padding; swizzled, in their order) are read 16 bytes at a time
        and written back only where a chunk held a NaN: each thread cleans whole rows while the block waits
        at the barrier after this pass, so its length is the length of one row's (or two rows') cleaning.
        For 3xTF32 only the hi half needs it: a NaN's lo half is 0 (``split_tf32``).
        """
        found = uint32(0)
        for c in range(ROW_CHUNKS):
            at = HI + r * RS + 4 * c
            w0, w1, w2, w3 = load_vec4(smem, at)
            w0, f0 = cleaned(w0)
            w1, f1 = cleaned(w1)
            w2, f2 = cleaned(w2)
            w3, f3 = cleaned(w3)
            if f0 | f1 | f2 | f3:
                store_vec4(smem, at, w0, w1, w2, w3)
                found = uint32(1)
        return found

    return ROW_ITERS, fetch_rows, commit_rows, sanitize_row


@lru_cache(maxsize=None)
def tile_copier(ROWS, D_PAD, THREADS, BUFFER_ROWS=None, BUFFER_WORDS=0, SWIZZLED=False):
    """(copy_rows, wait_rows): a tile of ROWS rows of 16-bit pairs (``VEC``) from device memory into a
    row-major tile in shared memory by ``cp.async``.

    * ``copy_rows(smem, AT, X, base, stride, rows_valid, head_dim, tid)``: start the thread's chunks of
      rows base, base + stride, ... (zeros past ``rows_valid`` and past ``head_dim``) on their way to the
      tile at word AT; nothing waits for them;
    * ``wait_rows()``: the thread's copies have landed (the block's, after the next barrier).

    With BUFFER_ROWS (decoding's key warps: one round of every warp's tile) the tile's rows go to
    buffers of BUFFER_ROWS rows each, BUFFER_WORDS apart: row R to row R % BUFFER_ROWS of buffer
    R // BUFFER_ROWS.  SWIZZLED: rows unpadded and swizzled (``tiling.swizzled_rows``).

    A thread keeps one column of chunks and walks down the rows, ``ROWS_PER_PASS`` at a time, so that each copy costs
    one address increment.  A tile whose rows are all inside (every one but a sequence's last) takes a path without the
    bounds tests, whose 64-bit compares and selects cost some ten instructions per copy (ptxas 13, sm_90, decoding's
    round of four (16, 16) tiles: 409 instructions instead of 618 with the 32-bit buffer index of ``forward.py``; no
    faster on the H200, whose decoding waits on memory: ``experiments/tuning/results/decode_breakdown_h200.md``).  When
    the chunks of a row do not divide the threads (d = 80: 10 chunks), the last few threads copy nothing.
    """
    RS = row_stride(D_PAD, True, SWIZZLED)
    ROW_CHUNKS = words_per_chunk_row(D_PAD, True)   # at most 32 (d <= 256): never more than the threads
    ROWS_PER_PASS = THREADS // ROW_CHUNKS
    COPYING = ROWS_PER_PASS * ROW_CHUNKS             # threads that copy
    PASSES = cdiv(ROWS, ROWS_PER_PASS)
    BUFFER_ROWS = BUFFER_ROWS or ROWS

    PASS_IN_ONE_BUFFER = BUFFER_ROWS % ROWS_PER_PASS == 0   # d = 64 and 128: a pass never straddles two
    # Swizzled, a thread's chunk moves with its row modulo 8: the same in every pass when passes are 8k rows.
    SAME_SWIZZLE = ROWS_PER_PASS % 8 == 0

    @inlined_device_function
    def row_at(r, i):
        """Words from the tile's start to pass i's row r + i ROWS_PER_PASS (constant but for r, once the
        passes are unrolled)."""
        if PASS_IN_ONE_BUFFER:
            first = i * ROWS_PER_PASS
            return (first // BUFFER_ROWS) * BUFFER_WORDS + (first % BUFFER_ROWS + r) * RS
        row = i * ROWS_PER_PASS + r
        return (row // BUFFER_ROWS) * BUFFER_WORDS + (row % BUFFER_ROWS) * RS

    @inlined_device_function
    def chunk_at(chunk, r, i):
        """Words from a row's start to the thread's chunk in pass i."""
        if not SWIZZLED:
            return 4 * chunk
        return 4 * swizzle(chunk, r if SAME_SWIZZLE else r + i * ROWS_PER_PASS)

    @inlined_device_function
    def copy_rows(smem, AT, X, base, stride, rows_valid, head_dim, tid):
        if COPYING < THREADS and tid >= COPYING:
            return
        r = tid // ROW_CHUNKS
        c = (tid % ROW_CHUNKS) * 8                     # the thread's column of chunks, in elements
        # Words of X (pairs): rows are 16-byte aligned, so base, stride and c are even.
        chunk = (base >> 1) + r * (stride >> 1) + (c >> 1)
        step = ROWS_PER_PASS * (stride >> 1)
        if rows_valid >= ROWS and head_dim >= D_PAD:   # every chunk inside: no tests
            for i in range(PASSES):
                if ROWS % ROWS_PER_PASS == 0 or r + i * ROWS_PER_PASS < ROWS:
                    copy_async16(smem, AT + row_at(r, i) + chunk_at(c >> 3, r, i), X, chunk + i * step, True)
        else:
            for i in range(PASSES):
                row = r + i * ROWS_PER_PASS
                if ROWS % ROWS_PER_PASS == 0 or row < ROWS:
                    inside = row < rows_valid and c < head_dim
                    # Outside, the copy reads nothing but still needs an address in X: the tile's first row.
                    copy_async16(smem, AT + row_at(r, i) + chunk_at(c >> 3, r, i), X,
                                 chunk + i * step if inside else base >> 1, inside)

    return copy_rows, copy_async_wait_all


@inlined_device_function
def log2_lse(lse):
    """lse in log2 units; +inf for a row that attended to nothing, so that exp2(s - it) = 0 (the backwards)."""
    return lse * float32(LOG2_E) if lse != float32(-math.inf) else float32(math.inf)


@inlined_device_function
def row_lse(m_log2, l_row):
    """A row's log-sum-exp from its running max in log2 units and its sum l: m ln 2 + log l, as one explicit FMA.
    Left to the compiler, the product was fused into the sum in the forward with 32-row warps and not in the one
    with 16 (hoisted above a branch), and the two lse came out 1 ulp apart (H200, 2026-12-02: l = 1 + 1 ulp, a
    single key); written out, every kernel rounds it once.  -inf for a row that saw no allowed key (l = 0)."""
    return cuda.fma(m_log2, float32(1 / LOG2_E), math.log(l_row)) if l_row != float32(0) else float32(NEG_INF)


@inlined_device_function
def warp_lane(tid):
    """(warp, g, t) of a thread: its warp, and its lane as 4 g + t (the fragment layouts' names)."""
    lane = tid % 32
    return tid // 32, lane >> 2, lane & 3


@inlined_device_function
def lane_entry(i, g, t, warp):
    """(row, column) of lane (g, t) of warp ``warp``'s accumulator register i in a tile of 16-row warps: mma's C
    fragment and wgmma's accumulator alike (``hopper/wgmma.py``'s table: columns 8 (i // 4) + 2t and + 1, rows g and
    g + 8 of the warp's 16, whatever the width)."""
    return 16 * warp + g + 8 * ((i % 4) // 2), 8 * (i // 4) + 2 * t + i % 2


__all__ = ["INFINITY_BITS", "LOG2_E", "NEG_INF", "ROWS_PER_WARP", "allowed", "block_mask_arguments", "cache_rows",
           "ceil_div", "chunk_iterations", "chunk_loader", "dropout_arguments", "dropout_words", "entry_fits",
           "kernel_name", "lane_entry", "lse_slabs", "operand_extent", "pair_has_nan", "paging_arguments",
           "partly_masked_tiles", "row_lse", "sequence_arguments", "sequence_arrays", "sequence_bounds",
           "sequence_mode", "tile_coordinates", "tile_copier", "tile_movers", "warp_lane", "word_extent",
           "words_per_chunk_row"]
