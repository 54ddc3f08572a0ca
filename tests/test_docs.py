"""The documentation's code runs as written, so it cannot go stale.

Every ```python block of README.md and of each docs/*.md page runs, the
blocks of one page in order and in one namespace (a later block may use what
an earlier one defined); every ```pycon block runs through doctest in that
namespace, so what it shows printed is checked.  A block whose info string
says ``no-run`` (```python no-run) is shown but not run: examples that need a
GPU, several processes or a torch.distributed launch.  In the simulator every
kernel call costs seconds, so the examples keep to tiny shapes.

Also checked: every local link and every repository path written as code
(`experiments/...`, `numba_flash/...`) names a file that exists, no page says
"session" (a date says when), and the README stays a newcomer's page.
"""
import doctest
import pathlib
import re
import sys
import types

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
#: Files that pages include whole (```{include} ../experiments/paper/README.md): part of the site too.
INCLUDED = sorted({(page.parent / path).resolve() for page in PAGES
                   for path in re.findall(r"^```\{include\}[ \t]+(\S+)", page.read_text(), flags=re.M)})

#: A fenced block: its info string (language, then options such as no-run) and its text, with the line it starts on.
_FENCE = re.compile(r"^(?P<fence>`{3,})(?P<info>[^`\n]*)\n(?P<body>.*?)^(?P=fence)[ \t]*$", re.M | re.S)
#: Markdown links and images, [text](target), and repository paths written as code, `experiments/x/y.md`.
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
_REPO_PATH = re.compile(r"`((?:experiments|numba_flash|tests|reference|docs|\.ci)/[^`\s*{}<>]*)`")
#: What the docs build writes (named by the pages that say how to build and open them): not in a fresh checkout.
BUILT = "docs/_build/"
#: Short forms that name no place: write the whole path (experiments/tuning/results/x.md) instead.
_AMBIGUOUS_PATH = re.compile(r"`(results/[^`\s]+)`")
#: Code, where a link is an example of one: inline spans, and the fenced blocks (matched by _FENCE).
_CODE_SPAN = re.compile(r"(`+)(?!`).+?(?<!`)\1(?!`)", re.S)


def code_blocks(page):
    """(language, runs, text, first line) of each fenced block of a page."""
    text = page.read_text()
    for match in _FENCE.finditer(text):
        words = match["info"].split()
        language = words[0] if words else ""
        line = text.count("\n", 0, match.start("body")) + 1
        yield language, "no-run" not in words[1:], match["body"], line


def examples(page):
    return [block for block in code_blocks(page) if block[0] in ("python", "pycon")]


def test_most_examples_run():
    blocks = [block for page in PAGES for block in examples(page)]
    run = sum(runs for _, runs, _, _ in blocks)
    not_run = len(blocks) - run
    print(f"{run} examples run, {not_run} shown only (no-run)")
    assert run >= 10 and run > 2 * not_run, (run, not_run)


@pytest.mark.parametrize("page", [page for page in PAGES if examples(page)], ids=lambda page: page.name)
def test_examples_run(page, monkeypatch):
    # The page's namespace is a module's, registered in sys.modules: torch.compile (Dynamo) looks up the module
    # of the code it compiles by its __name__.
    module = types.ModuleType(f"docs_{page.stem.replace('-', '_')}")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    namespace = module.__dict__
    parser = doctest.DocTestParser()
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    for language, runs, body, line in examples(page):
        if not runs:
            continue
        if language == "python":
            exec(compile("\n" * (line - 1) + body, str(page), "exec"), namespace)
        else:
            test = parser.get_doctest(body, namespace, f"{page.name}:{line}", str(page), line - 1)
            report = []
            result = runner.run(test, out=report.append, clear_globs=False)
            assert result.failed == 0, "".join(report)
            namespace.update(test.globs)  # doctest ran on a copy: what the block defined, later blocks see


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_links_and_paths_exist(page):
    text = page.read_text()
    missing = []
    for target in _LINK.findall(_CODE_SPAN.sub("", _FENCE.sub("", text))):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue  # a web address, or a heading of this page (Sphinx checks those)
        if not (page.parent / target.split("#")[0]).exists():
            missing.append(target)
    for path in _REPO_PATH.findall(text):
        if not path.startswith(BUILT) and not (ROOT / path.rstrip("/")).exists():
            missing.append(path)
    assert not missing, f"{page.name} names files that do not exist: {missing}"
    short = _AMBIGUOUS_PATH.findall(text)
    assert not short, f"{page.name}: write {short} in full (experiments/<room>/results/...)"


def test_included_files_exist():
    assert all(path.is_file() for path in INCLUDED), INCLUDED


@pytest.mark.parametrize("page", PAGES + INCLUDED, ids=lambda page: str(page.relative_to(ROOT)))
def test_no_page_says_session(page):
    lines = [number for number, line in enumerate(page.read_text().splitlines(), 1) if "session" in line.lower()]
    assert not lines, f"{page}, lines {lines}: say the date of a measurement, not the session that made it"


def test_readme_is_short_and_starts_with_the_demo():
    lines = README.read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines: move the detail to docs/"
    bash = [body for language, _, body, _ in code_blocks(README) if language == "bash"]
    assert bash and bash[0].splitlines()[0] == "pip install -e . && numba-flash demo"
