"""Launch every kernel on a few ragged shapes, for compute-sanitizer.

Not a pytest module: run it under the sanitizer on a GPU, e.g.

    compute-sanitizer --tool memcheck  python3 tests/gpu_sanitize.py
    compute-sanitizer --tool racecheck python3 tests/gpu_sanitize.py flash2 backward

Arguments select runs by name (any word of "forward flash2 float32 sparse
...", all given words must match); none runs everything.  The word "quick"
runs only the last (smallest) case: each run compiles its kernels, which
dominates the time.  Shapes are small
(the sanitizer slows kernels down a lot) and chosen to be ragged: N_q and N_k
not multiples of any block size, N_q != N_k, odd d.  Every result is checked
against the float64 reference too, so a run that the sanitizer passes but that
computes garbage still fails.
"""
import sys

import numpy as np

import numba_flash
import reference
from numba_flash import masks

CASES = [
    # (batch*heads, N_q, N_k, d, causal)
    (2, 37, 29, 24, False),
    (1, 61, 75, 64, True),
    (1, 19, 33, 7, True),
]
#: (direction, algorithm, dtype, block sizes, variant): variant is "dense", "sparse" (a random
#: block mask with an empty row of blocks), "dropout" or "sparse_dropout" (both at once).
RUNS = [
    ("forward", "standard", np.float32, None, "dense"),
    ("forward", "flash1", np.float32, (16, 24), "dense"),
    ("forward", "flash2", np.float32, (64, 32), "dense"),
    ("forward", "flash2", np.float32, (16, 16), "dense"),
    ("forward", "flash2", np.float16, (64, 64), "dense"),
    ("forward", "flash2", np.float16, (32, 16), "dense"),
    ("forward", "standard", np.float32, None, "sparse"),
    ("forward", "flash1", np.float32, (16, 16), "sparse"),
    ("forward", "flash2", np.float32, (32, 16), "sparse"),
    ("forward", "flash2", np.float16, (32, 32), "sparse"),
    ("forward", "flash2", np.float32, (32, 16), "dropout"),
    ("forward", "flash2", np.float16, (32, 32), "dropout"),
    ("forward", "flash2", np.float32, (32, 16), "sparse_dropout"),
    ("forward", "flash2", np.float16, (32, 32), "sparse_dropout"),
    ("backward", "flash1", np.float32, (16, 16), "dense"),
    ("backward", "flash1", np.float32, (16, 16), "sparse"),
    ("backward", "flash1", np.float32, (16, 16), "dropout"),
    ("backward", "flash2", np.float32, (32, 32), "dense"),
    ("backward", "flash2", np.float32, (32, 32), "sparse"),
    ("backward", "flash2", np.float32, (32, 32), "dropout"),
    ("backward", "flash2", np.float16, (32, 32), "dense"),
    ("backward", "flash2", np.float32, (128, 64), "dense"),  # the default tiles at d <= 64 (float16 to d = 128)
    ("backward", "flash2", np.float16, (128, 64), "dense"),
    ("backward", "flash1", np.float32, (16, 16), "sparse_dropout"),
    ("backward", "flash2", np.float32, (32, 32), "sparse_dropout"),
    ("backward", "flash2", np.float16, (32, 32), "sparse_dropout"),
]
MASK_BLOCK = 16
DROPOUT_P = 0.25


def run_name(run):
    direction, algorithm, dtype, blocks, variant = run
    return f"{direction} {algorithm} {np.dtype(dtype).name} {variant}"


def options(variant, bh, n_q, n_k, rng):
    """Keyword arguments for one call, and the (mask, keep) the reference needs."""
    kwargs, ref_kwargs = {}, {}
    if "sparse" in variant:
        bm = masks.random(n_q, n_k, (MASK_BLOCK, MASK_BLOCK), 0.6, seed=int(rng.integers(1 << 30)))
        layout = bm.layout.copy()
        layout[0] = False  # an empty row of blocks: those rows must come out 0
        bm = numba_flash.BlockMask(layout, bm.block_size)
        kwargs.update(block_mask=bm)
        ref_kwargs.update(mask=bm.to_dense(n_q, n_k))
    if "dropout" in variant:
        keep = numba_flash.dropout_mask((bh, n_q, n_k), DROPOUT_P, seed=7)
        kwargs.update(dropout_p=DROPOUT_P, seed=7)
        ref_kwargs.update(dropout_keep=keep, dropout_p=DROPOUT_P)
    return kwargs, ref_kwargs


def check(name, got, want, dtype):
    err = float(np.abs(np.asarray(got, np.float64) - want).max() / max(1.0, np.abs(want).max()))
    limit = 4e-3 if dtype == np.float16 else 2e-5
    print(f"  {name}: max err {err:.2e}", flush=True)
    assert err < limit, f"{name}: error {err} above {limit}"
    return err


def main(selected=()):
    rng = np.random.default_rng(0)
    worst = 0.0
    cases = CASES[-1:] if "quick" in selected else CASES
    selected = [word for word in selected if word != "quick"]
    for run in RUNS:
        if not all(word in run_name(run).split() for word in selected):
            continue
        direction, algorithm, dtype, blocks, variant = run
        for bh, n_q, n_k, d, causal in cases:
            q = rng.standard_normal((bh, n_q, d)).astype(dtype)
            k, v = (rng.standard_normal((bh, n_k, d)).astype(dtype) for _ in range(2))
            kwargs, ref_kwargs = options(variant, bh, n_q, n_k, rng)
            print(f"{run_name(run)} blocks={blocks} shape=({bh},{n_q},{n_k},{d}) causal={causal}", flush=True)
            ref, _ = reference.attention(q, k, v, causal=causal, **ref_kwargs)
            if direction == "forward":
                out = numba_flash.attention(q, k, v, causal=causal, algorithm=algorithm, block_sizes=blocks,
                                            **kwargs)
                worst = max(worst, check("O", out, ref, dtype))
                continue
            # The backward starts from the forward's O and lse (flash2 forward; same arguments).
            o, lse = numba_flash.attention(q, k, v, causal=causal, return_lse=True, **kwargs)
            do = rng.standard_normal(o.shape).astype(dtype)
            grads = numba_flash.attention_backward(q, k, v, o, lse, do, causal=causal, algorithm=algorithm,
                                                   block_sizes=blocks, **kwargs)
            want = reference.attention_backward(q, k, v, do, causal=causal, **ref_kwargs)
            for label, got, expected in zip(("dq", "dk", "dv"), grads, want):
                worst = max(worst, check(label, got, expected, dtype))
    print("all kernels ran; worst relative error", worst)


if __name__ == "__main__":
    main(sys.argv[1:])
