"""Forward kernels against the float64 reference, and invariances they must keep."""
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from numba import cuda

import numba_flash
import reference
from strategies import BFLOAT16, FORWARD_VARIANTS, block_masks, block_sizes, forward_warp_rows, problems, variants
from tolerances import assert_close_to_reference, constant_rows_tolerance

forward_variants = variants(FORWARD_VARIANTS)


def attend(p, algorithm, q=None, k=None, v=None, **overrides):
    kwargs = dict(causal=p.causal, scale=p.scale, algorithm=algorithm, block_sizes=p.block_sizes,
                  return_lse=True)
    kwargs.update(overrides)
    return numba_flash.attention(p.q if q is None else q, p.k if k is None else k, p.v if v is None else v,
                                 **kwargs)


def check_against_reference(p, out, lse, dtype, q=None, scale=None, **reference_options):
    """O and lse of a problem (k, v heads repeated for grouped queries) against float64, under the error model."""
    q = p.q if q is None else q
    scale = p.scale if scale is None else scale
    k, v = p.expanded(p.k), p.expanded(p.v)
    reference_options.setdefault("causal", p.causal)
    ref_out, ref_lse = reference.attention(q, k, v, scale=scale, **reference_options)
    effective = 1 / np.sqrt(q.shape[-1]) if scale is None else scale
    return assert_close_to_reference(out, lse, ref_out, ref_lse, q, k, v, effective, dtype,
                                     weight_scale=1 / (1 - reference_options.get("dropout_p", 0.0)))


@forward_variants
@given(data=st.data())
def test_matches_float64_reference(algorithm, dtype, data):
    # Shapes with batch and head dims or none, grouped-query heads (flash2), lengths not multiples
    # of the tiles, every causal alignment, drawn tiles and scales.
    p = data.draw(problems(algorithm=algorithm, dtype=dtype))
    out, lse = attend(p, algorithm)
    assert out.shape == p.q.shape and out.dtype == p.q.dtype
    assert lse.shape == p.q.shape[:-1] and lse.dtype == np.float32
    check_against_reference(p, out, lse, dtype)


@forward_variants
@given(data=st.data())
def test_permuting_keys_and_values_together_leaves_output_unchanged(algorithm, dtype, data):
    p = data.draw(problems(algorithm=algorithm, dtype=dtype, causal=False))
    perm = np.array(data.draw(st.permutations(range(p.k.shape[-2]))))
    out, lse = attend(p, algorithm)
    out_p, lse_p = attend(p, algorithm, k=p.k[..., perm, :], v=p.v[..., perm, :])
    # Both are within the model's bound of the same exact answer.
    for o, l in ((out, lse), (out_p, lse_p)):
        check_against_reference(p, o, l, dtype)


@forward_variants
@given(data=st.data())
def test_constant_value_rows_give_that_constant(algorithm, dtype, data):
    p = data.draw(problems(algorithm=algorithm, dtype=dtype, causal=False))
    row = p.v.reshape(-1, p.v.shape[-1])[0]
    out, _ = attend(p, algorithm, v=np.broadcast_to(row, p.v.shape).copy())
    tol = constant_rows_tolerance(p.k.shape[-2], dtype, np.abs(row.astype(np.float64)).max())
    np.testing.assert_allclose(out.astype(np.float64), np.broadcast_to(row, out.shape).astype(np.float64),
                               rtol=0, atol=tol)


@forward_variants
@given(data=st.data(), magnitude=st.sampled_from([1e2, 1e4]))
def test_huge_logits_do_not_overflow(algorithm, dtype, data, magnitude):
    p = data.draw(problems(algorithm=algorithm, dtype=dtype))
    if np.dtype(dtype) == np.float16:
        magnitude = 30.0  # float16 inputs top out at 65504; logits still reach the thousands
    q = (p.q.astype(np.float32) * magnitude).astype(dtype)
    out, lse = attend(p, algorithm, q=q, scale=1.0)
    assert np.all(np.isfinite(out.astype(np.float32))) and not np.any(np.isnan(lse))
    check_against_reference(p, out, lse, dtype, q=q, scale=1.0)


@forward_variants
@given(data=st.data())
def test_heads_are_computed_independently_and_deterministically(algorithm, dtype, data):
    p = data.draw(problems(algorithm=algorithm, dtype=dtype, gqa=False))
    out, lse = attend(p, algorithm)
    again, lse_again = attend(p, algorithm)
    np.testing.assert_array_equal(out, again)
    np.testing.assert_array_equal(lse, lse_again)
    q, k, v = (x.reshape((-1,) + x.shape[-2:]) for x in (p.q, p.k, p.v))
    h = data.draw(st.integers(0, q.shape[0] - 1))
    alone, alone_lse = attend(p, algorithm, q=q[h], k=k[h], v=v[h])
    np.testing.assert_array_equal(alone, out.reshape(q.shape)[h])
    np.testing.assert_array_equal(alone_lse, lse.reshape(q.shape[:-1])[h])


@variants([("flash2", np.float32), ("flash2", np.float16)])
@given(data=st.data())
def test_grouped_query_heads_equal_repeated_key_value_heads(algorithm, dtype, data):
    # Query head h reads key/value head h // group, with no copy: exactly what repeating them gives.
    p = data.draw(problems(algorithm=algorithm, dtype=dtype, gqa=True))
    out, lse = attend(p, algorithm)
    repeated, repeated_lse = attend(p, algorithm, k=p.expanded(p.k), v=p.expanded(p.v))
    np.testing.assert_array_equal(out, repeated)
    np.testing.assert_array_equal(lse, repeated_lse)


@forward_variants
@pytest.mark.parametrize("n_q, n_k, alignment", [(9, 4, "top_left"), (33, 17, "top_left"), (12, 9, "top_left"),
                                                 (9, 4, "bottom_right"), (7, 9, "bottom_right"),
                                                 (33, 17, "bottom_right")])
def test_causal_alignment_when_lengths_differ(algorithm, dtype, n_q, n_k, alignment):
    rng = np.random.default_rng(7)
    heads = 1 if numba_flash.in_simulator() else 2   # the alignment is per head: one is enough in the simulator
    q = rng.standard_normal((heads, n_q, 8)).astype(dtype)
    k, v = rng.standard_normal((2, heads, n_k, 8)).astype(dtype)
    out, lse = numba_flash.attention(q, k, v, causal=alignment, algorithm=algorithm, return_lse=True)
    ref_out, ref_lse = reference.attention(q, k, v, causal=alignment)
    assert_close_to_reference(out, lse, ref_out, ref_lse, q, k, v, 1 / np.sqrt(8), dtype)
    if alignment == "top_left":  # True means top-left, as torch's is_causal
        np.testing.assert_array_equal(numba_flash.attention(q, k, v, causal=True, algorithm=algorithm), out)
    # The queries that see every key (i >= N_k - 1 - offset: some in every case here; top-left with
    # N_q < N_k would have none) give non-causal attention there, bit for bit.
    offset = n_k - n_q if alignment == "bottom_right" else 0
    full = numba_flash.attention(q, k, v, algorithm=algorithm)
    tail = slice(max(0, n_k - 1 - offset), None)
    assert out[:, tail].size > 0
    np.testing.assert_array_equal(out[:, tail], full[:, tail])


# bfloat16 reaches the device through torch (tests/test_interop.py): Numba's arrays cannot hold it on a GPU.
@variants([(a, t) for a, t in FORWARD_VARIANTS if t != BFLOAT16])
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


def test_host_arrays_from_other_libraries_are_taken_as_host_arrays():
    # Lists and CPU torch tensors go through np.asarray; NumPy comes back.
    import torch

    rng = np.random.default_rng(9)
    q, k, v = rng.standard_normal((3, 2, 12, 8)).astype(np.float32)
    expected = numba_flash.attention(q, k, v)
    for convert in (lambda x: x.tolist(), torch.from_numpy):
        out = numba_flash.attention(*(convert(x) for x in (q, k, v)))
        assert isinstance(out, np.ndarray)
        np.testing.assert_array_equal(out, expected)
    bf16 = numba_flash.attention(*(torch.from_numpy(x.astype(np.float32)).to(torch.bfloat16) for x in (q, k, v)))
    assert bf16.dtype == BFLOAT16
    np.testing.assert_array_equal(bf16, numba_flash.attention(*(x.astype(BFLOAT16) for x in (q, k, v))))


@pytest.mark.parametrize("dtype", [np.float32, np.float16, BFLOAT16], ids=["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("head_dim", [1, 3, 72, 160, 256])
def test_flash2_head_dims_beyond_the_common_ones(dtype, head_dim):
    rng = np.random.default_rng(head_dim)
    n, heads = (5, 1) if numba_flash.in_simulator() else (200, 2)
    q, k, v = (rng.standard_normal((heads, n, head_dim)).astype(dtype) for _ in range(3))
    for causal in (False, True):
        out, lse = numba_flash.attention(q, k, v, causal=causal, return_lse=True)
        ref_out, ref_lse = reference.attention(q, k, v, causal=causal)
        assert_close_to_reference(out, lse, ref_out, ref_lse, q, k, v, 1 / np.sqrt(head_dim), dtype)


def test_flash2_is_the_default_algorithm(monkeypatch):
    from numba_flash import api
    called = []
    monkeypatch.setattr(api, "forward_launch", lambda call: called.append(call) or (lambda *args: None))
    numba_flash.attention(*(np.ones((2, 4, 8), np.float32),) * 3, scale=0.25)
    assert called and called[0].algorithm == "flash2"


def test_return_lse_false_returns_only_the_output():
    q = np.ones((4, 8), np.float32)
    out = numba_flash.attention(q, q, q, algorithm="flash1")
    assert isinstance(out, np.ndarray) and out.shape == (4, 8)


@forward_variants
@given(data=st.data(), dropout_p=st.sampled_from([0.1, 0.5]), seed=st.integers(0, 2 ** 64 - 1),
       masked=st.booleans())
def test_dropout_drops_exactly_the_generated_mask(algorithm, dtype, data, dropout_p, seed, masked):
    # With and without a block mask: the two share the kernels' inner loop.
    p = data.draw(problems(algorithm=algorithm, dtype=dtype))
    n_q, n_k = p.q.shape[-2], p.k.shape[-2]
    bm = None
    if masked:
        bm = data.draw(block_masks(n_q, n_k, p.block_sizes if algorithm == "flash1" else None))[0]
    dense = None if bm is None else bm.to_dense(n_q, n_k)
    blocks = bm.block_size if algorithm == "flash1" and bm is not None else p.block_sizes
    out, lse = attend(p, algorithm, dropout_p=dropout_p, seed=seed, block_mask=bm, block_sizes=blocks)
    keep = numba_flash.dropout_mask(p.q.shape[:-1] + (n_k,), dropout_p, seed)
    check_against_reference(p, out, lse, dtype, mask=dense, dropout_keep=keep, dropout_p=dropout_p)
    again, _ = attend(p, algorithm, dropout_p=dropout_p, seed=seed, block_mask=bm, block_sizes=blocks)
    np.testing.assert_array_equal(out, again)


@pytest.mark.parametrize("scale", [-0.7, 0.0, 1e-112, 1e-3, 2.5])
@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["float32", "float16"])
def test_flash2_takes_any_real_scale(scale, dtype):
    """A positive scale rides in the exponent's FMA with the row max taken over unscaled scores; zero
    and negative scales (which would flip or flatten that max) get the kernel that scales first, and so
    does a positive scale that rounds to 0 in float32 (1e-112: masked scores would be -inf * 0)."""
    rng = np.random.default_rng(11)
    # 37 rows: three query and three key tiles of 16 (the last ragged), the diagonal crossing each; in the
    # simulator two heads of one batch entry (each head runs the same blocks), on a GPU (2, 3).
    shape = (1, 2, 37, 16) if numba_flash.in_simulator() else (2, 3, 37, 16)
    q, k, v = (rng.standard_normal(shape).astype(dtype) for _ in range(3))
    out, lse = numba_flash.attention(q, k, v, causal=True, scale=scale, return_lse=True, algorithm="flash2")
    ref_out, ref_lse = reference.attention(*(x.astype(np.float64) for x in (q, k, v)), scale=scale, causal=True)
    assert_close_to_reference(out, lse, ref_out, ref_lse, q, k, v, scale, dtype)


@variants([(a, t) for a, t in FORWARD_VARIANTS if a == "flash2" and t != np.float32])
@given(data=st.data(), masked=st.booleans(), dropout_p=st.sampled_from([0.0, 0.3]))
def test_a_warp_of_32_rows_gives_the_bits_of_two_warps_of_16(algorithm, dtype, data, masked, dropout_p):
    """With ``tiling.FORWARD_WARP_ROWS`` = 32 a warp owns two 16-row fragments that share every K and V
    fragment it loads; each row still sees the same instructions in the same order as in a warp of 16,
    so the results are the same bits: causal and NaN included (block masks and dropout keep warps of 16,
    ``tiling.flash2_forward_warp_rows``: the same bits trivially, but through the rule).

    16-bit only: those are the precisions the library runs at 32 rows.  float32 never does
    (``FORWARD_WARP_ROWS``: its 3xTF32 fragments spill at 32 rows), and a float32 kernel forced to 32
    rows at d = 128 is other machine code: on the H200 one lse in 11 came out 1 ulp from the 16-row
    kernel's (2026-12-01, experiments/tuning/results/gpu_tests_h200.md, session 11)."""
    p = data.draw(problems(algorithm=algorithm, dtype=dtype))
    n_q, n_k, d = p.q.shape[-2], p.k.shape[-2], p.q.shape[-1]
    tiles = data.draw(block_sizes(algorithm, d, dtype).filter(lambda pair: pair[0] % 32 == 0))
    q = p.q.copy()
    if data.draw(st.booleans()):  # a NaN in one query row
        q.reshape(-1, d)[data.draw(st.integers(0, q.size // d - 1)), 0] = np.nan
    bm = data.draw(block_masks(n_q, n_k, batch_shape=p.q.shape[:-2]))[0] if masked else None
    options = dict(causal=p.causal, scale=p.scale, algorithm=algorithm, block_sizes=tiles, block_mask=bm,
                   dropout_p=dropout_p, seed=7, return_lse=True)
    with forward_warp_rows(16):
        sixteen = numba_flash.attention(q, p.k, p.v, **options)
    with forward_warp_rows(32):
        thirty_two = numba_flash.attention(q, p.k, p.v, **options)
    for a, b in zip(sixteen, thirty_two):
        np.testing.assert_array_equal(np.asarray(a, np.float64), np.asarray(b, np.float64))
