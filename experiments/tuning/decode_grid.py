"""Decoding across serving shapes: the whole call of ``attention_with_kv_cache`` against torch's SDPA backends.

One decoding step attends ``N_q`` new queries per sequence (1, or a few as speculative decoding does) to a full
cache of ``N`` keys.  For each point of a grid of batch sizes, (H_q, H_kv) pairs, cache lengths, head dims and
``N_q``, in one process: numba-flash (lengths a CUDA tensor, as a decoding loop holds them; nothing appended)
and every torch SDPA backend that takes the shapes (``enable_gqa=True``), each timed as a whole call (CUDA
events from the host's first step to the last kernel's end, host work included), in ``ROUNDS`` rounds of
``REPEATS`` / ``ROUNDS`` calls whose order of backends turns round each round, the median of the rounds' medians.  For
``N_q`` > 1 our call is causal aligned bottom-right (a new query sees the cache and the new queries before it)
while torch's backends attend to every key (they take no bottom-right mask without a dense one): the same bytes,
a little more arithmetic for them.  Each call reads the next of several sets of inputs, so that at least
``ROTATE_BYTES`` pass through memory between two reads of one set and L2 (50 MB) cannot serve a call from the
last.  Bandwidth: K and V bytes read per second, against a device-to-device copy (read + written) timed in the
same process.

    PYTHONPATH=$PWD python3 experiments/tuning/decode_grid.py [--dtype bfloat16] [--batches 1,4,16,64] ...
    PYTHONPATH=$PWD python3 experiments/tuning/decode_grid.py --quick    # a tiny grid (runs in the simulator)
    PYTHONPATH=$PWD python3 experiments/tuning/decode_grid.py --plans    # each point's plan only (no GPU needed)

The whole grid is 8 parts of 64 points (one dtype, head dim and N_q each), each meant to take at most ~4 minutes of
a GPU (the table's last line says how long it took), e.g.

    python3 experiments/tuning/decode_grid.py --dtype bfloat16 --head-dims 128 --new-queries 1

Writes ``results/decode_grid_<dtype>[_d<head dims>][_q<N_q>]_<card>.{md,csv,png}`` (``decode_grid_quick`` with
--quick): the table, with the layout ``decode_plan`` chose for each point (``plan``: packed query rows, tile, warps,
splits) and the model's time (``model_us``), and a heat map of (fastest torch backend) / ours.  Targets (issue 47):
>= 1.0x the fastest backend at every point, and >= 80% of the copy bandwidth where K and V exceed 64 MB.
"""
import argparse
import math
import os
import re
import time

import numpy as np

import numba_flash
from numba_flash.tools.report import markdown_header, markdown_table, pyplot, timer_note, write_csv
from numba_flash.tools.timing import time_ms

RESULTS = os.path.join(os.path.dirname(__file__), "results")
REPEATS = 20
#: Rounds of timing per point (each backend REPEATS / ROUNDS calls a round, the medians' median reported).
ROUNDS = 4
#: Bytes of K and V read between two reads of the same inputs (several sets in turn below this size).
ROTATE_BYTES = 512e6
#: Points whose inputs would take more memory than this are left out (marked so in the table).
MEMORY_LIMIT_BYTES = 60e9
#: Where the bandwidth target applies: K and V bytes per call above this.
BANDWIDTH_TARGET_BYTES = 64e6
GRID = dict(batches=(1, 4, 16, 64), heads=((32, 32), (32, 8), (64, 8), (32, 1)), lengths=(2048, 8192, 32768, 131072),
            head_dims=(64, 128), new_queries=(1, 4))
QUICK_GRID = dict(batches=(1, 2), heads=((4, 4), (4, 1)), lengths=(40,), head_dims=(16,), new_queries=(1, 3))


def peers():
    """torch's SDPA backends by name, each a function of (q, k, v)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    def backend(which):
        def run(q, k, v):
            with sdpa_kernel(which):
                sdpa(q, k, v, enable_gqa=q.shape[1] != k.shape[1])
        return run
    return {"torch flash": backend(SDPBackend.FLASH_ATTENTION), "torch cuDNN": backend(SDPBackend.CUDNN_ATTENTION),
            "torch mem-efficient": backend(SDPBackend.EFFICIENT_ATTENTION)}


def point(torch, batch, heads, kv_heads, n, d, n_q, dtype, device, repeats):
    """One grid point: a row of the table (times in microseconds, or the reason it was left out)."""
    row = dict(B=batch, H_q=heads, H_kv=kv_heads, N=n, d=d, N_q=n_q)
    kv_bytes = 2 * batch * kv_heads * n * d * torch.finfo(dtype).bits // 8
    sets = max(1, min(8, math.ceil(ROTATE_BYTES / kv_bytes)))
    if sets * kv_bytes > MEMORY_LIMIT_BYTES:
        return dict(row, kv_mb=f"{kv_bytes / 1e6:.0f}", note="left out: too large for this card")
    generator = torch.Generator(device=device).manual_seed(0)
    inputs = [(torch.randn(batch, heads, n_q, d, device=device, dtype=dtype, generator=generator),
               torch.randn(batch, kv_heads, n, d, device=device, dtype=dtype, generator=generator),
               torch.randn(batch, kv_heads, n, d, device=device, dtype=dtype, generator=generator))
              for _ in range(sets)]
    lengths = torch.full((batch,), n, dtype=torch.int32, device=device)
    turn = [0]

    def advance():
        turn[0] = (turn[0] + 1) % sets

    def ours():
        q, k, v = inputs[turn[0]]
        numba_flash.attention_with_kv_cache(q, k, v, lengths)

    ours()   # the plan (and kernels) made outside the timing
    layout = chosen_plan(batch, heads, n_q, kv_heads)
    row.update(plan=str(layout), model_us=f"{layout.estimate_us:.1f}")
    calls = dict(ours=ours, **{name: (lambda run=run: run(*inputs[turn[0]])) for name, run in peers().items()})
    samples = {name: [] for name in calls}
    # In ROUNDS (one in the simulator), the order reversed each round, so that no backend is always timed first after
    # the point's setup (ours, timed first, ran up to 1.25x slower in the whole grid than alone: H100, 2026-12-07).
    for round_ in range(ROUNDS if repeats > 1 else 1):
        for name in (list(calls) if round_ % 2 == 0 else list(calls)[::-1]):
            if name in samples:
                try:
                    samples[name].append(time_ms(calls[name], repeats=max(1, repeats // ROUNDS), setup=advance))
                except RuntimeError:   # a torch backend that refuses these shapes
                    if name == "ours":
                        raise
                    del samples[name]
    times = {name: float(np.median(found)) for name, found in samples.items()}
    best_name = min((name for name in times if name != "ours"), key=times.get, default=None)
    row.update(kv_mb=f"{kv_bytes / 1e6:.0f}", ours_us=f"{times['ours'] * 1e3:.1f}")
    for name in peers():
        row[name.replace("torch ", "") + "_us"] = f"{times[name] * 1e3:.1f}" if name in times else "n/a"
    row["best_over_ours"] = f"{times[best_name] / times['ours']:.2f}" if best_name else ""
    row["best"] = best_name or ""
    row["gb_per_s"] = f"{kv_bytes / (times['ours'] * 1e-3) / 1e9:.0f}"
    return row


def chosen_plan(batch, heads, n_q, kv_heads):
    """The ``decode_plan`` of the last decoding call of these shapes (``api._PLANS``)."""
    from numba_flash import api

    for made in reversed(list(api._PLANS.values())):
        if isinstance(made, api._CachePlan) and made.user_shape[:3] == (batch, heads, n_q) \
                and made.call.kv_heads == kv_heads:
            return made.plan
    raise LookupError("no decoding plan for these shapes")


def grid_points(grid):
    """(d, N_q, H_q, H_kv, B, N) of every point of ``grid``, in the table's order."""
    for d in grid["head_dims"]:
        for n_q in grid["new_queries"]:
            for heads, kv_heads in grid["heads"]:
                for batch in grid["batches"]:
                    for n in grid["lengths"]:
                        yield d, n_q, heads, kv_heads, batch, n


def print_plans(grid, dtype_bytes, multiprocessors):
    """Each point's plan and modelled time, as ``decode_plan`` makes it for a GPU of ``multiprocessors`` (no GPU)."""
    from numba_flash.decode_plan import decode_plan

    for d, n_q, heads, kv_heads, batch, n in grid_points(grid):
        layout = decode_plan(batch, heads, kv_heads, n_q, n, d, dtype_bytes, multiprocessors=multiprocessors)
        print(f"B={batch:<3} H={heads}/{kv_heads:<3} N={n:<7} d={d:<4} N_q={n_q}  {layout}  "
              f"(model {layout.estimate_us:.1f} us)")


def heat_map(plt, rows, path, title):
    """best / ours as colours: a row of the picture per (B, H_q, H_kv), a column per (d, N_q, N)."""
    timed = [r for r in rows if r.get("best_over_ours")]
    ys = sorted({(r["B"], r["H_q"], r["H_kv"]) for r in timed})
    xs = sorted({(r["d"], r["N_q"], r["N"]) for r in timed})
    values = np.full((len(ys), len(xs)), np.nan)
    for r in timed:
        values[ys.index((r["B"], r["H_q"], r["H_kv"])), xs.index((r["d"], r["N_q"], r["N"]))] = float(r["best_over_ours"])
    figure, axes = plt.subplots(figsize=(1 + 0.55 * len(xs), 1.5 + 0.35 * len(ys)))
    image = axes.imshow(values, cmap="RdYlGn", vmin=0.0, vmax=2.0, aspect="auto")
    for (y, x), value in np.ndenumerate(values):
        if not np.isnan(value):
            axes.text(x, y, f"{value:.2f}", ha="center", va="center", fontsize=6)
    axes.set_xticks(range(len(xs)), [f"d{d} q{nq} N{n // 1024 or n}{'K' if n >= 1024 else ''}" for d, nq, n in xs],
                    rotation=90, fontsize=6)
    axes.set_yticks(range(len(ys)), [f"B{b} H{h}/{hk}" for b, h, hk in ys], fontsize=6)
    figure.colorbar(image, label="fastest torch backend / numba-flash (> 1: ours faster)")
    axes.set_title(title, fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=150)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny grid (the simulator's run)")
    parser.add_argument("--plans", action="store_true", help="print each point's plan and modelled time, time nothing")
    parser.add_argument("--dtype", default="bfloat16", choices=("float16", "bfloat16"))
    parser.add_argument("--batches", help="comma-separated batch sizes (default: the whole grid's)")
    parser.add_argument("--lengths", help="comma-separated cache lengths N (default: the whole grid's)")
    parser.add_argument("--head-dims", help="comma-separated head dims (default: 64,128)")
    parser.add_argument("--new-queries", help="comma-separated N_q (default: 1,4)")
    parser.add_argument("--heads", help="comma-separated H_q:H_kv pairs (default: 32:32,32:8,64:8,32:1)")
    parser.add_argument("--out", default=RESULTS)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    grid = dict(QUICK_GRID if args.quick else GRID)
    for key, given in (("batches", args.batches), ("lengths", args.lengths), ("head_dims", args.head_dims),
                       ("new_queries", args.new_queries)):
        if given:
            grid[key] = tuple(int(x) for x in given.split(","))
    if args.heads:
        grid["heads"] = tuple(tuple(int(x) for x in pair.split(":")) for pair in args.heads.split(","))
    if args.plans:
        print_plans(grid, 2, numba_flash.device_limits().multiprocessors)
        return 0
    import torch

    simulator = numba_flash.in_simulator()
    if simulator and not args.quick:
        print("needs a GPU (or --quick, or --plans)")
        return 2
    device = "cpu" if simulator else "cuda"
    dtype = torch.float32 if simulator else getattr(torch, args.dtype)
    repeats = 1 if simulator else REPEATS
    copy_bandwidth = float("nan")
    if not simulator:
        source = torch.empty(int(1e9) // 2, dtype=torch.float16, device=device)
        target = torch.empty_like(source)
        copy_bandwidth = 2 * 1e9 / (time_ms(lambda: target.copy_(source), repeats=repeats) * 1e-3)
        del source, target
    rows = []
    for d, n_q, heads, kv_heads, batch, n in grid_points(grid):
        row = point(torch, batch, heads, kv_heads, n, d, n_q, dtype, device, repeats)
        if "gb_per_s" in row and not simulator:
            row["of_copy"] = f"{float(row['gb_per_s']) * 1e9 / copy_bandwidth:.2f}"
        rows.append(row)
        print(row, flush=True)
        if not simulator:
            torch.cuda.empty_cache()
    keys = list(dict.fromkeys(key for row in rows for key in row))
    rows = [{key: row.get(key, "") for key in keys} for row in rows]
    timed = [r for r in rows if r["best_over_ours"]]
    ratios = [float(r["best_over_ours"]) for r in timed]
    large = [r for r in timed if float(r["kv_mb"]) * 1e6 > BANDWIDTH_TARGET_BYTES and r.get("of_copy")]
    os.makedirs(args.out, exist_ok=True)
    given = [f"--{key.replace('_', '-')} {value}" for key, value in vars(args).items()
             if key not in ("quick", "out", "dtype") and value]
    command = " ".join(["python3 experiments/tuning/decode_grid.py"] + (["--quick"] if args.quick else
                                                                        [f"--dtype {args.dtype}"]) + given)
    device_name = "numba-cuda simulator" if simulator else numba_flash.device_limits().name
    card = re.search(r"[A-Z]\d{3}", device_name)   # "NVIDIA H100 80GB HBM3" -> h100
    dims = f"_d{args.head_dims.replace(',', '_')}" if args.head_dims else ""
    dims += f"_q{args.new_queries.replace(',', '_')}" if args.new_queries else ""
    dims += f"_h{args.heads.replace(',', '_').replace(':', '-')}" if args.heads else ""
    stem = os.path.join(args.out, "decode_grid_quick" if args.quick else
                        f"decode_grid_{args.dtype}{dims}_{card.group(0).lower() if card else 'gpu'}")
    write_csv(stem + ".csv", rows)
    with open(stem + ".md", "w") as f:
        f.write(markdown_header("Decoding across serving shapes", command, device_name, timer=timer_note(repeats)))
        f.write(f"\n{dtype}; whole calls (host work included), lengths on the GPU, caches full; copy bandwidth "
                f"(device to device, read + written): {copy_bandwidth / 1e9:.0f} GB/s.  best_over_ours: the fastest "
                f"torch backend's time over ours (>= 1.0: ours at least as fast).  of_copy: our K/V bytes per second "
                f"over the copy bandwidth.\n\n")
        if ratios:
            f.write(f"Summary: {len(timed)} points; best / ours from {min(ratios):.2f} to {max(ratios):.2f} "
                    f"(median {float(np.median(ratios)):.2f}); {sum(x >= 1.0 for x in ratios)} at >= 1.0x.")
            if large:
                shares = [float(r["of_copy"]) for r in large]
                f.write(f"  Where K and V exceed {BANDWIDTH_TARGET_BYTES / 1e6:.0f} MB ({len(large)} points): "
                        f"{min(shares):.2f} to {max(shares):.2f} of the copy bandwidth, "
                        f"{sum(x >= 0.8 for x in shares)} at >= 0.80.")
            f.write("\n\n")
        f.write(markdown_table(rows))
        f.write(f"\nplan: ``numba_flash.decode_plan``'s layout of the call; model_us: its modelled GPU time (the host's "
                f"work not included).  Wall time of this run: {time.perf_counter() - started:.0f} s.\n")
    plt = pyplot()
    if plt is not None and timed:
        heat_map(plt, rows, stem + ".png", f"decoding, {dtype}: fastest torch backend / numba-flash ({device_name})")
    print("wrote", stem + ".md")
    return 0


if __name__ == "__main__":
    main()
