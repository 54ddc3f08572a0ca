"""Where one decoding step's GPU time goes: the whole call with the lengths on the host and on the GPU, and the
forward kernel alone, beside torch's cuDNN and flash backends (GPU time, four sets of q and caches read in turn,
all in one process).

    PYTHONPATH=$PWD python3 experiments/tuning/decode_breakdown.py [--case B,H_q,H_kv,N] [--baseline DIR] [--out FILE]
    PYTHONPATH=$PWD python3 experiments/tuning/decode_breakdown.py --lengths 2048,8192,32768 [--baseline DIR]
    ncu --clock-control none --profile-from-start off ... python3 experiments/tuning/decode_breakdown.py --profile

The call with lengths on the host copies them to the GPU (a host-to-device copy in the timed region); with
lengths on the GPU (a torch int32 tensor, as a generation loop keeps them) the call launches no copy.  "forward
kernel alone" launches the call's own plan with its key bounds prepared beforehand: the kernels' share of the
step.  ``--profile`` runs one step of each (cuDNN, flash, ours with GPU lengths) between
``cudaProfilerStart`` and ``cudaProfilerStop``, after a warm-up, for ncu's ``--profile-from-start off``.
``--lengths``: the step at several cache lengths (the case's N unused) and a line through the times: its slope
is the rate at which K and V stream, its intercept the fixed cost of a call.
Default case: issue 16's (16, 32, 8, 8192), d = 128, float16.
"""
import argparse

import numpy as np
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention as sdpa

import numba_flash
from numba_flash.tools.bench import load_baseline
from numba_flash.tools.timing import time_ms

SETS = 4
D = 128


def make_sets(b, h, hk, n):
    """SETS sets of q (b, h, 1, D) and caches (b, hk, n, D), float16, to be read in turn."""
    g = torch.Generator(device="cuda").manual_seed(0)
    return [{name: torch.randn(bb, heads, rows, D, device="cuda", dtype=torch.float16, generator=g)
             for name, bb, heads, rows in (("q", b, h, 1), ("k", b, hk, n), ("v", b, hk, n))} for _ in range(SETS)]


def peer(backend):
    """A decoding step of torch's SDPA with ``backend`` on a set (grouped heads)."""
    def call(x):
        with sdpa_kernel(backend):
            return sdpa(x["q"], x["k"], x["v"], enable_gqa=True)
    return call


def rotating_timer(sets, repeats):
    """timed(call): GPU time of ``call(set)``, median of ``repeats``, each sample on the next set in turn."""
    turn = [0]

    def advance():
        turn[0] += 1

    def timed(call):
        return time_ms(lambda: call(sets[turn[0] % len(sets)]), repeats=repeats, warmup=3, device_only=True,
                       setup=advance)

    return timed


def steps(package, b, n):
    """(label, call) of one decoding step of ``package``: lengths on the host, on the GPU."""
    host = np.full(b, n, np.int32)
    device = torch.full((b,), n, dtype=torch.int32, device="cuda")
    return [("lengths on the host", lambda x: package.attention_with_kv_cache(x["q"], x["k"], x["v"], host)),
            ("lengths on the GPU", lambda x: package.attention_with_kv_cache(x["q"], x["k"], x["v"], device))]


def forward_alone(package, sets, b, n):
    """A call of the plan's forward launch alone on set x (its key bounds, o and lse made beforehand), or None
    where the plan splits the keys (then the launch needs partial results and a merge)."""
    api = package.api
    package.attention_with_kv_cache(sets[0]["q"], sets[0]["k"], sets[0]["v"], np.full(b, n, np.int32))
    plan = next(p for p in reversed(list(api._PLANS.values())) if type(p).__name__ == "_CachePlan")
    if plan.splits > 1:
        return None
    o = torch.empty_like(sets[0]["q"])
    lse = torch.empty(sets[0]["q"].shape[:-1], dtype=torch.float32, device="cuda")
    stream = torch.cuda.current_stream().cuda_stream
    if hasattr(plan, "q_bounds"):   # packages before 2026-12-03 (session 20): (0, L_b) key bounds pairs
        bounds = np.zeros(2 * b, np.int32)
        bounds[1::2] = n
        bounds = (plan.q_bounds, torch.from_numpy(bounds).cuda())
    else:                           # the forward reads cache_seqlens itself
        bounds = (torch.full((b,), n, dtype=torch.int32, device="cuda"),)
    return lambda x: plan.launch(stream, x["q"], x["k"], x["v"], o, lse, *bounds, 0, 0)


def fixed_and_streaming(b, h, hk, lengths, packages, repeats):
    """Lines of a table: cuDNN and each package's decoding step (lengths on the GPU) at each cache length, best
    of three passes, and a least-squares line through them: its slope is the streaming rate, its intercept
    the cost every call pays whatever it reads (launch, prologue, epilogue)."""
    rows, lines = [], ["| N | MB of K, V | torch cuDNN | " + " | ".join(name for name, _ in packages) + " |",
                       "|---|---|---|" + "---|" * len(packages)]
    for n in lengths:
        sets = make_sets(b, h, hk, n)
        timed = rotating_timer(sets, repeats)
        calls = [("torch cuDNN", peer(SDPBackend.CUDNN_ATTENTION))] + [
            (name, dict(steps(package, b, n))["lengths on the GPU"]) for name, package in packages]
        best = {name: min(timed(call) for _ in range(3)) for name, call in calls}
        megabytes = 2 * b * hk * n * D * 2 / 1e6
        rows.append((megabytes, best))
        lines.append(f"| {n} | {megabytes:.0f} | " + " | ".join(f"{ms:.4f}" for ms in best.values()) + " |")
        print(lines[-1], flush=True)
        del sets
        torch.cuda.empty_cache()
    for name in rows[0][1]:
        slope, intercept = np.polyfit([mb for mb, _ in rows], [best[name] for _, best in rows], 1)
        lines.append(f"{name}: {slope * 1e3:.4f} us per MB ({1 / slope:.0f} GB/s), fixed {intercept * 1e3:.2f} us")
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", default="16,32,8,8192", help="B,H_q,H_kv,N (d = 128)")
    parser.add_argument("--baseline", default=None, help="another copy of the package, timed beside this one")
    parser.add_argument("--profile", action="store_true", help="one step of each between profiler start and stop")
    parser.add_argument("--out", default=None, help="markdown file for the table")
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--lengths", default=None,
                        help="N,N,...: time the case's B, H_q, H_kv at these cache lengths and fit fixed + streaming")
    args = parser.parse_args()
    b, h, hk, n = map(int, args.case.split(","))
    packages = [("this tree", numba_flash)]
    if args.baseline:
        base = load_baseline(args.baseline)
        packages.append((base.label, base))
    if args.lengths:
        text = "\n".join(fixed_and_streaming(b, h, hk, [int(x) for x in args.lengths.split(",")], packages,
                                             args.repeats))
        print(text)
        if args.out:
            with open(args.out, "w") as f:
                f.write(text + "\n")
        return
    sets = make_sets(b, h, hk, n)
    peers = [("torch cuDNN", peer(SDPBackend.CUDNN_ATTENTION)), ("torch flash", peer(SDPBackend.FLASH_ATTENTION))]
    ours = [(f"{name}: {label}", call) for name, package in packages for label, call in steps(package, b, n)]

    if args.profile:
        calls = peers + ours[1:2]
        for _, call in calls:   # compile and warm up outside the profiled range
            call(sets[0])
            call(sets[1])
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        for index, (_, call) in enumerate(calls):
            call(sets[2 + index % 2])
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
        return

    timed = rotating_timer(sets, args.repeats)
    rows = [(name, timed(call)) for name, call in peers]
    for name, package in packages:
        for label, call in steps(package, b, n):
            rows.append((f"{name}: {label}", timed(call)))
            print(rows[-1], flush=True)
        alone = forward_alone(package, sets, b, n)
        if alone is not None:
            rows.append((f"{name}: forward kernel alone", timed(alone)))
            print(rows[-1], flush=True)
    rows += [(name + " (again)", timed(call)) for name, call in peers]
    fastest = min(ms for name, ms in rows if name.startswith("torch"))
    lines = [f"Case (B, H_q, H_kv, N_q, N, d) = ({b}, {h}, {hk}, 1, {n}, {D}) float16; GPU time, median of "
             f"{args.repeats}, {SETS} caches in turn.", "", "| what | ms | fastest torch / this |", "|---|---|---|"]
    lines += [f"| {name} | {ms:.4f} | {fastest / ms:.2f}x |" for name, ms in rows]
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
