"""A mask_mod's tiles classified on the GPU: FlexAttention's ``create_block_mask`` for numba-flash's kernels.

``tile_mask(mask_mod, batch, heads, n_q, n_k, block=(16, 16))`` launches one kernel, ``classify_tiles_<name>``
(one thread per tile), that evaluates the mask_mod -- the user's function compiled for the GPU as the attention
kernels inline it (``register_jitable``), reading its arrays on the device -- at every entry of each (b, h, query
block, key block) inside the sequences, and records two bits per block:

    ALLOWED (1): some entry is allowed            MASKED (2): some entry is masked

A block is **empty** (MASKED alone: never visited), **full** (ALLOWED alone: visited without the element test)
or **partial** (both: the mask_mod tested per element); a thread stops after the first row that has shown it
both.  The classes stay on the GPU in the returned ``TileMask``, (B', H', T_q, T_k) uint8, with B' = 1 where the
mask is broadcast over the batch and H' = 1 over the heads: ``batch=None`` / ``heads=None`` say so
(FlexAttention's B=None, H=None), and a mask_mod whose function does not read b (or h; its bytecode,
``batch_and_head_reads``) is classified once for every batch entry (or head) whatever they are.

Kernel tiles.  A kernel's tile whose sizes are multiples of the block's is a union of whole blocks, so its class is
the OR of theirs, exactly (the bits say "some entry is ..."): ``coarsen``, a second kernel, one thread per
kernel tile.  The default block, 16 x 16, divides every tile the library picks (flash2's rows come in warps of
16 and its keys in multiples of 16; wgmma's tiles are 64 x 64); a tile it does not divide (float32's forward
allows B_c = 8 k) is a ValueError naming mask_mod and the block that would.  Only the kernel tile's classes
(B' H' T_q T_k bytes) come to the host, where ``mod_mask_arguments`` turns them into the kernels' per-tile lists
(``tile_lists.py``: AND with a block mask, the causal rule's tile skipping, each role's format) and keeps them
on the TileMask per call shape.

Costs.  Classifying: one mask_mod call per entry of the (B' H', N_q, N_k) grid, on the GPU, once per TileMask (in
the simulator every entry is a Python call: keep shapes small there).  A call with a TileMask it has seen at
that shape: no host work, no launch.  The first call at a new shape or tile: one coarsening launch, a copy of
B' H' T_q T_k bytes and O(B H T_q T_k) host work for the lists.  A plain mask_mod passed to ``attention`` takes
the same path: a TileMask for the call's shape is built at its first call and kept on the Mod, classified anew
when one of its torch tensors has changed in place since (``array_versions``).  The mask_mod's
arrays are read when classifying: a TileMask over arrays that change in place must be built anew.
"""
import dis
import linecache
import math
import numbers
import warnings

import numpy as np
from numba import cuda
from numba.core.errors import NumbaPerformanceWarning

from .._checks import positive_int_pair
from ..mods import MASK, Mod, as_mod, jitable
from ..runtime.arrays import kernel_array, placeholder
from ..runtime.launch import cuda_kernel, launch
from ..tiling import cdiv
from .tile_lists import (LAYOUT, MASK_MOD_ALONE, MaskArguments, longest_first, mask_arguments, per_head_layout,
                         tile_lists, tile_visits)

#: A block's bits: some entry allowed, some entry masked; both: partial.
ALLOWED, MASKED = 1, 2
PARTIAL = ALLOWED | MASKED
#: The classification block (query rows, keys) that ``tile_mask`` takes by default: it divides every kernel tile the
#: library picks.
DEFAULT_BLOCK = (16, 16)
#: Threads per block of the classification and coarsening kernels (one thread per block or tile of the mask).
THREADS = 128

_CLASSIFIERS = {}


def _classifier(mask_mod):
    """The classification kernel of ``mask_mod``'s function (one per function and number of arrays).

    classes: flat uint8 (B' H', q_blocks, k_blocks); heads: H' (b = bh // H', h = bh % H'); then the mask's arrays.
    """
    key = (mask_mod.fn, len(mask_mod.arrays))
    if key not in _CLASSIFIERS:
        tail = "".join(f", a{i}" for i in range(len(mask_mod.arrays)))
        source = f"""
def classify(classes, heads, q_blocks, k_blocks, n_q, n_k, block_m, block_n{tail}):
    tile = cuda.grid(1)
    if tile < classes.size:
        bh, rest = tile // (q_blocks * k_blocks), tile % (q_blocks * k_blocks)
        q0, k0 = rest // k_blocks * block_m, rest % k_blocks * block_n
        seen = 0
        for q_idx in range(q0, min(q0 + block_m, n_q)):      # entries inside the sequences only: the mask's
            for kv_idx in range(k0, min(k0 + block_n, n_k)):  # array reads stay in bounds, as in the kernels
                seen |= ALLOWED if mask(bh // heads, bh % heads, q_idx, kv_idx{tail}) else MASKED
            if seen == PARTIAL:   # neither empty nor full: the other rows cannot change that
                break
        classes[tile] = seen
"""
        namespace = {"cuda": cuda, "mask": jitable(mask_mod.fn), "ALLOWED": ALLOWED, "MASKED": MASKED,
                     "PARTIAL": PARTIAL}
        file_name = f"<numba_flash.sparsity.mod_tiles classify_tiles_{mask_mod.name}>"
        # The source where line info (profilers, Numba's debug info) looks for it: without, a warning per compile.
        linecache.cache[file_name] = (len(source), None, source.splitlines(True), file_name)
        exec(compile(source, file_name, "exec"), namespace)
        _CLASSIFIERS[key] = cuda_kernel(namespace["classify"], f"classify_tiles_{mask_mod.name}")
    return _CLASSIFIERS[key]


def _coarsen(fine, q_blocks, k_blocks, coarse, q_tiles, k_tiles, blocks_per_row, blocks_per_col):
    """coarse[bh, i, j] = OR of the blocks fine[bh, ...] that kernel tile (i, j) covers (flat arrays); a tile is
    ``blocks_per_row`` x ``blocks_per_col`` blocks, fewer at the ragged edges."""
    tile = cuda.grid(1)
    if tile < coarse.size:
        bh, rest = tile // (q_tiles * k_tiles), tile % (q_tiles * k_tiles)
        i, j = rest // k_tiles, rest % k_tiles
        seen = 0
        for block_i in range(i * blocks_per_row, min((i + 1) * blocks_per_row, q_blocks)):
            row = (bh * q_blocks + block_i) * k_blocks
            for block_j in range(j * blocks_per_col, min((j + 1) * blocks_per_col, k_blocks)):
                seen |= fine[row + block_j]
        coarse[tile] = seen


coarsen = cuda_kernel(_coarsen, "coarsen_tile_classes")


def batch_and_head_reads(fn):
    """(reads b, reads h): whether a mask function reads its b and its h parameter (a combinator: whether any of its
    parts does), from its bytecode; True when unsure.  A mask is classified once for every batch entry it does not
    read, and once for every head."""
    parts = getattr(fn, "__numba_flash_parts__", None)
    if parts is not None:
        reads = [batch_and_head_reads(part) for part in parts]
        return any(b for b, _ in reads), any(h for _, h in reads)
    code = getattr(fn, "__code__", None)
    if code is None or code.co_argcount < 2:
        return True, True
    instructions = list(dis.get_instructions(code))

    def reads(name):
        if name in code.co_cellvars:   # captured by an inner function
            return True
        return any(instruction.opname.startswith(("LOAD_FAST", "STORE_FAST", "DELETE_FAST", "LOAD_DEREF"))
                   and (instruction.argval == name or (isinstance(instruction.argval, tuple)
                                                       and name in instruction.argval))
                   for instruction in instructions)

    return reads(code.co_varnames[0]), reads(code.co_varnames[1])


def _launch(kernel, count, *args):
    """``kernel`` on ``count`` threads (none for 0).  A small mask's grid is small: Numba's warning about
    under-used multiprocessors says nothing useful here."""
    if count:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", NumbaPerformanceWarning)
            launch(kernel, cdiv(count, THREADS), THREADS, args)


class TileMask(Mod):
    """A mask_mod with its tiles classified on the GPU (``tile_mask`` builds it): pass it as ``mask_mod=`` to
    ``attention``, ``attention_backward`` or ``numba_flash.torch.attention`` for calls of its shape, which then
    skip the classification.  It is the mask_mod itself too (same function, arrays and compiled kernels).

    Attributes: ``mask_mod`` (the Mod classified), ``batch``, ``heads`` (None: broadcast), ``n_q``, ``n_k``,
    ``block`` (query rows, keys), ``classified`` ((B', H'): the (batch, heads) actually classified, 1 where
    broadcast), ``classes`` (device uint8, flat (B', H', T_q, T_k): ALLOWED | MASKED bits per block).
    """

    def __init__(self, mask_mod, batch, heads, n_q, n_k, block, classified, classes):
        super().__init__(mask_mod.fn, *mask_mod.arrays, name=mask_mod.name, fits=self._fits)
        self.mask_mod, self.batch, self.heads, self.n_q, self.n_k = mask_mod, batch, heads, n_q, n_k
        self.block, self.classified, self.classes = block, classified, classes
        self._tile_classes = {}

    def __repr__(self):
        return (f"TileMask({self.name}, batch {self.batch}, heads {self.heads}, N_q {self.n_q}, N_k {self.n_k}, "
                f"blocks of {self.block}, classified {self.classified})")

    def _fits(self, heads, n_q, n_k):
        """What is wrong with a call of H_q ``heads`` and these lengths for this mask, or None (``Mod.fits``)."""
        if (n_q, n_k) != (self.n_q, self.n_k):
            return (f"classified for N_q = {self.n_q}, N_k = {self.n_k} (numba_flash.tile_mask), the call has "
                    f"N_q = {n_q}, N_k = {n_k}")
        if self.heads is not None and heads != self.heads:
            return f"classified for {self.heads} query heads (numba_flash.tile_mask), the call has {heads}"
        return self.mask_mod.fits(heads, n_q, n_k) if self.mask_mod.fits else None

    def tile_classes(self, tile):
        """The classes at a kernel's ``tile`` (query rows, keys): host uint8 (B', H', query tiles, key tiles),
        coarsened on the GPU (``coarsen``) and kept; ValueError naming mask_mod if ``block`` does not divide it."""
        tile = tuple(tile)
        if tile not in self._tile_classes:
            (rows, cols), (block_m, block_n) = tile, self.block
            if rows % block_m or cols % block_n:
                raise ValueError(f"mask_mod {self.name}: its tiles were classified in blocks of {self.block}, which "
                                 f"do not divide the kernel's tiles {tile}; build it with numba_flash.tile_mask(..., "
                                 f"block=({math.gcd(rows, block_m)}, {math.gcd(cols, block_n)}))")
            slabs = self.classified[0] * self.classified[1]   # (b, h) pairs classified
            q_blocks, k_blocks = cdiv(self.n_q, block_m), cdiv(self.n_k, block_n)
            q_tiles, k_tiles = cdiv(self.n_q, rows), cdiv(self.n_k, cols)
            classes = self.classes
            if tile != self.block:
                classes = cuda.device_array(slabs * q_tiles * k_tiles, np.uint8)
                _launch(coarsen, classes.size, self.classes, q_blocks, k_blocks, classes, q_tiles, k_tiles,
                        rows // block_m, cols // block_n)
            self._tile_classes[tile] = classes.copy_to_host().reshape(self.classified + (q_tiles, k_tiles))
        return self._tile_classes[tile]


def _size(name, value, none=False):
    if value is None and none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int{' or None' if none else ''}, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be positive, got {value}")
    return int(value)


def tile_mask(mask_mod, batch, heads, n_q, n_k, *, block=DEFAULT_BLOCK):
    """``mask_mod``'s tiles classified on the GPU once, for calls of this shape to reuse (FlexAttention's
    ``create_block_mask``; ``docs/mods.md``).

    Parameters
    ----------
    mask_mod : function or numba_flash.mods.Mod
        ``mask_mod(b, h, q_idx, kv_idx, *arrays) -> bool``.
    batch, heads : int or None
        The calls' batch size (the product of q's leading dims before the heads) and query heads; None: the mask
        does not depend on b (or h) and is classified once for all of them.  A mask_mod whose function reads
        neither b nor h is classified once anyway.
    n_q, n_k : int
        The calls' query and key lengths.
    block : (int, int)
        (query rows, keys) per classified block.  A kernel's tiles must be multiples of it (each tile's class is
        the OR of its blocks' classes); the default (16, 16) divides every tile the library picks.

    Returns
    -------
    TileMask
        A mask_mod to pass as ``mask_mod=``; a call of another shape is a ValueError naming mask_mod.
    """
    mask_mod = as_mod(mask_mod, MASK)
    mask_mod = mask_mod.mask_mod if isinstance(mask_mod, TileMask) else mask_mod
    batch, heads = _size("batch", batch, none=True), _size("heads", heads, none=True)
    n_q, n_k = _size("n_q", n_q), _size("n_k", n_k)
    block = positive_int_pair("block", block)
    problem = mask_mod.fits(heads or 1, n_q, n_k) if mask_mod.fits else None
    if problem:   # the classifier reads the mask's arrays unchecked, as the kernels do
        raise ValueError(f"mask_mod {mask_mod.name}: {problem}")
    reads_b, reads_h = batch_and_head_reads(mask_mod.fn)
    classified = (batch if reads_b and batch is not None else 1, heads if reads_h and heads is not None else 1)
    q_blocks, k_blocks = cdiv(n_q, block[0]), cdiv(n_k, block[1])
    classes = cuda.device_array(classified[0] * classified[1] * q_blocks * k_blocks, np.uint8)
    _launch(_classifier(mask_mod), classes.size, classes, classified[1], q_blocks, k_blocks, n_q, n_k, *block,
            *(kernel_array(a) for a in mask_mod.arrays))
    return TileMask(mask_mod, batch, heads, n_q, n_k, block, classified, classes)


def classify_tiles(mask_mod, batch, heads, n_q, n_k, tile):
    """(visit, partly): boolean (batch * heads, query tiles, key tiles) at a kernel's ``tile`` (query rows, keys).

    From ``mask_mod`` itself when it is a ``TileMask`` (ValueError naming mask_mod when it was built for another
    batch), else from a TileMask built for this shape at its first call and kept on the Mod."""
    if isinstance(mask_mod, TileMask):
        tiles = mask_mod
        if tiles.batch is not None and tiles.batch != batch:
            raise ValueError(f"mask_mod {tiles.name}: classified for a batch of {tiles.batch} "
                             f"(numba_flash.tile_mask), the call has {batch}")
    else:
        tiles = _kept_tile_mask(mask_mod, batch, heads, n_q, n_k, tile)
    classes = tiles.tile_classes(tile)
    classes = np.broadcast_to(classes, (batch, heads) + classes.shape[2:]).reshape((batch * heads,) + classes.shape[2:])
    return (classes & ALLOWED) != 0, classes == PARTIAL


def array_versions(mod):
    """What says whether a plain Mod's arrays changed since its tiles were classified: torch tensors' in-place
    version counters (``_version``: a training loop that rewrites its document ids in place gets its mask classified
    anew, not the old lists silently).  NumPy arrays are copied to the GPU once per plan, Numba device arrays have no
    counter: both are read as they were at the first call (``docs/mods.md``)."""
    return tuple(getattr(a, "_version", None) for a in mod.arrays)


def _kept_tile_mask(mask_mod, batch, heads, n_q, n_k, tile):
    """A plain Mod's TileMask for a call's shape: in the default blocks when they divide ``tile`` (then every role's
    tiles share it), else in ``tile``'s; kept on the Mod (the four latest shapes)."""
    block = DEFAULT_BLOCK if tile[0] % DEFAULT_BLOCK[0] == 0 and tile[1] % DEFAULT_BLOCK[1] == 0 else tuple(tile)
    key = (batch, heads, n_q, n_k, block, array_versions(mask_mod))
    kept = mask_mod.__dict__.setdefault("_tile_masks", {})
    if key not in kept:
        if len(kept) >= 4:
            kept.pop(next(iter(kept)))
        kept[key] = tile_mask(mask_mod, batch, heads, n_q, n_k, block=block)
    return kept[key]


def mod_mask_arguments(mask_mod, block_mask, leading_shape, n_q, n_k, tiles, causal_offset, role):
    """``mask_arguments`` for a call with a mask_mod (and perhaps a block mask): the role's tile lists from the mask's
    classification, the block mask's layout for the element test (all ones, in one block per head, without one)."""
    key = (role, tuple(leading_shape), n_q, n_k, tuple(tiles), causal_offset, id(block_mask),
           None if isinstance(mask_mod, TileMask) else array_versions(mask_mod))
    forms = mask_mod.__dict__.setdefault("_device_forms", {})
    if key in forms:
        return forms[key]
    if len(forms) >= 16:
        forms.pop(next(iter(forms)))
    leading = tuple(leading_shape)
    heads = leading[-1] if leading else 1
    batch = int(np.prod(leading[:-1], dtype=np.int64))
    own, streamed = tiles
    tile = (streamed, own) if role == "dkdv" else (own, streamed)
    visit, partly = classify_tiles(mask_mod, batch, heads, n_q, n_k, tile)
    if block_mask is not None:
        block = mask_arguments(block_mask, leading, n_q, n_k, tiles, causal_offset, role)
        layout = per_head_layout(block_mask, leading, n_q, n_k)
        block_visit, block_partly = tile_visits(layout, block_mask.block_size, tile, n_q, n_k, causal_offset)
        visit &= block_visit
        layout_cut = bool((visit & block_partly).any())   # some listed tile needs the layout's test
        partly = visit & (partly | block_partly)
        element_layout, mask_rows, mask_cols = block.layout, block.mask_rows, block.mask_cols
        t_r, t_c = block.mask_t_r, block.mask_t_c
    else:
        if causal_offset is not None:   # tiles wholly above the diagonal are never visited
            q_last = np.minimum(np.arange(0, n_q, tile[0]) + tile[0], n_q) - 1
            visit &= np.arange(0, n_k, tile[1])[None, None, :] <= q_last[None, :, None] + causal_offset
            partly &= visit
        layout_cut = False   # (the kernels read no layout: ``tile_lists.reads_layout``)
        element_layout, mask_rows, mask_cols, t_r, t_c = placeholder(np.uint8), 1, 1, 1, 1
    if role == "dkdv":
        offsets, entries = tile_lists(visit.transpose(0, 2, 1), partly.transpose(0, 2, 1))
    else:
        offsets, entries = tile_lists(visit, partly)
    forms[key] = MaskArguments(cuda.to_device(offsets.reshape(-1)),
                               cuda.to_device(entries if entries.size else np.zeros(1, np.int32)),
                               cuda.to_device(longest_first(offsets)) if role == "forward" else None,
                               element_layout, mask_rows, mask_cols, t_r, t_c,
                               partly=LAYOUT if layout_cut else MASK_MOD_ALONE if (entries & 1).any() else False)
    return forms[key]
