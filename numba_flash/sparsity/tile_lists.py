"""Which tiles a fast kernel visits under a block mask: built on the host, read by the kernels.

A ``BlockMask`` says which (query block, key block) pairs may attend, in
the mask's own blocks; flash2's kernels work in tiles of their own sizes.
``tile_visits`` turns one into the other: a kernel tile is *visited* if any
mask block it overlaps is non-zero (and, when causal, if it is not wholly
above the diagonal), and *partly masked* unless every block it overlaps is
non-zero; partly masked tiles test each element against the layout.
``tile_lists`` packs the visits as per-tile lists, the format the kernels
read (``listed_tile`` below decodes one entry):

    tiles of own tile i of head bh:  entries[offsets[bh, i] : offsets[bh, i + 1]]
    entry = other tile * 2 + partly-masked bit

Three roles: the forward and the backward's dQ pass list key tiles per
query tile; the dK/dV pass lists query tiles per key tile.  ``longest_first``
orders the own tiles by the length of their lists, longest first: the forward
runs its blocks in that order (the backward's passes keep grid order), so the tiles with the most work start first and
the shortest (and empty) ones fill the tail.  ``mask_arguments``
builds a role's device arrays once per (mask, shapes, tiles) and keeps them
on the mask, which is immutable.
"""
from dataclasses import dataclass

import numpy as np
from numba import cuda

from ..runtime.launch import inlined_device_function


def tile_visits(layout, mask_block, tile, n_q, n_k, causal_offset=None):
    """Which (query tile, key tile) pairs a kernel visits under a block mask, and which it masks.

    layout: (BH, T_r, T_c) bool, in blocks of mask_block = (B_r, B_c); tile:
    (query rows, keys) of the kernel's tiles, which need not match the mask's
    blocks.  causal_offset: None, or the causal rule's offset (key j visible to
    query i iff j <= i + offset).  Returns boolean (visit, partly), each
    (BH, query tiles, key tiles).
    """
    (mask_rows, mask_cols), (block_m, block_n) = mask_block, tile
    heads = layout.shape[0]
    # 2-D prefix sums count the non-zero mask blocks in any rectangle.
    prefix = np.zeros((heads, layout.shape[1] + 1, layout.shape[2] + 1), np.int64)
    prefix[:, 1:, 1:] = layout.cumsum(1).cumsum(2)
    q_first = np.arange(0, n_q, block_m)
    q_last = np.minimum(q_first + block_m, n_q) - 1
    k_first = np.arange(0, n_k, block_n)
    k_last = np.minimum(k_first + block_n, n_k) - 1
    r0, r1 = q_first // mask_rows, q_last // mask_rows + 1
    c0, c1 = k_first // mask_cols, k_last // mask_cols + 1
    nonzero = (prefix[:, r1][:, :, c1] - prefix[:, r0][:, :, c1] - prefix[:, r1][:, :, c0]
               + prefix[:, r0][:, :, c0])
    covered = (r1 - r0)[:, None] * (c1 - c0)[None, :]
    visit = nonzero > 0
    if causal_offset is not None:
        visit &= k_first[None, None, :] <= q_last[None, :, None] + causal_offset
    return visit, visit & (nonzero < covered[None])


def tile_lists(visit, partly):
    """visit, partly (BH, T_own, T_other) as per-(head, own tile) lists of the other tiles to visit.

    Returns (offsets (BH, T_own + 1) int32, entries int32 = other tile * 2 +
    partly-masked bit): head bh's own tile i visits
    ``entries[offsets[bh, i]:offsets[bh, i + 1]] >> 1``, in increasing order.
    """
    heads, own_tiles = visit.shape[:2]
    counts = visit.sum(axis=2)
    offsets = np.zeros((heads, own_tiles + 1), np.int64)
    offsets[:, 1:] = counts.cumsum(axis=1)
    offsets += (np.concatenate([[0], counts.sum(axis=1).cumsum()[:-1]]))[:, None]
    _, _, others = np.nonzero(visit)
    return offsets.astype(np.int32), (others * 2 + partly[visit]).astype(np.int32)


def longest_first(offsets):
    """The own tiles of ``tile_lists``' offsets (BH, T_own + 1) in decreasing order of their list's length (ties
    in grid order), each as bh * T_own + tile: the order a kernel's blocks take them (longest-processing-time
    first, as the causal grids' ``tile_coordinates``), int32."""
    counts = np.diff(offsets.astype(np.int64), axis=1).ravel()
    return np.argsort(-counts, kind="stable").astype(np.int32)


@inlined_device_function
def listed_tile(tile_entries, index, block):
    """Entry ``index`` of a tile list: the listed tile's first row (or key), and whether it is partly masked."""
    entry = tile_entries[index]
    return (entry >> 1) * block, (entry & 1) != 0


def per_head_layout(block_mask, leading_shape, n_q, n_k):
    """The mask's layout broadcast to one (T_r, T_c) grid per batch*head: (BH, T_r, T_c) bool."""
    grid = block_mask.grid_for(n_q, n_k)
    heads = int(np.prod(leading_shape, dtype=np.int64))
    return np.ascontiguousarray(np.broadcast_to(block_mask.layout, tuple(leading_shape) + grid).reshape((heads,) + grid))


#: ``MaskArguments.partly`` (a kernel's PARTLY_MASKED): what a listed tile's entries are tested against where its
#: list entry's bit says it is only partly covered.  False: no listed tile is partly covered (the element test
#: compiles out); ``LAYOUT``: the block mask's uint8 layout (and the mask_mod, where there is one); ``MASK_MOD_ALONE``:
#: the mask_mod alone (no block mask cuts a listed tile), so the kernels read no layout (``reads_layout``).
LAYOUT, MASK_MOD_ALONE = True, "mask_mod alone"


def reads_layout(partly):
    """Whether a kernel whose PARTLY_MASKED is ``partly`` tests partly covered tiles' entries against the block
    layout (an index computed with two divisions and a byte read per entry: work a mask_mod alone does not need)."""
    return partly is LAYOUT


@dataclass(frozen=True)
class MaskArguments:
    """A block mask as a fast kernel's arguments (device arrays, flat)."""

    tile_offsets: object   # int32, (BH, own tiles + 1) flattened
    tile_entries: object   # int32
    tile_order: object     # int32, (BH * own tiles): ``longest_first``; the forward's role only (None otherwise)
    layout: object         # uint8 (BH, T_r, T_c) flattened
    mask_rows: int
    mask_cols: int
    mask_t_r: int
    mask_t_c: int
    partly: object         # False, LAYOUT or MASK_MOD_ALONE: what a partly masked listed tile tests (above)


ROLES = ("forward", "dq", "dkdv")


def mask_arguments(block_mask, leading_shape, n_q, n_k, tiles, causal_offset, role):
    """The device arrays of ``role``'s tile lists for tiles (own, streamed); built once per mask and shapes.

    forward and dq: key tiles per query tile (tiles = (query rows, keys));
    dkdv: query tiles per key tile (tiles = (keys, query rows)).
    """
    key = (role, tuple(leading_shape), n_q, n_k, tuple(tiles), causal_offset)
    forms = block_mask._device_forms
    if key not in forms:
        if len(forms) >= 16:
            forms.pop(next(iter(forms)))
        layout = per_head_layout(block_mask, leading_shape, n_q, n_k)
        own, streamed = tiles
        if role == "dkdv":
            visit, partly = tile_visits(layout, block_mask.block_size, (streamed, own), n_q, n_k, causal_offset)
            offsets, entries = tile_lists(visit.transpose(0, 2, 1), partly.transpose(0, 2, 1))
        else:
            offsets, entries = tile_lists(*tile_visits(layout, block_mask.block_size, (own, streamed), n_q, n_k,
                                                       causal_offset))
        forms[key] = MaskArguments(cuda.to_device(offsets.reshape(-1)),
                                   cuda.to_device(entries if entries.size else np.zeros(1, np.int32)),
                                   cuda.to_device(longest_first(offsets)) if role == "forward" else None,
                                   cuda.to_device(layout.view(np.uint8).reshape(-1)),  # flat on the host: Numba
                                   *block_mask.block_size, *layout.shape[1:],      # reshapes few device arrays
                                   partly=LAYOUT if (entries & 1).any() else False)
    return forms[key]


def device_layout(block_mask, leading_shape, n_q, n_k):
    """The per-head layout as a (BH, T_r, T_c) uint8 device array (the literal kernels read it too)."""
    key = ("layout", tuple(leading_shape), n_q, n_k)
    forms = block_mask._device_forms
    if key not in forms:
        forms[key] = cuda.to_device(per_head_layout(block_mask, leading_shape, n_q, n_k).view(np.uint8))
    return forms[key]
