"""Sizes only a GPU reaches: more heads than a grid dimension holds, tensors past 2^31 elements, float32
that keeps its accuracy at any length.  Deselected in the simulator (see conftest.py)."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import numba_flash
import reference
from tolerances import assert_close_to_reference, backward_tolerance, long_sequence_tolerance

pytestmark = pytest.mark.gpu_only


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_more_heads_than_a_grid_dimension_holds(dtype):
    # 70000 batch x heads: beyond gridDim.y's 65535, forward and backward.
    import torch

    torch.manual_seed(0)
    q, k, v, do = (torch.randn(70000, 16, 16, device="cuda", dtype=getattr(torch, dtype)) for _ in range(4))
    out, lse = numba_flash.attention(q, k, v, causal=True, return_lse=True)
    grads = numba_flash.attention_backward(q, k, v, out, lse, do, causal=True)
    heads = [0, 1, 65534, 65535, 65536, 69999] + torch.randint(0, 70000, (10,)).tolist()
    for h in heads:
        qh, kh, vh, doh = (x[h].float().cpu().numpy() for x in (q, k, v, do))
        ref_out, ref_lse = reference.attention(qh, kh, vh, causal=True)
        assert_close_to_reference(out[h].cpu().numpy(), lse[h].cpu().numpy(), ref_out, ref_lse, qh, kh, vh, 0.25,
                                  np.dtype(dtype))
        expected = reference.attention_backward(qh, kh, vh, doh, causal=True)
        weights = reference.softmax(reference.masked_scores(qh, kh, causal=True))
        tolerances = backward_tolerance(qh, kh, vh, out[h].cpu().numpy(), doh, 0.25, weights, dtype=np.dtype(dtype))
        for name, got, want, tol in zip(("dq", "dk", "dv"), grads, expected, tolerances):
            err = float(np.abs(got[h].double().cpu().numpy() - want).max())
            assert err <= tol, f"head {h} {name}: {err:.3g} > {tol:.3g}"


def test_a_tensor_past_2_31_elements():
    # (1, 32, 524288, 128) float16: 2^31 elements per tensor (4 GiB), 64-bit offsets throughout.
    # Sampled rows of the first and last heads against float64 (computed on the GPU).
    import torch

    shape = (1, 32, 524288, 128)
    torch.manual_seed(1)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.float16) for _ in range(3))
    out, lse = numba_flash.attention(q, k, v, causal=True, return_lse=True)
    rows = [0, 1, 4095, 262144, 524286, 524287] + torch.randint(0, shape[2], (4,)).tolist()
    for h in (0, 31):
        keys, values = k[0, h].float().cpu().numpy(), v[0, h].float().cpu().numpy()
        for i in rows:
            query = q[0, h, i:i + 1].float().cpu().numpy()
            ref_out, ref_lse = reference.attention(query, keys[: i + 1], values[: i + 1])
            assert_close_to_reference(out[0, h, i:i + 1].cpu().numpy(), lse[0, h, i:i + 1].cpu().numpy(), ref_out,
                                      ref_lse, query, keys[: i + 1], values[: i + 1], 1 / np.sqrt(128),
                                      np.dtype(np.float16))


@settings(max_examples=6, deadline=None)
@given(n=st.sampled_from([1000, 4096, 16384, 65536]), seed=st.integers(0, 2 ** 32 - 1))
def test_float32_error_does_not_grow_with_length(n, seed):
    # The relative error of O against float64 stays under one bound for every length: the tensor
    # cores' truncating accumulator no longer runs across key tiles (tolerances.long_sequence_tolerance).
    import torch

    generator = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(1, 2, n, 64, device="cuda", generator=generator) for _ in range(3))
    out = numba_flash.attention(q, k, v)
    # float64 in chunks of 2048 queries: the whole N x N score matrix would take 64 GiB at N = 65536.
    expected = torch.cat([torch.nn.functional.scaled_dot_product_attention(q[:, :, i:i + 2048].double(), k.double(),
                                                                           v.double()) for i in range(0, n, 2048)], 2)
    relative = float((out.double() - expected).norm() / expected.norm())
    assert relative <= long_sequence_tolerance(), f"N = {n}: relative error {relative:.3g}"


@settings(max_examples=3, deadline=None)
@given(n=st.sampled_from([2048, 16384]), seed=st.integers(0, 2 ** 32 - 1))
def test_float32_gradients_do_not_lose_accuracy_with_length(n, seed):
    import torch

    generator = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v, do = (torch.randn(1, 2, n, 64, device="cuda", generator=generator) for _ in range(4))
    out, lse = numba_flash.attention(q, k, v, return_lse=True)
    grads = numba_flash.attention_backward(q, k, v, out, lse, do)
    leaves = tuple(x.double().requires_grad_() for x in (q, k, v))
    expected = torch.autograd.grad(torch.nn.functional.scaled_dot_product_attention(*leaves), leaves, do.double())
    for name, got, want in zip(("dq", "dk", "dv"), grads, expected):
        relative = float((got.double() - want).norm() / want.norm())
        assert relative <= long_sequence_tolerance(backward=True), f"{name}, N = {n}: relative error {relative:.3g}"
