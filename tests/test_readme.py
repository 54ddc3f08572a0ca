"""The README's Python examples run as written, so they cannot go stale."""
import pathlib
import re

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def python_blocks():
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_examples():
    assert python_blocks()


def test_readme_examples_run(capsys):
    for block in python_blocks():
        exec(compile(block, str(README), "exec"), {})
    printed = capsys.readouterr().out
    assert "(48, 48)" in printed  # the line-1 example prints what the README says
