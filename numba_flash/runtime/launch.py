"""Compiling and launching kernels the same way in the simulator and on a GPU."""
import sys
from functools import lru_cache

import numpy as np
from numba import cuda

from .device import device_limits, in_simulator

_STATIC_SHARED_LIMIT = 48 * 1024


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


_opted_in = set()


def launch(kernel, grid, block, args, *, dynamic_shared_bytes=0, stream=0):
    """Launch ``kernel``; above 48 KiB of dynamic shared memory, opt in first.

    CUDA refuses launches that ask for more than 48 KiB of dynamic shared
    memory unless the kernel's CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    was raised; numba-cuda has no API for it, so we set it through the driver
    on the compiled function (once per specialisation).
    """
    if dynamic_shared_bytes > _STATIC_SHARED_LIMIT and not in_simulator():
        limit = device_limits().shared_bytes_per_block_optin
        if dynamic_shared_bytes > limit:
            raise ValueError(f"{dynamic_shared_bytes} bytes of shared memory exceed the device's {limit}")
        kernel = kernel.specialize(*args)
        for overload in kernel.overloads.values():
            if id(overload) not in _opted_in:
                # The attribute is a ceiling, not a reservation: raise it to
                # the device maximum once and every later launch fits under it.
                from numba.cuda.cudadrv.driver import binding, driver

                cufunc = overload._codelibrary.get_cufunc()
                driver.cuKernelSetAttribute(
                    binding.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    limit, cufunc.handle, cufunc.device.id)
                _opted_in.add(id(overload))
    if in_simulator():
        # Simulated threads are Python threads: short switch intervals make
        # them meet at barriers several times sooner.
        interval = sys.getswitchinterval()
        sys.setswitchinterval(1e-4)
        try:
            kernel[grid, block, stream, dynamic_shared_bytes](*args)
        finally:
            sys.setswitchinterval(interval)
    else:
        kernel[grid, block, stream, dynamic_shared_bytes](*args)


def cdiv(a, b):
    """ceil(a / b) for positive integers."""
    return -(-a // b)


@lru_cache(maxsize=None)
def no_mask_layout():
    """A 1x1x1 all-ones block layout: what kernels get when there is no block mask."""
    return cuda.to_device(np.ones((1, 1, 1), dtype=np.uint8))
