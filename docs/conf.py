"""Sphinx configuration: Markdown pages (MyST), the furo theme, and the API pages from the docstrings (autodoc).

Build: ``python -m sphinx -W --keep-going -b html docs docs/_build/html`` (the ``docs`` extra, also in ``test``).
"""
import importlib.util
import os
import pathlib
import re
import sys

# autodoc imports numba_flash, on machines without a GPU too: the simulator, before Numba is imported.
os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numba_flash  # noqa: E402

project = "numba-flash"
author = "the numba-flash authors"
copyright = "the numba-flash authors"
release = version = numba_flash.__version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
exclude_patterns = ["_build"]

# Markdown: headings get anchors (links such as page.md#section), $...$ stays literal text.
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence"]

# API pages: members in source order, signatures as written; torch and transformers are optional
# dependencies, imitated when they are not installed so that the pages still build.
autodoc_member_order = "bysource"
autodoc_typehints = "none"
autodoc_inherit_docstrings = False  # not torch.autograd.Function's own docs on forward and backward
autodoc_mock_imports = [name for name in ("torch", "transformers") if importlib.util.find_spec(name) is None]
napoleon_google_docstring = True
napoleon_numpy_docstring = True

html_theme = "furo"
html_title = f"numba-flash {release}"


# ------------------------------------------------------------------ included pages
# The experiments page includes each room's README (experiments/paper/README.md, experiments/tuning/README.md),
# whose links are relative to the README itself, as GitHub shows them.  Before MyST parses an included file,
# each relative link becomes a path from docs/: a download link (MyST's ``path:``) for a file, an image path for
# an image.  Sphinx then copies each file into the site, and warns (an error under -W) for one that is missing.
_MARKDOWN_LINK = re.compile(r"(!?)\[([^\]]*)\]\(([^)\s]+)\)")


def _links_from_docs(app, relative_path, parent_docname, content):
    included = pathlib.Path(app.srcdir, relative_path)

    def rewrite(match):
        image, text, target = match.groups()
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            return match.group(0)   # a web address, or a heading of the included page
        path = os.path.relpath(included.parent / target.split("#")[0], app.srcdir)
        return f"![{text}]({path})" if image else f"[{text}](path:{path})"

    content[0] = _MARKDOWN_LINK.sub(rewrite, content[0])


def setup(app):
    app.connect("include-read", _links_from_docs)
