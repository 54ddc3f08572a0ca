"""Choose flash2's tile shape (BLOCK_M, BLOCK_N) per head dim and dtype by measurement.

For each (dtype, d) every candidate tile shape that fits in shared memory
is compiled, checked against the torch-free float64 reference on a small
problem (a fast wrong kernel is no candidate), and timed on a large one
(median of CUDA-event timings).  The table it writes is what
``FORWARD_BLOCK_SIZES`` in ``numba_flash/tiling.py`` records; with
``--backward`` the same sweep times the backward (both of its kernels,
BLOCK_M = the tile a thread block owns, BLOCK_N = the tile it streams) for
``tiling.BACKWARD_BLOCK_SIZES``.  The sweep is non-causal at N = 4096;
``--backward --confirm`` times the cases it does not cover (causal calls, N = 8192,
an odd head dim) with their candidate tiles in interleaved rounds, so that slow
drift of the clock or the card's temperature cannot favour one tile.

    PYTHONPATH=$PWD python3 experiments/tuning/tune_flash2.py [--quick] [--backward [--confirm]]
"""
import argparse
import os

import numpy as np

import numba_flash
from numba_flash.tools.report import markdown_header, progress, write_csv
import reference
from numba_flash._validation import check_block_sizes
from numba_flash.kernels.fast.backward import make_dkdv, make_dq
from numba_flash.kernels.fast.forward import make_forward
from numba_flash.tiling import padded_head_dim, precision_of

RESULTS = os.path.join(os.path.dirname(__file__), "results")
#: Candidate tiles per dtype (BLOCK_M, BLOCK_N): a first sweep on the H200 over
#: BLOCK_M in {32, 64, 128} x BLOCK_N in {32, 64, 128} found BLOCK_M = 128
#: fastest by far (the K/V tile loads are shared by more rows), so the sweep
#: now centres there.
CANDIDATES = {"float32": [(64, 32), (128, 32), (128, 64), (256, 32)],
              "float16": [(64, 64), (128, 32), (128, 64), (128, 128), (256, 64)]}
#: The backward's candidates (both dtypes; multiples of 16): its shipped default
#: (64, 32) and the neighbours in each direction.
BACKWARD_CANDIDATES = [(64, 16), (64, 32), (64, 64), (128, 16), (128, 32), (128, 64)]
#: ``--confirm``: (dtype, (B, H, N, d), causal, candidate tiles) for the backward.
CONFIRM_CASES = [
    ("float32", (4, 16, 4096, 64), False, [(64, 32), (128, 32), (128, 64)]),
    ("float32", (4, 16, 4096, 64), True, [(64, 32), (128, 64)]),
    ("float16", (4, 16, 4096, 64), True, [(64, 32), (128, 32), (128, 64)]),
    ("float16", (4, 16, 4096, 96), False, [(64, 32), (128, 64)]),
    ("float16", (4, 16, 4096, 128), False, [(64, 32), (128, 64)]),
    ("float16", (2, 16, 8192, 128), False, [(64, 32), (128, 32), (128, 64)]),
    ("float16", (2, 16, 8192, 128), True, [(64, 32), (64, 64), (128, 32), (128, 64)]),
]
CONFIRM_ROUNDS = 5


def fits(block_m, block_n, d, dtype, backward=False):
    """Whether the library takes these tiles (its own check: shared memory, threads, multiples)."""
    try:
        check_block_sizes((block_m, block_n), "flash2", d, 4096, 4096, dtype, backward=backward)
    except ValueError:
        return False
    return True


def check(block_sizes, d, dtype, backward=False):
    """Largest error against float64 on a small causal problem (the output, or all three gradients)."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 300, d)).astype(dtype) for _ in range(3))
    if not backward:
        out = numba_flash.attention(q, k, v, causal=True, block_sizes=block_sizes)
        ref, _ = reference.attention(q, k, v, causal=True)
        return float(np.abs(out.astype(np.float64) - ref).max())
    o, lse = numba_flash.attention(q, k, v, causal=True, return_lse=True)
    do = rng.standard_normal(o.shape).astype(dtype)
    grads = numba_flash.attention_backward(q, k, v, o, lse, do, causal=True, block_sizes=block_sizes)
    want = reference.attention_backward(q, k, v, do, causal=True)
    return max(float(np.abs(g.astype(np.float64) - w).max() / np.abs(w).max()) for g, w in zip(grads, want))


def kernels(block_m, block_n, d, dtype, backward):
    """The dense non-causal kernel(s) a timed call launches, for their register and stack use."""
    flags = (padded_head_dim(d, precision_of(dtype)), precision_of(dtype), True, False, False, False)
    if backward:
        return [make_dkdv(block_m, block_n, *flags), make_dq(block_m, block_n, *flags)]
    return [make_forward(block_m, block_n, *flags)]


def resources(kernel_list):
    """Registers and stack bytes per thread of each kernel, joined by "/" (empty in the simulator)."""
    if numba_flash.in_simulator():
        return "", ""
    compiled = [kernel.compiled for kernel in kernel_list]
    return tuple("/".join(str(getattr(c, attribute)) for c in compiled)
                 for attribute in ("regs_per_thread", "local_mem_per_thread"))


def timed_call(q, k, v, do, block_sizes, backward, causal=False, forward=None):
    """The call the sweep times: the forward, or the backward from a fixed O, lse and dO (``forward``: the
    (O, lse) of q, k, v already computed, else computed here)."""
    if not backward:
        return lambda: numba_flash.attention(q, k, v, block_sizes=block_sizes)
    o, lse = forward or numba_flash.attention(q, k, v, causal=causal, return_lse=True)
    return lambda: numba_flash.attention_backward(q, k, v, o, lse, do, causal=causal, block_sizes=block_sizes)


def device_inputs(shape, dtype):
    """Random q, k, v and dO of ``shape``, on the device."""
    from numba import cuda

    rng = np.random.default_rng(1)
    return [cuda.to_device(rng.standard_normal(shape).astype(dtype)) for _ in range(4)]


def confirm(out, quick, dtypes=None, causal_only=False):
    """Interleaved rounds of the backward's candidate tiles in ``CONFIRM_CASES`` (those of ``dtypes``, causal
    ones only if asked), beside the default."""
    import statistics

    from numba_flash.tools.report import markdown_table, pyplot, save_figure
    from numba_flash.runtime.device import in_simulator
    from numba_flash.tiling import flash2_tuned_block_sizes
    from numba_flash.tools.timing import time_ms

    rows = []
    # --quick: the first two cases on tiny problems, in the simulator: the pipeline, not the timing.  Each
    # case times two of its tiles there: the default (when the case lists it) and the smallest other one
    # (every simulated thread is a Python thread: a tile of 128 rows is a block of 256 threads).
    chosen = [case for case in CONFIRM_CASES
              if (dtypes is None or case[0] in dtypes) and (case[2] or not causal_only)]
    for dtype, shape, causal, candidates in progress(chosen[:2] if quick else chosen, "backward cases"):
        if quick:
            shape = (1, 1, shape[2] // 128, shape[3] // 8)
        default = flash2_tuned_block_sizes(shape[3], precision_of(dtype), backward=True, causal=causal)
        if quick:
            others = sorted((tiles for tiles in candidates if tiles != default), key=lambda tiles: tiles[0] * tiles[1])
            candidates = [tiles for tiles in candidates if tiles == default or tiles == others[0]]
        q, k, v, do = device_inputs(shape, dtype)
        forward = numba_flash.attention(q, k, v, causal=causal, return_lse=True)   # O and lse: one per case
        calls = [timed_call(q, k, v, do, tiles, True, causal, forward) for tiles in candidates]
        samples = [[] for _ in candidates]
        for _ in range(1 if quick else CONFIRM_ROUNDS):
            for call, times in zip(calls, samples):
                times.append(time_ms(call, repeats=1, warmup=0) if quick else time_ms(call, repeats=8, warmup=1))
        for tiles, times in zip(candidates, samples):
            rows.append(dict(dtype=dtype, shape=str(shape).replace(" ", ""), causal=causal, block_m=tiles[0],
                             block_n=tiles[1], median_ms=round(statistics.median(times), 3),
                             min_ms=round(min(times), 3), default="yes" if tiles == default else ""))
        print(rows[-len(candidates):], flush=True)

    stem = os.path.join(out, "tune_flash2_backward_confirm" + ("_quick" if quick else ""))
    write_csv(stem + ".csv", rows)
    cases = list(dict.fromkeys((r["dtype"], r["shape"], r["causal"]) for r in rows))
    fastest = {case: min(float(r["median_ms"]) for r in rows if (r["dtype"], r["shape"], r["causal"]) == case)
               for case in cases}
    command = ("python3 experiments/tuning/tune_flash2.py --backward --confirm" + (" --quick" if quick else "")
               + (f" --dtypes {','.join(dtypes)}" if dtypes else "") + (" --causal-only" if causal_only else ""))
    with open(stem + ".md", "w") as f:
        f.write(markdown_header("flash2 backward: candidate tiles in interleaved rounds", command,
                                numba_flash.device_limits().name,
                                "simulator wall clock (not a measurement)" if in_simulator() else
                                f"CUDA events; per tile the median and minimum of {CONFIRM_ROUNDS} rounds, each "
                                "the median of 8 calls, tiles taking turns within a round"))
        f.write("\nShapes are (B, H, N, d); `default` marks what "
                "`tiling.flash2_tuned_block_sizes` picks for the case.\n\n" + markdown_table(rows))
    plt = pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(9, 4.5))
        for x, case in enumerate(cases):
            case_rows = [r for r in rows if (r["dtype"], r["shape"], r["causal"]) == case]
            width = 0.8 / len(case_rows)
            for i, r in enumerate(case_rows):
                bar_x = x - 0.4 + (i + 0.5) * width
                ax.bar(bar_x, float(r["median_ms"]) / fastest[case], width,
                       color="tab:orange" if r["default"] else "tab:blue", edgecolor="black", linewidth=0.5)
                ax.text(bar_x, 1.005, f"{r['block_m']}x{r['block_n']}", rotation=90, ha="center", va="bottom",
                        fontsize=7)
        ax.set_xticks(range(len(cases)),
                      [f"{dtype}\n{shape}" + ("\ncausal" if causal else "") for dtype, shape, causal in cases],
                      fontsize=7)
        ax.set_ylim(0.95, None)
        ax.set_ylabel("backward time / fastest tile of the case")
        ax.set_title(f"flash2 backward tiles (orange: the default), {numba_flash.device_limits().name}")
        save_figure(fig, stem)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small problem (pipeline check)")
    parser.add_argument("--dims", default="64,128")
    parser.add_argument("--dtypes", default="float32,float16")
    parser.add_argument("--backward", action="store_true", help="sweep the backward's tiles instead")
    parser.add_argument("--confirm", action="store_true",
                        help="with --backward: time CONFIRM_CASES (causal, N = 8192, odd d) in interleaved rounds")
    parser.add_argument("--causal-only", action="store_true", help="with --confirm: only the causal cases")
    parser.add_argument("--out", default=RESULTS, help="directory for the outputs")
    parser.add_argument("--from-log", metavar="LOG", help="rebuild the outputs from the rows a run printed")
    parser.add_argument("--device", default=None, help="the device the logged run used (with --from-log)")
    args = parser.parse_args(argv)
    if args.confirm and not args.backward:
        parser.error("--confirm times the backward's cases: give --backward too")
    os.makedirs(args.out, exist_ok=True)
    if args.confirm:
        confirm(args.out, args.quick, args.dtypes.split(","), args.causal_only)
        return
    direction = "backward" if args.backward else "forward"
    command = "python3 experiments/tuning/tune_flash2.py" + (" --backward" if args.backward else "")
    suffix = "_backward" if args.backward else ""
    if args.from_log:
        write(rows_from_log(args.from_log), args.out, command, "(4,16,4096,d)", suffix, direction, device=args.device,
              note="Rebuilt with --from-log from the rows printed by a run that its time limit cut short "
                   "(the remaining candidates were not measured).")
        return
    from numba_flash.tools.timing import time_ms

    rows = []
    for dtype in args.dtypes.split(","):
        for d in (int(x) for x in args.dims.split(",")):
            shape = (1, 2, 64, d) if args.quick else (4, 16, 4096, d)
            q, k, v, do = device_inputs(shape, dtype)
            candidates = BACKWARD_CANDIDATES if args.backward else CANDIDATES[dtype]
            for block_m, block_n in progress(candidates, f"{direction} {dtype} d={d}"):
                if not fits(block_m, block_n, d, dtype, args.backward) or (dtype == "float16" and block_n % 16):
                    continue
                err = check((block_m, block_n), d, dtype, args.backward)
                ms = time_ms(timed_call(q, k, v, do, (block_m, block_n), args.backward),
                             repeats=3 if args.quick else 10, warmup=1)
                regs, spill = resources(kernels(block_m, block_n, d, dtype, args.backward))
                # The backward does 2.5 forwards' worth of products (the convention of `numba-flash bench`).
                flops = (2.5 if args.backward else 1.0) * 4.0 * shape[0] * shape[1] * shape[2] ** 2 * d
                tflops = flops / (ms * 1e-3) / 1e12
                rows.append(dict(dtype=dtype, d=d, block_m=block_m, block_n=block_n, ms=round(ms, 4),
                                 tflops=round(tflops, 2), max_err=f"{err:.2e}", regs=regs, local_bytes=spill))
                print(rows[-1], flush=True)
    write(rows, args.out, command + (" --quick" if args.quick else ""),
          "(1,2,64,d)" if args.quick else "(4,16,4096,d)", suffix + ("_quick" if args.quick else ""), direction)


def write(rows, out, command, problem, suffix="", direction="forward", note="", device=None):
    """CSV and markdown of the sweep, with the fastest tile per (dtype, d)."""
    stem = os.path.join(out, "tune_flash2" + suffix)
    write_csv(stem + ".csv", rows)
    best = {}
    with open(stem + ".md", "w") as f:
        f.write(markdown_header(f"flash2 tile shapes ({direction})", command,
                                device or numba_flash.device_limits().name)
                + f"Problem: (B,H,N,d) = {problem}, non-causal; max_err is against float64 at (2,300,d) causal"
                + (" (of dQ, dK and dV, each relative to its largest entry)" if direction == "backward" else "")
                + ".\n"
                + (f"\n{note}\n" if note else "") + "\n")
        f.write("| dtype | d | BLOCK_M | BLOCK_N | ms | TFLOP/s | max err | regs | local bytes |\n"
                "|---|---|---|---|---|---|---|---|---|\n")
        for r in rows:
            f.write(f"| {r['dtype']} | {r['d']} | {r['block_m']} | {r['block_n']} | {r['ms']} | {r['tflops']} | "
                    f"{r['max_err']} | {r['regs']} | {r['local_bytes']} |\n")
            key = (r["dtype"], r["d"])
            if key not in best or float(r["ms"]) < float(best[key]["ms"]):
                best[key] = r
        f.write("\nFastest per (dtype, d): " + "; ".join(
            f"{k[0]} d={k[1]}: ({v['block_m']}, {v['block_n']}) {v['tflops']} TFLOP/s" for k, v in best.items()) + "\n")
    print("best:", {k: (v["block_m"], v["block_n"], v["tflops"]) for k, v in best.items()})


def rows_from_log(path):
    """The rows a run printed (one dict per line): rebuild outputs of a run cut short."""
    import ast
    return [ast.literal_eval(line) for line in open(path) if line.startswith("{")]

if __name__ == "__main__":
    main()
