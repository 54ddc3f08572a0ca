"""Moving user arrays to and from the kernels' (batch*heads, N, d) layout.

NumPy arrays are copied to the GPU and the results copied back.  Anything
with ``__cuda_array_interface__`` (Numba device arrays, torch or CuPy
tensors) is wrapped in place: no copy, no trip through host memory, and the
results stay on the device as Numba device arrays.
"""
import numpy as np
from numba import cuda

from .device import in_simulator


def cuda_interface(x):
    """The array's ``__cuda_array_interface__``, or None for host objects.

    The simulator's device arrays have no such interface; we describe them
    the same way so that the rest of the package need not know.
    """
    if in_simulator():
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

        if isinstance(x, FakeCUDAArray):
            host = x._ary
            return {"shape": host.shape, "typestr": host.dtype.str, "strides": host.strides, "data": None}
    try:
        return x.__cuda_array_interface__
    except AttributeError:
        return None
    except RuntimeError as exc:  # torch: "Can't get __cuda_array_interface__ on Variable that requires grad"
        raise TypeError(f"{exc}; call .detach() first, or use numba_flash.torch for autograd") from exc


def as_heads(x, on_device):
    """View x (..., N, d) as (batch*heads, N, d) on the device."""
    n, d = x.shape[-2:]
    if on_device:
        return (x if in_simulator() else cuda.as_cuda_array(x)).reshape(-1, n, d)
    return cuda.to_device(np.ascontiguousarray(x).reshape(-1, n, d))


def as_rows(x, on_device):
    """View a per-row statistic x (..., N) as (batch*heads, N) on the device."""
    n = tuple(x.shape)[-1]  # the simulator's device-array shapes refuse negative indices
    if on_device:
        return (x if in_simulator() else cuda.as_cuda_array(x)).reshape(-1, n)
    return cuda.to_device(np.ascontiguousarray(x).reshape(-1, n))


def empty(shape, dtype):
    return cuda.device_array(shape, dtype=dtype)


def deliver(x, batch_shape, on_device):
    """Give a (batch*heads, N[, d]) result back in the caller's shape and kind."""
    x = x.reshape(tuple(batch_shape) + tuple(x.shape[1:]))
    return x if on_device else x.copy_to_host()
