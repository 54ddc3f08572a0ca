"""CUDA arrays from other libraries go in and come out without a host round trip, strided or not.

On a GPU every library that is importable takes part (Numba device arrays,
torch tensors, CuPy arrays); the simulator has only Numba's own (simulated)
device arrays.  torch tensors come back as torch tensors, every other kind
as Numba device arrays.
"""
import importlib

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from numba import cuda

import numba_flash
import reference
from strategies import BFLOAT16
from tolerances import forward_tolerance


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
        if x.dtype == BFLOAT16:
            return torch.as_tensor(x.view(np.int16), device="cuda").view(torch.bfloat16)
        return torch.as_tensor(x, device="cuda")
    import cupy
    return cupy.asarray(x)


def _to_host(x):
    if hasattr(x, "copy_to_host"):
        return x.copy_to_host()
    import torch
    if x.dtype == torch.bfloat16:
        return x.view(torch.int16).cpu().numpy().view(BFLOAT16)
    return x.cpu().numpy()


def _dtypes(lib):
    # bfloat16 reaches the kernels from torch tensors, or from the host through ml_dtypes.
    return [np.float32, np.float16] + ([BFLOAT16] if lib == "torch" else [])


@pytest.mark.parametrize("lib", _libraries())
def test_device_inputs_give_the_same_result_as_host_inputs(lib):
    for dtype in _dtypes(lib):
        rng = np.random.default_rng(3)
        q, k, v = (rng.standard_normal((1, 2, 20, 8)).astype(dtype) for _ in range(3))
        host_out, host_lse = numba_flash.attention(q, k, v, causal=True, return_lse=True)
        dev_out, dev_lse = numba_flash.attention(*(_to_device(lib, x) for x in (q, k, v)), causal=True,
                                                 return_lse=True)
        assert not isinstance(dev_out, np.ndarray)
        if lib == "torch":  # torch in, torch out (from torch's caching allocator)
            import torch
            assert isinstance(dev_out, torch.Tensor) and isinstance(dev_lse, torch.Tensor)
        np.testing.assert_array_equal(_to_host(dev_out), host_out)
        np.testing.assert_array_equal(_to_host(dev_lse), host_lse)


def swap_middle_axes(x):
    """(B, N, H, d) viewed as (B, H, N, d), with no copy, for each library's arrays."""
    if isinstance(x, np.ndarray):
        return x.transpose(0, 2, 1, 3)
    if numba_flash.in_simulator():
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray
        return FakeCUDAArray(x._ary.transpose(0, 2, 1, 3))
    if isinstance(x, cuda.devicearray.DeviceNDArray):  # Numba transposes only 2-D arrays: build the view
        order = (0, 2, 1, 3)
        return cuda.devicearray.DeviceNDArray(tuple(x.shape[i] for i in order), tuple(x.strides[i] for i in order),
                                              x.dtype, gpu_data=x.gpu_data)
    return x.transpose(1, 2) if hasattr(x, "dim") else x.transpose(0, 2, 1, 3)  # torch, CuPy


@pytest.mark.parametrize("lib", _libraries())
@given(data=st.data())
def test_strided_views_run_in_place_and_equal_contiguous_copies(lib, data):
    # A (B, N, H, d) layout viewed as (B, H, N, d), every other row, an offset start: flash2 reads any
    # strides whose last dimension is contiguous.
    dtype = data.draw(st.sampled_from(_dtypes(lib)))
    batch, heads, n, d = (data.draw(st.integers(1, top)) for top in (2, 3, 20, 16))
    rng = np.random.default_rng(data.draw(st.integers(0, 2 ** 32 - 1)))
    base = rng.standard_normal((batch, 2 * n + 1, heads, d)).astype(dtype)
    view = data.draw(st.sampled_from(["transposed", "every other row", "offset"]))
    device = _to_device(lib, base)

    def pick(x):
        if view == "every other row":
            x = x[:, ::2]
        elif view == "offset":
            x = x[:, 1:]
        return swap_middle_axes(x)

    strided = pick(device)
    expected = numba_flash.attention(*(np.ascontiguousarray(pick(base)),) * 3, causal=True)
    got = numba_flash.attention(strided, strided, strided, causal=True)
    np.testing.assert_array_equal(_to_host(got), expected)


@pytest.mark.simulator_only  # on a GPU numba-cuda cannot even copy bfloat16 arrays: there are none to reject
def test_bfloat16_numba_arrays_are_rejected_clearly():
    x = cuda.to_device(np.zeros((4, 16, 8), np.uint16)).view(BFLOAT16)
    with pytest.raises(TypeError, match="bfloat16 .* torch tensors"):
        numba_flash.attention(x, x, x)


@pytest.mark.parametrize("lib", _libraries())
def test_inputs_that_cannot_run_in_place_are_rejected_clearly(lib):
    x = _to_device(lib, np.zeros((4, 16, 8), np.float32))
    every_other_column = x[:, :, ::2]
    with pytest.raises(ValueError, match="q must have a contiguous last dimension"):
        numba_flash.attention(every_other_column, x[:, :, :4], x[:, :, :4])
    every_other_row = x[:, ::2, :]
    with pytest.raises(ValueError, match="q must be C-contiguous for algorithm='flash1'"):
        numba_flash.attention(every_other_row, every_other_row, every_other_row, algorithm="flash1")


#: Lengths given on the host, uploaded inside the call: the cache's entries, the packed sequences' bounds.
CACHE_SEQLENS = np.array([256, 251], np.int32)
CU_SEQLENS = np.array([0, 200, 512], np.int32)


def _per_sequence(q, k, v):
    """Packed (total, H, d) arrays attended sequence by sequence (CU_SEQLENS), in float64."""
    parts = []
    for a, b in zip(CU_SEQLENS[:-1], CU_SEQLENS[1:]):
        heads_first = [x[a:b].transpose(1, 0, 2)[None] for x in (q, k, v)]
        parts.append(reference.attention(*heads_first)[0][0].transpose(1, 0, 2))
    return np.concatenate(parts)


#: name: (inputs from a (2, 4, 256, 64) host q, the call on device arrays, the float64 expectation).  The cache
#: call with lengths on the GPU reads them on the GPU only; with host lengths it uploads them.
ENTRY_POINTS = {
    "attention": (lambda q: (q, q, q), numba_flash.attention, lambda q, k, v: reference.attention(q, k, v)[0]),
    "attention_with_kv_cache": (
        lambda q: (np.ascontiguousarray(q[:, :, -1:]), q, q),
        lambda q, k, v: numba_flash.attention_with_kv_cache(q, k, v, CACHE_SEQLENS),
        lambda q, k, v: np.concatenate([reference.attention(q[b:b + 1], k[b:b + 1, :, :n], v[b:b + 1, :, :n])[0]
                                        for b, n in enumerate(CACHE_SEQLENS)])),
    "attention_with_kv_cache, lengths on the GPU": (
        lambda q: (np.ascontiguousarray(q[:, :, -1:]), q, q, CACHE_SEQLENS),
        numba_flash.attention_with_kv_cache,
        lambda q, k, v, _: np.concatenate([reference.attention(q[b:b + 1], k[b:b + 1, :, :n], v[b:b + 1, :, :n])[0]
                                           for b, n in enumerate(CACHE_SEQLENS)])),
    "attention_varlen": (
        lambda q: (np.ascontiguousarray(q.transpose(0, 2, 1, 3).reshape(-1, *q.shape[1::2])),) * 3,
        lambda q, k, v: numba_flash.attention_varlen(q, k, v, CU_SEQLENS, CU_SEQLENS),
        _per_sequence),
}


@pytest.mark.gpu_only
@pytest.mark.parametrize("lib", ["torch", "numba"])
@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_a_call_returns_before_the_work_it_queues_behind_finishes(lib, name):
    # No host synchronisation inside a call: issued behind a long kernel on the same stream, the call
    # returns while that kernel still runs, and its results come out right once the stream is done.  The
    # cache and packed calls upload lengths given on the host: a synchronous copy would wait for the stream.
    import time

    import torch

    inputs, call, expect = ENTRY_POINTS[name]
    hosts = inputs(np.random.default_rng(0).standard_normal((2, 4, 256, 64)).astype(np.float16))
    # Both kinds run on the legacy default stream, where torch queues the products below.
    arrays = [torch.from_numpy(x).cuda() if lib == "torch" else cuda.to_device(x) for x in hosts]
    call(*arrays)   # plan and compile first
    torch.cuda.synchronize()
    if lib == "numba":
        # Numba frees unreferenced device memory in batches, once more than CUDA_DEALLOCS_COUNT frees are pending,
        # and cuMemFree waits for the device: with the count brought to the brink here, any array the call
        # drops would free a batch inside the call, unless the call holds its frees back (api.py).
        from numba.cuda.cudadrv import driver

        pending, brink = cuda.current_context().memory_manager.deallocations, driver.config.CUDA_DEALLOCS_COUNT
        pending.clear()
        for _ in range(brink):
            cuda.device_array(1)
        assert len(pending._cons) == brink
    big = torch.randn(8192, 8192, device="cuda")
    for _ in range(20):
        big = big @ big / 8192 ** 0.5   # tens of milliseconds queued on the legacy default stream
    out = call(*arrays)
    returned = time.perf_counter()
    busy = not torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    finished = time.perf_counter()
    assert busy, f"the stream had already drained: numba_flash.{name} waited for it"
    assert finished - returned > 1e-3
    hosts64 = [x.astype(np.float64) for x in hosts]
    k64 = hosts64[1]
    tol, _ = forward_tolerance(k64, k64, k64, 64 ** -0.5, np.float16)   # q = k = v everywhere but the cache's q
    np.testing.assert_allclose(_to_host(out).astype(np.float64), expect(*hosts64), rtol=0, atol=tol)
