"""Gradients of attention in float64, written out from the chain rule.

With S = tau Q K^T (masked), P = softmax(S), Z the dropout weights
(1/(1-p) kept, 0 dropped, 1 without dropout) and O = (P * Z) V:

    dV = (P * Z)^T dO
    dP = (dO V^T) * Z
    D  = rowsum(dP * P) = rowsum(dO * O)      (Algorithm 4's D_i)
    dS = P * (dP - D)
    dQ = tau dS K,   dK = tau dS^T Q

With grouped-query heads dK and dV are summed over the query heads that
read each key/value head.  Checked against finite differences in
tests/test_reference.py.
"""
import numpy as np

from .attention import dropout_weights, masked_scores, repeat_kv, softmax


def attention_backward(q, k, v, do, *, scale=None, causal=False, mask=None, dropout_keep=None, dropout_p=0.0):
    """(dQ, dK, dV) of sum(O * dO) for O = attention(q, k, v, ...), in float64."""
    q, k, v, do = (np.asarray(x, dtype=np.float64) for x in (q, k, v, do))
    kv_shape = k.shape
    if q.ndim >= 3:
        k, v = repeat_kv(k, q.shape[-3]), repeat_kv(v, q.shape[-3])
    if scale is None:
        scale = 1.0 / np.sqrt(q.shape[-1])
    p = softmax(masked_scores(q, k, scale=scale, causal=causal, mask=mask))
    z = dropout_weights(dropout_keep, dropout_p)
    dv = np.swapaxes(p * z, -1, -2) @ do
    dp = (do @ np.swapaxes(v, -1, -2)) * z
    ds = p * (dp - np.sum(dp * p, axis=-1, keepdims=True))
    dk = scale * np.swapaxes(ds, -1, -2) @ q
    return scale * ds @ k, _sum_groups(dk, kv_shape), _sum_groups(dv, kv_shape)


def _sum_groups(grad, kv_shape):
    """A gradient over the repeated heads summed back onto the key/value heads of ``kv_shape``."""
    if grad.shape == kv_shape:
        return grad
    heads = kv_shape[-3]
    return grad.reshape(grad.shape[:-3] + (heads, grad.shape[-3] // heads) + grad.shape[-2:]).sum(axis=-3)
