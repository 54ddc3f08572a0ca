"""What the kernels need to know about the GPU they will run on.

Everything is read once from the current CUDA device.  In Numba's CUDA
simulator there is no device to ask, so the simulator reports the H200's
numbers: tests that check "too large for shared memory" then behave the same
in CI as on the real card.
"""
import ctypes
import sys
from dataclasses import dataclass
from functools import lru_cache

from numba import config, cuda


@dataclass(frozen=True)
class DeviceLimits:
    """Hardware limits that decide tile sizes and launch shapes."""

    name: str
    compute_capability: tuple
    multiprocessors: int
    max_threads_per_block: int
    #: Shared memory a block may use without opting in (static arrays stop here).
    shared_bytes_per_block: int
    #: Shared memory a block may use after the per-kernel opt-in (dynamic arrays).
    shared_bytes_per_block_optin: int
    #: True for Numba's CUDA simulator, which reports the H200's limits.
    simulated: bool = False


# The H200 (compute capability 9.0), as read off the card on 2026-11-30.
SIMULATED_DEVICE = DeviceLimits(
    name="CUDA simulator (reporting H200 limits)",
    compute_capability=(9, 0),
    multiprocessors=132,
    max_threads_per_block=1024,
    shared_bytes_per_block=48 * 1024,
    shared_bytes_per_block_optin=232448,
    simulated=True,
)


def in_simulator() -> bool:
    """True when Numba runs kernels in its CUDA simulator (NUMBA_ENABLE_CUDASIM=1)."""
    return bool(config.ENABLE_CUDASIM)


@lru_cache(maxsize=None)
def _limits_of_device(device_id: int) -> DeviceLimits:
    dev = cuda.get_current_device()
    name = dev.name.decode() if isinstance(dev.name, bytes) else str(dev.name)
    return DeviceLimits(
        name=name,
        compute_capability=tuple(dev.compute_capability),
        multiprocessors=int(dev.MULTIPROCESSOR_COUNT),
        max_threads_per_block=int(dev.MAX_THREADS_PER_BLOCK),
        shared_bytes_per_block=int(dev.MAX_SHARED_MEMORY_PER_BLOCK),
        shared_bytes_per_block_optin=int(dev.MAX_SHARED_MEMORY_PER_BLOCK_OPTIN),
    )


def device_limits() -> DeviceLimits:
    """Limits of the current CUDA device (or of the simulated H200)."""
    if in_simulator():
        return SIMULATED_DEVICE
    return _limits_of_device(cuda.get_current_device().id)


# ---------------------------------------------------------------- the driver, called directly

@lru_cache(maxsize=None)
def libcuda():
    """The CUDA driver library through ctypes' ``PyDLL`` (calls keep the GIL), or None if it cannot be loaded.

    For the few calls made on every attention call (the launch, the current context): cuda-python's
    binding checks and wraps each argument on every call, which a profile of a small call showed as
    its largest host cost (experiments/tuning/host_profile.py).
    """
    try:
        library = ctypes.PyDLL("nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1")
        launch, get_context = library.cuLaunchKernel, library.cuCtxGetCurrent
    except (OSError, AttributeError):
        return None
    launch.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
    get_context.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
    launch.restype = get_context.restype = ctypes.c_int
    return library


_CONTEXTS = {}


def _still_primary(context):
    try:
        return context.device.primary_context is context   # device: a weak proxy in numba-cuda
    except ReferenceError:
        return False


def current_context():
    """Numba's object for the CUDA context current on this thread (creating the primary one if none is).

    ``numba.cuda.current_context()`` on a thread where Numba has not attached a context (torch made
    it current) asks the driver twice through cuda-python and takes a lock on every call (~13 us per
    result under cProfile on the H200); here one direct driver call gives the handle, and each
    handle's Numba object is looked up once.
    """
    library = libcuda()
    if library is not None:
        handle = ctypes.c_void_p()
        if library.cuCtxGetCurrent(ctypes.byref(handle)) == 0 and handle.value:
            context = _CONTEXTS.get(handle.value)
            # Looked up again when new, or when its device let it go since (``numba.cuda.close()``):
            # a later context may get the same handle.
            if context is None or not _still_primary(context):
                context = _CONTEXTS[handle.value] = cuda.current_context()
            return context
    return cuda.current_context()
