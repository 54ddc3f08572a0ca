"""FlashAttention forward, Algorithm 1 of Dao et al. (2022), written literally.

With a block mask it is Algorithm 5 (block-sparse FlashAttention): the
inner iteration runs only ``if M_ij != 0``, and the kernel's tiles are the
mask's blocks.

One thread block per (batch, head) runs the paper's two loops in the paper's
order: the outer loop over key/value blocks j, the inner loop over query
blocks i.  O, l and m live in device memory (HBM); every inner iteration
loads them (line 8) and writes them back (lines 12-13), which is exactly the
traffic Theorem 2 counts.  Thread r of the block plays row r of the current
query block; all threads share the work of loading tiles.  Clarity over
speed: ``kernels/fast/forward.py`` is the fast kernel.

Names follow the paper: Q_i, K_j, V_j, S_ij (shared-memory tiles), m_i, l_i,
mt_ij (m tilde), lt_ij (l tilde), m_new, l_new.  Departures, each marked
where it happens:

* the softmax scale tau enters at line 9, as in Algorithm 2 (line 10 there);
* masked entries (causal, or keys past N_k in a ragged last block) are -inf
  in S_ij, as Algorithm 2's MASK; causal means key j is visible to query i
  iff j <= i + causal_offset (0: top-left aligned, N_k - N_q: bottom-right);
* a row that has not met an allowed key yet keeps O = 0, l = 0, m = -inf:
  the paper's exp(m_i - m_new) would be exp(-inf + inf) = NaN there, so we
  define such rescale factors as 0;
* after the loops each thread writes lse = m + log(l) for its rows, the one
  statistic FlashAttention-2 and the backward pass keep;
* line 12's product Pt_ij V_j runs over the allowed keys only: a masked
  weight is 0, but 0 * NaN is NaN, and a NaN value row must reach only the
  rows allowed to see it (NaN in q or k reaches them through S_ij);
* with dropout (Algorithm 2, line 14), Pt_ij is dropped and rescaled after
  line 11, so l and m see the undropped values; the mask comes from the
  counter-based generator of ``numba_flash.dropout`` (nothing stored: Algorithm
  2's line 1, the generator state R, is the seed pair passed in);
* line 8 loads Q_i into shared memory and l_i, m_i into registers; O_i is read
  from device memory element by element at line 12, where it is used (the same
  bytes Theorem 2 counts, without a B_r x d tile of SRAM for them);
* one barrier per outer step is more than the paper's loop needs (see line 8);
* lines 3 and 4 (the splits into blocks) copy nothing: they are the index
  arithmetic ``i * BR + r`` and ``j * BC + c``, tagged where T_r, T_c and
  this thread's row of block i are first computed.
"""
import math
from functools import lru_cache

import numpy as np
from numba import cuda, float32

from ...dropout import NO_DROPOUT, dropout_weight
from ...runtime.arrays import placeholder
from ...runtime.launch import cuda_kernel, launch
from .tiles import load_rows


@lru_cache(maxsize=None)
def make_flash1_forward(BR, BC, D, CAUSAL, HAS_MASK, HAS_DROPOUT):
    """Algorithm 1 (5 with HAS_MASK, 2's dropout with HAS_DROPOUT) for B_r = BR, B_c = BC, head dim D."""

    def kernel(Q, K, V, O, l, m, lse, scale, causal_offset, M, keep_threshold, keep_scale, seed0, seed1):
        # Q, O: (BH, N_q, D); K, V: (BH, N_k, D); l, m, lse: (BH, N_q), float32;
        # M: (BH, T_r, T_c) uint8 block mask (Algorithm 5), read only if HAS_MASK;
        # dropout keeps an entry iff its generator word >= keep_threshold
        # (Alg. 2, line 1: the generator state R is (seed0, seed1)).
        bh = cuda.blockIdx.x
        r = cuda.threadIdx.x
        n_q = Q.shape[1]
        n_k = K.shape[1]
        NEG_INF = float32(-math.inf)
        tau = float32(scale)
        # Alg. 1, line 1: B_r = BR, B_c = BC, compile-time constants chosen on
        # the host (tiling.line1_block_sizes is the paper's choice, the default).

        # Alg. 1, line 3: Q split into T_r blocks Q_i of B_r rows, K and V into
        # T_c blocks K_j, V_j of B_c rows.  Nothing is copied: block i of Q is
        # rows i * BR ... i * BR + BR - 1 of Q[bh], reached by index arithmetic
        # (the loads of lines 6 and 8).
        T_r = (n_q + BR - 1) // BR
        T_c = (n_k + BC - 1) // BC

        Q_i = cuda.shared.array((BR, D), float32)
        K_j = cuda.shared.array((BC, D), float32)
        V_j = cuda.shared.array((BC, D), float32)
        S_ij = cuda.shared.array((BR, BC), float32)

        # Alg. 1, line 2: O = 0, l = 0, m = -inf in HBM.  Thread r owns row r
        # of every query block, so it initialises exactly the rows it updates.
        for i in range(T_r):
            # Alg. 1, line 4: O, l and m split into T_r blocks O_i, l_i, m_i as Q
            # is: block i is the same rows, and this thread's row of it is
            # ``row`` (here, at line 8's loads and at the writes of lines 12-13).
            row = i * BR + r
            if row < n_q:
                for x in range(D):
                    O[bh, row, x] = float32(0)
                l[bh, row] = float32(0)
                m[bh, row] = NEG_INF

        # Alg. 1, line 5: outer loop over key/value blocks.
        for j in range(T_c):
            # Alg. 1, line 6: load K_j, V_j from HBM to SRAM (zeros past N_k).
            # Barrier: no thread may still be reading the previous K_j, V_j (line 9, 12).
            cuda.syncthreads()
            load_rows(K_j, K, bh, j * BC, n_k, r, BR)
            load_rows(V_j, V, bh, j * BC, n_k, r, BR)

            # Alg. 1, line 7: inner loop over query blocks.
            for i in range(T_r):
                # Alg. 5, line 9: if M_ij != 0, around the rest of the inner loop's
                # body (the same for every thread of the block, so the barriers
                # below are reached by all threads or none).
                if HAS_MASK and M[bh, i, j] == 0:
                    continue
                # Alg. 1, line 8: load Q_i (all threads) ...
                # Barrier: every thread loads elements of every row of Q_i, so no
                # thread may still be reading the previous Q_i (on the first i of
                # each j this repeats the barrier above: one extra per outer step).
                cuda.syncthreads()
                load_rows(Q_i, Q, bh, i * BR, n_q, r, BR)
                # Barrier: Q_i (and K_j, V_j) complete before any thread uses them.
                # S_ij needs none: thread r alone writes and reads its row r.
                cuda.syncthreads()

                row = i * BR + r
                if row < n_q:
                    # ... and O_i, l_i, m_i (this thread's row; O_i is read
                    # element by element at line 12).
                    m_i = m[bh, row]
                    l_i = l[bh, row]

                    # Alg. 1, line 9: S_ij = tau Q_i K_j^T (row r), masked -> -inf.
                    for c in range(BC):
                        key = j * BC + c
                        if key < n_k and (not CAUSAL or key <= row + causal_offset):
                            s = float32(0)
                            for x in range(D):
                                s += Q_i[r, x] * K_j[c, x]
                            S_ij[r, c] = tau * s
                        else:
                            S_ij[r, c] = NEG_INF

                    # Alg. 1, line 10: mt_ij = rowmax(S_ij), Pt_ij = exp(S_ij - mt_ij),
                    # lt_ij = rowsum(Pt_ij).  Pt_ij overwrites S_ij in place.
                    mt_ij = NEG_INF
                    for c in range(BC):
                        mt_ij = max(mt_ij, S_ij[r, c])
                    # A row with no allowed key in this tile: Pt_ij = 0 (not NaN).
                    shift = mt_ij if mt_ij != NEG_INF else float32(0)
                    lt_ij = float32(0)
                    for c in range(BC):
                        S_ij[r, c] = math.exp(S_ij[r, c] - shift)
                        lt_ij += S_ij[r, c]

                    # Alg. 1, line 11: m_new = max(m_i, mt_ij),
                    # l_new = exp(m_i - m_new) l_i + exp(mt_ij - m_new) lt_ij.
                    m_new = max(m_i, mt_ij)
                    alpha = math.exp(m_i - m_new) if m_i != NEG_INF else float32(0)
                    beta = math.exp(mt_ij - m_new) if mt_ij != NEG_INF else float32(0)
                    l_new = alpha * l_i + beta * lt_ij

                    # Alg. 2, line 14: Pt_ij^dropped = dropout(Pt_ij).  lt_ij and l_new
                    # above saw the undropped weights; only line 12's product sees these.
                    if HAS_DROPOUT:
                        for c in range(BC):
                            S_ij[r, c] *= dropout_weight(bh, row, j * BC + c, keep_threshold, keep_scale,
                                                         seed0, seed1)

                    # Alg. 1, line 12: O_i <- diag(l_new)^-1 (diag(l_i) exp(m_i - m_new) O_i
                    #                                        + exp(mt_ij - m_new) Pt_ij V_j).
                    # (l_new is 0 only while no allowed key has been seen; NaN goes through.)
                    if l_new != float32(0):
                        for x in range(D):
                            pv = float32(0)
                            for c in range(BC):
                                key = j * BC + c
                                if key < n_k and (not CAUSAL or key <= row + causal_offset):
                                    pv += S_ij[r, c] * V_j[c, x]
                            O[bh, row, x] = (l_i * alpha * O[bh, row, x] + beta * pv) / l_new

                    # Alg. 1, line 13: l_i <- l_new, m_i <- m_new.
                    l[bh, row] = l_new
                    m[bh, row] = m_new

        # Alg. 1, lines 14-15 end the loops.  Before line 16's return: the log-sum-exp of each row, -inf where nothing
        # was allowed.
        for i in range(T_r):
            row = i * BR + r
            if row < n_q:
                lse[bh, row] = m[bh, row] + math.log(l[bh, row]) if l[bh, row] != float32(0) else NEG_INF

    name = (f"flash1_forward_Br{BR}_Bc{BC}_d{D}" + ("_causal" if CAUSAL else "") + ("_sparse" if HAS_MASK else "")
            + ("_dropout" if HAS_DROPOUT else ""))
    return cuda_kernel(kernel, name)


def flash1_forward(q, k, v, o, l, m, lse, *, scale, causal, causal_offset, block_sizes, block_layout=None, dropout=None,
                   stream=0):
    """Launch Algorithm 1 on device arrays q, o (BH, N_q, d), k, v (BH, N_k, d).

    block_layout: None, or a (BH, T_r, T_c) uint8 device array of blocks of exactly
    ``block_sizes`` (Algorithm 5); dropout: None or ``numba_flash.dropout.kernel_args``.
    """
    # Alg. 1, line 1 happens here: B_r, B_c are the caller's (the API's default is
    # tiling.line1_block_sizes, the paper's formula clamped to what fits).
    block_rows, block_cols = block_sizes
    # Plain ints: a NumPy integer would reach the kernel as a run-time value,
    # not the compile-time constant the shared-array shapes need.
    kernel = make_flash1_forward(int(block_rows), int(block_cols), int(q.shape[2]), bool(causal), block_layout is not None,
                                 dropout is not None)
    launch(kernel, q.shape[0], block_rows,
           (q, k, v, o, l, m, lse, scale, causal_offset, placeholder(np.uint8, 3) if block_layout is None else block_layout)
           + (NO_DROPOUT if dropout is None else dropout), stream=stream)


__all__ = ["flash1_forward", "make_flash1_forward"]
