"""Simulator or GPU: decided once, before Numba is imported.

Numba reads NUMBA_ENABLE_CUDASIM when it is first imported.  If the user has
not set it and no CUDA GPU is present, numba-flash turns the simulator on so
that it still runs (slowly) on a laptop or in CI.  If Numba was imported
first, or the variable is set, we leave the choice alone.
"""
import ctypes
import os
import sys
import warnings


def gpu_present() -> bool:
    """True if the CUDA driver loads and reports at least one device."""
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    count = ctypes.c_int(0)
    return libcuda.cuInit(0) == 0 and libcuda.cuDeviceGetCount(ctypes.byref(count)) == 0 and count.value > 0


def use_simulator_if_no_gpu():
    if "NUMBA_ENABLE_CUDASIM" in os.environ or "numba" in sys.modules:
        return
    if not gpu_present():
        os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
        warnings.warn("numba-flash: no CUDA GPU found, so kernels run in Numba's CUDA simulator "
                      "(correct but slow; set NUMBA_ENABLE_CUDASIM=0 to turn this off)", stacklevel=3)
