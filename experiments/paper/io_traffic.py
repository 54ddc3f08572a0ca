"""Device-memory traffic and memory of the three forward kernels, beside the paper's I/O results.

Traffic comes from ``numba_flash.io``: the exact bytes every load and store
of each kernel requests (checked access by access in ``tests/test_io.py``).
That is what the kernels ask of global memory; the paper's Fig. 2 reports
HBM (DRAM) bytes measured on an A100 for forward *and backward*, in float16,
and caches keep DRAM bytes at or below ours, so compare ratios and trends.

Four parts, each written to ``results/io_<part>{_quick}.{csv,md,png}``:

* ``gpt2``        Fig. 2 left: standard vs flash1 vs flash2 at the GPT-2
                  medium setting (N = 1024, d = 64, 16 heads, batch 64):
                  model GB, DRAM GB measured by ncu (read from
                  ``dram_traffic.py``'s results of the same setting), GFLOPs,
                  runtime, traffic relative to standard;
* ``block_size``  Fig. 2 middle: flash1's traffic (model) and runtime against
                  B_c, with B_r = 16 so that B_c reaches 64 within flash1's
                  48 KiB of shared memory (larger B_c: model only);
* ``scaling``     Theorem 2: traffic against N, and flash1's against the SRAM
                  budget M (tiles from Algorithm 1's line 1), on log-log
                  axes with fitted exponents;
* ``memory``      Table 21: device bytes one call allocates (model) against
                  N at batch 16, 8 heads, d = 64.

``--quick`` runs tiny problems, which the CUDA simulator times by the wall
clock (flagged in every output): a pipeline check, not a measurement.

    PYTHONPATH=$PWD python3 experiments/paper/io_traffic.py [--quick] [--out DIR] [--parts gpt2 memory ...]
"""
import argparse
import csv
import datetime
import math
import os
from dataclasses import dataclass

import numpy as np

import numba_flash
from numba_flash.tools.report import (markdown_header, markdown_table, progress, pyplot, save_figure, timer_note,
                                 write_csv)
from numba_flash import io
from numba_flash.kernels.literal.standard_attention import MATMUL_TILE
from numba_flash.tiling import flash1_shared_bytes, flash2_tuned_block_sizes, line1_block_sizes, precision_of
from numba_flash.tools.timing import time_ms

RESULTS = os.path.join(os.path.dirname(__file__), "results")
#: dram_traffic.py's Nsight Compute measurement of the GPT-2 setting (and others).
DRAM_RESULTS = os.path.join(RESULTS, "io_dram.csv")
PARTS = ("gpt2", "block_size", "scaling", "memory")
GB = 1e9
MB = 1e6


@dataclass(frozen=True)
class Setting:
    batch: int
    heads: int
    n: int
    d: int

    @property
    def batch_heads(self):
        return self.batch * self.heads

    def __str__(self):
        return f"N = {self.n}, d = {self.d}, {self.heads} heads, batch {self.batch}"

    @property
    def label(self):
        """How ``dram_traffic.py`` names the setting in its results."""
        return f"B={self.batch} H={self.heads} N={self.n} d={self.d}"


#: Fig. 2's setting (GPT-2 medium), and the simulator's stand-in.
GPT2 = Setting(batch=64, heads=16, n=1024, d=64)
GPT2_QUICK = Setting(batch=1, heads=2, n=16, d=8)
#: flash2's tiles in the simulator: 16 query rows (one warp), so it stays fast.
FLASH2_QUICK_TILES = (16, 16)

#: The paper's Fig. 2 left (A100, float16, forward + backward).
PAPER_GPT2 = {"standard": (40.3, 41.7, 66.6), "FlashAttention": (4.4, 7.3, 75.2)}  # GB, ms, GFLOPs
#: Fig. 2 middle (forward, read off the plot): B_c -> (GB, ms).
PAPER_BLOCK_SIZE = {64: (6.6, 8.6), 128: (3.4, 4.7), 256: (1.7, 3.3), 512: (0.9, 3.2)}
BLOCK_COLS = (16, 32, 64, 128, 256, 512)
BLOCK_COLS_QUICK = (4, 8, 16)
FLASH1_SWEEP_ROWS = 16
FLASH1_SWEEP_ROWS_QUICK = 4

#: Theorem 2's sweeps, per (batch, head).
LENGTHS = (256, 512, 1024, 2048, 4096, 8192, 16384)
LENGTHS_QUICK = (64, 128, 256, 512)
SRAM_KIB = (4, 8, 16, 32, 48, 64, 128, 256)
SRAM_KIB_QUICK = (4, 8, 16, 32)
SCALING_D = 64
SRAM_SWEEP_N = 4096
SRAM_SWEEP_N_QUICK = 512

#: Table 21 (no dropout or mask, batch 16, 8 heads, d = 64), MB; the notes give FlashAttention at 64K only.
MEMORY_SETTING = Setting(batch=16, heads=8, n=0, d=64)
MEMORY_LENGTHS = (512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)
PAPER_MEMORY = {"standard": {512: 336, 1024: 1184, 2048: 4416, 4096: 17024},
                "FlashAttention": {512: 104, 1024: 209, 2048: 418, 4096: 836, 65536: 13376}}


def variants(setting, quick):
    """(label, algorithm, dtype, block sizes) of each kernel at this setting, with its default tiles."""
    def flash2_tiles(dtype):
        return FLASH2_QUICK_TILES if quick else flash2_tuned_block_sizes(setting.d, precision_of(dtype))

    return [
        ("standard", "standard", np.float32, None),
        ("flash1", "flash1", np.float32, line1_block_sizes(setting.d, n_q=setting.n, n_k=setting.n)),
        ("flash2 float32", "flash2", np.float32, flash2_tiles(np.float32)),
        ("flash2 float16", "flash2", np.float16, flash2_tiles(np.float16)),
    ]


def forward_flops(setting):
    return 4.0 * setting.n ** 2 * setting.d * setting.batch_heads  # Q K^T and P V, 2 N^2 d each per head


def runtime_ms(setting, algorithm, dtype, block_sizes, quick):
    """Median time of one attention call on device arrays (simulator: one run, wall clock)."""
    from numba import cuda
    rng = np.random.default_rng(0)
    q, k, v = (cuda.to_device(rng.standard_normal((setting.batch_heads, setting.n, setting.d)).astype(dtype))
               for _ in range(3))

    def run():
        numba_flash.attention(q, k, v, algorithm=algorithm, block_sizes=block_sizes)

    return time_ms(run, repeats=1, warmup=0) if quick else time_ms(run, repeats=5, warmup=1)


def measured_dram_gb(setting):
    """ncu's DRAM GB (read + written) per kernel ("flash2 float16", ...) at ``setting``, from the
    results of ``dram_traffic.py`` (the profiler runs there, one call per kernel); {} if none."""
    if not os.path.exists(DRAM_RESULTS):
        return {}
    with open(DRAM_RESULTS) as f:
        return {row["kernel"]: float(row["dram_read_GB"]) + float(row["dram_write_GB"])
                for row in csv.DictReader(f) if row["setting"] == setting.label}


def tiles(block_sizes):
    return "" if block_sizes is None else f"{block_sizes[0]}x{block_sizes[1]}"


def gpt2(quick):
    setting = GPT2_QUICK if quick else GPT2
    rows = []
    dram = measured_dram_gb(setting)
    for label, algorithm, dtype, block_sizes in variants(setting, quick):
        traffic = io.attention_traffic(algorithm, setting.batch_heads, setting.n, setting.n, setting.d,
                                       block_sizes=block_sizes, dtype=dtype)
        ms = runtime_ms(setting, algorithm, dtype, block_sizes, quick)
        rows.append(dict(kernel=label, tiles=tiles(block_sizes), read_GB=traffic.read_bytes / GB,
                         write_GB=traffic.write_bytes / GB, total_GB=traffic.total_bytes / GB,
                         dram_GB_ncu=dram.get(f"{algorithm} {np.dtype(dtype).name}", math.nan),
                         gflop=forward_flops(setting) / 1e9, ms=ms,
                         tflops=forward_flops(setting) / (ms * 1e-3) / 1e12))
    for row in rows:
        row["standard_over_this"] = rows[0]["total_GB"] / row["total_GB"]
        row["standard_over_this_dram"] = rows[0]["dram_GB_ncu"] / row["dram_GB_ncu"]
    measured = ("DRAM GB (ncu): Nsight Compute's dram__bytes_read.sum + dram__bytes_write.sum for the same call "
                "(`experiments/paper/dram_traffic.py --settings gpt2`, results/io_dram.md; caches flushed before each "
                "kernel); standard moves "
                + ", ".join(f"{row['standard_over_this_dram']:.1f}x {row['kernel']}'s" for row in rows[1:])
                + " DRAM bytes." if dram else
                "DRAM GB (ncu): not measured for this setting (`experiments/paper/dram_traffic.py` measures it).")
    paper_ratio = PAPER_GPT2["standard"][0] / PAPER_GPT2["FlashAttention"][0]
    notes = (f"Setting: {setting}, forward only, causal off; GFLOP = 4 N^2 d x batch x heads "
             f"(the two products; the softmax's exponentials are not counted).\n\n"
             f"Paper (Fig. 2 left, A100, float16, forward + backward, HBM reads + writes): standard "
             f"{PAPER_GPT2['standard'][0]} GB, {PAPER_GPT2['standard'][1]} ms, {PAPER_GPT2['standard'][2]} GFLOPs; "
             f"FlashAttention {PAPER_GPT2['FlashAttention'][0]} GB, {PAPER_GPT2['FlashAttention'][1]} ms, "
             f"{PAPER_GPT2['FlashAttention'][2]} GFLOPs: {paper_ratio:.1f}x fewer HBM bytes.  "
             f"Here (forward, bytes requested): standard moves "
             + ", ".join(f"{row['standard_over_this']:.1f}x {row['kernel']}'s" for row in rows[1:]) + " traffic.  "
             + measured + "\n\n"
             f"Our standard kernel's tiled matmul reads Q and K once per {MATMUL_TILE} x {MATMUL_TILE} tile of "
             f"S and P d/{MATMUL_TILE} times, and its softmax reads S three times, so its requests are several "
             f"times the paper's ~4 N^2 (caches serve many of them on a GPU).  The paper's GFLOPs are below "
             f"4 N^2 d x batch x heads = {forward_flops(GPT2) / 1e9:.0f} GFLOP, the forward alone at its setting.")
    return rows, "Fig. 2 left: traffic, FLOPs and runtime at the GPT-2 medium setting", notes, plot_gpt2


def plot_gpt2(rows, plt):
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    labels = [row["kernel"] for row in rows]
    x = np.arange(len(rows))
    axes[0].bar(x - 0.2, [row["total_GB"] for row in rows], 0.4, color="tab:blue", label="model (requested)")
    axes[0].bar(x + 0.2, [row["dram_GB_ncu"] for row in rows], 0.4, color="tab:green", label="DRAM (ncu)")
    axes[0].set_xticks(x, labels)
    axes[0].set_yscale("log")
    axes[0].set_ylabel("bytes read + written per call (GB)")
    axes[0].set_title("traffic (forward)")
    axes[0].legend(fontsize=8)
    axes[1].bar(labels, [row["ms"] for row in rows], color="tab:orange")
    axes[1].set_yscale("log")
    axes[1].set_ylabel("runtime per call (ms)")
    axes[1].set_title("runtime (forward)")
    for ax in axes:
        ax.tick_params(axis="x", labelsize=8)
    return fig


def block_size(quick):
    setting = GPT2_QUICK if quick else GPT2
    block_rows = FLASH1_SWEEP_ROWS_QUICK if quick else FLASH1_SWEEP_ROWS
    limit = numba_flash.device_limits().shared_bytes_per_block
    rows = []
    for block_cols in (BLOCK_COLS_QUICK if quick else BLOCK_COLS):
        block_sizes = (block_rows, block_cols)
        traffic = io.flash1_traffic(setting.batch_heads, setting.n, setting.n, setting.d, block_sizes)
        shared = flash1_shared_bytes(block_rows, block_cols, setting.d)
        paper_gb, paper_ms = PAPER_BLOCK_SIZE.get(block_cols, ("", ""))
        rows.append(dict(block_cols=block_cols, block_rows=block_rows, shared_KiB=shared / 1024,
                         fits=shared <= limit, total_GB=traffic.total_bytes / GB,
                         ms=runtime_ms(setting, "flash1", np.float32, block_sizes, quick) if shared <= limit else "",
                         paper_GB=paper_gb, paper_ms=paper_ms))
    notes = (f"Setting: {setting}, float32, flash1 forward with B_r = {block_rows}; B_c whose tiles exceed the "
             f"{limit // 1024} KiB of static shared memory (fits = False) are model only.  Paper (Fig. 2 middle, "
             f"A100, float16, read off the plot): traffic halves as B_c doubles, runtime stops falling once "
             f"arithmetic dominates.  Our flash1 makes T_c = N / B_c passes over Q, O, l and m, so its traffic "
             f"nearly halves too.")
    return rows, "Fig. 2 middle: flash1 traffic and runtime against the key block size B_c", notes, plot_block_size


def plot_block_size(rows, plt):
    fig, ax = plt.subplots(figsize=(6.5, 4))
    cols = [row["block_cols"] for row in rows]
    ax.plot(cols, [row["total_GB"] for row in rows], marker="o", color="tab:blue", label="traffic (model)")
    paper = [(row["block_cols"], row["paper_GB"]) for row in rows if row["paper_GB"] != ""]
    if paper:
        ax.plot(*zip(*paper), marker="s", linestyle=":", color="tab:blue", fillstyle="none", label="paper's HBM GB")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("key block size B_c")
    ax.set_ylabel("read + written (GB)")
    timed = [(row["block_cols"], row["ms"]) for row in rows if row["ms"] != ""]
    right = ax.twinx()
    if timed:
        right.plot(*zip(*timed), marker="^", color="tab:orange", label="runtime (measured)")
    right.set_ylabel("runtime per call (ms)")
    handles = ax.get_legend_handles_labels()[0] + right.get_legend_handles_labels()[0]
    ax.legend(handles=handles, fontsize=8)
    return fig


def fitted_exponent(xs, ys):
    """Slope of log y against log x over the upper half of the range, where leading terms dominate."""
    half = len(xs) // 2
    return float(np.polyfit(np.log(xs[half:]), np.log(ys[half:]), 1)[0])


def scaling(quick):
    d = SCALING_D
    lengths = LENGTHS_QUICK if quick else LENGTHS
    rows = []
    for n in lengths:
        setting = Setting(batch=1, heads=1, n=n, d=d)
        for label, algorithm, dtype, block_sizes in variants(setting, quick=False):
            traffic = io.attention_traffic(algorithm, 1, n, n, d, block_sizes=block_sizes, dtype=dtype)
            rows.append(dict(sweep="N", kernel=label, n=n, sram_KiB="", tiles=tiles(block_sizes),
                             total_bytes=traffic.total_bytes))
    n = SRAM_SWEEP_N_QUICK if quick else SRAM_SWEEP_N
    for kib in (SRAM_KIB_QUICK if quick else SRAM_KIB):
        block_sizes = line1_block_sizes(d, sram_bytes=kib * 1024, n_q=n, n_k=n)
        rows.append(dict(sweep="M", kernel="flash1", n=n, sram_KiB=kib, tiles=tiles(block_sizes),
                         total_bytes=io.flash1_traffic(1, n, n, d, block_sizes).total_bytes))
    fits = []
    for label in dict.fromkeys(row["kernel"] for row in rows if row["sweep"] == "N"):
        points = [(row["n"], row["total_bytes"]) for row in rows if row["sweep"] == "N" and row["kernel"] == label]
        fits.append(("N", label, fitted_exponent(*map(np.array, zip(*points))), 2))
    points = [(row["sram_KiB"], row["total_bytes"]) for row in rows if row["sweep"] == "M"]
    fits.append(("M", "flash1", fitted_exponent(*map(np.array, zip(*points))), -1))
    notes = (f"Per (batch, head), d = {d}, float32 unless named; flash1 tiles from Algorithm 1's line 1 for "
             f"48 KiB (against N) or for each SRAM budget M (against M, at N = {n}; M above 48 KiB is model only: "
             f"flash1's static shared memory stops there); flash2 with its default tiles.  Exponents are "
             f"least-squares slopes on log-log axes over the upper half of each range.\n\n"
             "| against | kernel | fitted exponent | Theorem 2 |\n|---|---|---|---|\n"
             + "".join(f"| {sweep} | {label} | {slope:.3f} | {expected} |\n" for sweep, label, slope, expected in fits)
             + "\nTheorem 2: standard Theta(N d + N^2), FlashAttention Theta(N^2 d^2 / M).  flash2's tiles are "
             "fixed, so it too is quadratic in N: it reads K and V once per query tile, N^2 d / B_r.")
    return rows, "Theorem 2: traffic against N and against the SRAM size M", notes, plot_scaling


def plot_scaling(rows, plt):
    def matched(curve, model):
        """A leading term without constants, scaled to meet the model at the last point."""
        curve = np.asarray(curve, dtype=np.float64)  # int64 products of N^2 and bytes overflow
        return curve * (float(model[-1]) / curve[-1])

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    by_n = [row for row in rows if row["sweep"] == "N"]
    by_kernel = {}
    for row in by_n:
        by_kernel.setdefault(row["kernel"], []).append((row["n"], row["total_bytes"]))
    for label, points in by_kernel.items():
        xs, ys = map(np.array, zip(*points))
        axes[0].plot(xs, ys, marker="o", label=f"{label} (slope {fitted_exponent(xs, ys):.2f})")
    xs = np.array([n for n, _ in by_kernel["standard"]])
    axes[0].plot(xs, matched(io.theorem2_standard(xs, SCALING_D), [t for _, t in by_kernel["standard"]]),
                 "k--", linewidth=0.8, label="Theorem 2: N d + N^2 (scaled)")
    line1_sram = 48 * 1024 / 4  # elements: the budget flash1's tiles come from
    axes[0].plot(xs, matched(io.theorem2_flash(xs, SCALING_D, line1_sram), [t for _, t in by_kernel["flash1"]]),
                 "k:", linewidth=0.8, label="Theorem 2: N^2 d^2 / M (scaled)")
    axes[0].set_xlabel("sequence length N")
    axes[0].set_ylabel("bytes read + written per head (model)")
    axes[0].set_title(f"against N (d = {SCALING_D})", fontsize=9)
    by_m = [row for row in rows if row["sweep"] == "M"]
    kib, traffic = map(np.array, zip(*[(row["sram_KiB"], row["total_bytes"]) for row in by_m]))
    n = by_m[0]["n"]
    axes[1].plot(kib, traffic, marker="o", label=f"flash1, line-1 tiles (slope {fitted_exponent(kib, traffic):.2f})")
    axes[1].plot(kib, matched(io.theorem2_flash(n, SCALING_D, kib * 1024 / 4), traffic), "k:", linewidth=0.8,
                 label="Theorem 2: N^2 d^2 / M (scaled)")
    axes[1].axvline(48, color="gray", linestyle="--", linewidth=0.8, label="48 KiB: flash1's limit")
    axes[1].set_xlabel("SRAM budget M (KiB)")
    axes[1].set_ylabel("bytes read + written per head (model)")
    axes[1].set_title(f"flash1 against M (N = {n}, d = {SCALING_D})", fontsize=9)
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.legend(fontsize=7)
    return fig


def memory(quick):
    s = MEMORY_SETTING
    rows = []
    for n in MEMORY_LENGTHS:
        for label, algorithm, dtype, block_sizes in variants(Setting(s.batch, s.heads, n, s.d), quick):
            total = sum(io.device_allocations(algorithm, s.batch_heads, n, n, s.d, dtype=dtype).values())
            paper = PAPER_MEMORY["standard" if algorithm == "standard" else "FlashAttention"].get(n, "")
            rows.append(dict(n=n, kernel=label, MB=total / MB, bytes_per_token=total / (s.batch * n),
                             paper_MB=paper))
    per_token = {row["kernel"]: row["bytes_per_token"] for row in rows if row["n"] == MEMORY_LENGTHS[-1]}
    flash_kernels = list(per_token)[1:]  # all but standard (listed first), whose bytes per token grow with N
    notes = (f"Batch {s.batch}, {s.heads} heads, d = {s.d}: the device buffers one call with host inputs "
             f"allocates (q, k, v, o, lse; S and P for standard; l and m for flash1), all alive until it "
             f"returns, so their sum is its peak.  MB = 10^6 bytes.  Paper (Table 21, A100, same batch, heads and "
             f"d): FlashAttention's memory is linear in N, up to 20x below standard's.  Ours: "
             + ", ".join(f"{label} {per_token[label]:.0f} bytes per token" for label in flash_kernels)
             + f" (a token is one position of one sequence, over {s.heads} heads); standard adds "
             f"{2 * 4 * s.heads} N bytes per token for S and P.")
    return rows, "Table 21: device memory one forward call allocates", notes, plot_memory


def plot_memory(rows, plt):
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for label in dict.fromkeys(row["kernel"] for row in rows):
        points = [(row["n"], row["MB"]) for row in rows if row["kernel"] == label]
        ax.plot(*zip(*points), marker="o", linestyle="--" if label == "flash1" else "-", label=f"{label} (model)")
    for paper_label, values in PAPER_MEMORY.items():
        ax.plot(list(values), list(values.values()), marker="s", linestyle="none", fillstyle="none",
                label=f"paper: {paper_label}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length N")
    ax.set_ylabel("device memory per call (MB)")
    ax.legend(fontsize=8)
    return fig


#: Parts computed from the model alone: no kernel runs, so no device or timer applies.
MODEL_ONLY = ("scaling", "memory")


def write(out_dir, part, quick, command, rows, title, notes, plot):
    os.makedirs(out_dir, exist_ok=True)
    stem = os.path.join(out_dir, f"io_{part}" + ("_quick" if quick else ""))
    if part in MODEL_ONLY:
        device = "none: the traffic and allocation model of numba_flash/tools/io.py (checked in tests/test_io.py)"
        timer = "none (no kernel runs)"
    else:
        device = numba_flash.device_limits().name
        timer = timer_note(5)
    date = datetime.date.today()
    write_csv(stem + ".csv", rows)

    def cell(value):
        return f"{value:.4g}" if isinstance(value, float) else str(value)

    with open(stem + ".md", "w") as f:
        f.write(markdown_header(title, command, device, timer) + f"\n{notes}\n\n" + markdown_table(rows, cell))
    written = [stem + ".csv", stem + ".md"]
    plt = pyplot()
    if plt is not None:
        fig = plot(rows, plt)
        source = "model" if part in MODEL_ONLY else device
        fig.suptitle(f"{title}\n{source}, {date}" + (", simulator (quick)" if quick else ""), fontsize=9)
        written.append(save_figure(fig, stem))
    print("wrote", *written)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny problems (a simulator pipeline check)")
    parser.add_argument("--out", default=RESULTS, help="directory for the outputs (default: experiments/paper/results)")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS), help="which parts to run")
    args = parser.parse_args(argv)
    command = "python3 experiments/paper/io_traffic.py" + (" --quick" if args.quick else "") + (
        f" --parts {' '.join(args.parts)}" if args.parts != list(PARTS) else "")
    experiments = {"gpt2": gpt2, "block_size": block_size, "scaling": scaling, "memory": memory}
    for part in progress(args.parts, "parts"):
        write(args.out, part, args.quick, command, *experiments[part](args.quick))


if __name__ == "__main__":
    main()
