"""experiments/ in two rooms: every script listed in its room's README, every relative link resolving."""
import pathlib
import re

import pytest

EXPERIMENTS = pathlib.Path(__file__).resolve().parent.parent / "experiments"
ROOMS = ("paper", "tuning")
READMES = [EXPERIMENTS / "README.md"] + [EXPERIMENTS / room / "README.md" for room in ROOMS]
#: A Markdown link or image: [text](target) or ![alt](target), the target up to a space or ")".
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def relative_links(path):
    """The relative link targets of a Markdown file, without #fragments (web and mail links left out)."""
    targets = (match.group(1) for match in LINK.finditer(path.read_text()))
    return [target.split("#")[0] for target in targets
            if not re.match(r"[a-z][a-z0-9+.-]*:", target) and not target.startswith("#")]


@pytest.mark.parametrize("room", ROOMS)
def test_every_script_is_listed_in_its_rooms_readme(room):
    scripts = sorted(path.name for path in (EXPERIMENTS / room).glob("*.py"))
    assert scripts, room
    readme = (EXPERIMENTS / room / "README.md").read_text()
    rows = [line for line in readme.splitlines() if line.startswith("| `")]
    listed = {re.match(r"\| `([^`]+\.py)`", row).group(1) for row in rows if re.match(r"\| `[^`]+\.py`", row)}
    assert set(scripts) <= listed, sorted(set(scripts) - listed)
    for script in scripts:  # and the command in its row names the script where it now lives
        row = next(row for row in rows if row.startswith(f"| `{script}`"))
        assert f"experiments/{room}/{script}" in row, script


def test_every_script_lives_in_a_room():
    assert not list(EXPERIMENTS.glob("*.py")), "scripts belong in experiments/paper or experiments/tuning"
    assert not (EXPERIMENTS / "results").exists() or not any(
        path.name for path in (EXPERIMENTS / "results").iterdir() if "_quick." not in path.name), \
        "results belong in experiments/paper/results or experiments/tuning/results"


@pytest.mark.parametrize("readme", READMES + [EXPERIMENTS / room / "NOTES.md" for room in ROOMS],
                         ids=lambda path: str(path.relative_to(EXPERIMENTS)))
def test_every_relative_link_resolves(readme):
    links = relative_links(readme)
    assert links, readme
    missing = [target for target in links if not (readme.parent / target).exists()]
    assert not missing, missing


def test_links_between_results_files_resolve():
    for room in ROOMS:
        for path in (EXPERIMENTS / room / "results").glob("*.md"):
            missing = [target for target in relative_links(path) if not (path.parent / target).exists()]
            assert not missing, (path.name, missing)
