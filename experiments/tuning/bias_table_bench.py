"""What a learned relative-position table costs a training step: forward + backward through ``numba_flash.torch``.

For each case, ``numba_flash.torch.attention(q, k, v, causal=..., score_mod=relative_position_bias(table))`` and its
backward (dO given), ``--dtype`` (bfloat16; float32 runs the mma.sync kernels), CUDA events, median of
``--repeats``, in one process:

* ``plain``: the same call without the score_mod;
* ``fixed``: the table does not require grad (the kernels' forward and backward with the bias);
* ``fused``: the table learns, its gradient summed by the dQ kernel (``kernels/fast/bias_table.py``: on a Hopper GPU
  the wgmma one for 16-bit calls, where flash2 takes the wgmma backward; the mma.sync one otherwise);
* ``torch path``: the table learns, its gradient on torch ops (``numba_flash/_bias_gradient.py``: what every other
  backward takes), forced by making the fused path decline.

Also: the largest difference between the two table gradients over the largest entry (float32 sums in other orders),
and whether the fused one has the same bits on a second run.

    PYTHONPATH=$PWD python3 experiments/tuning/bias_table_bench.py [--repeats 10] [--dtype float32]

Prints one line per case; results: ``results/bias_table_gradient_h100.md``.  Needs a GPU and torch.
"""
import argparse

import torch

import numba_flash.torch as numba_flash_torch
from numba_flash import mods
from numba_flash.tools.timing import time_ms

#: (B, H, N, d, causal, D): the table (H, 2 D + 1).
CASES = [(4, 16, 4096, 64, True, 128), (2, 16, 8192, 128, True, 128), (4, 16, 4096, 64, False, 128),
         (8, 16, 2048, 128, False, 32)]


def run_case(batch, heads, n, d, causal, reach, repeats, dtype=torch.bfloat16):
    q, k, v, grad_out = (torch.randn(batch, heads, n, d, device="cuda", dtype=dtype, requires_grad=True)
                         for _ in "qkvo")
    fused_path = numba_flash_torch._backward_and_table_sums
    times, gradients = {}, {}
    for name, learns in (("fixed", False), ("fused", True), ("torch path", True)):
        numba_flash_torch._backward_and_table_sums = fused_path if name != "torch path" else lambda *a, **kw: None
        table = (torch.randn(heads, 2 * reach + 1, device="cuda",
                             generator=torch.Generator("cuda").manual_seed(0)) * 0.1).requires_grad_(learns)
        score_mod = mods.relative_position_bias(table)

        def step():
            table.grad = None
            numba_flash_torch.attention(q, k, v, causal=causal, score_mod=score_mod).backward(grad_out)

        try:
            step()
            gradients[name] = None if table.grad is None else table.grad.clone()
            times[name] = time_ms(step, repeats=repeats, warmup=2)
            if name == "fused":
                step()
                same_bits = torch.equal(table.grad, gradients[name])
        finally:
            numba_flash_torch._backward_and_table_sums = fused_path
    times["plain"] = time_ms(lambda: numba_flash_torch.attention(q, k, v, causal=causal).backward(grad_out),
                             repeats=repeats, warmup=2)
    difference = float((gradients["fused"] - gradients["torch path"]).abs().max()
                       / gradients["torch path"].abs().max())
    print((batch, heads, n, d, causal, reach), " ".join(f"{name}={ms:.3f}" for name, ms in times.items()),
          f"fused/fixed={times['fused'] / times['fixed']:.2f} torch_path/fused={times['torch path'] / times['fused']:.1f}"
          f" relative_difference={difference:.2e} fused_same_bits={same_bits}", flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    args = parser.parse_args(argv)
    for case in CASES:
        run_case(*case, args.repeats, getattr(torch, args.dtype))


if __name__ == "__main__":
    main()
