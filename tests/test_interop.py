"""CUDA arrays from other libraries go in and come out without a host round trip.

On a GPU every library that is importable takes part (Numba device arrays,
torch tensors, CuPy arrays); the simulator has only Numba's own (simulated)
device arrays.
"""
import importlib

import numpy as np
import pytest
from numba import cuda

import numba_flash


def _libraries():
    libs = ["numba"]
    if not numba_flash.in_simulator():
        for name in ("torch", "cupy"):
            try:
                importlib.import_module(name)
                libs.append(name)
            except ImportError:
                pass
    return libs


def _to_device(lib, x):
    if lib == "numba":
        return cuda.to_device(x)
    if lib == "torch":
        import torch
        return torch.as_tensor(x, device="cuda")
    import cupy
    return cupy.asarray(x)


@pytest.mark.parametrize("lib", _libraries())
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_device_inputs_give_the_same_result_as_host_inputs(lib, dtype):
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((1, 2, 20, 8)).astype(dtype) for _ in range(3))
    host_out, host_lse = numba_flash.attention(q, k, v, causal=True, return_lse=True)
    dev_out, dev_lse = numba_flash.attention(*(_to_device(lib, x) for x in (q, k, v)), causal=True,
                                             return_lse=True)
    assert not isinstance(dev_out, np.ndarray)
    np.testing.assert_array_equal(dev_out.copy_to_host(), host_out)
    np.testing.assert_array_equal(dev_lse.copy_to_host(), host_lse)
    if lib == "torch":  # the result wraps back into torch without a copy
        import torch
        as_torch = torch.as_tensor(dev_out, device="cuda")
        assert as_torch.data_ptr() == dev_out.device_ctypes_pointer.value


@pytest.mark.parametrize("lib", _libraries())
def test_non_contiguous_device_inputs_are_rejected_clearly(lib):
    x = _to_device(lib, np.zeros((4, 16, 8), np.float32))
    every_other_row = x[:, ::2, :]
    with pytest.raises(ValueError, match="q must be C-contiguous"):
        numba_flash.attention(every_other_row, every_other_row, every_other_row)


@pytest.mark.gpu_only
def test_torch_inputs_on_a_side_stream_are_read_after_their_producer():
    # numba_flash.attention imports torch tensors without a host sync and launches on the stream their
    # interface names (torch's current stream): a launch anywhere else would overtake the busy side
    # stream and read q2 before it is written.
    import torch

    rng = np.random.default_rng(5)
    q, k, v = (torch.tensor(rng.standard_normal((2, 2, 300, 64)).astype(np.float32), device="cuda") for _ in range(3))
    expected_out, expected_lse = numba_flash.attention(q, k, v, return_lse=True)
    expected_grads = numba_flash.attention_backward(q, k, v, expected_out, expected_lse, q)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)
        q2 = q * 1  # written on the side stream, after the sleep
        out, lse = numba_flash.attention(q2, k, v, return_lse=True)
        torch.cuda._sleep(50_000_000)
        do = q * 1
        grads = numba_flash.attention_backward(q2, k, v, out, lse, do)
    # The results carry the side stream, so their copies to the host wait for our kernels.
    np.testing.assert_array_equal(out.copy_to_host(), expected_out.copy_to_host())
    np.testing.assert_array_equal(lse.copy_to_host(), expected_lse.copy_to_host())
    for got, expected in zip(grads, expected_grads):
        np.testing.assert_array_equal(got.copy_to_host(), expected.copy_to_host())


@pytest.mark.gpu_only
def test_inputs_on_different_streams_are_synced_on_the_host_instead():
    from numba_flash._arrays import producer_stream

    rng = np.random.default_rng(6)
    q, k, v = (rng.standard_normal((1, 2, 100, 32)).astype(np.float32) for _ in range(3))
    first, second = cuda.stream(), cuda.stream()
    on_one = [cuda.to_device(x, stream=first) for x in (q, k, v)]
    assert int(producer_stream(on_one).handle) == int(first.handle)
    mixed = [cuda.to_device(q, stream=second)] + on_one[1:]
    assert producer_stream(mixed) is None  # no one stream orders them all
    expected = numba_flash.attention(q, k, v)
    for arrays in (on_one, mixed):
        np.testing.assert_array_equal(numba_flash.attention(*arrays).copy_to_host(), expected)
