"""Every kernel factory (a ``make_*`` function of ``numba_flash.kernels``) is cached: a plan that asks for a kernel it
asked for before gets the same ``Kernel`` back, so Numba compiles each specialisation once per process.  (A factory
that lost its ``lru_cache`` still gives right answers, only a new compilation for every new plan: no other test would
notice.)"""
import importlib
import pkgutil

import numba_flash.kernels


def test_every_kernel_factory_is_cached():
    factories = []
    for info in pkgutil.walk_packages(numba_flash.kernels.__path__, "numba_flash.kernels."):
        module = importlib.import_module(info.name)
        factories += [(info.name, name) for name, value in vars(module).items()
                      if name.startswith("make_") and callable(value)
                      and getattr(value, "__module__", None) == module.__name__
                      and not hasattr(value, "cache_info")]
    assert factories == [], f"kernel factories without lru_cache: {factories}"
