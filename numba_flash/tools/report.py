"""Writing results: the CSV and plotting boilerplate every experiment shares."""
import csv


def write_csv(path, rows):
    """Rows (dicts with the same keys) as a CSV file with a header."""
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend, or None (with a note) if matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib not installed (pip install numba-flash[plot]): no plot")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def progress(iterable, description):
    """``iterable`` with a tqdm progress bar when tqdm is installed (on stderr), as is otherwise."""
    try:
        from tqdm import tqdm
    except ImportError:
        return iterable
    return tqdm(iterable, desc=description, leave=False)


def timer_note(repeats):
    """How the numbers were timed, as the results files say it."""
    from ..runtime.device import in_simulator

    return "simulator wall clock (not a measurement)" if in_simulator() else f"CUDA events, median of {repeats}"


def markdown_header(title, command, device, timer=None):
    """The opening every results file shares: what ran, where, how it was timed, when."""
    import datetime

    return (f"# {title}\n\nCommand: `{command}`  \nDevice: {device}  \n" + (f"Timings: {timer}  \n" if timer else "")
            + f"Date: {datetime.date.today()}  \n")


def markdown_table(rows, cell=str):
    """Rows (dicts with the same keys) as a markdown table."""
    lines = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    lines += ["| " + " | ".join(cell(value) for value in row.values()) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def save_figure(fig, stem):
    """Lay out ``fig``, save it as ``stem``.png (120 dpi), close it; returns the path."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(stem + ".png", dpi=120)
    plt.close(fig)
    return stem + ".png"
