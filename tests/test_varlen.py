"""Variable-length (packed) attention, forward and backward, against the float64 reference per sequence."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import numba_flash
import reference
from numba_flash import dropout_mask
from strategies import VARLEN_DTYPES, arrays, cumulative, dtype_name, packed_problems
from tolerances import assert_close_to_reference, backward_tolerance

varlen_dtypes = pytest.mark.parametrize("dtype", VARLEN_DTYPES, ids=dtype_name)


def alignment(causal):
    """A packed call's causal argument for one sequence as ``attention`` spells it (True: bottom-right)."""
    return "bottom_right" if causal is True else causal


def keep_mask(p, dropout_p, seed):
    """The packed call's dropout: the (batch, H, N_q, N_k) mask of a batched call, of which sequence b uses its part."""
    if not dropout_p:
        return None
    return dropout_mask((p.batch, p.q.shape[1]) + p.longest, dropout_p, seed)


def expand(x, heads):
    return reference.repeat_kv(x, heads)


@varlen_dtypes
@given(data=st.data(), dropout_p=st.sampled_from([0.0, 0.25]))
def test_packed_sequences_match_the_float64_reference(dtype, data, dropout_p):
    # Empty and one-row sequences, grouped heads, every causal alignment, drawn tiles and scales.
    p = data.draw(packed_problems(dtype=dtype))
    seed = data.draw(st.integers(0, 2 ** 64 - 1))
    out, lse = numba_flash.attention_varlen(p.q, p.k, p.v, p.cu_q, p.cu_k, causal=p.causal, scale=p.scale,
                                            dropout_p=dropout_p, seed=seed, block_sizes=p.block_sizes,
                                            return_lse=True)
    assert out.shape == p.q.shape and out.dtype == dtype and lse.shape == (p.q.shape[1], p.q.shape[0])
    keep = keep_mask(p, dropout_p, seed)
    for b in range(p.batch):
        q, k, v = p.sequence(b)
        n_q, n_k = q.shape[1], k.shape[1]
        if n_q == 0:
            continue
        rows = p.rows(b)
        if n_k == 0:  # nothing to attend to
            assert np.all(out[rows].astype(np.float32) == 0) and np.all(np.isneginf(lse[:, rows]))
            continue
        k, v = expand(k, q.shape[0]), expand(v, q.shape[0])
        ref_out, ref_lse = reference.attention(q, k, v, scale=p.scale, causal=alignment(p.causal),
                                               dropout_keep=None if keep is None else keep[b, :, :n_q, :n_k],
                                               dropout_p=dropout_p)
        effective = 1 / np.sqrt(q.shape[-1]) if p.scale is None else p.scale
        assert_close_to_reference(np.swapaxes(out[rows], 0, 1), lse[:, rows], ref_out, ref_lse, q, k, v, effective,
                                  dtype, weight_scale=1 / (1 - dropout_p))


@varlen_dtypes
@settings(max_examples=max(3, settings.default.max_examples // 2))
@given(data=st.data(), dropout_p=st.sampled_from([0.0, 0.3]))
def test_packed_gradients_match_the_float64_reference(dtype, data, dropout_p):
    p = data.draw(packed_problems(dtype=dtype, backward=True))
    seed = data.draw(st.integers(0, 2 ** 64 - 1))
    keep = keep_mask(p, dropout_p, seed)
    options = dict(causal=p.causal, scale=p.scale, dropout_p=dropout_p, seed=seed)
    ref_out, ref_lse = reference.attention_varlen(p.q, p.k, p.v, p.cu_q, p.cu_k, scale=p.scale, causal=p.causal,
                                                  dropout_keep=keep, dropout_p=dropout_p)
    out, lse = ref_out.astype(dtype), ref_lse.astype(np.float32)   # the backward is tested on its own
    do = arrays(data.draw, p.q.shape, dtype)
    grads = numba_flash.attention_varlen_backward(p.q, p.k, p.v, out, lse, do, p.cu_q, p.cu_k,
                                                  block_sizes=p.block_sizes, **options)
    for got, like in zip(grads, (p.q, p.k, p.v)):
        assert got.shape == like.shape and got.dtype == dtype
    scale = 1 / np.sqrt(p.q.shape[-1]) if p.scale is None else p.scale
    group = p.q.shape[1] // p.k.shape[1]
    for b in range(p.batch):
        q, k, v = p.sequence(b)
        n_q, n_k = q.shape[1], k.shape[1]
        rows, keys = p.rows(b), p.keys(b)
        if n_q == 0 or n_k == 0:  # no query sees a key: every gradient of the sequence is 0
            for grad, where in zip(grads, (rows, keys, keys)):
                assert np.all(grad[where].astype(np.float32) == 0)
            continue
        seq_keep = None if keep is None else keep[b, :, :n_q, :n_k]
        k_all, v_all = expand(k, q.shape[0]), expand(v, q.shape[0])
        do_b = np.swapaxes(do[rows], 0, 1)
        expected = reference.attention_backward(q, k, v, do_b, scale=p.scale, causal=alignment(p.causal),
                                                dropout_keep=seq_keep, dropout_p=dropout_p)
        weights = reference.softmax(reference.masked_scores(q, k_all, scale=p.scale, causal=alignment(p.causal)))
        tolerances = backward_tolerance(q, k_all, v_all, np.swapaxes(out[rows], 0, 1), do_b, scale, weights,
                                        1 / (1 - dropout_p), dtype=dtype, group=group)
        for name, grad, where, want, tol in zip(("dq", "dk", "dv"), grads, (rows, keys, keys), expected, tolerances):
            err = float(np.abs(np.swapaxes(grad[where], 0, 1).astype(np.float64) - want).max())
            assert err <= tol, f"sequence {b} {name}: max error {err:.3g} > tolerance {tol:.3g}"


@varlen_dtypes
# Each example: two forwards and two backwards, packed and batched; three a dtype in the simulator (CI's time).
@settings(max_examples=3 if numba_flash.in_simulator() else max(3, settings.default.max_examples // 3))
@given(data=st.data(), dropout_p=st.sampled_from([0.0, 0.2]))
def test_equal_lengths_give_the_bits_of_the_batched_call(dtype, data, dropout_p):
    # Packed sequences of one length are a (batch, H, N, d) batch: the kernels must give the same bits,
    # dropout included (sequence b's entries are those of batch entry b).
    p = data.draw(packed_problems(dtype=dtype, backward=True, equal_lengths=True))
    seed = data.draw(st.integers(0, 2 ** 64 - 1))
    (n_q, n_k), batch = p.longest, p.batch

    def batched(x, n):
        return np.ascontiguousarray(np.swapaxes(x.reshape((batch, n) + x.shape[1:]), 1, 2))

    def packed(x):
        return np.ascontiguousarray(np.swapaxes(x, 1, 2)).reshape((-1,) + x.shape[1:2] + x.shape[3:])

    options = dict(scale=p.scale, dropout_p=dropout_p, seed=seed, block_sizes=p.block_sizes)
    out, lse = numba_flash.attention_varlen(p.q, p.k, p.v, p.cu_q, p.cu_k, causal=p.causal, return_lse=True,
                                            **options)
    qb, kb, vb = batched(p.q, n_q), batched(p.k, n_k), batched(p.v, n_k)
    out_b, lse_b = numba_flash.attention(qb, kb, vb, causal=alignment(p.causal), return_lse=True, **options)
    np.testing.assert_array_equal(out.view(np.uint8), packed(out_b).view(np.uint8))
    np.testing.assert_array_equal(lse, np.swapaxes(lse_b, 0, 1).reshape(lse.shape[0], -1))
    do = arrays(data.draw, p.q.shape, dtype)
    options["block_sizes"] = None
    grads = numba_flash.attention_varlen_backward(p.q, p.k, p.v, out, lse, do, p.cu_q, p.cu_k, causal=p.causal,
                                                  **options)
    grads_b = numba_flash.attention_backward(qb, kb, vb, out_b, lse_b, batched(do, n_q), causal=alignment(p.causal),
                                             **options)
    for got, want in zip(grads, grads_b):
        np.testing.assert_array_equal(got.view(np.uint8), packed(want).view(np.uint8))


Q = np.zeros((7, 2, 4), np.float32)
KV = np.zeros((9, 1, 4), np.float32)
CU_Q = np.array([0, 3, 7], np.int32)
CU_K = np.array([0, 4, 9], np.int32)

BAD_INPUTS = [
    # (description, args, kwargs, exception, words the message must contain)
    ("q not packed", (Q[None], KV, KV, CU_Q, CU_K), {}, ValueError, "(total, heads, d)"),
    ("cu_seqlens_q does not start at 0", (Q, KV, KV, np.array([1, 3, 7]), CU_K), {}, ValueError, "start at 0"),
    ("cu_seqlens_k decreases", (Q, KV, KV, CU_Q, np.array([0, 5, 4, 9])), {}, ValueError, "must not decrease"),
    ("cu_seqlens_q does not end at total_q", (Q, KV, KV, np.array([0, 3, 6]), CU_K), {}, ValueError,
     "end at the 7 rows of q"),
    ("cu_seqlens_k does not end at total_k", (Q, KV, KV, CU_Q, np.array([0, 4, 10])), {}, ValueError,
     "end at the 9 rows of k and v"),
    ("different numbers of sequences", (Q, KV, KV, CU_Q, np.array([0, 2, 4, 9])), {}, ValueError,
     "same number of sequences"),
    ("cu_seqlens of floats", (Q, KV, KV, CU_Q.astype(np.float32), CU_K), {}, TypeError, "integers"),
    ("cu_seqlens 2-D", (Q, KV, KV, CU_Q[None], CU_K), {}, ValueError, "1-D"),
    ("cu_seqlens of one entry", (Q, KV, KV, np.array([0]), np.array([0])), {}, ValueError, "batch + 1"),
    ("heads not a multiple", (Q, np.zeros((9, 3, 4), np.float32), np.zeros((9, 3, 4), np.float32), CU_Q, CU_K), {},
     ValueError, "multiple of the key/value heads"),
    ("k and v differ", (Q, KV, KV[:, :, :3], CU_Q, CU_K), {}, ValueError, "head dim"),
    ("float64", (Q.astype(np.float64), KV.astype(np.float64), KV.astype(np.float64), CU_Q, CU_K), {}, TypeError,
     "dtype float64"),
    ("causal unknown", (Q, KV, KV, CU_Q, CU_K), {"causal": "diagonal"}, ValueError, "bottom_right"),
    ("flash2 tiles", (Q, KV, KV, CU_Q, CU_K), {"block_sizes": (24, 16)}, ValueError, "block_sizes"),
    ("dropout out of range", (Q, KV, KV, CU_Q, CU_K), {"dropout_p": 1.0}, ValueError, "dropout_p"),
]


@pytest.mark.parametrize("description, args, kwargs, error, words", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_packed_input_is_rejected_before_any_launch(no_launch, description, args, kwargs, error, words):
    with pytest.raises(error, match=None) as caught:
        numba_flash.attention_varlen(*args, **kwargs)
    assert words in str(caught.value), str(caught.value)


def test_bad_packed_backward_input_is_rejected_before_any_launch(no_launch):
    o = np.zeros_like(Q)
    with pytest.raises(ValueError, match=r"lse must have shape \(2, 7\)"):
        numba_flash.attention_varlen_backward(Q, KV, KV, o, np.zeros((7, 2), np.float32), o, CU_Q, CU_K)
    with pytest.raises(ValueError, match=r"do must have shape \(7, 2, 4\)"):
        numba_flash.attention_varlen_backward(Q, KV, KV, o, np.zeros((2, 7), np.float32), o[:6], CU_Q, CU_K)


def test_sequence_bounds_may_be_lists_or_int64():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((7, 2, 4)).astype(np.float32)
    k = rng.standard_normal((9, 1, 4)).astype(np.float32)
    want = numba_flash.attention_varlen(q, k, k, CU_Q, CU_K)
    for cu_q, cu_k in (([0, 3, 7], [0, 4, 9]), (CU_Q.astype(np.int64), CU_K.astype(np.int64))):
        np.testing.assert_array_equal(numba_flash.attention_varlen(q, k, k, cu_q, cu_k), want)


def test_cumulative_helper():
    np.testing.assert_array_equal(cumulative([2, 0, 3]), [0, 2, 2, 5])
