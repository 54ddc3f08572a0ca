"""Faster barriers and device calls for Numba's CUDA simulator (used only when it is on).

The simulator (numba-cuda 0.30) runs each CUDA thread as a Python thread.  Three things in it dominate the time of
our kernels there, and ``install`` replaces them:

1. ``syncthreads``: the simulator has a manager thread poll every thread in a busy loop until all are blocked (seconds
   for a tiny attention).  ``BlockBarrier`` has the same semantics:

   * it releases when every *live* thread of the block has arrived (a thread that returned early no longer counts,
     as in the original);
   * when a thread raises, the barrier, the warp rooms of ``kernels/fast/primitives.py`` and the named barriers of
     ``kernels/hopper/roles.py`` are broken (and the mbarriers' waits of ``kernels/hopper/bulk.py`` stop), so the
     others stop instead of waiting forever, and the first real error is re-raised.

   A ``BlockBarrier`` of a given count also serves as a named barrier (``bar.sync`` / ``bar.arrive``: ``arrive``
   counts a thread that does not wait) and, with an action run by the last thread to arrive, as the rooms in which
   a warp's (or a warpgroup's) lanes meet for a shuffle or a product.  Each waiting thread blocks on a lock of its own
   (its gate, ``thread_gate``); the last to arrive opens the first waiter's gate, and each waiter opens the next
   one's as it leaves.  A ``threading.Condition`` (what ``threading.Barrier`` and this class once used) wakes all its
   waiters at once to contend for the condition's lock; opening every gate at once was faster for a bare meeting
   but slower for our kernels, whose 128 to 384 threads then all compete for the interpreter's lock.  One at a time
   (2 cores, CPython 3.11, 2026-12-08, several runs; one in ``experiments/tuning/results/simulator_speed.md``): a
   meeting of 32 threads 0.5-0.6 ms instead of 1.4, of 128 2.1-2.6 instead of 5.4-7.8; a small causal wgmma forward
   2.4-3.9 s instead of 7-9, flash2 4.3-8 instead of 15-18.  The
   mbarriers of ``kernels/hopper/bulk.py`` wake their waiters the same way.

2. Every call of a device function enters ``swapped_cuda_module``, which takes two locks and, whenever no other
   thread is inside a function of the same module, scans the module's globals to swap ``cuda`` for the launch's
   fake module and back: ~300,000 times for one small wgmma forward.  ``install`` swaps each module once per launch
   (``_swap_once_per_launch``) and back when the launch ends.

3. It fixes a race in the simulator's ``cuda.shared.array``: the array of a call site is created by the first thread
   that asks for it, but two threads asking at once could each create one, and then half the block wrote to a
   different "shared" array than the other half (we saw O off by 0.4 about once in a few hundred launches).
   Creation now happens under a lock.

With these (and ``kernels/hopper/wgmma.py``'s twins reading each thread's accumulator layout from a cache), the whole
test suite takes 320 s instead of 937 on two cores (``pytest -n 2``, 2026-12-08; its tests' own times add up to 610 s
instead of 1823).
"""
import sys
import threading
from contextlib import contextmanager

import numpy as np


def thread_gate():
    """This thread's gate: a lock kept locked, which the thread acquires to wait and another releases to wake it (a
    thread waits at one barrier at a time)."""
    me = threading.current_thread()
    gate = getattr(me, "_numba_flash_gate", None)
    if gate is None:
        gate = me._numba_flash_gate = threading.Lock()
        gate.acquire()
    return gate


class BlockBarrier:
    """A barrier of ``parties`` simulated threads (``syncthreads``, a named barrier, or a warp's room).

    ``action``, if given, runs once per generation in the last thread to arrive, before any other leaves (a room's
    shared computation).  ``timeout`` (seconds, None: none): a thread that waits longer breaks the barrier and raises
    (a deadlock's report; the threads queued behind it in the same generation then time out in turn)."""

    def __init__(self, parties, action=None, timeout=None):
        self._lock = threading.Lock()
        self._parties = parties
        self._arrived = 0     # this generation's arrivals, waiting or not (``arrive``)
        self._gates = []      # the gates of the threads waiting in this generation
        self._broken = False
        self._action = action
        self._timeout = -1 if timeout is None else timeout

    def wait(self):
        gate = thread_gate()
        with self._lock:
            if self._broken:
                raise threading.BrokenBarrierError
            self._arrived += 1
            last = self._arrived == self._parties
            if last:
                opened = self._next_generation()
            else:
                chain, place = self._gates, len(self._gates)
                chain.append(gate)
        if last:
            self._open(opened)
            return
        if not gate.acquire(timeout=self._timeout):
            with self._lock:
                self._broken = True
            raise threading.BrokenBarrierError
        if place + 1 < len(chain):   # the baton: this generation's next waiter
            chain[place + 1].release()
        if self._broken:
            raise threading.BrokenBarrierError

    def arrive(self):
        """Counted without waiting (``bar.arrive``: a named barrier's producer)."""
        with self._lock:
            if self._broken:
                raise threading.BrokenBarrierError
            self._arrived += 1
            if self._arrived < self._parties:
                return
            opened = self._next_generation()
        self._open(opened)

    def leave(self):
        """A thread has finished: the others no longer wait for it."""
        with self._lock:
            self._parties -= 1
            if not self._parties or self._arrived < self._parties:
                return
            opened = self._next_generation()
        self._open(opened)

    def abort(self):
        with self._lock:
            self._broken = True
            opened, self._gates = self._gates, []
        if opened:
            opened[0].release()   # (each waiter opens the next)

    def _next_generation(self):
        """(Holding the lock, all parties in.)  The gates to open; the next generation starts empty."""
        self._arrived = 0
        opened, self._gates = self._gates, []
        return opened

    def _open(self, gates):
        """The action, then the first waiting thread's gate (each waiter opens the next one's as it leaves: one
        thread woken at a time, not all at once).  An action that raises breaks the barrier."""
        try:
            if self._action is not None:
                self._action()
        except BaseException:
            with self._lock:
                self._broken = True
            raise
        finally:
            if gates:
                gates[0].release()


def _swap_once_per_launch(sim):
    """Device functions called in a launch find ``cuda`` in their module's globals already swapped for the launch's
    fake module (point 2 above); every module swapped is swapped back when the launch ends."""
    from numba import cuda

    swapped = {}   # id(a module's globals) -> (the globals, {name: the value swapped out})
    lock = threading.Lock()
    original_call = sim.FakeCUDAKernel.__call__
    original_push = sim._push_kernel_context

    def call(self, *args):
        fake = sim._kernel_context
        if fake is None:   # a launch, or a device function called outside one: the simulator's own way
            return original_call(self, *args)
        module = self.fn.__globals__
        if id(module) not in swapped:
            with lock:
                if id(module) not in swapped:
                    names = {name: value for name, value in module.items() if value is cuda}
                    module.update(dict.fromkeys(names, fake))
                    swapped[id(module)] = (module, names)
        return self.fn(*args)

    @contextmanager
    def push_kernel_context(fake):
        with original_push(fake):
            try:
                yield
            finally:
                with lock:
                    for module, names in swapped.values():
                        module.update(names)
                    swapped.clear()

    sim.FakeCUDAKernel.__call__ = call
    sim._push_kernel_context = push_kernel_context


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
            block["_numba_flash_broken"] = True   # (before the mbarriers' waits are opened: they see it)
            for room in list(block.get("_numba_flash_rooms", {}).values()):
                room.barrier.abort()
            for barrier in list(block.get("_numba_flash_named_barriers", {}).values()):
                barrier.abort()
            for barrier in list(block.get("_numba_flash_mbarriers", {}).values()):   # (kernels/hopper/bulk.py)
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
    _swap_once_per_launch(sim)
