"""Timing GPU work: CUDA events on a GPU, the wall clock in the simulator."""
import statistics
import time

from numba import cuda

from ..runtime.device import in_simulator


def time_ms(run, *, repeats=20, warmup=3, setup=None):
    """Median time of ``run()`` in milliseconds over ``repeats`` runs, after ``warmup``.

    ``setup()`` (if given) runs before each timed call, outside the timed
    region: use it to draw fresh inputs.  On a GPU the region is bracketed by
    CUDA events on the default stream; in the simulator (which has no event
    timing) by the host clock after a synchronize.
    """
    for _ in range(warmup):
        if setup is not None:
            setup()
        run()
    cuda.synchronize()
    samples = []
    for _ in range(repeats):
        if setup is not None:
            setup()
        if in_simulator():
            start = time.perf_counter()
            run()
            cuda.synchronize()
            samples.append((time.perf_counter() - start) * 1e3)
        else:
            begin, end = cuda.event(), cuda.event()
            begin.record()
            run()
            end.record()
            end.synchronize()
            samples.append(begin.elapsed_time(end))
    return statistics.median(samples)
