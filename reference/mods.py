"""Attention with a score_mod and mask_mod in float64 NumPy: the definition the kernels' mods must reproduce.

The mods' Python functions are evaluated element by element (``np.vectorize``) on float64 copies of their
arrays, with b the flattened batch index and h the query head, as in the kernels::

    S_ij  = score_mod(scale q_i . k_j, b, h, i, j)     where mask_mod(b, h, i, j) (and causal, mask) allow (i, j)
    S_ij  = -inf                                        elsewhere
    O, lse = softmax(S) V, logsumexp(S)                 (a row with no allowed key: O = 0, lse = -inf)

The backward is the chain rule of ``gradients.py`` with dS multiplied by d score_mod / d score, taken from
``numba_flash.mods.derivative`` (the traced derivative, or the Mod's ``grad``), or, with ``slope="numeric"``,
from central differences of the score_mod (an independent check of the tracer).  Tiny shapes only: one Python
call per entry.
"""
import numpy as np

from .attention import allowed_mask, dropout_weights, repeat_kv, softmax
from .gradients import _sum_groups


def _grid(shape4):
    """Index arrays b, h, i, j broadcast over (B, H, N_q, N_k)."""
    B, H, n_q, n_k = shape4
    return (np.arange(B).reshape(B, 1, 1, 1), np.arange(H).reshape(1, H, 1, 1), np.arange(n_q).reshape(1, 1, n_q, 1),
            np.arange(n_k).reshape(1, 1, 1, n_k))


def _four(x):
    """x (..., H, N, d) (or (N, d): one head) as (B, H, N, d), B the flattened batch dims (the kernels' b)."""
    x = np.asarray(x, np.float64)
    lead = x.shape[:-2]
    heads = lead[-1] if lead else 1
    return x.reshape((-1, heads) + x.shape[-2:])


def _as_mod(mod, kind):
    from numba_flash.mods import as_mod
    return as_mod(mod, kind)


def mod_mask(mask_mod, shape4):
    """The mask_mod's verdicts, boolean (B, H, N_q, N_k)."""
    mask_mod = _as_mod(mask_mod, "mask_mod")
    if mask_mod is None:
        return np.ones(shape4, dtype=bool)
    arrays = mask_mod.host_arrays()
    verdict = np.vectorize(lambda b, h, i, j: bool(mask_mod.fn(int(b), int(h), int(i), int(j), *arrays)),
                           otypes=[bool])
    return np.broadcast_to(verdict(*_grid(shape4)), shape4)


def _score_eval(score_mod, fn, s, allowed):
    arrays = score_mod.host_arrays()
    b, h, i, j = np.broadcast_arrays(*_grid(s.shape))
    out = np.full(s.shape, -np.inf)
    for idx in zip(*np.nonzero(allowed)):
        out[idx] = fn(float(s[idx]), int(b[idx]), int(h[idx]), int(i[idx]), int(j[idx]), *arrays)
    return out


def _scores(q, k, scale, causal, mask, score_mod, mask_mod):
    """(raw scaled scores, modded scores with -inf where not allowed, allowed), all (B, H, N_q, N_k) float64."""
    q4 = _four(q)
    k4 = repeat_kv(_four(k), q4.shape[-3])
    if scale is None:
        scale = 1.0 / np.sqrt(q.shape[-1])
    raw = scale * (q4 @ np.swapaxes(k4, -1, -2))
    allowed = np.broadcast_to(allowed_mask(q4.shape[-2], k4.shape[-2], causal=causal), raw.shape)
    if mask is not None:   # broadcast to q's leading dims, then viewed as (B, H, N_q, N_k)
        leading = np.shape(q)[:-2] + raw.shape[-2:]
        allowed = allowed & np.broadcast_to(np.asarray(mask, bool), leading).reshape(raw.shape)
    allowed = allowed & mod_mask(mask_mod, raw.shape)
    score_mod = _as_mod(score_mod, "score_mod")
    if score_mod is None:
        s = np.where(allowed, raw, -np.inf)
    else:
        s = _score_eval(score_mod, score_mod.fn, raw, allowed)
    return raw, s, allowed, scale


def attention(q, k, v, *, scale=None, causal=False, mask=None, score_mod=None, mask_mod=None, dropout_keep=None,
              dropout_p=0.0):
    """(O, lse) in float64, shaped as q and q without d."""
    _, s, _, _ = _scores(q, k, scale, causal, mask, score_mod, mask_mod)
    m = np.max(s, axis=-1)
    with np.errstate(divide="ignore"):
        lse = m + np.log(np.sum(np.exp(s - np.where(np.isfinite(m), m, 0.0)[..., None]), axis=-1))
    p = softmax(s) * dropout_weights(dropout_keep, dropout_p)
    v4 = repeat_kv(_four(v), s.shape[1])
    shape = np.shape(q)
    return (p @ v4).reshape(shape), np.where(np.isfinite(m), lse, -np.inf).reshape(shape[:-1])


def score_slopes(score_mod, raw, allowed, slope="traced", step=1e-4):
    """d score_mod / d score at every allowed entry of ``raw`` (0 elsewhere)."""
    score_mod = _as_mod(score_mod, "score_mod")
    if score_mod is None:
        return allowed.astype(np.float64)
    if slope == "numeric":
        up = _score_eval(score_mod, score_mod.fn, raw + step, allowed)
        down = _score_eval(score_mod, score_mod.fn, raw - step, allowed)
        with np.errstate(invalid="ignore"):   # -inf - -inf where not allowed
            return np.where(allowed, (up - down) / (2 * step), 0.0)
    from numba_flash.mods import derivative
    return np.where(allowed, _score_eval(score_mod, derivative(score_mod), raw, allowed), 0.0)


def attention_backward(q, k, v, do, *, scale=None, causal=False, mask=None, score_mod=None, mask_mod=None,
                       dropout_keep=None, dropout_p=0.0, slope="traced"):
    """(dQ, dK, dV) of sum(O * dO), float64, with d score_mod / d score in dS (``slope``: "traced" or "numeric")."""
    raw, s, allowed, scale = _scores(q, k, scale, causal, mask, score_mod, mask_mod)
    q4, do4 = _four(q), _four(do)
    k4, v4 = (repeat_kv(_four(x), s.shape[1]) for x in (k, v))
    p = softmax(s)
    z = dropout_weights(dropout_keep, dropout_p)
    dv = np.swapaxes(p * z, -1, -2) @ do4
    dp = (do4 @ np.swapaxes(v4, -1, -2)) * z
    ds = p * (dp - np.sum(dp * p, axis=-1, keepdims=True)) * score_slopes(score_mod, raw, allowed, slope)
    dk = scale * np.swapaxes(ds, -1, -2) @ q4
    kv4 = _four(k).shape
    return ((scale * ds @ k4).reshape(np.shape(q)), _sum_groups(dk, kv4).reshape(np.shape(k)),
            _sum_groups(dv, kv4).reshape(np.shape(v)))
