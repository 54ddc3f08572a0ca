"""Choose flash2's tile shape (BLOCK_M, BLOCK_N) per head dim and dtype by measurement.

For each (dtype, d) every candidate tile shape that fits in shared memory
is compiled, checked against the torch-free float64 reference on a small
problem (a fast wrong kernel is no candidate), and timed on a large one
(median of CUDA-event timings).  The table it writes is what
``DEFAULT_BLOCK_SIZES`` in ``numba_flash/kernels/flash2_forward.py`` records;
with ``--backward`` the same sweep times the backward (both of its kernels,
BLOCK_M = the tile a thread block owns, BLOCK_N = the tile it streams) for
``flash2_backward.DEFAULT_BLOCK_SIZES``.

    PYTHONPATH=$PWD python3 experiments/tune_flash2.py [--quick] [--backward]
"""
import argparse
import datetime
import os

import numpy as np

import numba_flash
from numba_flash._report import progress, write_csv
import reference
from numba_flash.kernels.flash2_backward import BackwardLayout, make_flash2_backward_dkdv, make_flash2_backward_dq
from numba_flash.kernels.flash2_forward import Flash2Layout, make_flash2_forward

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


def fits(block_m, block_n, d, dtype, backward=False):
    layout = (BackwardLayout if backward else Flash2Layout)(block_m, block_n, d, dtype == "float16")
    return layout.shared_bytes <= numba_flash.device_limits().shared_bytes_per_block_optin


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
    is_f16 = dtype == "float16"
    if backward:
        return [make_flash2_backward_dkdv(block_m, block_n, d, False, is_f16, True, False, False),
                make_flash2_backward_dq(block_m, block_n, d, False, is_f16, True, False, False)]
    return [make_flash2_forward(block_m, block_n, d, False, is_f16, True, False, False)]


def resources(kernel_list):
    """Registers and stack bytes per thread of each kernel, joined by "/" (empty where not reported)."""
    # Launches above 48 KiB of shared memory compile a specialised copy of the dispatcher (see
    # kernels/_launch.py), so look there too.  (The simulator's kernels have neither.)
    copies = [[kernel, *getattr(kernel, "specializations", {}).values()] for kernel in kernel_list]
    overloads = [next((o for k in kernel_copies for o in getattr(k, "overloads", {}).values()), None)
                 for kernel_copies in copies]
    return tuple("/".join(str(getattr(o, attribute, "")) for o in overloads) if any(overloads) else ""
                 for attribute in ("regs_per_thread", "local_mem_per_thread"))


def timed_call(q, k, v, do, block_sizes, backward):
    """The call the sweep times: the forward, or the backward from a fixed O, lse and dO."""
    if not backward:
        return lambda: numba_flash.attention(q, k, v, block_sizes=block_sizes)
    o, lse = numba_flash.attention(q, k, v, return_lse=True)
    return lambda: numba_flash.attention_backward(q, k, v, o, lse, do, block_sizes=block_sizes)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small problem (pipeline check)")
    parser.add_argument("--dims", default="64,128")
    parser.add_argument("--dtypes", default="float32,float16")
    parser.add_argument("--backward", action="store_true", help="sweep the backward's tiles instead")
    parser.add_argument("--from-log", metavar="LOG", help="rebuild the outputs from the rows a run printed")
    parser.add_argument("--device", default=None, help="the device the logged run used (with --from-log)")
    args = parser.parse_args(argv)
    direction = "backward" if args.backward else "forward"
    command = "python3 experiments/tune_flash2.py" + (" --backward" if args.backward else "")
    suffix = "_backward" if args.backward else ""
    if args.from_log:
        write(rows_from_log(args.from_log), command, "(4,16,4096,d)", suffix, direction, device=args.device,
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
            q, k, v, do = (cuda.to_device(rng.standard_normal(shape).astype(dtype)) for _ in range(4))
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
    write(rows, command + (" --quick" if args.quick else ""),
          "(1,2,64,d)" if args.quick else "(4,16,4096,d)", suffix + ("_quick" if args.quick else ""), direction)


def write(rows, command, problem, suffix="", direction="forward", note="", device=None):
    """CSV and markdown of the sweep, with the fastest tile per (dtype, d)."""
    os.makedirs(RESULTS, exist_ok=True)
    stem = os.path.join(RESULTS, "tune_flash2" + suffix)
    write_csv(stem + ".csv", rows)
    best = {}
    with open(stem + ".md", "w") as f:
        f.write(f"# flash2 tile shapes ({direction})\n\nCommand: `{command}`  \n"
                f"Device: {device or numba_flash.device_limits().name}  \n"
                f"Date: {datetime.date.today()}  \n"
                f"Problem: (B,H,N,d) = {problem}, non-causal; max_err is against float64 at (2,300,d) causal"
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
