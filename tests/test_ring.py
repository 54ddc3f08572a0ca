"""numba_flash.ring: ring attention over torch.distributed against one call on the whole sequence.

Two processes run ``ring_attention`` on their shards: in the simulator on
the CPU with gloo (float32), on a machine with two or more GPUs with NCCL
(float32, float16, bfloat16); with one GPU those tests are skipped.  The
processes start once per session (``ring_run``), run every case and the
scaling experiment's --quick mode, and hand back their shards of O and of
the gradients; the test process rejoins them and compares them with
``numba_flash.torch.attention`` on the whole sequence.  The rest (the plan
of which queries see which keys, the merge, the layout, bad input) needs no
second process.
"""
import csv
import datetime
import os
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
import torch
import torch.distributed as dist
import torch.multiprocessing
from filelock import FileLock

import numba_flash
import numba_flash.torch as nft
import reference
from numba_flash.ring import LAYOUTS, _visible_part, merge_by_lse, ring_positions, ring_shard, ring_unshard
from simulator_cpus import pin_to_one_cpu, xdist_worker
from strategies import BFLOAT16
from test_experiments_quick import load_script
from tolerances import FLOAT64_AGREEMENT, backward_tolerance, forward_tolerance, ring_tolerances

WORLD = 2
if numba_flash.in_simulator():
    BACKEND, DEVICE, DTYPES = "gloo", "cpu", ("float32",)
elif torch.cuda.device_count() >= WORLD:
    BACKEND, DEVICE, DTYPES = "nccl", "cuda", ("float32", "float16", "bfloat16")
else:
    BACKEND, DEVICE, DTYPES = None, "cuda", ("float32",)
NUMPY_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": BFLOAT16}


@dataclass(frozen=True)
class Case:
    name: str
    heads: int
    kv_heads: int
    length: int       # the whole sequence (times LENGTH_FACTOR): zigzag chunks of length / (2 * WORLD) positions
    causal: bool
    layout: str


CASES = [Case("dense, zigzag", 2, 2, 24, False, "zigzag"),
         Case("dense, contiguous", 2, 2, 24, False, "contiguous"),
         Case("causal, zigzag", 2, 2, 40, True, "zigzag"),
         Case("causal, contiguous", 2, 2, 24, True, "contiguous"),
         Case("causal, zigzag, grouped heads", 2, 1, 24, True, "zigzag")]
#: (batch, head dim, length factor): tiny in the simulator, where every CUDA thread is a Python thread.
BATCH, HEAD_DIM, LENGTH_FACTOR = (1, 8, 1) if numba_flash.in_simulator() else (2, 64, 25)
JOBS = {f"{case.name}, {dtype}": (case, dtype) for case in CASES for dtype in DTYPES}


def full_inputs(case, dtype):
    """q, k, v and dO of the whole sequence (CPU tensors), standard normal rounded to ``dtype``."""
    generator = torch.Generator().manual_seed(sum(map(ord, case.name)))
    n = case.length * LENGTH_FACTOR
    query_shape, key_shape = (BATCH, case.heads, n, HEAD_DIM), (BATCH, case.kv_heads, n, HEAD_DIM)
    return [torch.randn(shape, generator=generator).to(getattr(torch, dtype))
            for shape in (query_shape, key_shape, key_shape, query_shape)]


# ---------------------------------------------------------------- the two processes

def _bad_calls_raise(q, k, v):
    """Bad arguments with the group up: each raises on every rank, and nothing is sent (the cases after
    them still pair their messages)."""
    raised = []
    for call in (lambda: nft.ring_attention(q, k, v, layout="stripes"),
                 lambda: nft.ring_attention(q, k, v[..., :-2, :]),
                 lambda: nft.ring_attention(q, k, v, group="world")):
        try:
            call()
        except (ValueError, TypeError) as error:
            raised.append(f"{type(error).__name__}: {error}")
    return raised


def _ring_worker(rank, store, out_dir):
    """One rank: every job's shards through ring_attention and back, then the experiment's --quick mode."""
    if numba_flash.in_simulator():
        # Under pytest-xdist the ranks share the CPU of the worker that waits for them (the other workers keep
        # theirs busy); a test process of its own gives them one CPU each (they inherit its one).
        worker = xdist_worker()
        pin_to_one_cpu(rank if worker is None else worker)
    device = torch.device(DEVICE, rank) if BACKEND == "nccl" else None
    if device is not None:
        torch.cuda.set_device(device)   # before numba-flash's first launch: Numba uses the current device
    dist.init_process_group(BACKEND, init_method=f"file://{store}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(minutes=5), device_id=device)
    results = {}
    for key, (case, dtype) in JOBS.items():
        q, k, v, grad_out = (ring_shard(x, rank, WORLD, case.layout).to(DEVICE) for x in full_inputs(case, dtype))
        if not results:
            results["bad calls"] = _bad_calls_raise(q, k, v)
        q, k, v = (x.requires_grad_() for x in (q, k, v))
        out = nft.ring_attention(q, k, v, causal=case.causal, layout=case.layout)
        out.backward(grad_out)
        results[key] = [x.detach().cpu() for x in (out, q.grad, k.grad, v.grad)]
    load_script("ring_scaling").main(["--quick", "--out", out_dir])
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ring_run(tmp_path_factory):
    """Every rank's results, after one run of ``WORLD`` processes (spawned: fresh interpreters).

    Once per session even with pytest-xdist: the first worker to get here
    runs them, in the folder of this session that every worker shares, and
    the others wait for its lock and read what it left (xdist's recipe for
    session fixtures).
    """
    if BACKEND is None:
        pytest.skip(f"ring attention on GPUs needs {WORLD} of them; this machine has {torch.cuda.device_count()}")
    if "PYTEST_XDIST_WORKER" in os.environ:
        out_dir = tmp_path_factory.getbasetemp().parent / "ring"
    else:   # one process: its own folder (the parent of its base is shared by every session)
        out_dir = tmp_path_factory.mktemp("ring")
    with FileLock(f"{out_dir}.lock"):
        if not all((out_dir / f"rank{rank}.pt").exists() for rank in range(WORLD)):
            out_dir.mkdir(exist_ok=True)
            if BACKEND == "nccl":
                # NVLink multicast stays off on the shared machines; the processes inherit this.
                os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
                os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
            torch.multiprocessing.start_processes(_ring_worker, args=(str(out_dir / "store"), str(out_dir)),
                                                  nprocs=WORLD, start_method="spawn")
    return [torch.load(out_dir / f"rank{rank}.pt") for rank in range(WORLD)], out_dir


# ---------------------------------------------------------------- against one call on the whole sequence

def bounds(q, k, v, grad_out, out, causal, dtype):
    """Bounds on |ring - one call| for O, dq, dk and dv (``tolerances.ring_tolerances``)."""
    heads = q.shape[-3]
    scale = 1 / np.sqrt(q.shape[-1])
    k_per_head, v_per_head = (reference.repeat_kv(x, heads) for x in (k, v))
    tol_o, tol_lse = forward_tolerance(q, k_per_head, v_per_head, scale, dtype)
    weights = reference.softmax(reference.masked_scores(q, k, scale=scale, causal=causal))
    gradients = backward_tolerance(q, k_per_head, v_per_head, out, grad_out, scale, weights, dtype=dtype,
                                   group=heads // k.shape[-3])
    return ring_tolerances(tol_o, tol_lse, gradients, float(np.abs(v).max()), dtype, WORLD)


def as_float64(x):
    return x.detach().float().cpu().numpy().astype(np.float64)


@pytest.mark.parametrize("key", JOBS)
def test_ring_matches_one_call_on_the_whole_sequence(ring_run, key):
    ranks, _ = ring_run
    case, dtype = JOBS[key]
    ring = [ring_unshard([results[key][i] for results in ranks], case.layout) for i in range(4)]
    q, k, v, grad_out = (x.to(DEVICE) for x in full_inputs(case, dtype))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out = nft.attention(q, k, v, causal=case.causal)
    out.backward(grad_out)
    one_call = [out, q.grad, k.grad, v.grad]
    tolerances = bounds(*(as_float64(x) for x in (q, k, v, grad_out, out)), case.causal, NUMPY_DTYPES[dtype])
    for name, got, want, tol in zip(("O", "dq", "dk", "dv"), ring, one_call, tolerances):
        assert got.shape == want.shape and got.dtype == want.dtype, name
        err = float(np.abs(as_float64(got) - as_float64(want)).max())
        assert err <= tol, f"{name}: max |ring - one call| = {err:.3g} > {tol:.3g}"


def test_bad_calls_raise_on_every_rank_before_sending_anything(ring_run):
    ranks, _ = ring_run
    for results in ranks:
        assert len(results["bad calls"]) == 3, results["bad calls"]
        layout, lengths, group = results["bad calls"]
        assert layout.startswith("ValueError: layout must be one of")
        assert lengths.startswith("ValueError: k and v must have the same shape")
        assert group.startswith("TypeError: group must be a torch.distributed ProcessGroup")
    # The cases ran after these calls on the same group: had any of them sent a message, the cases' messages
    # would have paired with the wrong ones (test_ring_matches_one_call_on_the_whole_sequence).


def test_scaling_experiment_runs_quick(ring_run):
    _, out_dir = ring_run
    with open(out_dir / "ring_scaling_quick.csv") as f:
        rows = list(csv.DictReader(f))
    assert [row["GPUs"] for row in rows] == ["1"] + [str(WORLD)] * 3
    assert all(float(row["forward ms"]) > 0 and float(row["forward+backward ms"]) > 0 for row in rows)
    with open(out_dir / "ring_scaling_quick_longest.csv") as f:
        longest = list(csv.DictReader(f))
    assert {row["GPUs"] for row in longest if row["result"] == "ran"} == {"1", str(WORLD)}
    markdown = (out_dir / "ring_scaling_quick.md").read_text()
    assert "Command: `python3 experiments/tuning/ring_scaling.py --quick`" in markdown and "Date:" in markdown


# ---------------------------------------------------------------- the plan, the layout and the merge

@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_each_step_computes_exactly_the_causal_pairs(layout, world):
    # Rank r against rank s's K/V: the part _visible_part picks, causal or not, must be the global causal mask
    # between their positions, pair for pair.
    length = 4 * world * 3
    shard = length // world
    for rank in range(world):
        queries = ring_positions(length, rank, world, layout)
        for source in range(world):
            keys = ring_positions(length, source, world, layout)
            wanted = keys[None, :] <= queries[:, None]
            computed = torch.zeros(shard, shard, dtype=torch.bool)
            part = _visible_part(rank, source, shard, True, layout)
            if part is not None:
                rows, columns, causal = part
                block = computed[rows, columns]
                block[...] = torch.ones_like(block).tril() if causal else True
            assert torch.equal(computed, wanted), (rank, source)
            assert _visible_part(rank, source, shard, False, layout) == (slice(None), slice(None), False)


@pytest.mark.parametrize("world", [2, 3, 5])
def test_zigzag_gives_every_rank_equal_causal_work(world):
    shard = 4 * 3
    pairs = []
    for rank in range(world):
        work = 0
        for source in range(world):
            rows, columns, causal = _visible_part(rank, source, shard, True, "zigzag")
            n_q, n_k = len(range(shard)[rows]), len(range(shard)[columns])
            work += n_q * (n_k + 1) // 2 if causal else n_q * n_k
        pairs.append(work)
    assert len(set(pairs)) == 1, pairs


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("world", [1, 2, 3])
def test_shards_cover_the_sequence_once_and_rejoin(layout, world):
    x = torch.arange(2 * 12 * world * 4, dtype=torch.float32).reshape(1, 2, 12 * world, 4)
    positions = torch.cat([ring_positions(12 * world, rank, world, layout) for rank in range(world)])
    assert torch.equal(positions.sort().values, torch.arange(12 * world))
    shards = [ring_shard(x, rank, world, layout) for rank in range(world)]
    assert all(torch.equal(shard, x[:, :, ring_positions(12 * world, rank, world, layout)])
               for rank, shard in enumerate(shards))
    assert torch.equal(ring_unshard(shards, layout), x)


def test_zigzag_positions_as_documented():
    assert ring_positions(8, 0, 2).tolist() == [0, 1, 6, 7]
    assert ring_positions(8, 1, 2).tolist() == [2, 3, 4, 5]
    assert ring_positions(8, 1, 2, "contiguous").tolist() == [4, 5, 6, 7]


@given(heads=st.integers(1, 3), rows=st.integers(1, 8), keys=st.integers(1, 12), d=st.integers(1, 8),
       split=st.floats(0, 1), density=st.floats(0, 1), logit_scale=st.sampled_from([1.0, 1e3]),
       seed=st.integers(0, 2**32 - 1))
def test_merging_two_key_sets_gives_attention_over_both(heads, rows, keys, d, split, density, logit_scale, seed):
    # In float64 the merge and the one-pass reference differ only by rounding order.  Any split of the keys
    # (one side may be empty), any allowed pattern: rows that see keys on one side only, on both, on neither;
    # logits in the thousands, where weights taken before subtracting the larger lse would overflow.
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal((heads, n, d)) for n in (rows, keys, keys))
    q *= logit_scale
    allowed = rng.random((rows, keys)) < density
    cut = round(split * keys)

    def over(part):
        """Attention over a part of the keys; over none, what numba-flash returns: O = 0, lse = -inf."""
        if k[:, part].shape[1] == 0:
            return np.zeros(q.shape), np.full(q.shape[:-1], -np.inf)
        return reference.attention(q, k[:, part], v[:, part], mask=allowed[:, part])

    first, second = over(slice(None, cut)), over(slice(cut, None))
    out, lse = (torch.tensor(x) for x in first)
    merge_by_lse(out, lse, *(torch.tensor(x) for x in second))
    want_out, want_lse = reference.attention(q, k, v, mask=allowed)
    np.testing.assert_allclose(out.numpy(), want_out, rtol=FLOAT64_AGREEMENT, atol=FLOAT64_AGREEMENT)
    assert np.array_equal(np.isneginf(lse.numpy()), np.isneginf(want_lse))
    finite = np.isfinite(want_lse)
    np.testing.assert_allclose(lse.numpy()[finite], want_lse[finite], rtol=FLOAT64_AGREEMENT)
    assert np.all(out.numpy()[:, ~allowed.any(axis=1)] == 0)   # rows that see no key: O = 0


def test_merging_with_an_empty_side_keeps_the_other_exactly():
    rng = np.random.default_rng(1)
    partial_out = torch.tensor(rng.standard_normal((3, 5, 4)), dtype=torch.float32)
    partial_lse = torch.tensor(rng.standard_normal((3, 5)), dtype=torch.float32)
    out, lse = torch.zeros(3, 5, 4), torch.full((3, 5), -np.inf)
    merge_by_lse(out, lse, partial_out, partial_lse)
    assert torch.equal(out, partial_out) and torch.equal(lse, partial_lse)
    merge_by_lse(out, lse, torch.zeros(3, 5, 4, dtype=torch.float16), torch.full((3, 5), -np.inf))
    assert torch.equal(out, partial_out) and torch.equal(lse, partial_lse)


# ---------------------------------------------------------------- bad input, no process group needed

def shards(heads=2, kv_heads=2, length=8, d=16):
    return [torch.zeros(1, h, length, d, device=DEVICE) for h in (heads, kv_heads, kv_heads)]


@pytest.mark.parametrize("call, error, message", [
    (lambda q, k, v: nft.ring_attention(q, k, v, layout="striped"), ValueError, "layout must be one of"),
    (lambda q, k, v: nft.ring_attention(q, k, v, causal="bottom_right"), TypeError, "causal must be True or False"),
    (lambda q, k, v: nft.ring_attention(q[..., :7, :], k[..., :7, :], v[..., :7, :]), ValueError,
     "even shard length"),
    (lambda q, k, v: nft.ring_attention(q[..., :6, :], k, v), ValueError, "shards of one sequence"),
    (lambda q, k, v: nft.ring_attention(q, k, v[..., :4]), ValueError, "same head dim"),
    (lambda q, k, v: nft.ring_attention(q, k, v.double()), TypeError, "share one dtype"),
    (lambda q, k, v: nft.ring_attention(q.numpy(force=True), k, v), TypeError, "q must be a torch.Tensor"),
    (lambda q, k, v: nft.ring_attention(q[:, :1], k, v), ValueError, "query heads to be a multiple"),
], ids=["layout", "causal", "odd zigzag shard", "q and k lengths", "head dims", "dtypes", "not a tensor", "heads"])
def test_bad_input_raises_naming_the_argument(call, error, message):
    with pytest.raises(error, match=message):
        call(*shards())


def test_no_process_group_raises_naming_group():
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match="group: torch.distributed is not initialised"):
        nft.ring_attention(*shards())


def test_a_sequence_the_layout_cannot_cut_raises():
    with pytest.raises(ValueError, match="multiple of 4 for layout='zigzag'"):
        ring_shard(torch.zeros(1, 2, 10, 4), 0, 2)
    with pytest.raises(ValueError, match="rank must be an int in"):
        ring_positions(8, 2, 2)
