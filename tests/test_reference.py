"""The float64 reference and the NumPy tiling, checked against SciPy and each other."""
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from scipy import special

import reference
from strategies import problems
from tolerances import FLOAT64_AGREEMENT, central_difference_tolerance


@given(problems(algorithm="flash1"))
def test_reference_agrees_with_scipy(p):
    q, k, v = (x.astype(np.float64) for x in (p.q, p.k, p.v))
    s = p.effective_scale * q @ np.swapaxes(k, -1, -2)
    allowed = reference.allowed_mask(q.shape[-2], k.shape[-2], causal=p.causal)
    s = np.where(allowed, s, -np.inf)
    out, lse = reference.attention(q, k, v, scale=p.scale, causal=p.causal)
    # Rows that may see no key (bottom-right causal with N_q > N_k) follow the convention, O = 0 and
    # lse = -inf, where SciPy's softmax is undefined.
    seen = np.broadcast_to(allowed.any(-1), lse.shape)
    assert np.all(out[~seen] == 0) and np.all(np.isneginf(lse[~seen]))
    np.testing.assert_allclose(out[seen], (special.softmax(s, axis=-1) @ v)[seen], rtol=FLOAT64_AGREEMENT, atol=FLOAT64_AGREEMENT)
    np.testing.assert_allclose(lse[seen], special.logsumexp(s, axis=-1)[seen], rtol=FLOAT64_AGREEMENT, atol=FLOAT64_AGREEMENT)


@given(problems(algorithm="flash1"), st.tuples(st.integers(1, 50), st.integers(1, 50)))
def test_tiled_algorithm_1_equals_reference(p, block_sizes):
    q, k, v = (x.reshape((-1,) + x.shape[-2:]) for x in (p.q, p.k, p.v))
    out, lse = reference.attention(q, k, v, scale=p.scale, causal=p.causal)
    for h in range(q.shape[0]):
        o_t, lse_t, l_t, m_t = reference.flash1_tiled(q[h], k[h], v[h], block_sizes=block_sizes,
                                                      scale=p.scale, causal=p.causal)
        np.testing.assert_allclose(o_t, out[h], rtol=FLOAT64_AGREEMENT, atol=FLOAT64_AGREEMENT)
        np.testing.assert_allclose(lse_t, lse[h], rtol=FLOAT64_AGREEMENT, atol=FLOAT64_AGREEMENT)
        np.testing.assert_allclose(m_t + np.log(l_t), lse[h], rtol=FLOAT64_AGREEMENT, atol=FLOAT64_AGREEMENT)


def test_tiled_handles_rows_with_no_allowed_key():
    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal((3, 6, 4))
    mask = np.ones((6, 6), bool)
    mask[2] = False  # query 2 may see nothing
    mask[4, :3] = False  # query 4 sees nothing in the first key block
    out, lse = reference.attention(q, k, v, mask=mask)
    o_t, lse_t, _, _ = reference.flash1_tiled(q, k, v, block_sizes=(2, 3), mask=mask)
    assert np.all(out[2] == 0) and lse[2] == -np.inf
    np.testing.assert_allclose(o_t, out, atol=FLOAT64_AGREEMENT)
    np.testing.assert_array_equal(np.isneginf(lse_t), np.isneginf(lse))


@pytest.mark.parametrize("n_q, n_k", [(5, 3), (3, 5), (4, 4)])
def test_causal_is_top_left_aligned(n_q, n_k):
    allowed = reference.allowed_mask(n_q, n_k, causal=True)
    for i in range(n_q):
        assert list(np.flatnonzero(allowed[i])) == list(range(min(i + 1, n_k)))


def test_softmax_of_all_masked_row_is_zero():
    s = np.array([[-np.inf, -np.inf], [0.0, np.log(3.0)]])
    np.testing.assert_allclose(reference.softmax(s), [[0, 0], [0.25, 0.75]])


@given(st.integers(1, 3), st.integers(1, 4), st.integers(1, 4), st.integers(1, 3), st.booleans(),
       st.sampled_from([0.0, 0.4]), st.integers(0, 2 ** 32 - 1))
def test_reference_gradients_match_finite_differences(heads, n_q, n_k, d, causal, dropout_p, seed):
    rng = np.random.default_rng(seed)
    q, do = rng.standard_normal((2, heads, n_q, d))
    k, v = rng.standard_normal((2, heads, n_k, d))
    mask = rng.random((n_q, n_k)) < 0.7
    keep = rng.random((heads, n_q, n_k)) >= dropout_p
    options = dict(causal=causal, mask=mask, dropout_keep=keep, dropout_p=dropout_p)

    def loss(**x):
        args = {"q": q, "k": k, "v": v} | x
        return np.sum(reference.attention(args["q"], args["k"], args["v"], **options)[0] * do)

    grads = reference.attention_backward(q, k, v, do, **options)
    eps = 1e-6
    rtol, atol = central_difference_tolerance(eps, np.abs(reference.attention(q, k, v, **options)[0] * do).sum())
    for name, x, grad in zip("qkv", (q, k, v), grads):
        numeric = np.zeros_like(x)
        for index in np.ndindex(x.shape):
            up, down = x.copy(), x.copy()
            up[index] += eps
            down[index] -= eps
            numeric[index] = (loss(**{name: up}) - loss(**{name: down})) / (2 * eps)
        np.testing.assert_allclose(grad, numeric, rtol=rtol, atol=atol, err_msg=f"d{name}")


def test_reference_dropout_scales_kept_weights_and_keeps_lse():
    rng = np.random.default_rng(5)
    q, k, v = rng.standard_normal((3, 4, 6, 2))
    keep = rng.random((4, 6, 6)) >= 0.5
    out, lse = reference.attention(q, k, v, dropout_keep=keep, dropout_p=0.5)
    plain, plain_lse = reference.attention(q, k, v)
    p = reference.softmax(reference.masked_scores(q, k))
    np.testing.assert_allclose(out, (p * keep * 2.0) @ v, rtol=FLOAT64_AGREEMENT)
    np.testing.assert_array_equal(lse, plain_lse)
