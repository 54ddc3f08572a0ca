"""Warp-level building blocks of the fast kernels, each with a simulator twin.

On the GPU each function here is one or two PTX instructions, emitted from
Numba through intrinsics with inline PTX: the tensor-core multiply-accumulate
``mma.sync`` (which numba-cuda does not expose), half-precision packing, bit
casts and the warp shuffle.  Numba's CUDA simulator runs every CUDA thread as
a Python thread and has none of these, so under ``NUMBA_ENABLE_CUDASIM=1`` the
same names are bound to pure-Python versions that reproduce the *per-lane
register layouts* exactly: the 32 threads of a warp swap registers through a
barrier, compute the warp-wide result, and each keeps its own lanes' part.  A
kernel written against this module therefore runs unchanged in both worlds,
and a kernel that puts a value in the wrong lane fails in the simulator too.

Fragment layouts are the PTX ISA's ("Matrix fragments for mma.m16n8k8" and
"mma.m16n8k16").  With ``lane = 4 * g + t`` (``g = lane >> 2`` is the *group*,
``t = lane & 3`` the *thread in group*):

==========================  ============================================
m16n8k8, tf32 operands      A (16x8):  a0=(g, t)  a1=(g+8, t)  a2=(g, t+4)  a3=(g+8, t+4)
                            B (8x8):   b0=(t, g)  b1=(t+4, g)
m16n8k16, f16 or bf16       A (16x16): a0=(g, 2t:2t+2)  a1=(g+8, 2t:2t+2)
operands (two halves per               a2=(g, 2t+8:2t+10)  a3=(g+8, 2t+8:2t+10)
register, lower index in    B (16x8):  b0=(2t:2t+2, g)  b1=(2t+8:2t+10, g)
the low half)
both, f32 accumulators      C (16x8):  c0=(g, 2t)  c1=(g, 2t+1)  c2=(g+8, 2t)  c3=(g+8, 2t+1)
ldmatrix .x2 / .x4          register j of every lane: word t of row g of matrix j, matrix j's 8 rows
(16-bit, shared memory)     at the addresses lanes 8j .. 8j + 7 give (each row 16 bytes, 16-aligned)
ldmatrix .trans             register j: elements (2t, g) low and (2t+1, g) high of matrix j: the B
                            fragment of a row-major (k x n) tile, e.g. V for P V
==========================  ============================================

``copy_async16`` is ``cp.async``: a 16-byte copy from device to shared memory
that runs in the background (no register holds the data on the way) and is
complete, for the thread that issued it, after ``copy_async_wait_all``; other
threads see it after a barrier that follows that wait.  ``copy_async_commit``
closes the copies a thread issued since its last commit into a group, and
``copy_async_wait(n)`` waits until at most the ``n`` newest groups are still in
flight: a pipeline of several tiles waits for the oldest alone.  The simulator
copies at once, which is one of the orders the GPU may choose.

``ldmatrix_x4`` / ``ldmatrix_x2`` (/ ``ldmatrix_x2_trans``) are how 16-bit
fragments leave shared memory: one instruction for four (two) 8x8 matrices,
where a lane would otherwise issue four (two) 32-bit loads.  Lane l gives
``index + offset``, the word where row l % 8 of matrix l // 8 starts (``offset``:
the part known when compiling, e.g. a k step's, which becomes the instruction's
immediate); it returns
register j of the lane, the pair of elements (2t, 2t + 1) of row g of matrix j.
An A fragment is its matrices (rows 0-7, k 0-7), (8-15, 0-7), (0-7, 8-15),
(8-15, 8-15) of a row-major tile; B fragments of two 8-key tiles of a
row-major K (B = K^T, "col" layout) are (keys 0-7, k 0-7), (0-7, 8-15),
(8-15, 0-7), (8-15, 8-15).
"""
import threading
from functools import lru_cache

import numpy as np
from numba import config, cuda, uint32

from ...runtime.launch import inlined_device_function

__all__ = [
    "WARP_SIZE",
    "f32_as_u32",
    "u32_as_f32",
    "tf32_round",
    "pack_half2",
    "pack_bf16x2",
    "half_to_f32",
    "bf16_to_f32",
    "mma_tf32",
    "mma_f16",
    "mma_bf16",
    "shfl_xor",
    "sync_warp",
    "exp2",
    "load_word",
    "store_word",
    "load_vec4",
    "store_vec4",
    "load_vec4_l2",
    "load_word_l2",
    "reduce_add_pair",
    "ldmatrix_x2",
    "ldmatrix_x4",
    "ldmatrix_x2_trans",
    "copy_async16",
    "copy_async16_prefetching",
    "copy_async_wait_all",
    "copy_async_commit",
    "copy_async_wait",
    "ptx_statement",
]

WARP_SIZE = 32
TF32_DROPPED_BITS = 0x1FFF  # tf32 keeps 10 of float32's 23 mantissa bits


if not config.ENABLE_CUDASIM:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    _F32 = ir.FloatType()
    _I32, _I64 = ir.IntType(32), ir.IntType(64)

    def _cast_all(context, builder, sig, args, wanted):
        return [context.cast(builder, a, t, w) for a, t, w in zip(args, sig.args, wanted)]

    def _bitcast_intrinsic(source, target, doc):
        """A register move that reads ``source``'s bits as ``target`` (Numba types), no conversion."""
        @intrinsic
        def bitcast(typingctx, x):
            def codegen(context, builder, sig, args):
                (x,) = _cast_all(context, builder, sig, args, [source])
                return builder.bitcast(x, context.get_value_type(target))

            return target(x), codegen

        bitcast.__doc__ = doc
        return bitcast

    f32_as_u32 = _bitcast_intrinsic(types.float32, types.uint32, "The bits of a float32, as uint32 (no conversion).")
    u32_as_f32 = _bitcast_intrinsic(types.uint32, types.float32, "The float32 whose bits are the uint32 ``x``.")

    def _pack_intrinsic(kind, name):
        """``pack(lo, hi)``: round two float32 to ``kind`` (PTX's f16 or bf16, nearest even) and pack them."""
        @intrinsic
        def pack(typingctx, lo, hi):
            def codegen(context, builder, sig, args):
                lo, hi = _cast_all(context, builder, sig, args, [types.float32] * 2)
                # cvt.rn.<kind>x2.f32 d, a, b puts a in the upper half, b in the lower.
                asm = ir.InlineAsm(ir.FunctionType(_I32, [_F32, _F32]),
                                   f"cvt.rn.{kind}x2.f32 $0, $1, $2;", "=r,f,f")
                return builder.call(asm, [hi, lo])

            return types.uint32(lo, hi), codegen

        pack.__doc__ = f"Round two float32 to {name} (nearest even) and pack them: ``lo`` in bits 0-15."
        return pack

    pack_half2 = _pack_intrinsic("f16", "float16")
    pack_bf16x2 = _pack_intrinsic("bf16", "bfloat16")

    @intrinsic
    def half_to_f32(typingctx, bits):
        """The float16 whose bits are the low 16 bits of ``bits``, widened to float32 (exactly)."""
        def codegen(context, builder, sig, args):
            (bits,) = _cast_all(context, builder, sig, args, [types.uint32])
            asm = ir.InlineAsm(ir.FunctionType(_F32, [_I32]),
                               "{ .reg .b16 h; cvt.u16.u32 h, $1; cvt.f32.f16 $0, h; }", "=f,r")
            return builder.call(asm, [bits])

        return types.float32(bits), codegen

    @intrinsic
    def exp2(typingctx, x):
        """2^x in one instruction, ``ex2.approx.ftz.f32`` (relative error ~2^-22; NaN stays NaN, -inf gives 0).

        Written out rather than left to ``math.exp2`` under Numba's ``fastmath``,
        which also tells LLVM that no value is NaN or infinite: the kernels
        rely on -inf for masking and must let NaN through (issue 12).
        """
        def codegen(context, builder, sig, args):
            (x,) = _cast_all(context, builder, sig, args, [types.float32])
            asm = ir.InlineAsm(ir.FunctionType(_F32, [_F32]), "ex2.approx.ftz.f32 $0, $1;", "=f,f")
            return builder.call(asm, [x])

        return types.float32(x), codegen

    def _mma_intrinsic(ptx_shape_and_types, doc):
        @intrinsic
        def mma(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
            def codegen(context, builder, sig, args):
                vals = _cast_all(context, builder, sig, args,
                                 [types.uint32] * 6 + [types.float32] * 4)
                asm = ir.InlineAsm(
                    ir.FunctionType(ir.LiteralStructType([_F32] * 4), [_I32] * 6 + [_F32] * 4),
                    f"mma.sync.aligned.{ptx_shape_and_types} "
                    "{$0,$1,$2,$3}, {$4,$5,$6,$7}, {$8,$9}, {$10,$11,$12,$13};",
                    "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f",
                )
                d = builder.call(asm, vals)
                return context.make_tuple(builder, sig.return_type,
                                          [builder.extract_value(d, i) for i in range(4)])

            return types.UniTuple(types.float32, 4)(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3), codegen

        mma.__doc__ = doc
        return mma

    mma_tf32 = _mma_intrinsic(
        "m16n8k8.row.col.f32.tf32.tf32.f32",
        "D = A B + C for one warp: A 16x8, B 8x8 in tf32 bit patterns, C and D float32.")
    mma_f16 = _mma_intrinsic(
        "m16n8k16.row.col.f32.f16.f16.f32",
        "D = A B + C for one warp: A 16x16, B 16x8 as packed float16 pairs, C and D float32.")
    mma_bf16 = _mma_intrinsic(
        "m16n8k16.row.col.f32.bf16.bf16.f32",
        "D = A B + C for one warp: A 16x16, B 16x8 as packed bfloat16 pairs, C and D float32.")

    def _element_pointer(context, builder, arrty, arr, index, indexty):
        from numba.cuda.np.arrayobj import make_array

        data = make_array(arrty)(context, builder, arr).data
        index = context.cast(builder, index, indexty, types.intp)
        return builder.gep(data, [index], inbounds=True)

    def _shared_address(context, builder, arrty, arr, index, indexty):
        """The 32-bit shared-window address of ``arr[index]``, ``arr`` holding a generic pointer into shared
        memory: the address NVVM's own shared loads use (a 64-bit generic address and a cvta in the asm cost
        two registers per address and spilled flash2 at its register cap)."""
        pointer = _element_pointer(context, builder, arrty, arr, index, indexty)
        return builder.ptrtoint(builder.addrspacecast(pointer, ir.PointerType(pointer.type.pointee, 3)), _I32)

    def _global_address(context, builder, arrty, arr, index, indexty):
        """The 64-bit global-window address of ``arr[index]`` (``arr`` in device memory)."""
        pointer = _element_pointer(context, builder, arrty, arr, index, indexty)
        return builder.ptrtoint(builder.addrspacecast(pointer, ir.PointerType(pointer.type.pointee, 1)), _I64)

    def _flat_words(arr, index, bitwidth=None):
        """Typing test of the memory intrinsics: a 1-D array (of ``bitwidth``-bit elements) and an integer."""
        return (isinstance(arr, types.Array) and arr.ndim == 1 and isinstance(index, types.Integer)
                and (bitwidth is None or arr.dtype.bitwidth == bitwidth))

    def _word_and_integer(arr, index, value):
        """Typing test of the intrinsics on ``arr[index]`` (32-bit words) that take one more integer."""
        return _flat_words(arr, index, 32) and isinstance(value, types.Integer)

    def _first_shared_address(context, builder, sig, args):
        """``_shared_address`` of ``args[0][args[1]]``: the intrinsic's first two arguments."""
        return _shared_address(context, builder, sig.args[0], args[0], args[1], sig.args[1])

    def _vector_pointer(context, builder, sig, args):
        """Pointer to the 4-element vector at ``args[0][args[1]]`` (16-byte alignment is the caller's promise)."""
        element = context.get_value_type(sig.args[0].dtype)
        ptr = _element_pointer(context, builder, sig.args[0], args[0], args[1], sig.args[1])
        return builder.bitcast(ptr, ir.VectorType(element, 4).as_pointer()), ir.VectorType(element, 4)

    @intrinsic
    def load_word(typingctx, arr, index):
        """``arr[index]`` for a 1-D array and an index known to be in range.

        Plain indexing makes Numba wrap negative indices (a compare and a
        select on 64-bit values) before every access, which also keeps the
        compiler from folding constant offsets; the fast kernels address
        shared memory hundreds of times per tile and use this instead.
        """
        if not _flat_words(arr, index):
            return None

        def codegen(context, builder, sig, args):
            return builder.load(_element_pointer(context, builder, sig.args[0], args[0], args[1], sig.args[1]))

        return arr.dtype(arr, index), codegen

    @intrinsic
    def store_word(typingctx, arr, index, value):
        """``arr[index] = value`` for a 1-D array and an index known to be in range."""
        if not _flat_words(arr, index):
            return None

        def codegen(context, builder, sig, args):
            value = context.cast(builder, args[2], sig.args[2], sig.args[0].dtype)
            builder.store(value, _element_pointer(context, builder, sig.args[0], args[0], args[1], sig.args[1]))
            return context.get_dummy_value()

        return types.void(arr, index, value), codegen

    @intrinsic
    def load_vec4(typingctx, arr, index):
        """``arr[index:index + 4]`` as one 16-byte load (index a multiple of 4, data 16-byte aligned)."""
        if not _flat_words(arr, index, 32):
            return None

        def codegen(context, builder, sig, args):
            ptr, _ = _vector_pointer(context, builder, sig, args)
            vector = builder.load(ptr, align=16)
            return context.make_tuple(builder, sig.return_type,
                                      [builder.extract_element(vector, ir.Constant(_I32, i)) for i in range(4)])

        return types.UniTuple(arr.dtype, 4)(arr, index), codegen

    @intrinsic
    def store_vec4(typingctx, arr, index, a, b, c, d):
        """``arr[index:index + 4] = a, b, c, d`` as one 16-byte store (index a multiple of 4, aligned)."""
        if not _flat_words(arr, index, 32):
            return None

        def codegen(context, builder, sig, args):
            ptr, vector_type = _vector_pointer(context, builder, sig, args)
            vector = ir.Constant(vector_type, ir.Undefined)
            for i in range(4):
                value = context.cast(builder, args[2 + i], sig.args[2 + i], sig.args[0].dtype)
                vector = builder.insert_element(vector, value, ir.Constant(_I32, i))
            builder.store(vector, ptr, align=16)
            return context.get_dummy_value()

        return types.void(arr, index, a, b, c, d), codegen

    def _l2_load_intrinsic(count):
        """A load of ``count`` (1 or 4) float32 words that other blocks of this grid wrote: one ``ld.global.cg``
        (16 bytes for four), served by L2, where their fenced stores are, and not by this multiprocessor's L1,
        which does not see other multiprocessors' stores (a line it read earlier in the grid could be stale).
        Volatile asm: kept after the fence that orders it."""
        vector, operands = (".v4", "{$0, $1, $2, $3}") if count == 4 else ("", "$0")

        @intrinsic
        def load(typingctx, arr, index):
            if not (_flat_words(arr, index, 32) and arr.dtype == types.float32):
                return None

            def codegen(context, builder, sig, args):
                address = _global_address(context, builder, sig.args[0], args[0], args[1], sig.args[1])
                result = ir.LiteralStructType([_F32] * 4) if count == 4 else _F32
                asm = ir.InlineAsm(ir.FunctionType(result, [_I64]), f"ld.global.cg{vector}.f32 {operands}, [${count}];",
                                   ",".join(["=f"] * count + ["l"]), side_effect=True)
                words = builder.call(asm, [address])
                if count == 1:
                    return words
                return context.make_tuple(builder, sig.return_type, [builder.extract_value(words, i) for i in range(4)])

            return (types.UniTuple(types.float32, 4) if count == 4 else types.float32)(arr, index), codegen

        return load

    #: ``load_vec4`` / ``load_word`` of float32 words another block of the grid wrote (``_l2_load_intrinsic``).
    load_vec4_l2 = _l2_load_intrinsic(4)
    load_word_l2 = _l2_load_intrinsic(1)

    @intrinsic
    def reduce_add_pair(typingctx, arr, index, a, b):
        """``arr[index] += a; arr[index + 1] += b`` in device memory, float32, as one ``red.global.add.v2.f32``
        (sm_90; index even, the pair 8-byte aligned): a reduction in L2 that returns nothing, so the thread does
        not wait for it, and adds from many blocks to one word all land (in an order nobody chose)."""
        if not (_flat_words(arr, index, 32) and arr.dtype == types.float32):
            return None

        def codegen(context, builder, sig, args):
            address = _global_address(context, builder, sig.args[0], args[0], args[1], sig.args[1])
            a, b = (context.cast(builder, args[i], sig.args[i], types.float32) for i in (2, 3))
            asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), [_I64, _F32, _F32]),
                               "red.global.add.v2.f32 [$0], {$1, $2};", "l,f,f,~{memory}", side_effect=True)
            builder.call(asm, [address, a, b])
            return context.get_dummy_value()

        return types.void(arr, index, a, b), codegen

    def _ldmatrix_intrinsic(count, trans=False):
        @intrinsic
        def ldmatrix(typingctx, arr, index, offset):
            if not _word_and_integer(arr, index, offset):
                return None

            def codegen(context, builder, sig, args):
                row = _first_shared_address(context, builder, sig, args)
                # The offset is added to the finished 32-bit address, where a constant one can become the
                # instruction's immediate whatever the index holds (a buffer's runtime offset, say).  SASS of
                # the d = 128 forward's key-tile loop: 820 instructions, against 833 with the offset in the
                # index (the same at d = 64).
                offset_bytes = builder.mul(builder.trunc(args[2], _I32) if args[2].type.width > 32 else args[2],
                                           ir.Constant(_I32, 4))
                address = builder.add(row, offset_bytes)
                registers = ", ".join(f"${i}" for i in range(count))
                # Side effects: never hoisted out of a loop or merged across the barrier that publishes a tile.
                asm = ir.InlineAsm(ir.FunctionType(ir.LiteralStructType([_I32] * count), [_I32]),
                                   f"ldmatrix.sync.aligned.m8n8.x{count}{'.trans' if trans else ''}.shared.b16 "
                                   f"{{{registers}}}, [${count}];",
                                   "=r," * count + "r,~{memory}", side_effect=True)
                words = builder.call(asm, [address])
                return context.make_tuple(builder, sig.return_type,
                                          [builder.extract_value(words, i) for i in range(count)])

            return types.UniTuple(types.uint32, count)(arr, index, offset), codegen

        return ldmatrix

    ldmatrix_x2 = _ldmatrix_intrinsic(2)
    ldmatrix_x4 = _ldmatrix_intrinsic(4)
    ldmatrix_x2_trans = _ldmatrix_intrinsic(2, trans=True)

    def _copy_async_intrinsic(l2_prefetch=None):
        """``cp.async`` of 16 bytes; ``l2_prefetch`` (128 or 256): the ``.L2::NB`` hint, which asks L2 to fetch
        that many bytes around the copy from device memory."""
        hint = f".L2::{l2_prefetch}B" if l2_prefetch else ""

        @intrinsic
        def copy_async16(typingctx, dst, dst_index, src, src_index, valid):
            """Start copying ``src[src_index:src_index + 4]`` to ``dst[dst_index:dst_index + 4]`` (32-bit words;
            dst in shared memory, src in device memory, both 16-byte aligned); 16 zero bytes instead when not
            ``valid`` (``src_index`` must still be an address inside ``src``: nothing is read from it)."""
            if not (_flat_words(dst, dst_index, 32) and _flat_words(src, src_index, 32)
                    and isinstance(valid, types.Boolean)):
                return None

            def codegen(context, builder, sig, args):
                to = _first_shared_address(context, builder, sig, args)
                origin = _global_address(context, builder, sig.args[2], args[2], args[3], sig.args[3])
                # The source size operand: 16 bytes, or 0 (the hardware fills the 16 bytes with zeros).
                size = builder.select(args[4], ir.Constant(_I32, 16), ir.Constant(_I32, 0))
                # .cg: the tile goes to shared memory through L2 only (every block reads it once from there).
                asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), [_I32, _I64, _I32]),
                                   f"cp.async.cg.shared.global{hint} [$0], [$1], 16, $2;", "r,l,r,~{memory}",
                                   side_effect=True)
                builder.call(asm, [to, origin, size])
                return context.get_dummy_value()

            return types.void(dst, dst_index, src, src_index, valid), codegen

        return copy_async16

    copy_async16 = _copy_async_intrinsic()
    #: ``copy_async16`` with L2 asked to fetch 128 or 256 bytes around each copy (timed against it by
    #: experiments/tuning/cp_async_stream.py; no kernel uses it yet).
    copy_async16_prefetching = {size: _copy_async_intrinsic(size) for size in (128, 256)}

    def ptx_statement(text):
        """An instruction without operands, kept in place and ordered with memory (a clobber)."""
        @intrinsic
        def instruction(typingctx):
            def codegen(context, builder, sig, args):
                function = ir.FunctionType(ir.VoidType(), [])
                builder.call(ir.InlineAsm(function, text, "~{memory}", side_effect=True), [])
                return context.get_dummy_value()
            return types.void(), codegen
        return instruction

    #: Wait until every ``copy_async16`` this thread issued has landed in shared memory.
    copy_async_wait_all = ptx_statement("cp.async.wait_all;")
    #: The thread's copies since its last commit become one group (``copy_async_wait`` counts groups).
    copy_async_commit = ptx_statement("cp.async.commit_group;")

    @lru_cache(maxsize=None)
    def copy_async_wait(pending):
        """Wait until at most ``pending`` of this thread's committed groups are still in flight (the newest)."""
        return ptx_statement(f"cp.async.wait_group {int(pending)};")

    @inlined_device_function
    def shfl_xor(value, lane_mask):
        """The ``value`` of lane ``laneid ^ lane_mask`` (all 32 lanes take part)."""
        return cuda.shfl_xor_sync(0xFFFFFFFF, value, lane_mask)

    @inlined_device_function
    def sync_warp():
        """A barrier of the warp's 32 lanes (``bar.warp.sync``): what each wrote to shared memory before it,
        every other lane sees after it.  For a warp that owns its buffers, as a block does with syncthreads."""
        cuda.syncwarp(0xFFFFFFFF)

    @intrinsic
    def tf32_round(typingctx, x):
        """``x`` rounded to tf32 (nearest, ties away), ``cvt.rna.tf32.f32``: the bits ``mma_tf32`` takes.

        The instruction leaves infinities and NaN unrounded.  An integer add of half an ulp,
        which this once was, carries the GPU's canonical NaN (0x7FFFFFFF, what arithmetic on a
        NaN returns) into the sign bit and gives -0: a NaN vanished from float32 gradients.
        """
        def codegen(context, builder, sig, args):
            (x,) = _cast_all(context, builder, sig, args, [types.float32])
            asm = ir.InlineAsm(ir.FunctionType(_I32, [_F32]), "cvt.rna.tf32.f32 $0, $1;", "=r,f")
            return builder.call(asm, [x])

        return types.uint32(x), codegen

    @inlined_device_function
    def bf16_to_f32(bits):
        """The bfloat16 whose bits are the low 16 bits of ``bits``, as float32 (a shift: exact)."""
        return u32_as_f32(uint32(bits) << uint32(16))

else:
    # ------------------------------------------------------------------
    # Simulator twins.  Each warp gets a "room": its 32 threads post their
    # registers, and the last to arrive at the room's barrier computes the
    # warp-wide result once (the barrier's action) before all are released
    # to read their lane's part.  Posts alternate between two buffers, so a
    # fast thread's next post cannot overwrite values a slow thread has not
    # read yet: to post twice it must pass a barrier that waits for the slow
    # one.  (``collective`` gives Hopper's warpgroups of 128 the same rooms.)
    # ------------------------------------------------------------------
    from ...runtime.simulator import BlockBarrier

    _ROOMS_LOCK = threading.Lock()

    class _Room:
        def __init__(self, size):
            self.posts = [[None] * size, [None] * size]
            self.results = [None, None]
            self.calls = [0] * size
            self.compute = None
            self.barrier = BlockBarrier(size, action=self._act, timeout=600)
            self._parity = 0

        def _act(self):
            parity = self._parity
            self.results[parity] = self.compute(self.posts[parity])
            self._parity ^= 1

    def collective(value, compute, size=WARP_SIZE):
        """Simulator only: post ``value`` to the room of this thread's group of ``size`` consecutive threads
        (a warp, or a warpgroup of 128); ``compute(all posts, in thread order)`` runs once; return this
        thread's entry of its result."""
        me = threading.current_thread()
        block = me._manager
        with _ROOMS_LOCK:
            rooms = block.__dict__.setdefault("_numba_flash_rooms", {})
            key = (tuple(me.blockIdx), size, me.thread_id // size)
            room = rooms.get(key)
            if room is None:
                if int(np.prod(block._block_dim)) % size:
                    raise RuntimeError(f"groups of {size} threads need blockDim a multiple of {size}")
                room = rooms[key] = _Room(size)
        member = me.thread_id % size
        parity = room.calls[member] & 1
        room.calls[member] += 1
        room.posts[parity][member] = value
        room.compute = compute
        room.barrier.wait()
        return room.results[parity][member]

    def _warp_op(value, compute):
        """Post ``value``; ``compute(all 32 posts)`` runs once; return this lane's result."""
        return collective(value, compute, WARP_SIZE)

    def f32_as_u32(x):
        """The bits of a float32, as uint32."""
        return np.uint32(np.array([x], dtype=np.float32).view(np.uint32)[0])

    def u32_as_f32(u):
        """The float32 whose bits are ``u``."""
        return np.float32(np.array([int(u) & 0xFFFFFFFF], dtype=np.uint32).view(np.float32)[0])

    def tf32_round(x):
        """``x`` rounded to tf32 (nearest, ties away); infinities and NaN unrounded, as cvt.rna.tf32.f32."""
        bits = int(f32_as_u32(x))
        if bits & 0x7F800000 != 0x7F800000:
            bits += 0x1000
        return np.uint32(bits & 0xFFFFE000)

    def pack_half2(lo, hi):
        """Round two float32 to float16 and pack them: ``lo`` in bits 0-15."""
        with np.errstate(over="ignore"):  # like cvt.rn: too large -> inf
            halves = np.array([lo, hi], dtype=np.float32).astype(np.float16)
        return np.uint32(halves.view(np.uint32)[0])

    def pack_bf16x2(lo, hi):
        """Round two float32 to bfloat16 (nearest even) and pack them: ``lo`` in bits 0-15."""
        return np.uint32(_bf16_bits(lo) | (_bf16_bits(hi) << 16))

    def _bf16_bits(x):
        """float32 -> bfloat16 bits, rounded to nearest even (NaN stays a quiet NaN), as cvt.rn.bf16."""
        bits = int(f32_as_u32(x))
        if (bits & 0x7F800000) == 0x7F800000 and bits & 0x7FFFFF:
            return (bits >> 16) | 0x40
        return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF

    def half_to_f32(bits):
        """The float16 whose bits are the low 16 bits of ``bits``, widened to float32 (exactly)."""
        return np.float32(np.array([int(bits) & 0xFFFF], dtype=np.uint16).view(np.float16)[0])

    def bf16_to_f32(bits):
        """The bfloat16 whose bits are the low 16 bits of ``bits``, as float32 (a shift: exact)."""
        return u32_as_f32((int(bits) & 0xFFFF) << 16)

    def exp2(x):
        """2^x in float32 (the GPU's ex2.approx.ftz.f32 is within ~2^-22 of this)."""
        with np.errstate(over="ignore", invalid="ignore"):
            return np.float32(np.exp2(np.float32(x)))

    def _check_index(name, index, multiple=1):
        # The GPU versions trust the caller; here a wrong index is an error
        # (plain Python indexing would wrap a negative one silently).
        if index < 0 or index % multiple:
            raise IndexError(f"{name}: index {index} is not a non-negative multiple of {multiple}")

    def load_word(arr, index):
        """``arr[index]`` for a 1-D array and an index known to be in range."""
        _check_index("load_word", index)
        return arr[index]

    def store_word(arr, index, value):
        """``arr[index] = value`` for a 1-D array and an index known to be in range."""
        _check_index("store_word", index)
        arr[index] = value

    def load_vec4(arr, index):
        """``arr[index:index + 4]`` as one 16-byte load (index a multiple of 4, data 16-byte aligned)."""
        _check_index("load_vec4", index, 4)
        return arr[index], arr[index + 1], arr[index + 2], arr[index + 3]

    #: The simulator's threads share one memory: nothing to bypass.
    load_vec4_l2 = load_vec4
    load_word_l2 = load_word

    def reduce_add_pair(arr, index, a, b):
        """``arr[index] += a; arr[index + 1] += b`` (float32; the simulator runs one block at a time)."""
        _check_index("reduce_add_pair", index, 2)
        arr[index] = np.float32(arr[index] + np.float32(a))
        arr[index + 1] = np.float32(arr[index + 1] + np.float32(b))

    def store_vec4(arr, index, a, b, c, d):
        """``arr[index:index + 4] = a, b, c, d`` as one 16-byte store (index a multiple of 4, aligned)."""
        _check_index("store_vec4", index, 4)
        arr[index], arr[index + 1], arr[index + 2], arr[index + 3] = a, b, c, d

    def shfl_xor(value, lane_mask):
        """The ``value`` of lane ``laneid ^ lane_mask`` (all 32 lanes take part)."""
        return _warp_op(value, lambda posts: [posts[lane ^ lane_mask] for lane in range(WARP_SIZE)])

    def sync_warp():
        """A barrier of the warp's 32 lanes: each waits here until all have posted."""
        _warp_op(None, lambda posts: [None] * WARP_SIZE)

    def _ldmatrix(count, trans=False):
        def ldmatrix(arr, index, offset):
            index += offset
            _check_index(f"ldmatrix_x{count}", index, 4)   # a row starts 16-byte aligned

            def half(row, column):
                """16-bit element ``column`` of the 8-element row starting at word ``row``."""
                return (int(arr[row + column // 2]) >> (16 * (column % 2))) & 0xFFFF

            def register(rows, j, lane):
                g, t = lane >> 2, lane & 3
                if trans:   # elements (2t, g) and (2t + 1, g) of matrix j
                    return np.uint32(half(rows[8 * j + 2 * t], g) | (half(rows[8 * j + 2 * t + 1], g) << 16))
                return np.uint32(arr[rows[8 * j + g] + t])      # elements (g, 2t) and (g, 2t + 1)

            def gather(posts):
                rows = [index for _, index in posts]
                return [tuple(register(rows, j, lane) for j in range(count)) for lane in range(WARP_SIZE)]

            return _warp_op((arr, index), gather)

        return ldmatrix

    ldmatrix_x2 = _ldmatrix(2)
    ldmatrix_x4 = _ldmatrix(4)
    ldmatrix_x2_trans = _ldmatrix(2, trans=True)

    def copy_async16(dst, dst_index, src, src_index, valid):
        """Start copying ``src[src_index:src_index + 4]`` to ``dst[dst_index:dst_index + 4]`` (here: copy now);
        16 zero bytes instead when not ``valid``."""
        _check_index("copy_async16 (shared)", dst_index, 4)
        _check_index("copy_async16 (device)", src_index, 4)
        words = load_vec4(src, src_index) if valid else (0, 0, 0, 0)   # nothing is read when not valid
        store_vec4(dst, dst_index, *words)

    #: A prefetch hint changes nothing here.
    copy_async16_prefetching = {128: copy_async16, 256: copy_async16}

    def ptx_statement(text):
        """An instruction without operands: here, nothing to do (the twins act at once)."""
        return _nothing

    def _nothing():
        pass

    #: The copies have landed when they are issued here, so waiting and grouping do nothing.
    copy_async_wait_all = copy_async_commit = _nothing

    def copy_async_wait(pending):
        return _nothing

    # Where each lane's registers sit in the warp's matrices (PTX ISA layouts).
    _LANES = np.arange(WARP_SIZE)
    _G, _T = _LANES >> 2, _LANES & 3

    def _unpack(posts, count):
        return np.array([p[:count] for p in posts], dtype=np.int64).astype(np.uint32)

    def _as_tf32(bits):
        if np.any(bits & TF32_DROPPED_BITS):
            # The hardware would silently ignore these bits; a kernel that
            # passes them has skipped tf32_round, which is a bug.
            raise ValueError("mma_tf32 operand is not a tf32 bit pattern")
        return bits.view(np.float32).astype(np.float64)

    def _accumulate(posts, a, b):
        d = a @ b
        c = np.array([p[6:] for p in posts], dtype=np.float64)
        out = c + np.stack([d[_G, 2 * _T], d[_G, 2 * _T + 1], d[_G + 8, 2 * _T], d[_G + 8, 2 * _T + 1]], axis=1)
        return [tuple(np.float32(x) for x in row) for row in out]

    def _mma_tf32_warp(posts):
        regs = _unpack(posts, 6)
        a = np.zeros((16, 8))
        b = np.zeros((8, 8))
        a[_G, _T], a[_G + 8, _T] = _as_tf32(regs[:, 0]), _as_tf32(regs[:, 1])
        a[_G, _T + 4], a[_G + 8, _T + 4] = _as_tf32(regs[:, 2]), _as_tf32(regs[:, 3])
        b[_T, _G], b[_T + 4, _G] = _as_tf32(regs[:, 4]), _as_tf32(regs[:, 5])
        return _accumulate(posts, a, b)

    def _halves(words):
        """(32,) uint32 -> (32, 2) float64: low half, high half."""
        return np.ascontiguousarray(words).view(np.float16).reshape(-1, 2).astype(np.float64)

    def _bf16_halves(words):
        """(32,) uint32 -> (32, 2) float64 from bfloat16 pairs: low half, high half."""
        words = np.asarray(words, dtype=np.uint32)
        pairs = np.stack([words << np.uint32(16), words & np.uint32(0xFFFF0000)], axis=1)
        return pairs.view(np.float32).astype(np.float64)

    def _mma_16bit_warp(posts, halves):
        regs = _unpack(posts, 6)
        a = np.zeros((16, 16))
        b = np.zeros((16, 8))
        for reg, (row_off, col_off) in enumerate([(0, 0), (8, 0), (0, 8), (8, 8)]):
            pair = halves(regs[:, reg])
            a[_G + row_off, 2 * _T + col_off] = pair[:, 0]
            a[_G + row_off, 2 * _T + col_off + 1] = pair[:, 1]
        for reg, row_off in enumerate([0, 8]):
            pair = halves(regs[:, 4 + reg])
            b[2 * _T + row_off, _G] = pair[:, 0]
            b[2 * _T + row_off + 1, _G] = pair[:, 1]
        return _accumulate(posts, a, b)

    def mma_tf32(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        """D = A B + C for one warp: A 16x8, B 8x8 in tf32 bit patterns, C and D float32."""
        return _warp_op((a0, a1, a2, a3, b0, b1, c0, c1, c2, c3), _mma_tf32_warp)

    def mma_f16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        """D = A B + C for one warp: A 16x16, B 16x8 as packed float16 pairs, C and D float32."""
        return _warp_op((a0, a1, a2, a3, b0, b1, c0, c1, c2, c3), lambda posts: _mma_16bit_warp(posts, _halves))

    def mma_bf16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        """D = A B + C for one warp: A 16x16, B 16x8 as packed bfloat16 pairs, C and D float32."""
        return _warp_op((a0, a1, a2, a3, b0, b1, c0, c1, c2, c3), lambda posts: _mma_16bit_warp(posts, _bf16_halves))
