"""SASS instruction counts of the 16-bit flash2 kernels, compiled for sm_90 without a GPU.

``--hopper``: the wgmma forward of ``kernels/hopper`` instead, compiled for sm_90a (its products
show as HGMMA, the waits for them as WARPGROUP.DEPBAR).  ``--decode``: the decoding kernel (one-warp
blocks of 16 query rows, 16-key tiles, split keys) at d = 128 with 2, 3 and 4 K/V buffers
(``attention_with_kv_cache``'s ``kv_stages``; LDGDEPBAR and DEPBAR are cp.async's commits and waits).

Each kernel is compiled to PTX by Numba (NVVM), assembled by ptxas and
disassembled by cuobjdump; the table counts a few opcodes in the machine code
(static counts: an instruction in a loop counts once) with ptxas's registers and
spill stores.  It is the evidence for changes to how fragments move (shared loads
LDS against ldmatrix's LDSM, the HMMA products, barriers), to set beside timings
taken on a GPU.

    NUMBA_ENABLE_CUDASIM=0 PATH=<CUDA 13 bin with ptxas, cuobjdump, nvdisasm>:$PATH \\
        python3 experiments/tuning/sass_counts.py [--hopper] [--out FILE.md]

ptxas, cuobjdump and nvdisasm come with the CUDA toolkit (on the GPU machine), or
from pip: nvidia-cuda-nvcc, nvidia-cuda-cuobjdump, nvidia-cuda-nvdisasm (13.x).
"""
import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
import types

import numba_flash  # noqa: F401  (the NumPy compatibility fix, before compiling)
import numba_flash.runtime.device  # noqa: E402
import numba_flash.tiling  # noqa: E402
from numba import cuda
from numba.cuda import dispatcher

# Device functions that Numba does not inline compile for the current device; without a driver, sm_90.
dispatcher.get_current_device = lambda: types.SimpleNamespace(compute_capability=(9, 0))
# Sizes that depend on the device's limits (flash2's K/V buffers) take the H200's.
numba_flash.tiling.device_limits = lambda: numba_flash.runtime.device.SIMULATED_DEVICE
from numba_flash.kernels.fast.backward import make_dkdv, make_dq  # noqa: E402
from numba_flash.kernels.fast.forward import make_forward  # noqa: E402

OPCODES = ("LDS", "LDSM", "HMMA", "STS", "LDG", "LDGSTS", "BAR", "FFMA", "MUFU", "F2FP", "SHFL")
DECODE_OPCODES = ("LDSM", "HMMA", "LDGSTS", "LDGDEPBAR", "DEPBAR", "BAR", "FFMA", "MUFU", "SHFL", "LDL", "STL")
HOPPER_OPCODES = ("HGMMA", "WARPGROUP", "LDGSTS", "BAR", "FFMA", "MUFU", "F2FP", "SHFL", "STG", "LDL", "STL")
#: (head dim, forward tiles): the default tiles at both head dims (tiling.FORWARD_BLOCK_SIZES), the forward with
#: warps of 16 and of 32 query rows; backward (128, 64).
CASES = ((64, (128, 64)), (128, (128, 64)))


def kernels(precision):
    for d, tiles in CASES:
        for warp_rows in (16, 32):  # both sides of tiling.FORWARD_WARP_ROWS
            yield make_forward(*tiles, d, precision, True, False, False, False, WARP_ROWS=warp_rows)
            yield make_forward(*tiles, d, precision, True, True, False, False, WARP_ROWS=warp_rows)
        yield make_dkdv(128, 64, d, precision, True, False, False, False)
        yield make_dq(128, 64, d, precision, True, False, False, False)


def decode_kernels():
    """The decoding kernel at its default tiles for d = 128 (``tiling.decode_block_sizes``), with 2-4 buffers."""
    from numba_flash.tiling import decode_block_sizes

    block_m, block_n = decode_block_sizes(1, 128, "f16")
    for stages in (2, 3, 4):
        yield make_forward(block_m, block_n, 128, "f16", True, False, False, False, True, True, KV_STAGES=stages)


def sass_counts(kernel, folder):
    """(registers, spill store bytes, opcode counts, hot loop) of one ``runtime.launch.Kernel`` at its signature."""
    signature = tuple(kernel.param_type(p) for p in kernel.params)
    return machine_code(kernel.dispatcher.py_func, signature, kernel.launch_bounds,
                        folder)


def hopper_kernels():
    """(name, Python function, signature, launch bounds) of the wgmma forward at d = 64, 96 and 128, dense and causal,
    both loops, blocks of one warpgroup and of two."""
    from numba import types as nt

    from numba_flash.kernels.hopper.forward import WARPGROUP_COUNTS, make_wgmma_forward

    words = nt.uint32[::1]
    signature = (words,) * 4 + (nt.float32[::1],) + (nt.int64,) * 18 + (nt.float64,)
    for warpgroups in WARPGROUP_COUNTS:
        for d in (64, 96, 128):   # d = 96 on d = 128's layout (common.layout_dim)
            for causal in (False, True):
                for overlap in (False, True):   # each product waited for at once, or S_{j+1} beside the softmax
                    kernel = make_wgmma_forward(d, "f16", causal, overlap, warpgroups)
                    yield kernel.name, kernel.dispatcher.py_func, signature, kernel.launch_bounds


def machine_code(py_func, signature, launch_bounds, folder, arch="sm_90"):
    """(registers, spill store bytes, opcode counts, hot loop) of a kernel function compiled for ``arch``."""
    ptx, _ = cuda.compile_ptx(py_func, signature, cc=(9, 0, "a") if arch == "sm_90a" else (9, 0), lineinfo=True,
                              launch_bounds=launch_bounds)
    ptx_path, cubin = os.path.join(folder, "k.ptx"), os.path.join(folder, "k.cubin")
    with open(ptx_path, "w") as f:
        f.write(ptx)
    assembled = subprocess.run(["ptxas", f"-arch={arch}", "-v", ptx_path, "-o", cubin], capture_output=True,
                               text=True, check=True)
    registers = int(re.search(r"Used (\d+) registers", assembled.stderr).group(1))
    spills = int(re.search(r"(\d+) bytes spill stores", assembled.stderr).group(1))
    sass = subprocess.run(["cuobjdump", "-sass", cubin], capture_output=True, text=True, check=True).stdout
    ops = collections.Counter(m.group(1) for m in re.finditer(r"/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)",
                                                               sass))
    return registers, spills, ops, hot_loop(sass)


def hot_loop(sass):
    """(instructions, HMMA) of the body of the backward branch whose body holds the most HMMA: the
    inner loop, counted once per iteration (at d = 128 the compiler may split an iteration over more
    than one such body, so compare kernels of the same d)."""
    lines = [(int(m.group(1), 16), m.group(2)) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    best = (0, 0)
    for address, text in lines:
        branch = re.search(r"BRA\s+(?:`\(.*?\)\s*)?0x([0-9a-f]+)", text)
        if branch and int(branch.group(1), 16) < address:
            body = [t for a, t in lines if int(branch.group(1), 16) <= a <= address]
            hmma = sum("HMMA" in t or "HGMMA" in t for t in body)
            if (hmma, -len(body)) > (best[1], -best[0]):
                best = (len(body), hmma)
    return best


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="also write the table to this markdown file")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--hopper", action="store_true", help="the wgmma forward (sm_90a) instead")
    which.add_argument("--decode", action="store_true", help="the decoding kernel with 2-4 K/V buffers instead")
    args = parser.parse_args(argv)
    opcodes = HOPPER_OPCODES if args.hopper else DECODE_OPCODES if args.decode else OPCODES
    lines = ["| kernel | registers | spill bytes | loop instructions | loop HMMA | " + " | ".join(opcodes) + " |",
             "|---|---|---|---|---|" + "---|" * len(opcodes)]
    with tempfile.TemporaryDirectory() as folder:
        if args.hopper:
            for name, py_func, signature, bounds in hopper_kernels():
                registers, spills, ops, (loop, loop_hmma) = machine_code(py_func, signature, bounds, folder, "sm_90a")
                lines.append(f"| {name} | {registers} | {spills} | {loop} | {loop_hmma} | "
                             + " | ".join(str(ops.get(op, 0)) for op in opcodes) + " |")
                print(lines[-1], flush=True)
        flash2 = (list(decode_kernels()) if args.decode else [] if args.hopper
                  else [kernel for precision in ("f16", "bf16") for kernel in kernels(precision)])
        for kernel in flash2:
            registers, spills, ops, (loop, loop_hmma) = sass_counts(kernel, folder)
            lines.append(f"| {kernel.name} | {registers} | {spills} | {loop} | {loop_hmma} | "
                         + " | ".join(str(ops.get(op, 0)) for op in opcodes) + " |")
            print(lines[-1], flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
