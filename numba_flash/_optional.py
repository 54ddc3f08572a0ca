"""Optional dependencies: imported where they are used, with an error that names the extra to install.

``pip install -e .`` gives numba-flash without any extra: NumPy arrays in,
NumPy arrays out, the CLI's demo.  The faces that need more import it
through :func:`require`, so a missing package says what to install instead
of a bare ``ModuleNotFoundError``.
"""
import importlib


def require(module, extra, needed_by):
    """``import module``, or an ImportError saying that ``needed_by`` needs ``pip install 'numba-flash[extra]'``."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise ImportError(f"{needed_by} needs {module.split('.')[0]}, which is not installed: "
                          f"pip install 'numba-flash[{extra}]'") from error
