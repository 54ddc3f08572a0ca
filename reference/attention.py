"""Exact attention in float64: the definition every kernel must reproduce."""
import numpy as np


def allowed_mask(n_q, n_k, *, causal=False, mask=None):
    """Boolean (..., n_q, n_k): True where query i may attend to key j.

    ``causal``: True or "top_left" keeps j <= i (as torch's ``is_causal=True``),
    "bottom_right" keeps j <= i + n_k - n_q (as flash-attn); ``mask``
    (boolean, broadcastable) is AND-ed in.
    """
    allowed = np.ones((n_q, n_k), dtype=bool)
    if causal:
        offset = n_k - n_q if causal == "bottom_right" else 0
        allowed = np.arange(n_k)[None, :] <= np.arange(n_q)[:, None] + offset
    if mask is not None:
        allowed = allowed & np.asarray(mask, dtype=bool)
    return allowed


def softmax(s, axis=-1):
    """Row softmax that maps an all -inf row to zeros instead of NaN."""
    m = np.max(s, axis=axis, keepdims=True)
    e = np.exp(s - np.where(np.isfinite(m), m, 0.0))
    total = np.sum(e, axis=axis, keepdims=True)
    return np.where(total > 0, e / np.where(total > 0, total, 1.0), 0.0)


def repeat_kv(x, heads):
    """k or v (..., H_kv, N, d) with each head repeated for the heads // H_kv query heads that read it.

    Grouped-query attention (torch's ``enable_gqa=True``): query head h reads
    key/value head h // (H_q // H_kv).
    """
    x = np.asarray(x)
    if x.ndim < 3 or x.shape[-3] == heads:
        return x
    return np.repeat(x, heads // x.shape[-3], axis=-3)


def masked_scores(q, k, *, scale=None, causal=False, mask=None):
    """S = scale * Q K^T in float64, with forbidden entries set to -inf."""
    q, k = np.asarray(q, dtype=np.float64), np.asarray(k, dtype=np.float64)
    k = repeat_kv(k, q.shape[-3]) if q.ndim >= 3 else k
    if scale is None:
        scale = 1.0 / np.sqrt(q.shape[-1])
    s = scale * (q @ np.swapaxes(k, -1, -2))
    return np.where(allowed_mask(q.shape[-2], k.shape[-2], causal=causal, mask=mask), s, -np.inf)


def dropout_weights(keep, p):
    """Z of Algorithm 2: 1/(1-p) where kept, 0 where dropped (1 without dropout)."""
    return 1.0 if keep is None else np.where(keep, 1.0 / (1.0 - p), 0.0)


def attention(q, k, v, *, scale=None, causal=False, mask=None, dropout_keep=None, dropout_p=0.0):
    """softmax(scale * Q K^T, masked) V and the row log-sum-exp, in float64.

    q: (..., H_q, N_q, d), k and v: (..., H_kv, N_k, d) (``repeat_kv``).  Returns (O, lse) with
    lse = log sum_j exp(S_ij) over allowed j; a row with no allowed key gives
    O = 0 and lse = -inf.  With dropout (Algorithm 2), ``dropout_keep`` is the
    boolean keep mask (``numba_flash.dropout_mask``): O = (P * Z) V with
    Z = keep / (1 - p), while lse is that of the undropped P.
    """
    s = masked_scores(q, k, scale=scale, causal=causal, mask=mask)
    m = np.max(s, axis=-1)
    with np.errstate(divide="ignore"):
        lse = m + np.log(np.sum(np.exp(s - np.where(np.isfinite(m), m, 0.0)[..., None]), axis=-1))
    p = softmax(s) * dropout_weights(dropout_keep, dropout_p)
    v = repeat_kv(np.asarray(v, dtype=np.float64), s.shape[-3]) if s.ndim >= 3 else np.asarray(v, np.float64)
    return p @ v, np.where(np.isfinite(m), lse, -np.inf)
