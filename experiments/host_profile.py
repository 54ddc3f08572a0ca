"""Where the host time of a call goes: loops of calls under cProfile.

``numba-flash bench --host`` says how long a call keeps the host; this
script says where that time goes, for the three calls it times at the
smallest size (1, 1, 128, 64) float16: the forward on torch tensors, the
forward on Numba device arrays, and a training step (forward and backward
through ``numba_flash.torch``).  Prints, per call, the 15 functions with the
most time of their own.  Needs a GPU and torch; prints only.

    PYTHONPATH=$PWD python3 experiments/host_profile.py
"""
import cProfile
import pstats

import torch
from numba import cuda

import numba_flash
import numba_flash.torch as nft

SHAPE = (1, 1, 128, 64)
CALLS = 2000


def main():
    q, k, v, grad = (torch.randn(SHAPE, device="cuda", dtype=torch.float16) for _ in range(4))
    trained = tuple(x.clone().requires_grad_() for x in (q, k, v))
    views = tuple(cuda.as_cuda_array(x) for x in (q, k, v))
    calls = {
        "forward, torch tensors": lambda: numba_flash.attention(q, k, v),
        "forward, Numba arrays": lambda: numba_flash.attention(*views),
        "forward and backward (numba_flash.torch)": lambda: nft.attention(*trained).backward(grad),
    }
    for name, call in calls.items():
        for _ in range(20):
            call()
        torch.cuda.synchronize()
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(CALLS):
            call()
        profile.disable()
        torch.cuda.synchronize()
        print(f"==== {name}: {CALLS} calls", flush=True)
        pstats.Stats(profile).sort_stats("tottime").print_stats(15)


if __name__ == "__main__":
    main()
