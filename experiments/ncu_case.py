"""One flash2 (or wgmma) forward on random inputs, for profiling with ncu.

    ncu --clock-control none --kernel-name regex:flash2 --launch-skip 1 --launch-count 1 \\
        --section SpeedOfLight --section Occupancy --section WarpStateStats \\
        python3 experiments/ncu_case.py B H N D [--dtype float16] [--causal] [--package DIR] [--wgmma]

The first call compiles (and is skipped by --launch-skip 1); ncu profiles the second.  ``--package``
profiles another copy of numba-flash instead (a package folder, as ``numba-flash bench --baseline``
takes), so that two versions of a kernel can be profiled on the same inputs.  ``--wgmma`` asks for
the Hopper forward (``algorithm="wgmma"``; kernel names start with ``wgmma``), which flash2 picks by
itself on a Hopper GPU in its scope.
"""
import argparse

import numpy as np
from numba import cuda

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("shape", nargs=4, type=int, metavar="B H N D")
parser.add_argument("--dtype", default="float32", choices=("float32", "float16"))
parser.add_argument("--causal", action="store_true")
parser.add_argument("--package", default=None, help="a numba-flash package folder to profile instead")
parser.add_argument("--wgmma", action="store_true", help="the Hopper forward (16-bit, d 64 or 128)")
args = parser.parse_args()
if args.package:
    from numba_flash.tools.bench import load_baseline
    forward = load_baseline(args.package).attention
else:
    from numba_flash import attention as forward
rng = np.random.default_rng(0)
q, k, v = (cuda.to_device(rng.standard_normal(args.shape).astype(args.dtype)) for _ in range(3))
for _ in range(2):  # the first call compiles; ncu profiles the second
    forward(q, k, v, causal=args.causal, algorithm="wgmma" if args.wgmma else "flash2")
cuda.synchronize()
