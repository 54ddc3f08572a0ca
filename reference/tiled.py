"""Algorithm 1's tiling, in NumPy float64: the blockwise math without CUDA.

The loops, the blocks and the running statistics are exactly those of the
paper's Algorithm 1 (outer loop over K/V blocks j, inner loop over Q blocks
i); only the arithmetic is float64 and vectorised within a tile.  Comparing
this with ``attention`` tests the online-softmax algebra on its own.
"""
import math

import numpy as np

from .attention import allowed_mask


def flash1_tiled(q, k, v, *, block_sizes, scale=None, causal=False, mask=None):
    """Return (O, lse, l, m) for one head: q (N_q, d), k and v (N_k, d)."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    (n_q, d), n_k = q.shape, k.shape[0]
    b_r, b_c = block_sizes
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    allowed = np.broadcast_to(allowed_mask(n_q, n_k, causal=causal, mask=mask), (n_q, n_k))

    o, l, m = np.zeros((n_q, d)), np.zeros(n_q), np.full(n_q, -np.inf)  # line 2
    for j0 in range(0, n_k, b_c):  # line 5
        k_j, v_j = k[j0:j0 + b_c], v[j0:j0 + b_c]  # line 6
        for i0 in range(0, n_q, b_r):  # line 7
            rows = slice(i0, i0 + b_r)
            q_i, o_i, l_i, m_i = q[rows], o[rows], l[rows], m[rows]  # line 8
            s_ij = np.where(allowed[rows, j0:j0 + b_c], scale * q_i @ k_j.T, -np.inf)  # line 9
            mt_ij = s_ij.max(axis=1)  # line 10
            # A row with no allowed key in this tile contributes nothing
            # (exp(-inf - -inf) would be NaN).
            pt_ij = np.exp(s_ij - np.where(np.isfinite(mt_ij), mt_ij, 0.0)[:, None])
            lt_ij = pt_ij.sum(axis=1)
            m_new = np.maximum(m_i, mt_ij)  # line 11
            alpha = _exp_diff(m_i, m_new)
            beta = _exp_diff(mt_ij, m_new)
            l_new = alpha * l_i + beta * lt_ij
            seen = l_new > 0
            denominator = np.where(seen, l_new, 1.0)[:, None]
            o[rows] = np.where(seen[:, None],  # line 12
                               ((alpha * l_i)[:, None] * o_i + beta[:, None] * (pt_ij @ v_j)) / denominator,
                               0.0)
            l[rows], m[rows] = l_new, m_new  # line 13
    with np.errstate(divide="ignore"):
        lse = np.where(l > 0, m + np.log(l), -np.inf)
    return o, lse, l, m


def _exp_diff(a, b):
    """exp(a - b) with exp(-inf - -inf) taken as 0 (nothing seen yet)."""
    return np.where(np.isfinite(a), np.exp(a - np.where(np.isfinite(b), b, 0.0)), 0.0)
