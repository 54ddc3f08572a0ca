"""Which shared-memory layouts and descriptors ``wgmma`` reads as we mean them (a GPU check, issue 18).

Before an attention kernel is built on ``wgmma`` (``numba_flash/kernels/hopper/wgmma.py``), this
settles its layouts on the GPU.  For each product attention needs, one warpgroup stages random
16-bit operands in shared memory in the 128-byte swizzle (``wgmma.swizzle_128``), issues the
products with descriptors built from candidate (leading, stride) byte offsets, and writes its
accumulator registers out; the host maps them back by the accumulator layout of ``wgmma.py`` and
compares with NumPy in float64.  The right candidate is off by float32 rounding only (relative
error < 1e-3; a wrong layout is off by O(1)).  Where no candidate matches but the sorted values
do, the layout of the accumulator registers is what is wrong.

Cases (64 query rows, 64 keys):

* ``S d=64``: S = Q K^T, A = Q and B = K both from shared memory, K-major (d contiguous):
  four k-steps of 16 inside one 128-byte row, each advancing the descriptor's start by 32 bytes.
* ``S d=128``: the same over two 64-column tiles per operand (the fifth k-step starts the second).
* ``S d=64 bf16``: the first case in bfloat16.
* ``PV d=64``: O = P V, A = P from registers (the A-fragment layout), B = V (keys x d, d
  contiguous: MN-major, transposed by the instruction); each k-step of 16 keys advances 2048 bytes.
* ``PV d=128``: the same with N = 128: V in two 64-column tiles, whose distance is a candidate.
* ``PV d=64 SS``: P from shared memory (K-major) instead, to tell P's register layout from V's.
* ``S d=96``, ``PV d=96``: d = 96 on d = 128's layout (two 64-column tiles, the second half used; the
  forward's ``common.layout_dim``): S in six k-steps, and O = P V as m64n96, which reads V's second
  tile only up to column 95 (checked in the simulator's twins only until this runs on a GPU).

    PYTHONPATH=$PWD python3 experiments/tuning/wgmma_layouts.py      # on an H100/H200; writes results/wgmma_layouts.md
"""
import argparse
import itertools
import os
import sys

import numpy as np
from numba import cuda

from numba_flash.kernels.hopper.wgmma import ROW_BYTES, accumulator_entries

RESULTS = os.path.join(os.path.dirname(__file__), "results")
ROWS = 64          # wgmma's M
KEYS = 64          # keys per tile: N of S = Q K^T, the reduction of P V
#: name: (reduction length K, N, A from registers, B MN-major, element)
CASES = {
    "S d=64": (64, KEYS, False, False, "f16"),
    "S d=128": (128, KEYS, False, False, "f16"),
    "S d=64 bf16": (64, KEYS, False, False, "bf16"),
    "PV d=64": (KEYS, 64, True, True, "f16"),
    "PV d=128": (KEYS, 128, True, True, "f16"),
    "PV d=64 SS": (KEYS, 64, False, True, "f16"),
    "S d=96": (96, KEYS, False, False, "f16"),
    "PV d=96": (KEYS, 96, True, True, "f16"),
}


def k_major_candidates():
    """(leading, stride) byte offsets for a K-major swizzled operand: the stride is the 8-row group
    (1024 bytes) and the leading offset unused, or the two the other way round."""
    return [(16, 1024), (1024, 16)]


def mn_major_candidates(n):
    """The same for an MN-major operand of N columns in 64-column tiles of KEYS rows each."""
    tile = KEYS * ROW_BYTES
    return [(16, 1024), (1024, 16)] if n <= 64 else [(tile, 1024), (1024, tile)]


def accumulator_to_matrix(registers, n):
    """The m64nN accumulator from (128 threads, n / 2 registers), by ``wgmma.py``'s layout."""
    out = np.zeros((ROWS, n))
    for member in range(128):
        rows, columns = accumulator_entries(member, n)
        out[rows, columns] = registers[member]
    return out


def build(k_dim, n, a_registers, b_mn_major, element):
    """The kernel of one case: run(a, b, out, lbo_a, sbo_a, lbo_b, sbo_b); a (64, K) and b ((K, N) when
    MN-major, else (N, K)) 16-bit values as uint16, out (128, N / 2) float32."""
    from numba import float32, uint32

    from numba_flash.kernels.hopper.common import layout_dim
    from numba_flash.kernels.hopper.wgmma import (SWIZZLE_128B, descriptor_device, fence_proxy_async,
                                                  shared_address, staged_offset_device, swizzle_128_device,
                                                  wgmma_commit, wgmma_fence, wgmma_rs, wgmma_ss, wgmma_wait)

    registers = n // 2
    b_rows = k_dim if b_mn_major else n      # rows of B as stored (its contiguous dimension is 128-byte rows)
    b_cols = n if b_mn_major else k_dim
    # Stored rows are whole 64-column tiles (96 columns: two, the second half used).
    a_bytes = 0 if a_registers else ROWS * layout_dim(k_dim) * 2
    b_bytes = b_rows * layout_dim(b_cols) * 2
    words = (a_bytes + b_bytes + 1024) // 4
    # Both forms are typed (only one is used): a constant branch still has to type-check.
    product_rs, product_ss = wgmma_rs(n, element, b_mn_major), wgmma_ss(n, element, b_mn_major)
    wait_all = wgmma_wait(0)

    @cuda.jit(launch_bounds=(128, 1))
    def run(a, b, out, lbo_a, sbo_a, lbo_b, sbo_b):
        smem = cuda.shared.array(words, uint32)
        tid = cuda.threadIdx.x
        base = shared_address(smem)
        pad = ((1024 - (base & 1023)) & 1023) // 4        # tiles start on a 1024-byte boundary
        a_word, b_word = pad, pad + a_bytes // 4
        if not a_registers:
            for p in range(tid, ROWS * k_dim // 2, 128):
                row, col = p // (k_dim // 2), 2 * (p % (k_dim // 2))
                smem[a_word + swizzle_128_device(staged_offset_device(row, col, ROWS)) // 4] = (
                    uint32(a[row, col]) | (uint32(a[row, col + 1]) << 16))
        for p in range(tid, b_rows * b_cols // 2, 128):
            row, col = p // (b_cols // 2), 2 * (p % (b_cols // 2))
            smem[b_word + swizzle_128_device(staged_offset_device(row, col, b_rows)) // 4] = (
                uint32(b[row, col]) | (uint32(b[row, col + 1]) << 16))
        fence_proxy_async()
        cuda.syncthreads()
        w, g, t = tid // 32, (tid % 32) // 4, tid % 4
        acc = cuda.local.array(registers, float32)
        for i in range(registers):
            acc[i] = float32(0)
        for s in range(k_dim // 16):
            if b_mn_major:   # 16 rows of 128 bytes per k-step
                b_start = base + b_word * 4 + s * 16 * ROW_BYTES
            else:            # 32 bytes per k-step inside a row, the next 64-column tile after four
                b_start = base + b_word * 4 + (s // 4) * b_rows * ROW_BYTES + (s % 4) * 32
            desc_b = descriptor_device(b_start, lbo_b, sbo_b, SWIZZLE_128B)
            if a_registers:
                r0, c0 = 16 * w + g, 16 * s + 2 * t
                fragment = (uint32(a[r0, c0]) | (uint32(a[r0, c0 + 1]) << 16),
                            uint32(a[r0 + 8, c0]) | (uint32(a[r0 + 8, c0 + 1]) << 16),
                            uint32(a[r0, c0 + 8]) | (uint32(a[r0, c0 + 9]) << 16),
                            uint32(a[r0 + 8, c0 + 8]) | (uint32(a[r0 + 8, c0 + 9]) << 16))
                wgmma_fence()    # the fragment's registers, written just now, before the product reads them
                product_rs(acc, fragment, desc_b)
            else:
                a_start = base + a_word * 4 + (s // 4) * ROWS * ROW_BYTES + (s % 4) * 32
                wgmma_fence()
                product_ss(acc, descriptor_device(a_start, lbo_a, sbo_a, SWIZZLE_128B), desc_b)
        wgmma_commit()
        wait_all()
        for i in range(registers):
            out[tid, i] = acc[i]

    return run


def check_case(name, rng):
    """Rows of the results table: every candidate of one case, with its error."""
    k_dim, n, a_registers, b_mn_major, element = CASES[name]
    import ml_dtypes
    dtype = np.float16 if element == "f16" else ml_dtypes.bfloat16
    a = rng.standard_normal((ROWS, k_dim)).astype(dtype)
    b_matrix = rng.standard_normal((k_dim, n)).astype(dtype)            # B as K x N
    b_stored = b_matrix if b_mn_major else np.ascontiguousarray(b_matrix.T)
    expected = a.astype(np.float64) @ b_matrix.astype(np.float64)
    run = build(k_dim, n, a_registers, b_mn_major, element)
    a_device, b_device = cuda.to_device(a.view(np.uint16)), cuda.to_device(b_stored.view(np.uint16))
    out = cuda.device_array((128, n // 2), np.float32)
    a_candidates = [(0, 0)] if a_registers else k_major_candidates()
    b_candidates = mn_major_candidates(n) if b_mn_major else k_major_candidates()
    rows = []
    for (lbo_a, sbo_a), (lbo_b, sbo_b) in itertools.product(a_candidates, b_candidates):
        run[1, 128](a_device, b_device, out, lbo_a, sbo_a, lbo_b, sbo_b)
        got = accumulator_to_matrix(out.copy_to_host(), n)
        error = float(np.abs(got - expected).max() / np.abs(expected).max())
        sorted_match = bool(np.allclose(np.sort(got.ravel()), np.sort(expected.ravel()), rtol=1e-3, atol=1e-3))
        rows.append(dict(case=name, a_offsets="registers" if a_registers else f"({lbo_a}, {sbo_a})",
                         b_offsets=f"({lbo_b}, {sbo_b})", relative_error=f"{error:.2e}", right=error < 1e-3,
                         values_right_when_sorted=sorted_match))
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=RESULTS)
    args = parser.parse_args(argv)
    if not cuda.is_available() or os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        print("needs a Hopper GPU (sm_90a); the simulator has no warpgroup instructions")
        return 2
    from numba_flash.kernels.hopper.wgmma import enable_sm90a
    from numba_flash.tools.report import markdown_header, markdown_table

    enable_sm90a()
    rng = np.random.default_rng(0)
    rows = []
    for name in CASES:
        try:
            rows += check_case(name, rng)
        except Exception as exc:   # a case that does not compile or launch is a finding too
            rows.append(dict(case=name, a_offsets="", b_offsets="", relative_error=f"{type(exc).__name__}: {exc}"[:200],
                             right=False, values_right_when_sorted=False))
        print(*(r for r in rows if r["case"] == name), sep="\n", flush=True)
    settled = all(any(r["right"] for r in rows if r["case"] == name) for name in CASES)
    os.makedirs(args.out, exist_ok=True)
    device = cuda.get_current_device().name
    with open(os.path.join(args.out, "wgmma_layouts.md"), "w") as f:
        f.write(markdown_header("wgmma: layouts and descriptors checked against NumPy",
                                "python3 experiments/tuning/wgmma_layouts.py",
                                device.decode() if isinstance(device, bytes) else device)
                + f"\nEvery case has a right candidate: {settled}.  (leading, stride): the descriptor's byte "
                "offsets; 128-byte swizzle throughout.\n\n" + markdown_table(rows))
    return 0 if settled else 1


if __name__ == "__main__":
    sys.exit(main())
