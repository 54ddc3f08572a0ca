"""Hopper's warpgroup matrix multiply (``wgmma.mma_async``) from Numba: the building blocks.

numba-cuda has no warpgroup instructions; these intrinsics emit them as inline
PTX, which needs the arch-specific target sm_90a (``enable_sm90a``: numba-cuda
then writes ``.target sm_90a``).  PTX ISA, "Asynchronous Warpgroup Level Matrix
Multiply-Accumulate".  How the pieces fit:

* A warpgroup is 4 consecutive warps (128 threads, the first warp's index a
  multiple of 4).  ``wgmma`` m64nNk16 adds A (64 x 16) times B (16 x N) into a
  64 x N float32 accumulator spread over the warpgroup's registers, N / 2 per
  thread.  B always comes from shared memory, named by a 64-bit *descriptor*;
  A from shared memory too ("SS", ``wgmma_ss``) or from registers ("RS",
  ``wgmma_rs``: P in attention's O += P V, straight from the softmax).
* The product is asynchronous: ``wgmma_fence`` orders this thread's earlier
  register writes (of the accumulator, or of A) before the products read
  them; ``wgmma_commit`` closes a group of issued products; ``wgmma_wait(k)``
  waits until at most k groups are in flight, after which the accumulators of
  the finished ones may be read.
* Shared memory written by ordinary stores reaches the tensor cores' (the
  "async proxy's") view only after ``fence_proxy_async`` in each writing thread,
  before the barrier that publishes it.

Layouts (the 128-byte swizzle; ``experiments/tuning/wgmma_layouts.py`` checks each row
of this table against NumPy on a GPU, candidates side by side):

=========================  =====================================================================
accumulator D (m64nN, f32)  register i of thread 32 w + 4 g + t: row 16 w + g + 8 ((i % 4) // 2),
                            column 8 (i // 4) + 2 t + (i % 2) (per 8 columns, mma.sync's C fragment)
A from registers (m64k16)   four 16-bit pairs: (16 w + g, 2t:2t+2), (16 w + g + 8, 2t:2t+2),
                            (16 w + g, 2t+8:2t+10), (16 w + g + 8, 2t+8:2t+10): mma.sync's A fragment
K-major tile (rows x 64     row r's 16-byte chunk c at byte r * 128 + 16 (c ^ (r % 8)): ``swizzle_128``
16-bit elements)            of the unswizzled offset, atoms of 8 rows (1024 bytes, 1024-aligned); a
                            wider row is several such tiles one after another (64 columns each)
K-major descriptor          start = tile + 32 bytes per k-step of 16 (next 64-column tile after 4),
                            stride byte offset 1024 (8-row groups), leading offset unused, swizzle 1
MN-major tile (B = V: keys  the same swizzle with rows = keys and the 128 bytes along N; transposed
x d, d contiguous)          by the instruction (``trans_b``); start = tile + 2048 per k-step of 16
=========================  =====================================================================

The simulator has no warpgroup instructions: under ``NUMBA_ENABLE_CUDASIM=1``
each name here is bound to a twin that reads the operands the way this table
says the tensor cores do (see the twins below), so a kernel written against
this module runs in the simulator and its staging, descriptors and fragment
handling are checked there against the table.  Whether the table is the
hardware's only a GPU can say (``experiments/tuning/wgmma_layouts.py``).
"""
from functools import lru_cache

from numba import uint64
from numba.cuda import config

from ...runtime.launch import inlined_device_function
from ..fast.primitives import ptx_statement

#: Bytes of one row of a swizzled tile: 64 16-bit elements.
ROW_BYTES = 128
#: Swizzle modes of a descriptor's bits 62-63.
SWIZZLE_NONE, SWIZZLE_128B, SWIZZLE_64B, SWIZZLE_32B = 0, 1, 2, 3
#: Bytes of one 128-byte-swizzle atom: 8 rows of 128 bytes (its tiles start on this boundary).
ATOM_BYTES = 1024


def enable_sm90a():
    """Compile from now on for sm_90a (wgmma, setmaxnreg need the arch-specific target).  Process-wide:
    numba-cuda reads it when it next compiles; the sm_90a code runs only on compute capability 9.0."""
    config.FORCE_CUDA_CC = (9, 0, "a")


def swizzle_128(offset):
    """The byte where the 128-byte swizzle puts byte ``offset`` of a 1024-aligned tile: within each 8-row
    atom of 128-byte rows, row r's 16-byte chunks are permuted by XOR with r % 8."""
    return offset ^ (((offset >> 7) & 7) << 4)


def staged_offset(row, col, rows):
    """Byte offset, before the swizzle, of element (row, col) of an operand stored as 64-column tiles of
    ``rows`` rows of ROW_BYTES each (a K-major Q or K, or an MN-major V: the table above)."""
    return (col // 64) * rows * ROW_BYTES + row * ROW_BYTES + (col % 64) * 2


def accumulator_entries(member, n):
    """(rows, columns) of registers 0 .. n / 2 - 1 of thread ``member`` (0-127) of an m64nN accumulator."""
    import numpy as np

    w, g, t = member // 32, (member % 32) // 4, member % 4
    i = np.arange(n // 2)
    return 16 * w + g + 8 * ((i % 4) // 2), 8 * (i // 4) + 2 * t + i % 2


def descriptor(address, leading_bytes, stride_bytes, swizzle):
    """A wgmma matrix descriptor: the shared-memory start address (bits 0-13), the leading-dimension
    and stride-dimension byte offsets (bits 16-29, 32-45), each >> 4, and the swizzle mode (62-63)."""
    return (uint64((address >> 4) & 0x3FFF) | (uint64((leading_bytes >> 4) & 0x3FFF) << uint64(16))
            | (uint64((stride_bytes >> 4) & 0x3FFF) << uint64(32)) | (uint64(swizzle & 3) << uint64(62)))


def advanced(desc, offset_bytes):
    """``desc`` with its start address ``offset_bytes`` (a multiple of 16) further on.  The start is the low
    field, address >> 4 in 14 bits, and every shared address is below 2^18 bytes (228 KB on Hopper), so the
    sum stays inside the field: one 64-bit add of a constant, where building the descriptor again costs
    shifts, masks and ors (about six uniform instructions per product in the SASS)."""
    return desc + uint64(offset_bytes >> 4)


#: The four above as device functions (the host's are for building layouts and tests).
swizzle_128_device = inlined_device_function(swizzle_128)
staged_offset_device = inlined_device_function(staged_offset)
descriptor_device = inlined_device_function(descriptor)
advanced_device = inlined_device_function(advanced)


#: Instructions without operands (in the simulator, where a twin's product is complete when it returns, they
#: have nothing to order and do nothing: ``primitives.ptx_statement``).
wgmma_fence = ptx_statement("wgmma.fence.sync.aligned;")
wgmma_commit = ptx_statement("wgmma.commit_group.sync.aligned;")
fence_proxy_async = ptx_statement("fence.proxy.async.shared::cta;")


@lru_cache(maxsize=None)
def wgmma_wait(pending):
    """wait_group ``pending``: until at most that many committed groups are still in flight."""
    return ptx_statement(f"wgmma.wait_group.sync.aligned {int(pending)};")


if not config.ENABLE_CUDASIM:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    _F32, _I32, _I64 = ir.FloatType(), ir.IntType(32), ir.IntType(64)

    @intrinsic
    def shared_address(typingctx, array):
        """The shared-window address (32 bits) of a shared array's first element."""
        def codegen(context, builder, sig, args):
            from numba.cuda.np.arrayobj import make_array
            data = make_array(sig.args[0])(context, builder, args[0]).data
            shared = builder.addrspacecast(data, ir.PointerType(data.type.pointee, 3))
            return builder.ptrtoint(shared, _I32)
        return types.uint32(array), codegen

    def _product(n, element, trans_b, a_from_registers, trans_a=False, fresh=False):
        registers = n // 2
        a_operands = 4 if a_from_registers else 1
        # Operands: D (registers, in and out), A (4 words or a descriptor), B's descriptor, then scale-d.
        a_text = ("{" + ", ".join(f"${registers + i}" for i in range(4)) + "}" if a_from_registers
                  else f"${registers}")
        b_index = registers + a_operands
        transpose = f"{int(trans_b)}" if a_from_registers else f"{int(trans_a)}, {int(trans_b)}"
        text = ("{ .reg .pred p; setp.ne.b32 p, $" + str(b_index + 1) + ", 0; "
                f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{element}.{element} "
                "{" + ", ".join(f"${i}" for i in range(registers)) + "}, "
                f"{a_text}, ${b_index}, p, 1, 1, {transpose}; }}")
        a_types = [_I32] * 4 if a_from_registers else [_I64]
        constraints = ",".join(["=f"] * registers + (["r"] * 4 if a_from_registers else ["l"]) + ["l", "r"]
                               + [str(i) for i in range(registers)])
        function = ir.FunctionType(ir.LiteralStructType([_F32] * registers), a_types + [_I64, _I32]
                                   + [_F32] * registers)

        def codegen(context, builder, sig, args):
            from numba.cuda.np.arrayobj import make_array
            # The accumulator is a local array, read whole before and written whole after the instruction: with
            # constant indices LLVM keeps it in registers, which the product then names.
            # fresh: scale-d 0 (D = A B) and the old contents not read, so that no zeros are moved into the
            # registers after the fence while other products are in flight (ptxas would wait for them: C7517).
            data = make_array(sig.args[0])(context, builder, args[0]).data
            slots = [builder.gep(data, [ir.Constant(_I32, i)]) for i in range(registers)]
            a_values = args[1:-1]
            if a_from_registers:
                a_values = [builder.extract_value(a_values[0], i) for i in range(4)]
            old = [ir.Constant(_F32, ir.Undefined) if fresh else builder.load(x) for x in slots]
            out = builder.call(ir.InlineAsm(function, text, constraints, side_effect=True),
                               list(a_values) + [args[-1], ir.Constant(_I32, 0 if fresh else 1)] + old)
            for i, slot in enumerate(slots):
                builder.store(builder.extract_value(out, i), slot)
            return context.get_dummy_value()
        return codegen

    def _accumulator(acc, n):
        return (isinstance(acc, types.Array) and acc.dtype == types.float32 and acc.ndim == 1
                and acc.layout == "C")

    @lru_cache(maxsize=None)
    def wgmma_ss(n, element="f16", trans_b=False, trans_a=False, fresh=False):
        """acc += A B, m64n``n``k16, A and B in shared memory by descriptor: ``f(acc, desc_a, desc_b)``, acc a
        local float32 array of n / 2 (the layout above).  element: "f16" or "bf16"; trans_b: B is MN-major
        (its N dimension contiguous); trans_a: A is MN-major (its M dimension contiguous: a tile stored with
        A's k along the rows, as dS^T is when it becomes dQ's A); fresh: acc = A B (a product's first k-step,
        with no zeroing of acc before it)."""
        codegen = _product(n, element, trans_b, False, trans_a, fresh)

        @intrinsic
        def product(typingctx, acc, desc_a, desc_b):
            if not _accumulator(acc, n):
                return None
            return types.void(acc, types.uint64, types.uint64), codegen
        return product

    @lru_cache(maxsize=None)
    def wgmma_rs(n, element="f16", trans_b=False):
        """acc += A B, m64n``n``k16, A from registers (a UniTuple of four uint32: the layout above), B by
        descriptor: ``f(acc, a, desc_b)``."""
        codegen = _product(n, element, trans_b, True)

        @intrinsic
        def product(typingctx, acc, a, desc_b):
            if not _accumulator(acc, n):
                return None
            return types.void(acc, types.UniTuple(types.uint32, 4), types.uint64), codegen
        return product

else:
    # ------------------------------------------------------------------
    # Simulator twins.  The fences and waits have nothing to order (a twin's
    # product is complete when it returns).  ``shared_address`` returns 0 and
    # remembers the block's shared array, so that a descriptor's address is an
    # offset into it; a product decodes its operands from that array the way
    # the table above says the tensor cores do (the 128-byte swizzle applied to
    # each element's address), so a kernel that stages a tile in another
    # layout than it describes fails here as on the GPU.  Whether the table is
    # the hardware's is for experiments/tuning/wgmma_layouts.py to say.  A thread
    # computes its own accumulator entries; P from registers is gathered from
    # the warpgroup's 128 threads through ``primitives.collective``.
    # ------------------------------------------------------------------
    import threading

    import ml_dtypes
    import numpy as np

    from ..fast.primitives import collective

    WARPGROUP = 128

    def shared_address(array):
        threading.current_thread()._manager.__dict__["_numba_flash_shared"] = array
        return 0

    def _values(addresses, element):
        """The 16-bit elements at byte ``addresses`` of the block's shared array (the swizzle applied), float64."""
        halves = threading.current_thread()._manager.__dict__["_numba_flash_shared"].view(np.uint16)
        bits = halves[(addresses ^ (((addresses >> 7) & 7) << 4)) // 2]
        kind = np.float16 if element == "f16" else ml_dtypes.bfloat16
        return bits.view(kind).astype(np.float64)

    def _fields(desc):
        desc = int(desc)
        if desc >> 62 != SWIZZLE_128B:
            raise NotImplementedError("the simulator's wgmma reads 128-byte-swizzled operands only")
        return ((desc & 0x3FFF) << 4, ((desc >> 16) & 0x3FFF) << 4, ((desc >> 32) & 0x3FFF) << 4)

    _SIXTEEN = np.arange(16)

    def _k_major(desc, rows, element):
        """Operand rows ``rows`` x 16 k of a K-major operand: element (r, k) at start + (r // 8) stride +
        (r % 8) 128 + 2 k."""
        start, _, stride = _fields(desc)
        rows = rows[:, None]
        return _values(start + (rows // 8) * stride + (rows % 8) * 128 + 2 * _SIXTEEN[None, :], element)

    def _mn_major(desc, columns, element):
        """The 16 x len(columns) block of an MN-major operand: element (k, n) at start + (n // 64) leading +
        (k // 8) stride + (k % 8) 128 + 2 (n % 64)."""
        start, leading, stride = _fields(desc)
        ks, columns = _SIXTEEN[:, None], columns[None, :]
        return _values(start + (columns // 64) * leading + (ks // 8) * stride + (ks % 8) * 128
                       + 2 * (columns % 64), element)

    def _b_operand(desc, columns, element, trans_b):
        """B's 16 x len(columns) block: K-major (its rows are B's columns), or MN-major."""
        return _mn_major(desc, columns, element) if trans_b else _k_major(desc, columns, element).T

    @lru_cache(maxsize=None)
    def _entries(member, n):
        """Thread ``member``'s accumulator entries (the table above) as (distinct rows, distinct columns, each
        register's index into both): a product computes only the rows x columns block its entries lie in."""
        rows, columns = accumulator_entries(member, n)
        distinct_rows, row_of = np.unique(rows, return_inverse=True)
        distinct_columns, column_of = np.unique(columns, return_inverse=True)
        return distinct_rows, distinct_columns, row_of, column_of

    def _accumulate(acc, n, a_rows, entries, desc_b, element, trans_b):
        """acc[i] += A[row i] . B[:, column i] for this thread's entries, each sum in float64 rounded to float32;
        a_rows: A's distinct rows of ``entries``, 16 each."""
        _, columns, row_of, column_of = entries
        products = a_rows @ _b_operand(desc_b, columns, element, trans_b)
        registers = n // 2
        acc[:registers] = (acc[:registers].astype(np.float64) + products[row_of, column_of]).astype(np.float32)

    def _member():
        """This thread's place in its warpgroup."""
        return threading.current_thread().thread_id % WARPGROUP

    @lru_cache(maxsize=None)
    def wgmma_ss(n, element="f16", trans_b=False, trans_a=False, fresh=False):
        def product(acc, desc_a, desc_b):
            if fresh:
                for i in range(n // 2):
                    acc[i] = np.float32(0)
            entries = _entries(_member(), n)
            rows = entries[0]
            a_rows = _mn_major(desc_a, rows, element).T if trans_a else _k_major(desc_a, rows, element)
            _accumulate(acc, n, a_rows, entries, desc_b, element, trans_b)
        return product

    def _gather_a(posts, element):
        """A (64 x 16) from the warpgroup's register fragments (four 16-bit pairs per thread, the table above)."""
        kind = np.float16 if element == "f16" else ml_dtypes.bfloat16
        a = np.zeros((64, 16))
        for member, words in enumerate(posts):
            w, g, t = member // 32, (member % 32) // 4, member % 4
            pairs = np.array([int(x) & 0xFFFFFFFF for x in words], np.uint32).view(np.uint16).view(kind)
            for x, (row, col) in enumerate(((g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8))):
                a[16 * w + row, col:col + 2] = pairs[2 * x:2 * x + 2].astype(np.float64)
        return [a] * len(posts)

    @lru_cache(maxsize=None)
    def wgmma_rs(n, element="f16", trans_b=False):
        def product(acc, a, desc_b):
            whole = collective(tuple(a), lambda posts: _gather_a(posts, element), WARPGROUP)
            entries = _entries(_member(), n)
            _accumulate(acc, n, whole[entries[0]], entries, desc_b, element, trans_b)
        return product
