"""The warp-level tile products that flash2's forward and backward kernels share.

A warp owns 16 rows of a 16 x OTHER fragment (OTHER: the width of the tile
it streams, in 8-wide column tiles) and multiplies through the tensor cores
(``primitives.py`` has the fragment layouts; lane = 4 g + t):

* ``rows_by_rows_t``: acc += A B^T with A and B row-major tiles in shared
  memory, contracting over the head dim: S = Q K^T, dP = dO V^T and the
  backward's transposes S^T = K Q^T, dP^T = V dO^T;
* ``store_fragment_row`` (from ``fragment_row_store``): one of a lane's
  two rows of a 16 x d accumulator, scaled, to device memory: the forward's
  O_i and the backward's dK, dV and dQ.
* ``regs_by_rows``: acc += P B with P an accumulator fragment still in
  registers (the contraction runs over P's column tiles) and B (OTHER x d)
  in shared memory: O += P V, and the backward's dV, dK and dQ.  For tf32
  (k = 8) the accumulator's columns (2t, 2t + 1) are renumbered as k-indices
  t and t + 4 inside each k-step, and B is read with the same renumbering
  (a sum over columns does not care about their order).  For float16 the
  accumulator layout is m16n8k16's A layout exactly, and B is read from a
  tile stored as interleaved row pairs (its B layout).

float32 runs as 3xTF32: every operand is split once into tf32 hi and lo
halves (stored in two tiles, at ``*_HI`` and ``*_LO``), and each product is
lo*hi + hi*lo + hi*hi, float32-accurate.  Shared rows are padded to strides
that make the 32 lanes of a fragment load hit 32 different banks.
"""
from functools import lru_cache

from numba import cuda
from numba.cuda.types import float16

from ...runtime.launch import inlined_device_function
from .primitives import load_word, mma_f16, mma_tf32, pack_half2, store_word, tf32_round, u32_as_f32


def padded_stride(words, residue):
    """The smallest stride >= words that is congruent to residue mod 32 (banks)."""
    return words + (residue - words) % 32


def row_stride(d_pad, is_f16):
    """Words per row of a row-major tile: tf32 words, or float16 pairs along d (4 mod 32: conflict-free)."""
    return padded_stride(d_pad // 2 if is_f16 else d_pad, 4)


def pair_stride(d_pad):
    """Words per row pair of a float16 tile stored as interleaved row pairs (8 mod 32)."""
    return padded_stride(d_pad, 8)


@cuda.jit(device=True, inline=True)
def split_tf32(x):
    """x = hi + lo, both as tf32 bit patterns (3xTF32)."""
    hi = tf32_round(x)
    return hi, tf32_round(x - u32_as_f32(hi))


@cuda.jit(device=True, inline=True)
def mma_3xtf32(a_hi0, a_hi1, a_hi2, a_hi3, a_lo0, a_lo1, a_lo2, a_lo3,
               b_hi0, b_hi1, b_lo0, b_lo1, c0, c1, c2, c3):
    """C + A B in float32 accuracy from three tf32 mma: lo*hi + hi*lo + hi*hi."""
    c0, c1, c2, c3 = mma_tf32(a_lo0, a_lo1, a_lo2, a_lo3, b_hi0, b_hi1, c0, c1, c2, c3)
    c0, c1, c2, c3 = mma_tf32(a_hi0, a_hi1, a_hi2, a_hi3, b_lo0, b_lo1, c0, c1, c2, c3)
    return mma_tf32(a_hi0, a_hi1, a_hi2, a_hi3, b_hi0, b_hi1, c0, c1, c2, c3)


@lru_cache(maxsize=None)
def tile_products(OTHER, D_PAD, IS_F16):
    """(rows_by_rows_t, regs_by_rows) for a streamed tile of OTHER rows and head dim D_PAD."""
    RS = row_stride(D_PAD, IS_F16)
    PS = pair_stride(D_PAD)
    O_TILES = OTHER // 8            # 8-wide column tiles of a 16 x OTHER fragment
    D_TILES = D_PAD // 8
    QK_STEPS = D_PAD // (16 if IS_F16 else 8)

    @cuda.jit(device=True, inline=True)
    def rows_by_rows_t(acc, smem, A_HI, A_LO, B_HI, B_LO, a_row0, g, t):
        """acc[ot] += A[a_row0 + (g, g + 8), :] . B[8 ot + (2t, 2t + 1), :]^T over d (OTHER rows of B)."""
        for ks in range(QK_STEPS):
            a_row = (a_row0 + g) * RS + ks * 8 + t
            if IS_F16:
                a0 = load_word(smem, A_HI + a_row)
                a1 = load_word(smem, A_HI + a_row + 8 * RS)
                a2 = load_word(smem, A_HI + a_row + 4)
                a3 = load_word(smem, A_HI + a_row + 8 * RS + 4)
                for ot in range(O_TILES):
                    b_row = B_HI + (ot * 8 + g) * RS + ks * 8 + t
                    c0, c1, c2, c3 = mma_f16(a0, a1, a2, a3, load_word(smem, b_row), load_word(smem, b_row + 4),
                                             acc[ot, 0], acc[ot, 1], acc[ot, 2], acc[ot, 3])
                    acc[ot, 0], acc[ot, 1], acc[ot, 2], acc[ot, 3] = c0, c1, c2, c3
            else:
                ah0 = load_word(smem, A_HI + a_row)
                ah1 = load_word(smem, A_HI + a_row + 8 * RS)
                ah2 = load_word(smem, A_HI + a_row + 4)
                ah3 = load_word(smem, A_HI + a_row + 8 * RS + 4)
                al0 = load_word(smem, A_LO + a_row)
                al1 = load_word(smem, A_LO + a_row + 8 * RS)
                al2 = load_word(smem, A_LO + a_row + 4)
                al3 = load_word(smem, A_LO + a_row + 8 * RS + 4)
                for ot in range(O_TILES):
                    b_row = (ot * 8 + g) * RS + ks * 8 + t
                    c0, c1, c2, c3 = mma_3xtf32(
                        ah0, ah1, ah2, ah3, al0, al1, al2, al3,
                        load_word(smem, B_HI + b_row), load_word(smem, B_HI + b_row + 4),
                        load_word(smem, B_LO + b_row), load_word(smem, B_LO + b_row + 4),
                        acc[ot, 0], acc[ot, 1], acc[ot, 2], acc[ot, 3])
                    acc[ot, 0], acc[ot, 1], acc[ot, 2], acc[ot, 3] = c0, c1, c2, c3

    @cuda.jit(device=True, inline=True)
    def regs_by_rows(acc, p, smem, B_HI, B_LO, g, t):
        """acc[dt] += P . B: P (16 x OTHER) in accumulator fragments, B (OTHER x d) in shared memory.

        B is a row-major tile at B_HI/B_LO for tf32, and an interleaved-pairs
        tile at B_HI for float16.
        """
        if IS_F16:
            for ks in range(O_TILES // 2):
                a0 = pack_half2(p[2 * ks, 0], p[2 * ks, 1])
                a1 = pack_half2(p[2 * ks, 2], p[2 * ks, 3])
                a2 = pack_half2(p[2 * ks + 1, 0], p[2 * ks + 1, 1])
                a3 = pack_half2(p[2 * ks + 1, 2], p[2 * ks + 1, 3])
                for dt in range(D_TILES):
                    b_row = B_HI + (ks * 8 + t) * PS + dt * 8 + g
                    c0, c1, c2, c3 = mma_f16(a0, a1, a2, a3, load_word(smem, b_row), load_word(smem, b_row + 4 * PS),
                                             acc[dt, 0], acc[dt, 1], acc[dt, 2], acc[dt, 3])
                    acc[dt, 0], acc[dt, 1], acc[dt, 2], acc[dt, 3] = c0, c1, c2, c3
        else:
            for ks in range(O_TILES):
                # k-index t <-> column 2t (c0, c2) and t + 4 <-> column 2t + 1 (c1, c3).
                ah0, al0 = split_tf32(p[ks, 0])
                ah1, al1 = split_tf32(p[ks, 2])
                ah2, al2 = split_tf32(p[ks, 1])
                ah3, al3 = split_tf32(p[ks, 3])
                for dt in range(D_TILES):
                    b_row = (ks * 8 + 2 * t) * RS + dt * 8 + g
                    c0, c1, c2, c3 = mma_3xtf32(
                        ah0, ah1, ah2, ah3, al0, al1, al2, al3,
                        load_word(smem, B_HI + b_row), load_word(smem, B_HI + b_row + RS),
                        load_word(smem, B_LO + b_row), load_word(smem, B_LO + b_row + RS),
                        acc[dt, 0], acc[dt, 1], acc[dt, 2], acc[dt, 3])
                    acc[dt, 0], acc[dt, 1], acc[dt, 2], acc[dt, 3] = c0, c1, c2, c3

    return rows_by_rows_t, regs_by_rows


@lru_cache(maxsize=None)
def fragment_row_store(D_PAD, IS_F16, VEC):
    """store_fragment_row(X, acc, h, out, head_dim, scale, t) for a 16 x D_PAD accumulator fragment.

    Writes row h of the lane's two (0: row g, 1: row g + 8), times scale, to
    X[out + c] for the lane's columns c = 8 dt + 2t, 8 dt + 2t + 1 below head_dim.
    X is flat: float32 or float16 elements, or for float16 with VEC packed pairs
    (d even, so a pair never straddles head_dim).
    """
    D_TILES = D_PAD // 8

    @inlined_device_function
    def store_fragment_row(X, acc, h, out, head_dim, scale, t):
        for dt in range(D_TILES):
            col = dt * 8 + 2 * t
            x0 = acc[dt, 2 * h] * scale
            x1 = acc[dt, 2 * h + 1] * scale
            if IS_F16 and VEC:  # columns col, col + 1 as one packed pair
                if col < head_dim:
                    store_word(X, (out + col) // 2, pack_half2(x0, x1))
            else:
                if col < head_dim:
                    store_word(X, out + col, float16(x0) if IS_F16 else x0)
                if col + 1 < head_dim:
                    store_word(X, out + col + 1, float16(x1) if IS_F16 else x1)

    return store_fragment_row
