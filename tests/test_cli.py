"""The command line: ``numba-flash demo`` runs every algorithm and reports errors."""
import re

from numba_flash import cli
from tolerances import DEMO_MAX_ERROR


def test_demo_reports_small_errors_for_every_algorithm(capsys):
    assert cli.main(["demo", "--shape", "1", "2", "20", "8", "--causal"]) == 0
    out = capsys.readouterr().out
    for algorithm in cli.ALGORITHMS_IN_DEMO:
        line = next(l for l in out.splitlines() if l.startswith(algorithm))
        error = float(re.split(r"\s+", line)[1])
        assert error < DEMO_MAX_ERROR


def test_experiment_command_runs_a_quick_experiment(tmp_path, capsys):
    assert cli.main(["experiment", "mask_gallery", "--quick", "--out", str(tmp_path)]) in (0, None)
    assert (tmp_path / "mask_gallery_quick.md").exists()
    assert cli.main(["experiment", "block_size_choice", "--quick", "--out", str(tmp_path)]) in (0, None)
    assert "line 1 / fastest" in (tmp_path / "block_size_choice_quick.md").read_text()
