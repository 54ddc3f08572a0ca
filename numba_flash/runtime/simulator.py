"""A faster barrier for Numba's CUDA simulator (used only when it is on).

The simulator (numba-cuda 0.30) runs each CUDA thread as a Python thread and
implements ``syncthreads`` by having a manager thread poll every thread in a
busy loop until all are blocked; with many barriers per kernel the polling
dominates (seconds for a tiny attention).  ``install`` swaps in a condition-
variable barrier with the same semantics as the original:

* it releases when every *live* thread of the block has arrived (a thread
  that returned early no longer counts, as in the original);
* when a thread raises, the barrier, the warp rooms of
  ``numba_flash.kernels.primitives`` and the named barriers of
  ``kernels/hopper/roles.py`` are broken (and the mbarriers' waits of
  ``kernels/hopper/bulk.py`` stop), so the others stop instead of waiting
  forever, and the first real error is re-raised.

A ``BlockBarrier`` of a given count also serves as a named barrier
(``bar.sync`` / ``bar.arrive``: ``arrive`` counts a thread that does not wait).

It also fixes a race in the simulator's ``cuda.shared.array``: the array of
a call site is created by the first thread that asks for it, but two threads
asking at once could each create one, and then half the block wrote to a
different "shared" array than the other half (we saw O off by 0.4 about once
in a few hundred launches).  Creation now happens under a lock.
"""
import sys
import threading

import numpy as np


class BlockBarrier:
    """``syncthreads`` for one simulated block."""

    def __init__(self, parties):
        self._cond = threading.Condition()
        self._parties = parties
        self._waiting = 0
        self._generation = 0
        self._broken = False

    def wait(self):
        with self._cond:
            if self._broken:
                raise threading.BrokenBarrierError
            generation = self._generation
            self._waiting += 1
            if self._waiting == self._parties:
                self._release()
                return
            while generation == self._generation and not self._broken:
                self._cond.wait()
            if self._broken:
                raise threading.BrokenBarrierError

    def arrive(self):
        """Counted without waiting (``bar.arrive``: a named barrier's producer)."""
        with self._cond:
            if self._broken:
                raise threading.BrokenBarrierError
            self._waiting += 1
            if self._waiting == self._parties:
                self._release()

    def leave(self):
        """A thread has finished: the others no longer wait for it."""
        with self._cond:
            self._parties -= 1
            if self._parties and self._waiting == self._parties:
                self._release()

    def abort(self):
        with self._cond:
            self._broken = True
            self._cond.notify_all()

    def _release(self):
        self._waiting = 0
        self._generation += 1
        self._cond.notify_all()


def install():
    from numba.cuda.simulator import kernel as sim
    from numba.cuda.simulator import kernelapi
    from numba.np import numpy_support
    from numba.core import types

    allocation_lock = threading.Lock()

    def shared_array(self, shape, dtype, alignment=None):
        if alignment is not None:
            raise RuntimeError("Array alignment is not supported in cudasim")
        if isinstance(dtype, types.Type):
            dtype = numpy_support.as_dtype(dtype)
        if shape == 0:  # dynamic shared memory: one buffer for the whole block
            count = self._dynshared_size // dtype.itemsize
            return np.frombuffer(self._dynshared.data, dtype=dtype, count=count)
        caller = sys._getframe(1)  # as the original: one array per call site
        site = (caller.f_code.co_filename, caller.f_lineno)
        with allocation_lock:
            array = self._allocations.get(site)
            if array is None:
                array = self._allocations[site] = np.empty(shape, dtype)
        return array

    original_thread_run = sim.BlockThread.run

    def syncthreads(self):
        self._block_barrier.wait()

    def run_thread(self):
        try:
            original_thread_run(self)
        finally:
            self._block_barrier.leave()
        if self.exception is not None:
            self._block_barrier.abort()
            block = self._manager.__dict__
            block["_numba_flash_broken"] = True   # (``bulk.barrier_try_wait``'s twin stops waiting)
            for room in block.get("_numba_flash_rooms", {}).values():
                room.barrier.abort()
            for barrier in block.get("_numba_flash_named_barriers", {}).values():
                barrier.abort()

    def run_block(self, grid_point, *args):
        barrier = BlockBarrier(int(np.prod(self._block_dim)))
        for state in ("_numba_flash_rooms", "_numba_flash_named_barriers", "_numba_flash_mbarriers",
                      "_numba_flash_broken"):
            self.__dict__.pop(state, None)
        threads = []
        for block_point in np.ndindex(*self._block_dim):
            thread = sim.BlockThread(lambda: self._f(*args), self, grid_point, block_point, self._debug)
            thread._block_barrier = barrier
            threads.append(thread)
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        failures = [t.exception for t in threads if t.exception is not None]
        # Report the thread that failed first, not those it broke out of a barrier.
        failures.sort(key=lambda exc: isinstance(exc[0], threading.BrokenBarrierError))
        if failures:
            raise failures[0][0].with_traceback(failures[0][1])

    kernelapi.FakeCUDAShared.array = shared_array
    sim.BlockThread.syncthreads = syncthreads
    sim.BlockThread.run = run_thread
    sim.BlockManager.run = run_block
