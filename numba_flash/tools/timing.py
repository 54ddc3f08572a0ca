"""Timing GPU work: CUDA events on a GPU, the wall clock in the simulator."""
import statistics
import time

from numba import cuda

from ..runtime.device import in_simulator

#: How long ``time_ms(..., device_only=True)`` first keeps the stream busy ahead of each timed call: far more
#: than a call here spends on the host in a quiet process (20-300 us, ``numba-flash bench --host``).
HOLD_MS = 5.0
#: Times the hold may grow fourfold for a sample whose call took longer to issue (a busy host).
HOLD_RETRIES = 3


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
    graph).  A sample whose call took longer to issue than most of the wait
    is taken again behind a longer one; one that outlasts every wait raises,
    rather than report a mixture.
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
        elif device_only:
            samples.append(_device_time(run))
        else:
            samples.append(_event_time(run, hold_ms=0)[0])
    return statistics.median(samples)


def _event_time(run, hold_ms):
    """(ms between events around ``run()``, ms the host took to issue it), the stream held ``hold_ms`` first."""
    begin, end = cuda.event(), cuda.event()
    if hold_ms:
        _hold[1, 1](int(hold_ms * 1000))
    begin.record()
    issued = time.perf_counter()
    run()
    issued = (time.perf_counter() - issued) * 1e3
    end.record()
    end.synchronize()
    return begin.elapsed_time(end), issued


def _device_time(run):
    """One sample of ``run()``'s GPU time: behind a hold the host's issue of the call fits well inside."""
    hold_ms = HOLD_MS
    for _ in range(HOLD_RETRIES + 1):
        ms, issued = _event_time(run, hold_ms)
        if issued < 0.8 * hold_ms:
            return ms
        hold_ms *= 4
    raise RuntimeError(f"time_ms(device_only=True): the call took {issued:.2f} ms to issue, longer than most of "
                       f"the {hold_ms / 4:.0f} ms the stream was held; the timing would include host time")
