"""Compile every kernel specialisation the API can launch for sm_90 and run ptxas on it.

Not a pytest module: it needs Numba's real CUDA target (NVVM; no GPU) and
CUDA's ptxas on PATH.  It catches what the simulator cannot: kernels that do
not type or compile on the GPU target, spills and stack frames.

    NUMBA_ENABLE_CUDASIM=0 python3 tests/gpu_compile_all.py             # every flag (varlen too), default tiles
    NUMBA_ENABLE_CUDASIM=0 python3 tests/gpu_compile_all.py tiles I/N   # every tile the GPU tests draw, shard I of N
    NUMBA_ENABLE_CUDASIM=0 python3 tests/gpu_compile_all.py --ptx DIR   # also keep each kernel's PTX (to diff)
    NUMBA_ENABLE_CUDASIM=0 python3 tests/gpu_compile_all.py hopper      # the wgmma kernels (sm_90a), varlen too
    NUMBA_ENABLE_CUDASIM=0 python3 tests/gpu_compile_all.py decode      # decode_plan's layouts of issue 47's grid
    NUMBA_ENABLE_CUDASIM=0 python3 tests/gpu_compile_all.py mods        # score_mod / mask_mod specialisations and
                                                                        # the mask_mods' tile classification
    NUMBA_ENABLE_CUDASIM=0 python3 tests/gpu_compile_all.py hopper-mods # the same on the wgmma kernels (sm_90a)
    NUMBA_ENABLE_CUDASIM=0 python3 tests/gpu_compile_all.py mods_varlen_cache   # only those of packed sequences, caches

Kernels compile with line info, as ``cuda_kernel`` compiles them on a GPU.
Use the NVVM and ptxas of the CUDA version the GPU machine has (13.x:
``pip install "numba-cuda[cu13]" "nvidia-cuda-nvcc==13.*"``, its ptxas first on
PATH): NVVM 12 accepts IR that NVVM 13 rejects.  Prints one line per kernel:
registers, spills, stack frame.
"""
import argparse
import itertools
import os
import re
import subprocess
import sys
import types

import numpy as np
import numba_flash  # noqa: F401  (the NumPy compatibility fix, before compiling)
import numba_flash.runtime.device  # noqa: E402
import numba_flash.tiling  # noqa: E402
from numba import cuda
from numba import types as T
from numba.cuda import dispatcher

# Device functions that are not inlined by Numba compile for the current
# device's compute capability; without a driver, say sm_90.
dispatcher.get_current_device = lambda: types.SimpleNamespace(compute_capability=(9, 0))
# Sizes that depend on the device's limits (flash2's K/V buffers) take the H200's.
numba_flash.tiling.device_limits = lambda: numba_flash.runtime.device.SIMULATED_DEVICE
from numba_flash.kernels.fast.backward import make_dkdv, make_dq, make_preprocess  # noqa: E402
from numba_flash.kernels.fast.cache import make_append  # noqa: E402
from numba_flash.kernels.fast.forward import make_forward  # noqa: E402
from numba_flash.kernels.literal.flash1_backward import make_flash1_backward  # noqa: E402
from numba_flash.kernels.literal.flash1_forward import make_flash1_forward  # noqa: E402
from numba_flash.kernels.literal.standard_attention import make_batched_matmul, make_row_softmax  # noqa: E402
from numba_flash.decode_plan import default_tile  # noqa: E402
from numba_flash.tiling import (FORWARD_BLOCK_SIZES, PRECISIONS, ROWS_PER_WARP, decode_block_sizes,  # noqa: E402
                                flash2_forward_warp_rows, tiles_for_head_dim)

a3 = T.Array(T.float32, 3, "C")
l2 = T.Array(T.float32, 2, "C")
u8 = T.Array(T.uint8, 3, "C")
drop = (T.int64, T.float64, T.int64, T.int64)
failures = []
PTX_DIR = None


def check(name, py_func, sig, launch_bounds=None, arch="sm_90"):
    try:  # as cuda_kernel compiles for a GPU
        ptx, _ = cuda.compile_ptx(py_func, sig, cc=(9, 0, "a") if arch == "sm_90a" else (9, 0), lineinfo=True,
                                  launch_bounds=launch_bounds)
    except Exception as exc:  # report every specialisation that fails, not only the first
        failures.append(name)
        print(name, "FAILED:", str(exc).splitlines()[0], flush=True)
        return
    path = f"/tmp/compile_all_{os.getpid()}.ptx"
    with open(path, "w") as f:
        f.write(ptx)
    if PTX_DIR:
        with open(os.path.join(PTX_DIR, re.sub(r"\W+", "_", name) + ".ptx"), "w") as f:
            # Without line info and mangled names only code differences remain.
            f.write("\n".join(line for line in re.sub(r"_ZN[0-9A-Za-z_]+", "SYM", ptx).splitlines()
                              if not line.strip().startswith((".loc", ".file", "//"))))
    out = subprocess.run(["ptxas", f"-arch={arch}", "-v", path, "-o", "/dev/null"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    info = [line.split("info    : ")[-1] for line in out.stderr.splitlines() if "Used" in line or "spill stores" in line]
    # ptxas's C7514: some instruction reads a wgmma's accumulator while it may be in flight, so it serialised them all.
    serialised = " | wgmma SERIALISED (C7514)" if "C7514" in out.stderr else ""
    print(name, " | ".join(x.strip() for x in info) + serialised, flush=True)


def fast(kernel, arch="sm_90"):
    """A fast kernel (``runtime.launch.Kernel``) at its explicit signature."""
    check(kernel.name, kernel.dispatcher.py_func, tuple(kernel.param_type(p) for p in kernel.params),
          kernel.launch_bounds, arch)


def hopper(head_dims, elements=("f16", "bf16")):
    """The wgmma kernels (``kernels/hopper``, sm_90a) as the API launches them by default (the forward's plain loop
    in blocks of its head dim's ``DEFAULT_WARPGROUPS``, and its warp-specialised kernel; the backward's dK/dV kernel
    in every way of summing dQ, its dQ kernel and the convert kernel, at the head dims it takes), dense and causal,
    without and with packed sequences (VARLEN): the flag must compile out of the kernels without it (compare their
    ``--ptx`` with a run before a change), and the packed ones' registers and spills are the ones to watch.  Head dims
    past 128 (the forward's alone, on the 256-column layout, no register cap) also in every other loop, warpgroup
    count and block mask (float16: bfloat16's kernels differ only in the conversions)."""
    from numba_flash.kernels.hopper.backward import make_dq_convert, make_wgmma_dkdv, make_wgmma_dq
    from numba_flash.kernels.hopper.dq_sums import DQ_MODES, UNORDERED_MODES, key_warpgroups, splits_dq_columns
    from numba_flash.kernels.hopper.specialized_dkdv import make_specialized_dkdv
    from numba_flash.kernels.hopper.specialized_forward import CONSUMER_COUNTS, STAGE_COUNTS, make_specialized_forward
    from numba_flash.kernels.hopper.common import HEAD_DIMS, layout_dim
    from numba_flash.kernels.hopper.forward import DEFAULT_WARPGROUPS, make_wgmma_forward

    for d, element, varlen in itertools.product(head_dims, elements, (False, True)):
        for causal in (False, True):
            fast(make_wgmma_forward(d, element, causal, WARPGROUPS=DEFAULT_WARPGROUPS[layout_dim(d)], VARLEN=varlen),
                 "sm_90a")
            if d not in HEAD_DIMS:
                continue
            for consumers, query_in_registers, stages in itertools.product(CONSUMER_COUNTS, (False, True),
                                                                           STAGE_COUNTS):
                # the warp-specialised forward (NUMBA_FLASH_WGMMA_FORWARD=specialized, NUMBA_FLASH_WGMMA_QUERY, _STAGES)
                fast(make_specialized_forward(d, element, causal, varlen, consumers, query_in_registers, stages),
                     "sm_90a")
            for dq_mode in DQ_MODES:
                if key_warpgroups(dq_mode) == 1:
                    fast(make_wgmma_dkdv(d, element, causal, dq_mode, VARLEN=varlen), "sm_90a")
                elif splits_dq_columns(d):   # the bulk modes' kernel of warps with roles
                    fast(make_specialized_dkdv(d, element, causal, dq_mode not in UNORDERED_MODES, varlen), "sm_90a")
            fast(make_wgmma_dq(d, element, causal, VARLEN=varlen), "sm_90a")
        if d in HEAD_DIMS:
            fast(make_dq_convert(d, element, varlen), "sm_90a")
            if splits_dq_columns(d):
                fast(make_dq_convert(d, element, varlen, True), "sm_90a")
    for d in (d for d in head_dims if d not in HEAD_DIMS):
        for causal, overlap, warpgroups, (mask, partly) in itertools.product(
                (False, True), (False, True), (1, 2), ((False, True), (True, False), (True, True))):
            if (overlap, warpgroups, mask) != (False, DEFAULT_WARPGROUPS[layout_dim(d)], False):  # (done above)
                fast(make_wgmma_forward(d, "f16", causal, overlap, warpgroups, mask, partly), "sm_90a")


def flash2(precision, vec, causal, mask, dropout, tiles=None, head_dim=64, varlen=False):
    forward_tiles = tiles or tiles_for_head_dim(FORWARD_BLOCK_SIZES["tf32x3" if precision == "tf32x3" else "f16"],
                                                head_dim)
    # A warp of 16 query rows, and of 32 where the library chooses it (tiling.flash2_forward_warp_rows).
    chosen = flash2_forward_warp_rows(forward_tiles[0], head_dim, precision, plain=not (mask or dropout))
    for warp_rows in sorted({ROWS_PER_WARP, chosen}):
        fast(make_forward(*forward_tiles, head_dim, precision, vec, causal, mask, dropout, varlen,
                          WARP_ROWS=warp_rows))
    if mask:  # a mask of whole tiles: no element test, and the warps of a call without the mask
        whole_rows = flash2_forward_warp_rows(forward_tiles[0], head_dim, precision, plain=not dropout)
        fast(make_forward(*forward_tiles, head_dim, precision, vec, causal, mask, dropout, varlen,
                          WARP_ROWS=whole_rows, PARTLY_MASKED=False))
    backward_tiles = tiles or (128, 64)
    fast(make_dkdv(*backward_tiles, head_dim, precision, vec, causal, mask, dropout, varlen))
    fast(make_dq(*backward_tiles, head_dim, precision, vec, causal, mask, dropout, varlen))


def decode(precision, head_dim):
    """Decoding from a KV cache at its default tiles (one query, and 40): the forward over per-entry lengths,
    its split-keys form (with the NaN of entries whose lengths, left on the GPU, do not fit, and the merge by the
    last split of each tile), and on a paged cache."""
    for n_q, vec, causal, split in itertools.product((1, 40), (True, False), (False, True), (False, True)):
        fast(make_forward(*decode_block_sizes(n_q, head_dim, precision), head_dim, precision, vec, causal, False,
                          False, "cache", split))
    for vec, split in itertools.product((True, False), (False, True)):   # a paged cache (through registers: vec False)
        fast(make_forward(*decode_block_sizes(1, head_dim, precision), head_dim, precision, vec, False, False, False,
                          "cache", split, PAGED=True))
    if precision != "tf32x3":   # warps taking turns along the keys: one warp's rows, tiles by cp.async
        for causal, split, paged in itertools.product((False, True), (False, True), (False, True)):
            tiles = default_tile(1, head_dim, 2, True)[:2]
            fast(make_forward(*tiles, head_dim, precision, True, causal, False, False, "cache", split, KEY_WARPS=4,
                              PAGED=paged))


def planned_decoding(precisions=("f16",), head_dims=(64, 128)):
    """The decoding kernels ``decode_plan`` picks over issue 47's grid (``experiments/tuning/decode_grid.py``) that
    ``decode`` does not compile, once each: packed query groups (MQA's 32 and 128 rows, causal rows of N_q = 4),
    their split and paged forms."""
    from numba_flash.decode_plan import decode_plan

    seen = set()
    for precision, d, n_q, (heads, kv_heads), batch, n, paged in itertools.product(
            precisions, head_dims, (1, 4), ((32, 32), (32, 8), (64, 8), (32, 1)), (1, 4, 16, 64),
            (2048, 8192, 32768, 131072), (False, True)):
        plan = decode_plan(batch, heads, kv_heads, n_q, n, d, 2, page_size=64 if paged else None)
        causal = n_q > 1   # bottom-right: one query sees every key
        key = (precision, d, plan.block_sizes, plan.warp_rows, plan.key_warps, plan.kv_stages, plan.splits > 1, causal,
               plan.packed and causal, paged)
        if key in seen or (plan.block_sizes[0] <= ROWS_PER_WARP and not (plan.packed and causal)):
            continue   # (a tile of one warp's rows without query groups: ``decode``'s)
        seen.add(key)
        fast(make_forward(*plan.block_sizes, d, precision, True, causal, False, False, "cache", plan.splits > 1,
                          WARP_ROWS=plan.warp_rows, KV_STAGES=plan.kv_stages, KEY_WARPS=plan.key_warps, PAGED=paged,
                          QUERY_GROUPS=plan.packed and causal))


def mod_pairs():
    """(score_mod, mask_mod) pairs that cover the built-ins and the combinators (numba_flash.mods)."""
    from numba_flash import mods

    ids = np.zeros(4096, np.int32)
    table = np.zeros((16, 257), np.float32)
    return [(mods.softcap(50.0), None),
            (None, mods.sliding_window(1024)),
            (mods.alibi(mods.alibi_slopes(16)), mods.document(ids)),
            (mods.compose(mods.relative_position_bias(table), mods.softcap(30.0)),
             mods.or_masks(mods.prefix_lm(64), mods.causal_mask))]


def mod_kernels(head_dim):
    """The forward and both backward passes with each ``mod_pairs`` pair, causal or not, every precision, at the
    default tiles (a mask_mod's tiles come as lists: HAS_MASK; a score_mod takes the scaled-first path)."""
    from numba_flash import mods
    from numba_flash.kernels.fast.mod_steps import mod_steps

    for precision, (score_mod, mask_mod), causal in itertools.product(PRECISIONS, mod_pairs(), (False, True)):
        tiles = tiles_for_head_dim(FORWARD_BLOCK_SIZES["tf32x3" if precision == "tf32x3" else "f16"], head_dim)
        has_mask = mask_mod is not None
        fast(make_forward(*tiles, head_dim, precision, True, causal, has_mask, False, POSITIVE_SCALE=score_mod is None,
                          MODS=mod_steps(score_mod, mask_mod)))
        steps = mod_steps(score_mod, mask_mod, backward=True)
        fast(make_dkdv(128, 64, head_dim, precision, True, causal, has_mask, False, MODS=steps))
        fast(make_dq(128, 64, head_dim, precision, True, causal, has_mask, False, MODS=steps))
    # The dQ kernel that sums a learned relative-bias table's bins (``kernels/fast/bias_table.py``), every precision.
    table = mod_steps(mods.relative_position_bias(np.zeros((2, 257), np.float32)), None, backward=True)
    for precision, causal in itertools.product(PRECISIONS, (False, True)):
        fast(make_dq(128, 64, head_dim, precision, True, causal, False, False, MODS=table, TABLE_REACH=128))


def mod_tile_kernels():
    """The classification kernel of each ``mod_pairs`` mask_mod (its arrays as NumPy ones arrive) and the coarsening
    kernel (``sparsity/mod_tiles.py``: ``numba_flash.tile_mask``)."""
    from numba import typeof
    from numba_flash.sparsity import mod_tiles

    classes = T.Array(T.uint8, 1, "C")
    for _, mask_mod in mod_pairs():
        if mask_mod is not None:
            kernel = mod_tiles._classifier(mask_mod)
            check(f"classify_tiles_{mask_mod.name}", kernel.py_func, (classes,) + (T.int64,) * 7
                  + tuple(typeof(np.ascontiguousarray(a)) for a in mask_mod.arrays))
    check("coarsen_tile_classes", mod_tiles.coarsen.py_func, (classes, T.int64, T.int64, classes) + (T.int64,) * 4)


def hopper_mod_kernels(head_dims, element="f16"):
    """The wgmma kernels with each ``mod_pairs`` pair, causal or not: the forward's loops (plain, overlapped, two
    warpgroups), the dK/dV kernel in every way of summing dQ, and the dQ kernel (a mask_mod's tiles come as lists
    with the element test: HAS_MASK, PARTLY_MASKED); then the dQ kernel that sums a relative-bias table's gradient.  float16 only: bfloat16 differs in the packing alone."""
    from numba_flash import mods
    from numba_flash.kernels.fast.mod_steps import mod_steps
    from numba_flash.kernels.hopper.backward import make_wgmma_dkdv, make_wgmma_dq
    from numba_flash.kernels.hopper.dq_sums import DQ_MODES, key_warpgroups
    from numba_flash.kernels.hopper.forward import make_wgmma_forward

    for d, (score_mod, mask_mod), causal in itertools.product(head_dims, mod_pairs(), (False, True)):
        has_mask = mask_mod is not None
        steps = mod_steps(score_mod, mask_mod)
        for overlap, warpgroups in ((False, 1), (True, 1), (False, 2)):
            fast(make_wgmma_forward(d, element, causal, overlap, warpgroups, has_mask, True, MODS=steps), "sm_90a")
        steps = mod_steps(score_mod, mask_mod, backward=True)
        for dq_mode in DQ_MODES:
            if key_warpgroups(dq_mode) == 1:   # (the bulk modes take no mods yet: ``dq_mode_for``)
                fast(make_wgmma_dkdv(d, element, causal, dq_mode, has_mask, True, MODS=steps), "sm_90a")
        fast(make_wgmma_dq(d, element, causal, has_mask, True, MODS=steps), "sm_90a")
    for d, causal in itertools.product(head_dims, (False, True)):   # the dQ kernel that sums a learned table's bins
        steps = mod_steps(mods.relative_position_bias(np.zeros((2, 257), np.float32)), None, backward=True)
        fast(make_wgmma_dq(d, element, causal, False, True, MODS=steps, TABLE_REACH=128), "sm_90a")


def varlen_cache_mod_kernels(head_dim):
    """The mods on packed sequences (forward and both backward passes, every ``mod_pairs`` pair; no tile lists:
    the mask_mod tested on every tile) and on KV caches: split keys, four key warps on a paged cache, and
    ``decode_plan``'s packed query groups (causal N_q = 4, and one query, packed for the mods' sake), with Gemma 2's
    pair (a softcap, a sliding window) and the composed one."""
    from numba_flash import mods
    from numba_flash.decode_plan import decode_plan
    from numba_flash.kernels.fast.mod_steps import mod_steps

    tiles = tiles_for_head_dim(FORWARD_BLOCK_SIZES["f16"], head_dim)
    for precision, (score_mod, mask_mod) in itertools.chain(itertools.product(("f16",), mod_pairs()),
                                                            [("tf32x3", mod_pairs()[-1])]):
        f32_tiles = tiles_for_head_dim(FORWARD_BLOCK_SIZES["tf32x3"], head_dim)
        fast(make_forward(*(f32_tiles if precision == "tf32x3" else tiles), head_dim, precision, True, True, False,
                          False, True, POSITIVE_SCALE=score_mod is None, MODS=mod_steps(score_mod, mask_mod)))
        steps = mod_steps(score_mod, mask_mod, backward=True)
        fast(make_dkdv(128, 64, head_dim, precision, True, True, False, False, True, MODS=steps))
        fast(make_dq(128, 64, head_dim, precision, True, True, False, False, True, MODS=steps))
    gemma = (mods.softcap(50.0), mods.sliding_window(4096))
    for score_mod, mask_mod in (gemma, mod_pairs()[-1]):
        steps = mod_steps(score_mod, mask_mod)
        fast(make_forward(*decode_block_sizes(1, head_dim, "f16"), head_dim, "f16", True, False, False, False, "cache",
                          True, POSITIVE_SCALE=False, MODS=steps))
        fast(make_forward(*default_tile(1, head_dim, 2, True)[:2], head_dim, "f16", True, False, False, False, "cache",
                          True, POSITIVE_SCALE=False, KEY_WARPS=4, PAGED=True, MODS=steps))
        for n_q in (4, 1):
            plan = decode_plan(16, 32, 8, n_q, 8192, head_dim, 2)
            fast(make_forward(*plan.block_sizes, head_dim, "f16", True, n_q > 1, False, False, "cache", plan.splits > 1,
                              POSITIVE_SCALE=False, WARP_ROWS=plan.warp_rows, KV_STAGES=plan.kv_stages,
                              KEY_WARPS=plan.key_warps, QUERY_GROUPS=plan.packed, MODS=steps))


def main(argv):
    global PTX_DIR
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", nargs="?", default="flags", choices=("flags", "tiles", "hopper", "decode",
                                                                            "mods", "hopper-mods",
                                                                            "mods_varlen_cache"))
    parser.add_argument("shard", nargs="?", default="0/1")
    parser.add_argument("--ptx", default=None, help="folder for each kernel's PTX")
    parser.add_argument("--head-dim", type=int, default=None, help="64 (hopper: 64, 96, 128 and 256) unless given")
    args = parser.parse_args(argv)
    head_dims = (args.head_dim,) if args.head_dim else (64, 96, 128, 256)
    args.head_dim = args.head_dim or 64
    PTX_DIR = args.ptx
    if PTX_DIR:
        os.makedirs(PTX_DIR, exist_ok=True)
    if args.mode == "hopper":
        hopper(head_dims)
        return f"{len(failures)} failed: {failures}" if failures else 0
    if args.mode == "decode":
        planned_decoding(head_dims=(args.head_dim,) if "--head-dim" in argv else (64, 128))
        return f"{len(failures)} failed: {failures}" if failures else 0
    if args.mode == "mods":
        mod_tile_kernels()
        mod_kernels(args.head_dim)
        varlen_cache_mod_kernels(args.head_dim)
        return f"{len(failures)} failed: {failures}" if failures else 0
    if args.mode == "mods_varlen_cache":
        varlen_cache_mod_kernels(args.head_dim)
        return f"{len(failures)} failed: {failures}" if failures else 0
    if args.mode == "hopper-mods":
        hopper_mod_kernels(head_dims)
        return f"{len(failures)} failed: {failures}" if failures else 0
    if args.mode == "tiles":
        # Every tile shape of the GPU test profile (tests/strategies.py), with dropout alone and with
        # every flag on: NVVM's rejections have depended on the tile shape (B_c = 64 with dropout).
        shard, shards = (int(x) for x in args.shard.split("/"))
        jobs = [(p, (r, c), flags) for p in PRECISIONS for r in (16, 48, 64, 128) for c in (16, 48, 64)
                for flags in ((False, False, True), (True, True, True))]
        for precision, tiles, flags in jobs[shard::shards]:
            flash2(precision, True, *flags, tiles=tiles, head_dim=args.head_dim)
        return f"{len(failures)} failed: {failures}" if failures else 0
    for transpose in (True, False):
        check(f"matmul {transpose}", make_batched_matmul(16, transpose).py_func, (a3, a3, a3, T.float64))
    for c, m, d in itertools.product((False, True), repeat=3):
        check(f"softmax {c}{m}{d}", make_row_softmax(128, c, m, d).py_func, (a3, a3, l2, T.int64, u8, T.int64,
                                                                             T.int64) + drop)
        check(f"flash1 fwd {c}{m}{d}", make_flash1_forward(48, 48, 64, c, m, d).py_func,
              (a3, a3, a3, a3, l2, l2, l2, T.float64, T.int64, u8) + drop)
        check(f"flash1 bwd {c}{m}{d}", make_flash1_backward(16, 24, 64, c, m, d).py_func,
              (a3,) * 5 + (l2,) + (a3,) * 3 + (T.float64, T.int64, u8) + drop)
    for precision in PRECISIONS:
        fast(make_preprocess(precision))
        for vec, c, m, d in itertools.product((True, False), (False, True), (False, True), (False, True)):
            flash2(precision, vec, c, m, d, head_dim=args.head_dim)
        for vec, c, d in itertools.product((True, False), (False, True), (False, True)):  # packed: no block masks
            flash2(precision, vec, c, False, d, head_dim=args.head_dim, varlen=True)
        decode(precision, args.head_dim)
        for vec, causal in itertools.product((True, False), (False, True)):  # the kernel for a scale <= 0
            fast(make_forward(*tiles_for_head_dim(FORWARD_BLOCK_SIZES["tf32x3" if precision == "tf32x3" else "f16"],
                                                  args.head_dim), args.head_dim, precision, vec, causal, False, False,
                              POSITIVE_SCALE=False))
    for element, paged in itertools.product((np.float32, np.uint16), (False, True)):
        fast(make_append(element, paged))
    return f"{len(failures)} failed: {failures}" if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
