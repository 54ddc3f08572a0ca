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
