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
    # Both rooms: mask_gallery is in experiments/paper, causal_schedule (a model, no GPU) in experiments/tuning.
    assert cli.experiment_path("mask_gallery").parent.name == "paper"
    assert cli.main(["experiment", "causal_schedule", "--out", str(tmp_path)]) == 0
    assert "experiments/tuning/causal_schedule.py" in (tmp_path / "causal_schedule.md").read_text()


def test_experiment_command_lists_every_runnable_script_of_both_rooms():
    import ast
    import pathlib

    experiments = pathlib.Path(cli.__file__).resolve().parent.parent / "experiments"
    scripts = [path for room in cli.EXPERIMENT_ROOMS for path in (experiments / room).glob("*.py")]
    with_main = {path.stem for path in scripts
                 if any(isinstance(node, ast.FunctionDef) and node.name == "main"
                        for node in ast.parse(path.read_text()).body)}
    with_quick = {path.stem for path in scripts if '"--quick"' in path.read_text()}
    assert set(cli.EXPERIMENTS) == with_main and len(cli.EXPERIMENTS) == len(with_main)
    assert set(cli.QUICK_EXPERIMENTS) == with_quick & with_main
    assert all(cli.experiment_path(name).stem == name for name in cli.EXPERIMENTS)


def test_experiment_command_refuses_quick_where_a_script_has_none(capsys):
    assert cli.main(["experiment", "causal_schedule", "--quick"]) == 2
    assert "no --quick mode" in capsys.readouterr().out
