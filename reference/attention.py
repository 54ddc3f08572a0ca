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


def attention(q, k, v, *, scale=None, causal=False, mask=None):
    """softmax(scale * Q K^T, masked) V and the row log-sum-exp, in float64.

    q: (..., N_q, d), k and v: (..., N_k, d).  Returns (O, lse) with
    lse = log sum_j exp(S_ij) over allowed j; a row with no allowed key gives
    O = 0 and lse = -inf.
    """
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    if scale is None:
        scale = 1.0 / np.sqrt(q.shape[-1])
    s = scale * (q @ np.swapaxes(k, -1, -2))
    allowed = allowed_mask(q.shape[-2], k.shape[-2], causal=causal, mask=mask)
    s = np.where(allowed, s, -np.inf)
    m = np.max(s, axis=-1)
    with np.errstate(divide="ignore"):
        lse = m + np.log(np.sum(np.exp(s - np.where(np.isfinite(m), m, 0.0)[..., None]), axis=-1))
    return softmax(s) @ v, np.where(np.isfinite(m), lse, -np.inf)
