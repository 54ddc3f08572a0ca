"""FlashAttention backward, Algorithm 4 of Dao et al. (2022), written literally.

The same shape as ``flash1_forward.py``: one thread block per (batch, head),
the outer loop over key/value blocks j, the inner loop over query blocks i.
dK_j and dV_j accumulate on chip (shared memory) across the inner loop and
are written once per outer iteration (line 24); dQ lives in device memory and
every inner iteration reads, updates and writes back its rows (line 21).
Thread r plays row r of the current query block for the row-wise steps; all
threads share the column-wise accumulations of dK_j and dV_j.

Names follow the paper (Q_i, K_j, V_j, dO_i, P_ij, dP_ij, dS_ij, D_i; dKt_j and
dVt_j are the on-chip accumulators, the paper's dK~_j and dV~_j).  Departures,
each marked where it happens:

* P_ij is rebuilt from the forward's log-sum-exp, P_ij = exp(S_ij - lse_i)
  (lines 11-13), instead of diag(l_i)^-1 exp(S_ij - m_i): lse_i = m_i + log l_i
  is the one statistic FlashAttention-2 keeps, and the same number;
* masked entries (causal, the block mask, keys past N_k) have P_ij = 0 and
  dS_ij = 0, and the products of lines 16, 21 and 22 run over the allowed
  entries only (0 * NaN is NaN: a NaN must reach only the gradients of
  entries allowed to see it); a row that attended to nothing (lse_i = -inf)
  has P_ij = 0 and dS_ij = 0; causal means key j is visible to query i iff
  j <= i + causal_offset;
* with a block mask, the inner iteration runs only if M_ij != 0 (Algorithm 5's
  test, its line 9, applied to the backward as the paper's block-sparse
  backward does);
* dropout (lines 14, 15, 18) regenerates the forward's mask from the
  counter-based generator of ``numba_flash.dropout``; nothing is stored
  (line 1's state R is the seed pair passed in).

Reorderings (same values, different order):

* line 19, D_i = rowsum(dO_i o O_i), is hoisted to the start of the inner
  iteration, before line 11: thread r needs it for every entry of its row at
  line 20, so it is computed once per (i, j) instead of between lines 18 and
  20 of each entry.  It is still recomputed for every j, as in the paper
  (FlashAttention-2 computes it once per row in a pass of its own);
* line 16 (dVt_j += (P_ij^dropped)^T dO_i) runs after line 21, fused with
  line 22 (dKt_j += tau dS_ij^T Q_i): both are sums over the tile's rows,
  column by column, and need every row of P_ij (resp. dS_ij) written first,
  so one barrier and one pass over dKt_j's and dVt_j's elements serve both;
* line 5 zeroes dK and dV in device memory; we do not: line 24 writes every
  element of dK_j and dV_j from the on-chip sums, so the zeros would be
  written and never read.  dQ is zeroed (line 5) because line 21 adds to it.

Barriers: four per inner iteration at most, each needed and justified where
it stands; the row-wise steps (lines 11-21) need none because thread r alone
touches row r of P_ij, dS_ij and dQ_i.
"""
import math
from functools import lru_cache

import numpy as np
from numba import cuda, float32

from ...dropout import NO_DROPOUT, dropout_weight
from ...runtime.arrays import placeholder
from ...runtime.launch import cuda_kernel, inlined_device_function, launch
from .tiles import load_rows, zero_tile


@lru_cache(maxsize=None)
def make_flash1_backward(BR, BC, D, CAUSAL, HAS_MASK, HAS_DROPOUT):
    """Algorithm 4 for B_r = BR, B_c = BC, head dim D (compile-time constants)."""

    @inlined_device_function
    def allowed(row, key, n_q, n_k, causal_offset):
        """Whether query ``row`` may attend to ``key`` (the block mask's test is per tile, above)."""
        return row < n_q and key < n_k and (not CAUSAL or key <= row + causal_offset)

    def kernel(Q, K, V, O, dO, LSE, dQ, dK, dV, scale, causal_offset, M, keep_threshold, keep_scale, seed0, seed1):
        # Q, O, dO, dQ: (BH, N_q, D); K, V, dK, dV: (BH, N_k, D); LSE: (BH, N_q);
        # M: (BH, T_r, T_c) uint8 block mask (if HAS_MASK); dropout keeps an entry
        # iff its generator word >= keep_threshold and scales it by keep_scale.
        # Alg. 4, line 1: the generator state R is the forward's (seed0, seed1).
        bh = cuda.blockIdx.x
        r = cuda.threadIdx.x
        n_q = Q.shape[1]
        n_k = K.shape[1]
        NEG_INF = float32(-math.inf)
        tau = float32(scale)
        # Alg. 4, line 2: B_r = BR, B_c = BC (the forward's, chosen on the host).
        # Alg. 4, lines 3-4: Q, O, dO, lse in T_r blocks of B_r rows; K, V in T_c
        # blocks of B_c rows, reached by index arithmetic (nothing is copied).
        T_r = (n_q + BR - 1) // BR
        T_c = (n_k + BC - 1) // BC

        Q_i = cuda.shared.array((BR, D), float32)
        dO_i = cuda.shared.array((BR, D), float32)
        K_j = cuda.shared.array((BC, D), float32)
        V_j = cuda.shared.array((BC, D), float32)
        dKt_j = cuda.shared.array((BC, D), float32)
        dVt_j = cuda.shared.array((BC, D), float32)
        P_ij = cuda.shared.array((BR, BC), float32)
        dS_ij = cuda.shared.array((BR, BC), float32)

        # Alg. 4, line 5: dQ = 0 in HBM (each thread the rows it will update);
        # dK, dV are not zeroed: line 24 writes every element of them.
        for i in range(T_r):
            row = i * BR + r
            if row < n_q:
                for x in range(D):
                    dQ[bh, row, x] = float32(0)

        # Alg. 4, line 6: outer loop over key/value blocks.
        for j in range(T_c):
            # Alg. 4, line 7: load K_j, V_j.
            # Barrier: no thread may still be reading the previous K_j, V_j (lines 11-22).
            cuda.syncthreads()
            load_rows(K_j, K, bh, j * BC, n_k, r, BR)
            load_rows(V_j, V, bh, j * BC, n_k, r, BR)
            # Alg. 4, line 8: dKt_j = dVt_j = 0 on chip.  Each thread zeroes the
            # elements it alone accumulates (lines 16 + 22) and writes (line 24):
            # no barrier needed for these.
            zero_tile(dKt_j, r, BR)
            zero_tile(dVt_j, r, BR)

            # Alg. 4, line 9: inner loop over query blocks.
            for i in range(T_r):
                # Alg. 5, line 9: if M_ij != 0 (uniform over the block, so all
                # threads skip together and every barrier below is reached by all or none).
                if HAS_MASK and M[bh, i, j] == 0:
                    continue
                # Alg. 4, line 10: load Q_i, dO_i into shared memory (all threads);
                # lse_i into a register, O_i and dQ_i read where used (own row).
                # Barrier: lines 16 + 22 of the previous i read every row of Q_i,
                # dO_i, P_ij and dS_ij; they must be done before we overwrite them.
                cuda.syncthreads()
                load_rows(Q_i, Q, bh, i * BR, n_q, r, BR)
                load_rows(dO_i, dO, bh, i * BR, n_q, r, BR)
                # Barrier: Q_i, dO_i (and K_j, V_j) complete before use.
                cuda.syncthreads()

                row = i * BR + r
                if row < n_q:
                    lse_i = LSE[bh, row]
                    # Alg. 4, line 19, hoisted: D_i = rowsum(dO_i o O_i), O_i from HBM.
                    D_i = float32(0)
                    for x in range(D):
                        D_i += dO_i[r, x] * O[bh, row, x]
                    for c in range(BC):
                        key = j * BC + c
                        # The block mask's test passed above; the rest is element-wise.
                        visible = allowed(row, key, n_q, n_k, causal_offset) and lse_i != NEG_INF
                        P = float32(0)
                        if visible:
                            # Alg. 4, lines 11-13: S_ij = tau Q_i K_j^T, P_ij = exp(S_ij - lse_i).
                            s = float32(0)
                            for x in range(D):
                                s += Q_i[r, x] * K_j[c, x]
                            P = math.exp(tau * s - lse_i)
                        # Alg. 4, line 14: Z_ij, the dropout weights (1 without dropout).
                        Z = (dropout_weight(bh, row, key, keep_threshold, keep_scale, seed0, seed1)
                             if HAS_DROPOUT else float32(1))
                        # Alg. 4, line 15: P_ij^dropped = P_ij o Z_ij (used at line 16).
                        P_ij[r, c] = P * Z
                        # Alg. 4, lines 17-18: dP_ij = (dO_i V_j^T) o Z_ij.
                        dP = float32(0)
                        for x in range(D):
                            dP += dO_i[r, x] * V_j[c, x]
                        # Alg. 4, line 20: dS_ij = P_ij o (dP_ij - D_i).
                        dS_ij[r, c] = P * (dP * Z - D_i) if visible else float32(0)
                    # Alg. 4, line 21: dQ_i <- dQ_i + tau dS_ij K_j, in HBM.
                    for x in range(D):
                        acc = float32(0)
                        for c in range(BC):
                            if allowed(row, j * BC + c, n_q, n_k, causal_offset):
                                acc += dS_ij[r, c] * K_j[c, x]
                        dQ[bh, row, x] += tau * acc
                else:  # rows past N_q contribute nothing to dKt_j, dVt_j
                    for c in range(BC):
                        P_ij[r, c] = float32(0)
                        dS_ij[r, c] = float32(0)
                # Barrier: lines 16 + 22 sum over every row of P_ij and dS_ij.
                cuda.syncthreads()

                # Alg. 4, line 16: dVt_j += (P_ij^dropped)^T dO_i, fused with
                # Alg. 4, line 22: dKt_j += tau dS_ij^T Q_i (both on chip).
                for e in range(r, BC * D, BR):
                    c = e // D
                    x = e % D
                    dv = float32(0)
                    dk = float32(0)
                    for rr in range(BR):
                        if allowed(i * BR + rr, j * BC + c, n_q, n_k, causal_offset):
                            dv += P_ij[rr, c] * dO_i[rr, x]
                            dk += dS_ij[rr, c] * Q_i[rr, x]
                    dVt_j[c, x] += dv
                    dKt_j[c, x] += tau * dk

            # Alg. 4, line 23 ends the inner loop.
            # Alg. 4, line 24: write dK_j <- dKt_j, dV_j <- dVt_j to HBM (each thread the
            # elements it accumulated, so no barrier).
            for e in range(r, BC * D, BR):
                c = e // D
                x = e % D
                key = j * BC + c
                if key < n_k:
                    dK[bh, key, x] = dKt_j[c, x]
                    dV[bh, key, x] = dVt_j[c, x]

    name = (f"flash1_backward_Br{BR}_Bc{BC}_d{D}" + ("_causal" if CAUSAL else "") + ("_sparse" if HAS_MASK else "")
            + ("_dropout" if HAS_DROPOUT else ""))
    return cuda_kernel(kernel, name)


def flash1_backward(q, k, v, o, do, lse, dq, dk, dv, *, scale, causal, causal_offset, block_sizes, block_layout=None,
                    dropout=None, stream=0):
    """Launch Algorithm 4 on device arrays ((BH, N, d) and lse (BH, N_q)).

    block_layout: None or a (BH, T_r, T_c) uint8 device array in blocks of ``block_sizes``;
    dropout: None or (keep_threshold, keep_scale, seed0, seed1) from ``numba_flash.dropout``.
    """
    # Alg. 4, line 2 happens here: the caller's B_r, B_c (the forward's).
    block_rows, block_cols = int(block_sizes[0]), int(block_sizes[1])
    kernel = make_flash1_backward(block_rows, block_cols, int(q.shape[2]), bool(causal), block_layout is not None,
                                  dropout is not None)
    keep_threshold, keep_scale, seed0, seed1 = NO_DROPOUT if dropout is None else dropout
    launch(kernel, q.shape[0], block_rows,
           (q, k, v, o, do, lse, dq, dk, dv, scale, causal_offset, placeholder(np.uint8, 3) if block_layout is None else block_layout,
            keep_threshold, keep_scale, seed0, seed1), stream=stream)
