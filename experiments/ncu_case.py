"""One flash2 call on random float32 inputs, for profiling with ncu.

    ncu --clock-control none --kernel-name regex:flash2 --launch-skip 1 --launch-count 1 \\
        --section SpeedOfLight --section Occupancy --section WarpStateStats \\
        python3 experiments/ncu_case.py B H N D

The first call compiles (and is skipped by --launch-skip 1); ncu profiles the second.
"""
import sys
import numpy as np
from numba import cuda
import numba_flash
b, h, n, d = (int(x) for x in sys.argv[1:5])
rng = np.random.default_rng(0)
q, k, v = (cuda.to_device(rng.standard_normal((b, h, n, d)).astype(np.float32)) for _ in range(3))
for _ in range(2):  # the first call compiles; ncu profiles the second
    numba_flash.attention(q, k, v)
cuda.synchronize()
