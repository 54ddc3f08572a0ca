"""Standard attention, Algorithm 0 of Dao et al. (2022): the baseline.

Three kernels, so that the N x N intermediates really travel through device
memory as the paper's baseline does:

1. ``batched_matmul``  S = tau Q K^T, written to HBM (N_q x N_k per head);
2. ``row_softmax``     reads S, writes P = softmax(mask(S)) and the row lse;
3. ``batched_matmul``  O = P V, reading P back from HBM.

The two products share one 16x16 shared-memory tiled kernel (the numba-cuda
matmul example, batched, with an optional transpose of B).  Masking happens
in the softmax kernel, which sees every score: entries that the causal mask
(key j visible to query i iff j <= i + causal_offset) or the block mask
(element (i, j) allowed iff layout[i // B_r, j // B_c]) forbids count as
-inf there, and an all-masked row yields P = 0, lse = -inf.

NaN follows torch's math backend, which is also three separate steps: a
NaN logit makes its row NaN, and a NaN in V reaches every row of its head
through O = P V (a masked weight is 0, and 0 * NaN is NaN); the flash
kernels confine it to the rows allowed to see it.

Every launch uses a 1-D grid (the batch*heads index decoded in the kernel),
so any number of heads fits gridDim.x.
"""
import math
from functools import lru_cache

import numpy as np
from numba import cuda, float32

from ...dropout import NO_DROPOUT, dropout_weight
from ...runtime.arrays import placeholder
from ...runtime.device import in_simulator
from ...runtime.launch import cuda_kernel, inlined_device_function, launch
from ...tiling import cdiv

# Launch shapes.  The simulator runs every CUDA thread as a Python thread, so
# it gets smaller blocks; the kernels' logic is the same for any of these.
#: The matmul computes MATMUL_TILE x MATMUL_TILE outputs per block, one per thread.
MATMUL_TILE = 4 if in_simulator() else 16
#: Threads cooperating on one row of S in the softmax (a power of two).
ROW_THREADS = 8 if in_simulator() else 128


@lru_cache(maxsize=None)
def make_batched_matmul(TILE, TRANSPOSE_B):
    """C[b] = alpha A[b] B[b] (or A[b] B[b]^T), float32, for a batch of matrices."""
    PADDED = TILE + 1  # a padded row: reading a column touches TILE different banks

    def kernel(A, B, C, alpha):
        n_rows = C.shape[1]
        n_cols = C.shape[2]
        col_tiles = (n_cols + TILE - 1) // TILE
        row_tiles = (n_rows + TILE - 1) // TILE
        col_tile = cuda.blockIdx.x % col_tiles             # a 1-D grid: (column tile, row tile, matrix)
        row_tile = cuda.blockIdx.x // col_tiles % row_tiles
        b = cuda.blockIdx.x // (col_tiles * row_tiles)
        tx = cuda.threadIdx.x
        ty = cuda.threadIdx.y
        row = row_tile * TILE + ty
        col = col_tile * TILE + tx
        inner = A.shape[2]
        A_tile = cuda.shared.array((TILE, TILE), float32)
        B_tile = cuda.shared.array((TILE, PADDED), float32)

        acc = float32(0)
        for t0 in range(0, inner, TILE):
            # Guarded loads: zeros outside the matrices keep the sum exact.
            A_tile[ty, tx] = A[b, row, t0 + tx] if row < n_rows and t0 + tx < inner else float32(0)
            if TRANSPOSE_B:  # B is (n_cols, inner): tile element (k, n) = B[n, k]
                n = col_tile * TILE + ty
                B_tile[tx, ty] = B[b, n, t0 + tx] if n < n_cols and t0 + tx < inner else float32(0)
            else:  # B is (inner, n_cols)
                B_tile[ty, tx] = B[b, t0 + ty, col] if t0 + ty < inner and col < n_cols else float32(0)
            cuda.syncthreads()  # both tiles loaded
            for kk in range(TILE):
                acc += A_tile[ty, kk] * B_tile[kk, tx]
            cuda.syncthreads()  # done reading before the next load overwrites
        if row < n_rows and col < n_cols:
            C[b, row, col] = float32(alpha) * acc

    return cuda_kernel(kernel, f"standard_matmul_{'abt' if TRANSPOSE_B else 'ab'}_tile{TILE}")


@inlined_device_function
def block_allowed(layout, b, row, col, block_rows, block_cols):
    """Whether the block mask allows element (row, col) of head b."""
    return layout[b, row // block_rows, col // block_cols] != 0


@lru_cache(maxsize=None)
def make_row_softmax(SOFTMAX_THREADS, CAUSAL, HAS_MASK, HAS_DROPOUT):
    """P = softmax(mask(S)) row by row (times the dropout weights), plus lse; one block per row."""

    def kernel(S, P, lse, causal_offset, layout, block_rows, block_cols, keep_threshold, keep_scale, seed0, seed1):
        # layout: (BH, T_r, T_c) uint8 block mask in blocks of (block_rows, block_cols).
        n_q = S.shape[1]
        n_k = S.shape[2]
        row = cuda.blockIdx.x % n_q          # a 1-D grid: (row, matrix)
        b = cuda.blockIdx.x // n_q
        t = cuda.threadIdx.x
        NEG_INF = float32(-math.inf)
        partial = cuda.shared.array(SOFTMAX_THREADS, float32)
        # Keys a query may see: all, or j <= row + causal_offset when causal.
        visible = max(0, min(n_k, row + causal_offset + 1)) if CAUSAL else n_k

        # Row maximum: each thread strides over the row, then a tree reduction.
        mx = NEG_INF
        for c in range(t, visible, SOFTMAX_THREADS):
            if not HAS_MASK or block_allowed(layout, b, row, c, block_rows, block_cols):
                mx = max(mx, S[b, row, c])
        partial[t] = mx
        stride = SOFTMAX_THREADS // 2
        while stride > 0:
            cuda.syncthreads()  # the previous level is written
            if t < stride:
                partial[t] = max(partial[t], partial[t + stride])
            stride //= 2
        cuda.syncthreads()  # partial[0] is the row max
        m = partial[0]
        shift = m if m != NEG_INF else float32(0)
        cuda.syncthreads()  # everyone read m before partial is reused

        total = float32(0)
        for c in range(t, visible, SOFTMAX_THREADS):
            if not HAS_MASK or block_allowed(layout, b, row, c, block_rows, block_cols):
                total += math.exp(S[b, row, c] - shift)
        partial[t] = total
        stride = SOFTMAX_THREADS // 2
        while stride > 0:
            cuda.syncthreads()
            if t < stride:
                partial[t] += partial[t + stride]
            stride //= 2
        cuda.syncthreads()  # partial[0] is the row sum
        l = partial[0]

        for c in range(t, n_k, SOFTMAX_THREADS):
            keep = c < visible and l != float32(0)  # l is 0 only when nothing is visible; NaN goes through
            if HAS_MASK and keep:
                keep = block_allowed(layout, b, row, c, block_rows, block_cols)
            weight = math.exp(S[b, row, c] - shift) / l if keep else float32(0)
            if HAS_DROPOUT:  # Algorithm 2: l and lse above use the undropped values
                weight *= dropout_weight(b, row, c, keep_threshold, keep_scale, seed0, seed1)
            P[b, row, c] = weight
        if t == 0:
            lse[b, row] = m + math.log(l) if l != float32(0) else NEG_INF

    name = (f"standard_row_softmax_t{SOFTMAX_THREADS}" + ("_causal" if CAUSAL else "") + ("_masked" if HAS_MASK else "")
            + ("_dropout" if HAS_DROPOUT else ""))
    return cuda_kernel(kernel, name)


def standard_attention(q, k, v, o, lse, s, p, *, scale, causal, causal_offset, block_layout=None, dropout=None, stream=0):
    """Algorithm 0 on device arrays; s and p are the (BH, N_q, N_k) HBM buffers.

    block_layout: None, or (layout, (B_r, B_c)) with layout a (BH, T_r, T_c) uint8 device array;
    dropout: None or ``numba_flash.dropout.kernel_args``.
    """
    bh, n_q, d = q.shape
    n_k = k.shape[1]
    # Alg. 0, line 1: S = tau Q K^T, written to HBM.
    tile = (MATMUL_TILE, MATMUL_TILE)
    launch(make_batched_matmul(MATMUL_TILE, True), cdiv(n_k, MATMUL_TILE) * cdiv(n_q, MATMUL_TILE) * bh, tile,
           (q, k, s, scale), stream=stream)
    # Alg. 0, line 2: read S, P = softmax(S), write P to HBM.
    layout, (block_rows, block_cols) = block_layout if block_layout is not None else (placeholder(np.uint8, 3), (1, 1))
    launch(make_row_softmax(ROW_THREADS, bool(causal), block_layout is not None, dropout is not None), n_q * bh, ROW_THREADS,
           (s, p, lse, causal_offset, layout, block_rows, block_cols) + (NO_DROPOUT if dropout is None else dropout),
           stream=stream)
    # Alg. 0, line 3: read P and V, O = P V, write O.
    launch(make_batched_matmul(MATMUL_TILE, False), cdiv(d, MATMUL_TILE) * cdiv(n_q, MATMUL_TILE) * bh, tile,
           (p, v, o, 1.0), stream=stream)
