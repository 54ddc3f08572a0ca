"""score_mod / mask_mod against FlexAttention: issue 46's examples, forward and forward + backward, in one process.

Each case runs the same modification three ways, CUDA events, median of ``--repeats``:

* ``ours``: ``numba_flash.attention`` (forward) and ``numba_flash.torch.attention`` through ``torch.autograd.grad``
  (forward + backward) with the mods of ``numba_flash.mods``, whichever kernel ``algorithm="flash2"`` picks;
* ``mma``: ours with flash2's pick of the wgmma kernels turned off (the ``mma.sync`` kernels), to check the pick;
* ``plain``: the same call without the score_mod (the causal or masked call alone), flash2's pick, so
  ``ours / plain`` is what the mod costs (issue 46: at most 1.15);
* ``flex``: FlexAttention under ``torch.compile`` with the same ``score_mod`` and a block mask made once by
  ``create_block_mask`` (outside the timed region, as a training loop caches it).

    PYTHONPATH=$PWD python3 experiments/tuning/mods_bench.py [--dtypes bfloat16,float16] [--out DIR --tag NAME]

Prints a markdown table (times in ms; ratios > 1 mean ours is faster) and, with ``--out``, writes it with the
command, device and date.  Needs a GPU and torch with FlexAttention.
"""
import argparse
import contextlib
import datetime
import os
import sys

import numpy as np

import numba_flash
import numba_flash.torch as numba_flash_torch
from numba_flash import mods

#: (B, H, N, d) and the examples timed there: issue 46's table.
CASES = [((4, 16, 4096, 64), ("causal", "softcap", "alibi", "sliding_window", "document")),
         ((2, 16, 8192, 128), ("causal", "softcap", "alibi"))]
SOFTCAP = 50.0          # Gemma 2's attention logit cap
WINDOW = 1024
DOCUMENTS = 7


@contextlib.contextmanager
def wgmma_automatic(enabled):
    """flash2's pick of the wgmma kernels on or off (off: the mma.sync kernels).  The pick is made when a call's
    plan is built, and plans are cached by the call's arrays and options (``numba_flash.api._PLANS``): the cache is
    emptied on the way in and out, or the calls after this block would run the plans built inside it (as this
    script's first runs did, 2026-12-06: their "ours" with mods was the mma.sync kernels')."""
    from numba_flash import api
    from numba_flash.kernels.hopper import forward as hopper_forward
    before = hopper_forward.AUTOMATIC
    hopper_forward.AUTOMATIC = enabled
    api._PLANS.clear()
    try:
        yield
    finally:
        hopper_forward.AUTOMATIC = before
        api._PLANS.clear()


def document_ids(n, rng):
    """DOCUMENTS documents of random lengths covering n positions, as int32 ids."""
    cuts = np.sort(rng.choice(np.arange(1, n), DOCUMENTS - 1, replace=False))
    return np.repeat(np.arange(DOCUMENTS, dtype=np.int32), np.diff(np.concatenate([[0], cuts, [n]])))


def example(torch, name, heads, n, rng):
    """(our options, our options without the score_mod, flex score_mod, flex mask_mod) for one example."""
    slopes = mods.alibi_slopes(heads).astype(np.float32)
    docs = document_ids(n, rng)
    slopes_t, docs_t = torch.as_tensor(slopes, device="cuda"), torch.as_tensor(docs, device="cuda")
    causal = lambda b, h, q, k: q >= k   # noqa: E731
    if name == "causal":
        return dict(causal=True), dict(causal=True), None, causal
    if name == "softcap":
        return (dict(causal=True, score_mod=mods.softcap(SOFTCAP)), dict(causal=True),
                lambda s, b, h, q, k: SOFTCAP * torch.tanh(s / SOFTCAP), causal)
    if name == "alibi":
        return (dict(causal=True, score_mod=mods.alibi(slopes_t)), dict(causal=True),
                lambda s, b, h, q, k: s + slopes_t[h] * (k - q), causal)
    if name == "sliding_window":
        options = dict(mask_mod=mods.sliding_window(WINDOW))
        return options, options, None, lambda b, h, q, k: (q >= k) & (q - k < WINDOW)
    if name == "document":
        options = dict(causal=True, mask_mod=mods.document(docs_t))
        return options, options, None, lambda b, h, q, k: (q >= k) & (docs_t[q] == docs_t[k])
    raise ValueError(name)


def run_case(torch, shape, name, dtype, repeats, rng):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from numba_flash.tools.timing import time_ms
    batch, heads, n, d = shape
    q, k, v, grad_out = (torch.randn(batch, heads, n, d, device="cuda", dtype=dtype) for _ in "qkvo")
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    ours, plain, flex_score, flex_mask = example(torch, name, heads, n, rng)
    timed = lambda run: time_ms(run, repeats=repeats, warmup=2)   # noqa: E731
    row = {}
    row["plain fwd"] = timed(lambda: numba_flash.attention(q, k, v, **plain))
    row["plain fwd+bwd"] = timed(lambda: torch.autograd.grad(
        numba_flash_torch.attention(*leaves, **plain), leaves, grad_out))
    with wgmma_automatic(False):
        row["mma fwd"] = timed(lambda: numba_flash.attention(q, k, v, **ours))
        row["mma fwd+bwd"] = timed(lambda: torch.autograd.grad(
            numba_flash_torch.attention(*leaves, **ours), leaves, grad_out))
    row["ours fwd"] = timed(lambda: numba_flash.attention(q, k, v, **ours))
    row["ours fwd+bwd"] = timed(lambda: torch.autograd.grad(
        numba_flash_torch.attention(*leaves, **ours), leaves, grad_out))
    compiled = torch.compile(flex_attention, dynamic=False)
    block_mask = create_block_mask(flex_mask, None, None, n, n, device="cuda")
    flex = lambda *x: compiled(*x, score_mod=flex_score, block_mask=block_mask)   # noqa: E731
    row["flex fwd"] = timed(lambda: flex(q, k, v))
    row["flex fwd+bwd"] = timed(lambda: torch.autograd.grad(flex(*leaves), leaves, grad_out))
    return row


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", default="bfloat16,float16")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--only", default=None, help="comma-separated example names")
    parser.add_argument("--out", default=None)
    parser.add_argument("--tag", default="mods_bench")
    args = parser.parse_args(argv)
    if numba_flash.in_simulator():
        print("needs a GPU")
        return 2
    import torch
    import torch._dynamo.config as dynamo_config
    dynamo_config.cache_size_limit = max(dynamo_config.cache_size_limit, 256)
    dynamo_config.accumulated_cache_size_limit = max(dynamo_config.accumulated_cache_size_limit, 1024)
    rng = np.random.default_rng(0)
    lines = ["| (B, H, N, d) | example | dtype | ours fwd | flex fwd | flex/ours fwd | ours fwd+bwd | flex fwd+bwd "
             "| flex/ours fwd+bwd | mod cost fwd (ours/plain) | mod cost fwd+bwd | mma.sync/ours fwd | mma.sync/ours "
             "fwd+bwd |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    for shape, names in CASES:
        for name in names:
            if args.only and name not in args.only.split(","):
                continue
            for dtype_name in args.dtypes.split(","):
                try:
                    r = run_case(torch, shape, name, getattr(torch, dtype_name), args.repeats, rng)
                except Exception as exc:   # one failed case must not hide the others' numbers
                    line = f"| {shape} | {name} | {dtype_name} | failed: {type(exc).__name__}: {exc} |"
                else:
                    line = (f"| {shape} | {name} | {dtype_name} | {r['ours fwd']:.3f} | {r['flex fwd']:.3f} | "
                            f"{r['flex fwd'] / r['ours fwd']:.2f}x | {r['ours fwd+bwd']:.3f} | "
                            f"{r['flex fwd+bwd']:.3f} | {r['flex fwd+bwd'] / r['ours fwd+bwd']:.2f}x | "
                            f"{r['ours fwd'] / r['plain fwd']:.2f} | {r['ours fwd+bwd'] / r['plain fwd+bwd']:.2f} | "
                            f"{r['mma fwd'] / r['ours fwd']:.2f}x | {r['mma fwd+bwd'] / r['ours fwd+bwd']:.2f}x |")
                print(line, flush=True)
                lines.append(line)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        device = torch.cuda.get_device_name()
        with open(os.path.join(args.out, f"{args.tag}.md"), "w") as f:
            f.write(f"# score_mod / mask_mod against FlexAttention\n\nCommand: `python3 {' '.join(sys.argv)}`; "
                    f"{device}; {datetime.date.today()}; torch {torch.__version__}.  Times in ms (CUDA events, "
                    f"median of {args.repeats}); flex/ours > 1: ours faster.\n\n" + "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
