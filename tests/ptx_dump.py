"""Dump the PTX of the flash2 kernels to a folder, to check that a refactor leaves the GPU code alone.

Not a pytest module: it needs Numba's real CUDA target (NVVM; no GPU):

    NUMBA_ENABLE_CUDASIM=0 python3 tests/ptx_dump.py /tmp/before   # on the old tree
    NUMBA_ENABLE_CUDASIM=0 python3 tests/ptx_dump.py /tmp/after    # on the new tree
    diff -r /tmp/before /tmp/after

Line info and mangled names are removed, so only code differences remain.
"""
import itertools, os, re, sys, types
import numba_flash  # noqa
from numba import cuda, types as T
from numba.cuda import dispatcher
dispatcher.get_current_device = lambda: types.SimpleNamespace(compute_capability=(9, 0))
from numba_flash.kernels.fast.forward import make_flash2_forward
from numba_flash.kernels.fast.backward import make_flash2_backward_dkdv, make_flash2_backward_dq
out = sys.argv[1]
os.makedirs(out, exist_ok=True)
l2 = T.Array(T.float32, 2, "C"); u8 = T.Array(T.uint8, 3, "C"); i2 = T.Array(T.int32, 2, "C"); i1 = T.Array(T.int32, 1, "C")
drop = (T.int64, T.float64, T.int64, T.int64)
def clean(ptx):
    ptx = re.sub(r"_ZN[0-9A-Za-z_]+", "SYM", ptx)
    return "\n".join(l for l in ptx.splitlines() if not l.strip().startswith((".loc", ".file", "//")))
for f16, vec, c, m, d in itertools.product((False, True), (True, False), (False, True), (False, True), (False, True)):
    if (m or d) and not vec:
        continue
    word = (T.uint32 if vec else T.float16) if f16 else T.float32
    flat = T.Array(word, 1, "C")
    bm, bn = (128, 64) if f16 else (128, 32)
    sig = (flat,) * 4 + (l2, T.int64, T.int64, T.int64, T.float64, i2, i1, u8, T.int64, T.int64) + drop
    name = f"f16{int(f16)}_vec{int(vec)}_c{int(c)}_m{int(m)}_d{int(d)}"
    ptx, _ = cuda.compile_ptx(make_flash2_forward(bm, bn, 64, c, f16, vec, m, d).py_func, sig, cc=(9, 0), fastmath=True)
    open(f"{out}/fwd_{name}.ptx", "w").write(clean(ptx))
    tail = (T.int64, T.int64, T.int64, T.float64, T.float64, i2, i1, u8, T.int64, T.int64) + drop
    if not m and not d:
        ptx, _ = cuda.compile_ptx(make_flash2_backward_dkdv(64, 32, 64, c, f16, vec, m, d).py_func, (flat,) * 4 + (l2, l2) + (flat,) * 2 + tail, cc=(9, 0), fastmath=True)
        open(f"{out}/dkdv_{name}.ptx", "w").write(clean(ptx))
        ptx, _ = cuda.compile_ptx(make_flash2_backward_dq(64, 32, 64, c, f16, vec, m, d).py_func, (flat,) * 4 + (l2, l2) + (flat,) + tail, cc=(9, 0), fastmath=True)
        open(f"{out}/dq_{name}.ptx", "w").write(clean(ptx))
    print(name, flush=True)
