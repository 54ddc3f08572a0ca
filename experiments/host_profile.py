"""Where the host time of a flash2 forward call goes: a loop of calls, timed and under cProfile.

The forward benchmark times whole ``numba_flash.attention`` calls; at
(8, 16, 1024, 64) the kernel is about half of that (README, "Where it falls
short").  This script runs 200 calls back to back on torch tensors (as the
benchmark passes them) and on Numba device arrays, and prints the host time
per call, the time until the GPU has finished too, one call timed with CUDA
events, and the cProfile tables of the torch loop (by own time, then by
cumulative time).  Run it again with ``NUMBA_CUDA_ARRAY_INTERFACE_SYNC=0`` to
see what Numba's host sync on each imported tensor costs.  Needs a GPU and
torch; prints only (no results files).

    PYTHONPATH=$PWD python3 experiments/host_profile.py

Measured on the H200 (2026-11-30): torch tensors 1.31 ms per call in the
loop (0.93 ms with the sync off), Numba arrays 0.86 ms; about 2100 Python
function calls per call.
"""
import cProfile
import pstats
import time

import torch
from numba import cuda

import numba_flash
from numba_flash.tools.timing import time_ms

SHAPE = (8, 16, 1024, 64)
CALLS = 200


def main():
    q, k, v = (torch.randn(SHAPE, device="cuda") for _ in range(3))
    as_numba = tuple(cuda.as_cuda_array(x) for x in (q, k, v))
    for name, args in (("torch", (q, k, v)), ("numba", as_numba)):
        for _ in range(5):
            numba_flash.attention(*args)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(CALLS):
            numba_flash.attention(*args)
        host = (time.perf_counter() - start) / CALLS * 1e3
        torch.cuda.synchronize()
        total = (time.perf_counter() - start) / CALLS * 1e3
        one = time_ms(lambda: numba_flash.attention(*args))
        print(f"{name}: host per call {host:.3f} ms, with the GPU {total:.3f} ms, events one call {one:.3f} ms",
              flush=True)
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(CALLS):
        numba_flash.attention(q, k, v)
    torch.cuda.synchronize()
    profile.disable()
    pstats.Stats(profile).sort_stats("tottime").print_stats(30)
    pstats.Stats(profile).sort_stats("cumulative").print_stats(40)


if __name__ == "__main__":
    main()
