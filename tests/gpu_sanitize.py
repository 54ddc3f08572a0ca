"""Launch every forward kernel on a few ragged shapes, for compute-sanitizer.

Not a pytest module: run it under the sanitizer on a GPU, e.g.

    compute-sanitizer --tool memcheck  python3 tests/gpu_sanitize.py
    compute-sanitizer --tool racecheck python3 tests/gpu_sanitize.py

Shapes are small (the sanitizer slows kernels down a lot) and chosen to be
ragged: N_q and N_k not multiples of any block size, N_q != N_k, odd d.
Each result is also checked against the float64 reference, so a run that
the sanitizer passes but that computes garbage still fails.
"""
import sys

import numpy as np

import numba_flash
import reference

CASES = [
    # (batch*heads, N_q, N_k, d, causal)
    (2, 37, 29, 24, False),
    (1, 61, 75, 64, True),
    (1, 19, 33, 7, True),
]
RUNS = [("standard", np.float32, None), ("flash1", np.float32, (16, 24)),
        ("flash2", np.float32, (64, 32)), ("flash2", np.float32, (16, 16)), ("flash2", np.float16, (64, 64)),
        ("flash2", np.float16, (32, 16))]


def main(only=None):
    rng = np.random.default_rng(0)
    worst = 0.0
    for algorithm, dtype, blocks in RUNS:
        if only and algorithm not in only:
            continue
        for bh, n_q, n_k, d, causal in CASES:
            q = rng.standard_normal((bh, n_q, d)).astype(dtype)
            k, v = (rng.standard_normal((bh, n_k, d)).astype(dtype) for _ in range(2))
            out = numba_flash.attention(q, k, v, causal=causal, algorithm=algorithm, block_sizes=blocks)
            ref, _ = reference.attention(q, k, v, causal=causal)
            err = float(np.abs(out.astype(np.float64) - ref).max())
            limit = 2e-3 if dtype == np.float16 else 1e-5
            print(f"{algorithm:8s} {np.dtype(dtype).name} blocks={blocks} shape=({bh},{n_q},{n_k},{d}) "
                  f"causal={causal}: max err {err:.2e}", flush=True)
            assert err < limit, f"error {err} above {limit}"
            worst = max(worst, err)
    print("all kernels ran; worst error", worst)


if __name__ == "__main__":
    main(sys.argv[1:])
