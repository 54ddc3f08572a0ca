"""Ceilings for flash2: how fast can Numba issue tensor-core mma.sync on this GPU?

Each warp runs two independent accumulator chains of ``mma.sync`` (through
``numba_flash.kernels.fast.primitives``) on register operands, no memory
traffic; 8 blocks of 256 threads per SM.  The result is the ceiling of the
matrix instructions flash2 uses: divide the tf32 rate by three for 3xTF32
(float32-accurate) products.  An FMA loop (eight dependent chains per
thread) is timed alongside for scale.

    PYTHONPATH=$PWD python3 experiments/tuning/mma_throughput.py

Measured on the H200 (2026-11-30): tf32 m16n8k8 194 TFLOP/s, float16
m16n8k16 399 TFLOP/s, the FMA loop 30 TFLOP/s (latency-bound by design:
the datasheet FP32 peak is ~67).
"""
import argparse

import numpy as np
from numba import cuda, float32, uint32

import numba_flash
from numba_flash.kernels.fast.primitives import mma_f16, mma_tf32, tf32_round
from numba_flash.tools.timing import time_ms

ITERATIONS = 4096


@cuda.jit
def mma_tf32_loop(out):
    a = tf32_round(float32(cuda.threadIdx.x) * float32(1e-3))
    c0 = c1 = c2 = c3 = float32(0)
    e0 = e1 = e2 = e3 = float32(0)
    for _ in range(ITERATIONS):
        c0, c1, c2, c3 = mma_tf32(a, a, a, a, a, a, c0, c1, c2, c3)
        e0, e1, e2, e3 = mma_tf32(a, a, a, a, a, a, e0, e1, e2, e3)
    out[cuda.grid(1)] = c0 + c1 + c2 + c3 + e0 + e1 + e2 + e3


@cuda.jit
def mma_f16_loop(out):
    a = uint32(0x3C003C00)  # two float16 ones
    c0 = c1 = c2 = c3 = float32(0)
    e0 = e1 = e2 = e3 = float32(0)
    for _ in range(ITERATIONS):
        c0, c1, c2, c3 = mma_f16(a, a, a, a, a, a, c0, c1, c2, c3)
        e0, e1, e2, e3 = mma_f16(a, a, a, a, a, a, e0, e1, e2, e3)
    out[cuda.grid(1)] = c0 + c1 + c2 + c3 + e0 + e1 + e2 + e3


@cuda.jit(fastmath=True)
def fma_loop(out):
    x = float32(cuda.threadIdx.x) * float32(1e-3)
    acc = cuda.local.array(8, float32)
    for j in range(8):
        acc[j] = float32(j)
    for _ in range(ITERATIONS):
        for j in range(8):
            acc[j] = acc[j] * x + x
    total = float32(0)
    for j in range(8):
        total += acc[j]
    out[cuda.grid(1)] = total


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.parse_args(argv)
    if numba_flash.in_simulator():
        print("needs a GPU: it measures the hardware's instruction rates")
        return 2
    blocks, threads = numba_flash.device_limits().multiprocessors * 8, 256
    out = cuda.device_array(blocks * threads, np.float32)
    warps = blocks * threads / 32
    # FLOPs per instruction: 2*M*N*K for an mma (per warp), 2 for an FMA (per thread).
    for name, kernel, flops in [("mma.sync tf32 m16n8k8", mma_tf32_loop, 2 * 2 * 16 * 8 * 8 * ITERATIONS * warps),
                                ("mma.sync f16 m16n8k16", mma_f16_loop, 2 * 2 * 16 * 8 * 16 * ITERATIONS * warps),
                                ("fma (8 chains/thread)", fma_loop, 2 * 8 * ITERATIONS * blocks * threads)]:
        ms = time_ms(lambda: kernel[blocks, threads](out), repeats=5, warmup=1)
        print(f"{name:24s} {ms:8.3f} ms {flops / (ms * 1e-3) / 1e12:8.1f} TFLOP/s")


if __name__ == "__main__":
    main()
