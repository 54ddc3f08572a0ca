"""A mask_mod's tile visits, classified on the host: the equivalent of FlexAttention's ``create_block_mask``.

For each (batch * query head, query tile, key tile) of a kernel's tiles, the mask_mod is evaluated at every entry
inside the sequences (a Numba ``njit`` loop on the CPU, compiled once per mask_mod and array types) and the tile is

* **empty** (no entry allowed): never visited;
* **full** (every entry allowed): visited without the element test (the kernels skip the mask_mod there);
* **partial**: visited, the mask_mod tested per element.

The result is ``tile_lists``' (visit, partly) pair, so it feeds the block-mask machinery unchanged: combined with a
call's ``block_mask`` (AND of the visits, OR of the partial bits) and the causal rule's tile skipping, packed into
per-tile lists for each kernel role.  The cost is one mask_mod call per entry of the (B H, N_q, N_k) grid, on one
CPU core, when a plan is built; it is kept with the Mod (the mask_mod's arrays are read then: a Mod whose mask
arrays change in place must be rebuilt).  Not yet on the GPU (the issue asks for that).
"""
import dis

import numpy as np
from numba import cuda, njit

from ..mods import jitable
from .tile_lists import MaskArguments, longest_first, mask_arguments, tile_lists, tile_visits

_CLASSIFIERS = {}


def _classifier(mask_mod):
    """An njit function (batch, heads, n_q, n_k, block_m, block_n, *arrays) -> (allowed counts, entry counts), both
    (batch * heads, query tiles, key tiles) int64, for ``mask_mod``'s function."""
    fn = mask_mod.fn
    if fn in _CLASSIFIERS:
        return _CLASSIFIERS[fn]
    names = ", ".join(f"a{i}" for i in range(len(mask_mod.arrays)))
    tail = f", {names}" if names else ""
    source = f"""
def classify(batch, heads, n_q, n_k, block_m, block_n{tail}):
    q_tiles, k_tiles = (n_q + block_m - 1) // block_m, (n_k + block_n - 1) // block_n
    allowed = np.zeros((batch * heads, q_tiles, k_tiles), np.int64)
    entries = np.zeros((batch * heads, q_tiles, k_tiles), np.int64)
    for b in range(batch):
        for h in range(heads):
            for i in range(n_q):
                for j in range(n_k):
                    entries[b * heads + h, i // block_m, j // block_n] += 1
                    if mask(b, h, i, j{tail}):
                        allowed[b * heads + h, i // block_m, j // block_n] += 1
    return allowed, entries
"""
    namespace = {"np": np, "mask": jitable(fn)}
    exec(compile(source, "<numba_flash.sparsity.mod_tiles>", "exec"), namespace)
    _CLASSIFIERS[fn] = njit(namespace["classify"])
    return _CLASSIFIERS[fn]


def reads_batch_or_head(fn):
    """Whether a mask function reads its b or h parameter (a combinator: whether any of its parts does), from its
    bytecode; True when unsure.  A mask that reads neither is classified once and broadcast over (batch, heads)."""
    parts = getattr(fn, "__numba_flash_parts__", None)
    if parts is not None:
        return any(reads_batch_or_head(part) for part in parts)
    code = getattr(fn, "__code__", None)
    if code is None or code.co_argcount < 2:
        return True
    names = set(code.co_varnames[:2])
    if names & set(code.co_cellvars):   # captured by an inner function
        return True
    for instruction in dis.get_instructions(code):
        value = instruction.argval
        if instruction.opname.startswith(("LOAD_FAST", "STORE_FAST", "DELETE_FAST", "LOAD_DEREF")) and (
                value in names or (isinstance(value, tuple) and names & set(value))):
            return True
    return False


def classify_tiles(mask_mod, batch, heads, n_q, n_k, tile):
    """(visit, partly): boolean (batch * heads, query tiles, key tiles) for tiles ``tile`` = (query rows, keys).

    A mask_mod that reads neither b nor h (``reads_batch_or_head``) is evaluated for one (b, h) and broadcast: one
    (N_q, N_k) grid, about 0.1 s at N = 4096 and 0.5 s at 8192 on one core (sliding window, 2026-12-06)."""
    shared = not reads_batch_or_head(mask_mod.fn)
    classify = _classifier(mask_mod)
    allowed, entries = classify(1 if shared else batch, 1 if shared else heads, n_q, n_k, tile[0], tile[1],
                                *mask_mod.host_arrays())
    visit, partly = allowed > 0, (allowed > 0) & (allowed < entries)
    if shared:
        visit, partly = (np.broadcast_to(x, (batch * heads,) + x.shape[1:]).copy() for x in (visit, partly))
    return visit, partly


def mod_mask_arguments(mask_mod, block_mask, leading_shape, n_q, n_k, tiles, causal_offset, role):
    """``mask_arguments`` for a call with a mask_mod (and perhaps a block mask): the role's tile lists from the mask's
    classification, the block mask's layout for the element test (all ones, in one block per head, without one)."""
    key = (role, tuple(leading_shape), n_q, n_k, tuple(tiles), causal_offset, id(block_mask))
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
        from .tile_lists import per_head_layout
        layout = per_head_layout(block_mask, leading, n_q, n_k)
        block_visit, block_partly = tile_visits(layout, block_mask.block_size, tile, n_q, n_k, causal_offset)
        visit &= block_visit
        partly = visit & (partly | block_partly)
        element_layout, mask_rows, mask_cols = block.layout, block.mask_rows, block.mask_cols
        t_r, t_c = block.mask_t_r, block.mask_t_c
    else:
        if causal_offset is not None:   # tiles wholly above the diagonal are never visited
            q_last = np.minimum(np.arange(0, n_q, tile[0]) + tile[0], n_q) - 1
            visit &= np.arange(0, n_k, tile[1])[None, None, :] <= q_last[None, :, None] + causal_offset
            partly &= visit
        # The element test reads a layout too: all ones, one block per head, so that only the mask_mod decides.
        element_layout = cuda.to_device(np.ones(batch * heads, np.uint8))
        mask_rows, mask_cols, t_r, t_c = max(n_q, 1), max(n_k, 1), 1, 1
    if role == "dkdv":
        offsets, entries = tile_lists(visit.transpose(0, 2, 1), partly.transpose(0, 2, 1))
    else:
        offsets, entries = tile_lists(visit, partly)
    forms[key] = MaskArguments(cuda.to_device(offsets.reshape(-1)),
                               cuda.to_device(entries if entries.size else np.zeros(1, np.int32)),
                               cuda.to_device(longest_first(offsets)) if role == "forward" else None,
                               element_layout, mask_rows, mask_cols, t_r, t_c, partly=bool((entries & 1).any()))
    return forms[key]
