"""The wgmma forward's two kernels side by side on a Hopper GPU, against torch's flash and cuDNN backends.

"blocks" is ``kernels/hopper/forward.py``'s (blocks of one warpgroup that copy their own tiles and meet at block
barriers), "specialized" ``kernels/hopper/specialized_forward.py``'s (a producer warpgroup, two consumers taking
turns on the tensor cores; "specialized3" with three consumers, 192-row blocks; "R": Q held in registers,
``NUMBA_FLASH_WGMMA_QUERY=registers``; "4S": four K/V stages, ``NUMBA_FLASH_WGMMA_STAGES=4``), switched in one
process as ``NUMBA_FLASH_WGMMA_FORWARD``, ``NUMBA_FLASH_WGMMA_CONSUMERS``, ``NUMBA_FLASH_WGMMA_QUERY`` and
``NUMBA_FLASH_WGMMA_STAGES`` would switch them.  For each
shape, dense and causal: the forward alone as GPU time (``time_ms(device_only=True)``: the launches queued behind a
wait, as in a training loop) for both kernels and both torch backends, then forward + backward through autograd
(``numba_flash.torch.attention``, the backward the library's) with each kernel and each backend as whole calls; the
specialised kernels' largest difference from "blocks"' O over the largest |O| (``<kernel> diff``), and the
TFLOP/s of the first kernel after "blocks".  Ratios are to cuDNN measured in the same process.

    PYTHONPATH=$PWD python3 experiments/tuning/wgmma_forward_kernels.py [--dtypes bfloat16,float16] [--issue-rows]
        [--kernels specialized,specialized4S] [--tag wgmma_forward_stages]

Writes ``results/<tag>_<card>.md`` (tag ``wgmma_forward_kernels`` by default).
"""
import argparse
import os
import re

import numba_flash
import numba_flash.torch as numba_flash_torch
from numba_flash.tools.report import markdown_header, markdown_table, timer_note
from numba_flash.tools.timing import time_ms

REPEATS = 10
#: (B, H_q, H_kv, N, d): issue 45's rows, then other head dims, batch sizes, groups and ragged lengths.
SHAPES = [(4, 16, 16, 4096, 64), (2, 16, 16, 8192, 128), (4, 32, 8, 4096, 128), (4, 16, 16, 3000, 64),
          (2, 16, 16, 4096, 96), (16, 16, 16, 1024, 128), (1, 32, 4, 16384, 128), (8, 12, 12, 2000, 80)]
#: name: (NUMBA_FLASH_WGMMA_FORWARD, NUMBA_FLASH_WGMMA_CONSUMERS, NUMBA_FLASH_WGMMA_QUERY, NUMBA_FLASH_WGMMA_STAGES)
KERNELS = {"blocks": ("blocks", "2", "shared", "3"), "specialized": ("specialized", "2", "shared", "3"),
           "specialized3": ("specialized", "3", "shared", "3"), "specializedR": ("specialized", "2", "registers", "3"),
           "specialized3R": ("specialized", "3", "registers", "3"),
           "specialized4S": ("specialized", "2", "shared", "4"), "specialized3-4S": ("specialized", "3", "shared", "4")}
RESULTS = os.path.join(os.path.dirname(__file__), "results")


def use(kernel):
    """The wgmma forward's kernel (a name of ``KERNELS``) for the while, the plans laid out before forgotten."""
    from numba_flash import api
    from numba_flash.kernels.hopper import forward as hopper

    hopper.FORWARD_KERNEL, hopper.CONSUMERS, hopper.QUERY_OPERAND, hopper.STAGES = KERNELS[kernel]
    api._PLANS.clear()


def case(torch, kernels, batch, heads, kv_heads, n, d, dtype, causal):
    """One row: GPU times of the forward alone and whole fwd+bwd times, in milliseconds, and the ratios."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    q, grad_out = (torch.randn(batch, heads, n, d, device="cuda", dtype=dtype) for _ in "qo")
    k, v = (torch.randn(batch, kv_heads, n, d, device="cuda", dtype=dtype) for _ in "kv")
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    forward_alone = lambda run: time_ms(run, repeats=REPEATS, warmup=2, device_only=True)   # noqa: E731
    whole = lambda run: time_ms(run, repeats=REPEATS, warmup=2)   # noqa: E731
    row = dict(B=batch, H_q=heads, H_kv=kv_heads, N=n, d=d, dtype=str(dtype)[6:], causal=bool(causal))
    outputs = {}
    for kernel in kernels:
        use(kernel)
        outputs[kernel] = numba_flash.attention(q, k, v, causal=causal)
        row[f"{kernel} fwd"] = forward_alone(lambda: numba_flash.attention(q, k, v, causal=causal))
        row[f"{kernel} fwd+bwd"] = whole(lambda: torch.autograd.grad(
            numba_flash_torch.attention(*leaves, causal=causal), leaves, grad_out))
    use("blocks")
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cuDNN", SDPBackend.CUDNN_ATTENTION)):
        def forward(backend=backend):
            with sdpa_kernel(backend):
                return sdpa(*leaves, is_causal=bool(causal), enable_gqa=heads != kv_heads)
        row[f"{name} fwd"] = forward_alone(forward)
        row[f"{name} fwd+bwd"] = whole(lambda: torch.autograd.grad(forward(), leaves, grad_out))
    blocks = outputs["blocks"].float()
    for kernel in kernels[1:]:
        row[f"{kernel} diff"] = float((outputs[kernel].float() - blocks).abs().max() / blocks.abs().max())
    flops = 4 * batch * heads * n * n * d / (2 if causal else 1)
    row[f"{kernels[1]} TFLOP/s"] = flops / (row[f"{kernels[1]} fwd"] * 1e-3) / 1e12
    for kernel in kernels:
        row[f"{kernel} fwd / cuDNN"] = row["cuDNN fwd"] / row[f"{kernel} fwd"]
        row[f"{kernel} fwd+bwd / cuDNN"] = row["cuDNN fwd+bwd"] / row[f"{kernel} fwd+bwd"]
    row[f"{kernels[1]} fwd+bwd / flash"] = row["flash fwd+bwd"] / row[f"{kernels[1]} fwd+bwd"]
    print(" ".join(f"{key}={value:.3g}" if isinstance(value, float) else f"{key}={value}"
                   for key, value in row.items()), flush=True)
    return row


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", default="bfloat16,float16")
    parser.add_argument("--issue-rows", action="store_true", help="issue 45's first four rows, bfloat16 only")
    parser.add_argument("--kernels", default=",".join(KERNELS),
                        help=f"those of {', '.join(KERNELS)} to time, comma-separated ('blocks' is always first)")
    parser.add_argument("--out", default=RESULTS)
    parser.add_argument("--tag", default="wgmma_forward_kernels",
                        help="the results file's stem (the card's name is appended), so a run can keep an earlier one")
    args = parser.parse_args(argv)
    kernels = ["blocks"] + [name for name in args.kernels.split(",") if name != "blocks"]
    unknown = [name for name in kernels if name not in KERNELS]
    if unknown or len(kernels) < 2:
        parser.error(f"--kernels: {unknown or 'none'} besides 'blocks'; the kernels are {', '.join(KERNELS)}")
    if numba_flash.in_simulator():
        print("needs a Hopper GPU")
        return 2
    import torch

    shapes, dtypes = (SHAPES[:4], ["bfloat16"]) if args.issue_rows else (SHAPES, args.dtypes.split(","))
    rows = [case(torch, kernels, *shape, getattr(torch, dtype), causal)
            for dtype in dtypes for shape in shapes for causal in (False, True)]
    device_name = numba_flash.device_limits().name
    card = re.search(r"[A-Z]\d{3}", device_name)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"{args.tag}_{card.group(0).lower() if card else 'gpu'}.md")
    command = ("python3 experiments/tuning/wgmma_forward_kernels.py" + (" --issue-rows" if args.issue_rows else
                                                                        f" --dtypes {args.dtypes}")
               + f" --kernels {','.join(kernels)}")
    with open(path, "w") as f:
        f.write(markdown_header("The wgmma forward's two kernels", command, device_name, timer=timer_note(REPEATS)))
        f.write("\nfwd: GPU time of the forward alone (ms); fwd+bwd: whole calls through autograd (ms); ratios: "
                "cuDNN's (or flash's) time over ours, >= 1.0 where ours is faster.\n\n")
        f.write(markdown_table(rows, lambda x: f"{x:.3g}" if isinstance(x, float) else str(x)))
    print("wrote", path)
    return 0


if __name__ == "__main__":
    main()
