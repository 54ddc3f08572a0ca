"""What the kernels need to know about the GPU they will run on.

Everything is read once from the current CUDA device.  In Numba's CUDA
simulator there is no device to ask, so the simulator reports the H200's
numbers: tests that check "too large for shared memory" then behave the same
in CI as on the real card.
"""
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
