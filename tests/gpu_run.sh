#!/usr/bin/env bash
# One batch of GPU work: tests, compute-sanitizer, benchmarks and experiments, each under a time limit.
#
#   bash tests/gpu_run.sh [STEP ...]     # steps: tests sanitize (memcheck racecheck) bench host backward accuracy
#                                        # experiments decode train ring hopper roles sixteen mods (default: all but
#                                        # backward, decode, train, ring, hopper, roles, sixteen, mods; ring needs
#                                        # two GPUs)
#
# Logs go to $OUT/run (or ./run), results files to experiments/{paper,tuning}/results/.  Every step prints one
# summary line; a step cut by its limit says so (rc=124) and the next one starts.  Most of a GPU
# run is JIT compilation (seconds per kernel specialisation, in every pytest worker), hence the
# short Hypothesis profile for the tests (the whole suite: 382 s on 16 workers, 2026-12-03; each failure's
# report lands in $LOGS/failures.txt as it happens).  With BASELINE set to a package folder (an earlier commit,
# e.g. .baseline/numba_flash_a449d24), the benchmarks and the accuracy experiment measure it beside
# this tree in the same process.  GPU=i puts the steps on GPU i; TEST_FILES narrows the tests step
# (to split the suite between device calls), SANITIZE_WORDS the sanitizer runs (e.g. "flash2 float16":
# the runs whose names hold every word).  Clocks are never touched.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
export CUDA_VISIBLE_DEVICES=${GPU:-0}
LOGS=${OUT:-.}/run${GPU:-}
mkdir -p "$LOGS" experiments/paper/results experiments/tuning/results
STEPS=${*:-tests sanitize bench host accuracy experiments}
BASE=${BASELINE:+--baseline $BASELINE}

step() {  # step NAME LIMIT_SECONDS COMMAND...
    local name=$1 limit=$2 start=$SECONDS
    shift 2
    timeout -s INT "$limit" "$@" > "$LOGS/$name.log" 2>&1
    echo "$name: rc=$? in $((SECONDS - start)) s (limit $limit s, log $LOGS/$name.log)"
}

for s in $STEPS; do
    case $s in
    tests)
        NUMBA_FLASH_TEST_FAILURES=$LOGS/failures.txt HYPOTHESIS_PROFILE=${HYPOTHESIS_PROFILE:-gpu_smoke} \
            step pytest ${TEST_LIMIT:-520} python3 -m pytest -q -n ${WORKERS:-16} -p no:cacheprovider -p no:benchmark --durations=15 ${TEST_FILES:-tests/}
        grep -E "passed|failed|^FAILED|^ERROR" "$LOGS/pytest.log" | tail -12 ;;
    sanitize|memcheck|racecheck)
        for tool in memcheck racecheck; do
            [ "$s" = sanitize ] || [ "$s" = $tool ] || continue
            step $tool ${SANITIZE_LIMIT:-200} compute-sanitizer --tool $tool --report-api-errors no --error-exitcode 9 \
                python3 tests/gpu_sanitize.py quick ${SANITIZE_WORDS:-}
            grep -hE "SUMMARY|rror" "$LOGS/$tool.log" | tail -4
        done ;;
    bench)
        step bench_forward 300 python3 -m numba_flash bench --repeats 20 $BASE --out experiments/tuning/results \
            --tag bench_h200 --command "python3 -m numba_flash bench --repeats 20 $BASE"
        tail -4 "$LOGS/bench_forward.log" ;;
    sixteen)  # issue 15's 16-bit check in one process: forward, and forward + backward, beside torch and Flex
        step bench_sixteen_bit ${SIXTEEN_LIMIT:-560} python3 -m numba_flash bench --sixteen-bit --repeats 10 $BASE \
            --out experiments/tuning/results --tag bench_sixteen_bit_h200 \
            --command "python3 -m numba_flash bench --sixteen-bit --repeats 10 $BASE"
        grep -E "torch-flash \(target" "$LOGS/bench_sixteen_bit.log" | tail -20 ;;
    mods)  # issue 46's examples against FlexAttention, forward and forward + backward (~330 s a dtype)
        step mods_bench ${MODS_LIMIT:-560} python3 experiments/tuning/mods_bench.py --dtypes ${MODS_DTYPES:-bfloat16} \
            --repeats 10 --out experiments/tuning/results --tag mods_bench_h200
        tail -12 "$LOGS/mods_bench.log" ;;
    host)
        step bench_host 150 python3 -m numba_flash bench --host $BASE --dtypes float16,float32 \
            --out experiments/tuning/results --tag host_h200 --command "python3 -m numba_flash bench --host $BASE"
        tail -16 "$LOGS/bench_host.log" ;;
    backward)
        step bench_backward 300 python3 -m numba_flash bench --backward --repeats 10 $BASE --out experiments/tuning/results \
            --tag bench_backward_h200 --command "python3 -m numba_flash bench --backward --repeats 10 $BASE"
        tail -4 "$LOGS/bench_backward.log" ;;
    accuracy)
        step float32_accuracy 200 python3 experiments/paper/float32_accuracy.py $BASE
        tail -30 "$LOGS/float32_accuracy.log" ;;
    experiments)
        step block_sparse 150 python3 experiments/paper/block_sparse.py
        tail -3 "$LOGS/block_sparse.log"
        step block_sparse_float16 200 python3 experiments/paper/block_sparse.py --dtype float16
        tail -3 "$LOGS/block_sparse_float16.log" ;;
    decode)  # where one step's GPU time goes and the defaults beside BASELINE and torch (GPU time), then ncu of
             # ours and cuDNN's kernels: L2 sectors and stall reasons (issue 16: 0.96x cuDNN, 2026-12-03)
        step decode_breakdown 100 python3 experiments/tuning/decode_breakdown.py ${BASELINE:+--baseline $BASELINE}
        grep -E "^\| " "$LOGS/decode_breakdown.log" | tail -12
        step decode 300 python3 experiments/tuning/decode_key_warps.py --quick ${BASELINE:+--baseline $BASELINE} \
            --case 16,32,8,8192 --case 1,32,8,8192 --case 4,32,8,32768 --out experiments/tuning/results/decode_quick_h200.md
        grep -E "^\| |Case" "$LOGS/decode.log" | tail -24
        step decode_profile 120 ncu --clock-control none --profile-from-start off --kernel-name regex:"flash2|cudnn" \
            --section SpeedOfLight --section WarpStateStats --section MemoryWorkloadAnalysis --section SourceCounters \
            python3 experiments/tuning/decode_breakdown.py --profile
        grep -E "^  [a-z_0-9]+.*\(|Duration|DRAM Throughput|L2 Hit Rate|excessive|Warp Cycles Per Issued" "$LOGS/decode_profile.log" \
            | head -30 ;;
    ring)  # two GPUs (nvidia-h200-x2): NCCL equalities, then the scaling run; NVLink multicast stays off
        export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
        CUDA_VISIBLE_DEVICES=0,1 step ring_tests ${RING_LIMIT:-240} python3 -m pytest -q -p no:cacheprovider tests/test_ring.py
        tail -3 "$LOGS/ring_tests.log"
        CUDA_VISIBLE_DEVICES=0,1 step ring_scaling ${RING_SCALING_LIMIT:-420} torchrun --nproc-per-node 2 \
            experiments/tuning/ring_scaling.py ${RING_SCALING_ARGS:-}
        tail -12 "$LOGS/ring_scaling.log" ;;
    hopper)  # Hopper's warpgroup MMA driven from Numba: the layouts against NumPy, the forward's and backward's tests and
             # sanitizers, then TFLOP/s beside cuBLAS
        step wgmma_layouts 150 python3 experiments/tuning/wgmma_layouts.py
        grep -E "True|Error" "$LOGS/wgmma_layouts.log" | tail -12
        HYPOTHESIS_PROFILE=${HYPOTHESIS_PROFILE:-gpu} step wgmma_test 300 python3 -m pytest -q -p no:cacheprovider tests/test_hopper.py \
            tests/test_hopper_mods.py
        tail -3 "$LOGS/wgmma_test.log"
        for tool in memcheck racecheck synccheck; do
            step wgmma_$tool 150 compute-sanitizer --tool $tool --report-api-errors no --error-exitcode 9 \
                python3 tests/gpu_sanitize.py wgmma
            grep -hE "SUMMARY|rror" "$LOGS/wgmma_$tool.log" | tail -3
        done
        step wgmma_probe 150 python3 experiments/tuning/wgmma_probe.py
        tail -6 "$LOGS/wgmma_probe.log"
        for groups in 1 2; do   # blocks of one warpgroup or two, beside mma.sync and torch flash (GPU time)
            NUMBA_FLASH_WGMMA_WARPGROUPS=$groups step wgmma_warpgroups$groups 150 python3 -m numba_flash bench \
                --device-time --dtypes float16,bfloat16 --algorithms wgmma,mma --peers torch-flash --repeats 10 \
                --shape 4 16 4096 64 --shape 2 16 8192 128 --shape 1 16 16384 64 --out experiments/tuning/results \
                --tag bench_wgmma_warpgroups${groups}_h200 \
                --command "NUMBA_FLASH_WGMMA_WARPGROUPS=$groups python3 -m numba_flash bench --device-time ..."
            grep -E "\| wgmma \|" "$LOGS/wgmma_warpgroups$groups.log" | tail -12
        done ;;
    roles)  # issue 45: the bulk modes' dK/dV kernel whose warps have roles (specialized_dkdv.py): every way of
            # summing dQ timed in one process, then its tests and racecheck, synccheck, memcheck (one tool a run)
        step backward_modes ${MODES_LIMIT:-240} python3 experiments/tuning/wgmma_backward_bench.py modes
        grep -E "^\(" "$LOGS/backward_modes.log" | tail -12
        HYPOTHESIS_PROFILE=${HYPOTHESIS_PROFILE:-gpu_smoke} step roles_test 150 python3 -m pytest -q -n 6 \
            -p no:cacheprovider tests/test_hopper.py -k "bulk or hands or backward"
        tail -3 "$LOGS/roles_test.log"
        for tool in racecheck synccheck memcheck; do
            step roles_$tool 120 compute-sanitizer --tool $tool --report-api-errors no --error-exitcode 9 \
                python3 tests/gpu_sanitize.py quick backward wgmma bulk_ordered,gqa_bulk_unordered,varlen_bulk_ordered
            grep -hE "SUMMARY|rror" "$LOGS/roles_$tool.log" | tail -3
        done ;;
    train)
        step train_gpt ${TRAIN_LIMIT:-300} python3 experiments/paper/train_gpt.py --steps ${TRAIN_STEPS:-300}
        tail -6 "$LOGS/train_gpt.log" ;;
    *) echo "unknown step $s (tests, sanitize, bench, host, backward, accuracy, experiments, decode, train, ring, hopper, roles,"
       echo "sixteen, mods)"
       exit 2 ;;
    esac
done
