"""How fast Numba's CUDA simulator runs our kernels, and what ``runtime.simulator`` changes in it.

CI runs the whole test suite in the simulator on two cores, where every CUDA thread is a Python thread; its time
is set by how fast the threads meet (``syncthreads``, a warp's shuffles, a warpgroup's products) and by the Python
each thread runs between meetings.  This script times, in one process:

* **meetings**: ``parties`` threads passing ``rounds`` barriers one after the other, with ``threading.Barrier``
  (a ``threading.Condition`` underneath: its waiters wake to contend for its lock in turn) and with
  ``runtime.simulator.BlockBarrier`` (each waiter blocked on a lock of its own, opened by the last to arrive), at
  32 threads (a warp's room) and 128 (a warpgroup's, or a block's ``syncthreads``);
* **calls**: one causal attention of (1, 2, 133, 64) float16 through flash2 (mma.sync's twins) and through the
  wgmma forward, timed as the simulator runs them with ``runtime.simulator.install``'s changes (the median of
  ``--repeats`` calls after one that warms up).

    PYTHONPATH=$PWD python3 experiments/tuning/simulator_speed.py [--repeats 3] [--out experiments/tuning/results]

No GPU: it sets NUMBA_ENABLE_CUDASIM=1 itself (run it as a script: in a process that has already imported
numba_flash on a GPU it says so and stops).  Timings vary by 10-20% from run to run on a busy two-core machine.
"""
import argparse
import os
import platform
import statistics
import sys
import threading
import time

os.environ["NUMBA_ENABLE_CUDASIM"] = "1"

import numpy as np  # noqa: E402

import numba_flash  # noqa: E402
from numba_flash.runtime.simulator import BlockBarrier  # noqa: E402
from numba_flash.tools.report import markdown_table  # noqa: E402


def meeting_us(make_barrier, parties, rounds):
    """Microseconds per meeting of ``parties`` threads, each passing ``rounds`` barriers of ``make_barrier``."""
    barrier = make_barrier(parties)

    def run():
        for _ in range(rounds):
            barrier.wait()

    threads = [threading.Thread(target=run) for _ in range(parties)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return (time.perf_counter() - start) / rounds * 1e6


def call_seconds(algorithm, repeats):
    """Median seconds of a causal (1, 2, 133, 64) float16 attention through ``algorithm`` in the simulator."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 2, 133, 64)).astype(np.float16) for _ in range(3))
    numba_flash.attention(q, k, v, algorithm=algorithm, causal=True)   # (the first call makes the kernels)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        numba_flash.attention(q, k, v, algorithm=algorithm, causal=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per kernel (median reported)")
    parser.add_argument("--rounds", type=int, default=300, help="barriers each thread passes per meeting test")
    parser.add_argument("--out", default=None, help="folder for simulator_speed.md (default: print only)")
    args = parser.parse_args(argv)
    from numba import config

    if not config.ENABLE_CUDASIM:
        print("simulator_speed times the CUDA simulator: run it as a script (it turns the simulator on before "
              "numba_flash is imported), not in a process that uses a GPU")
        return 2

    rows = []
    for parties in (32, 128):
        for name, make in (("threading.Barrier", lambda n: threading.Barrier(n, action=lambda: None)),
                           ("BlockBarrier", lambda n: BlockBarrier(n, action=lambda: None))):
            rows.append(dict(what=f"meeting of {parties} threads, {name}",
                             time=f"{meeting_us(make, parties, args.rounds):.0f} us"))
    for algorithm in ("flash2", "wgmma"):
        rows.append(dict(what=f"causal (1, 2, 133, 64) float16, {algorithm}",
                         time=f"{call_seconds(algorithm, args.repeats):.2f} s"))
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    text = "\n".join([
        "# The simulator's speed",
        "",
        f"Command: `python3 experiments/tuning/simulator_speed.py --repeats {args.repeats}`  ",
        f"Machine: {cpus} CPUs, CPython {platform.python_version()}  ",
        f"Date: {time.strftime('%Y-%m-%d')}",
        "",
        markdown_table(rows),
        "",
    ])
    print(text)
    if args.out:
        with open(os.path.join(args.out, "simulator_speed.md"), "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
