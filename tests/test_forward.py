"""Forward kernels against the float64 reference, and invariances they must keep."""
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from numba import cuda

import numba_flash
import reference
from strategies import problems, random_block_mask
from tolerances import U16, U32, assert_close_to_reference

# (algorithm, dtype) pairs: every algorithm in float32, the fast one also in float16.
VARIANTS = [("standard", np.float32), ("flash1", np.float32), ("flash2", np.float32), ("flash2", np.float16)]
IDS = [f"{a}-{np.dtype(t).name}" for a, t in VARIANTS]
variants = pytest.mark.parametrize("algorithm, dtype", VARIANTS, ids=IDS)


def attend(p, algorithm, q=None, k=None, v=None, **overrides):
    kwargs = dict(causal=p.causal, scale=p.scale, algorithm=algorithm, block_sizes=p.block_sizes,
                  return_lse=True)
    kwargs.update(overrides)
    return numba_flash.attention(p.q if q is None else q, p.k if k is None else k, p.v if v is None else v,
                                 **kwargs)


@variants
@given(data=st.data())
def test_matches_float64_reference(algorithm, dtype, data):
    p = data.draw(problems(algorithm=algorithm, dtype=dtype))
    out, lse = attend(p, algorithm)
    assert out.shape == p.q.shape and out.dtype == p.q.dtype
    assert lse.shape == p.q.shape[:-1] and lse.dtype == np.float32
    ref_out, ref_lse = reference.attention(p.q, p.k, p.v, scale=p.scale, causal=p.causal)
    assert_close_to_reference(out, lse, ref_out, ref_lse, p.q, p.k, p.v, p.effective_scale, dtype)


@variants
@given(data=st.data())
def test_permuting_keys_and_values_together_leaves_output_unchanged(algorithm, dtype, data):
    p = data.draw(problems(algorithm=algorithm, dtype=dtype, causal=False))
    perm = np.array(data.draw(st.permutations(range(p.k.shape[-2]))))
    out, lse = attend(p, algorithm)
    out_p, lse_p = attend(p, algorithm, k=p.k[..., perm, :], v=p.v[..., perm, :])
    # Both are within the model's bound of the same exact answer.
    ref_out, ref_lse = reference.attention(p.q, p.k, p.v, scale=p.scale)
    for o, l in ((out, lse), (out_p, lse_p)):
        assert_close_to_reference(o, l, ref_out, ref_lse, p.q, p.k, p.v, p.effective_scale, dtype)


@variants
@given(data=st.data())
def test_constant_value_rows_give_that_constant(algorithm, dtype, data):
    p = data.draw(problems(algorithm=algorithm, dtype=dtype))
    row = p.v.reshape(-1, p.v.shape[-1])[0]
    out, _ = attend(p, algorithm, v=np.broadcast_to(row, p.v.shape).copy())
    # sum_j P_ij c / l = c because the weights sum to l: only rounding remains.
    # The weighted sum and l are each sums of N_k float32 terms ((N_k + 4) u
    # each); 3xTF32 products add ~8 u; float16 also rounds each weight and the
    # output (2^-11 each).
    n_k = p.k.shape[-2]
    rel = (2 * n_k + 24) * U32 + (2 * U16 if dtype == np.float16 else 0.0)
    np.testing.assert_allclose(out.astype(np.float64), np.broadcast_to(row, out.shape),
                               rtol=0, atol=rel * np.abs(row.astype(np.float64)).max())


@variants
@given(data=st.data(), magnitude=st.sampled_from([1e2, 1e4]))
def test_huge_logits_do_not_overflow(algorithm, dtype, data, magnitude):
    p = data.draw(problems(algorithm=algorithm, dtype=dtype))
    if dtype == np.float16:
        magnitude = 30.0  # float16 inputs top out at 65504; logits still reach the thousands
    q = (p.q.astype(np.float32) * magnitude).astype(dtype)
    out, lse = attend(p, algorithm, q=q, scale=1.0)
    assert np.all(np.isfinite(out)) and not np.any(np.isnan(lse))
    ref_out, ref_lse = reference.attention(q, p.k, p.v, scale=1.0, causal=p.causal)
    assert_close_to_reference(out, lse, ref_out, ref_lse, q, p.k, p.v, 1.0, dtype)


@variants
@given(data=st.data())
def test_heads_are_computed_independently_and_deterministically(algorithm, dtype, data):
    p = data.draw(problems(algorithm=algorithm, dtype=dtype))
    out, lse = attend(p, algorithm)
    again, lse_again = attend(p, algorithm)
    np.testing.assert_array_equal(out, again)
    np.testing.assert_array_equal(lse, lse_again)
    q, k, v = (x.reshape((-1,) + x.shape[-2:]) for x in (p.q, p.k, p.v))
    h = data.draw(st.integers(0, q.shape[0] - 1))
    alone, alone_lse = attend(p, algorithm, q=q[h], k=k[h], v=v[h])
    np.testing.assert_array_equal(alone, out.reshape(q.shape)[h])
    np.testing.assert_array_equal(alone_lse, lse.reshape(q.shape[:-1])[h])


@variants
@pytest.mark.parametrize("n_q, n_k", [(9, 4), (4, 9), (33, 17)])
def test_causal_is_top_left_aligned_when_lengths_differ(algorithm, dtype, n_q, n_k):
    rng = np.random.default_rng(7)
    q = rng.standard_normal((2, n_q, 8)).astype(dtype)
    k, v = rng.standard_normal((2, 2, n_k, 8)).astype(dtype)
    out, lse = numba_flash.attention(q, k, v, causal=True, algorithm=algorithm, return_lse=True)
    ref_out, ref_lse = reference.attention(q, k, v, causal=True)
    assert_close_to_reference(out, lse, ref_out, ref_lse, q, k, v, 1 / np.sqrt(8), dtype)
    # Queries i >= N_k - 1 see every key: identical to non-causal attention there.
    full = numba_flash.attention(q, k, v, algorithm=algorithm)
    tail = slice(n_k - 1, None)
    np.testing.assert_allclose(out[:, tail].astype(np.float64), full[:, tail], atol=4 * U16 if dtype == np.float16 else 1e-6)


@variants
def test_cuda_arrays_stay_on_the_device(algorithm, dtype):
    rng = np.random.default_rng(8)
    q, k, v = rng.standard_normal((3, 2, 10, 8)).astype(dtype)
    host_out, host_lse = numba_flash.attention(q, k, v, algorithm=algorithm, return_lse=True)
    dq, dk, dv = (cuda.to_device(x) for x in (q, k, v))
    dev_out, dev_lse = numba_flash.attention(dq, dk, dv, algorithm=algorithm, return_lse=True)
    assert not isinstance(dev_out, np.ndarray) and not isinstance(dev_lse, np.ndarray)
    assert dev_out.shape == q.shape and dev_lse.shape == q.shape[:-1] and dev_out.dtype == dtype
    np.testing.assert_array_equal(dev_out.copy_to_host(), host_out)
    np.testing.assert_array_equal(dev_lse.copy_to_host(), host_lse)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("head_dim", [1, 3, 72, 160, 256])
def test_flash2_head_dims_beyond_the_common_ones(dtype, head_dim):
    rng = np.random.default_rng(head_dim)
    n = 5 if numba_flash.in_simulator() else 200
    q, k, v = (rng.standard_normal((2, n, head_dim)).astype(dtype) for _ in range(3))
    for causal in (False, True):
        out, lse = numba_flash.attention(q, k, v, causal=causal, return_lse=True)
        ref_out, ref_lse = reference.attention(q, k, v, causal=causal)
        assert_close_to_reference(out, lse, ref_out, ref_lse, q, k, v, 1 / np.sqrt(head_dim), dtype)


def test_flash2_is_the_default_algorithm(monkeypatch):
    from numba_flash import api
    called = []
    monkeypatch.setattr(api, "flash2_forward", lambda *a, **kw: called.append(True))
    numba_flash.attention(*(np.ones((2, 4, 8), np.float32),) * 3)
    assert called


def test_return_lse_false_returns_only_the_output():
    q = np.ones((4, 8), np.float32)
    out = numba_flash.attention(q, q, q, algorithm="flash1")
    assert isinstance(out, np.ndarray) and out.shape == (4, 8)


@variants
@given(data=st.data(), dropout_p=st.sampled_from([0.1, 0.5]), seed=st.integers(0, 2 ** 64 - 1),
       masked=st.booleans())
def test_dropout_drops_exactly_the_generated_mask(algorithm, dtype, data, dropout_p, seed, masked):
    # With and without a block mask: the two share the kernels' inner loop.
    p = data.draw(problems(algorithm=algorithm, dtype=dtype))
    n_q, n_k = p.q.shape[-2], p.k.shape[-2]
    bm = random_block_mask(data, n_q, n_k, p.block_sizes if algorithm == "flash1" else None) if masked else None
    dense = None if bm is None else bm.to_dense(n_q, n_k)
    out, lse = attend(p, algorithm, dropout_p=dropout_p, seed=seed, block_mask=bm,
                      block_sizes=bm.block_size if algorithm == "flash1" and bm is not None else p.block_sizes)
    keep = numba_flash.dropout_mask(p.q.shape[:-1] + (n_k,), dropout_p, seed)
    ref_out, ref_lse = reference.attention(p.q, p.k, p.v, scale=p.scale, causal=p.causal, mask=dense,
                                           dropout_keep=keep, dropout_p=dropout_p)
    assert_close_to_reference(out, lse, ref_out, ref_lse, p.q, p.k, p.v, p.effective_scale, dtype,
                              weight_scale=1 / (1 - dropout_p))
    again, _ = attend(p, algorithm, dropout_p=dropout_p, seed=seed, block_mask=bm,
                      block_sizes=bm.block_size if algorithm == "flash1" and bm is not None else p.block_sizes)
    np.testing.assert_array_equal(out, again)
