"""Exact attention in float64: the definition every kernel must reproduce."""
import numpy as np


def allowed_mask(n_q, n_k, *, causal=False, mask=None):
    """Boolean (..., n_q, n_k): True where query i may attend to key j.

    ``causal`` keeps j <= i (top-left aligned, as torch's ``is_causal=True``);
    ``mask`` (boolean, broadcastable) is AND-ed in.
    """
    allowed = np.ones((n_q, n_k), dtype=bool)
    if causal:
        allowed = np.arange(n_k)[None, :] <= np.arange(n_q)[:, None]
    if mask is not None:
        allowed = allowed & np.asarray(mask, dtype=bool)
    return allowed


def softmax(s, axis=-1):
    """Row softmax that maps an all -inf row to zeros instead of NaN."""
    m = np.max(s, axis=axis, keepdims=True)
    e = np.exp(s - np.where(np.isfinite(m), m, 0.0))
    total = np.sum(e, axis=axis, keepdims=True)
    return np.where(total > 0, e / np.where(total > 0, total, 1.0), 0.0)


def masked_scores(q, k, *, scale=None, causal=False, mask=None):
    """S = scale * Q K^T in float64, with forbidden entries set to -inf."""
    q, k = (np.asarray(x, dtype=np.float64) for x in (q, k))
    if scale is None:
        scale = 1.0 / np.sqrt(q.shape[-1])
    s = scale * (q @ np.swapaxes(k, -1, -2))
    return np.where(allowed_mask(q.shape[-2], k.shape[-2], causal=causal, mask=mask), s, -np.inf)


def dropout_weights(keep, p):
    """Z of Algorithm 2: 1/(1-p) where kept, 0 where dropped (1 without dropout)."""
    return 1.0 if keep is None else np.where(keep, 1.0 / (1.0 - p), 0.0)


def attention(q, k, v, *, scale=None, causal=False, mask=None, dropout_keep=None, dropout_p=0.0):
    """softmax(scale * Q K^T, masked) V and the row log-sum-exp, in float64.

    q: (..., N_q, d), k and v: (..., N_k, d).  Returns (O, lse) with
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
    return p @ np.asarray(v, dtype=np.float64), np.where(np.isfinite(m), lse, -np.inf)
