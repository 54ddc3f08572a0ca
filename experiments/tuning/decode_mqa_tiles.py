"""Multi-query decoding: the plan's layout against forced tiles, key warps and splits.

Issue 47's gap is MQA (one K/V head for 32 query heads).  Until 2026-12-07 ``decode_plan`` packed the group's 32
rows into one tile of two warps, each K/V tile read once, over few blocks (``docs/decoding.md``: (4, 32, 1, 8192)
45.9 us of GPU time against cuDNN's 15.6 on an H100).  The alternative, which the plan now takes after this script's
run (``results/decode_mqa_tiles_h100.md``): two tiles of 16 rows each, which reads each K/V tile twice, the second
time mostly from L2, with key warps (eight of 16-key tiles at d = 128 since a later run of the same day).  For each
(B, H_q, H_kv, N, d), bfloat16, one new query per sequence, caches full, lengths on the GPU: the whole call (CUDA
events around an idle stream) and the GPU work alone (``device_only``), in microseconds, for the plan's choice and
the forced variants in ``VARIANTS``, their largest difference from the plan's output, and torch SDPA's cuDNN and
flash backends (``enable_gqa``); one process.

    PYTHONPATH=$PWD python3 experiments/tuning/decode_mqa_tiles.py

Prints one line per shape.  Needs a GPU and torch.
"""
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention as sdpa

import numba_flash
from numba_flash.decode_plan import decode_plan
from numba_flash.tools.timing import time_ms

#: (B, H_q, H_kv, N, d): multi-query shapes of issue 47's grid, and single long sequences at d = 64 (the grid's
#: lowest multi-query points on 2026-12-07: (1, 32, 1, 32768, 64) 0.73x the fastest torch backend).
CASES = [(4, 32, 1, 8192, 128), (4, 32, 1, 16384, 128), (1, 32, 1, 32768, 128), (16, 32, 1, 8192, 128),
         (1, 32, 1, 8192, 128), (4, 32, 1, 8192, 64), (64, 32, 1, 2048, 128), (1, 32, 1, 32768, 64),
         (1, 32, 1, 131072, 64)]
#: Forced layouts (``attention_with_kv_cache``'s arguments) beside the plan's.  Settled (2026-12-07, the results file):
#: 16-row tiles beat one 32-row tile of two warps (1.55-2.51x less GPU time), 33 or 66 splits of four key warps lost to
#: the plan's splits, and eight key warps of (16, 16) tiles beat four of (16, 32) at every shape (1.00-1.24x), which
#: the plan takes since at d = 128.  Open: whether twice the plan's splits (a second block on the idle multiprocessors
#: at one long sequence: 31 splits of two tiles use 62 of 132) outweigh the longer merge with eight key warps.  A
#: variant is a dict of arguments, or a function of the plan's splits.
VARIANTS = {"plan": {}, "4 key warps, 16x32": dict(block_sizes=(16, 32), key_warps=4),
            "8 key warps, 16x16": dict(block_sizes=(16, 16), key_warps=8),
            "8 key warps, twice the splits": lambda splits: dict(block_sizes=(16, 16), key_warps=8,
                                                                 num_splits=2 * splits)}


def microseconds(run):
    return (f"whole={time_ms(run, repeats=30) * 1e3:.1f} "
            f"device={time_ms(run, repeats=30, device_only=True) * 1e3:.1f}")


def main():
    if numba_flash.in_simulator():
        print("needs a GPU")
        return 2
    print(torch.cuda.get_device_name(), flush=True)
    for batch, heads, kv_heads, n, d in CASES:
        q = torch.randn(batch, heads, 1, d, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(batch, kv_heads, n, d, device="cuda", dtype=torch.bfloat16) for _ in "kv")
        lengths = torch.full((batch,), n, dtype=torch.int32, device="cuda")
        reference = numba_flash.attention_with_kv_cache(q, k, v, lengths)
        splits = decode_plan(batch, heads, kv_heads, 1, n, d, 2,
                             multiprocessors=numba_flash.device_limits().multiprocessors).splits
        parts = []
        for name, options in VARIANTS.items():
            options = options(splits) if callable(options) else options
            def run(options=options):
                return numba_flash.attention_with_kv_cache(q, k, v, lengths, **options)
            difference = float((run().float() - reference.float()).abs().max())
            parts.append(f"{name}: {microseconds(run)} max|diff|={difference:.1e}")
        for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
            def run(backend=backend):
                with sdpa_kernel(backend):
                    return sdpa(q, k, v, enable_gqa=True)
            try:
                parts.append(f"{name}: {microseconds(run)}")
            except RuntimeError:   # the backend refuses the shape
                parts.append(f"{name}: refused")
        print((batch, heads, kv_heads, n, d), " | ".join(parts), flush=True)
    return 0


if __name__ == "__main__":
    main()
