"""The backward pass (Algorithm 4) against float64 gradients, and its invariants."""
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import numba_flash
import reference
from numba_flash import BlockMask, dropout_mask
from strategies import arrays, problems
from tolerances import backward_tolerance


def reference_forward(p, dense_mask, keep, dropout_p):
    """O (float32) and lse (float32) from the float64 reference: the backward is tested on its own."""
    out, lse = reference.attention(p.q, p.k, p.v, scale=p.scale, causal=p.causal, mask=dense_mask,
                                   dropout_keep=keep, dropout_p=dropout_p)
    return out.astype(np.float32), lse.astype(np.float32)


@given(data=st.data(), dropout_p=st.sampled_from([0.0, 0.3]), masked=st.booleans())
def test_flash1_gradients_match_the_float64_reference(data, dropout_p, masked):
    p = data.draw(problems(algorithm="flash1", max_n=24))
    n_q, n_k = p.q.shape[-2], p.k.shape[-2]
    block_sizes = p.block_sizes
    bm = dense = None
    if masked:
        block_sizes = block_sizes or (data.draw(st.integers(1, 8)), data.draw(st.integers(1, 8)))
        grid = (-(-n_q // block_sizes[0]), -(-n_k // block_sizes[1]))
        rng = np.random.default_rng(data.draw(st.integers(0, 2 ** 32 - 1)))
        bm = BlockMask(rng.random(grid) < 0.6, block_sizes)
        dense = bm.to_dense(n_q, n_k)
    seed = data.draw(st.integers(0, 2 ** 64 - 1))
    keep = dropout_mask(p.q.shape[:-1] + (n_k,), dropout_p, seed) if dropout_p else None
    out, lse = reference_forward(p, dense, keep, dropout_p)
    do = arrays(data.draw, p.q.shape)
    grads = numba_flash.attention_backward(p.q, p.k, p.v, out, lse, do, causal=p.causal, scale=p.scale,
                                           block_mask=bm, dropout_p=dropout_p, seed=seed, algorithm="flash1",
                                           block_sizes=block_sizes)
    expected = reference.attention_backward(p.q, p.k, p.v, do, scale=p.scale, causal=p.causal, mask=dense,
                                            dropout_keep=keep, dropout_p=dropout_p)
    weights = reference.softmax(reference.masked_scores(p.q, p.k, scale=p.scale, causal=p.causal, mask=dense))
    tolerances = backward_tolerance(p.q, p.k, p.v, out, do, p.effective_scale, weights, 1 / (1 - dropout_p))
    for name, got, want, tol in zip(("dq", "dk", "dv"), grads, expected, tolerances):
        assert got.shape == want.shape and got.dtype == np.float32
        err = float(np.abs(got - want).max())
        assert err <= tol, f"{name}: max error {err:.3g} > tolerance {tol:.3g}"


@given(data=st.data())
def test_flash1_backward_is_deterministic(data):
    p = data.draw(problems(algorithm="flash1", max_n=16))
    out, lse = reference_forward(p, None, None, 0.0)
    do = arrays(data.draw, p.q.shape)
    first = numba_flash.attention_backward(p.q, p.k, p.v, out, lse, do, causal=p.causal, algorithm="flash1")
    second = numba_flash.attention_backward(p.q, p.k, p.v, out, lse, do, causal=p.causal, algorithm="flash1")
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a, b)


Q = np.zeros((2, 8, 4), np.float32)
LSE = np.zeros((2, 8), np.float32)


@pytest.mark.parametrize("args, kwargs, error, words", [
    ((Q, Q, Q, Q[:, :5], LSE, Q), {}, ValueError, "o must have shape"),
    ((Q, Q, Q, Q, LSE[:, :5], Q), {}, ValueError, "lse must have shape"),
    ((Q, Q, Q, Q, LSE.astype(np.float64), Q), {}, TypeError, "lse must have dtype"),
    ((Q, Q, Q, Q, LSE, Q.astype(np.float16)), {}, TypeError, "do must have dtype"),
    ((Q, Q, Q, Q, LSE, [[0.0]]), {}, TypeError, "do must be"),
    ((Q, Q, Q, Q, LSE, Q), {"algorithm": "standard"}, ValueError, "algorithm"),
    ((Q, Q, Q, Q, LSE, Q), {"algorithm": "flash2"}, NotImplementedError, "flash1"),
])
def test_bad_backward_input_is_rejected(args, kwargs, error, words):
    kwargs.setdefault("algorithm", "flash1")
    with pytest.raises(error, match=words):
        numba_flash.attention_backward(*args, **kwargs)
