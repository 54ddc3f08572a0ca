"""Multi-query decoding: one packed tile of the group's 32 rows against 16-row tiles with key warps.

Issue 47's gap is MQA (one K/V head for 32 query heads).  Until 2026-12-07 ``decode_plan`` packed the group's 32
rows into one tile of two warps, each K/V tile read once, over few blocks (``docs/decoding.md``: (4, 32, 1, 8192)
45.9 us of GPU time against cuDNN's 15.6 on an H100).  The alternative, which the plan now takes after this script's
run (``results/decode_mqa_tiles_h100.md``): two tiles of 16 rows each, with the four key warps the 16-row tiles
have, which reads each K/V tile twice, the second time mostly from L2.  For each (B, H_q, H_kv, N, d), bfloat16, one
new query per sequence, caches full, lengths on the GPU: the whole call (CUDA events around an idle stream) and the
GPU work alone (``device_only``), in microseconds, for the plan's choice and the forced variants in ``VARIANTS``,
their largest difference from the plan's output, and torch SDPA's cuDNN and flash backends (``enable_gqa``); one
process.

    PYTHONPATH=$PWD python3 experiments/tuning/decode_mqa_tiles.py

Prints one line per shape.  Needs a GPU and torch.
"""
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention as sdpa

import numba_flash
from numba_flash.tools.timing import time_ms

#: (B, H_q, H_kv, N, d): multi-query shapes of issue 47's grid, and single long sequences at d = 64 (the grid's
#: lowest multi-query points on 2026-12-07: (1, 32, 1, 32768, 64) 0.73x the fastest torch backend).
CASES = [(4, 32, 1, 8192, 128), (4, 32, 1, 16384, 128), (1, 32, 1, 32768, 128), (16, 32, 1, 8192, 128),
         (1, 32, 1, 8192, 128), (4, 32, 1, 8192, 64), (64, 32, 1, 2048, 128), (1, 32, 1, 32768, 64),
         (1, 32, 1, 131072, 64)]
#: The plan's choice (16-row tiles with four key warps since 2026-12-07), and forced tiles / key warps / splits
#: (``attention_with_kv_cache``'s arguments).  At one long sequence the plan's 32 blocks are issue-bound, one warp per
#: scheduler (ncu, H100, 2026-12-07, ``results/decode_key_warps_h100.md``), and 33 or 66 splits of the 16-row tiles
#: were no faster (the last block's merge grows with them; ``results/decode_mqa_tiles_h100.md``): so eight key warps
#: of (16, 16) tiles, twice the warps on the same blocks (three buffers of eight warps' tiles fit at d = 128 with
#: 16-key tiles only).
VARIANTS = {"plan": {}, "32-row tile, 2 warps": dict(block_sizes=(32, 32), key_warps=1),
            "16 rows, 4 key warps, 8 splits": dict(block_sizes=(16, 32), key_warps=4, num_splits=8),
            "16 rows, 4 key warps, 33 splits": dict(block_sizes=(16, 32), key_warps=4, num_splits=33),
            "16x16 tiles, 8 key warps": dict(block_sizes=(16, 16), key_warps=8),
            "16x16 tiles, 8 key warps, 8 splits": dict(block_sizes=(16, 16), key_warps=8, num_splits=8)}


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
        parts = []
        for name, options in VARIANTS.items():
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
