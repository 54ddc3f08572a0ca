"""Counting the device memory a kernel touches, in Numba's CUDA simulator.

In the simulator a kernel's array arguments are NumPy arrays behind two
wrappers: the host holds ``FakeCUDAArray``s, and inside the kernel every
argument is a ``FakeWithinKernelCUDAArray`` whose ``__getitem__`` and
``__setitem__`` index the NumPy array.  Every global load and store of a
kernel, including those of the ``load_word``/``load_vec4``/``store_word``/
``store_vec4`` twins in ``numba_flash.kernels.fast.primitives`` (which index their
array element by element), goes through those two methods.  Shared and local
memory are plain NumPy arrays in the simulator and never do, so they are not
counted.

``count_traffic()`` wraps the two methods (and the launch) for the duration
of a ``with`` block and attributes every access to the kernel parameter that
the accessed array was passed as, by the identity of the NumPy buffer at the
root of its ``.base`` chain: a reshaped or re-typed view of an argument (as
flash2 makes of q, k, v, o) counts as that argument.  Bytes are elements
times the item size of the array *as indexed*: flash2's float16 data viewed
as uint32 pairs counts 4 bytes per word, so a ``load_vec4`` counts 16.

It also records the device buffers that new ``FakeCUDAArray``s wrap inside
the block (by their roots), which is what a call allocates; a view made in
the block of a buffer allocated before it would count too, so allocate
such buffers (like cached placeholders) before counting.
"""
import inspect
import threading
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
from numba.cuda.simulator import kernel as simulator_kernel
from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray, FakeWithinKernelCUDAArray


def root_buffer(array):
    """The NumPy array that owns the memory ``array`` views."""
    while isinstance(array.base, np.ndarray):
        array = array.base
    return array


@dataclass
class LaunchCount:
    """Bytes one kernel launch read and wrote, per kernel parameter name."""

    kernel: str
    reads: Counter = field(default_factory=Counter)
    writes: Counter = field(default_factory=Counter)


@dataclass
class TrafficCounter:
    launches: list = field(default_factory=list)
    #: Root buffers of the device arrays created while counting, by id.
    allocations: dict = field(default_factory=dict)

    @property
    def allocated_bytes(self):
        return sum(buffer.nbytes for buffer in self.allocations.values())


@contextmanager
def count_traffic():
    """Count device-memory traffic per launch and allocations until the block exits."""
    counter = TrafficCounter()
    lock = threading.Lock()  # simulated CUDA threads are Python threads
    # The simulator runs one launch at a time: (its LaunchCount, {root id: parameter}).
    current = {}

    original_call = simulator_kernel.FakeCUDAKernel.__call__
    original_getitem = FakeWithinKernelCUDAArray.__getitem__
    original_setitem = FakeWithinKernelCUDAArray.__setitem__
    original_init = FakeCUDAArray.__init__

    def counting_call(kernel, *args):
        # Device functions go through __call__ too: only a launch from the host starts a count.
        if kernel._device or simulator_kernel._get_kernel_context() is not None:
            return original_call(kernel, *args)
        parameters = inspect.signature(kernel.fn).parameters
        buffers = {id(root_buffer(arg._ary)): name for name, arg in zip(parameters, args)
                   if isinstance(arg, FakeCUDAArray)}
        launch = LaunchCount(kernel.fn.__name__)
        current.update(launch=launch, buffers=buffers)
        try:
            return original_call(kernel, *args)
        finally:
            current.clear()
            counter.launches.append(launch)

    def record(array, direction, elements):
        ary = array._item._ary
        parameter = current["buffers"][id(root_buffer(ary))]  # KeyError: not a kernel argument
        with lock:
            getattr(current["launch"], direction)[parameter] += elements * ary.itemsize

    def counting_getitem(array, index):
        value = original_getitem(array, index)
        # Indexing that returns a sub-array is a view, not a load: its
        # element accesses are counted when they happen.
        if not isinstance(value, FakeWithinKernelCUDAArray):
            record(array, "reads", np.size(value))
        return value

    def counting_setitem(array, index, value):
        original_setitem(array, index, value)
        record(array, "writes", np.size(array._item._ary[index]))

    def recording_init(array, ary, *args, **kwargs):
        original_init(array, ary, *args, **kwargs)
        root = root_buffer(ary)
        counter.allocations.setdefault(id(root), root)  # holding it keeps the id unique

    simulator_kernel.FakeCUDAKernel.__call__ = counting_call
    FakeWithinKernelCUDAArray.__getitem__ = counting_getitem
    FakeWithinKernelCUDAArray.__setitem__ = counting_setitem
    FakeCUDAArray.__init__ = recording_init
    try:
        yield counter
    finally:
        simulator_kernel.FakeCUDAKernel.__call__ = original_call
        FakeWithinKernelCUDAArray.__getitem__ = original_getitem
        FakeWithinKernelCUDAArray.__setitem__ = original_setitem
        FakeCUDAArray.__init__ = original_init
