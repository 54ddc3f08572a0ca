"""Decoding speed: one new token per sequence against a KV cache, as a fraction of the GPU's copy bandwidth.

A decoding step reads every cached key and value once and does little
arithmetic on them, so its measure is bandwidth: the bytes of K and V read,
divided by the time, against what a device-to-device copy achieves on the
same card (bytes read plus written per second).  Times are GPU time
(``time_ms(device_only=True)``: the stream is held while the host issues the
call, so the events bracket the kernels alone, as in a decoding loop whose
host runs ahead, or a captured graph); the first table also gives each
call's whole time, host included.  In the same process:
``numba_flash.attention_with_kv_cache`` (with and without appending the new
token's key and value; the lengths on the GPU as a decoding loop holds them,
and once given on the host, which adds an upload to every call), and torch's
SDPA backends on the same q, k, v
(``enable_gqa=True``; a backend that refuses the shapes is listed as such).
Every call reads the next of ``--caches`` sets of inputs (4: 2.1 GB), as a
model's layers each read their own cache, so that what the 50 MB L2 kept of
one call cannot serve the next; a column gives the time over one set read
again and again, as the runs before 2026-12-02 (session 16) timed it.

    PYTHONPATH=$PWD python3 experiments/tuning/decode_bandwidth.py            # (B, H_q, H_kv, N_q, N, d) = (16, 32, 8, 1, 8192, 128)
    PYTHONPATH=$PWD python3 experiments/tuning/decode_bandwidth.py --quick    # a small case (runs in the simulator, times nothing)

Writes experiments/tuning/results/decode_h200.{csv,md} (``decode_quick`` with --quick), with a second table
that times the tile shapes and split counts around the defaults (the evidence for them), and a
third that times the K/V buffers (``kv_stages``) at a few of them.
Target (issue 16): >= 70% of the copy bandwidth, and >= 1.0x the fastest SDPA backend.
"""
import argparse
import os
from functools import partial

import numpy as np

import numba_flash
from numba_flash.tools.report import markdown_header, markdown_table, timer_note, write_csv
from numba_flash.tools.timing import time_ms

RESULTS = os.path.join(os.path.dirname(__file__), "results")
FULL = dict(batch=16, heads=32, kv_heads=8, n=8192, d=128)
QUICK = dict(batch=1, heads=2, kv_heads=1, n=32, d=8)
REPEATS = 50
#: Tiles around the default: key tiles of 64 and 128 rows became possible when cp.async stopped holding
#: the next K/V tile in registers (ptxas at d = 128, decoding kernel: (16, 32) 251 registers, (16, 64) 255
#: with 76 bytes of spills, (16, 128) 250 with none).
SWEEP_TILES = ((16, 16), (16, 32), (16, 64), (16, 128), (32, 32))
SWEEP_SPLITS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 32)
#: K/V buffers (``kv_stages``) at a few tiles and splits: a one-warp block has one tile in flight with two
#: buffers, so memory latency may bound it (``tiling.DECODE_KV_STAGES``).
SWEEP_STAGES = (2, 3, 4, 6)
SWEEP_STAGE_TILES = ((16, 16), (16, 32), (16, 64))
SWEEP_STAGE_SPLITS = (0, 4, 6, 8, 12, 16)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--dtype", default="float16", choices=("float16", "bfloat16"))
    parser.add_argument("--out", default=RESULTS)
    parser.add_argument("--caches", type=int, default=4, help="sets of q and caches read in turn (default 4)")
    parser.add_argument("--no-sweep", action="store_true", help="the first table only (no tiles, splits or buffers)")
    args = parser.parse_args(argv)
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    simulator = numba_flash.in_simulator()
    if simulator and not args.quick:
        print("needs a GPU (or --quick)")
        return 2
    shape = QUICK if args.quick else FULL
    device = "cpu" if simulator else "cuda"
    dtype = getattr(torch, args.dtype) if not simulator else torch.float32
    b, h, hk, n, d = (shape[key] for key in ("batch", "heads", "kv_heads", "n", "d"))
    generator = torch.Generator(device=device).manual_seed(0)
    # ``--caches`` sets of inputs, read in turn: a model's layers each read their own cache, so what L2 (50 MB)
    # kept of one call's 537 MB cannot serve the next.  The ms_one_cache column reads one set again and again,
    # as runs of this script before 2026-12-02 did (within 1% of the rotating times, every implementation).
    sets = [dict(q=torch.randn(b, h, 1, d, device=device, dtype=dtype, generator=generator),
                 k_cache=torch.randn(b, hk, n, d, device=device, dtype=dtype, generator=generator),
                 v_cache=torch.randn(b, hk, n, d, device=device, dtype=dtype, generator=generator),
                 k_new=torch.randn(b, hk, 1, d, device=device, dtype=dtype, generator=generator),
                 v_new=torch.randn(b, hk, 1, d, device=device, dtype=dtype, generator=generator))
            for _ in range(1 if simulator else args.caches)]
    turn = [0]

    def now(inputs=sets):
        """The set of ``inputs`` the next call reads."""
        return inputs[turn[0] % len(inputs)]

    def next_set():
        turn[0] += 1

    full = np.full(b, n, np.int32)       # every entry holds n keys (host lengths: no device-to-host wait)
    # The lengths as a decoding loop (or a captured graph) holds them: on the GPU, read by the kernels alone.
    # Given on the host, each call adds an upload on the stream (the row "lengths on the host").
    full_held = torch.as_tensor(full, device=device)
    one_short = torch.as_tensor(full - 1, device=device)     # ... or n - 1, and the call appends the n-th
    kv_bytes = 2 * b * hk * n * d * sets[0]["q"].element_size()
    repeats, warmup = (1, 0) if simulator else (REPEATS, 3)   # the simulator's run checks the pipeline only

    def ours(lengths=full_held):
        x = now()
        numba_flash.attention_with_kv_cache(x["q"], x["k_cache"], x["v_cache"], lengths)

    def ours_append():
        x = now()
        numba_flash.attention_with_kv_cache(x["q"], x["k_cache"], x["v_cache"], one_short, k_new=x["k_new"],
                                            v_new=x["v_new"])

    runs = [("numba-flash", ours), ("numba-flash, lengths on the host", partial(ours, full)),
            ("numba-flash, appending the token", ours_append)]
    for name, backend in (("torch math", SDPBackend.MATH), ("torch mem-efficient", SDPBackend.EFFICIENT_ATTENTION),
                          ("torch flash", SDPBackend.FLASH_ATTENTION), ("torch cuDNN", SDPBackend.CUDNN_ATTENTION)):
        def peer(backend=backend):
            x = now()
            with sdpa_kernel(backend):
                sdpa(x["q"], x["k_cache"], x["v_cache"], enable_gqa=True)
        runs.append((name, peer))
    source = torch.empty(kv_bytes // 2, dtype=torch.float16, device=device)   # the copy: one buffer (1.07 GB moved)
    target = torch.empty_like(source)
    gpu_ms = partial(time_ms, repeats=repeats, warmup=warmup, device_only=True, setup=next_set)
    one_cache_ms = partial(time_ms, repeats=repeats, warmup=warmup, device_only=True)
    copy_ms = one_cache_ms(lambda: target.copy_(source))
    copy_bandwidth = 2 * kv_bytes / (copy_ms * 1e-3)      # read + written per second

    rows = []
    for name, run in runs:
        try:
            ms = gpu_ms(run)
            one_ms = one_cache_ms(run)
            whole_ms = time_ms(run, repeats=repeats, warmup=warmup, setup=next_set)
        except RuntimeError as error:
            rows.append(dict(implementation=name, ms="n/a", kv_gb_per_s="", of_copy_bandwidth="", whole_call_ms="",
                             ms_one_cache="", note=str(error).splitlines()[0][:80]))
            continue
        rate = kv_bytes / (ms * 1e-3)
        rows.append(dict(implementation=name, ms=f"{ms:.4f}", kv_gb_per_s=f"{rate / 1e9:.0f}",
                         of_copy_bandwidth=f"{rate / copy_bandwidth:.2f}", whole_call_ms=f"{whole_ms:.4f}",
                         ms_one_cache=f"{one_ms:.4f}", note=""))
        print(rows[-1], flush=True)
    sweep = []
    for tiles in () if args.no_sweep else SWEEP_TILES if not simulator else ((16, 16),):
        for splits in SWEEP_SPLITS if not simulator else (0, 2):
            def tried(tiles=tiles, splits=splits):
                x = now()
                numba_flash.attention_with_kv_cache(x["q"], x["k_cache"], x["v_cache"], full_held, block_sizes=tiles,
                                                    num_splits=splits)
            ms = gpu_ms(tried)
            sweep.append(dict(block_sizes=str(tiles),
                              num_splits=splits or "0 (default)", ms=f"{ms:.4f}",
                              of_copy_bandwidth=f"{kv_bytes / (ms * 1e-3) / copy_bandwidth:.2f}"))
            print(sweep[-1], flush=True)
    # The buffers need tiles that travel by cp.async: 16-bit (the simulator's run converts to float16).
    halves = [{name: t.half() if t.dtype == torch.float32 else t for name, t in x.items()} for x in sets]
    buffers = []
    for tiles in () if args.no_sweep else SWEEP_STAGE_TILES if not simulator else ((16, 16),):
        for stages in SWEEP_STAGES if not simulator else (2, 3):
            for splits in SWEEP_STAGE_SPLITS if not simulator else (0,):
                def tried(tiles=tiles, stages=stages, splits=splits):
                    x = now(halves)
                    numba_flash.attention_with_kv_cache(x["q"], x["k_cache"], x["v_cache"], full_held,
                                                        block_sizes=tiles, num_splits=splits, kv_stages=stages)
                try:
                    ms = gpu_ms(tried)
                except ValueError as error:   # more buffers than shared memory holds
                    buffers.append(dict(block_sizes=str(tiles), kv_stages=stages, num_splits=splits or "0 (default)",
                                        ms="n/a", of_copy_bandwidth=str(error)[:60]))
                    continue
                buffers.append(dict(block_sizes=str(tiles), kv_stages=stages, num_splits=splits or "0 (default)",
                                    ms=f"{ms:.4f}", of_copy_bandwidth=f"{kv_bytes / (ms * 1e-3) / copy_bandwidth:.2f}"))
                print(buffers[-1], flush=True)
    timed = [float(r["ms"]) for r in rows if r["implementation"].startswith("torch") and r["ms"] != "n/a"]
    fastest_peer = min(timed) if timed else float("nan")
    for row in rows:
        row["vs fastest torch"] = (f"{fastest_peer / float(row['ms']):.2f}x" if row["ms"] != "n/a" and timed else "")

    stem = os.path.join(args.out, "decode_quick" if args.quick else "decode_h200")
    os.makedirs(args.out, exist_ok=True)
    write_csv(stem + ".csv", rows)
    with open(stem + ".md", "w") as f:
        f.write(markdown_header("Decoding from a KV cache", "python3 experiments/tuning/decode_bandwidth.py"
                                + (" --quick" if args.quick else f" --dtype {args.dtype}"),
                                "numba-cuda simulator" if simulator else numba_flash.device_limits().name,
                                timer=timer_note(repeats)))
        f.write(f"\n(B, H_q, H_kv, N_q, N, d) = ({b}, {h}, {hk}, 1, {n}, {d}), {dtype}; K and V: {kv_bytes / 1e6:.0f} MB "
                f"read per step.  Copy bandwidth on this card (device-to-device, read + written): "
                f"{copy_bandwidth / 1e9:.0f} GB/s.  Target: >= 0.70 of it, and >= 1.0x the fastest torch backend.  "
                f"Lengths (cache_seqlens) on the GPU unless a row says otherwise.  "
                f"ms: GPU time (the stream held while the host issues the call), {len(sets)} sets of q and "
                f"caches read in turn; ms_one_cache: the same, one set read again and again (L2 may keep part "
                f"of it between calls); whole_call_ms: the call from the host's first step to the last "
                f"kernel's end.\n\n")
        f.write(markdown_table(rows))
        if sweep:
            f.write("\nTiles and split counts (num_splits 0: the library's choice for those tiles):\n\n")
            f.write(markdown_table(sweep))
            f.write("\nK/V buffers (``kv_stages``: that many tiles less one in flight while one is computed on; "
                    "float16 in the simulator's run):\n\n")
            f.write(markdown_table(buffers))
    print("wrote", stem + ".md")
    return 0


if __name__ == "__main__":
    main()
