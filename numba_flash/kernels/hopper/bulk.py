"""Hopper's bulk copy engine from Numba: ``cp.async.bulk`` and the mbarriers it completes on.

numba-cuda exposes neither; these intrinsics emit them as inline PTX (plain sm_90, no arch-specific
target).  PTX ISA, "Data Movement and Conversion Instructions: cp.async.bulk" and "Parallel
Synchronization and Communication Instructions: mbarrier".  How the pieces fit:

* ``bulk_copy(dst, dst_word, src, src_word, nbytes, smem, barrier)`` asks the copy engine for
  ``nbytes`` (a multiple of 16, both ends 16-byte aligned) from device memory into shared memory.  One
  thread issues it; no register holds the data and no thread waits for it.  When the bytes have
  landed, the engine counts them off the *transaction count* of the mbarrier at word ``barrier`` of
  ``smem`` (``.mbarrier::complete_tx::bytes``).  Where ``cp.async`` moves 16 bytes per thread and
  instruction, one instruction here moves a whole row or tile.
* An mbarrier (8 bytes of shared memory, 8-byte aligned) counts *phases*.  ``barrier_init(smem, word,
  arrivals)`` sets how many arrivals a phase needs; ``barrier_expect_bytes(smem, word, nbytes)`` is one
  arrival that also adds ``nbytes`` to the transaction count the phase must see counted off before it
  completes.  ``barrier_arrive(smem, word, count)`` is ``count`` plain arrivals (a producer that filled a buffer with
  its own stores or ``cp.async`` copies, or a consumer done with one).  A phase completes when both are spent; its
  *parity* then flips.
  ``barrier_try_wait(smem, word, parity)`` is True once the phase of that parity has completed (it
  suspends the thread a while before answering False, so a loop on it does not spin hot).  A buffer
  used for tile j of a ring of S buffers waits with parity (j // S) & 1.
* Ordering.  ``barrier_init`` is an ordinary store; ``fence_barrier_init`` makes it visible to the
  copy engine, and a block barrier after it to the other threads, before anyone waits or copies.  The
  bytes a completed phase announces are visible to every thread that saw it complete: no further fence
  or barrier is needed to read them.  The other way round (a buffer read by ordinary loads, then
  refilled by the engine) is ordered by the block barrier all readers pass before the refill is issued.
  A thread that wrote a buffer with ordinary stores which the engine will write later needs
  ``fence.proxy.async`` (``wgmma.fence_proxy_async``) before the barrier that hands the buffer over.

* ``bulk_reduce_add(dst, dst_word, smem, src_word, nbytes)`` goes the other way: the engine adds
  ``nbytes`` of float32 from shared memory to device memory (``cp.reduce.async.bulk ... .add.f32``, a
  reduction in L2, element by element).  No mbarrier: its completion is counted in *bulk groups* of the
  issuing thread (``bulk_commit``): ``bulk_wait_read()`` returns once every committed reduction has read
  its source (the shared buffer may be rewritten), ``bulk_wait_done()`` once their adds are done and
  visible to this thread (then a ``threadfence`` makes them visible to whoever sees this thread's next write,
  as an ordered sum's turn counter).  The source is written by ordinary stores: each writer's
  ``fence.proxy.async`` and a barrier before the one thread issues it.

The simulator has no copy engine: there ``bulk_copy`` copies at once (one of the orders the GPU may choose), so
the barriers count arrivals only (an ``expect_bytes`` is one arrival), each phase's parity kept per simulated block:
a warp-specialised kernel whose consumers wait for a producer's arrivals waits there too.  Whether a kernel waits
for the bytes of its copies before it reads them only the GPU can say (compute-sanitizer's racecheck and synccheck,
and its results: ``tests/gpu_sanitize.py``).
"""
import numpy as np
from numba import config

from ...runtime.launch import inlined_device_function
from ..fast.primitives import ptx_statement

#: Bytes of an mbarrier (and its alignment).
BARRIER_BYTES = 8

#: The thread's bulk reductions since its last commit become one bulk group.
bulk_commit = ptx_statement("cp.async.bulk.commit_group;")
#: Wait until every committed bulk group of this thread has read its shared-memory source.
bulk_wait_read = ptx_statement("cp.async.bulk.wait_group.read 0;")
#: Wait until every committed bulk group of this thread is complete (its writes done).
bulk_wait_done = ptx_statement("cp.async.bulk.wait_group 0;")

#: The barriers' initialisation, made visible to the copy engine (then a block barrier: to the threads).
fence_barrier_init = ptx_statement("fence.mbarrier_init.release.cluster;")

if not config.ENABLE_CUDASIM:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    from ..fast.primitives import (_I32, _I64, _first_shared_address, _flat_words, _global_address, _shared_address,
                                   _word_and_integer)

    def _as_i32(context, builder, value, ty):
        return context.cast(builder, value, ty, types.uint32)

    def _barrier_operation(text, doc, answers=False):
        """An mbarrier instruction on ``smem[word]`` with one 32-bit operand: ``f(smem, word, value)``; with
        ``answers``, the instruction's text sets ``$0`` to 1 or 0 and ``f`` returns it as a bool."""
        @intrinsic
        def operation(typingctx, smem, word, value):
            if not _word_and_integer(smem, word, value):
                return None

            def codegen(context, builder, sig, args):
                operands = [_first_shared_address(context, builder, sig, args),
                            _as_i32(context, builder, args[2], sig.args[2])]
                if not answers:
                    asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), [_I32, _I32]), text, "r,r,~{memory}",
                                       side_effect=True)
                    builder.call(asm, operands)
                    return context.get_dummy_value()
                asm = ir.InlineAsm(ir.FunctionType(_I32, [_I32, _I32]), text, "=r,r,r,~{memory}", side_effect=True)
                return builder.icmp_unsigned("!=", builder.call(asm, operands), ir.Constant(_I32, 0))

            return (types.boolean if answers else types.void)(smem, word, value), codegen

        operation.__doc__ = doc
        return operation

    barrier_init = _barrier_operation(
        "mbarrier.init.shared::cta.b64 [$0], $1;",
        "mbarrier at ``smem[word:word + 2]``: a phase needs ``arrivals`` arrivals (and its bytes).")
    barrier_expect_bytes = _barrier_operation(
        "mbarrier.arrive.expect_tx.shared::cta.b64 _, [$0], $1;",
        "One arrival on the mbarrier at ``smem[word]`` that also expects ``nbytes`` more of copies.")
    barrier_arrive = _barrier_operation(
        "mbarrier.arrive.shared::cta.b64 _, [$0], $1;",
        "``count`` arrivals on the mbarrier at ``smem[word]`` (release: what this thread wrote before, a thread that "
        "sees the phase complete sees).")
    barrier_try_wait = _barrier_operation(
        "{ .reg .pred done; mbarrier.try_wait.parity.shared::cta.b64 done, [$1], $2; selp.u32 $0, 1, 0, done; }",
        "Whether the phase of ``parity`` (0 or 1) of the mbarrier at ``smem[word]`` has completed.", answers=True)

    @intrinsic
    def bulk_copy(typingctx, dst, dst_word, src, src_word, nbytes, smem, barrier):
        """Start copying ``nbytes`` from ``src[src_word]`` (device memory) to ``dst[dst_word]`` (shared memory),
        counted off the mbarrier at ``smem[barrier]`` when they land (32-bit words; 16-byte aligned ends,
        ``nbytes`` a multiple of 16)."""
        if not (_flat_words(dst, dst_word, 32) and _flat_words(src, src_word, 32) and _flat_words(smem, barrier, 32)
                and isinstance(nbytes, types.Integer)):
            return None

        def codegen(context, builder, sig, args):
            to = _first_shared_address(context, builder, sig, args)
            origin = _global_address(context, builder, sig.args[2], args[2], args[3], sig.args[3])
            at = _shared_address(context, builder, sig.args[5], args[5], args[6], sig.args[6])
            asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), [_I32, _I64, _I32, _I32]),
                               "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [$0], [$1], $2, [$3];",
                               "r,l,r,r,~{memory}", side_effect=True)
            builder.call(asm, [to, origin, _as_i32(context, builder, args[4], sig.args[4]), at])
            return context.get_dummy_value()

        return types.void(dst, dst_word, src, src_word, nbytes, smem, barrier), codegen

    @intrinsic
    def bulk_reduce_add(typingctx, dst, dst_word, smem, src_word, nbytes):
        """Start adding ``nbytes`` of float32 at ``smem[src_word]`` (shared memory) to ``dst[dst_word]`` (device
        memory, float32), counted in this thread's next bulk group (16-byte aligned ends, ``nbytes`` a multiple of
        16)."""
        if not (_flat_words(dst, dst_word, 32) and dst.dtype == types.float32 and _flat_words(smem, src_word, 32)
                and isinstance(nbytes, types.Integer)):
            return None

        def codegen(context, builder, sig, args):
            to = _global_address(context, builder, sig.args[0], args[0], args[1], sig.args[1])
            origin = _shared_address(context, builder, sig.args[2], args[2], args[3], sig.args[3])
            asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), [_I64, _I32, _I32]),
                               "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [$0], [$1], $2;",
                               "l,r,r,~{memory}", side_effect=True)
            builder.call(asm, [to, origin, _as_i32(context, builder, args[4], sig.args[4])])
            return context.get_dummy_value()

        return types.void(dst, dst_word, smem, src_word, nbytes), codegen

else:
    import threading

    from ...runtime.simulator import thread_gate

    _LOCK = threading.Lock()   # held to read or change any mbarrier

    class _MBarrier:
        """A simulated mbarrier: the arrivals a phase needs, those still missing, the phase, and the gates
        (``runtime.simulator.thread_gate``) of the threads waiting for the phase to complete, in order of arrival."""

        def __init__(self, arrivals):
            self.needed = self.missing = arrivals
            self.phase = 0
            self.waiting = []

        def open(self):
            """Wake the threads waiting now, one at a time (each opens the next one's gate, as
            ``runtime.simulator.BlockBarrier`` does): they look at the phase again."""
            with _LOCK:
                chain, self.waiting = self.waiting, []
            if chain:
                chain[0].release()

        abort = open   # (``runtime.simulator``: another thread of the block failed; the waiters see it and stop)

    def _barriers():
        """The simulated block's mbarriers: word -> ``_MBarrier``."""
        return threading.current_thread()._manager.__dict__.setdefault("_numba_flash_mbarriers", {})

    def barrier_init(smem, word, arrivals):
        """A phase needs ``arrivals`` arrivals (the copies land when issued: no bytes to count)."""
        with _LOCK:
            _barriers()[int(word)] = _MBarrier(int(arrivals))

    def barrier_arrive(smem, word, count):
        """``count`` arrivals; the last of a phase completes it, flips its parity and wakes its waiters."""
        with _LOCK:
            barrier = _barriers()[int(word)]
            barrier.missing -= int(count)
            if barrier.missing < 0:
                raise RuntimeError(f"mbarrier at word {word}: more arrivals than its phase needs")
            completed = barrier.missing == 0
            if completed:
                barrier.missing, barrier.phase = barrier.needed, barrier.phase + 1
        if completed:
            barrier.open()

    def barrier_expect_bytes(smem, word, nbytes):
        """One arrival (the bytes have landed already)."""
        barrier_arrive(smem, word, 1)

    def barrier_try_wait(smem, word, parity):
        """Whether the phase of ``parity`` has completed: the current phase's parity differs (a wait for the phase
        before the first succeeds at once, as on the GPU).  Here the thread sleeps until it has, and answers True (the
        GPU's answer may be False first: the callers loop); it stops when another thread of its block failed."""
        block = threading.current_thread()._manager.__dict__
        gate = thread_gate()
        while True:
            with _LOCK:
                barrier = _barriers()[int(word)]
                if (barrier.phase & 1) != int(parity):
                    return True
                if block.get("_numba_flash_broken"):
                    raise threading.BrokenBarrierError
                chain, place = barrier.waiting, len(barrier.waiting)
                chain.append(gate)
            gate.acquire()
            if place + 1 < len(chain):   # the next waiter of this chain
                chain[place + 1].release()

    def bulk_copy(dst, dst_word, src, src_word, nbytes, smem, barrier):
        """Copy now (16-byte aligned ends and a multiple of 16 bytes, as the engine requires)."""
        if dst_word % 4 or src_word % 4 or nbytes % 16 or nbytes <= 0:
            raise IndexError(f"bulk_copy: words {dst_word}, {src_word} and {nbytes} bytes are not 16-byte units")
        words = nbytes // 4
        dst[dst_word:dst_word + words] = src[src_word:src_word + words]


    def bulk_reduce_add(dst, dst_word, smem, src_word, nbytes):
        """Add now (the simulator runs one block at a time; float32 adds, element by element)."""
        if dst_word % 4 or src_word % 4 or nbytes % 16 or nbytes <= 0:
            raise IndexError(f"bulk_reduce_add: words {dst_word}, {src_word} and {nbytes} bytes are not 16-byte units")
        words = nbytes // 4
        if dst_word + words > dst.size or src_word + words > smem.size:
            raise IndexError(f"bulk_reduce_add: {words} words from {src_word} to {dst_word} run past an array")
        dst[dst_word:dst_word + words] += smem[src_word:src_word + words].view(np.float32)


@inlined_device_function
def barrier_wait(smem, word, parity):
    """Wait until the phase of ``parity`` of the mbarrier at ``smem[word]`` has completed."""
    while not barrier_try_wait(smem, word, parity):
        pass


__all__ = ["BARRIER_BYTES", "barrier_arrive", "barrier_expect_bytes", "barrier_init", "barrier_try_wait", "barrier_wait",
           "bulk_commit", "bulk_copy", "bulk_reduce_add", "bulk_wait_done", "bulk_wait_read", "fence_barrier_init"]
