"""Warps with roles: named barriers and register budgets, FlashAttention-3's way of splitting a block's work.

A warp-specialised block gives its warps different jobs (one warpgroup copies tiles and hands dQ's sums to the copy
engine, the others compute), so they cannot all meet at ``syncthreads``: each hand-over has its own barrier among the
threads it concerns.  numba-cuda exposes neither piece below; both are one PTX instruction with constant operands
(``primitives.ptx_statement``), made once per (barrier, count) or budget.

* ``named_barrier_sync(ID, COUNT)`` is ``bar.sync ID, COUNT``: the thread waits until COUNT threads (a multiple of 32)
  have arrived at barrier ID (1 .. 15; 0 is ``syncthreads``'), counting those that only ``named_barrier_arrive(ID,
  COUNT)`` (``bar.arrive``: counted, not waiting).  A producer arrives and a consumer syncs: what the producer wrote
  before its arrive the consumer sees after its sync, as with ``syncthreads``.
* ``register_budget(DIRECTION, COUNT)`` is ``setmaxnreg.{dec,inc}.sync.aligned.u32 COUNT``: every thread of the
  warpgroup gives back registers down to COUNT, or waits until the block's pool has room and takes them up to COUNT.
  The block is launched with the registers of its launch bounds (168 a thread for 384 threads a block); a producer
  warpgroup that drops to 24 leaves enough for two consumer warpgroups to rise to 240 (128 x 24 + 256 x 240 =
  64512 of 65536).  ptxas allocates each region to its budget (a session check, 2026-12-06:
  ``experiments/tuning/results/backward_bulk_dq_h100.md``).  sm_90a only.

The simulator runs each thread as a Python thread: there a named barrier is a ``runtime.simulator.BlockBarrier`` of
COUNT parties per (block, ID), with ``arrive`` counting a thread without waiting, and a register budget does nothing.
"""
from functools import lru_cache

from numba import config

from ..fast.primitives import ptx_statement

#: Named barrier 0 is the block's (``syncthreads``); these kernels use 1 .. 15.
FIRST_NAMED_BARRIER = 1
LAST_NAMED_BARRIER = 15


def _check(ID, COUNT):
    if not FIRST_NAMED_BARRIER <= ID <= LAST_NAMED_BARRIER or COUNT <= 0 or COUNT % 32:
        raise ValueError(f"named barrier {ID} of {COUNT} threads: the id must be 1..15, the count a multiple of 32")


def _check_budget(DIRECTION, COUNT):
    if DIRECTION not in ("dec", "inc") or not 24 <= COUNT <= 256 or COUNT % 8:
        raise ValueError(f"setmaxnreg.{DIRECTION} {COUNT}: dec or inc, 24..256 in steps of 8")


if not config.ENABLE_CUDASIM:
    @lru_cache(maxsize=None)
    def named_barrier_sync(ID, COUNT):
        """Wait at barrier ID until COUNT threads have arrived (this one among them)."""
        _check(ID, COUNT)
        return ptx_statement(f"bar.sync {ID}, {COUNT};")

    @lru_cache(maxsize=None)
    def named_barrier_arrive(ID, COUNT):
        """Arrive at barrier ID of COUNT threads without waiting."""
        _check(ID, COUNT)
        return ptx_statement(f"bar.arrive {ID}, {COUNT};")

    @lru_cache(maxsize=None)
    def register_budget(DIRECTION, COUNT):
        """The warpgroup's registers per thread down ("dec") or up ("inc") to COUNT (24 .. 256, a multiple of 8)."""
        _check_budget(DIRECTION, COUNT)
        return ptx_statement(f"setmaxnreg.{DIRECTION}.sync.aligned.u32 {COUNT};")

else:
    import threading

    from ...runtime.simulator import BlockBarrier

    _LOCK = threading.Lock()

    def _barrier(ID, COUNT):
        """The simulated block's barrier ID (made by the first thread that reaches it)."""
        block = threading.current_thread()._manager
        with _LOCK:
            barriers = block.__dict__.setdefault("_numba_flash_named_barriers", {})
            barrier = barriers.get(ID)
            if barrier is None:
                barrier = barriers[ID] = BlockBarrier(COUNT)
        return barrier

    @lru_cache(maxsize=None)
    def named_barrier_sync(ID, COUNT):
        _check(ID, COUNT)

        def sync():
            _barrier(ID, COUNT).wait()

        return sync

    @lru_cache(maxsize=None)
    def named_barrier_arrive(ID, COUNT):
        _check(ID, COUNT)

        def arrive():
            _barrier(ID, COUNT).arrive()

        return arrive

    @lru_cache(maxsize=None)
    def register_budget(DIRECTION, COUNT):
        _check_budget(DIRECTION, COUNT)
        return ptx_statement("")


__all__ = ["named_barrier_arrive", "named_barrier_sync", "register_budget"]
