"""Choose flash2's tile shape (BLOCK_M, BLOCK_N) per head dim and dtype by measurement.

For each (dtype, d) every candidate tile shape that fits in shared memory
is compiled, checked against the torch-free float64 reference on a small
problem (a fast wrong kernel is no candidate), and timed on a large one
(median of CUDA-event timings).  The table it writes is what
``DEFAULT_BLOCK_SIZES`` in ``numba_flash/kernels/flash2_forward.py`` records.

    PYTHONPATH=$PWD python3 experiments/tune_flash2.py [--quick]
"""
import argparse
import datetime
import os

import numpy as np

import numba_flash
from numba_flash._report import progress, write_csv
import reference
from numba_flash.kernels.flash2_forward import Flash2Layout, make_flash2_forward

RESULTS = os.path.join(os.path.dirname(__file__), "results")
#: Candidate tiles per dtype (BLOCK_M, BLOCK_N): a first sweep on the H200 over
#: BLOCK_M in {32, 64, 128} x BLOCK_N in {32, 64, 128} found BLOCK_M = 128
#: fastest by far (the K/V tile loads are shared by more rows), so the sweep
#: now centres there.
CANDIDATES = {"float32": [(64, 32), (128, 32), (128, 64), (256, 32)],
              "float16": [(64, 64), (128, 32), (128, 64), (128, 128), (256, 64)]}


def fits(block_m, block_n, d, dtype):
    layout = Flash2Layout(block_m, block_n, d, dtype == "float16")
    return layout.shared_bytes <= numba_flash.device_limits().shared_bytes_per_block_optin


def check(block_sizes, d, dtype):
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 300, d)).astype(dtype) for _ in range(3))
    out = numba_flash.attention(q, k, v, causal=True, block_sizes=block_sizes)
    ref, _ = reference.attention(q, k, v, causal=True)
    return float(np.abs(out.astype(np.float64) - ref).max())


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small problem (pipeline check)")
    parser.add_argument("--dims", default="64,128")
    parser.add_argument("--dtypes", default="float32,float16")
    parser.add_argument("--from-log", metavar="LOG", help="rebuild the outputs from the rows a run printed")
    parser.add_argument("--device", default=None, help="the device the logged run used (with --from-log)")
    args = parser.parse_args(argv)
    if args.from_log:
        write(rows_from_log(args.from_log), "python3 experiments/tune_flash2.py", "(4,16,4096,d)", device=args.device,
              note="Rebuilt with --from-log from the rows printed by a run that its time limit cut short "
                   "(the remaining candidates were not measured).")
        return
    from numba import cuda
    from numba_flash.timing import time_ms

    rows = []
    for dtype in args.dtypes.split(","):
        for d in (int(x) for x in args.dims.split(",")):
            shape = (1, 2, 64, d) if args.quick else (4, 16, 4096, d)
            rng = np.random.default_rng(1)
            q, k, v = (cuda.to_device(rng.standard_normal(shape).astype(dtype)) for _ in range(3))
            for block_m, block_n in progress(CANDIDATES[dtype], f"{dtype} d={d}"):
                if not fits(block_m, block_n, d, dtype) or (dtype == "float16" and block_n % 16):
                    continue
                err = check((block_m, block_n), d, dtype)
                ms = time_ms(lambda: numba_flash.attention(q, k, v, block_sizes=(block_m, block_n)),
                             repeats=3 if args.quick else 10, warmup=1)
                kernel = make_flash2_forward(block_m, block_n, d, False, dtype == "float16", True, False, False)
                overload = next(iter(kernel.overloads.values()), None)
                regs = getattr(overload, "regs_per_thread", "")
                spill = getattr(overload, "local_mem_per_thread", "")
                tflops = 4.0 * shape[0] * shape[1] * shape[2] ** 2 * d / (ms * 1e-3) / 1e12
                rows.append(dict(dtype=dtype, d=d, block_m=block_m, block_n=block_n, ms=round(ms, 4),
                                 tflops=round(tflops, 2), max_err=f"{err:.2e}", regs=regs, local_bytes=spill))
                print(rows[-1], flush=True)
    write(rows, "python3 experiments/tune_flash2.py" + (" --quick" if args.quick else ""),
          "(1,2,64,d)" if args.quick else "(4,16,4096,d)", "_quick" if args.quick else "")


def write(rows, command, problem, suffix="", note="", device=None):
    """CSV and markdown of the sweep, with the fastest tile per (dtype, d)."""
    os.makedirs(RESULTS, exist_ok=True)
    stem = os.path.join(RESULTS, "tune_flash2" + suffix)
    write_csv(stem + ".csv", rows)
    best = {}
    with open(stem + ".md", "w") as f:
        f.write(f"# flash2 tile shapes\n\nCommand: `{command}`  \n"
                f"Device: {device or numba_flash.device_limits().name}  \n"
                f"Date: {datetime.date.today()}  \n"
                f"Problem: (B,H,N,d) = {problem}, non-causal; max_err is against float64 at (2,300,d) causal.\n"
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
