"""NaN in, NaN out: exactly the outputs and gradients allowed to see a NaN get one.

The expected NaN pattern is worked out here from the allowed-entries mask
alone (``nan_pattern``), independent of any kernel: a logit S_ij is NaN when
q_i or k_j holds one; a row's softmax is NaN when any allowed logit is; a
value row reaches the rows allowed to see it.  Every other output must equal
the float64 reference on the same inputs with the NaN replaced by 0 (those
outputs never read it).  The standard algorithm spreads a NaN value row to
its whole head, as torch's math backend does (O = P V with masked weights 0,
and 0 * NaN is NaN); the flash kernels confine it.
"""
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import numba_flash
import reference
from strategies import (BACKWARD_VARIANTS, FORWARD_VARIANTS, block_masks, causal_mask, flash1_fits, problems,
                        variants)
from tolerances import assert_close_to_reference, backward_tolerance


@dataclass
class Poisoned:
    """Where the NaNs are: per (batch*head) row flags of q, k, v, dO (k, v per key/value head)."""

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    do: np.ndarray


def flags_of(x):
    """(batch*heads, N) True where a row holds a NaN."""
    x = np.asarray(x, np.float64)
    return np.isnan(x).any(-1).reshape(-1, x.shape[-2])


def nan_pattern(allowed, bad, group):
    """Which outputs and gradients are NaN, from the allowed mask (BH, N_q, N_k) and the poisoned rows.

    Returns row flags for O, lse (BH, N_q), dQ (BH, N_q), and dK, dV (BH_kv, N_k).
    """
    k, v = (np.repeat(x, group, axis=0) for x in (bad.k, bad.v))      # per query head
    logit = allowed & (bad.q[:, :, None] | k[:, None, :])
    lse = logit.any(-1)                                                # lse_i and every allowed P_ij
    p = allowed & lse[:, :, None]
    o = lse | (allowed & v[:, None, :]).any(-1)
    dp = bad.do[:, :, None] | v[:, None, :]
    d = bad.do | o
    ds = allowed & (p | dp | d[:, :, None])
    dv = (allowed & (p | bad.do[:, :, None])).any(1)
    dk = (allowed & (ds | bad.q[:, :, None])).any(1)
    dq = (allowed & (ds | k[:, None, :])).any(-1)

    def per_kv_head(x):
        return x.reshape(-1, group, x.shape[-1]).any(1)

    return o, lse, dq, per_kv_head(dk), per_kv_head(dv)


def poison(data, x, n_rows_max=2):
    """x with NaN written into a few random elements (a copy)."""
    x = x.copy()
    flat = x.reshape(-1, x.shape[-1])
    for _ in range(data.draw(st.integers(0, n_rows_max))):
        flat[data.draw(st.integers(0, flat.shape[0] - 1)), data.draw(st.integers(0, x.shape[-1] - 1))] = np.nan
    return x


def without_nan(x):
    return np.where(np.isnan(np.asarray(x, np.float64)), 0, x).astype(x.dtype)


def allowed_of(p, bm):
    n_q, n_k = p.q.shape[-2], p.k.shape[-2]
    heads = int(np.prod(p.q.shape[:-2]))
    allowed = np.ones((n_q, n_k), bool)
    causal = causal_mask(p.causal, n_q, n_k)
    if causal is not None:
        allowed &= causal
    allowed = np.broadcast_to(allowed, p.q.shape[:-2] + (n_q, n_k))
    if bm is not None:
        allowed = allowed & bm.to_dense(n_q, n_k)
    return np.broadcast_to(allowed, p.q.shape[:-2] + (n_q, n_k)).reshape(heads, n_q, n_k)


def draw_case(data, algorithm, dtype):
    p = data.draw(problems(algorithm=algorithm, dtype=dtype, backward=True))
    bm = None
    if data.draw(st.booleans()):
        # flash1 runs with tiles equal to the mask's blocks: the problem's tiles, or (default tiles) any
        # blocks that its forward and backward can run.
        d = p.q.shape[-1]
        fits = (lambda blocks: flash1_fits(blocks, d, backward=True)) if algorithm == "flash1" else None
        bm = data.draw(block_masks(p.q.shape[-2], p.k.shape[-2], p.block_sizes if algorithm == "flash1" else None,
                                   fits=fits))[0]
    which = data.draw(st.sampled_from(["q", "k", "v", "all"]))
    for name in ("q", "k", "v"):
        if which in (name, "all"):
            setattr(p, name, poison(data, getattr(p, name)))
    return p, bm


def forward_call(p, algorithm, bm):
    blocks = bm.block_size if algorithm == "flash1" and bm is not None else p.block_sizes
    return dict(causal=p.causal, scale=p.scale, block_mask=bm, algorithm=algorithm, block_sizes=blocks)


@variants(FORWARD_VARIANTS)
@given(data=st.data())
def test_nan_reaches_exactly_the_rows_allowed_to_see_it(algorithm, dtype, data):
    p, bm = draw_case(data, algorithm, dtype)
    out, lse = numba_flash.attention(p.q, p.k, p.v, return_lse=True, **forward_call(p, algorithm, bm))
    allowed = allowed_of(p, bm)
    bad = Poisoned(flags_of(p.q), flags_of(p.k), flags_of(p.v), np.zeros(allowed.shape[:2], bool))
    nan_o, nan_lse, *_ = nan_pattern(allowed, bad, p.group)
    if algorithm == "standard":  # as torch's math backend: a NaN value row reaches its whole head
        nan_o = nan_o | np.repeat(bad.v.any(-1), p.group)[:, None]
    got_o = np.isnan(np.asarray(out, np.float64)).any(-1).reshape(nan_o.shape)
    assert np.array_equal(got_o, nan_o), f"NaN rows of O: {np.argwhere(got_o != nan_o)[:5]}"
    assert np.array_equal(np.isnan(lse).reshape(nan_lse.shape), nan_lse)
    # Every other row is what it would be without the NaNs.
    clean = dict(q=without_nan(p.q), k=without_nan(p.k), v=without_nan(p.v))
    ref_out, ref_lse = reference.attention(clean["q"], p.expanded(clean["k"]), p.expanded(clean["v"]), scale=p.scale,
                                           causal=p.causal, mask=None if bm is None else bm.to_dense(*allowed.shape[1:]))
    keep = ~nan_o.reshape(out.shape[:-1])
    keep_lse = ~nan_lse.reshape(out.shape[:-1])
    assert_close_to_reference(np.where(keep[..., None], out, 0), np.where(keep_lse, lse, ref_lse),
                              np.where(keep[..., None], ref_out, 0), ref_lse, clean["q"], p.expanded(clean["k"]),
                              p.expanded(clean["v"]), p.effective_scale, dtype)


@variants(BACKWARD_VARIANTS)
@given(data=st.data())
def test_nan_gradients_reach_exactly_the_entries_allowed_to_see_it(algorithm, dtype, data):
    p, bm = draw_case(data, algorithm, dtype)
    options = forward_call(p, algorithm, bm)
    out, lse = numba_flash.attention(p.q, p.k, p.v, return_lse=True, **options)
    rng = np.random.default_rng(data.draw(st.integers(0, 2 ** 32 - 1)))
    do = poison(data, rng.standard_normal(p.q.shape).astype(dtype), 1)
    options["block_sizes"] = options["block_sizes"] if algorithm == "flash1" else None
    grads = numba_flash.attention_backward(p.q, p.k, p.v, out, lse, do, **options)
    allowed = allowed_of(p, bm)
    bad = Poisoned(flags_of(p.q), flags_of(p.k), flags_of(p.v), flags_of(do))
    _, _, nan_dq, nan_dk, nan_dv = nan_pattern(allowed, bad, p.group)
    for name, got, want in zip(("dq", "dk", "dv"), grads, (nan_dq, nan_dk, nan_dv)):
        got_rows = np.isnan(np.asarray(got, np.float64)).any(-1).reshape(want.shape)
        assert np.array_equal(got_rows, want), f"NaN rows of {name}: {np.argwhere(got_rows != want)[:5]}"
    if not (bad.q.any() or bad.k.any() or bad.v.any() or bad.do.any()):
        # No NaN drawn: the gradients are the float64 ones.
        mask = None if bm is None else bm.to_dense(*allowed.shape[1:])
        expected = reference.attention_backward(p.q, p.k, p.v, do, scale=p.scale, causal=p.causal, mask=mask)
        weights = reference.softmax(reference.masked_scores(p.q, p.expanded(p.k), scale=p.scale, causal=p.causal,
                                                            mask=mask))
        tolerances = backward_tolerance(p.q, p.expanded(p.k), p.expanded(p.v), out, do, p.effective_scale, weights,
                                        dtype=dtype, group=p.group)
        for name, got, want, tol in zip(("dq", "dk", "dv"), grads, expected, tolerances):
            err = float(np.abs(np.asarray(got, np.float64) - want).max())
            assert err <= tol, f"{name}: max error {err:.3g} > tolerance {tol:.3g}"


@variants(FORWARD_VARIANTS)
def test_an_infinite_query_row_is_nan_as_torch_gives_it(algorithm, dtype):
    # +inf logits: softmax divides inf by inf.  A row that may see no key stays 0 (and lse -inf).
    rng = np.random.default_rng(5)
    q = rng.standard_normal((2, 20, 8)).astype(dtype)
    k = np.abs(rng.standard_normal((2, 20, 8))).astype(dtype)
    v = rng.standard_normal((2, 20, 8)).astype(dtype)
    q[1, 6] = np.inf
    out, lse = numba_flash.attention(q, k, v, return_lse=True, algorithm=algorithm)
    nan_rows = np.isnan(np.asarray(out, np.float64)).any(-1)
    assert nan_rows[1, 6] and nan_rows.sum() == 1 and np.isnan(lse[1, 6]) and np.isnan(lse).sum() == 1


@pytest.mark.parametrize("algorithm", ["flash1", "flash2"])
def test_a_row_that_may_see_no_key_is_zero_even_with_nan_in_its_query(algorithm):
    # bottom-right causal with N_q > N_k: the first N_q - N_k rows see nothing.
    rng = np.random.default_rng(6)
    q = rng.standard_normal((1, 24, 8)).astype(np.float32)
    k, v = (rng.standard_normal((1, 10, 8)).astype(np.float32) for _ in range(2))
    q[0, 3, 0] = np.nan
    v[0, 9, 0] = np.nan
    out, lse = numba_flash.attention(q, k, v, causal="bottom_right", return_lse=True, algorithm=algorithm)
    assert np.all(out[0, :14] == 0) and np.all(np.isneginf(lse[0, :14]))
    assert np.isnan(out[0, 14:]).any(-1).tolist() == [False] * 9 + [True]


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["float32", "float16"])
@pytest.mark.parametrize("poisoned", ["q", "k", "v"])
def test_nan_in_streamed_rows_beyond_the_thread_count(dtype, poisoned):
    """Tiles of 16 own rows (32 threads) stream 64 rows: the NaN pass must clean and flag rows 32-63 too.

    On the H200 (2026-12-01) it did not: with (16, 64) tiles the rows past the thread count were neither
    sanitized nor flagged, so a NaN value row there leaked into rows masked from it, and the flags were
    whatever shared memory held (a flaky failure).  Row 40 of the poisoned operand is in the first
    streamed tile, which the causal diagonal crosses for every 16-row tile above it.
    """
    # The head dim plays no part: 8 in the simulator (one k-step of the float32 products instead of two).
    n, d = 80, 8 if numba_flash.in_simulator() else 16
    rng = np.random.default_rng(7)
    q, k, v, do = (rng.standard_normal((1, 1, n, d)).astype(dtype) for _ in range(4))
    named = dict(q=q, k=k, v=v)
    named[poisoned][0, 0, 40, 3] = np.nan
    options = dict(causal=True, algorithm="flash2", block_sizes=(16, 64))
    out, lse = numba_flash.attention(q, k, v, return_lse=True, **options)
    grads = numba_flash.attention_backward(q, k, v, out, lse, do, **options)
    allowed = np.tril(np.ones((1, n, n), bool))
    bad = Poisoned(flags_of(q), flags_of(k), flags_of(v), flags_of(do))
    expected = dict(zip(("o", "lse", "dq", "dk", "dv"), nan_pattern(allowed, bad, 1)))
    for name, got in zip(("o", "dq", "dk", "dv"), (out,) + tuple(grads)):
        got_rows = np.isnan(np.asarray(got, np.float64)).any(-1).reshape(1, n)
        wrong = np.argwhere(got_rows != expected[name])
        assert not len(wrong), f"NaN rows of {name} differ at {wrong}"
