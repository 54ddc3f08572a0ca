"""A mask_mod's tiles classified on the GPU (numba_flash.tile_mask, sparsity/mod_tiles.py) against a dense NumPy
evaluation of the mask, and attention through a kept TileMask against the mask_mod passed directly.

The classification: random built-in masks and and/or compositions, per-head and per-batch masks (arrays indexed by
h and b) and broadcast ones (batch=None / heads=None, or a function that reads neither), ragged N_q != N_k, random
blocks and kernel tiles that are multiples of them (the coarsening kernel).  Every (b, h, tile) must be empty,
full or partial exactly as the dense mask says.  Attention: the same kernels read the same lists, so the outputs
are bitwise equal; a kept TileMask launches nothing more at its second call.  Bad arguments: a ValueError or
TypeError naming the argument before any launch.  Simulator budget: lengths up to 40, one kernel thread per tile.
"""
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import numba_flash
from numba_flash import mods
from numba_flash.sparsity import mod_tiles
from numba_flash.sparsity.mod_tiles import ALLOWED, MASKED, PARTIAL
from tolerances import assert_close_to_reference

MAX_N = 40 if numba_flash.in_simulator() else 300
EMPTY, FULL, PART = "empty", "full", "partial"


def dense_mask(mask_mod, batch, heads, n_q, n_k):
    """allowed[b, h, i, j]: the mask's own Python function at every entry, on the host copies of its arrays."""
    arrays = mask_mod.host_arrays()
    return np.array([[[[bool(mask_mod.fn(b, h, i, j, *arrays)) for j in range(n_k)] for i in range(n_q)]
                      for h in range(heads)] for b in range(batch)], dtype=bool).reshape(batch, heads, n_q, n_k)


def dense_classes(allowed, tile):
    """Each (b, h, tile)'s class from the dense mask: empty, full or partial (object array of names)."""
    rows, cols = tile
    n_q, n_k = allowed.shape[-2:]
    out = np.empty(allowed.shape[:2] + (-(-n_q // rows), -(-n_k // cols)), dtype=object)
    for i in range(out.shape[2]):
        for j in range(out.shape[3]):
            block = allowed[:, :, i * rows:(i + 1) * rows, j * cols:(j + 1) * cols]
            some, every = block.any(axis=(2, 3)), block.all(axis=(2, 3))
            out[:, :, i, j] = np.where(every, FULL, np.where(some, PART, EMPTY))
    return out


def names(classes):
    """The kernel's bits as names (and nothing else: a zero or unknown code fails the comparison)."""
    lookup = {MASKED: EMPTY, ALLOWED: FULL, PARTIAL: PART}
    return np.vectorize(lambda c: lookup.get(int(c), f"bad code {c}"), otypes=[object])(classes)


def _head_window(b, h, q_idx, kv_idx, windows):
    return q_idx - windows[h] < kv_idx and kv_idx <= q_idx


def _batch_documents(b, h, q_idx, kv_idx, ids):
    return ids[b, q_idx] == ids[b, kv_idx]


@st.composite
def masks(draw, batch, heads, n_q, n_k):
    """A built-in mask_mod, an and/or of two, or one that reads h (per-head windows) or b (per-batch documents)."""
    rng = np.random.default_rng(draw(st.integers(0, 2 ** 32 - 1)))
    n = max(n_q, n_k)
    choices = {
        "sliding_window": lambda: mods.sliding_window(draw(st.integers(1, 12))),
        "prefix_lm": lambda: mods.prefix_lm(draw(st.integers(0, 12))),
        "document": lambda: mods.document(np.sort(rng.integers(0, 4, n_q)).astype(np.int32),
                                          np.sort(rng.integers(0, 4, n_k)).astype(np.int32)),
        "causal": lambda: mods.causal_mask,
        "per_head": lambda: mods.Mod(_head_window, rng.integers(1, 12, heads).astype(np.int32)),
        "per_batch": lambda: mods.Mod(_batch_documents, np.sort(rng.integers(0, 3, (batch, n)), axis=1)
                                      .astype(np.int32)),
    }
    picked = draw(st.lists(st.sampled_from(sorted(choices)), min_size=1, max_size=2, unique=True))
    built = [choices[name]() for name in picked]
    if len(built) == 1:
        return built[0]
    return (mods.and_masks if draw(st.booleans()) else mods.or_masks)(*built)


@st.composite
def classifications(draw):
    batch, heads = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    n_q, n_k = draw(st.integers(1, MAX_N)), draw(st.integers(1, MAX_N))
    block = (draw(st.sampled_from([1, 4, 8, 16])), draw(st.sampled_from([1, 4, 8, 16])))
    multiple = (draw(st.integers(1, 3)), draw(st.integers(1, 3)))
    mask_mod = draw(masks(batch, heads, n_q, n_k))
    say_batch, say_heads = draw(st.booleans()), draw(st.booleans())
    return batch, heads, n_q, n_k, block, multiple, mask_mod, say_batch, say_heads


@given(classifications())
def test_the_gpu_classification_matches_the_dense_mask(case):
    batch, heads, n_q, n_k, block, multiple, mask_mod, say_batch, say_heads = case
    reads_b, reads_h = mod_tiles.batch_and_head_reads(mask_mod.fn)
    # batch=None / heads=None promise a mask that does not depend on them: only for masks that keep it.
    given_batch = batch if say_batch or reads_b else None
    given_heads = heads if say_heads or reads_h else None
    tiles = numba_flash.tile_mask(mask_mod, given_batch, given_heads, n_q, n_k, block=block)
    assert tiles.classified == (batch if reads_b else 1, heads if reads_h else 1)
    allowed = dense_mask(mask_mod, batch, heads, n_q, n_k)
    for tile in (block, (block[0] * multiple[0], block[1] * multiple[1])):
        got = tiles.tile_classes(tile)
        want = dense_classes(allowed, tile)
        np.testing.assert_array_equal(names(np.broadcast_to(got, want.shape)), want, err_msg=f"tile {tile}")
        # The lists' view (classify_tiles): visited = not empty, partly masked = partial.
        visit, partly = mod_tiles.classify_tiles(tiles, batch, heads, n_q, n_k, tile)
        want = want.reshape(visit.shape)
        assert np.array_equal(visit, want != EMPTY) and np.array_equal(partly, want == PART)


def test_masks_are_classified_once_for_what_they_do_not_read():
    from numba_flash.sparsity.mod_tiles import batch_and_head_reads

    assert numba_flash.tile_mask(mods.sliding_window(4) & mods.prefix_lm(2), 4, 8, 32, 32).classified == (1, 1)
    per_head = mods.Mod(_head_window, np.arange(1, 5, dtype=np.int32))
    per_batch = mods.Mod(_batch_documents, np.zeros((3, 32), np.int32))
    assert batch_and_head_reads(per_head.fn) == (False, True) and batch_and_head_reads(per_batch.fn) == (True, False)
    assert numba_flash.tile_mask(per_head, 3, 4, 32, 32).classified == (1, 4)
    assert numba_flash.tile_mask(per_batch, 3, 4, 32, 32).classified == (3, 1)
    assert numba_flash.tile_mask(per_head & per_batch, 3, 4, 32, 32).classified == (3, 4)
    assert numba_flash.tile_mask(per_head & per_batch, None, 4, 32, 32).classified == (1, 4)   # the caller's B=None
    assert batch_and_head_reads(lambda b, h, q_idx, kv_idx: kv_idx <= q_idx + h * b) == (True, True)


def problem(batch=2, heads=2, n_q=23, n_k=19, d=8, seed=0):
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal((batch, heads, n, d)).astype(np.float32) for n in (n_q, n_k, n_k))


@pytest.mark.parametrize("given_batch, given_heads, backward", [(2, 2, True), (None, None, False)])
def test_attention_through_a_tile_mask_equals_the_mask_mod_passed_directly(given_batch, given_heads, backward,
                                                                           monkeypatch):
    q, k, v = problem()
    docs = np.repeat(np.arange(3), 8).astype(np.int32)
    mask_mod = (mods.document(docs[:23], docs[:19]) & mods.sliding_window(9)) | mods.prefix_lm(3)
    tiles = numba_flash.tile_mask(mask_mod, given_batch, given_heads, 23, 19)
    direct, direct_lse = numba_flash.attention(q, k, v, causal=True, mask_mod=mask_mod, return_lse=True)
    do = np.random.default_rng(1).standard_normal(q.shape).astype(np.float32)
    if backward:
        want = numba_flash.attention_backward(q, k, v, direct, direct_lse, do, causal=True, mask_mod=mask_mod)
    # Calls with the TileMask (a training loop's steps) classify nothing: at most a coarsening to a new kernel tile
    # (on a GPU, whose tiles are larger than the blocks), once.
    launched, launch = [], mod_tiles._launch
    monkeypatch.setattr(mod_tiles, "_launch", lambda kernel, *args: launched.append(kernel) or launch(kernel, *args))
    for _ in range(2):
        kept, kept_lse = numba_flash.attention(q, k, v, causal=True, mask_mod=tiles, return_lse=True)
        assert np.array_equal(kept, direct) and np.array_equal(kept_lse, direct_lse)
        assert set(launched) <= {mod_tiles.coarsen} and len(launched) <= 1
    if backward:
        got = numba_flash.attention_backward(q, k, v, kept, kept_lse, do, causal=True, mask_mod=tiles)
        assert all(np.array_equal(g, w) for g, w in zip(got, want)) and set(launched) <= {mod_tiles.coarsen}


def test_torch_attention_takes_a_tile_mask():
    torch = pytest.importorskip("torch")
    import numba_flash.torch as nft

    q, k, v = (torch.from_numpy(x) for x in problem(batch=1, n_q=20, n_k=20))
    tiles = numba_flash.tile_mask(mods.sliding_window(5), None, None, 20, 20)
    assert torch.equal(nft.attention(q, k, v, mask_mod=tiles), nft.attention(q, k, v, mask_mod=mods.sliding_window(5)))


def test_a_plain_mask_mod_is_classified_anew_when_its_tensor_changes_in_place():
    """A training loop that rewrites its document ids in place between steps: the kept classification must follow,
    or tiles of the new documents would be skipped silently."""
    torch = pytest.importorskip("torch")
    from reference import mods as reference_mods

    q, k, v = problem(batch=1, heads=1, n_q=40, n_k=40)
    ids = torch.zeros(40, dtype=torch.int32)          # one document: every tile visited
    mask_mod = mods.document(ids)
    numba_flash.attention(q, k, v, mask_mod=mask_mod)
    ids[20:] = 1                                       # two documents: the off-diagonal tiles now empty
    got, lse = numba_flash.attention(q, k, v, mask_mod=mask_mod, return_lse=True)
    want, want_lse = reference_mods.attention(*(x.astype(np.float64) for x in (q, k, v)),
                                              mask_mod=mods.document(ids.numpy()))
    assert_close_to_reference(got, lse, want, want_lse, q, k, v, q.shape[-1] ** -0.5)


@pytest.mark.parametrize("args, error, words", [
    ((mods.softcap(2.0), 1, 1, 8, 8), TypeError, "mask_mod"),
    ((mods.causal_mask, 0, 1, 8, 8), ValueError, "batch"),
    ((mods.causal_mask, 1, 2.0, 8, 8), TypeError, "heads"),
    ((mods.causal_mask, 1, 1, 0, 8), ValueError, "n_q"),
    ((mods.causal_mask, 1, 1, 8, True), TypeError, "n_k"),
    ((mods.document(np.zeros(4, np.int32)), 1, 1, 8, 8), ValueError, "mask_mod document"),   # ids too short
])
def test_bad_tile_mask_arguments_raise_before_classifying(args, error, words, monkeypatch):
    monkeypatch.setattr(mod_tiles, "_launch", lambda *a: pytest.fail("classified bad arguments"))
    with pytest.raises(error, match=words):
        numba_flash.tile_mask(*args)
    with pytest.raises(ValueError, match="block"):
        numba_flash.tile_mask(mods.causal_mask, 1, 1, 8, 8, block=(0, 16))


@pytest.mark.parametrize("call, words", [
    (dict(n_q=21), "classified for N_q = 20, N_k = 20"),
    (dict(heads=3), "classified for 2 query heads"),
    (dict(batch=3), "classified for a batch of 2"),
    (dict(block_sizes=(16, 8)), r"its tiles were classified in blocks of \(16, 16\), which do not divide the kernel's tiles \(16, 8\).*"
                                r"block=\(16, 8\)"),
])
def test_a_tile_mask_refuses_calls_of_another_shape(call, words, no_launch):
    tiles = numba_flash.tile_mask(mods.Mod(_head_window, np.array([2, 5], np.int32)), 2, 2, 20, 20)
    shape = dict(batch=2, heads=2, n_q=20, n_k=20)
    shape.update({key: value for key, value in call.items() if key in shape})
    q, k, v = problem(shape["batch"], shape["heads"], shape["n_q"], 20)
    with pytest.raises(ValueError, match=f"mask_mod _head_window: {words}"):
        numba_flash.attention(q, k, v, mask_mod=tiles, block_sizes=call.get("block_sizes"))


def test_the_gallery_draws_every_picture(tmp_path):
    # experiments/paper/mods_gallery.py (docs/mods.md's pictures), small: every file written and a PNG.
    pytest.importorskip("matplotlib")
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parent.parent / "experiments" / "paper" / "mods_gallery.py"
    spec = importlib.util.spec_from_file_location("mods_gallery", path)
    gallery = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gallery)
    written = gallery.main(["--quick", "--out", str(tmp_path)])
    assert len(written) == 9 and all((tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for name in written)
