"""The warp-level tile products that flash2's forward and backward kernels share.

A warp owns M_TILES fragments of 16 rows (one in the backward; one or two in
the forward, ``tiling.flash2_forward_warp_rows``), each 16 x OTHER (OTHER:
the width of the tile it streams, in 8-wide column tiles), and multiplies
through the tensor cores (``primitives.py`` has the fragment layouts; lane =
4 g + t).  A warp's fragments of X column tiles are one local array of
M_TILES X rows: fragment m's column tile x is row m X + x, and the lane's
rows of the tile are g + 16 m and g + 16 m + 8 (its row r = 0, 1, 2, ... is
g + 8 r).

* ``rows_by_rows_t``: acc += A B^T with A and B row-major tiles in shared
  memory, contracting over the head dim: S = Q K^T, dP = dO V^T and the
  backward's transposes S^T = K Q^T, dP^T = V dO^T.  Each call starts from a
  zeroed fragment: one tile's dot products are short (d / 8 or d / 16 k-steps).
* ``accumulate_product``: acc = alpha acc + P B with P an accumulator
  fragment still in registers (the contraction runs over P's column tiles)
  and B (OTHER x d) in shared memory: O = alpha O + P V, and the backward's
  dV += P^T dO, dK += dS^T Q and dQ += dS K.  The product of one tile goes
  into a *fresh* fragment and is added into acc on the float32 units: the
  tensor cores' float32 accumulator truncates instead of rounding
  (``experiments/tuning/results/mma_accumulation.md``: a chain of 32768 tf32 steps
  is 1.5e-3 too small), so a chain that ran over every key tile made the
  error grow linearly in N.  One tile's chain is short; the adds across
  tiles round to nearest.  The fresh fragment covers CHUNK head-dim tiles at
  a time, so it costs 4 CHUNK registers, not d / 2.
* ``store_fragment_row`` (from ``fragment_row_store``): one of a lane's
  rows of its d-wide accumulators, scaled, to device memory: the forward's
  O_i and the backward's dK, dV and dQ; ``store_pair`` (from ``pair_store``)
  two neighbouring columns of a row, as it writes them.

For tf32 (k = 8) ``accumulate_product`` renumbers the accumulator's columns
(2t, 2t + 1) as k-indices t and t + 4 inside each k-step, and reads B with
the same renumbering (a sum over columns does not care about their order).
For 16-bit operands the accumulator layout is m16n8k16's A layout exactly.

16-bit fragments leave shared memory through ``ldmatrix`` (one instruction
for four or two 8x8 matrices, where each lane would issue as many 32-bit
loads), every tile row-major as it arrived: A and B of ``rows_by_rows_t``
as they are, B of ``accumulate_product`` (k x d) transposed on the way
(``ldmatrix.trans`` gives m16n8k16's B layout).  SASS before and after:
experiments/tuning/results/ldmatrix_sass.md.

float32 runs as 3xTF32: every operand is split once into tf32 hi and lo
halves (stored in two tiles, at ``*_HI`` and ``*_LO``), and each product is
lo*hi + hi*lo + hi*hi, float32-accurate.
"""
from functools import lru_cache

from numba import cuda, float32, uint32

from ...runtime.launch import inlined_device_function, unrolled
from ...tiling import SWIZZLE_CHUNKS, row_stride
from .primitives import (bf16_to_f32, half_to_f32, ldmatrix_x2, ldmatrix_x2_trans, ldmatrix_x4, load_word, mma_bf16,
                         mma_f16, mma_tf32, pack_bf16x2, pack_half2, store_word, tf32_round, f32_as_u32,
                         u32_as_f32)

#: Head-dim tiles that one fresh product fragment covers (4 registers each): 2 keeps flash2's forward
#: at 128 registers up to d = 64 (ptxas, tests/gpu_compile_all.py), with no loss in the products.
PRODUCT_CHUNK = 2


@inlined_device_function
def split_tf32(x):
    """x = hi + lo, both as tf32 bit patterns (3xTF32).

    hi is ``tf32_round`` (cvt.rna.tf32.f32), which keeps NaN and infinities.
    lo = x - hi is finite, or NaN when x is not finite: then lo is 0, so that
    hi alone carries the infinity or NaN through the product as IEEE
    arithmetic would.  A finite lo is rounded by adding half an ulp to its
    bits, which is exact for finite values and lets the compiler fold the
    NaN test into the select (with the instruction, SASS showed ~60% more
    instructions in the float32 forward's key-tile loop).
    """
    hi = tf32_round(x)
    rest = x - u32_as_f32(hi)
    return hi, (f32_as_u32(rest) + uint32(0x1000)) & uint32(0xFFFFE000) if rest == rest else uint32(0)


@inlined_device_function
def mma_3xtf32(a_hi0, a_hi1, a_hi2, a_hi3, a_lo0, a_lo1, a_lo2, a_lo3,
               b_hi0, b_hi1, b_lo0, b_lo1, c0, c1, c2, c3):
    """C + A B in float32 accuracy from three tf32 mma: lo*hi + hi*lo + hi*hi."""
    c0, c1, c2, c3 = mma_tf32(a_lo0, a_lo1, a_lo2, a_lo3, b_hi0, b_hi1, c0, c1, c2, c3)
    c0, c1, c2, c3 = mma_tf32(a_hi0, a_hi1, a_hi2, a_hi3, b_lo0, b_lo1, c0, c1, c2, c3)
    return mma_tf32(a_hi0, a_hi1, a_hi2, a_hi3, b_hi0, b_hi1, c0, c1, c2, c3)


def sixteen_bit_ops(PRECISION):
    """(mma, pack): the m16n8k16 instruction and the float32-pair packing of a 16-bit precision."""
    return (mma_f16, pack_half2) if PRECISION == "f16" else (mma_bf16, pack_bf16x2)


@lru_cache(maxsize=None)
def widening(PRECISION):
    """``widen(word)``: the element in the low 16 bits of ``word`` as float32 (exact), or a float32 as it is."""

    @inlined_device_function
    def widen(word):
        if PRECISION == "f16":
            return half_to_f32(uint32(word))
        if PRECISION == "bf16":
            return bf16_to_f32(uint32(word))
        return word

    return widen


@inlined_device_function
def swizzle(chunk, row):
    """Where logical 16-byte chunk ``chunk`` of ``row`` sits in a swizzled row (``tiling.swizzled_rows``)."""
    return chunk ^ (row % SWIZZLE_CHUNKS)


@lru_cache(maxsize=None)
def tile_products(OTHER, D_PAD, PRECISION, M_TILES=1, SWIZZLED=False):
    """(rows_by_rows_t, accumulate_product) for a streamed tile of OTHER rows and head dim D_PAD, for a warp
    that owns M_TILES fragments of 16 rows (module docstring: ``fragment [m, x]`` is row ``m * X + x``).
    SWIZZLED (16-bit): the streamed tiles, B of both products, have swizzled rows (``tiling.swizzled_rows``);
    A's stay padded."""
    SIXTEEN = PRECISION != "tf32x3"
    assert SIXTEEN or not SWIZZLED, "swizzled rows are 16-bit rows read by ldmatrix"
    RS = row_stride(D_PAD, SIXTEEN)
    RS_B = row_stride(D_PAD, SIXTEEN, SWIZZLED)    # words per row of B
    O_TILES = OTHER // 8            # 8-wide column tiles of a 16 x OTHER fragment
    D_TILES = D_PAD // 8
    QK_STEPS = D_PAD // (16 if SIXTEEN else 8)
    CHUNK = min(D_TILES, PRODUCT_CHUNK)
    ACC_ROWS = M_TILES * O_TILES    # rows of the warp's fragments of S-like products
    mma16, pack = sixteen_bit_ops(PRECISION) if SIXTEEN else (None, None)

    @inlined_device_function
    def mma_into(acc, i, a, a_lo, m, b0, b1, b_lo0, b_lo1):
        """acc[i] += A B for row fragment m of A (``a``; tf32: and its lo halves ``a_lo``) and one B fragment
        (tf32: its hi and lo halves; 16-bit operands read only b0, b1)."""
        if SIXTEEN:
            c0, c1, c2, c3 = mma16(a[m, 0], a[m, 1], a[m, 2], a[m, 3], b0, b1,
                                   acc[i, 0], acc[i, 1], acc[i, 2], acc[i, 3])
        else:
            c0, c1, c2, c3 = mma_3xtf32(a[m, 0], a[m, 1], a[m, 2], a[m, 3], a_lo[m, 0], a_lo[m, 1], a_lo[m, 2],
                                        a_lo[m, 3], b0, b1, b_lo0, b_lo1, acc[i, 0], acc[i, 1], acc[i, 2], acc[i, 3])
        acc[i, 0], acc[i, 1], acc[i, 2], acc[i, 3] = c0, c1, c2, c3

    @inlined_device_function
    def b_chunk_at(chunk, row):
        """Words from the start of a row of B (in both products) to its 16-byte chunk ``chunk``: ``swizzle`` where
        B's rows are swizzled (``row``: the row modulo 8 is what counts)."""
        return 4 * (swizzle(chunk, row) if SWIZZLED else chunk)

    def b_one_product_ahead(load_b, COUNT, b_address):
        """``products(acc, a, a_lo, smem, b_lane, x, y)`` (16-bit): acc[m * COUNT + c] += A_m B_c for the
        warp's M_TILES row fragments and COUNT B fragments, B_c = ``load_b(smem, b_lane, b_address(c, x, y))``,
        each loaded one product ahead, so that no mma waits on its own load."""
        @inlined_device_function
        def products(acc, a, a_lo, smem, b_lane, x, y):
            b0, b1 = load_b(smem, b_lane, b_address(0, x, y))
            for c in range(COUNT):
                if c + 1 < COUNT:
                    n0, n1 = load_b(smem, b_lane, b_address(c + 1, x, y))
                for m in range(M_TILES):
                    mma_into(acc, m * COUNT + c, a, a_lo, m, b0, b1, b0, b1)
                if c + 1 < COUNT:
                    b0, b1 = n0, n1

        return products

    @inlined_device_function
    def b_row_tile_at(ot, b_at, _):
        """Words from a lane's row of B to its chunk ``b_at`` in 8-row tile ``ot``."""
        return ot * 8 * RS_B + b_at

    b_rows_one_ahead = b_one_product_ahead(ldmatrix_x2, O_TILES, b_row_tile_at)

    @inlined_device_function
    def rows_by_rows_t(acc, smem, A_HI, A_LO, B_HI, B_LO, a_row0, g, t):
        """acc[m, ot] = A[a_row0 + 16 m + (g, g + 8), :] . B[8 ot + (2t, 2t + 1), :]^T over d (OTHER rows of B).

        Every B fragment loaded serves the warp's M_TILES row fragments: the reuse that lets a warp of 32
        rows read K_j from shared memory half as often per product as a warp of 16.
        """
        for i in range(ACC_ROWS):
            for e in range(4):
                acc[i, e] = float32(0)
        a = cuda.local.array((M_TILES, 4), uint32)      # A fragments (tf32: hi), one per 16 rows
        a_lo = cuda.local.array((M_TILES, 4), uint32)   # tf32 only: the lo halves
        # 16-bit fragments through ldmatrix: lane l names row l % 8 of matrix l // 8 (``primitives``).  A's
        # four matrices are (rows 0-7 | 8-15) x (k 0-7 | 8-15), rows fastest; B's two, of 8-row tile ot, are
        # k 0-7 and 8-15 (two, not four: B's registers stay as few as with 32-bit loads).
        row_in_matrix = 4 * (g & 1) + t
        matrix = g >> 1
        a_lane = A_HI + (a_row0 + (matrix & 1) * 8 + row_in_matrix) * RS + (matrix >> 1) * 4
        b_lane = B_HI + row_in_matrix * RS_B     # B's row (8 ot +) row_in_matrix; chunk 2 ks + (matrix & 1)
        for ks in range(QK_STEPS):
            if SIXTEEN:
                for m in range(M_TILES):
                    a[m, 0], a[m, 1], a[m, 2], a[m, 3] = ldmatrix_x4(smem, a_lane, m * 16 * RS + ks * 8)
                # The lane's chunk of B for this k-step (rows 8 ot + row_in_matrix: one swizzle for every ot).
                b_at = b_chunk_at(2 * ks + (matrix & 1), row_in_matrix)
                b_rows_one_ahead(acc, a, a_lo, smem, b_lane, b_at, 0)
            else:
                for m in range(M_TILES):
                    a_row = (a_row0 + 16 * m + g) * RS + ks * 8 + t
                    for e in range(4):  # rows g, g + 8; k t, t + 4
                        at = a_row + (e & 1) * 8 * RS + (e >> 1) * 4
                        a[m, e] = load_word(smem, A_HI + at)
                        a_lo[m, e] = load_word(smem, A_LO + at)
                for ot in range(O_TILES):
                    b_row = (ot * 8 + g) * RS + ks * 8 + t
                    bh0, bh1 = load_word(smem, B_HI + b_row), load_word(smem, B_HI + b_row + 4)
                    bl0, bl1 = load_word(smem, B_LO + b_row), load_word(smem, B_LO + b_row + 4)
                    for m in range(M_TILES):
                        mma_into(acc, m * O_TILES + ot, a, a_lo, m, bh0, bh1, bl0, bl1)

    def product_chunk(FIRST, COUNT):
        """acc[m, FIRST:FIRST + COUNT] = alpha acc + (P . B)[m, FIRST:FIRST + COUNT], through a fresh fragment."""
        TILE_ROWS = M_TILES * COUNT

        @inlined_device_function
        def b_chunk_tile_at(c, ks, row_in_matrix):
            """Words from a lane's row of B (k-step ``ks``) to its chunk of d tile FIRST + c."""
            return ks * 16 * RS_B + b_chunk_at(FIRST + c, row_in_matrix)

        b_chunks_one_ahead = b_one_product_ahead(ldmatrix_x2_trans, COUNT, b_chunk_tile_at)

        @inlined_device_function
        def chunk(acc, alpha, p, smem, B_HI, B_LO, g, t):
            tile = cuda.local.array((TILE_ROWS, 4), float32)
            for i in range(TILE_ROWS):
                for e in range(4):
                    tile[i, e] = float32(0)
            a = cuda.local.array((M_TILES, 4), uint32)      # P as the A operand (tf32: hi), per 16 rows
            a_lo = cuda.local.array((M_TILES, 4), uint32)   # tf32 only: the lo halves
            if SIXTEEN:
                # Row-major B through ldmatrix.trans: lane l < 16 names row l % 8 of matrix l // 8, the
                # matrices (k 0-7 | 8-15) x (d tile FIRST + c): b0 and b1 of one d tile.  (x4 for two d tiles
                # at once held two registers more and spilled flash2's forward at its register cap.)
                row_in_matrix = 4 * (g & 1) + t
                b_lane = B_HI + (((g >> 1) & 1) * 8 + row_in_matrix) * RS_B   # rows 16 ks + this; chunk: d tile
                for ks in range(O_TILES // 2):
                    for m in range(M_TILES):
                        k0, k1 = m * O_TILES + 2 * ks, m * O_TILES + 2 * ks + 1
                        a[m, 0] = pack(p[k0, 0], p[k0, 1])
                        a[m, 1] = pack(p[k0, 2], p[k0, 3])
                        a[m, 2] = pack(p[k1, 0], p[k1, 1])
                        a[m, 3] = pack(p[k1, 2], p[k1, 3])
                    b_chunks_one_ahead(tile, a, a_lo, smem, b_lane, ks, row_in_matrix)
            else:
                for ks in range(O_TILES):
                    # k-index t <-> column 2t (c0, c2) and t + 4 <-> column 2t + 1 (c1, c3).
                    for m in range(M_TILES):
                        k = m * O_TILES + ks
                        a[m, 0], a_lo[m, 0] = split_tf32(p[k, 0])
                        a[m, 1], a_lo[m, 1] = split_tf32(p[k, 2])
                        a[m, 2], a_lo[m, 2] = split_tf32(p[k, 1])
                        a[m, 3], a_lo[m, 3] = split_tf32(p[k, 3])
                    for c in range(COUNT):
                        b_row = (ks * 8 + 2 * t) * RS + (FIRST + c) * 8 + g
                        bh0, bh1 = load_word(smem, B_HI + b_row), load_word(smem, B_HI + b_row + RS)
                        bl0, bl1 = load_word(smem, B_LO + b_row), load_word(smem, B_LO + b_row + RS)
                        for m in range(M_TILES):
                            mma_into(tile, m * COUNT + c, a, a_lo, m, bh0, bh1, bl0, bl1)
            # Promote the tile's product into acc with round-to-nearest adds (one FMA each).
            for m in range(M_TILES):
                for c in range(COUNT):
                    i, o = m * COUNT + c, m * D_TILES + FIRST + c
                    acc[o, 0] = acc[o, 0] * alpha[2 * m] + tile[i, 0]
                    acc[o, 1] = acc[o, 1] * alpha[2 * m] + tile[i, 1]
                    acc[o, 2] = acc[o, 2] * alpha[2 * m + 1] + tile[i, 2]
                    acc[o, 3] = acc[o, 3] * alpha[2 * m + 1] + tile[i, 3]

        return chunk

    #: acc[m, dt] = alpha acc[m, dt] + (P . B)[m, dt]: P (16 M_TILES x OTHER) in accumulator fragments, B
    #: (OTHER x d) in shared memory (row-major at B_HI/B_LO for tf32, at B_HI for 16-bit); alpha[2 m] scales
    #: the lane's row g of fragment m, alpha[2 m + 1] its row g + 8.
    #: (Chained rather than looped over: NVVM does not unroll a loop over chunks at d = 128.)
    accumulate_product = unrolled([product_chunk(first, min(CHUNK, D_TILES - first))
                                   for first in range(0, D_TILES, CHUNK)])

    return rows_by_rows_t, accumulate_product


@lru_cache(maxsize=None)
def pair_store(PRECISION, VEC):
    """store_pair(X, out, col, x0, x1, head_dim): elements col and col + 1 of the row at X[out] (col even),
    those below head_dim.  X is flat: float32 elements, or for 16-bit outputs packed pairs (uint32, with VEC:
    d even, so a pair never straddles head_dim) or single 16-bit words (uint16)."""
    SIXTEEN = PRECISION != "tf32x3"
    pack = sixteen_bit_ops(PRECISION)[1] if SIXTEEN else None

    @inlined_device_function
    def store_pair(X, out, col, x0, x1, head_dim):
        if SIXTEEN:
            pair = pack(x0, x1)
            if VEC:  # columns col, col + 1 as one packed pair, word (out + col) / 2 by a shift: out + col is
                # never negative, and // would round a negative value down (some ten 64-bit instructions a store)
                if col < head_dim:
                    store_word(X, (out + col) >> 1, pair)
            else:
                if col < head_dim:
                    store_word(X, out + col, pair & uint32(0xFFFF))
                if col + 1 < head_dim:
                    store_word(X, out + col + 1, pair >> uint32(16))
        else:
            if col < head_dim:
                store_word(X, out + col, x0)
            if col + 1 < head_dim:
                store_word(X, out + col + 1, x1)

    return store_pair


@lru_cache(maxsize=None)
def fragment_row_store(D_PAD, PRECISION, VEC):
    """store_fragment_row(X, acc, r, out, head_dim, scale, t) for a warp's accumulator fragments of D_PAD columns.

    Writes the lane's row r (rows g + 8 r: r = 0, 1 in fragment 0, 2, 3 in fragment 1, ...), times scale, to
    X[out + c] for the lane's columns c = 8 dt + 2t, 8 dt + 2t + 1 below head_dim (``pair_store``'s X).
    """
    D_TILES = D_PAD // 8
    store_pair = pair_store(PRECISION, VEC)

    @inlined_device_function
    def store_fragment_row(X, acc, r, out, head_dim, scale, t):
        fragment, half = r // 2, r % 2
        for dt in range(D_TILES):
            store_pair(X, out, dt * 8 + 2 * t, acc[fragment * D_TILES + dt, 2 * half] * scale,
                       acc[fragment * D_TILES + dt, 2 * half + 1] * scale, head_dim)

    return store_fragment_row
