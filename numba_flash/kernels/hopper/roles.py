"""Warps with roles: named barriers and register budgets, FlashAttention-3's way of splitting a block's work.

A warp-specialised block gives its warps different jobs (one warpgroup copies tiles and hands dQ's sums to the copy
engine, the others compute), so they cannot all meet at ``syncthreads``: each hand-over has its own barrier among the
threads it concerns.  numba-cuda exposes neither piece below; each is one PTX instruction.

* ``named_sync(barrier, threads)`` is ``bar.sync barrier, threads``: the thread waits until ``threads`` threads (a
  multiple of 32) have arrived at barrier ``barrier`` (1 .. 15, the same in every lane of a warp; 0 is
  ``syncthreads``'), counting those that only ``named_arrive(barrier, threads)`` (``bar.arrive``: counted, not
  waiting).  A producer arrives and a consumer syncs: what the producer wrote before its arrive the consumer sees
  after its sync, as with ``syncthreads``.
* ``register_budget(DIRECTION, COUNT)`` is ``setmaxnreg.{dec,inc}.sync.aligned.u32 COUNT`` (a constant of the
  instruction): every thread of the warpgroup gives back registers down to COUNT, or waits until the block's pool has
  room and takes them up to COUNT.  The block is launched with the registers of its launch bounds (168 a thread for
  384 threads a block); a producer warpgroup that drops to 24 leaves enough for two consumer warpgroups to rise to
  240 (128 x 24 + 256 x 240 = 64512 of 65536).  ptxas allocates each region to its budget (2026-12-07, sm_90a: the
  bulk modes' consumer loop without a spill at 240, ``specialized_dkdv.py``).  sm_90a only.

The simulator runs each thread as a Python thread: there a named barrier is a ``runtime.simulator.BlockBarrier`` of
``threads`` parties per (block, barrier), with ``arrive`` counting a thread without waiting, and a register budget
does nothing.
"""
from functools import lru_cache

from numba import config

from ..fast.primitives import ptx_statement

#: Named barrier 0 is the block's (``syncthreads``); kernels with roles use 1 .. 15.
NAMED_BARRIERS = range(1, 16)


def _check_budget(DIRECTION, COUNT):
    if DIRECTION not in ("dec", "inc") or not 24 <= COUNT <= 256 or COUNT % 8:
        raise ValueError(f"setmaxnreg.{DIRECTION} {COUNT}: dec or inc, 24..256 in steps of 8")


if not config.ENABLE_CUDASIM:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    from ..fast.primitives import _I32

    def _named(text, doc):
        @intrinsic
        def operation(typingctx, barrier, threads):
            if not (isinstance(barrier, types.Integer) and isinstance(threads, types.Integer)):
                return None

            def codegen(context, builder, sig, args):
                operands = [context.cast(builder, value, ty, types.uint32) for value, ty in zip(args, sig.args)]
                asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), [_I32, _I32]), text, "r,r,~{memory}",
                                   side_effect=True)
                builder.call(asm, operands)
                return context.get_dummy_value()

            return types.void(barrier, threads), codegen

        operation.__doc__ = doc
        return operation

    named_sync = _named("bar.sync $0, $1;", "Wait at named barrier ``barrier`` until ``threads`` threads arrived.")
    named_arrive = _named("bar.arrive $0, $1;", "Arrive at named barrier ``barrier`` of ``threads`` threads.")

    @lru_cache(maxsize=None)
    def register_budget(DIRECTION, COUNT):
        """The warpgroup's registers per thread down ("dec") or up ("inc") to COUNT (24 .. 256, a multiple of 8)."""
        _check_budget(DIRECTION, COUNT)
        return ptx_statement(f"setmaxnreg.{DIRECTION}.sync.aligned.u32 {COUNT};")

else:
    import threading

    from ...runtime.simulator import BlockBarrier

    _LOCK = threading.Lock()

    def _barrier(barrier, threads):
        """The simulated block's named barrier (made by the first thread that reaches it)."""
        barrier, threads = int(barrier), int(threads)
        if barrier not in NAMED_BARRIERS or threads <= 0 or threads % 32:
            raise ValueError(f"named barrier {barrier} of {threads} threads: 1..15, a multiple of 32 threads")
        block = threading.current_thread()._manager
        with _LOCK:
            barriers = block.__dict__.setdefault("_numba_flash_named_barriers", {})
            if barrier not in barriers:
                barriers[barrier] = BlockBarrier(threads)
                barriers[barrier].threads = threads
        found = barriers[barrier]
        if found.threads != threads:
            raise ValueError(f"named barrier {barrier}: {threads} threads here, {found.threads} elsewhere")
        return found

    def named_sync(barrier, threads):
        _barrier(barrier, threads).wait()

    def named_arrive(barrier, threads):
        _barrier(barrier, threads).arrive()

    @lru_cache(maxsize=None)
    def register_budget(DIRECTION, COUNT):
        _check_budget(DIRECTION, COUNT)
        return ptx_statement("")


@lru_cache(maxsize=None)
def role_budgets(PRODUCER_REGISTERS, CONSUMER_GROUPS=2):
    """(give_registers, take_registers, CONSUMER_REGISTERS) for a block of a producer warpgroup and CONSUMER_GROUPS
    consumer warpgroups launched with launch bounds of that many threads (ptxas then allocates at most the
    multiprocessor's 65536 registers over them, rounded down to 8 a thread: 168 for 384 threads, 128 for 512): the
    producer gives back down to PRODUCER_REGISTERS a thread, the consumers take what that frees, CONSUMER_REGISTERS (a
    multiple of 8; two consumers: 24 -> 240, 56 -> 224; three: 56 -> 152)."""
    threads = 128 * (1 + CONSUMER_GROUPS)
    pool = threads * (65536 // threads // 8 * 8)
    consumer = (pool - 128 * PRODUCER_REGISTERS) // (128 * CONSUMER_GROUPS) // 8 * 8
    return register_budget("dec", PRODUCER_REGISTERS), register_budget("inc", consumer), consumer


__all__ = ["NAMED_BARRIERS", "named_arrive", "named_sync", "register_budget", "role_budgets"]
