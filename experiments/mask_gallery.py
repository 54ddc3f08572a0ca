"""Mask gallery: a picture of every sparsity pattern in ``numba_flash.masks``.

Draws the example mask of each entry of ``masks.GENERATORS`` for N = 512
tokens in blocks of 32 x 32 (a 16 x 16 block grid, the layout the
block-sparse kernel would iterate) to ``results/mask_<name>.png``, and lists
them with what each shows in ``results/mask_gallery.md``.  Needs matplotlib,
no GPU.

    PYTHONPATH=$PWD python3 experiments/mask_gallery.py
"""
import datetime
import os

from numba_flash.masks import GENERATORS, save_picture

RESULTS = os.path.join(os.path.dirname(__file__), "results")
N = 512
BLOCK_SIZE = (32, 32)
COMMAND = "python3 experiments/mask_gallery.py"


def main():
    os.makedirs(RESULTS, exist_ok=True)
    lines = [f"# Block-mask gallery\n\nCommand: `{COMMAND}`  \nDate: {datetime.date.today()}  \n"
             f"N = {N} queries and keys, blocks of {BLOCK_SIZE[0]} x {BLOCK_SIZE[1]}: a "
             f"{N // BLOCK_SIZE[0]} x {N // BLOCK_SIZE[1]} block layout, dark = kept block.  The examples are "
             f"`numba_flash.masks.GENERATORS` (also `numba-flash masks --show NAME`).\n"]
    for name, example in GENERATORS.items():
        block_mask = example(N, BLOCK_SIZE)
        file_name = f"mask_{name}.png"
        save_picture(block_mask, os.path.join(RESULTS, file_name), title=f"{name}, N = {N}")
        what_it_shows = example.__doc__.splitlines()[0]
        lines.append(f"## {name}\n\n![{name}]({file_name})\n\n{what_it_shows} "
                     f"Density {block_mask.density:.3f}.\n")
        print("wrote", file_name)
    with open(os.path.join(RESULTS, "mask_gallery.md"), "w") as f:
        f.write("\n".join(lines))
    print("wrote mask_gallery.md in", RESULTS)


if __name__ == "__main__":
    main()
