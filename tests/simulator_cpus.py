"""One CPU per test process in the simulator (conftest.py and the ring test's ranks use this).

A simulated kernel is one Python thread per CUDA thread, handing the GIL back and forth at every barrier
and warp instruction: one core's worth of work at most, but with its threads free to run on every core
each hand-over wakes a thread on another core, and the process spends about as much time in the kernel's
scheduler as in Python.  Pinned to one CPU the same tests take about half the time, and two pytest-xdist
workers pinned to two different CPUs no longer slow each other down (measured on a 2-core machine:
tests/test_forward.py with -n 2, 144 s -> 87 s).  Where the tests run changes nothing in what they run
or check.

``NUMBA_FLASH_TEST_PIN=0`` turns it off.  Only Linux has ``os.sched_setaffinity``; elsewhere nothing
happens.
"""
import os

#: The CPUs the session started with, kept in the environment for the processes it starts: a pinned
#: process's own affinity is its one CPU.
CPUS_VARIABLE = "NUMBA_FLASH_TEST_CPUS"


def xdist_worker():
    """The number N of this pytest-xdist worker (gwN), or None outside one."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    return None if worker is None else int(worker.lstrip("gw"))


def session_cpus():
    """The CPUs the test session may use (saved at the first call, so pinned processes and their children
    see the whole set)."""
    saved = os.environ.get(CPUS_VARIABLE)
    if not saved:
        saved = os.environ[CPUS_VARIABLE] = ",".join(str(cpu) for cpu in sorted(os.sched_getaffinity(0)))
    return [int(cpu) for cpu in saved.split(",")]


def pin_to_one_cpu(index):
    """Run this process's threads, and those it starts later, on CPU ``index`` (modulo their number) of
    ``session_cpus()``."""
    if os.environ.get("NUMBA_FLASH_TEST_PIN", "1") == "0" or not hasattr(os, "sched_setaffinity"):
        return
    cpus = session_cpus()
    cpu = {cpus[index % len(cpus)]}
    # sched_setaffinity(0) sets the calling thread's CPUs only: every thread already running (BLAS pools)
    # is set too; threads started from now on inherit the main thread's.
    for thread_id in os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else ["0"]:
        try:
            os.sched_setaffinity(int(thread_id), cpu)
        except OSError:   # a thread that has just ended
            pass
