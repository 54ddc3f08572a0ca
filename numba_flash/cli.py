"""The ``numba-flash`` command (also ``python -m numba_flash``)."""
import argparse
import sys

import numpy as np

from .masks import GENERATORS, save_picture
from .tools.bench import DEFAULT_DTYPES

DEMO_SHAPE_GPU = (4, 8, 1024, 64)   # (batch, heads, N, d)
DEMO_SHAPE_SIMULATOR = (1, 2, 32, 16)


def demo(args):
    from numba import cuda

    import reference

    from . import attention, device_limits, in_simulator
    from .tools.timing import time_ms

    simulated = in_simulator()
    shape = tuple(args.shape) if args.shape else (DEMO_SHAPE_SIMULATOR if simulated else DEMO_SHAPE_GPU)
    if simulated:
        print("No GPU: running in Numba's CUDA simulator with a tiny shape (times are not GPU times).")
    print(f"device: {device_limits().name}")
    b, h, n, d = shape
    print(f"problem: batch={b} heads={h} N={n} d={d} float32 causal={args.causal}")
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal(shape).astype(np.float32) for _ in range(3))
    ref, _ = reference.attention(q, k, v, causal=args.causal)
    dq, dk, dv = (cuda.to_device(x) for x in (q, k, v))
    repeats = 1 if simulated else 10
    print(f"{'algorithm':<10} {'max |O - O_ref|':>16} {'time (ms)':>10}")
    for algorithm in ALGORITHMS_IN_DEMO:
        out = attention(dq, dk, dv, causal=args.causal, algorithm=algorithm).copy_to_host()
        err = float(np.abs(out - ref).max())
        ms = time_ms(lambda: attention(dq, dk, dv, causal=args.causal, algorithm=algorithm),
                     repeats=repeats, warmup=0 if simulated else 2)
        print(f"{algorithm:<10} {err:>16.2e} {ms:>10.3f}")
    return 0


ALGORITHMS_IN_DEMO = ("standard", "flash1", "flash2")


def bench(args):
    from .tools.bench import main as bench_main

    return bench_main(args)


MASKS_DEFAULT_N = 512
MASKS_DEFAULT_BLOCK = 32


def masks(args):
    if args.list:
        for name, example in GENERATORS.items():
            print(f"{name:<11} {example.__doc__.splitlines()[0]}")
        return 0
    block_mask = GENERATORS[args.show](args.n, (args.block, args.block))
    t_r, t_c = block_mask.layout.shape
    print(f"{args.show}: N = {args.n}, {t_r} x {t_c} blocks of {args.block} x {args.block}, "
          f"density {block_mask.density:.3f} ('#' kept, '.' skipped)")
    for row in block_mask.layout:
        print(" ".join("#" if kept else "." for kept in row))  # spaced: terminal cells are twice as tall as wide
    if args.out:
        save_picture(block_mask, args.out, title=f"{args.show}, N = {args.n}")
        print("wrote", args.out)
    return 0


#: The two rooms of experiments/ in a source checkout: the paper's figures and claims, and the kernel probes.
EXPERIMENT_ROOMS = ("paper", "tuning")
#: Experiments the command runs: experiments/<room>/<name>.py (every script with a main(); ncu_case.py runs
#: under ncu by itself).
EXPERIMENTS = ("loop_order", "block_sparse", "io_traffic", "dram_traffic", "block_size_choice", "mask_gallery",
               "float32_accuracy", "train_gpt", "mods_gallery",
               "tune_flash2", "mma_throughput", "mma_accumulation", "host_profile", "causal_schedule",
               "decode_bandwidth", "decode_key_warps", "decode_splits", "decode_breakdown", "cp_async_stream",
               "ring_scaling", "wgmma_layouts", "wgmma_probe", "sass_counts", "decode_grid", "generate_bench",
               "wgmma_backward_bench", "wgmma_forward_kernels", "mods_bench", "bias_table_bench",
               "decode_host_split", "decode_mqa_tiles", "simulator_speed")
#: Those with a --quick mode (a tiny version the simulator can run).
QUICK_EXPERIMENTS = ("loop_order", "block_sparse", "io_traffic", "dram_traffic", "block_size_choice",
                     "mask_gallery", "train_gpt", "tune_flash2", "decode_bandwidth", "decode_key_warps",
                     "ring_scaling", "decode_grid", "generate_bench", "mods_gallery")


def experiment_path(name):
    """experiments/<room>/<name>.py of the source checkout, whichever room holds it (None if neither)."""
    import pathlib

    experiments = pathlib.Path(__file__).resolve().parent.parent / "experiments"
    return next((experiments / room / f"{name}.py" for room in EXPERIMENT_ROOMS
                 if (experiments / room / f"{name}.py").exists()), None)


def experiment(args):
    import importlib.util

    path = experiment_path(args.name)
    if path is None:
        print(f"experiments/{{{','.join(EXPERIMENT_ROOMS)}}}/{args.name}.py not found: the experiments live in the "
              "source checkout of numba-flash")
        return 2
    argv = (["--quick"] if args.quick else []) + args.options
    if "--quick" in argv and args.name not in QUICK_EXPERIMENTS:
        print(f"{args.name} has no --quick mode (those with one: {', '.join(QUICK_EXPERIMENTS)})")
        return 2
    # As if run from its folder: some import their neighbours (decode_key_warps from decode_breakdown), and
    # some parse sys.argv themselves (main() without arguments).
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [str(path)] + argv
    sys.path.insert(0, str(path.parent))
    try:
        spec = importlib.util.spec_from_file_location(f"experiments.{path.parent.name}.{args.name}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module.main(argv) if module.main.__code__.co_argcount else module.main()
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path


def main(argv=None):
    parser = argparse.ArgumentParser(prog="numba-flash", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("demo", help="run each algorithm once; print its error and time")
    p.add_argument("--shape", type=int, nargs=4, metavar=("B", "H", "N", "D"),
                   help=f"problem shape (default {DEMO_SHAPE_GPU} on a GPU, {DEMO_SHAPE_SIMULATOR} in the simulator)")
    p.add_argument("--causal", action="store_true", help="causal masking")
    p.set_defaults(run=demo)

    p = commands.add_parser("bench", help="time our kernels against torch's attention backends (GPU only)")
    p.add_argument("--shape", type=int, nargs=4, action="append", metavar=("B", "H", "N", "D"),
                   help="a problem shape; repeat for several (default: the four shapes of issue #3)")
    p.add_argument("--dtypes", default=DEFAULT_DTYPES, help="comma-separated: float32,float16,bfloat16")
    p.add_argument("--algorithms", default="flash2",
                   help="ours to time, comma-separated: flash2, flash1, standard, wgmma, mma (flash2 on mma.sync)")
    p.add_argument("--peers", default=None,
                   help="the peers to time beside ours, comma-separated (default all: torch-math, torch-efficient, "
                        "torch-flash, torch-cudnn, flex-attention); forward only")
    p.add_argument("--repeats", type=int, default=20, help="timed runs per case (median reported)")
    p.add_argument("--backward", action="store_true",
                   help="time the backward and forward + backward through autograd (default shapes: issue #5's)")
    p.add_argument("--sixteen-bit", action="store_true",
                   help="issue 15's 16-bit check in one process: the forward at its three shapes and forward + "
                        "backward at two, float16 and bfloat16, beside torch flash, cuDNN and FlexAttention")
    p.add_argument("--device-time", action="store_true",
                   help="time GPU work only: the stream is held while the host issues each call, so the events "
                        "bracket the kernels alone (what a profiler reports); default: the whole call")
    p.add_argument("--host", action="store_true",
                   help="time what a call costs the host: a loop of --calls calls, one synchronisation")
    p.add_argument("--calls", type=int, default=1000, help="calls in the --host loop")
    p.add_argument("--baseline", action="append", metavar="PACKAGE_DIR",
                   help="also time another copy of numba-flash (its package folder), in the same process; "
                        "repeat for several")
    p.add_argument("--out", default=None, help="folder for the CSV and markdown results")
    p.add_argument("--tag", default="bench", help="file name stem of the results")
    p.add_argument("--command", default=None, help="the command line to record in the results")
    p.set_defaults(run=bench)

    p = commands.add_parser("masks", help="show the block-sparsity patterns of numba_flash.masks")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--show", choices=list(GENERATORS), metavar="NAME",
                       help=f"print the layout of one example mask ({', '.join(GENERATORS)})")
    which.add_argument("--list", action="store_true", help="list the example masks")
    p.add_argument("--n", type=int, default=MASKS_DEFAULT_N, help="sequence length N (queries and keys)")
    p.add_argument("--block", type=int, default=MASKS_DEFAULT_BLOCK, help="block size B (blocks are B x B)")
    p.add_argument("--out", default=None, help="also save the layout as a PNG here (needs matplotlib)")
    p.set_defaults(run=masks)

    p = commands.add_parser("experiment", help="run one of the experiments, from experiments/paper/ (the paper's "
                            "figures and claims) or experiments/tuning/ (kernel probes and sweeps); each writes to "
                            "its room's results/",
                            description="Run experiments/paper/NAME.py (the paper's figures and claims, the "
                            "training run) or experiments/tuning/NAME.py (kernel probes and sweeps) from a source "
                            "checkout; results go to experiments/paper/results/ or experiments/tuning/results/.")
    p.add_argument("name", choices=EXPERIMENTS, metavar="NAME",
                   help="the script's name, from either room: " + ", ".join(EXPERIMENTS))
    p.add_argument("--quick", action="store_true",
                   help="a tiny version (runs in the simulator; checks the pipeline): "
                        + ", ".join(QUICK_EXPERIMENTS))
    p.add_argument("options", nargs=argparse.REMAINDER, help="further options for the experiment's own parser")
    p.set_defaults(run=experiment)
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except ImportError as error:   # an optional package missing: say which extra brings it (_optional.require)
        if "numba-flash[" not in str(error):
            raise
        print(f"numba-flash {args.command}: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
