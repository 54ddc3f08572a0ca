"""Launch every kernel on a few ragged shapes, for compute-sanitizer.

Not a pytest module: run it under the sanitizer on a GPU, e.g.

    compute-sanitizer --tool memcheck --report-api-errors no python3 tests/gpu_sanitize.py
    compute-sanitizer --tool racecheck python3 tests/gpu_sanitize.py flash2 backward

(``--report-api-errors no``: on some machines cuda-bindings probes the driver with ``cuGetProcAddress`` and
memcheck counts each CUDA_ERROR_INVALID_VALUE it gets back as an error, none of them in a kernel: 34 in one run on
an H100, 2026-12-06.)

Arguments select runs by name (any word of "forward flash2 float32 sparse
...", all given words must match; "a,b" matches either); none runs
everything.  The word "quick" runs only the last (smallest) case, or for the
bulk modes' backward the case of most query rows (its blocks go round both of
their stages, the hand-over racecheck found wanting on 2026-12-07): each run
compiles its kernels, which dominates the time.  Shapes are small (the sanitizer slows kernels down a
lot) and chosen to be ragged: N_q and N_k not multiples of any block size,
N_q != N_k, odd d.  Variants: dense, sparse (a random block mask with an
empty row of blocks; sparse_whole: its blocks are the kernel's tiles, so no
element test; the wgmma forward's are 64 x 64, which leave its blocks of two
warpgroups, 128 rows, partly covered tiles), dropout, both, gqa (two query
heads per key/value head, bottom-right causal), overlap (the wgmma forward's overlapped loop), warpgroups2
(its blocks of two warpgroups), specialized (the warp-specialised wgmma forward; consumers3: of three consumer
warpgroups; registers: Q's fragments in registers; stages4: of four K/V stages), strided
(q, k, v as transposed (B, N, H, d) views), unordered (the backward with deterministic=False), ordered / separate (the
wgmma backward's dQ summed in a fixed order by its dK/dV kernel, or in a kernel of its own: ``NUMBA_FLASH_WGMMA_DQ``),
bulk_ordered / bulk_unordered (its dK/dV kernel of two warpgroups adding dQ by bulk reductions), nan (NaN in a value
row and a query row: the masked-tile sanitising path),
varlen (packed sequences of lengths 0, 1 and ragged ones, grouped heads,
bottom-right causal, dropout; on the wgmma kernels longer ones over several 64-row tiles, no dropout, with the dQ
variants above too), decode (a KV cache with appends, entries of
different lengths, one query per head with the keys split between blocks, then
three causal ones; decode_stages4: the same with four K/V buffers; decode_key_warps4 / 3: with warps of
a block taking turns along the keys; decode_swizzled: four key warps at d = 128, whose K/V rows are swizzled;
decode_paged: a paged cache, with its block table; decode_mqa, decode_many_splits, decode_paged_gqa,
decode_paged_mqa: decode_plan's packed query groups and many splits), mods (score_mod / mask_mod, numba_flash.mods:
mods_score a softcap composed with ALiBi; mods_mask a relative-position bias with a sliding window OR a prefix, whose
tiles come as lists classified on the GPU; gqa_mods_mask the same with grouped heads, bottom-right causal;
mods_mask_tile_mask the same mask classified ahead by numba_flash.tile_mask in 16 x 16 blocks and coarsened to the
kernel's tiles; select them with the word "mods_score,mods_mask,gqa_mods_mask,mods_mask_tile_mask"; on the wgmma
kernels also mods_mask_overlap and gqa_mods_mask_warpgroups2, the forward's other loops, and mods_mask_ordered and
gqa_mods_mask_unordered, the backward's other ways of summing dQ), mods on packed sequences and caches (varlen_mods:
the packed runs with a softcap composed with ALiBi and a sliding window OR a prefix, per sequence, every tile tested,
no dropout; decode_mods, decode_paged_mods: the decode runs with the same mods at each query's position in its entry,
packed query groups, split keys, key warps; select them with "varlen_mods,decode_mods,decode_paged_mods").
Every result
is checked against the float64 reference too, so a run that the sanitizer passes
but that computes garbage still fails.
"""
import contextlib
import sys

import ml_dtypes
import numpy as np
import torch

import numba_flash
import reference
from numba_flash import masks
from strategies import forward_warp_rows, wgmma_dq, wgmma_loop

BF16 = np.dtype(ml_dtypes.bfloat16)
CASES = [
    # (batch, heads, N_q, N_k, d, causal)
    (1, 2, 37, 29, 24, False),
    (1, 2, 61, 75, 64, True),
    (1, 2, 19, 33, 8, True),
]
#: (direction, algorithm, dtype, block sizes, variant).
RUNS = [
    ("forward", "standard", np.float32, None, "dense"),
    ("forward", "flash1", np.float32, (16, 24), "dense"),
    ("forward", "standard", np.float32, None, "sparse"),
    ("forward", "flash1", np.float32, (16, 16), "sparse"),
    ("forward", "flash2", np.float32, (64, 32), "dense"),
    ("forward", "flash2", np.float32, (16, 16), "dense"),
    ("forward", "flash2", np.float16, (64, 64), "dense"),
    ("forward", "flash2", BF16, (32, 16), "dense"),
    ("forward", "flash2", np.float32, (32, 16), "sparse_dropout"),
    ("forward", "flash2", np.float16, (32, 32), "sparse_dropout"),
    ("forward", "flash2", BF16, (32, 32), "sparse_dropout"),
    ("forward", "flash2", np.float32, (32, 16), "gqa"),
    ("forward", "flash2", np.float16, (64, 64), "strided"),
    ("forward", "flash2", np.float32, (32, 16), "nan"),
    ("forward", "flash2", np.float16, (32, 32), "nan"),
    ("backward", "flash1", np.float32, (16, 16), "sparse_dropout"),
    ("backward", "flash1", np.float32, (16, 16), "nan"),
    ("backward", "flash2", np.float32, (32, 32), "dense"),
    ("backward", "flash2", np.float32, (128, 64), "dense"),  # the default tiles at d <= 64 (16-bit to d = 128)
    ("backward", "flash2", np.float16, (128, 64), "dense"),
    ("backward", "flash2", BF16, (32, 32), "sparse_dropout"),
    ("backward", "flash2", np.float32, (32, 32), "sparse_dropout"),
    ("forward", "flash2", np.float32, (32, 16), "varlen"),
    ("forward", "flash2", BF16, (64, 64), "varlen"),
    ("backward", "flash2", np.float32, (32, 32), "varlen"),
    ("backward", "flash2", np.float16, (64, 32), "varlen"),
    ("forward", "flash2", np.float32, (16, 32), "decode"),
    ("forward", "flash2", np.float16, (16, 64), "decode"),
    ("forward", "flash2", BF16, None, "decode"),
    # Four K/V buffers (kv_stages): three tiles in flight, one cp.async group each, the last groups empty.
    ("forward", "flash2", np.float16, (16, 16), "decode_stages4"),
    # Warps of one block taking turns along the keys, the block copying each round of tiles together
    # (key_warps): four warps, two buffers; three warps, three buffers (the last rounds leave warps idle).
    ("forward", "flash2", np.float16, (16, 32), "decode_key_warps4"),
    ("forward", "flash2", BF16, (16, 16), "decode_key_warps3"),
    # At d = 128 the key warps' K/V rows are unpadded and swizzled (tiling.swizzled_rows); the default layout.
    ("forward", "flash2", np.float16, (16, 32), "decode_swizzled"),
    # A paged cache (block_table): scattered pages of a (pages, page_size, H_kv, d) pool passed transposed, its
    # table on the GPU for one query, on the host for three; with the default tiles, and with four key warps at
    # d = 128 (a round of tiles spans pages).
    ("forward", "flash2", np.float16, None, "decode_paged"),
    ("forward", "flash2", BF16, (16, 16), "decode_paged_key_warps4"),
    # The layouts of decode_plan.py, library's tiles: multi-query attention (32 query heads on one K/V head: two
    # 16-row tiles of 32 packed rows sharing the K/V, eight key warps of 16-key tiles, splits; then 3 causal queries
    # each, 96 rows in six such tiles, each row its own diagonal); more splits than the merge loads at once (20, key
    # warps of one warp); a paged cache under grouped heads of 8 (8 and 24 packed rows).
    ("forward", "flash2", np.float16, None, "decode_mqa"),
    ("forward", "flash2", BF16, (16, 16), "decode_many_splits"),
    ("forward", "flash2", np.float16, None, "decode_paged_gqa"),
    # Multi-query attention at d = 128 in a paged cache: the shared-K/V tiles' eight key warps reading pages.
    ("forward", "flash2", BF16, None, "decode_paged_mqa"),
    ("backward", "flash2", np.float16, (32, 32), "gqa"),
    ("backward", "flash2", np.float32, (32, 16), "strided"),
    ("backward", "flash2", np.float32, (32, 32), "nan"),
    ("backward", "flash2", np.float16, (32, 32), "nan"),
    # Warps of 32 query rows (tiling.FORWARD_WARP_ROWS: 16-bit, d <= 128, plain calls); every other forward run
    # forces warps of 16, so both shapes of the kernel are checked.
    ("forward", "flash2", np.float16, (128, 64), "warp32"),
    ("forward", "flash2", BF16, (64, 32), "warp32"),
    # Block masks of whole tiles (no element test compiled in): at 32 rows, and at 16.
    ("forward", "flash2", np.float16, (128, 64), "sparse_whole_warp32"),
    ("forward", "flash2", BF16, (64, 32), "sparse_whole"),
    # Streamed tiles of more rows than the block has threads (64 for 32): the NaN pass must reach them all.
    ("forward", "flash2", np.float32, (16, 64), "nan"),
    ("backward", "flash2", np.float32, (16, 64), "nan"),
    ("backward", "flash2", np.float16, (16, 64), "nan"),
    # The Hopper forward (kernels/hopper; compute capability 9.0 only), on WGMMA_CASES: its head dims.
    ("forward", "wgmma", np.float16, None, "dense"),
    ("forward", "wgmma", BF16, None, "gqa"),
    ("forward", "wgmma", np.float16, None, "strided"),
    # Its loop with the next tile's scores overlapping this one's softmax (make_wgmma_forward, OVERLAP).
    ("forward", "wgmma", np.float16, None, "overlap"),
    ("forward", "wgmma", BF16, None, "gqa_overlap"),
    # Blocks of two warpgroups sharing each K/V tile (WARPGROUPS), with either loop.
    ("forward", "wgmma", np.float16, None, "warpgroups2"),
    ("forward", "wgmma", BF16, None, "gqa_overlap_warpgroups2"),
    # Block masks: 16 x 16 blocks (partly covered tiles, tested element by element), and blocks of whole tiles
    # (the element test compiled out), in either loop and warpgroup count.
    # The warp-specialised forward (NUMBA_FLASH_WGMMA_FORWARD=specialized: producer and consumers on mbarriers and
    # named barriers), NaN in V on the diagonal cleaned by its producer.
    ("forward", "wgmma", np.float16, None, "specialized"),
    ("forward", "wgmma", BF16, None, "gqa_specialized"),
    ("forward", "wgmma", np.float16, None, "nan_specialized"),
    ("forward", "wgmma", BF16, None, "gqa_varlen_specialized"),
    ("forward", "wgmma", BF16, None, "specialized_consumers3"),
    ("forward", "wgmma", np.float16, None, "nan_specialized_consumers3"),
    ("forward", "wgmma", BF16, None, "gqa_specialized_registers"),
    ("forward", "wgmma", np.float16, None, "nan_specialized_consumers3_registers"),
    ("forward", "wgmma", BF16, None, "gqa_specialized_stages4"),
    ("forward", "wgmma", np.float16, None, "nan_specialized_consumers3_stages4"),
    ("forward", "wgmma", np.float16, None, "sparse"),
    ("forward", "wgmma", BF16, None, "sparse_whole"),
    ("forward", "wgmma", BF16, None, "gqa_sparse_overlap"),
    ("forward", "wgmma", np.float16, None, "sparse_whole_overlap_warpgroups2"),
    # The Hopper backward (kernels/hopper/backward.py): its dK/dV and dQ kernels, grouped heads, strided inputs.
    ("backward", "wgmma", np.float16, None, "dense"),
    ("backward", "wgmma", BF16, None, "gqa"),
    ("backward", "wgmma", np.float16, None, "strided"),
    # Its dK/dV kernel adding dQ in whatever order the adds arrive (deterministic=False).
    ("backward", "wgmma", np.float16, None, "unordered"),
    ("backward", "wgmma", BF16, None, "gqa_unordered"),
    # Its dK/dV kernel of two warpgroups on 128 keys, adding dQ_i's column halves by bulk reductions from shared
    # memory, in a fixed order or as they arrive.
    ("backward", "wgmma", np.float16, None, "bulk_ordered"),
    ("backward", "wgmma", BF16, None, "gqa_bulk_unordered"),
    ("backward", "wgmma", BF16, None, "gqa_bulk_ordered"),
    ("backward", "wgmma", np.float16, None, "varlen_bulk_ordered"),
    # Its block masks: 16 x 16 blocks (partly covered tiles, tested element by element) and blocks of whole tiles
    # (the element test compiled out), with dQ in its own kernel (the default), and summed by the dK/dV kernel in
    # either order.
    ("backward", "wgmma", np.float16, None, "sparse"),
    ("backward", "wgmma", BF16, None, "gqa_sparse_unordered"),
    ("backward", "wgmma", BF16, None, "sparse_whole"),
    ("backward", "wgmma", np.float16, None, "sparse_ordered"),
    ("backward", "wgmma", BF16, None, "gqa_sparse_whole_ordered"),
    # Packed sequences (VARLEN; WGMMA_VARLEN_LENGTHS, at each head dim of WGMMA_CASES), grouped heads or not, dQ
    # in its own kernel and summed by the dK/dV kernel in either order.
    ("forward", "wgmma", np.float16, None, "varlen"),
    ("forward", "wgmma", BF16, None, "gqa_varlen"),
    ("backward", "wgmma", BF16, None, "gqa_varlen"),
    ("backward", "wgmma", np.float16, None, "varlen_ordered"),
    ("backward", "wgmma", BF16, None, "gqa_varlen_unordered"),
    # score_mod / mask_mod on the mma.sync kernels (numba_flash.mods): a score_mod alone (every tile walked by the
    # mod step), and a mask_mod whose classified tiles are empty (skipped), full or partial (element test).
    ("forward", "flash2", np.float16, (64, 64), "mods_score"),
    ("forward", "flash2", np.float32, (32, 16), "mods_mask"),
    ("forward", "flash2", BF16, (32, 32), "gqa_mods_mask"),
    ("backward", "flash2", np.float16, (32, 32), "mods_score"),
    ("backward", "flash2", np.float32, (32, 16), "mods_mask"),
    ("backward", "flash2", BF16, (32, 32), "gqa_mods_mask"),
    # The mask classified ahead (numba_flash.tile_mask: the classification kernel, then its coarsening to the tiles).
    ("forward", "flash2", np.float16, (64, 32), "mods_mask_tile_mask"),
    ("backward", "flash2", np.float32, (32, 16), "mods_mask_tile_mask"),
    # The same mods on the wgmma kernels: the forward's three loops (plain, overlapped, two warpgroups), the backward's
    # three ways of summing dQ (its default, "separate"; "ordered"; "atomic" for the unordered runs).
    ("forward", "wgmma", np.float16, None, "mods_score"),
    ("forward", "wgmma", BF16, None, "mods_mask"),
    ("forward", "wgmma", BF16, None, "gqa_mods_mask"),
    ("forward", "wgmma", np.float16, None, "mods_mask_overlap"),
    ("forward", "wgmma", BF16, None, "gqa_mods_mask_warpgroups2"),
    ("backward", "wgmma", np.float16, None, "mods_score"),
    ("backward", "wgmma", BF16, None, "mods_mask"),
    ("backward", "wgmma", BF16, None, "gqa_mods_mask"),
    ("backward", "wgmma", np.float16, None, "mods_mask_ordered"),
    ("backward", "wgmma", BF16, None, "gqa_mods_mask_unordered"),
    # A lone relative-bias table whose gradient the dQ kernel sums (kernels/fast/bias_table.py), checked too: the
    # wgmma dQ kernel's, and the mma.sync one's at tiles with more diagonals than threads and at float32.
    ("backward", "wgmma", BF16, None, "gqa_mods_table"),
    ("backward", "flash2", np.float16, (32, 64), "gqa_mods_table"),
    ("backward", "flash2", np.float32, (64, 32), "mods_table"),
    # The mods on packed sequences (every tile tests the mask_mod: no tile lists) and on KV caches (contiguous with
    # the library's layout: packed query groups, splits, key warps; paged with 16 x 16 tiles).
    ("forward", "flash2", np.float16, (32, 32), "varlen_mods"),
    ("backward", "flash2", BF16, (32, 32), "varlen_mods"),
    ("forward", "flash2", np.float16, None, "decode_mods"),
    ("forward", "flash2", BF16, (16, 16), "decode_paged_mods"),
    # The wgmma forward on the 256-column layout (variants with "d256": WGMMA_WIDE_CASES, d = 256 and 192): blocks of
    # two warpgroups (its default there) and of one, grouped heads, the overlapped loop, block masks of 16 x 16 blocks
    # and of the 64 x 64 tiles (partly covering two warpgroups' 128-row tiles: the element test), packed sequences.
    ("forward", "wgmma", np.float16, None, "d256_warpgroups2"),
    ("forward", "wgmma", BF16, None, "gqa_d256_warpgroups1"),
    ("forward", "wgmma", np.float16, None, "gqa_overlap_d256_warpgroups2"),
    ("forward", "wgmma", BF16, None, "sparse_whole_d256_warpgroups2"),
    ("forward", "wgmma", np.float16, None, "sparse_d256_warpgroups1"),
    ("forward", "wgmma", BF16, None, "gqa_varlen_d256"),
]
#: The wgmma kernels' cases, forward and backward: d = 64 and 128, and d = 96 on the 128-column layout with its pad
#: columns zero-filled (first, so that "quick" keeps the last case); ragged lengths of one to five 64-row tiles (five:
#: the forward's ring of three K/V buffers goes round more than once).
WGMMA_CASES = [
    (1, 2, 97, 270, 96, True),
    (1, 2, 130, 270, 128, False),
    (2, 2, 61, 150, 64, True),
]
#: The wgmma forward's cases on the 256-column layout: d = 256, and d = 192 (its last 64 columns pad; last, so that
#: "quick" keeps it), ragged lengths of one to three 64-row tiles.
WGMMA_WIDE_CASES = [
    (1, 2, 97, 150, 256, True),
    (1, 2, 61, 130, 192, False),
]
MASK_BLOCK = 16
#: The wgmma forward's tiles (one warpgroup): the blocks of its "sparse_whole" masks.
WGMMA_TILES = (64, 64)
DROPOUT_P = 0.25


def run_name(run):
    direction, algorithm, dtype, blocks, variant = run
    return f"{direction} {algorithm} {np.dtype(dtype).name} {variant}"


def inputs(variant, dtype, blocks, case, rng):
    """q, k, v (torch CUDA tensors: strided views for "strided"), their float64 copies, the call's options."""
    batch, heads, n_q, n_k, d, causal = case
    kv_heads = heads // 2 if "gqa" in variant else heads
    q = rng.standard_normal((batch, heads, n_q, d))
    k, v = (rng.standard_normal((batch, kv_heads, n_k, d)) for _ in range(2))
    if "nan" in variant.split("_"):
        v[0, 0, n_k // 2, 1] = np.nan
        q[0, -1, 3, 0] = np.nan
    host = [x.astype(dtype) for x in (q, k, v)]
    device = [torch.as_tensor(x.view(np.int16) if dtype == BF16 else x, device="cuda") for x in host]
    if dtype == BF16:
        device = [x.view(torch.bfloat16) for x in device]
    if variant == "strided":
        device = [x.transpose(1, 2).contiguous().transpose(1, 2) for x in device]
    kwargs, ref_kwargs = dict(causal="bottom_right" if "gqa" in variant else causal), {}
    if "sparse" in variant:
        mask_block = (blocks or WGMMA_TILES) if "whole" in variant else (MASK_BLOCK, MASK_BLOCK)   # whole: tiles
        bm = masks.random(n_q, n_k, mask_block, 0.6, seed=int(rng.integers(1 << 30)))
        layout = bm.layout.copy()
        layout[0] = False  # an empty row of blocks: those rows must come out 0
        layout[-1, 0] = True  # and never an empty mask (every gradient 0 checks nothing)
        bm = numba_flash.BlockMask(layout, bm.block_size)
        kwargs.update(block_mask=bm)
        ref_kwargs.update(mask=bm.to_dense(n_q, n_k))
    if "dropout" in variant:
        keep = numba_flash.dropout_mask((batch, heads, n_q, n_k), DROPOUT_P, seed=7)
        kwargs.update(dropout_p=DROPOUT_P, seed=7)
        ref_kwargs.update(dropout_keep=keep, dropout_p=DROPOUT_P)
    if "mods" in variant:   # the arrays as NumPy (copied to the GPU once per plan), the reference's in float64
        from numba_flash import mods
        if variant == "mods_score":
            kwargs.update(score_mod=mods.compose(mods.softcap(5.0), mods.alibi(mods.alibi_slopes(heads))))
        elif "table" in variant:   # reach 40: inner and edge bins across tiles
            kwargs.update(score_mod=mods.relative_position_bias(rng.standard_normal((heads, 81)).astype(np.float32)))
        else:
            table = rng.standard_normal((heads, 17)).astype(np.float32)
            kwargs.update(score_mod=mods.relative_position_bias(table),
                          mask_mod=mods.or_masks(mods.sliding_window(9), mods.prefix_lm(5)))
        ref_kwargs.update(score_mod=kwargs.get("score_mod"), mask_mod=kwargs.get("mask_mod"))
        if "tile_mask" in variant:
            kwargs.update(mask_mod=numba_flash.tile_mask(kwargs["mask_mod"], batch, heads, n_q, n_k))
    ref_kwargs["causal"] = kwargs["causal"]
    return device, [x.astype(np.float64) for x in host], kwargs, ref_kwargs


def to_host(x):
    x = x.detach()
    return (x.float() if x.dtype == torch.bfloat16 else x).cpu().numpy().astype(np.float64)


def check(name, got, want, dtype, nan_rows_only=False):
    """``got`` against the float64 ``want`` (NaN where ``nan_rows`` puts it: whole rows).  ``nan_rows_only``: the
    wgmma forwards, whose tensor cores carry a NaN value element on a tile no mask touches only into its own
    column of O (0 x NaN is NaN, the other columns' products are finite), as torch's backends do: there the NaN
    rows must match (tests/test_nan.py's contract, rows that may see a NaN), and the other rows every element."""
    got = to_host(got)
    finite = ~np.isnan(want)
    if nan_rows_only:
        want_rows = np.isnan(want).any(-1)   # (the rows ``nan_rows`` made NaN)
        assert np.array_equal(np.isnan(got).any(-1), want_rows), f"{name}: NaN rows unlike the reference's"
        finite = np.broadcast_to(~want_rows[..., None], want.shape)
    else:
        assert np.array_equal(np.isnan(got), ~finite), f"{name}: NaN where the reference has none, or missing"
    assert np.any(want[finite] != 0), f"{name}: the reference is all zeros, so this case checks nothing"
    err = float(np.abs(got[finite] - want[finite]).max(initial=0) / max(1.0, np.abs(want[finite]).max(initial=0)))
    limit = {np.dtype(np.float16): 4e-3, BF16: 3e-2}.get(np.dtype(dtype), 2e-5)
    print(f"  {name}: max err {err:.2e}", flush=True)
    assert err < limit, f"{name}: error {err} above {limit}"
    return err


def reference_of(variant):
    """The float64 reference for a variant: ``reference.mods`` (which applies the mods) for the mods runs."""
    if "mods" in variant:
        from reference import mods as reference_mods
        return reference_mods
    return reference


def main(selected=()):
    rng = np.random.default_rng(0)
    worst = 0.0
    quick = "quick" in selected
    selected = [word for word in selected if word != "quick"]
    for run in RUNS:
        words = run_name(run).split()
        if not all(any(choice in words for choice in word.split(",")) for word in selected):
            continue
        direction, algorithm, dtype, blocks, variant = run
        if algorithm == "wgmma" and torch.cuda.get_device_capability() != (9, 0):
            print(f"{run_name(run)}: skipped (needs compute capability 9.0)", flush=True)
            continue
        cases = WGMMA_WIDE_CASES if "d256" in variant else WGMMA_CASES if algorithm == "wgmma" else CASES
        if quick:
            cases = [max(cases, key=lambda case: case[2])] if "bulk" in variant else cases[-1:]
        if variant.startswith("decode"):
            print(f"{run_name(run)} blocks={blocks} lengths={DECODE_LENGTHS}", flush=True)
            key_warps = int(variant[-1]) if "key_warps" in variant else 4 if variant == "decode_swizzled" else 0
            stages = {"decode_stages4": 4, "decode_key_warps3": 3, "decode_swizzled": 3}.get(variant, 0)
            wide = variant in ("decode_swizzled", "decode_paged_key_warps4", "decode_mqa", "decode_paged_mqa")
            layout = dict(key_warps=key_warps)
            layout.update({"decode_mqa": dict(heads=32, kv_heads=1), "decode_paged_mqa": dict(heads=32, kv_heads=1),
                           "decode_many_splits": dict(num_splits=20, key_warps=1, rows=640),
                           "decode_paged_gqa": dict(heads=32, kv_heads=4)}.get(variant, {}))
            worst = max(worst, decode(dtype, blocks, rng, kv_stages=stages, d=128 if wide else 40,
                                      page_size=32 if "paged" in variant else 0, with_mods="mods" in variant,
                                      **layout))
            continue
        if "varlen" in variant:
            for d in ([case[4] for case in cases] if algorithm == "wgmma" else [VARLEN_HEAD_DIM]):
                print(f"{run_name(run)} blocks={blocks} d={d} lengths={packed_lengths(algorithm)}", flush=True)
                worst = max(worst, packed(direction, algorithm, variant, dtype, blocks, d, rng))
            continue
        for case in cases:
            (q, k, v), (q64, k64, v64), kwargs, ref_kwargs = inputs(variant, dtype, blocks, case, rng)
            print(f"{run_name(run)} blocks={blocks} case={case}", flush=True)
            # NaN runs: the rows that never see a NaN equal the reference without it; the others are NaN.
            ref, _ = reference_of(variant).attention(*(np.nan_to_num(x) for x in (q64, k64, v64)), **ref_kwargs)
            if "nan" in variant.split("_"):
                ref = nan_rows(ref, q64, v64, ref_kwargs["causal"])
            if direction == "forward":
                with (forward_warp_rows(32 if "warp32" in variant else 16),
                      wgmma_loop("overlap" in variant, 2 if "warpgroups2" in variant else 1,
                                 "specialized" if "specialized" in variant else "blocks",
                                 3 if "consumers3" in variant else 2,
                                 "registers" if "registers" in variant else "shared",
                                 4 if "stages4" in variant else 3)):
                    out = numba_flash.attention(q, k, v, algorithm=algorithm, block_sizes=blocks, **kwargs)
                worst = max(worst, check("O", out, ref, dtype, nan_rows_only=algorithm == "wgmma"))
                continue
            # The backward starts from the forward's O and lse (flash2 forward; same arguments).
            o, lse = numba_flash.attention(q, k, v, return_lse=True, **kwargs)
            do_host = rng.standard_normal(q.shape).astype(dtype)
            do = torch.as_tensor(do_host.view(np.int16) if dtype == BF16 else do_host, device="cuda")
            do = do.view(torch.bfloat16) if dtype == BF16 else do
            if "table" in variant:
                *grads, sums = numba_flash.api._attention_backward_and_table_sums(
                    q, k, v, o, lse, do, algorithm=algorithm, deterministic=True, block_mask=None, scale=None,
                    block_sizes=blocks, **kwargs)
                worst = max(worst, check("d table", sums.sum((0, 2)),
                                         table_gradient(q64, k64, v64, do_host.astype(np.float64), **kwargs), dtype))
            else:
                with named_dq(variant) as deterministic:
                    grads = numba_flash.attention_backward(q, k, v, o, lse, do, algorithm=algorithm,
                                                           block_sizes=blocks, deterministic=deterministic, **kwargs)
            if "nan" in variant.split("_"):
                for label, got in zip(("dq", "dk", "dv"), grads):
                    print(f"  {label}: NaN rows {int(torch.isnan(got).any(-1).sum())}", flush=True)
                continue
            want = reference_of(variant).attention_backward(q64, k64, v64, do_host.astype(np.float64), **ref_kwargs)
            for label, got, expected in zip(("dq", "dk", "dv"), grads, want):
                worst = max(worst, check(label, got, expected, dtype))
    print("all kernels ran; worst relative error", worst)


def table_gradient(q, k, v, do, causal, score_mod):
    """d L / d table of a relative-bias score_mod in float64 (NumPy): dS = P o (dP - D) summed by clamped distance."""
    group = q.shape[1] // k.shape[1]
    k, v = (np.repeat(x, group, axis=1) for x in (k, v))
    table = np.asarray(score_mod.arrays[0], np.float64)
    n_q, n_k, reach = q.shape[2], k.shape[2], (table.shape[1] - 1) // 2
    distance = np.clip(np.arange(n_k)[None, :] - np.arange(n_q)[:, None], -reach, reach) + reach
    scores = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1]) + table[:, distance]
    if causal:
        offset = n_k - n_q if causal == "bottom_right" else 0
        scores = np.where(np.arange(n_k)[None, :] <= np.arange(n_q)[:, None] + offset, scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p = np.nan_to_num(p / p.sum(-1, keepdims=True))
    d_p = do @ np.swapaxes(v, -1, -2)
    d_s = p * (d_p - (d_p * p).sum(-1, keepdims=True))
    gradient = np.zeros_like(table)
    for c in range(2 * reach + 1):
        gradient[:, c] = d_s[..., distance == c].sum(axis=(0, 2))
    return gradient


def named_dq(variant):
    """The wgmma backward's dQ in the way the variant names, else its default (``DQ_MODE``): a context that yields
    the ``deterministic`` to pass."""
    named = next((mode for mode in ("bulk_unordered", "bulk_ordered", "unordered", "ordered", "separate")
                  if mode in variant), None)
    modes = {"unordered": "atomic", "bulk_unordered": "bulk-atomic", "bulk_ordered": "bulk-ordered"}
    return wgmma_dq(modes.get(named, named)) if named else contextlib.nullcontext(True)


#: Packed sequences (query lengths, key lengths): empty, one-row and ragged ones, causal bottom-right; d = 24.
VARLEN_LENGTHS, VARLEN_HEAD_DIM = ([5, 0, 37, 1], [9, 3, 33, 1]), 24
#: The wgmma kernels': longer ones, over one to three 64-row tiles (a sequence without keys, one without queries).
WGMMA_VARLEN_LENGTHS = ([5, 0, 130, 1, 3, 70], [9, 3, 150, 1, 0, 64])


def packed_lengths(algorithm):
    return WGMMA_VARLEN_LENGTHS if algorithm == "wgmma" else VARLEN_LENGTHS


def packed(direction, algorithm, variant, dtype, blocks, d, rng):
    """attention_varlen (or its backward) on torch tensors, causal bottom-right: on flash2 grouped heads and dropout,
    on wgmma (no dropout) grouped heads where the variant says "gqa", dQ as it names (``named_dq``); the worst
    relative error."""
    wgmma = algorithm == "wgmma"
    heads, kv_heads = (4, 2) if "gqa" in variant or not wgmma else (2, 2)
    modded = "mods" in variant
    dropout_p = 0.0 if wgmma or modded else DROPOUT_P
    lengths = packed_lengths(algorithm)
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(n)]).astype(np.int32) for n in lengths)
    host = [rng.standard_normal((total, h, d)).astype(dtype)
            for total, h in ((cu_q[-1], heads), (cu_k[-1], kv_heads), (cu_k[-1], kv_heads))]

    def device(x):
        t = torch.as_tensor(x.view(np.int16) if dtype == BF16 else x, device="cuda")
        return t.view(torch.bfloat16) if dtype == BF16 else t

    q, k, v = (device(x) for x in host)
    longest = (max(lengths[0]), max(lengths[1]))
    keep = numba_flash.dropout_mask((len(cu_q) - 1, heads) + longest, dropout_p, seed=7) if dropout_p else None
    options = dict(causal=True, dropout_p=dropout_p, seed=7, **(sanitized_mods(heads) if modded else {}))
    cu = (torch.as_tensor(cu_q, device="cuda"), torch.as_tensor(cu_k, device="cuda"))
    # The backward starts from flash2's forward (the wgmma forward is the forward runs' subject).
    with wgmma_loop(kernel="specialized") if "specialized" in variant else contextlib.nullcontext():
        o, lse = numba_flash.attention_varlen(q, k, v, *cu, return_lse=True, block_sizes=blocks,
                                              algorithm=algorithm if direction == "forward" else "flash2", **options)
    do_host = rng.standard_normal(host[0].shape).astype(dtype)
    if modded:
        ref, want = modded_varlen_reference(host, do_host, cu_q, cu_k, options)
    else:
        ref, _ = reference.attention_varlen(*host, cu_q, cu_k, causal=True, dropout_keep=keep, dropout_p=dropout_p)
        want = reference.attention_varlen_backward(*host, do_host, cu_q, cu_k, causal=True, dropout_keep=keep,
                                                   dropout_p=dropout_p)
    if direction == "forward":
        return check("O", o, ref, dtype)
    with named_dq(variant) as deterministic:
        grads = numba_flash.attention_varlen_backward(q, k, v, o, lse, device(do_host), *cu, block_sizes=blocks,
                                                      algorithm=algorithm, deterministic=deterministic, **options)
    return max(check(label, got, expected, dtype) for label, got, expected in zip(("dq", "dk", "dv"), grads, want))


def sanitized_mods(heads):
    """The varlen_mods and decode mods runs' mods: a softcap composed with ALiBi, and a sliding window OR a prefix."""
    from numba_flash import mods
    return dict(score_mod=mods.compose(mods.softcap(5.0), mods.alibi(mods.alibi_slopes(heads))),
                mask_mod=mods.or_masks(mods.sliding_window(9), mods.prefix_lm(5)))


def seen_from(mod, b, offset):
    """``mod`` as the float64 reference must call it for batch entry b alone, its query i at position offset + i: a
    copy whose Python function fixes b and shifts q_idx (the reference calls ``fn`` in Python; the kernels never
    see this copy, and its derivative comes from central differences, ``slope="numeric"``)."""
    import copy

    if mod is None:
        return None
    fn, shifted = mod.fn, copy.copy(mod)
    if mod.kind == "score_mod":
        shifted.fn = lambda score, _, h, i, j, *arrays: fn(score, b, h, i + offset, j, *arrays)
    else:
        shifted.fn = lambda _, h, i, j, *arrays: fn(b, h, i + offset, j, *arrays)
    return shifted


def modded_varlen_reference(host, do, cu_q, cu_k, options):
    """The float64 O and (dq, dk, dv) of a packed call with mods, sequence by sequence (``reference.mods``, b its
    index in the pack, indices from its start), bottom-right causal."""
    from reference import mods as reference_mods

    q, k, v = (x.astype(np.float64) for x in host)
    out, grads = np.zeros(q.shape), [np.zeros(x.shape) for x in (q, k, v)]
    for b in range(len(cu_q) - 1):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if rows.start == rows.stop or keys.start == keys.stop:
            continue
        seq = [np.swapaxes(x, 0, 1) for x in (q[rows], k[keys], v[keys])]
        mod_options = dict(causal="bottom_right", score_mod=seen_from(options["score_mod"], b, 0),
                           mask_mod=seen_from(options["mask_mod"], b, 0))
        out[rows] = np.swapaxes(reference_mods.attention(*seq, **mod_options)[0], 0, 1)
        found = reference_mods.attention_backward(*seq, np.swapaxes(do[rows], 0, 1).astype(np.float64),
                                                  slope="numeric", **mod_options)
        for grad, where, got in zip(grads, (rows, keys, keys), found):
            grad[where] = np.swapaxes(got, 0, 1)
    return out, grads


#: Cache entries' lengths before the append (one empty), in caches of DECODE_ROWS rows.
DECODE_LENGTHS, DECODE_ROWS = [200, 0, 37], 256


def decode(dtype, blocks, rng, kv_stages=0, key_warps=0, d=40, page_size=0, heads=8, kv_heads=2, num_splits=0,
           rows=DECODE_ROWS, with_mods=False):
    """attention_with_kv_cache on torch tensors: one query per head, grouped heads (split keys), its lengths on
    the GPU (read by the forward itself), then three queries (causal), lengths on the host; each
    appends as many keys.  ``page_size``: the caches are pools of that many rows a page, the entries' pages
    scattered through them (two spare), the table with the lengths (on the GPU, then the host).  ``rows``: of
    each entry's cache.  ``with_mods``: ``sanitized_mods``, which see query i at position L_b - N_q + i.  Returns the
    worst relative error."""
    from reference import mods as reference_mods

    mod_options = sanitized_mods(heads) if with_mods else {}
    batch = len(DECODE_LENGTHS)
    group = heads // kv_heads

    def device(x):
        t = torch.as_tensor(x.view(np.int16) if dtype == BF16 else x, device="cuda")
        return t.view(torch.bfloat16) if dtype == BF16 else t

    def host(t):
        return (t.view(torch.int16).cpu().numpy().view(BF16) if t.dtype == torch.bfloat16 else t.cpu().numpy())

    caches = [rng.standard_normal((batch, kv_heads, rows, d)).astype(dtype) for _ in range(2)]
    k_cache, v_cache = (device(x) for x in caches)
    table = None
    if page_size:
        per_entry = rows // page_size
        table = rng.permutation(batch * per_entry + 2)[:batch * per_entry].reshape(batch, per_entry).astype(np.int32)
        pools = []
        for cache in caches:    # (pages, page_size, H_kv, d), as vLLM keeps it; the kernels see its transpose
            pool = rng.standard_normal((batch * per_entry + 2, page_size, kv_heads, d)).astype(dtype)
            for b in range(batch):
                for i, page in enumerate(table[b]):
                    pool[page] = cache[b, :, i * page_size:(i + 1) * page_size].transpose(1, 0, 2)
            pools.append(device(pool).transpose(1, 2))
        k_cache, v_cache = pools

    def gathered(cache):     # (B, H_kv, DECODE_ROWS, d): a paged cache's pool read through the table
        if table is None:
            return cache
        pages = cache[torch.as_tensor(table.reshape(-1), device="cuda", dtype=torch.int64)]
        pages = pages.reshape(batch, rows // page_size, kv_heads, page_size, d)
        return pages.permute(0, 2, 1, 3, 4).reshape(batch, kv_heads, rows, d)

    lengths = np.array(DECODE_LENGTHS, np.int32)
    worst = 0.0
    for n_q in (1, 3):
        q = rng.standard_normal((batch, heads, n_q, d)).astype(dtype)
        new = [rng.standard_normal((batch, kv_heads, n_q, d)).astype(dtype) for _ in range(2)]
        held = torch.as_tensor(lengths, device="cuda") if n_q == 1 else lengths
        paged = {} if table is None else dict(block_table=torch.as_tensor(table, device="cuda") if n_q == 1 else table)
        out = numba_flash.attention_with_kv_cache(device(q), k_cache, v_cache, held,
                                                  k_new=device(new[0]), v_new=device(new[1]), block_sizes=blocks,
                                                  kv_stages=kv_stages, key_warps=key_warps, num_splits=num_splits,
                                                  **paged, **mod_options)
        lengths = lengths + n_q
        k64, v64 = (host(gathered(x)).astype(np.float64) for x in (k_cache, v_cache))
        ref = np.zeros(q.shape)
        for b, length in enumerate(lengths):
            seen = {name: seen_from(mod, b, length - n_q) for name, mod in mod_options.items()}
            ref[b], _ = (reference_mods if seen else reference).attention(
                q[b].astype(np.float64), np.repeat(k64[b, :, :length], group, axis=0),
                np.repeat(v64[b, :, :length], group, axis=0), causal="bottom_right", **seen)
        worst = max(worst, check(f"O (N_q = {n_q})", out, ref, dtype))
    return worst


def nan_rows(ref, q64, v64, causal):
    """``ref`` with NaN in the rows allowed to see a NaN value row, or holding a NaN query (tests/test_nan.py)."""
    n_q, n_k = ref.shape[-2], v64.shape[-2]
    allowed = reference.allowed_mask(n_q, n_k, causal=causal)
    group = q64.shape[1] // v64.shape[1]
    bad_v = np.repeat(np.isnan(v64).any(-1), group, axis=1)             # (B, H, N_k)
    bad = (allowed[None, None] & bad_v[:, :, None, :]).any(-1) | (np.isnan(q64).any(-1) & allowed.any(-1))
    return np.where(bad[..., None], np.nan, ref)


if __name__ == "__main__":
    main(sys.argv[1:])
