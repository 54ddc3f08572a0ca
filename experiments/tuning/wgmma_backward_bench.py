"""The wgmma backward on a Hopper GPU: its errors against float64 beside the mma.sync backward's, and its speed.

``check``: dQ, dK, dV of the mma.sync backward, the wgmma backward and the wgmma backward with
``deterministic=False`` against float64 gradients (torch autograd on the GPU) on ragged, grouped and causal shapes;
each called twice, ``same`` saying whether the two gave the same bits.  ``bench``: at issue 45's shapes, the backward
alone (ours with ``deterministic`` True and False) and a whole training step's attention through autograd
(``numba_flash.torch.attention``) against torch's flash and cuDNN backends (``enable_gqa``), and the forward alone;
CUDA events, median of ``REPEATS``.  ``quick``: the backward alone, float16, no peers.  ``mask``: a random block
mask of ``MASK_DENSITY`` (blocks of ``MASK_BLOCK``, FlexAttention's default) at ``MASK_SHAPES``: the backward alone
on wgmma and on mma.sync, and forward + backward through autograd (ours with the backward on wgmma, and with flash2's
pick) beside FlexAttention's with the same mask.  ``modes``: the backward alone in every way of summing dQ
(``kernels/hopper/dq_sums.py``'s DQ_MODES, switched in one process; the bulk modes run the kernel whose warps have
roles, ``specialized_dkdv.py``) at ``MODE_SHAPES``, bfloat16, each mode's largest difference from "separate" over the
largest entry and, for the deterministic ones, whether a second call gives the same bits; then forward + backward
through autograd in each mode beside torch's flash and cuDNN (``--modes``: fewer of them).
``NUMBA_FLASH_WGMMA_DQ`` (separate, ordered, atomic, bulk-ordered, bulk-atomic) picks how the backward sums dQ for
the other commands, ``NUMBA_FLASH_WGMMA=0`` the mma.sync backward.

    PYTHONPATH=$PWD python3 experiments/tuning/wgmma_backward_bench.py check
    PYTHONPATH=$PWD python3 experiments/tuning/wgmma_backward_bench.py bench [--dtypes float16,bfloat16]
    NUMBA_FLASH_WGMMA_DQ=atomic PYTHONPATH=$PWD python3 experiments/tuning/wgmma_backward_bench.py quick
    PYTHONPATH=$PWD python3 experiments/tuning/wgmma_backward_bench.py mask
    PYTHONPATH=$PWD python3 experiments/tuning/wgmma_backward_bench.py modes [--modes separate,bulk-ordered]

Prints one line per case; results read from those lines: results/bench_wgmma_backward_h100.md.
"""
import argparse

import numba_flash
from numba_flash.kernels.hopper.dq_sums import DQ_MODES
import numba_flash.torch as numba_flash_torch

REPEATS = 10
#: (B, H_q, H_kv, N, d): issue 45's rows.
SHAPES = [(4, 16, 16, 4096, 64), (2, 16, 16, 8192, 128), (4, 32, 8, 4096, 128), (4, 16, 16, 3000, 64),
          (2, 16, 16, 4096, 96)]
#: (B, H_q, H_kv, N_q, N_k, d, dtype name, causal): ragged, one-row, grouped, both causal alignments.
CHECKS = [(1, 1, 1, 64, 64, 64, "float16", False), (1, 2, 1, 130, 200, 64, "float16", True),
          (2, 4, 2, 300, 257, 128, "bfloat16", "bottom_right"), (1, 3, 1, 1, 70, 128, "float16", False),
          (2, 4, 4, 1000, 1000, 64, "bfloat16", True), (1, 8, 2, 777, 513, 128, "float16", False),
          (2, 4, 2, 333, 300, 96, "bfloat16", True)]
#: The block-mask benchmark: issue 45's (B, H, N, d) for FlexAttention's 10%-dense mask, and a d = 128 one.
MASK_SHAPES = [(4, 16, 4096, 64), (2, 16, 8192, 128)]
MASK_DENSITY = 0.1
MASK_BLOCK = 128
#: ``modes``: (B, H_q, H_kv, N, d, causal), issue 45's rows and two more, dense and causal.
MODE_SHAPES = [(4, 16, 16, 4096, 64, False), (4, 16, 16, 4096, 64, True), (2, 16, 16, 8192, 128, False),
               (2, 16, 16, 8192, 128, True), (4, 32, 8, 4096, 128, False), (4, 32, 8, 4096, 128, True),
               (8, 16, 16, 2048, 64, False), (16, 16, 16, 1024, 128, True), (4, 16, 16, 3000, 64, True),
               # dense d = 128 beyond issue 45's table, where deterministic calls take "bulk-ordered": few key tiles
               # per head, a ragged length, a group of 8, and 160 key tiles (more than a head's blocks that fit at
               # once on an H100's 132 multiprocessors: not rotated, so "separate")
               (16, 16, 16, 1024, 128, False), (4, 16, 16, 3000, 128, False), (2, 64, 8, 2048, 128, False),
               (1, 8, 8, 20480, 128, False)]


def reference_gradients(torch, q, k, v, grad_out, causal, group):
    """dQ, dK, dV in float64 by autograd, with torch's ops."""
    q64, k64, v64 = (x.double().detach().requires_grad_() for x in (q, k, v))
    keys, values = k64.repeat_interleave(group, 1), v64.repeat_interleave(group, 1)
    s = q64 @ keys.transpose(-1, -2) / q.shape[-1] ** 0.5
    if causal:
        n_q, n_k = s.shape[-2:]
        allowed = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).tril(0 if causal is True else n_k - n_q)
        s = s.masked_fill(~allowed, float("-inf"))
    out = torch.softmax(s, -1).nan_to_num() @ values
    return torch.autograd.grad(out, (q64, k64, v64), grad_out.double())


def check(torch, batch, heads, kv_heads, n_q, n_k, d, dtype_name, causal):
    generator = torch.Generator(device="cuda").manual_seed(0)
    dtype = getattr(torch, dtype_name)
    q, grad_out = (torch.randn(batch, heads, n_q, d, device="cuda", dtype=dtype, generator=generator) for _ in "qo")
    k, v = (torch.randn(batch, kv_heads, n_k, d, device="cuda", dtype=dtype, generator=generator) for _ in "kv")
    want = reference_gradients(torch, q, k, v, grad_out, causal, heads // kv_heads)
    out, lse = numba_flash.attention(q, k, v, causal=causal, return_lse=True)
    parts = []
    for name, options in (("mma.sync", dict(block_sizes=(64, 64))), ("wgmma", dict(algorithm="wgmma")),
                          ("wgmma deterministic=False", dict(algorithm="wgmma", deterministic=False))):
        got, again = (numba_flash.attention_backward(q, k, v, out, lse, grad_out, causal=causal, **options)
                      for _ in range(2))
        same = all(torch.equal(a, b) for a, b in zip(got, again))
        errors = " ".join(f"{float((a.double() - b).abs().max()):.3g}" for a, b in zip(got, want))
        parts.append(f"{name}: {errors} same={same}")
    print((batch, heads, kv_heads, n_q, n_k, d, dtype_name, causal), " | ".join(parts), flush=True)


def torch_times(torch, leaves, grad_out, causal, timed, forward_too=False):
    """Milliseconds of torch SDPA's flash and cuDNN backends on ``leaves`` (q, k, v): forward + backward, and the
    forward alone when ``forward_too``."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    times, grouped = {}, leaves[0].shape[1] != leaves[1].shape[1]
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cuDNN", SDPBackend.CUDNN_ATTENTION)):
        def forward(backend=backend):
            with sdpa_kernel(backend):
                return sdpa(*leaves, is_causal=bool(causal), enable_gqa=grouped)
        times[f"{name} fwd+bwd"] = timed(lambda: torch.autograd.grad(forward(), leaves, grad_out))
        if forward_too:
            times[f"{name} fwd"] = timed(forward)
    return times


def bench(torch, batch, heads, kv_heads, n, d, dtype, causal, peers):
    from numba_flash.tools.timing import time_ms

    q, grad_out = (torch.randn(batch, heads, n, d, device="cuda", dtype=dtype) for _ in "qo")
    k, v = (torch.randn(batch, kv_heads, n, d, device="cuda", dtype=dtype) for _ in "kv")
    out, lse = numba_flash.attention(q, k, v, causal=causal, return_lse=True)
    timed = lambda run: time_ms(run, repeats=REPEATS, warmup=2)   # noqa: E731
    times = {}
    for name, deterministic in (("bwd", True), ("bwd deterministic=False", False)):
        times[name] = timed(lambda: numba_flash.attention_backward(q, k, v, out, lse, grad_out, causal=causal,
                                                                   deterministic=deterministic))
    if peers:
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        times.update(torch_times(torch, leaves, grad_out, causal, timed, forward_too=True))
        times["ours fwd+bwd"] = timed(lambda: torch.autograd.grad(
            numba_flash_torch.attention(*leaves, causal=causal), leaves, grad_out))
        times["ours fwd"] = timed(lambda: numba_flash.attention(q, k, v, causal=causal))
    print((batch, heads, kv_heads, n, d, str(dtype)[6:], causal), " ".join(f"{k}={v:.3f}" for k, v in times.items()),
          flush=True)


def bench_mask(torch, batch, heads, n, d, dtype):
    from numba_flash import masks
    from numba_flash.tools.bench import flex_attention
    from numba_flash.tools.timing import time_ms

    block_mask = masks.random(n, n, (MASK_BLOCK, MASK_BLOCK), MASK_DENSITY, seed=0)
    q, k, v, grad_out = (torch.randn(batch, heads, n, d, device="cuda", dtype=dtype) for _ in "qkvo")
    out, lse = numba_flash.attention(q, k, v, block_mask=block_mask, return_lse=True)
    timed = lambda run: time_ms(run, repeats=REPEATS, warmup=2)   # noqa: E731
    times = {}
    for name, options in (("bwd wgmma", dict(algorithm="wgmma")), ("bwd mma.sync", dict(block_sizes=(64, 64)))):
        times[name] = timed(lambda: numba_flash.attention_backward(q, k, v, out, lse, grad_out, block_mask=block_mask,
                                                                   **options))
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    for name, algorithm in (("ours fwd+bwd (wgmma)", "wgmma"), ("ours fwd+bwd (flash2)", "flash2")):
        times[name] = timed(lambda: torch.autograd.grad(
            numba_flash_torch.attention(*leaves, block_mask=block_mask, algorithm=algorithm), leaves, grad_out))
    flex = flex_attention(torch, False, n, n, d, block_mask=block_mask)
    if flex is not None:
        times["flex fwd+bwd"] = timed(lambda: torch.autograd.grad(flex(*leaves), leaves, grad_out))
    print((batch, heads, n, d, str(dtype)[6:], f"density {float(block_mask.layout.mean()):.3f}"),
          " ".join(f"{k}={v:.3f}" for k, v in times.items()), flush=True)


def bench_modes(torch, modes, batch, heads, kv_heads, n, d, causal):
    from numba_flash import api
    from numba_flash.kernels.hopper import backward as hopper_backward
    from numba_flash.kernels.hopper.dq_sums import UNORDERED_MODES
    from numba_flash.tools.timing import time_ms

    def use(mode):   # DQ_MODE for the while; the plans laid out for the previous one forgotten
        hopper_backward.DQ_MODE = mode
        api._PLANS.clear()

    q, grad_out = (torch.randn(batch, heads, n, d, device="cuda", dtype=torch.bfloat16) for _ in "qo")
    k, v = (torch.randn(batch, kv_heads, n, d, device="cuda", dtype=torch.bfloat16) for _ in "kv")
    out, lse = numba_flash.attention(q, k, v, causal=causal, return_lse=True)
    timed = lambda run: time_ms(run, repeats=REPEATS, warmup=2)   # noqa: E731
    saved, times, notes, gradients = hopper_backward.DQ_MODE, {}, [], {}
    try:
        for mode in modes:
            use(mode)
            deterministic = mode not in UNORDERED_MODES

            def backward(deterministic=deterministic):
                return numba_flash.attention_backward(q, k, v, out, lse, grad_out, causal=causal,
                                                      deterministic=deterministic)

            gradients[mode] = backward()
            times[mode] = timed(backward)
            if mode != "separate":
                difference = max(float((x.float() - y.float()).abs().max() / y.float().abs().max())
                                 for x, y in zip(gradients[mode], gradients["separate"]))
                notes.append(f"{mode} diff={difference:.1e}")
            if deterministic:
                notes.append(f"{mode} same={all(torch.equal(x, y) for x, y in zip(gradients[mode], backward()))}")
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        times.update(torch_times(torch, leaves, grad_out, causal, timed))
        for mode in modes:
            use(mode)
            times[f"ours fwd+bwd ({mode})"] = timed(lambda: torch.autograd.grad(
                numba_flash_torch.attention(*leaves, causal=causal, deterministic=mode not in UNORDERED_MODES),
                leaves, grad_out))
    finally:
        use(saved)
    print((batch, heads, kv_heads, n, d, causal), " ".join(f"{k}={v:.3f}" for k, v in times.items()), "|",
          " ".join(notes), flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("check", "bench", "quick", "mask", "modes"))
    parser.add_argument("--dtypes", default="float16,bfloat16")
    parser.add_argument("--modes", default=",".join(DQ_MODES), help="modes: the ways of summing dQ to time")
    args = parser.parse_args(argv)
    if numba_flash.in_simulator():
        print("needs a GPU")
        return 2
    import torch

    if args.what == "check":
        for case in CHECKS:
            check(torch, *case)
        return 0
    if args.what == "modes":
        for shape in MODE_SHAPES:
            bench_modes(torch, args.modes.split(","), *shape)
        return 0
    dtypes = ["float16"] if args.what == "quick" else args.dtypes.split(",")
    if args.what == "mask":
        for dtype in dtypes:
            for shape in MASK_SHAPES:
                bench_mask(torch, *shape, getattr(torch, dtype))
        return 0
    for dtype in dtypes:
        for shape in SHAPES:
            for causal in (False, True):
                bench(torch, *shape, getattr(torch, dtype), causal, peers=args.what == "bench")
    return 0


if __name__ == "__main__":
    main()
