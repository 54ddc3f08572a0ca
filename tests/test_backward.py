"""Both backward passes (Algorithm 4 literally, and the fast flash2 one) against float64 gradients."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numba import cuda

import numba_flash
import reference
from numba_flash import BlockMask, dropout_mask
from strategies import BACKWARD_VARIANTS, arrays, block_masks, problems, variants
from tolerances import backward_tolerance

backward_variants = variants(BACKWARD_VARIANTS)


def reference_forward(p, dense_mask, keep, dropout_p):
    """O and lse (float32) from the float64 reference, O in q's dtype: the backward is tested on its own."""
    out, lse = reference.attention(p.q, p.k, p.v, scale=p.scale, causal=p.causal, mask=dense_mask,
                                   dropout_keep=keep, dropout_p=dropout_p)
    return out.astype(p.q.dtype), lse.astype(np.float32)


@backward_variants
@given(data=st.data(), dropout_p=st.sampled_from([0.0, 0.3]), masked=st.booleans())
def test_gradients_match_the_float64_reference(algorithm, dtype, data, dropout_p, masked):
    # Grouped-query heads (flash2: dK, dV summed over each group), every causal alignment, drawn tiles,
    # block masks and dropout.
    p = data.draw(problems(algorithm=algorithm, dtype=dtype, max_n=24 if algorithm == "flash1" else None,
                           backward=True))
    n_q, n_k = p.q.shape[-2], p.k.shape[-2]
    bm = dense = None
    if masked:
        # flash1 runs Algorithm 5 with tiles equal to the mask's blocks; flash2 takes any mask blocks.
        bm = data.draw(block_masks(n_q, n_k, p.block_sizes if algorithm == "flash1" else None))[0]
        dense = bm.to_dense(n_q, n_k)
    block_sizes = bm.block_size if algorithm == "flash1" and bm is not None else p.block_sizes
    seed = data.draw(st.integers(0, 2 ** 64 - 1))
    keep = dropout_mask(p.q.shape[:-1] + (n_k,), dropout_p, seed) if dropout_p else None
    out, lse = reference_forward(p, dense, keep, dropout_p)
    do = arrays(data.draw, p.q.shape, dtype)
    grads = numba_flash.attention_backward(p.q, p.k, p.v, out, lse, do, causal=p.causal, scale=p.scale,
                                           block_mask=bm, dropout_p=dropout_p, seed=seed, algorithm=algorithm,
                                           block_sizes=block_sizes)
    expected = reference.attention_backward(p.q, p.k, p.v, do, scale=p.scale, causal=p.causal, mask=dense,
                                            dropout_keep=keep, dropout_p=dropout_p)
    weights = reference.softmax(reference.masked_scores(p.q, p.k, scale=p.scale, causal=p.causal, mask=dense))
    tolerances = backward_tolerance(p.q, p.expanded(p.k), p.expanded(p.v), out, do, p.effective_scale, weights,
                                    1 / (1 - dropout_p), dtype=dtype, group=p.group)
    for name, got, want, tol in zip(("dq", "dk", "dv"), grads, expected, tolerances):
        assert got.shape == want.shape and got.dtype == dtype
        err = float(np.abs(got.astype(np.float64) - want).max())
        assert err <= tol, f"{name}: max error {err:.3g} > tolerance {tol:.3g}"


@backward_variants
@settings(max_examples=max(3, settings.default.max_examples // 3))  # two full backward passes per example
@given(data=st.data(), dropout_p=st.sampled_from([0.0, 0.2]))
def test_backward_is_bitwise_deterministic(algorithm, dtype, data, dropout_p):
    p = data.draw(problems(algorithm=algorithm, dtype=dtype, max_n=16 if algorithm == "flash1" else None,
                           backward=True))
    keep = dropout_mask(p.q.shape[:-1] + (p.k.shape[-2],), dropout_p, 5) if dropout_p else None
    out, lse = reference_forward(p, None, keep, dropout_p)
    do = arrays(data.draw, p.q.shape, dtype)
    runs = [numba_flash.attention_backward(p.q, p.k, p.v, out, lse, do, causal=p.causal, scale=p.scale,
                                           dropout_p=dropout_p, seed=5, algorithm=algorithm,
                                           block_sizes=p.block_sizes) for _ in range(2)]
    for a, b in zip(*runs):
        np.testing.assert_array_equal(a, b)


def test_rows_that_attend_to_nothing_get_zero_gradients():
    # A block mask with an empty row of blocks: those queries have O = 0,
    # lse = -inf, and neither receive nor pass on any gradient.
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((2, 32, 16)).astype(np.float32) for _ in range(3))
    layout = np.ones((2, 2), bool)
    layout[0] = False
    bm = BlockMask(layout, (16, 16))
    out, lse = numba_flash.attention(q, k, v, block_mask=bm, return_lse=True)
    assert np.all(np.isneginf(lse[:, :16]))
    do = rng.standard_normal(q.shape).astype(np.float32)
    dense = bm.to_dense(32, 32)
    expected = reference.attention_backward(q, k, v, do, mask=dense)
    weights = reference.softmax(reference.masked_scores(q, k, mask=dense))
    tolerances = backward_tolerance(q, k, v, out, do, 1 / np.sqrt(16), weights)
    for algorithm in ("flash1", "flash2"):
        dq, dk, dv = numba_flash.attention_backward(q, k, v, out, lse, do, block_mask=bm, algorithm=algorithm)
        assert np.all(dq[:, :16] == 0), algorithm
        for got, want, tol in zip((dq, dk, dv), expected, tolerances):
            assert np.abs(got - want).max() <= tol, algorithm


# bfloat16 reaches the device through torch (tests/test_torch.py): Numba's arrays cannot hold it on a GPU.
@variants([(a, t) for a, t in BACKWARD_VARIANTS if np.dtype(t).name != "bfloat16"])
def test_device_arrays_in_give_device_gradients_out(algorithm, dtype):
    # (batch, heads, N, d) device arrays, lse from a device forward: the gradients stay on the
    # device and equal the same call on NumPy arrays bit for bit.
    rng = np.random.default_rng(11)
    heads = 2 if numba_flash.in_simulator() else 3   # batch and heads both above 1; fewer blocks in the simulator
    q, k, v, do = rng.standard_normal((4, 2, heads, 20, 8)).astype(dtype)
    host_out, host_lse = numba_flash.attention(q, k, v, return_lse=True)
    host_grads = numba_flash.attention_backward(q, k, v, host_out, host_lse, do, algorithm=algorithm)
    q_dev, k_dev, v_dev, do_dev = (cuda.to_device(x) for x in (q, k, v, do))
    out, lse = numba_flash.attention(q_dev, k_dev, v_dev, return_lse=True)
    grads = numba_flash.attention_backward(q_dev, k_dev, v_dev, out, lse, do_dev, algorithm=algorithm)
    for got, want in zip(grads, host_grads):
        assert not isinstance(got, np.ndarray) and got.shape == want.shape and got.dtype == dtype
        np.testing.assert_array_equal(got.copy_to_host(), want)


@pytest.mark.parametrize("precision", ["tf32x3", "f16", "bf16"])
@pytest.mark.parametrize("causal", [False, True])
def test_default_flash2_tiles_are_legal_for_every_head_dim(precision, causal):
    # The GPU defaults, forward and backward (the simulator uses (16, 16)), must pass the same checks as
    # tiles a user gives.
    from numba_flash._validation import check_block_sizes
    from numba_flash.tiling import FLASH2_MAX_HEAD_DIM, PRECISION, flash2_tuned_block_sizes

    dtype = {v: k for k, v in PRECISION.items()}[precision]
    for d in range(1, FLASH2_MAX_HEAD_DIM + 1):
        for backward in (False, True):
            blocks = flash2_tuned_block_sizes(d, precision, backward=backward, causal=causal)
            assert check_block_sizes(blocks, "flash2", d, 100, 100, dtype, backward=backward) == blocks


Q = np.zeros((2, 8, 4), np.float32)
LSE = np.zeros((2, 8), np.float32)


@pytest.mark.parametrize("args, kwargs, error, words", [
    ((Q, Q, Q, Q[:, :5], LSE, Q), {}, ValueError, "o must have shape"),
    ((Q, Q, Q, Q, LSE[:, :5], Q), {}, ValueError, "lse must have shape"),
    ((Q, Q, Q, Q, LSE.astype(np.float64), Q), {}, TypeError, "lse must have dtype"),
    ((Q, Q, Q, Q, LSE, Q.astype(np.float16)), {}, TypeError, "do must have dtype"),
    ((Q, Q, Q, Q, LSE, [[0.0]]), {}, ValueError, "do must have shape"),
    ((Q, Q, Q, Q, LSE, object()), {}, TypeError, "do must be"),
    ((Q, Q, Q, Q, LSE, Q), {"algorithm": "standard"}, ValueError, "algorithm"),
    ((Q, Q, Q, Q, LSE, Q), {"algorithm": "flash2", "block_sizes": (16, 8)}, ValueError, "multiple of 16"),
    ((Q, Q, Q, Q, LSE, Q), {"algorithm": "flash2", "block_sizes": (24, 16)}, ValueError, "multiple of 16"),
    ((Q.astype(np.float16),) * 3 + (Q, LSE, Q), {"algorithm": "flash2"}, TypeError, "o must have dtype"),
])
def test_bad_backward_input_is_rejected(args, kwargs, error, words):
    kwargs.setdefault("algorithm", "flash1")
    with pytest.raises(error, match=words):
        numba_flash.attention_backward(*args, **kwargs)
