"""``pip install -e .`` without extras is enough to import numba-flash and run its demo.

The optional packages (the extras' torch, transformers, matplotlib, tqdm, and
the test tools) are hidden from a fresh interpreter by an import hook, as if
they were not installed: the package must import and the demo must run, and
each face that needs an extra must say which one.  ``.ci/run`` also runs the
demo in a virtual environment without extras; this test keeps the rule in
every test run.
"""
import os
import subprocess
import sys
import textwrap

import pytest

#: What the extras bring (setup.cfg's extras_require) and the test tools, none of which the core may import.
OPTIONAL = ("torch", "transformers", "matplotlib", "tqdm", "hypothesis", "pytest")

HIDE = textwrap.dedent(f"""
    import importlib.abc, sys
    class Hide(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if any(name == m or name.startswith(m + ".") for m in {OPTIONAL!r}):
                raise ModuleNotFoundError(f"No module named {{name!r}} (hidden by test_install)", name=name)
    sys.meta_path.insert(0, Hide())
""")


def run_hidden(code):
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM=os.environ.get("NUMBA_ENABLE_CUDASIM", ""))
    if not env["NUMBA_ENABLE_CUDASIM"]:
        del env["NUMBA_ENABLE_CUDASIM"]
    return subprocess.run([sys.executable, "-c", HIDE + textwrap.dedent(code)], capture_output=True, text=True,
                          env=env, timeout=600)


def test_package_imports_and_the_demo_runs_without_extras():
    result = run_hidden("""
        import numba_flash
        from numba_flash import cli
        assert cli.main(["demo", "--shape", "1", "1", "8", "8"]) == 0
        print("loaded:", sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "matplotlib", "tqdm")))
    """)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "flash2" in result.stdout and "loaded: []" in result.stdout


@pytest.mark.parametrize("module, extra", [("numba_flash.torch", "torch"), ("numba_flash.ring", "torch"),
                                           ("numba_flash.integrations.transformers", "transformers")])
def test_a_face_that_needs_an_extra_names_it(module, extra):
    result = run_hidden(f"""
        try:
            import {module}
        except ImportError as error:
            print("ImportError:", error)
    """)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"pip install 'numba-flash[{extra}]'" in result.stdout, result.stdout


def test_saving_a_mask_picture_names_the_plot_extra(tmp_path):
    result = run_hidden(f"""
        import numba_flash
        try:
            numba_flash.masks.save_picture(numba_flash.masks.causal(64, 64, (16, 16)), {str(tmp_path / 'm.png')!r})
        except ImportError as error:
            print("ImportError:", error)
    """)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "pip install 'numba-flash[plot]'" in result.stdout, result.stdout


def test_the_command_line_names_the_extra_it_misses(tmp_path):
    result = run_hidden(f"""
        from numba_flash import cli
        print("rc", cli.main(["masks", "--show", "causal", "--n", "64", "--block", "16",
                              "--out", {str(tmp_path / 'm.png')!r}]))
    """)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "rc 2" in result.stdout and "pip install 'numba-flash[plot]'" in result.stderr, result.stderr
