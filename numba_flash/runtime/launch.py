"""Compiling kernels and launching them with as little host work as the GPU allows.

Two ways to launch the same kernels:

* **direct** (on a GPU, the default).  A fast kernel (``Kernel``) is
  compiled once for an explicit signature: its arrays are 1-D and contiguous
  (the kernels index flat memory themselves), its other parameters int64 or
  float64.  A ``Launch`` lays out every parameter once, in Numba's flattened
  form (an array is meminfo, parent, nitems, itemsize, data, shape, stride; a
  scalar one slot), in a ctypes buffer; a call writes only what changes (the
  data pointers, the dropout seed) and calls ``cuLaunchKernel`` on the
  caller's stream.  Measured on the H200 (2026-11-30): 4.7 us per launch,
  against 29 us through ``_Kernel.launch`` with Numba arrays and 85 us
  through Numba's dispatcher with torch tensors, which types every argument
  on every call.  ``cuLaunchKernel`` itself is called through ctypes
  (``device.libcuda``), not cuda-python's binding, which checks and wraps
  each argument on every call.  This relies on numba-cuda internals (the compiled
  overload's ``_codelibrary.get_cufunc().handle``); setup.cfg pins the
  numba-cuda versions it was written against, and if they change shape the
  launch falls back to the dispatcher with a warning.
* **through Numba's dispatcher**: in the simulator (which has no driver),
  for the literal kernels (``launch``), and on a GPU with
  ``NUMBA_FLASH_LAUNCH=dispatcher`` (the fallback, tested to give the same
  bits).
"""
import ctypes
import functools
import inspect
import os
import struct
import sys
import threading
import warnings
from functools import cached_property

import numpy as np
from numba import cuda, from_dtype, types

from .device import device_limits, in_simulator, libcuda

_STATIC_SHARED_LIMIT = 48 * 1024
#: "direct" or "dispatcher": how ``Launch`` starts kernels on a GPU (read once; tests may change it).
LAUNCH_MODE = os.environ.get("NUMBA_FLASH_LAUNCH", "direct")


def cuda_kernel(fn, name, *, fastmath=False, launch_bounds=None):
    """``cuda.jit`` ``fn`` under a readable kernel name that profilers will show.

    GPU-only options (line info for ncu, launch bounds) are dropped in the
    simulator, whose ``cuda.jit`` rejects them.
    """
    fn.__name__ = fn.__qualname__ = name
    options = {"fastmath": fastmath}
    if not in_simulator():
        options["lineinfo"] = True
        if launch_bounds is not None:
            options["launch_bounds"] = launch_bounds
    return cuda.jit(**options)(fn)


def inlined_device_function(fn):
    """A device function that LLVM always inlines (the simulator, which has no such option, calls it)."""
    return cuda.jit(device=True)(fn) if in_simulator() else cuda.jit(device=True, forceinline=True)(fn)


def unrolled(functions):
    """One inlined device function that calls ``functions`` in order, each with the same arguments.

    For a loop over a compile-time range whose body is long (a row of scores per step, say): NVVM
    leaves such a loop rolled, and then the index is not a compile-time constant, which sends every
    local array it indexes to local memory (ptxas: a stack frame of the array's size).  Each function
    here has its step baked in (a closure), so the chain is straight-line code.
    """
    if len(functions) == 1:
        return functions[0]
    head, rest = functions[0], unrolled(functions[1:])

    @inlined_device_function
    def both(*args):
        head(*args)
        rest(*args)

    return both


def unrolled_or(functions):
    """One inlined device function returning the bitwise OR of ``functions``' results, each called with the same
    arguments: ``unrolled`` for a loop that gathers a word of bits, one per step (a mask's hidden entries, say)."""
    if len(functions) == 1:
        return functions[0]
    head, rest = functions[0], unrolled_or(functions[1:])

    @inlined_device_function
    def either(*args):
        return head(*args) | rest(*args)

    return either


_opted_in = set()


def _opt_in_shared_memory(compiled, dynamic_shared_bytes):
    """Raise a compiled kernel's dynamic shared-memory ceiling (CUDA refuses more than 48 KiB without it).

    numba-cuda has no API for CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
    so we set it through the driver, once per compiled kernel, to the device
    maximum: the attribute is a ceiling, not a reservation.
    """
    limit = device_limits().shared_bytes_per_block_optin
    if dynamic_shared_bytes > limit:
        raise ValueError(f"{dynamic_shared_bytes} bytes of shared memory exceed the device's {limit}")
    if id(compiled) in _opted_in:
        return
    from numba.cuda.cudadrv.driver import binding, driver

    cufunc = compiled._codelibrary.get_cufunc()
    driver.cuKernelSetAttribute(binding.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                limit, cufunc.handle, cufunc.device.id)
    _opted_in.add(id(compiled))


def launch(kernel, grid, block, args, *, dynamic_shared_bytes=0, stream=0):
    """Launch a ``cuda.jit`` kernel through Numba's dispatcher (the literal kernels, and the fallback)."""
    if in_simulator():
        # Simulated threads are Python threads: short switch intervals make
        # them meet at barriers several times sooner.
        interval = sys.getswitchinterval()
        sys.setswitchinterval(1e-4)
        try:
            kernel[grid, block, stream, dynamic_shared_bytes](*args)
        finally:
            sys.setswitchinterval(interval)
        return
    if dynamic_shared_bytes > _STATIC_SHARED_LIMIT:
        kernel = kernel.specialize(*args)
        for overload in kernel.overloads.values():
            _opt_in_shared_memory(overload, dynamic_shared_bytes)
    kernel[grid, block, stream, dynamic_shared_bytes](*args)


class Kernel:
    """A fast kernel specialisation: its dispatcher, and its parameters by name and type.

    ``arrays`` gives the element dtype of each array parameter (1-D,
    C-contiguous), or (dtype, ndim) for a C-contiguous array of ``ndim`` dims (a mod's arrays, which its
    Python function indexes as the user wrote it); parameters named in ``floats`` are float64, the rest int64.
    ``launch_bounds``: (threads per block, blocks per multiprocessor wanted),
    which caps the registers ptxas may use.
    """

    def __init__(self, fn, name, *, arrays, floats=(), launch_bounds=None):
        self.name = name
        self.launch_bounds = launch_bounds
        self.params = tuple(inspect.signature(fn).parameters)
        self.ndims = {param: spec[1] if isinstance(spec, tuple) else 1 for param, spec in arrays.items()}
        self.arrays = {param: np.dtype(spec[0] if isinstance(spec, tuple) else spec) for param, spec in arrays.items()}
        self.floats = frozenset(floats)
        unknown = (set(self.arrays) | self.floats) - set(self.params)
        assert not unknown, f"{name}: no parameters {unknown}"
        self.dispatcher = cuda_kernel(fn, name, launch_bounds=launch_bounds)

    def param_type(self, param):
        if param in self.arrays:
            return types.Array(from_dtype(self.arrays[param]), self.ndims[param], "C")
        return types.float64 if param in self.floats else types.int64

    @cached_property
    def compiled(self):
        """The compiled overload for the explicit signature (compiled on first use, then kept)."""
        return self.dispatcher.compile(tuple(self.param_type(param) for param in self.params))

    def __repr__(self):
        return f"Kernel({self.name})"


_UINT64 = (1 << 64) - 1
_ARRAY_SLOTS = 7  # meminfo, parent, nitems, itemsize, data, shape[0], strides[0] (1-D; ndim of each for more)
_DATA_SLOT = 4


def _direct_launch_available():
    return not in_simulator() and LAUNCH_MODE == "direct"


class Launch:
    """One kernel launch laid out once; a call supplies the arguments that change, and a stream.

    ``fixed``: values of the parameters that stay the same for every call
    (scalars, and arrays such as block-mask tile lists, kept alive here);
    ``per_call``: the names of the rest, in the order ``__call__`` takes them;
    ``extents``: the number of elements each per-call array parameter may touch
    (its flat view, as the kernel indexes it).  Arrays passed per call may be
    Numba device arrays, torch tensors or anything with
    ``__cuda_array_interface__`` (and the simulator's arrays there).
    """

    def __init__(self, kernel, grid, block, shared_bytes, fixed, per_call, extents):
        self.kernel = kernel
        self.grid, self.block, self.shared_bytes = int(grid), int(block), int(shared_bytes)
        self.fixed, self.per_call, self.extents = dict(fixed), tuple(per_call), dict(extents)
        missing = set(kernel.params) - set(self.fixed) - set(self.per_call)
        assert not missing, f"{kernel.name}: no value for {sorted(missing)}"
        self._direct = _direct_launch_available()
        if self._direct:
            try:
                self._lay_out()
            except AttributeError as exc:  # numba-cuda internals changed: keep working, slower
                warnings.warn(f"numba-flash: direct kernel launch unavailable ({exc}); using Numba's dispatcher")
                self._direct = False

    # ---- direct: a parameter buffer written once -------------------------------------------------

    def _lay_out(self):
        from cuda.bindings import driver as cuda_driver

        from .arrays import TORCH_TENSOR, device_pointer

        compiled = self.kernel.compiled
        self._handle = compiled._codelibrary.get_cufunc().handle
        if self.shared_bytes > _STATIC_SHARED_LIMIT:
            _opt_in_shared_memory(compiled, self.shared_bytes)
        library = libcuda()
        geometry = (self.grid, 1, 1, self.block, 1, 1, self.shared_bytes)
        if library is not None:  # launch(stream, params, extra) -> CUresult as an int
            self._launch = functools.partial(library.cuLaunchKernel, int(self._handle), *geometry)
        else:
            binding, handle = cuda_driver.cuLaunchKernel, self._handle
            self._launch = lambda stream, params, extra: int(binding(handle, *geometry, stream, params, 0)[0])
        values, self._call_slots, self._keep = [], [], []
        for param in self.kernel.params:
            if param in self.kernel.arrays:
                itemsize = self.kernel.arrays[param].itemsize
                if param in self.fixed:
                    array = self.fixed[param]
                    self._keep.append(array)
                    nitems, pointer = int(np.prod(array.shape)), device_pointer(array)
                else:
                    nitems, pointer = int(self.extents[param]), 0
                    self._call_slots.append((len(values) + _DATA_SLOT, "pointer"))
                shape = tuple(int(n) for n in array.shape) if self.kernel.ndims[param] > 1 else (nitems,)
                # C-order strides in bytes (a mod's arrays of several dims are C-contiguous: ``Kernel``)
                strides = tuple(int(np.prod(shape[i + 1:], dtype=np.int64)) * itemsize for i in range(len(shape)))
                values += [0, 0, nitems, itemsize, pointer, *shape, *strides]
            elif param in self.fixed:
                values.append(self._encode(param, self.fixed[param]))
            else:
                self._call_slots.append((len(values), "float" if param in self.kernel.floats else "int"))
                values.append(0)
        # Slots in the order of ``per_call``, whatever their order in the kernel's signature.
        order = [p for p in self.kernel.params if p not in self.fixed]
        by_name = dict(zip(order, self._call_slots))
        self._call_slots = [by_name[p] for p in self.per_call]
        self._slots = (ctypes.c_uint64 * len(values))(*values)
        self._doubles = (ctypes.c_double * len(values)).from_buffer(self._slots)
        base = ctypes.addressof(self._slots)
        self._pointers = (ctypes.c_void_p * len(values))(*(base + 8 * i for i in range(len(values))))
        self._params = ctypes.addressof(self._pointers)
        self._device_pointer = device_pointer
        self._torch_tensor = TORCH_TENSOR
        self._lock = threading.Lock()

    def _encode(self, param, value):
        if param in self.kernel.floats:
            return struct.unpack("<Q", struct.pack("<d", float(value)))[0]
        return int(value) & _UINT64

    def __call__(self, stream, *values):
        """Launch on ``stream`` (a raw CUDA stream handle, 0 for the legacy default stream) with ``values``
        for the ``per_call`` parameters."""
        if not self._direct:
            self._dispatch(stream, values)
            return
        with self._lock:  # one parameter buffer per launch: one call at a time fills it
            slots, doubles = self._slots, self._doubles
            for (slot, kind), value in zip(self._call_slots, values):
                if kind == "pointer":   # a torch tensor's without a call of device_pointer (~1 us a pointer)
                    slots[slot] = (value.data_ptr() if type(value) is self._torch_tensor
                                   else self._device_pointer(value))
                elif kind == "int":
                    slots[slot] = value & _UINT64
                else:
                    doubles[slot] = value
            err = self._launch(stream, self._params, None)
        if err:  # CUDA_SUCCESS is 0
            raise RuntimeError(f"cuLaunchKernel of {self.kernel.name} failed: error {int(err)}")

    # ---- fallback: Numba's dispatcher -------------------------------------------------------------

    def _dispatch(self, stream, values):
        from .arrays import flat_view, numba_stream

        args = dict(self.fixed)
        for param, value in zip(self.per_call, values):
            if param in self.kernel.arrays:
                value = flat_view(value, self.kernel.arrays[param], self.extents[param])
            args[param] = value
        ordered = []
        for param in self.kernel.params:
            value = args[param]
            if param in self.kernel.floats:
                value = float(value)
            elif param not in self.kernel.arrays:
                value = int(value)
            ordered.append(value)
        launch(self.kernel.dispatcher, self.grid, self.block, tuple(ordered), dynamic_shared_bytes=self.shared_bytes,
               stream=numba_stream(stream))


__all__ = ["Kernel", "Launch", "cuda_kernel", "inlined_device_function", "launch", "unrolled", "LAUNCH_MODE"]
