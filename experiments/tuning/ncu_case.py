"""One flash2 (or wgmma) forward on random inputs, for profiling with ncu.

    ncu --clock-control none --kernel-name regex:flash2 --launch-skip 1 --launch-count 1 \\
        --section SpeedOfLight --section Occupancy --section WarpStateStats \\
        python3 experiments/tuning/ncu_case.py B H N D [--dtype float16] [--causal] [--package DIR] [--wgmma]

The first call compiles (and is skipped by --launch-skip 1); ncu profiles the second.  ``--package``
profiles another copy of numba-flash instead (a package folder, as ``numba-flash bench --baseline``
takes), so that two versions of a kernel can be profiled on the same inputs.  ``--wgmma`` asks for
the Hopper forward (``algorithm="wgmma"``; kernel names start with ``wgmma``), which flash2 picks by
itself on a Hopper GPU in its scope.

``--decode``: one decoding step instead (``attention_with_kv_cache``, one query per head against a full
cache; the shape is then (B, H_q, N_cache, D) with ``--kv-heads`` key/value heads), one kernel: the
forward (whose last blocks merge split keys, with smaller grids): with ``--kernel-name regex:flash2
--launch-skip 1 --launch-count 1`` ncu profiles the second call's forward.  ``decode_breakdown.py --profile``
profiles a step of torch's backends beside ours (``results/decode_breakdown_h200.md``).
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
parser.add_argument("--decode", action="store_true", help="one decoding step against a full KV cache instead")
parser.add_argument("--kv-heads", type=int, default=None, help="--decode: key/value heads (default: H)")
args = parser.parse_args()
if args.package:
    from numba_flash.tools.bench import load_baseline
    forward = load_baseline(args.package).attention
else:
    from numba_flash import attention as forward
rng = np.random.default_rng(0)
if args.decode:
    import numba_flash

    batch, heads, n, d = args.shape
    q = cuda.to_device(rng.standard_normal((batch, heads, 1, d)).astype(args.dtype))
    k, v = (cuda.to_device(rng.standard_normal((batch, args.kv_heads or heads, n, d)).astype(args.dtype))
            for _ in range(2))
    for _ in range(2):  # the first call compiles; ncu profiles the second
        numba_flash.attention_with_kv_cache(q, k, v, np.full(batch, n, np.int32))
else:
    q, k, v = (cuda.to_device(rng.standard_normal(args.shape).astype(args.dtype)) for _ in range(3))
    for _ in range(2):  # the first call compiles; ncu profiles the second
        forward(q, k, v, causal=args.causal, algorithm="wgmma" if args.wgmma else "flash2")
cuda.synchronize()
