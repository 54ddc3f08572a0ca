"""Does the tensor cores' float32 accumulator round to nearest?  Why flash2's float32 error grew with N.

flash2 accumulated O += P V inside the ``mma.sync`` chain across every key
tile (N / 8 k-steps, three tf32 ``mma`` each for 3xTF32), and its float32
error grew linearly in N (issue 12: 7.4e-6 at N = 1K, 4.7e-4 at 64K).  A sum
rounded to nearest at every step has an error that grows like sqrt(steps) on
random data and is unbiased; one that is truncated grows linearly and has a
sign.  This experiment isolates the accumulator: one warp multiplies an
all-ones 16 x 8 A by L random 8 x 8 B tiles (tf32 values in [0, 1), so every
product is exact) and sums the results three ways:

* ``chain``:    C = mma(A, B_l, C) for every l (as flash2 did);
* ``per step``: C = C + mma(A, B_l, 0), the add on the float32 units (round to nearest);
* ``every 4``:  a fresh mma chain of 4 steps, then added on the float32 units.

The exact sums come from float64 on the host.  float16 (m16n8k16) is
measured the same way.  Prints, per L, the relative error and its mean sign
(negative: the results are too small, as truncation makes positive sums).

    PYTHONPATH=$PWD python3 experiments/tuning/mma_accumulation.py [--out experiments/tuning/results]

Needs a GPU (the simulator's twin adds in float64 and rounds once).
"""
import argparse
import os

import numpy as np
from numba import cuda, float32, uint32

import numba_flash
from numba_flash.kernels.fast.primitives import mma_f16, mma_tf32, tf32_round
from numba_flash.runtime.launch import inlined_device_function

STEPS = (16, 128, 1024, 8192, 32768)
MODES = ("chain", "per step", "every 4")


@inlined_device_function
def as_stored(word):
    """float16 operands arrive packed two to a word, ready for m16n8k16."""
    return word


def make_accumulation_kernel(mma, load_operand, one_word):
    """A one-warp kernel: out[mode, lane, 4] holds the three sums of A B_l over l (A all ones, lane = 4 g + t).

    ``b[l, row, col]`` holds the B operand words of step l in mma's layout: for
    tf32 float32 values (rounded by ``load_operand``), for float16 packed row pairs.
    """

    @cuda.jit
    def accumulate(b, out):
        lane = cuda.threadIdx.x
        g, t = lane >> 2, lane & 3
        one = one_word()
        chain = cuda.local.array(4, float32)
        step = cuda.local.array(4, float32)
        four = cuda.local.array(4, float32)
        part = cuda.local.array(4, float32)
        for e in range(4):
            chain[e] = step[e] = four[e] = part[e] = float32(0)
        for l in range(b.shape[0]):
            b0 = load_operand(b[l, t, g])
            b1 = load_operand(b[l, t + 4, g])
            chain[0], chain[1], chain[2], chain[3] = mma(one, one, one, one, b0, b1,
                                                         chain[0], chain[1], chain[2], chain[3])
            s0, s1, s2, s3 = mma(one, one, one, one, b0, b1, float32(0), float32(0), float32(0), float32(0))
            step[0] += s0
            step[1] += s1
            step[2] += s2
            step[3] += s3
            part[0], part[1], part[2], part[3] = mma(one, one, one, one, b0, b1, part[0], part[1], part[2], part[3])
            if l % 4 == 3:
                for e in range(4):
                    four[e] += part[e]
                    part[e] = float32(0)
        for e in range(4):
            out[0, lane, e] = chain[e]
            out[1, lane, e] = step[e]
            out[2, lane, e] = four[e] + part[e]

    return accumulate


@inlined_device_function
def tf32_one():
    return tf32_round(float32(1))


@inlined_device_function
def f16_ones():
    return uint32(0x3C003C00)  # two float16 ones


accumulate_tf32 = make_accumulation_kernel(mma_tf32, tf32_round, tf32_one)
accumulate_f16 = make_accumulation_kernel(mma_f16, as_stored, f16_ones)


def fragment_columns():
    """Column of C that each (lane, register) holds: c0, c2 -> 2t; c1, c3 -> 2t + 1."""
    t = np.arange(32) & 3
    return np.stack([2 * t, 2 * t + 1, 2 * t, 2 * t + 1], axis=1)


def measure(dtype, steps, rng):
    if dtype == "tf32":
        b = (rng.random((steps, 8, 8)).astype(np.float32).view(np.uint32) & np.uint32(0xFFFFE000)).view(np.float32)
        exact = b.astype(np.float64).sum(axis=(0, 1))  # column sums over every B_l (A is all ones)
        kernel, device_b = accumulate_tf32, cuda.to_device(b)
    else:
        b = rng.random((steps, 16, 8)).astype(np.float16)
        exact = b.astype(np.float64).sum(axis=(0, 1))
        pairs = np.stack([b[:, 0::2], b[:, 1::2]], axis=-1)  # (steps, 8 pairs, 8 cols, 2)
        pairs = np.ascontiguousarray(pairs).view(np.uint32)[..., 0]
        kernel, device_b = accumulate_f16, cuda.to_device(np.ascontiguousarray(pairs))
    out = cuda.device_array((3, 32, 4), np.float32)
    kernel[1, 32](device_b, out)
    want = exact[fragment_columns()]
    got = out.copy_to_host().astype(np.float64)
    rel = (got - want) / want
    return [(float(np.abs(r).max()), float(np.mean(np.sign(r)))) for r in rel]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="folder for mma_accumulation.md")
    args = parser.parse_args(argv)
    if numba_flash.in_simulator():
        print("needs a GPU: it measures the hardware's accumulator")
        return 2
    rng = np.random.default_rng(0)
    lines = ["| operands | steps L | " + " | ".join(f"{m}: max rel. error (mean sign)" for m in MODES) + " |",
             "|---|---|" + "---|" * len(MODES)]
    for dtype in ("tf32", "f16"):
        for steps in STEPS:
            cells = [f"{err:.2e} ({sign:+.2f})" for err, sign in measure(dtype, steps, rng)]
            lines.append(f"| {dtype} | {steps} | " + " | ".join(cells) + " |")
            print(lines[-1], flush=True)
    if args.out:
        from numba_flash.tools.report import markdown_header

        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, "mma_accumulation.md")
        with open(path, "w") as f:
            f.write(markdown_header("Rounding of the tensor cores' float32 accumulator",
                                    "python3 experiments/tuning/mma_accumulation.py --out experiments/tuning/results",
                                    numba_flash.device_limits().name))
            f.write("\n" + "\n".join(lines) + "\n")
        print("wrote", path)
    return 0


if __name__ == "__main__":
    main()
