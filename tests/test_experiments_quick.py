"""The experiment scripts' --quick modes run end to end and write sane outputs."""
import csv
import importlib.util
import pathlib

import numpy as np
import pytest

import numba_flash
from tolerances import MODEL_LOSS_RTOL

EXPERIMENTS = pathlib.Path(__file__).resolve().parent.parent / "experiments"
ROOMS = ("paper", "tuning")


def script_path(name):
    """experiments/paper/<name>.py or experiments/tuning/<name>.py, whichever exists."""
    paths = [EXPERIMENTS / room / f"{name}.py" for room in ROOMS if (EXPERIMENTS / room / f"{name}.py").exists()]
    assert len(paths) == 1, (name, paths)
    return paths[0]


def load_script(name):
    spec = importlib.util.spec_from_file_location(name, script_path(name))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def io_traffic():
    return load_script("io_traffic")


@pytest.fixture(scope="module")
def results(io_traffic, tmp_path_factory):
    out = tmp_path_factory.mktemp("results")
    io_traffic.main(["--quick", "--out", str(out)])
    return out


def rows(results, part):
    with open(results / f"io_{part}_quick.csv") as f:
        return list(csv.DictReader(f))


def test_every_part_writes_csv_and_markdown(io_traffic, results):
    for part in io_traffic.PARTS:
        assert rows(results, part), part
        markdown = (results / f"io_{part}_quick.md").read_text()
        assert "Command: `python3 experiments/paper/io_traffic.py --quick`" in markdown
        assert "Device:" in markdown and "Date:" in markdown
        # Model-only parts say no kernel ran; timed parts say what timed them.
        timer = "simulator" if numba_flash.in_simulator() else "CUDA events"
        assert ("model" in markdown) if part in io_traffic.MODEL_ONLY else (timer in markdown)


def test_every_part_draws_a_plot(io_traffic, results):
    pytest.importorskip("matplotlib")
    for part in io_traffic.PARTS:
        assert (results / f"io_{part}_quick.png").stat().st_size > 0, part


def test_fig2_left_finds_the_ncu_measurement_of_its_setting(io_traffic):
    # The committed experiments/paper/results/io_dram.csv (dram_traffic.py on the H200) must join every kernel of Fig. 2 left.
    measured = io_traffic.measured_dram_gb(io_traffic.GPT2)
    kernels = {f"{algorithm} {np.dtype(dtype).name}" for _, algorithm, dtype, _ in io_traffic.variants(io_traffic.GPT2, False)}
    assert set(measured) == kernels and all(gb > 0 for gb in measured.values())
    assert io_traffic.measured_dram_gb(io_traffic.GPT2_QUICK) == {}


def test_flash_moves_less_than_standard(results):
    gpt2 = {row["kernel"]: row for row in rows(results, "gpt2")}
    assert set(gpt2) == {"standard", "flash1", "flash2 float32", "flash2 float16"}
    for row in gpt2.values():
        assert float(row["total_GB"]) == pytest.approx(float(row["read_GB"]) + float(row["write_GB"]))
        assert float(row["ms"]) > 0 and float(row["gflop"]) > 0
    assert float(gpt2["standard"]["total_GB"]) > float(gpt2["flash1"]["total_GB"])
    assert float(gpt2["flash2 float32"]["total_GB"]) == pytest.approx(2 * float(gpt2["flash2 float16"]["total_GB"]),
                                                                      rel=0.05)


def test_flash1_traffic_falls_as_key_blocks_grow(results):
    sweep = rows(results, "block_size")
    traffic = [float(row["total_GB"]) for row in sweep]
    assert traffic == sorted(traffic, reverse=True)
    assert all(float(row["ms"]) > 0 for row in sweep if row["fits"] == "True")


def test_scaling_grows_with_n_and_falls_with_sram(results):
    scaling = rows(results, "scaling")
    for kernel in {row["kernel"] for row in scaling if row["sweep"] == "N"}:
        traffic = [int(row["total_bytes"]) for row in scaling if row["sweep"] == "N" and row["kernel"] == kernel]
        assert traffic == sorted(traffic) and len(set(traffic)) == len(traffic), kernel
    by_sram = [int(row["total_bytes"]) for row in scaling if row["sweep"] == "M"]
    assert by_sram == sorted(by_sram, reverse=True)


def test_flash_memory_is_linear_in_n(results):
    memory = rows(results, "memory")
    for kernel in ("flash1", "flash2 float32", "flash2 float16"):
        per_token = {float(row["bytes_per_token"]) for row in memory if row["kernel"] == kernel}
        assert len(per_token) == 1, kernel
    standard = [float(row["bytes_per_token"]) for row in memory if row["kernel"] == "standard"]
    assert standard == sorted(standard) and standard[-1] > standard[0]


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_block_sparse_experiment_runs_quick(tmp_path, dtype):
    assert load_script("block_sparse").main(["--quick", "--dtype", dtype, "--out", str(tmp_path)]) == 0
    stem = "block_sparse" + ("" if dtype == "float32" else f"_{dtype}") + "_quick"
    with open(tmp_path / f"{stem}.csv") as f:
        rows = list(csv.DictReader(f))
    assert {r["pattern"] for r in rows} == {"random", "butterfly"}
    assert all(0.0 <= float(r["density"]) <= 1.0 and float(r["sparse_ms"]) > 0 for r in rows)
    assert (tmp_path / f"{stem}.md").read_text().startswith("# Block-sparse flash2")


def test_dram_experiment_runs_quick_and_reports_the_model(tmp_path):
    load_script("dram_traffic").main(["--quick", "--out", str(tmp_path)])
    with open(tmp_path / "io_dram_quick.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["kernel"] for r in rows] == ["standard float32", "flash1 float32", "flash2 float32", "flash2 float16"]
    model = [float(r["model_read_GB"]) + float(r["model_write_GB"]) for r in rows]
    assert model[0] > model[1] and model[0] > model[2] > model[3] > 0  # standard moves most; float16 half of float32



def test_backward_tile_confirmation_runs_quick_and_marks_the_defaults(tmp_path):
    from numba_flash.tiling import flash2_tuned_block_sizes, precision_of

    # --quick runs the first two cases chosen: float16's here, one causal, one not (the first two of all are
    # float32's), so that the dtype filter is tested too.
    load_script("tune_flash2").main(["--backward", "--confirm", "--quick", "--dtypes", "float16", "--out",
                                     str(tmp_path)])
    with open(tmp_path / "tune_flash2_backward_confirm_quick.csv") as f:
        rows = list(csv.DictReader(f))
    cases = {(r["dtype"], r["shape"], r["causal"]) for r in rows}
    assert len(cases) == 2 and all(float(r["median_ms"]) >= float(r["min_ms"]) > 0 for r in rows)
    assert {r["dtype"] for r in rows} == {"float16"} and {r["causal"] for r in rows} == {"True", "False"}
    for dtype, shape, causal in cases:
        d = int(shape.strip("()").split(",")[3])
        marked = [(int(r["block_m"]), int(r["block_n"])) for r in rows
                  if (r["dtype"], r["shape"], r["causal"]) == (dtype, shape, causal) and r["default"] == "yes"]
        assert marked == [flash2_tuned_block_sizes(d, precision_of(dtype), backward=True, causal=causal == "True")]
    assert (tmp_path / "tune_flash2_backward_confirm_quick.md").read_text().startswith("# flash2 backward")
    # The causal cases alone (as for the re-tune of the pipelined backward's causal tiles): float32 has one, so
    # one case (a filter that let the non-causal case or float16's through would add rows).
    load_script("tune_flash2").main(["--backward", "--confirm", "--quick", "--dtypes", "float32", "--causal-only",
                                     "--out", str(tmp_path)])
    with open(tmp_path / "tune_flash2_backward_confirm_quick.csv") as f:
        rows = list(csv.DictReader(f))
    assert rows and all(r["dtype"] == "float32" and r["causal"] == "True" for r in rows)


NCU_CSV = '''==PROF== Connected to process 1
"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","dram__bytes_read.sum","dram__bytes_write.sum"
"","","","","","","","","","","","byte","byte"
"0","7","python3","h","standard_matmul_abt_tile16","1","7","(16, 16, 1)","(64, 64, 1)","0","9.0","1,000","2,000"
"1","7","python3","h","standard_row_softmax_t128","1","7","(128, 1, 1)","(1024, 1, 1)","0","9.0","300","400"
'''


def test_ncu_csv_parsing_reads_every_launch_in_bytes():
    launches = load_script("dram_traffic").parse_ncu_csv(NCU_CSV)
    assert launches == {0: ("standard_matmul_abt_tile16", 1000.0, 2000.0), 1: ("standard_row_softmax_t128", 300.0, 400.0)}


def test_training_experiment_runs_quick_and_both_attentions_learn_alike(tmp_path):
    train_gpt = load_script("train_gpt")
    # float32 everywhere: the script's GPU default is bfloat16 autocast, whose runs differ by far more.
    assert train_gpt.main(["--quick", "--dtype", "float32", "--out", str(tmp_path)]) == 0
    with open(tmp_path / "train_gpt_quick.csv") as f:
        steps = list(csv.DictReader(f))
    ours = np.array([float(row["loss numba-flash"]) for row in steps])
    theirs = np.array([float(row["loss torch SDPA"]) for row in steps])
    # Same weights, same batches, float32: the runs differ only by the attention's summation order.
    np.testing.assert_allclose(ours, theirs, rtol=MODEL_LOSS_RTOL)
    assert (tmp_path / "train_gpt_quick.md").read_text().count("|") > 10


def test_decoding_experiment_runs_quick(tmp_path):
    decode = load_script("decode_bandwidth")
    assert decode.main(["--quick", "--out", str(tmp_path)]) == 0
    with open(tmp_path / "decode_quick.csv") as f:
        rows = {row["implementation"]: row for row in csv.DictReader(f)}
    for name in ("numba-flash", "numba-flash, lengths on the host", "numba-flash, appending the token"):
        assert float(rows[name]["ms"]) > 0, name


def test_causal_schedule_model_puts_rank_major_near_the_ideal(tmp_path):
    schedule = load_script("causal_schedule")
    assert schedule.main(["--out", str(tmp_path)]) == 0
    # Three heads of 4 tiles (work 4, 3, 2, 1) on 5 slots: head-major starts the third head's 4 only at
    # t = 4, when the first wave is done, and ends at 8; rank-major starts all three 4s first and ends at
    # the ideal 6 (30 units of work over 5 slots).
    head_major, rank_major = schedule.orders(3, 4, 0.0)
    assert head_major[:5] == [4, 3, 2, 1, 4] and rank_major[:5] == [4, 4, 4, 3, 3]
    assert (schedule.makespan(head_major, 5), schedule.makespan(rank_major, 5)) == (8, 6)


def test_generate_bench_quick_gives_sdpas_tokens_and_a_table(tmp_path):
    bench = load_script("generate_bench")
    assert bench.main(["--quick", "--out", str(tmp_path)]) == 0   # 0: float32 tokens identical, both caches
    text = (tmp_path / "generate_bench_quick.md").read_text()
    assert "with a static cache: True, with a dynamic cache: True" in text
    assert "| float32 | 2 | numba-flash |" in text and "experiments/tuning/generate_bench.py --quick" in text
