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
