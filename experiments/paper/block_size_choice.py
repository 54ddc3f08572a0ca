"""How good is Algorithm 1's line 1?  Its (B_r, B_c) against the fastest measured pair.

Line 1 picks B_c = ceil(M / 4d) and B_r = min(B_c, d) from the SRAM size M
alone.  For d in {32, 64, 128} we time the literal flash1 kernel with the
line-1 pair (for M = 48 KiB, the static shared-memory limit) and with every
pair on a grid of B_r x B_c whose tiles fit in that budget, and report how
far line 1 is from the best.

    PYTHONPATH=$PWD python3 experiments/paper/block_size_choice.py [--quick] [--out DIR]
"""
import argparse
import datetime
import os

import numpy as np

import numba_flash
from numba_flash.tools.report import markdown_header, progress, pyplot, save_figure, timer_note, write_csv
from numba_flash.tiling import flash1_sram_elements
from numba_flash.tools.timing import time_ms

RESULTS = os.path.join(os.path.dirname(__file__), "results")
SRAM_BYTES = 48 * 1024
CANDIDATES = (8, 16, 24, 32, 48, 64, 96, 128)
REPEATS = 3  # timed calls per pair (median), after one warm-up


def fits(block_rows, block_cols, d):
    return 4 * flash1_sram_elements(block_rows, block_cols, d) <= SRAM_BYTES


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny problems (a simulator pipeline check)")
    parser.add_argument("--out", default=RESULTS, help="directory for the outputs")
    args = parser.parse_args(argv)
    from numba import cuda

    # N = 1024 at 64 heads: flash1 runs one thread block per head, so the 109 timed pairs take
    # about 0.1 s a call (a longer N scales every pair alike, T_r T_c tiles of the same work).
    dims, shape, candidates = ((8,), (1, 1, 24), (4, 8)) if args.quick else ((32, 64, 128), (4, 16, 1024), CANDIDATES)
    rows = []
    for d in dims:
        rng = np.random.default_rng(0)
        q, k, v = (cuda.to_device(rng.standard_normal(shape + (d,)).astype(np.float32)) for _ in range(3))
        line1 = numba_flash.line1_block_sizes(d, sram_bytes=SRAM_BYTES, n_q=shape[-1], n_k=shape[-1])
        pairs = sorted({line1} | {(r, c) for r in candidates for c in candidates if fits(r, c, d)})
        for block_rows, block_cols in progress(pairs, f"d={d}"):
            ms = time_ms(lambda: numba_flash.attention(q, k, v, algorithm="flash1",
                                                       block_sizes=(block_rows, block_cols)),
                         repeats=1 if args.quick else REPEATS, warmup=0 if args.quick else 1)
            rows.append(dict(d=d, block_rows=block_rows, block_cols=block_cols, line1=(block_rows, block_cols) == line1,
                             ms=round(ms, 4)))
    write(rows, args.out, args.quick, shape)


def write(rows, out_dir, quick, shape):
    os.makedirs(out_dir, exist_ok=True)
    stem = os.path.join(out_dir, "block_size_choice" + ("_quick" if quick else ""))
    device = numba_flash.device_limits().name
    write_csv(stem + ".csv", rows)
    summary = []
    for d in sorted({r["d"] for r in rows}):
        group = [r for r in rows if r["d"] == d]
        best = min(group, key=lambda r: r["ms"])
        line1 = next(r for r in group if r["line1"])
        summary.append(dict(d=d, line1=(line1["block_rows"], line1["block_cols"]), line1_ms=line1["ms"],
                            best=(best["block_rows"], best["block_cols"]), best_ms=best["ms"],
                            line1_vs_best=round(line1["ms"] / best["ms"], 3)))
    with open(stem + ".md", "w") as f:
        f.write(markdown_header("Line 1's block sizes against the fastest (flash1, float32)",
                                "python3 experiments/paper/block_size_choice.py" + (" --quick" if quick else ""),
                                device,
                                timer_note(1 if quick else REPEATS))
                + f"(B,H,N) = {shape}, M = 48 KiB (float32 elements: 12288), every (B_r, B_c) from "
                f"{CANDIDATES} whose tiles fit.\n\n| d | line 1 | ms | fastest | ms | line 1 / fastest |\n"
                "|---|---|---|---|---|---|\n")
        for s in summary:
            f.write(f"| {s['d']} | {s['line1']} | {s['line1_ms']} | {s['best']} | {s['best_ms']} | "
                    f"{s['line1_vs_best']} |\n")
    written = [stem + ".csv", stem + ".md"]
    plt = pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(6, 4.2))
        for d in sorted({r["d"] for r in rows}):
            group = sorted((r for r in rows if r["d"] == d), key=lambda r: r["block_rows"] * r["block_cols"])
            ax.plot([r["block_rows"] * r["block_cols"] for r in group], [r["ms"] for r in group], "o", alpha=0.6,
                    label=f"d = {d}")
            marked = next(r for r in group if r["line1"])
            ax.plot(marked["block_rows"] * marked["block_cols"], marked["ms"], "k*", markersize=12)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tile area B_r x B_c (elements)")
        ax.set_ylabel("flash1 forward time (ms)")
        ax.set_title(f"Block sizes of flash1; * = line 1 ({device}, {datetime.date.today()})", fontsize=9)
        ax.legend(fontsize=8)
        written.append(save_figure(fig, stem))
    print("wrote", *written)


if __name__ == "__main__":
    main()
