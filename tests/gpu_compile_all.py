"""Compile every kernel specialisation the API can launch for sm_90 and run ptxas on it.

Not a pytest module: it needs Numba's real CUDA target (NVVM; no GPU) and
CUDA's ptxas on PATH.  It catches what the simulator cannot: kernels that do
not type or compile on the GPU target, spills and stack frames.

    NUMBA_ENABLE_CUDASIM=0 python3 tests/gpu_compile_all.py            # every flag, default tiles
    NUMBA_ENABLE_CUDASIM=0 python3 tests/gpu_compile_all.py tiles I/N  # every tile the GPU tests draw, shard I of N

Kernels compile with line info, as ``cuda_kernel`` compiles them on a GPU.
Use the NVVM and ptxas of the CUDA version the GPU machine has (13.x:
``pip install "numba-cuda[cu13]" "nvidia-cuda-nvcc==13.*"``, its ptxas first on
PATH): NVVM 12 accepts IR that NVVM 13 rejects.
"""
import itertools
import os
import subprocess
import sys
import types
import numba_flash  # noqa: F401  (the NumPy compatibility fix, before compiling)
from numba import cuda, types as T
from numba.cuda import dispatcher

# Device functions that are not inlined by Numba compile for the current
# device's compute capability; without a driver, say sm_90.
dispatcher.get_current_device = lambda: types.SimpleNamespace(compute_capability=(9, 0))
from numba_flash.kernels.fast.forward import make_flash2_forward
from numba_flash.kernels.fast.backward import make_flash2_backward_dkdv, make_flash2_backward_dq, preprocess
from numba_flash.kernels.literal.flash1_forward import make_flash1_forward
from numba_flash.kernels.literal.flash1_backward import make_flash1_backward
from numba_flash.kernels.literal.standard_attention import make_batched_matmul, make_row_softmax
a3 = T.Array(T.float32, 3, "C"); l2 = T.Array(T.float32, 2, "C"); u8 = T.Array(T.uint8, 3, "C")
i2 = T.Array(T.int32, 2, "C"); i1 = T.Array(T.int32, 1, "C")
drop = (T.int64, T.float64, T.int64, T.int64)
failures = []


def check(name, fn, sig, fastmath=False):
    try:
        ptx, _ = cuda.compile_ptx(fn.py_func, sig, cc=(9, 0), fastmath=fastmath, lineinfo=True)  # as cuda_kernel does
    except Exception as exc:  # report every specialisation that fails, not only the first
        failures.append(name)
        print(name, "FAILED:", str(exc).splitlines()[0], flush=True)
        return
    path = f"/tmp/compile_all_{os.getpid()}.ptx"
    open(path, "w").write(ptx)
    out = subprocess.run(["ptxas", "-arch=sm_90", "-v", path, "-o", "/dev/null"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    info = [l.split("info    : ")[-1] for l in out.stderr.splitlines() if "Used" in l or "spill stores" in l]
    print(name, " | ".join(x.strip() for x in info), flush=True)
def flash2_forward(f16, vec, c, m, d, bm=None, bn=None):
    bm, bn = (bm, bn) if bm else ((128, 64) if f16 else (128, 32))
    word = (T.uint32 if vec else T.float16) if f16 else T.float32
    flat = T.Array(word, 1, "C")
    sig = (flat,) * 4 + (l2, T.int64, T.int64, T.int64, T.float64, i2, i1, u8, T.int64, T.int64) + drop
    check(f"flash2 {bm}x{bn} f16={f16} vec={vec} causal={c} mask={m} drop={d}",
          make_flash2_forward(bm, bn, 64, c, f16, vec, m, d), sig, True)


def flash2_backward(f16, vec, c, m, d, bm=64, bn=32):
    word = (T.uint32 if vec else T.float16) if f16 else T.float32
    flat = T.Array(word, 1, "C")
    tail = (T.int64, T.int64, T.int64, T.float64, T.float64, i2, i1, u8, T.int64, T.int64) + drop
    name = f"{bm}x{bn} f16={f16} vec={vec} causal={c} mask={m} drop={d}"
    check(f"flash2 bwd dkdv {name}", make_flash2_backward_dkdv(bm, bn, 64, c, f16, vec, m, d),
          (flat,) * 4 + (l2, l2) + (flat,) * 2 + tail, True)
    check(f"flash2 bwd dq {name}", make_flash2_backward_dq(bm, bn, 64, c, f16, vec, m, d),
          (flat,) * 4 + (l2, l2) + (flat,) + tail, True)


if sys.argv[1:2] == ["tiles"]:
    # Every tile shape of the GPU test profile (tests/strategies.py), with dropout alone and with
    # every flag on: NVVM's rejections have depended on the tile shape (B_c = 64 with dropout).
    shard, shards = (int(x) for x in (sys.argv[2] if len(sys.argv) > 2 else "0/1").split("/"))
    rows, cols = (16, 48, 64, 128), (8, 16, 48, 64)
    jobs = [(flash2_forward, f16, r, col, flags) for f16 in (False, True) for r in rows for col in cols
            if col % (16 if f16 else 8) == 0 for flags in ((False, False, True), (True, True, True))]
    jobs += [(flash2_backward, f16, r, col, flags) for f16 in (False, True) for r in rows for col in cols
             if col % 16 == 0 for flags in ((False, False, True), (True, True, True))]
    for fn, f16, r, col, flags in jobs[shard::shards]:
        fn(f16, True, *flags, bm=r, bn=col)
    sys.exit(f"{len(failures)} failed: {failures}" if failures else 0)
for tb in (True, False):
    check(f"matmul {tb}", make_batched_matmul(16, tb), (a3, a3, a3, T.float64))
for c, m, d in itertools.product((False, True), repeat=3):
    check(f"softmax {c}{m}{d}", make_row_softmax(128, c, m, d), (a3, a3, l2, u8, T.int64, T.int64) + drop)
    check(f"flash1 fwd {c}{m}{d}", make_flash1_forward(48, 48, 64, c, m, d), (a3, a3, a3, a3, l2, l2, l2, T.float64, u8) + drop)
    check(f"flash1 bwd {c}{m}{d}", make_flash1_backward(16, 24, 64, c, m, d), (a3,) * 5 + (l2,) + (a3,) * 3 + (T.float64, u8) + drop)
for f16, vec, c, m, d in itertools.product((False, True), (True, False), (False, True), (False, True), (False, True)):
    flash2_forward(f16, vec, c, m, d)
for f16, vec, c, m, d in itertools.product((False, True), (True, False), (False, True), (False, True), (False, True)):
    flash2_backward(f16, vec, c, m, d)
for dtype in (T.float32, T.float16):
    check(f"flash2 bwd preprocess {dtype}", preprocess, (T.Array(dtype, 3, "C"),) * 2 + (l2,))
sys.exit(f"{len(failures)} failed: {failures}" if failures else 0)
