"""Mask gallery: a picture of every sparsity pattern in ``numba_flash.masks``.

Draws the example mask of each entry of ``masks.GENERATORS`` for N = 512
tokens in blocks of 32 x 32 (a 16 x 16 block grid, the layout the
block-sparse kernel would iterate) to ``results/mask_<name>.png``, and lists
them with what each shows in ``results/mask_gallery.md``.  Needs matplotlib,
no GPU.

    PYTHONPATH=$PWD python3 experiments/paper/mask_gallery.py [--quick] [--out DIR]
"""
import argparse
import datetime
import os

from numba_flash.masks import GENERATORS, save_picture

RESULTS = os.path.join(os.path.dirname(__file__), "results")
N = 512
BLOCK_SIZE = (32, 32)
COMMAND = "python3 experiments/paper/mask_gallery.py"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small masks (N = 64, blocks of 8), files *_quick.*")
    parser.add_argument("--out", default=RESULTS, help="directory for the outputs")
    args = parser.parse_args(argv)
    n, block_size = (64, (8, 8)) if args.quick else (N, BLOCK_SIZE)
    suffix = "_quick" if args.quick else ""
    os.makedirs(args.out, exist_ok=True)
    lines = [f"# Block-mask gallery\n\nCommand: `{COMMAND}{' --quick' if args.quick else ''}`  \n"
             f"Date: {datetime.date.today()}  \n"
             f"N = {n} queries and keys, blocks of {block_size[0]} x {block_size[1]}: a "
             f"{n // block_size[0]} x {n // block_size[1]} block layout, dark = kept block.  The examples are "
             f"`numba_flash.masks.GENERATORS` (also `numba-flash masks --show NAME`).\n"]
    for name, example in GENERATORS.items():
        block_mask = example(n, block_size)
        file_name = f"mask_{name}{suffix}.png"
        save_picture(block_mask, os.path.join(args.out, file_name), title=f"{name}, N = {n}")
        what_it_shows = example.__doc__.splitlines()[0]
        lines.append(f"## {name}\n\n![{name}]({file_name})\n\n{what_it_shows} "
                     f"Density {block_mask.density:.3f}.\n")
        print("wrote", file_name)
    with open(os.path.join(args.out, f"mask_gallery{suffix}.md"), "w") as f:
        f.write("\n".join(lines))
    print(f"wrote mask_gallery{suffix}.md in", args.out)


if __name__ == "__main__":
    main()
