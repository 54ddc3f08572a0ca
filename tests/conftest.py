"""Test configuration: simulator or GPU, and the Hypothesis profile for each.

The same test files run in Numba's CUDA simulator (CI, no GPU) and on a real
GPU.  Unless NUMBA_ENABLE_CUDASIM is set, importing numba_flash picks the GPU
when the CUDA driver reports one and the simulator otherwise.

Hypothesis profiles (pick one with HYPOTHESIS_PROFILE or --hypothesis-profile):

* ``sim``: tiny shapes, few examples, derandomised so CI is reproducible;
  the default in the simulator.
* ``gpu``: larger shapes and more examples; the default on a GPU.
* ``thorough``: the GPU sizes with many more examples (an opt-in slow tier).
* ``gpu_smoke``: the GPU sizes with few examples, six head dims and four
  flash2 tiles, for a quick run on a GPU (each new block size and head dim
  compiles a kernel, seconds each).

The sizes each profile draws live in ``strategies.SIZES`` (and
``strategies.SMOKE_HEAD_DIMS``).
"""
import os
import sys

import numba_flash  # noqa: F401,I001  (picks the simulator when there is no GPU, before Numba loads)

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402
from numba import config  # noqa: E402

from simulator_cpus import pin_to_one_cpu, xdist_worker  # noqa: E402

_common = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
               print_blob=True)
settings.register_profile("sim", max_examples=12, derandomize=True, **_common)
settings.register_profile("gpu", max_examples=20, **_common)
settings.register_profile("thorough", max_examples=500, **_common)
settings.register_profile("gpu_smoke", max_examples=5, **_common)  # GPU sizes, few examples: a short device run
PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "sim" if config.ENABLE_CUDASIM else "gpu")
settings.load_profile(PROFILE)


def pytest_configure(config):
    config.addinivalue_line("markers", "simulator_only(reason): needs the simulator (e.g. its array wrappers)")
    config.addinivalue_line("markers", "gpu_only(reason): needs a GPU (e.g. CUDA streams)")
    if config_is_simulator():
        # One CPU per process that runs tests (simulator_cpus says why): pytest-xdist worker gwN on the N-th
        # CPU, a run without workers on one.  Not xdist's controller, which runs no test (and whose CPUs
        # -n auto counts).
        worker = xdist_worker()
        if worker is not None:
            pin_to_one_cpu(worker)
        elif not getattr(config.option, "numprocesses", None):
            pin_to_one_cpu(os.getpid())


def pytest_runtest_logreport(report):
    """With NUMBA_FLASH_TEST_FAILURES=FILE, each failure's report is appended to FILE as it arrives (in the
    process that prints the summary), so that a run cut short by a time limit (a GPU call's) still says what
    failed and why."""
    path = os.environ.get("NUMBA_FLASH_TEST_FAILURES")
    if path and report.failed and xdist_worker() is None:
        with open(path, "a") as f:
            f.write(f"{report.nodeid} ({report.when})\n{report.longreprtext}\n\n")


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """A pytest-xdist worker ends its process as soon as it has sent its results (in ``pytest_sessionfinish``)
    and every other plugin has unconfigured.  On the H200 workers that had run GPU tests kept the controller
    waiting in its teardown for minutes after the last test (2026-12-03: every test passed, then a device
    call's time limit struck before the summary); the interpreter's own shutdown (CUDA contexts, Numba's and
    torch's exit handlers) is what they were doing, and a test process has nothing left to save."""
    if xdist_worker() is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def pytest_collection_modifyitems(config, items):
    """Deselect (not skip) tests that cannot run in this mode, and say so in the report header.

    A test marked ``simulator_only`` instruments the simulator's arrays; one
    marked ``gpu_only`` needs real CUDA streams.  Every other test runs in
    both modes.
    """
    unavailable = "gpu_only" if config_is_simulator() else "simulator_only"
    kept, dropped = [], []
    for item in items:
        (dropped if item.get_closest_marker(unavailable) else kept).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept
        config._numba_flash_deselected = (unavailable, len(dropped))


def pytest_report_header(config):
    return f"numba-flash: {'CUDA simulator' if config_is_simulator() else 'GPU'}, Hypothesis profile {PROFILE}"


def config_is_simulator():
    return bool(config.ENABLE_CUDASIM)


def pytest_terminal_summary(terminalreporter, config):
    marker, count = getattr(config, "_numba_flash_deselected", (None, 0))
    if count:
        mode = "the simulator" if config_is_simulator() else "a GPU"
        terminalreporter.write_line(f"numba-flash: {count} tests marked {marker} deselected: they cannot run on {mode}")


@pytest.fixture
def no_launch(monkeypatch):
    """Any kernel launch is a failure: bad input must be rejected first (every launcher: the fast kernels'
    ``Launch`` and the literal and standard kernels' ``launch``)."""
    from numba_flash.kernels.literal import flash1_forward, standard_attention
    from numba_flash.runtime import launch

    def forbidden(*args, **kwargs):
        raise AssertionError("a kernel was launched before the input was rejected")
    monkeypatch.setattr(flash1_forward, "launch", forbidden)
    monkeypatch.setattr(standard_attention, "launch", forbidden)
    monkeypatch.setattr(launch.Launch, "__call__", forbidden)


@pytest.fixture
def hopper_lookalike(monkeypatch):
    """The device made to look like an H100/H200 (compute capability 9.0; sm_90a not enabled, nothing launched), so
    that tests of flash2's pick build plans in the simulator.  Returns the device: set its ``compute_capability``
    to see the pick on another GPU."""
    from types import SimpleNamespace

    from numba_flash.kernels.hopper import backward as hopper_backward
    from numba_flash.kernels.hopper import common
    from numba_flash.kernels.hopper import forward as hopper

    device = SimpleNamespace(compute_capability=(9, 0), multiprocessors=132)
    for module in (hopper_backward, hopper, common):
        monkeypatch.setattr(module, "in_simulator", lambda: False)
    for module in (hopper_backward, common):
        monkeypatch.setattr(module, "device_limits", lambda: device)
    for module in (hopper, hopper_backward):
        monkeypatch.setattr(module, "enable_sm90a", lambda: None)
    return device
