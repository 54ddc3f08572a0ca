"""Loop order: where FlashAttention-1's parallelism runs out.

Algorithm 1 (``flash1``) puts the key/value blocks in the outer loop and the
query blocks inside, so the paper's implementation runs one thread block per
(batch, head): with fewer batch*heads than the GPU has multiprocessors, SMs
sit idle.  FlashAttention-2 (``flash2``) swaps the loops and launches one
thread block per (batch, head, query block).  We time both over a grid of
batch*heads and sequence lengths at d = 64, float32, with the same tiles
(B_r, B_c) = (48, 48) (Algorithm 1's line 1 for 48 KiB and d = 64) and plot
achieved TFLOP/s against batch*heads with the SM count marked.

Our flash1 is also the *literal* kernel (scalar code, one thread per row),
so its absolute speed is far below flash2's for reasons beyond loop order;
the experiment's point is the *shape* of each curve: flash1 grows with
batch*heads until it reaches the SM count, flash2 is flat from far fewer.

    PYTHONPATH=$PWD python3 experiments/paper/loop_order.py [--quick]
"""
import argparse
import datetime
import os
import time

import numpy as np

import numba_flash
from numba_flash.tools.report import markdown_header, progress, pyplot, save_figure, write_csv
from numba_flash.tools.timing import time_ms

RESULTS = os.path.join(os.path.dirname(__file__), "results")
BLOCKS = (48, 48)
HEAD_DIM = 64
BATCH_HEADS = (1, 4, 16, 64, 132, 256)
LENGTHS = (256, 1024, 4096, 16384)
#: Skip a flash1 point predicted (from the same batch*heads at a quarter of
#: N: time grows as N^2) to take longer than this many seconds: the literal
#: kernel at N = 16384 would take minutes.
FLASH1_BUDGET_S = 2.0


def flops(bh, n, d):
    return 4.0 * n * n * d * bh  # two matrix products of N x N x d per head


def measure(algorithm, bh, n, d, repeats):
    from numba import cuda
    rng = np.random.default_rng(0)
    q, k, v = (cuda.to_device(rng.standard_normal((bh, n, d)).astype(np.float32)) for _ in range(3))
    run = lambda: numba_flash.attention(q, k, v, algorithm=algorithm, block_sizes=BLOCKS)  # noqa: E731
    numba_flash.attention(q[:, :1], k[:, :1], v[:, :1], algorithm=algorithm, block_sizes=BLOCKS)  # compile
    cuda.synchronize()
    start = time.perf_counter()
    run()
    cuda.synchronize()
    first = time.perf_counter() - start
    if first > FLASH1_BUDGET_S / 4:
        return first * 1e3, "single run"
    return time_ms(run, repeats=repeats, warmup=1), ""


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny grid (simulator pipeline check)")
    parser.add_argument("--from-log", metavar="LOG", help="rebuild the outputs from the rows a run printed")
    parser.add_argument("--note", default="", help="a sentence to add to the markdown (with --from-log)")
    parser.add_argument("--device", default=None, help="the device the logged run used (with --from-log)")
    args = parser.parse_args(argv)
    if args.from_log:
        import ast
        rows = [ast.literal_eval(line) for line in open(args.from_log) if line.startswith("{")]
        write(rows, os.path.join(RESULTS, "loop_order"), 132, False, args.note, args.device)
        return
    batch_heads, lengths, d, repeats = ((1, 2), (16, 32), 16, 1) if args.quick else (BATCH_HEADS, LENGTHS, HEAD_DIM, 5)
    sms = numba_flash.device_limits().multiprocessors
    rows = []
    for n in lengths:
        for bh in progress(batch_heads, f"N={n}"):
            for algorithm in ("flash1", "flash2"):
                smaller = next((r for r in rows if r["algorithm"] == algorithm and r["batch_heads"] == bh
                                and r["n"] == n // 4), None)
                if smaller is not None and smaller["ms"] * 16 > FLASH1_BUDGET_S * 1e3:
                    print(f"skip {algorithm} bh={bh} n={n}: predicted {smaller['ms'] * 16 / 1e3:.0f} s")
                    continue
                ms, note = measure(algorithm, bh, n, d, repeats)
                rows.append(dict(algorithm=algorithm, batch_heads=bh, n=n, d=d, ms=round(ms, 4),
                                 tflops=round(flops(bh, n, d) / (ms * 1e-3) / 1e12, 3), note=note))
                print(rows[-1], flush=True)
    stem = os.path.join(RESULTS, "loop_order" + ("_quick" if args.quick else ""))
    write(rows, stem, sms, args.quick)


def write(rows, stem, sms, quick, note="", device=None):
    os.makedirs(os.path.dirname(stem), exist_ok=True)
    device = device or numba_flash.device_limits().name
    command = "python3 experiments/paper/loop_order.py" + (" --quick" if quick else "")
    write_csv(stem + ".csv", rows)
    with open(stem + ".md", "w") as f:
        f.write(markdown_header("Loop order: flash1 (outer K/V) vs flash2 (outer Q)", command, f"{device} ({sms} SMs)")
                + f"d = {rows[0]['d']}, float32, tiles (B_r, B_c) = {BLOCKS}, median of CUDA-event timings.\n\n"
                + (f"{note}\n\n" if note else "") +
                "| N | batch*heads | flash1 ms | flash1 TFLOP/s | flash2 ms | flash2 TFLOP/s | flash2 speed-up |\n"
                "|---|---|---|---|---|---|---|\n")
        by_key = {(r["n"], r["batch_heads"], r["algorithm"]): r for r in rows}
        for n, bh in sorted({(r["n"], r["batch_heads"]) for r in rows}):
            r1, r2 = by_key.get((n, bh, "flash1")), by_key.get((n, bh, "flash2"))
            cells = [f"{r['ms']} | {r['tflops']}" if r else "not measured |" for r in (r1, r2)]
            ratio = f"{r1['ms'] / r2['ms']:.1f}x" if r1 and r2 else ""
            f.write(f"| {n} | {bh} | {cells[0]} | {cells[1]} | {ratio} |\n")
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, algorithm in zip(axes, ("flash1", "flash2")):
        for n in sorted({r["n"] for r in rows}):
            pts = sorted((r["batch_heads"], r["tflops"]) for r in rows if r["algorithm"] == algorithm and r["n"] == n)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"N = {n}")
        ax.axvline(sms, color="gray", linestyle="--", label=f"{sms} SMs")
        ax.set_xscale("log", base=2)
        if algorithm == "flash1":  # log-log: throughput proportional to batch*heads is a slope-1 line
            ax.set_yscale("log")
        ax.set_xlabel("batch x heads (thread blocks of flash1)")
        ax.set_ylabel("achieved TFLOP/s")
        ax.set_title(f"{algorithm}: {'outer K/V loop, 1 block per head' if algorithm == 'flash1' else 'outer Q loop, 1 block per query block'}",
                     fontsize=9)
        ax.legend(fontsize=8)
    fig.suptitle(f"Loop order at d = {rows[0]['d']}, float32, tiles {BLOCKS} ({device}, {datetime.date.today()})")
    print("wrote", stem + ".csv", stem + ".md", save_figure(fig, stem))


if __name__ == "__main__":
    main()
