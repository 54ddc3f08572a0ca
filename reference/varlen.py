"""Packed variable-length attention in float64: every sequence on its own, packed again.

q is (total_q, H_q, d) and k, v (total_k, H_kv, d), sequence b in rows
cu_q[b] .. cu_q[b + 1] - 1 (and cu_k[b] .. for keys), as flash-attn packs
them.  Each sequence is an ordinary (H, N_b, d) attention problem for
``attention`` and ``attention_backward``.
"""
import numpy as np

from .attention import attention
from .gradients import attention_backward


def _sequences(cu_q, cu_k):
    """(b, query rows, key rows) of every sequence, as slices."""
    return [(b, slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1])))
            for b in range(len(cu_q) - 1)]


def _alignment(causal):
    """A packed call's causal argument for one sequence: True is bottom-right, as flash-attn's varlen."""
    return "bottom_right" if causal is True else causal


def _heads_first(x):
    return np.swapaxes(np.asarray(x, dtype=np.float64), 0, 1)


def attention_varlen(q, k, v, cu_q, cu_k, *, scale=None, causal=False, dropout_keep=None, dropout_p=0.0):
    """(O (total_q, H_q, d), lse (H_q, total_q)).  ``dropout_keep``: the (batch, H_q, N_q, N_k) keep mask of
    ``numba_flash.dropout_mask``, of which sequence b uses [b, :, :N_q,b, :N_k,b]."""
    q = np.asarray(q, dtype=np.float64)
    out = np.zeros(q.shape)
    lse = np.full((q.shape[1], q.shape[0]), -np.inf)
    for b, rows, keys in _sequences(cu_q, cu_k):
        n_q, n_k = rows.stop - rows.start, keys.stop - keys.start
        if n_q == 0 or n_k == 0:   # no query, or nothing to attend to: O = 0, lse = -inf
            continue
        keep = None if dropout_keep is None else dropout_keep[b, :, :n_q, :n_k]
        o_b, lse_b = attention(_heads_first(q[rows]), _heads_first(k[keys]), _heads_first(v[keys]), scale=scale,
                               causal=_alignment(causal), dropout_keep=keep, dropout_p=dropout_p)
        out[rows] = np.swapaxes(o_b, 0, 1)
        lse[:, rows] = lse_b
    return out, lse


def attention_varlen_backward(q, k, v, do, cu_q, cu_k, *, scale=None, causal=False, dropout_keep=None,
                              dropout_p=0.0):
    """(dQ, dK, dV) of sum(O * dO) for O = attention_varlen(q, k, v, cu_q, cu_k, ...), packed like q, k, v."""
    q, k, v, do = (np.asarray(x, dtype=np.float64) for x in (q, k, v, do))
    dq, dk, dv = np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape)
    for b, rows, keys in _sequences(cu_q, cu_k):
        n_q, n_k = rows.stop - rows.start, keys.stop - keys.start
        if n_q == 0 or n_k == 0:
            continue
        keep = None if dropout_keep is None else dropout_keep[b, :, :n_q, :n_k]
        grads = attention_backward(_heads_first(q[rows]), _heads_first(k[keys]), _heads_first(v[keys]),
                                   _heads_first(do[rows]), scale=scale, causal=_alignment(causal),
                                   dropout_keep=keep, dropout_p=dropout_p)
        for out, where, grad in zip((dq, dk, dv), (rows, keys, keys), grads):
            out[where] = np.swapaxes(grad, 0, 1)
    return dq, dk, dv
