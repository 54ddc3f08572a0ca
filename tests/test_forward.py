"""Forward kernels against the float64 reference, and invariances they must keep."""
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from numba import cuda

import numba_flash
import reference
from strategies import SIZES, problems
from tolerances import assert_close_to_reference

ALGORITHMS = ["standard", "flash1"]


def run(p, algorithm, **overrides):
    kwargs = dict(causal=p.causal, scale=p.scale, algorithm=algorithm, block_sizes=p.block_sizes,
                  return_lse=True)
    kwargs.update(overrides)
    return numba_flash.attention(p.q, p.k, p.v, **kwargs)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@given(data=st.data())
def test_matches_float64_reference(algorithm, data):
    p = data.draw(problems(algorithm=algorithm))
    out, lse = run(p, algorithm)
    assert out.shape == p.q.shape and out.dtype == p.q.dtype
    assert lse.shape == p.q.shape[:-1] and lse.dtype == np.float32
    ref_out, ref_lse = reference.attention(p.q, p.k, p.v, scale=p.scale, causal=p.causal)
    assert_close_to_reference(out, lse, ref_out, ref_lse, p.q, p.k, p.v, p.effective_scale)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@given(data=st.data())
def test_permuting_keys_and_values_together_leaves_output_unchanged(algorithm, data):
    p = data.draw(problems(algorithm=algorithm, causal=False))
    perm = data.draw(st.permutations(range(p.k.shape[-2])))
    out, lse = run(p, algorithm)
    out_p, lse_p = numba_flash.attention(
        p.q, p.k[..., perm, :], p.v[..., perm, :], scale=p.scale, algorithm=algorithm,
        block_sizes=p.block_sizes, return_lse=True)
    # Both are within the model's bound of the same exact answer.
    ref_out, ref_lse = reference.attention(p.q, p.k, p.v, scale=p.scale)
    assert_close_to_reference(out_p, lse_p, ref_out, ref_lse, p.q, p.k, p.v, p.effective_scale)
    assert_close_to_reference(out, lse, ref_out, ref_lse, p.q, p.k, p.v, p.effective_scale)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@given(data=st.data())
def test_constant_value_rows_give_that_constant(algorithm, data):
    p = data.draw(problems(algorithm=algorithm))
    row = p.v.reshape(-1, p.v.shape[-1])[0]
    v = np.broadcast_to(row, p.v.shape).copy()
    out = numba_flash.attention(p.q, p.k, v, causal=p.causal, scale=p.scale, algorithm=algorithm,
                                block_sizes=p.block_sizes)
    # sum_j P_ij c = c because the weights sum to one: only rounding remains.
    tol = 1e-6 * (1 + p.k.shape[-2] / 64) * np.abs(row).max()
    np.testing.assert_allclose(out, np.broadcast_to(row, out.shape), rtol=0, atol=tol)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@given(data=st.data(), magnitude=st.sampled_from([1e2, 1e4]))
def test_huge_logits_do_not_overflow(algorithm, data, magnitude):
    p = data.draw(problems(algorithm=algorithm))
    q = (p.q * magnitude).astype(np.float32)
    out, lse = numba_flash.attention(q, p.k, p.v, causal=p.causal, scale=1.0, algorithm=algorithm,
                                     block_sizes=p.block_sizes, return_lse=True)
    assert np.all(np.isfinite(out)) and not np.any(np.isnan(lse))
    ref_out, ref_lse = reference.attention(q, p.k, p.v, scale=1.0, causal=p.causal)
    assert_close_to_reference(out, lse, ref_out, ref_lse, q, p.k, p.v, 1.0)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@given(data=st.data())
def test_heads_are_computed_independently_and_deterministically(algorithm, data):
    p = data.draw(problems(algorithm=algorithm))
    out, lse = run(p, algorithm)
    again, lse_again = run(p, algorithm)
    np.testing.assert_array_equal(out, again)
    np.testing.assert_array_equal(lse, lse_again)
    q, k, v = (x.reshape((-1,) + x.shape[-2:]) for x in (p.q, p.k, p.v))
    flat = out.reshape((-1,) + out.shape[-2:])
    h = data.draw(st.integers(0, q.shape[0] - 1))
    alone = numba_flash.attention(q[h], k[h], v[h], causal=p.causal, scale=p.scale, algorithm=algorithm,
                                  block_sizes=p.block_sizes)
    np.testing.assert_array_equal(alone, flat[h])


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_causal_with_more_queries_than_keys(algorithm):
    rng = np.random.default_rng(7)
    q = rng.standard_normal((2, 9, 8)).astype(np.float32)
    k, v = rng.standard_normal((2, 2, 4, 8)).astype(np.float32)
    out, lse = numba_flash.attention(q, k, v, causal=True, algorithm=algorithm, return_lse=True)
    ref_out, ref_lse = reference.attention(q, k, v, causal=True)
    assert_close_to_reference(out, lse, ref_out, ref_lse, q, k, v, 1 / np.sqrt(8))
    # Queries 3..8 see all four keys: identical to non-causal attention there.
    full = numba_flash.attention(q, k, v, algorithm=algorithm)
    np.testing.assert_allclose(out[:, 3:], full[:, 3:], atol=1e-6)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_cuda_arrays_stay_on_the_device(algorithm):
    rng = np.random.default_rng(8)
    q, k, v = rng.standard_normal((3, 2, 10, 8)).astype(np.float32)
    host_out, host_lse = numba_flash.attention(q, k, v, algorithm=algorithm, return_lse=True)
    dq, dk, dv = (cuda.to_device(x) for x in (q, k, v))
    dev_out, dev_lse = numba_flash.attention(dq, dk, dv, algorithm=algorithm, return_lse=True)
    assert not isinstance(dev_out, np.ndarray) and not isinstance(dev_lse, np.ndarray)
    assert dev_out.shape == q.shape and dev_lse.shape == q.shape[:-1]
    np.testing.assert_array_equal(dev_out.copy_to_host(), host_out)
    np.testing.assert_array_equal(dev_lse.copy_to_host(), host_lse)


def test_return_lse_false_returns_only_the_output():
    q = np.ones((4, 8), np.float32)
    out = numba_flash.attention(q, q, q, algorithm="flash1")
    assert isinstance(out, np.ndarray) and out.shape == (4, 8)
