"""Timing GPU work: CUDA events on a GPU, the wall clock in the simulator."""
import statistics
import time

from numba import cuda

from ..runtime.device import in_simulator

#: How long ``time_ms(..., device_only=True)`` keeps the stream busy ahead of each timed call: far more than
#: any call here spends on the host (20-300 us, ``numba-flash bench --host``).
HOLD_MS = 5.0


@cuda.jit
def _hold(microseconds):
    """One thread sleeping in 1 us steps: the stream it runs on stays busy for about that long."""
    for _ in range(microseconds):
        cuda.nanosleep(1000)


def time_ms(run, *, repeats=20, warmup=3, setup=None, device_only=False):
    """Median time of ``run()`` in milliseconds over ``repeats`` runs, after ``warmup``.

    ``setup()`` (if given) runs before each timed call, outside the timed
    region: use it to draw fresh inputs.  On a GPU the region is bracketed by
    CUDA events on the default stream; in the simulator (which has no event
    timing) by the host clock after a synchronize.

    The region then holds what the host spends issuing the call as well: the
    events bracket an idle stream until the first launch.  ``device_only``
    keeps the stream busy (a sleeping kernel, ``HOLD_MS``) while the host
    issues ``run()``, so its launches queue behind the wait and the region
    holds GPU work only: the time a profiler reports, which is what a call
    costs when the host runs ahead of the GPU (a decoding loop, a captured
    graph).  A call whose host part outlasts the wait raises, rather than
    report a mixture.
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
            continue
        begin, end = cuda.event(), cuda.event()
        if device_only:
            _hold[1, 1](int(HOLD_MS * 1000))
        begin.record()
        issued = time.perf_counter()
        run()
        issued = (time.perf_counter() - issued) * 1e3
        end.record()
        end.synchronize()
        if device_only and issued > 0.8 * HOLD_MS:
            raise RuntimeError(f"time_ms(device_only=True): the call took {issued:.2f} ms to issue, near the "
                               f"{HOLD_MS} ms the stream is held; the timing would include host time")
        samples.append(begin.elapsed_time(end))
    return statistics.median(samples)
