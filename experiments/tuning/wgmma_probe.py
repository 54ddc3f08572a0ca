"""Hopper's warpgroup MMA from Numba: a throughput probe (issues 15.6 and 18).

A Numba kernel issues ``wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16``
(inline PTX, target sm_90a) back to back on one 64 x 128 float32 accumulator
per warpgroup, operands A (64 x 16) and B (16 x 128) in shared memory named by
64-bit matrix descriptors, and reports TFLOP/s beside torch's own float16
matrix product on the same card (cuBLAS, which uses the same instruction).
It answers whether the instruction can be driven from Numba at speed before an
attention kernel is built on it.

How the pieces fit (PTX ISA, "Asynchronous Warpgroup Level Matrix Multiply"):

* A warpgroup is 4 consecutive warps (128 threads); each thread holds 64 of
  the accumulator's 64 x 128 floats (``D_REGISTERS``) between instructions.
* ``wgmma.fence`` orders this thread's earlier register writes of the
  accumulator before the asynchronous products read it; ``commit_group``
  closes a group of issued products and ``wait_group 0`` waits for all of
  them, after which the accumulator may be read.  Products on one
  accumulator may be in flight together (a GEMM's k-loop does this).
* Operands written to shared memory by ordinary stores reach the tensor
  cores' asynchronous proxy only after ``fence.proxy.async.shared::cta`` in
  the writing threads and a barrier.
* A descriptor (64 bits) gives the operand's shared-memory start address >> 4
  (bits 0-13), the byte offset between core matrices along the leading
  dimension >> 4 (bits 16-29) and along the strided dimension >> 4 (bits
  32-45), and the swizzle mode (bits 62-63; 0: none).  A core matrix is 8 rows
  of 16 bytes.  This probe stores both operands as consecutive core matrices
  (no swizzle): K-direction neighbours 128 bytes apart, M/N-direction ones 256.

Correctness: A and B are all ones, so whatever the layout every element of
A B is 16 and after ``ITERATIONS`` x ``UNROLL`` products every accumulator
element must equal 16 times that count; the script checks it.  (The layout of
a real kernel's operands needs the descriptors right; the attention kernel's
own tests will check those against float64.)

    PYTHONPATH=$PWD python3 experiments/tuning/wgmma_probe.py     # on an H100/H200; writes results/wgmma_probe.md
"""
import argparse
import os
import sys

import numpy as np
from numba import cuda

RESULTS = os.path.join(os.path.dirname(__file__), "results")
N = 128                    # the product's width: m64nNk16
D_REGISTERS = N // 2       # accumulator floats per thread (64 x N over 128 threads)
UNROLL = 4                 # products issued per commit group
ITERATIONS = 4096          # commit groups per warpgroup
FLOPS_PER_PRODUCT = 2 * 64 * N * 16
A_WORDS = 64 * 16 // 2     # 16-bit pairs
B_WORDS = N * 16 // 2


def build():
    """The probe kernel, compiled for sm_90a (Hopper's arch-specific instructions need the 'a' target)."""
    from numba import float32, uint32

    from numba_flash.kernels.hopper.wgmma import (SWIZZLE_NONE, descriptor_device, enable_sm90a, fence_proxy_async,
                                                  shared_address, wgmma_commit, wgmma_fence, wgmma_ss, wgmma_wait)

    enable_sm90a()
    product, wait_all = wgmma_ss(N), wgmma_wait(0)

    @cuda.jit(launch_bounds=(128, 1))
    def probe(out, iterations):
        a = cuda.shared.array(A_WORDS, uint32)
        b = cuda.shared.array(B_WORDS, uint32)
        one_one = uint32(0x3C003C00)          # two float16 ones
        for i in range(cuda.threadIdx.x, A_WORDS, 128):
            a[i] = one_one
        for i in range(cuda.threadIdx.x, B_WORDS, 128):
            b[i] = one_one
        fence_proxy_async()
        cuda.syncthreads()
        desc_a = descriptor_device(shared_address(a), 128, 256, SWIZZLE_NONE)
        desc_b = descriptor_device(shared_address(b), 128, 256, SWIZZLE_NONE)
        acc = cuda.local.array(D_REGISTERS, float32)
        for i in range(D_REGISTERS):
            acc[i] = float32(0)
        wgmma_fence()
        for _ in range(iterations):
            for _ in range(UNROLL):
                product(acc, desc_a, desc_b)
            wgmma_commit()
            wait_all()
        base = (cuda.blockIdx.x * 128 + cuda.threadIdx.x) * D_REGISTERS
        for i in range(D_REGISTERS):
            out[base + i] = acc[i]

    return probe


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=RESULTS)
    parser.add_argument("--blocks-per-sm", type=int, default=2)
    args = parser.parse_args(argv)
    if cuda.is_available() is False or os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        print("needs a Hopper GPU (sm_90a); the simulator has no warpgroup instructions")
        return 2
    import torch
    from numba_flash.tools.report import markdown_header
    from numba_flash.tools.timing import time_ms

    probe = build()
    sms = cuda.get_current_device().MULTIPROCESSOR_COUNT
    blocks = sms * args.blocks_per_sm
    out = cuda.device_array(blocks * 128 * D_REGISTERS, np.float32)
    probe[blocks, 128](out, 1)       # compile, and check one group's result
    cuda.synchronize()
    first = out.copy_to_host()
    ms = time_ms(lambda: probe[blocks, 128](out, ITERATIONS), repeats=10, warmup=2)
    result = out.copy_to_host()
    expected = 16.0 * UNROLL * ITERATIONS
    exact = bool(np.all(first == 16.0 * UNROLL) and np.all(result == expected))
    tflops = blocks * ITERATIONS * UNROLL * FLOPS_PER_PRODUCT / (ms * 1e-3) / 1e12
    a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.float16) for _ in range(2))
    torch_ms = time_ms(lambda: a @ b, repeats=10, warmup=3)
    torch_tflops = 2 * 8192 ** 3 / (torch_ms * 1e-3) / 1e12
    lines = [f"| probe | TFLOP/s |", "|---|---|",
             f"| Numba wgmma m64n{N}k16, {blocks} warpgroups ({args.blocks_per_sm} per multiprocessor), "
             f"{UNROLL} products per group | {tflops:.0f} |",
             f"| torch float16 8192^3 matrix product (cuBLAS) | {torch_tflops:.0f} |"]
    text = "\n".join(lines)
    print(text, "\nresults exact:", exact)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "wgmma_probe.md"), "w") as f:
        f.write(markdown_header("wgmma from Numba: throughput probe", "python3 experiments/tuning/wgmma_probe.py",
                                cuda.get_current_device().name.decode() if isinstance(cuda.get_current_device().name, bytes)
                                else cuda.get_current_device().name, timer="CUDA events, median of 10"))
        f.write(f"\nEvery accumulator element equal to 16 x the products issued (all-ones operands): {exact}.\n\n"
                + text + "\n")
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
