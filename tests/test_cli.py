"""The command line: ``numba-flash demo`` runs every algorithm and reports errors."""
import re

from numba_flash import cli


def test_demo_reports_small_errors_for_every_algorithm(capsys):
    assert cli.main(["demo", "--shape", "1", "2", "20", "8", "--causal"]) == 0
    out = capsys.readouterr().out
    for algorithm in cli.ALGORITHMS_IN_DEMO:
        line = next(l for l in out.splitlines() if l.startswith(algorithm))
        error = float(re.split(r"\s+", line)[1])
        assert error < 1e-5
