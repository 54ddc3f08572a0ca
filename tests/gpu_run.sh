#!/usr/bin/env bash
# One batch of GPU work: tests, compute-sanitizer, benchmarks and experiments, each under a time limit.
#
#   bash tests/gpu_run.sh [STEP ...]     # steps: tests sanitize bench experiments (default: all)
#
# Logs go to $OUT/run (or ./run), results files to experiments/results/.  Every step prints one
# summary line; a step cut by its limit says so (rc=124) and the next one starts.  Most of a GPU
# run is JIT compilation (seconds per kernel specialisation, in every pytest worker), hence the
# short Hypothesis profile for the tests.  Clocks are never touched.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
LOGS=${OUT:-.}/run
mkdir -p "$LOGS" experiments/results
STEPS=${*:-tests sanitize bench experiments}

step() {  # step NAME LIMIT_SECONDS COMMAND...
    local name=$1 limit=$2 start=$SECONDS
    shift 2
    timeout -s INT "$limit" "$@" > "$LOGS/$name.log" 2>&1
    echo "$name: rc=$? in $((SECONDS - start)) s (limit $limit s, log $LOGS/$name.log)"
}

for s in $STEPS; do
    case $s in
    tests)
        HYPOTHESIS_PROFILE=${HYPOTHESIS_PROFILE:-gpu_smoke} step pytest 300 \
            python3 -m pytest -q -n 16 -p no:cacheprovider -p no:benchmark --durations=15 tests/
        grep -E "passed|failed|^FAILED|^ERROR" "$LOGS/pytest.log" | tail -5 ;;
    sanitize)
        step memcheck 150 compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 9 \
            python3 tests/gpu_sanitize.py quick
        step racecheck 150 compute-sanitizer --tool racecheck --report-api-errors no --error-exitcode 9 \
            python3 tests/gpu_sanitize.py quick
        grep -hE "SUMMARY" "$LOGS/memcheck.log" "$LOGS/racecheck.log" ;;
    bench)
        step bench_forward 150 python3 -m numba_flash bench --repeats 20 --out experiments/results --tag bench_h200 \
            --command "python3 -m numba_flash bench --repeats 20"
        step bench_backward 150 python3 -m numba_flash bench --backward --repeats 10 --out experiments/results \
            --tag bench_backward_h200 --command "python3 -m numba_flash bench --backward --repeats 10" ;;
    experiments)
        step block_sparse 90 python3 experiments/block_sparse.py
        step dram_traffic 200 python3 experiments/dram_traffic.py
        step io_traffic 150 python3 experiments/io_traffic.py --parts gpt2 block_size
        step block_size_choice 300 python3 experiments/block_size_choice.py ;;
    *) echo "unknown step $s (tests, sanitize, bench, experiments)"; exit 2 ;;
    esac
done
