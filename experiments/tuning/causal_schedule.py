"""Causal grids: in what order to dispatch tiles of unequal work (a scheduling model, no GPU).

A causal forward's query tile i (from the top) visits i + 1 key tiles of its own height, so one
head's tiles range from 1 to T units of work.  The GPU starts thread blocks in the order of their
index as block slots free up (the H200 holds two of our 16-bit forward's blocks per multiprocessor:
264 slots).  ``common.tile_coordinates`` decides the order:

* head-major (before): block i runs tile rank i % T of head i // T, each head's longest tile first.
  The last heads' longest tiles are dispatched when most of the work is done and run alone at the end.
* rank-major (now, causal grids): block i runs rank i // BH of head i % BH, every head's longest tile
  before any shorter one: longest-processing-time-first list scheduling, whose tail is one short tile.

The model: greedy list scheduling of the blocks, in index order, onto the slots; a block costs the
key tiles it visits plus ``--overhead`` tiles (its Q load and O store).  It ignores L2: rank-major
runs more heads at once (their K and V compete for L2), which only a GPU run can weigh.

    python3 experiments/tuning/causal_schedule.py [--slots 264] [--overhead 0.5] [--out DIR]
"""
import argparse
import heapq
import os

from numba_flash.tools.report import markdown_header, markdown_table, write_csv

RESULTS = os.path.join(os.path.dirname(__file__), "results")
#: (B, H, N, query rows per tile): issue 15's shapes at the forward's (128, 64) tiles.
CASES = [(4, 16, 4096, 128), (2, 16, 8192, 128), (1, 16, 16384, 128), (8, 16, 1024, 128)]


def makespan(costs, slots):
    """When the last of ``costs`` (in dispatch order) ends, each block taking the slot that frees first."""
    free = [0.0] * slots
    end = 0.0
    for cost in costs:
        start = heapq.heappop(free)
        end = max(end, start + cost)
        heapq.heappush(free, start + cost)
    return end


def orders(batch_heads, tiles, overhead):
    """Block costs in dispatch order: head-major and rank-major; rank r is tile T - 1 - r (T - r key tiles)."""
    cost = [tiles - rank + overhead for rank in range(tiles)]
    head_major = [cost[i % tiles] for i in range(batch_heads * tiles)]
    rank_major = [cost[i // batch_heads] for i in range(batch_heads * tiles)]
    return head_major, rank_major


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slots", type=int, default=264, help="blocks resident at once (132 SMs x 2)")
    parser.add_argument("--overhead", type=float, default=0.5, help="a block's fixed cost, in key tiles")
    parser.add_argument("--out", default=RESULTS)
    args = parser.parse_args(argv)
    rows = []
    for batch, heads, n, block_m in CASES:
        tiles = -(-n // block_m)
        head_major, rank_major = orders(batch * heads, tiles, args.overhead)
        ideal = max(sum(head_major) / args.slots, max(head_major))
        rows.append(dict(shape=(batch, heads, n), blocks=batch * heads * tiles, ideal=round(ideal, 1),
                         head_major=round(makespan(head_major, args.slots) / ideal, 3),
                         rank_major=round(makespan(rank_major, args.slots) / ideal, 3)))
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, "causal_schedule")
    write_csv(stem + ".csv", rows)
    with open(stem + ".md", "w") as f:
        f.write(markdown_header("Causal grids: dispatch order against the ideal (model)",
                                f"python3 experiments/tuning/causal_schedule.py --slots {args.slots} "
                                f"--overhead {args.overhead}", "none (a list-scheduling model)")
                + f"\nTiles of {CASES[0][3]} query rows, {args.slots} block slots; head_major and rank_major: "
                "the modelled time over the ideal (total work / slots, or the longest block).\n\n"
                + markdown_table(rows))
    print(markdown_table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
