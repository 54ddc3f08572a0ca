"""Arrays in and out: what the API accepts, how kernels see it, and where results live.

Accepted inputs (``describe``):

* **torch tensors** on a CUDA device: used in place (any strides whose last
  dimension is contiguous), on torch's current stream; results are torch
  tensors from torch's caching allocator, on that stream.
* **Numba device arrays** and anything else with ``__cuda_array_interface__``
  (CuPy, ...): used in place, on the stream the array or its interface
  names (the legacy default stream if none); results are Numba device arrays
  from a small per-stream pool (``_OutputPool``), so a call allocates no new
  device memory once sizes repeat.
* **host arrays**: NumPy arrays, and anything ``np.asarray`` converts (CPU
  torch tensors; nested lists, as float32): copied to the GPU and the
  results copied back as NumPy.

No call waits on the host for the GPU: work is ordered on the streams the
inputs name (``stream_of``).

Kernels see flat 1-D views (``flat_view`` for Numba's dispatcher and the
simulator) or raw device pointers (``device_pointer`` for the direct launch
of ``launch.py``).
"""
import functools
import math
import threading
from collections import defaultdict
from dataclasses import dataclass
from typing import Tuple

import numpy as np
from numba import cuda

from ..tiling import cdiv
from .device import current_context, in_simulator

try:  # torch is optional; when present its tensors are the fast path
    import torch as _torch
except ImportError:
    _torch = None

#: ``torch.Tensor`` (None without torch): an exact type test is the cheapest.
TORCH_TENSOR = None if _torch is None else _torch.Tensor

#: dtypes the kernels take, by name (bfloat16 through ml_dtypes on the host, torch.bfloat16 on the device).
KERNEL_DTYPES = ("float32", "float16", "bfloat16")


def _bfloat16():
    """NumPy's bfloat16 dtype from ml_dtypes, or None when ml_dtypes is not installed."""
    try:
        import ml_dtypes
    except ImportError:
        return None
    return np.dtype(ml_dtypes.bfloat16)


def _torch_dtype_names():
    if _torch is None:
        return {}
    return {_torch.float32: "float32", _torch.float16: "float16", _torch.bfloat16: "bfloat16",
            _torch.float64: "float64", _torch.int32: "int32", _torch.int64: "int64", _torch.uint8: "uint8",
            _torch.bool: "bool"}


_TORCH_DTYPES = _torch_dtype_names()
_TORCH_BY_NAME = {name: dtype for dtype, name in _TORCH_DTYPES.items()}


@dataclass(frozen=True)
class Strides:
    """Element strides of the (batch, head, row) view of an operand (..., H, N, d) whose last dim is contiguous.

    The batch dims must form one stride; a missing head or batch dim has stride 0.
    """

    batch: int
    head: int
    row: int


def view_strides(name, shape, strides):
    """``Strides`` of an array of ``shape`` and element ``strides``, or a ValueError naming it."""
    row = strides[-2]
    head = strides[-3] if len(shape) > 2 and shape[-3] > 1 else 0
    batch_dims = [(n, s) for n, s in zip(shape[:-3], strides[:-3]) if n > 1]
    for (_, s_outer), (n_inner, s_inner) in zip(batch_dims, batch_dims[1:]):
        if s_outer != n_inner * s_inner:
            raise ValueError(f"{name}: its batch dims {tuple(shape[:-3])} with strides {tuple(strides[:-3])} do not "
                             f"form one stride; make it contiguous over them (e.g. .contiguous() or .reshape)")
    return Strides(batch_dims[-1][1] if batch_dims else 0, head, row)


def c_strides(shape):
    """Element strides of a C-contiguous array."""
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))


def is_c_contiguous(shape, strides):
    """Whether element ``strides`` lay ``shape`` out in C order (dims of size 1 may have any stride)."""
    return all(s == c or n == 1 for n, s, c in zip(shape, strides, c_strides(shape)))


@dataclass(frozen=True)
class Operand:
    """What the checks and kernels need to know of one input array."""

    kind: str                   # "torch", "cuda" (Numba or another __cuda_array_interface__) or "host"
    shape: Tuple[int, ...]
    strides: Tuple[int, ...]    # in elements
    dtype: str                  # "float32", "float16", "bfloat16", or another dtype's name (rejected later)
    aligned: bool               # data pointer on a 16-byte boundary
    stream: int                 # raw CUDA stream handle the data is ordered on (0: legacy default)
    device: int = 0

    @property
    def on_device(self):
        return self.kind != "host"


def is_torch_tensor(x):
    return _torch is not None and isinstance(x, _torch.Tensor)


def grad_enabled():
    return _torch.is_grad_enabled()


def describe(name, x):
    """An ``Operand`` for array ``x`` (named ``name`` in errors), or a TypeError."""
    if is_torch_tensor(x):
        if x.device.type != "cuda":
            return _describe_host(name, x)
        if x.requires_grad and _torch.is_grad_enabled():
            raise TypeError(f"{name} requires grad: use numba_flash.torch.attention for autograd, "
                            f"or pass {name}.detach()")
        dtype = _TORCH_DTYPES.get(x.dtype, str(x.dtype))
        index = x.device.index if x.device.index is not None else _torch.cuda.current_device()
        return Operand("torch", tuple(x.shape), tuple(x.stride()), dtype, x.data_ptr() % 16 == 0,
                       current_torch_stream(index), index)
    if in_simulator():
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

        if isinstance(x, FakeCUDAArray):
            host = x._ary
            return Operand("cuda", host.shape, tuple(s // host.itemsize for s in host.strides), _dtype_name(host.dtype),
                           True, 0)
    if is_numba_device_array(x):
        return Operand("cuda", tuple(x.shape), tuple(s // x.dtype.itemsize for s in x.strides), _dtype_name(x.dtype),
                       device_pointer(x) % 16 == 0, stream_handle(x.stream))
    interface = getattr(x, "__cuda_array_interface__", None)
    if interface is not None:
        dtype = np.dtype(interface["typestr"])
        shape = tuple(interface["shape"])
        strides = interface.get("strides")
        strides = (tuple(s // dtype.itemsize for s in strides) if strides is not None
                   else c_strides(shape))
        # The interface's stream: None (no ordering needed), or a handle (1 and 2 are
        # the legacy and per-thread default streams, valid handles for the driver too).
        return Operand("cuda", shape, strides, _dtype_name(dtype), interface["data"][0] % 16 == 0,
                       interface.get("stream") or 0)
    return _describe_host(name, x)


def _describe_host(name, x):
    try:
        array = as_host_array(x)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{name} must be an array: a NumPy array, a CUDA array (a torch tensor, a Numba "
                        f"device array, anything with __cuda_array_interface__), or something np.asarray "
                        f"converts; got {type(x).__name__} ({exc})") from None
    if array.dtype == object:
        raise TypeError(f"{name} must be a numeric array, got {type(x).__name__} that NumPy reads as objects")
    return Operand("host", array.shape, c_strides(array.shape), _dtype_name(array.dtype), True, 0)


def _dtype_name(dtype):
    dtype = np.dtype(dtype)
    return "bfloat16" if dtype.name == "bfloat16" else dtype.name


def as_host_array(x):
    """A NumPy array for a host input: CPU torch tensors (bfloat16 through ml_dtypes), and nested lists
    or tuples of numbers as float32 (the dtype every algorithm takes; NumPy would make them float64)."""
    if isinstance(x, (list, tuple)):
        return np.asarray(x, dtype=np.float32)
    if is_torch_tensor(x):
        x = x.detach()
        if x.dtype == _torch.bfloat16:
            bf16 = _bfloat16()
            if bf16 is None:
                raise TypeError("a CPU bfloat16 tensor needs ml_dtypes (pip install ml_dtypes), or move it to CUDA")
            return x.contiguous().view(_torch.int16).numpy().view(bf16)
        return x.numpy()
    return np.asarray(x)


def _device_ndarray_type():
    if in_simulator():
        return ()  # the simulator's arrays have no device memory: isinstance(x, ()) is False
    from numba.cuda.cudadrv.devicearray import DeviceNDArray

    return DeviceNDArray


_DEVICE_NDARRAY = _device_ndarray_type()


def is_numba_device_array(x):
    """A (real) Numba device array; the simulator's have no device memory."""
    return isinstance(x, _DEVICE_NDARRAY)


def is_device_array(x):
    """Whether ``x`` lives on the GPU: a CUDA torch tensor, a Numba device array (the simulator's too), or
    another object with ``__cuda_array_interface__``."""
    if is_torch_tensor(x):
        return x.device.type == "cuda"
    if is_numba_device_array(x):
        return True
    if in_simulator():
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

        return isinstance(x, FakeCUDAArray)
    return hasattr(x, "__cuda_array_interface__") and not isinstance(x, np.ndarray)


def stream_of(x):
    """The raw handle of the stream a CUDA array's data is ordered on (0: the legacy default stream)."""
    if is_numba_device_array(x):
        return stream_handle(x.stream)
    interface = getattr(x, "__cuda_array_interface__", None) if not in_simulator() else None
    return (interface.get("stream") or 0) if interface is not None else 0


# ---------------------------------------------------------------- streams

def current_torch_stream(device):
    """The raw handle of torch's current stream on ``device`` (int).

    ``torch.cuda.current_stream(device).cuda_stream`` builds a Python stream
    object (about 7 us on the H200); torch's own Triton launcher reads the
    raw handle instead, as we do when torch offers it.
    """
    raw = getattr(_torch._C, "_cuda_getCurrentRawStream", None)
    return raw(device) if raw is not None else _torch.cuda.current_stream(device).cuda_stream


def stream_handle(stream):
    """The raw handle of a Numba stream (0 for Numba's default stream)."""
    return int(stream) if stream else 0


@functools.lru_cache(maxsize=64)
def _external_stream(handle):
    return cuda.external_stream(handle)


def numba_stream(handle):
    """A Numba stream object for a raw handle (0: the legacy default stream), created once per handle."""
    return 0 if not handle or in_simulator() else _external_stream(handle)


def wait_for(stream, others):
    """Order ``stream`` after the current work of every stream in ``others`` (events, no host wait)."""
    from cuda.bindings import driver as cuda_driver

    for other in set(others) - {stream}:
        err, event = cuda_driver.cuEventCreate(cuda_driver.CUevent_flags.CU_EVENT_DISABLE_TIMING)
        cuda_driver.cuEventRecord(event, other)
        cuda_driver.cuStreamWaitEvent(stream, event, 0)
        cuda_driver.cuEventDestroy(event)


# ---------------------------------------------------------------- kernels' views

def device_pointer(x):
    """The device address of ``x``'s first element (torch tensor, Numba array, or CUDA array interface)."""
    if is_torch_tensor(x):
        return x.data_ptr()
    pointer = getattr(x, "_numba_flash_pointer", None)  # our pooled results carry it
    if pointer is not None:
        return pointer
    gpu_data = getattr(x, "gpu_data", None)
    if gpu_data is not None:
        return int(gpu_data.device_pointer)
    return x.__cuda_array_interface__["data"][0]


def flat_view(x, dtype, extent):
    """A 1-D Numba device array of ``extent`` elements of ``dtype`` starting at ``x``'s first element.

    The kernels index operands as flat memory with their own strides; this
    view is how Numba's dispatcher (and the simulator) passes them.
    """
    dtype = np.dtype(dtype)
    if in_simulator():
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

        host = x._ary if isinstance(x, FakeCUDAArray) else np.asarray(x)
        if host.flags.c_contiguous:
            flat = host.reshape(-1)  # a view, so the traffic counter finds its root buffer
        else:
            flat = np.lib.stride_tricks.as_strided(host, shape=(extent * dtype.itemsize // host.itemsize,),
                                                   strides=(host.itemsize,))
        return FakeCUDAArray(flat.view(dtype)[:extent])
    from numba.cuda.cudadrv.devicearray import DeviceNDArray

    if not isinstance(x, DeviceNDArray):
        x = cuda.as_cuda_array(x, sync=False)
    return DeviceNDArray((extent,), (dtype.itemsize,), dtype, stream=x.stream, gpu_data=x.gpu_data)


def extent(shape, strides):
    """Elements from the first to one past the last element of a (non-negative) strided array."""
    return 1 + sum((n - 1) * s for n, s in zip(shape, strides))


# ---------------------------------------------------------------- results

class _OutputPool:
    """Device memory for results returned as Numba device arrays, kept per stream and reused once dropped.

    ``cuda.device_array`` costs about 55 us per call on the H200 (a driver
    allocation and Numba's bookkeeping); a call of numba-flash returns two or
    three arrays.  Blocks come straight from the driver, lent to one result at
    a time, and come back here when the result (and every view of it) is
    garbage; they go out again only for work on the same stream, which runs
    after everything queued there before: the rule torch's caching allocator
    follows.  At most ``CACHE_BYTES`` of dropped blocks are kept; the rest are
    freed.
    """

    CACHE_BYTES = 1 << 30
    GRANULE = 512

    def __init__(self):
        self._free = defaultdict(list)     # (stream, bytes) -> [device addresses]
        self._cached = 0
        self._lock = threading.Lock()
        self._templates = {}

    def _take(self, stream, nbytes):
        from cuda.bindings import driver as cuda_driver

        nbytes = cdiv(max(nbytes, 1), self.GRANULE) * self.GRANULE
        with self._lock:
            free = self._free.get((stream, nbytes))
            if free:
                self._cached -= nbytes
                return free.pop(), nbytes
        current_context()  # the primary context, current on this thread
        err, pointer = cuda_driver.cuMemAlloc(nbytes)
        if err != cuda_driver.CUresult.CUDA_SUCCESS:
            raise MemoryError(f"numba-flash: cuMemAlloc of {nbytes} bytes failed: {err!r}")
        return int(pointer), nbytes

    def give_back(self, address, stream, nbytes):
        with self._lock:
            if self._cached + nbytes <= self.CACHE_BYTES:
                self._free[stream, nbytes].append(address)
                self._cached += nbytes
                return
        from cuda.bindings import driver as cuda_driver

        cuda_driver.cuMemFree(address)  # waits for the work queued on it

    def empty(self, shape, dtype, stream):
        """A C-contiguous Numba device array of ``shape`` and ``dtype``, ordered on ``stream``."""
        from numba.cuda.cudadrv.devicearray import DeviceNDArray
        from numba.cuda.cudadrv.driver import MemoryPointer, binding

        dtype = np.dtype(dtype)
        address, nbytes = self._take(stream, math.prod(shape) * dtype.itemsize)
        # The array's memory is a plain pointer owned by a lease: when the array and every view
        # of it are gone, the lease returns the block here.
        memory = MemoryPointer(current_context(), binding.CUdeviceptr(address), nbytes,
                               owner=_Lease(self, address, stream, nbytes))
        key = (tuple(shape), dtype.str)
        template = self._templates.get(key)
        if template is None:  # one full construction per shape; later arrays copy its fields
            strides = tuple(s * dtype.itemsize for s in c_strides(shape))
            template = self._templates[key] = DeviceNDArray(shape, strides, dtype, gpu_data=memory).__dict__.copy()
            del template["gpu_data"]
        array = object.__new__(DeviceNDArray)
        array.__dict__.update(template)
        array.gpu_data = memory
        array.stream = numba_stream(stream)
        array._numba_flash_pointer = address
        return array


class _Lease:
    """A pooled block lent to one result; it goes back to the pool when the result is garbage."""

    __slots__ = ("pool", "address", "stream", "nbytes")

    def __init__(self, pool, address, stream, nbytes):
        self.pool, self.address, self.stream, self.nbytes = pool, address, stream, nbytes

    def __del__(self):
        self.pool.give_back(self.address, self.stream, self.nbytes)


_POOL = _OutputPool()


def empty(kind, shape, dtype, stream, device=0):
    """A new C-contiguous result of ``kind`` ("torch" or "cuda"; host calls compute on "cuda" arrays).

    bfloat16 outside torch is held as its 16-bit words (uint16): Numba's
    copies go through the buffer protocol, which has no bfloat16.
    """
    dtype = str(dtype) if not isinstance(dtype, np.dtype) else _dtype_name(dtype)
    if kind == "torch":
        return _torch.empty(shape, dtype=_TORCH_BY_NAME[dtype], device=_torch_device(device))
    np_dtype = np.dtype(np.uint16) if dtype == "bfloat16" else np.dtype(dtype)
    if in_simulator():
        return cuda.device_array(shape, dtype=np_dtype)
    return _POOL.empty(shape, np_dtype, stream)


def zeros(kind, shape, dtype, stream, device=0):
    """``empty``'s result, zeroed in order on ``stream`` (torch's: its current stream, the one torch calls
    launch on)."""
    if kind == "torch":
        return _torch.zeros(shape, dtype=_TORCH_BY_NAME[str(dtype)], device=_torch_device(device))
    return _upload(np.zeros(shape, np.dtype(dtype)), stream)


def capturing():
    """Whether torch is capturing a CUDA graph on its current stream."""
    return _torch is not None and _torch.cuda.is_current_stream_capturing()


@functools.lru_cache(maxsize=None)
def _torch_device(index):
    return _torch.device("cuda", index)


def to_device(x):
    """A host array on the GPU (a C-contiguous copy; bfloat16 as its 16-bit words)."""
    array = np.ascontiguousarray(as_host_array(x))
    return cuda.to_device(array.view(np.uint16) if _dtype_name(array.dtype) == "bfloat16" else array)


def to_host(x, dtype):
    """A device result of ``dtype`` (a name) back on the host as NumPy (bfloat16 as ml_dtypes' bfloat16)."""
    host = x.copy_to_host()
    return host.view(_bfloat16()) if dtype == "bfloat16" else host


def integers_on_host(x):
    """A small integer array (e.g. cu_seqlens) as NumPy, wherever it lives.  One that lives on the GPU is
    copied back, which waits for the stream it is ordered on: the price of checking it."""
    if is_torch_tensor(x):
        return x.detach().cpu().numpy()
    if is_numba_device_array(x):
        return x.copy_to_host()
    if hasattr(x, "__cuda_array_interface__") and not isinstance(x, np.ndarray):
        return cuda.as_cuda_array(x).copy_to_host()
    return np.asarray(x)


def int32_on_device(x, host, kind, device=0, stream=None):
    """``x`` as a 1-D int32 device array for the kernels: ``x`` itself when it already is one of the call's
    ``kind`` (no copy), else a copy of ``host``.

    With ``stream`` (the raw handle the call launches on) the copy is ordered on it and the host does not
    wait for the GPU: a pageable host array is staged at once, so it may go right after.  Without, the copy
    is a synchronous one, which first waits for the work queued on the legacy default stream (fine while
    a plan is built, not inside a call).
    """
    if kind == "torch" and is_torch_tensor(x) and x.device.type == "cuda":
        if x.dtype == _torch.int32 and x.dim() == 1 and x.is_contiguous():
            return x
        return x.to(_torch.int32).contiguous()
    if kind == "torch":   # torch copies on its current stream: the one a torch call launches on
        return _torch.from_numpy(host.astype(np.int32)).to(_torch_device(device), non_blocking=stream is not None)
    if kind == "cuda" and is_numba_device_array(x) and x.dtype == np.int32 and x.ndim == 1 and x.is_c_contiguous():
        return x
    return _upload(host.astype(np.int32), stream)


def _upload(host, stream):
    """A NumPy array copied to the GPU in order on ``stream`` (a raw handle), the host not waiting; with
    ``stream`` None a synchronous copy."""
    if stream is None or in_simulator():
        return cuda.to_device(host)
    return cuda.to_device(host, stream=numba_stream(stream) or cuda.default_stream())


def kernel_array(a):
    """A mod's array as a kernel parameter: CUDA arrays in place (a contiguous copy of a non-contiguous tensor),
    host arrays (NumPy, CPU tensors) copied to the GPU."""
    if is_torch_tensor(a):
        if not a.is_cuda:
            return cuda.to_device(np.ascontiguousarray(a.detach().numpy()))
        return a if a.is_contiguous() else a.contiguous()
    if hasattr(a, "__cuda_array_interface__") or hasattr(a, "copy_to_host"):
        return a
    return cuda.to_device(np.ascontiguousarray(a))


@functools.lru_cache(maxsize=None)
def placeholder(dtype, ndim=1):
    """A one-element device array (of ``ndim`` dims) for array parameters a kernel specialisation never reads."""
    return cuda.to_device(np.zeros((1,) * ndim, dtype=dtype))
