"""FlashAttention backward, Algorithm 4 of Dao et al. (2022), written literally.

The same shape as ``flash1_forward.py``: one thread block per (batch, head),
the outer loop over key/value blocks j, the inner loop over query blocks i.
dK_j and dV_j accumulate on chip (shared memory) across the inner loop and
are written once per outer iteration (line 24); dQ lives in device memory and
every inner iteration reads, updates and writes back its rows (line 21).
Thread r plays row r of the current query block for the row-wise steps; all
threads share the column-wise accumulations of dK_j and dV_j.

Names follow the paper (Q_i, K_j, V_j, dO_i, P_ij, dP_ij, dS_ij, D_i).
Departures, each marked where it happens:

* P_ij is rebuilt from the forward's log-sum-exp, P_ij = exp(S_ij - lse_i),
  instead of from l_i and m_i (lse_i = m_i + log l_i: one statistic, as
  FlashAttention-2 keeps);
* masked entries (causal, the block mask, keys past N_k) have P_ij = 0 and
  dS_ij = 0, and the products of lines 16, 21 and 22 run over the allowed
  entries only (0 * NaN is NaN: a NaN must reach only the gradients of
  entries allowed to see it); a row that attended to nothing (lse_i = -inf)
  has P_ij = 0 and dS_ij = 0; causal means key j is visible to query i iff
  j <= i + causal_offset;
* with a block mask, the inner iteration runs only if M_ij != 0 (Algorithm 5's test);
* dropout (lines 14, 18) regenerates the forward's mask from the
  counter-based generator of ``numba_flash.dropout``; nothing is stored.
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
        bh = cuda.blockIdx.x
        r = cuda.threadIdx.x
        n_q = Q.shape[1]
        n_k = K.shape[1]
        T_r = (n_q + BR - 1) // BR
        T_c = (n_k + BC - 1) // BC
        NEG_INF = float32(-math.inf)
        tau = float32(scale)

        Q_i = cuda.shared.array((BR, D), float32)
        dO_i = cuda.shared.array((BR, D), float32)
        K_j = cuda.shared.array((BC, D), float32)
        V_j = cuda.shared.array((BC, D), float32)
        dK_j = cuda.shared.array((BC, D), float32)
        dV_j = cuda.shared.array((BC, D), float32)
        P_ij = cuda.shared.array((BR, BC), float32)
        dS_ij = cuda.shared.array((BR, BC), float32)

        # Alg. 4, line 5: dQ = 0 in HBM (each thread the rows it will update).
        for i in range(T_r):
            row = i * BR + r
            if row < n_q:
                for x in range(D):
                    dQ[bh, row, x] = float32(0)

        # Alg. 4, line 6: outer loop over key/value blocks.
        for j in range(T_c):
            # Alg. 4, lines 7-8: load K_j, V_j; dK_j = dV_j = 0 on chip.
            cuda.syncthreads()  # nobody still reads the previous K_j, V_j, dK_j, dV_j
            load_rows(K_j, K, bh, j * BC, n_k, r, BR)
            load_rows(V_j, V, bh, j * BC, n_k, r, BR)
            zero_tile(dK_j, r, BR)
            zero_tile(dV_j, r, BR)

            # Alg. 4, line 9: inner loop over query blocks.
            for i in range(T_r):
                # Algorithm 5's test (uniform over the block, so all threads skip together).
                if HAS_MASK and M[bh, i, j] == 0:
                    continue
                # Alg. 4, line 10: load Q_i, dO_i (all threads); O_i, dQ_i, lse_i (own row).
                cuda.syncthreads()  # nobody still reads the previous Q_i, dO_i, P_ij, dS_ij
                load_rows(Q_i, Q, bh, i * BR, n_q, r, BR)
                load_rows(dO_i, dO, bh, i * BR, n_q, r, BR)
                cuda.syncthreads()  # Q_i, dO_i (and K_j, V_j) complete

                row = i * BR + r
                if row < n_q:
                    lse_i = LSE[bh, row]
                    # Alg. 4, line 19: D_i = rowsum(dO_i o O_i).
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
                        # Alg. 4, line 15: P_ij^dropped = P_ij o Z_ij (used for dV_j).
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
                else:  # rows past N_q contribute nothing to dK_j, dV_j
                    for c in range(BC):
                        P_ij[r, c] = float32(0)
                        dS_ij[r, c] = float32(0)
                cuda.syncthreads()  # every row of P_ij, dS_ij is written

                # Alg. 4, line 16: dV_j += (P_ij^dropped)^T dO_i;
                # Alg. 4, line 22: dK_j += tau dS_ij^T Q_i (both on chip).
                for e in range(r, BC * D, BR):
                    c = e // D
                    x = e % D
                    dv = float32(0)
                    dk = float32(0)
                    for rr in range(BR):
                        if allowed(i * BR + rr, j * BC + c, n_q, n_k, causal_offset):
                            dv += P_ij[rr, c] * dO_i[rr, x]
                            dk += dS_ij[rr, c] * Q_i[rr, x]
                    dV_j[c, x] += dv
                    dK_j[c, x] += tau * dk

            # Alg. 4, line 24: write dK_j, dV_j to HBM (each thread the elements it accumulated).
            for e in range(r, BC * D, BR):
                c = e // D
                x = e % D
                key = j * BC + c
                if key < n_k:
                    dK[bh, key, x] = dK_j[c, x]
                    dV[bh, key, x] = dV_j[c, x]

    name = (f"flash1_backward_Br{BR}_Bc{BC}_d{D}" + ("_causal" if CAUSAL else "") + ("_sparse" if HAS_MASK else "")
            + ("_dropout" if HAS_DROPOUT else ""))
    return cuda_kernel(kernel, name)


def flash1_backward(q, k, v, o, do, lse, dq, dk, dv, *, scale, causal, causal_offset, block_sizes, block_layout=None,
                    dropout=None, stream=0):
    """Launch Algorithm 4 on device arrays ((BH, N, d) and lse (BH, N_q)).

    block_layout: None or a (BH, T_r, T_c) uint8 device array in blocks of ``block_sizes``;
    dropout: None or (keep_threshold, keep_scale, seed0, seed1) from ``numba_flash.dropout``.
    """
    block_rows, block_cols = int(block_sizes[0]), int(block_sizes[1])
    kernel = make_flash1_backward(block_rows, block_cols, int(q.shape[2]), bool(causal), block_layout is not None,
                                  dropout is not None)
    keep_threshold, keep_scale, seed0, seed1 = NO_DROPOUT if dropout is None else dropout
    launch(kernel, q.shape[0], block_rows,
           (q, k, v, o, do, lse, dq, dk, dv, scale, causal_offset, placeholder(np.uint8, 3) if block_layout is None else block_layout,
            keep_threshold, keep_scale, seed0, seed1), stream=stream)
