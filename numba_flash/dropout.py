"""Dropout masks from a counter-based generator (Philox-4x32-10).

Algorithm 2 drops entries of P with probability p and scales the kept ones
by 1/(1 - p); Algorithm 4 must drop exactly the same entries again.  Storing
an N x N mask would defeat the point, so the mask is a pure function of
(seed, batch*head index, query row, key column): Philox-4x32-10 (Salmon et
al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011) with key = the
64-bit seed and counter = (column // 4, row, batch*head, 0) gives four
32-bit words; word ``column % 4`` decides the entry, kept iff it is
>= ``threshold(p)`` = round(p * 2^32).  The comparison is on integers, so the
host (``dropout_mask``) and every kernel agree bit for bit.

``philox_4x32_10`` is written once with NumPy integer casts: called on NumPy
arrays it runs on the host; compiled by ``cuda.jit(device=True)`` it runs in
the kernels.
"""
import numpy as np
from numba import float32, uint32

from .runtime.launch import inlined_device_function

PHILOX_M0 = 0xD2511F53
PHILOX_M1 = 0xCD9E8D57
PHILOX_W0 = 0x9E3779B9  # key schedule increments (golden ratio, sqrt(3) - 1)
PHILOX_W1 = 0xBB67AE85
MASK32 = 0xFFFFFFFF


def philox_4x32_10(c0, c1, c2, c3, k0, k1):
    """Philox-4x32 with 10 rounds: four 32-bit counters, a 64-bit key -> four 32-bit words."""
    for _ in range(10):
        p0 = np.uint64(c0) * np.uint64(PHILOX_M0)
        p1 = np.uint64(c2) * np.uint64(PHILOX_M1)
        hi0, lo0 = np.uint32(p0 >> np.uint64(32)), np.uint32(p0 & np.uint64(MASK32))
        hi1, lo1 = np.uint32(p1 >> np.uint64(32)), np.uint32(p1 & np.uint64(MASK32))
        c0, c1, c2, c3 = (np.uint32(hi1 ^ np.uint32(c1) ^ np.uint32(k0)), lo1,
                          np.uint32(hi0 ^ np.uint32(c3) ^ np.uint32(k1)), lo0)
        k0 = np.uint32((np.uint64(k0) + np.uint64(PHILOX_W0)) & np.uint64(MASK32))
        k1 = np.uint32((np.uint64(k1) + np.uint64(PHILOX_W1)) & np.uint64(MASK32))
    return c0, c1, c2, c3


def threshold(p):
    """The 32-bit threshold below which an entry is dropped (round(p * 2^32), capped)."""
    return min(int(round(p * 2.0 ** 32)), 2 ** 32 - 1)


def seed_words(seed):
    """The two 32-bit key words of a (non-negative, < 2^64) seed."""
    if not 0 <= seed < 2 ** 64:
        raise ValueError(f"seed must be in [0, 2**64), got {seed}")
    return seed & MASK32, seed >> 32


def dropout_mask(shape, p, seed):
    """The boolean keep-mask (shape (..., N_q, N_k)) that the kernels use for (p, seed).

    Entry [..., i, j] is True where attention(..., dropout_p=p, seed=seed)
    keeps P[..., i, j] (and scales it by 1/(1 - p)).  The leading dims are
    flattened in C order to the batch*head index, as the kernels see them.
    """
    shape = tuple(int(n) for n in shape)
    if len(shape) < 2:
        raise ValueError(f"shape must be (..., N_q, N_k), got {shape}")
    if not 0.0 <= p < 1.0:
        raise ValueError(f"p must be in [0, 1), got {p}")
    n_q, n_k = shape[-2:]
    heads = int(np.prod(shape[:-2], dtype=np.int64))
    bh, row, col = np.meshgrid(np.arange(heads, dtype=np.uint32), np.arange(n_q, dtype=np.uint32),
                               np.arange(n_k, dtype=np.uint32), indexing="ij")
    k0, k1 = seed_words(seed)
    words = philox_4x32_10(col // np.uint32(4), row, bh, np.zeros_like(bh), np.uint32(k0), np.uint32(k1))
    lane = col % np.uint32(4)
    chosen = np.select([lane == 0, lane == 1, lane == 2], words[:3], words[3])
    return (chosen >= threshold(p)).reshape(shape)


def kernel_args(p, seed):
    """(keep_threshold, keep_scale, seed0, seed1): what a kernel needs to apply dropout."""
    seed0, seed1 = seed_words(seed)
    return threshold(p), 1.0 / (1.0 - p), seed0, seed1


#: The device version for the kernels (same source, so the same bits).  Inlined by LLVM: inlined
#: by Numba inside the kernels' loops, NVVM 13 rejects it once compiled with line info.
philox_device = inlined_device_function(philox_4x32_10)


@inlined_device_function
def dropout_weight(bh, row, col, keep_threshold, keep_scale, seed0, seed1):
    """Z of Algorithm 2 for entry (bh, row, col): 1/(1-p) if kept, else 0."""
    words = philox_device(uint32(col // 4), uint32(row), uint32(bh), uint32(0), uint32(seed0), uint32(seed1))
    lane = col % 4
    word = words[0] if lane == 0 else (words[1] if lane == 1 else (words[2] if lane == 2 else words[3]))
    return float32(keep_scale) if word >= keep_threshold else float32(0)


#: Placeholder arguments for kernels compiled without dropout (never read).
NO_DROPOUT = (0, 1.0, 0, 0)
