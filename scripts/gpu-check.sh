#!/usr/bin/env bash
# Runs on the GPU machine (CUDA driver, no Rust, no network), in the repository root, with the
# bundle from scripts/gpu-bundle.sh in gpu-bundle/ and $OUT set to a folder that comes back.
# The device tool brings back at most 8 files from $OUT, so the script writes at most 7:
#
#   $OUT/summary.md        the machine, one line per step, the conformance count, the MNIST
#                          comparison and the replay table
#   $OUT/results.tsv       step, status (pass/fail/skip), seconds, passed, failed, ignored, note
#   $OUT/logs.tar.gz       logs/*.log: the full output of every step, the machine, this script
#   $OUT/mnist-report.json, $OUT/mnist-timeline.svg   the MNIST comparison (when it ran)
#   $OUT/replay.json, $OUT/replay-cuda.svg            the replay on the device (when it ran)
#
# summary.md, results.tsv and logs.tar.gz are rewritten after every step, so a step that hangs
# (or a call that runs out of time) loses nothing that finished before it.
#
# Steps, in order, each with its own timeout, all within one time budget:
#   test-lib, test-runtime     the library's unit tests and the runtime tests, GPU tests
#                              included (--include-ignored: they are ignored without a GPU);
#                              test-runtime holds comm_cuda (the NCCL probe, NCCL against the
#                              host path, the 256 MiB micro-benchmark the summary shows) and
#                              multi_device_one::cuda (a copy to the same
#                              device, an all-reduce of one rank through CubeCL's client)
#   test-cuda_fake             the tests CI runs under the fake CUDA driver (tests/cuda_fake),
#                              here on the real driver (BURN_CACHING_ALLOC_REAL_CUDA=1): a real
#                              device checks the fake (checks of the fake itself say so)
#   conformance_cuda           CubeCL's conformance suite on CachingCudaRuntime; fails when
#                              fewer tests pass than the bundle holds (or none)
#   mnist                      the MNIST comparison, caching-cuda against Burn's stock cuda
#   seed_walkthrough, replay   the seed walkthrough and the replay of the built-in traces on
#                              the device (real cuMemAlloc/cuMemFree)
# plus any bench-* binary in the bundle, then
#   burn-side-by-side          Burn models on CachingCuda against Burn's stock
#                              Cuda, fused and unfused (a few steps each); the last step, and
#                              left out when less than SIDE_BY_SIDE_MIN seconds of budget remain
#                              (dropped first when time is short) A missing piece is a skip with its reason.
#
# Without a CUDA driver (or with GPU_CHECK_DRY_RUN=1) it is a dry run: the same files, every
# step skipped with the reason, in a few seconds, exit status 0 (CI runs it). GPU_CHECK_FORCE=1
# runs the steps anyway (scripts/gpu-check-selftest.sh does, with a fake bundle).
#
# Exit status: 0 when nothing failed, 1 when a step failed, 2 when there was no bundle.
#
# Env: GPU_BUNDLE_DIR (default gpu-bundle), STEP_TIMEOUT seconds per step (default 150),
#      CONFORMANCE_TIMEOUT (default 240), TIME_BUDGET seconds for all steps (default 500),
#      MNIST_ARGS (default "--epochs 1"), SKIP_STEPS (names to leave out, e.g.
#      "replay seed_walkthrough"), SIDE_BY_SIDE_ARGS (default "--steps 6 --warmup 2"),
#      SIDE_BY_SIDE_MIN (default 60), CUDA_PATH (default /usr/local/cuda), GPU_CHECK_DRY_RUN=1.
set -uo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
MNIST_DATA="$ROOT/examples/mnist/data"
OUT=${OUT:-$PWD/gpu-check-out}
BUNDLE=${GPU_BUNDLE_DIR:-gpu-bundle}
STEP_TIMEOUT=${STEP_TIMEOUT:-150}
CONFORMANCE_TIMEOUT=${CONFORMANCE_TIMEOUT:-240}
TIME_BUDGET=${TIME_BUDGET:-500}
MNIST_ARGS=${MNIST_ARGS:---epochs 1}
SKIP_STEPS=${SKIP_STEPS:-}
SIDE_BY_SIDE_ARGS=${SIDE_BY_SIDE_ARGS:---steps 6 --warmup 2}
SIDE_BY_SIDE_MIN=${SIDE_BY_SIDE_MIN:-60}
START=$(date +%s)

# tests/cuda_fake (test-cuda_fake) runs on the real driver here, not under the fake: a real
# device checks what CI checks on the fake (the fake's own checks print that they are fake-only).
export BURN_CACHING_ALLOC_REAL_CUDA=1

# NVRTC and its headers: set before anything loads libnvrtc.
export CUDA_PATH=${CUDA_PATH:-/usr/local/cuda}
export LD_LIBRARY_PATH="$CUDA_PATH/lib64:$CUDA_PATH/targets/x86_64-linux/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

mkdir -p "$OUT"
LOGROOT=$(mktemp -d)
LOGS="$LOGROOT/logs"
mkdir -p "$LOGS"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK" "$LOGROOT"' EXIT
RESULTS="$OUT/results.tsv"
SUMMARY="$OUT/summary.md"
printf 'step\tstatus\tseconds\tpassed\tfailed\tignored\tnote\n' >"$RESULTS"
FAILED_STEPS=0
CONFORMANCE="not run"
MNIST_LINE="not run"
# The steps every run reports, in order (bench-* ones are added when the bundle has them).
STEPS=(test-lib test-runtime conformance_cuda mnist seed_walkthrough replay burn-side-by-side)

say() { printf '[gpu-check] %s\n' "$*" | tee -a "$LOGS/gpu-check.log" >&2; }

# --- results, written after every step --------------------------------------------------------
publish() {
    {
        echo "# GPU check"
        echo
        echo "Mode: $MODE. Elapsed: $(($(date +%s) - START)) s of a $TIME_BUDGET s budget."
        echo
        echo '```'
        cat "$BUNDLE/BUILD-INFO" 2>/dev/null || echo "no BUILD-INFO in $BUNDLE"
        nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null ||
            echo "nvidia-smi unavailable"
        echo '```'
        echo
        echo "| step | status | seconds | passed | failed | ignored | note |"
        echo "|---|---|---|---|---|---|---|"
        tail -n +2 "$RESULTS" | awk -F'\t' '{printf "| %s | %s | %s | %s | %s | %s | %s |\n", $1, $2, $3, $4, $5, $6, $7}'
        echo
        echo "- CubeCL conformance on CachingCudaRuntime: $CONFORMANCE"
        echo "- MNIST --compare (caching-cuda vs cuda): $MNIST_LINE"
        if [ -s "$LOGS/mnist.log" ]; then
            echo
            echo '```'
            tail -n 40 "$LOGS/mnist.log"
            echo '```'
        fi
        if grep -qE '^\| (comm-bench|nccl) \|' "$LOGS/test-runtime.log" 2>/dev/null; then
            echo
            echo "Between devices (comm_cuda: NCCL probe; 256 MiB device path against host path):"
            echo
            grep -E '^\| (comm-bench|nccl) \|' "$LOGS/test-runtime.log"
        fi
        if grep -q '^| trace | allocator' "$LOGS/replay.log" 2>/dev/null; then
            echo
            echo "Replay on the CUDA device (real cuMemAlloc/cuMemFree):"
            echo
            grep '^|' "$LOGS/replay.log"
        fi
        if [ -s "$LOGS/conformance-failures.log" ]; then
            echo
            echo "Conformance failures:"
            echo '```'
            head -n 50 "$LOGS/conformance-failures.log"
            echo '```'
        fi
        echo
        echo "Failed steps: $FAILED_STEPS. Full logs: logs.tar.gz."
    } >"$SUMMARY.tmp" && mv "$SUMMARY.tmp" "$SUMMARY"
    tar -C "$LOGROOT" -czf "$OUT/logs.tar.gz.tmp" logs 2>/dev/null && mv "$OUT/logs.tar.gz.tmp" "$OUT/logs.tar.gz"
}

record() { # step status seconds passed failed ignored note
    printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$@" >>"$RESULTS"
    say "$1: $2 ($3 s${4:+, passed $4}${5:+, failed $5}${6:+, ignored $6}${7:+; $7})"
    publish
}

fail_step() { FAILED_STEPS=$((FAILED_STEPS + 1)); }

# Sums libtest's "test result:" lines of a log: prints "passed failed ignored".
test_counts() {
    awk '/^test result:/ {
            for (i = 1; i <= NF; i++) {
                if ($(i+1) ~ /^passed/)  p += $i
                if ($(i+1) ~ /^failed/)  f += $i
                if ($(i+1) ~ /^ignored/) g += $i
            }
         }
         END { printf "%d %d %d\n", p, f, g }' "$1"
}

# Whether step $1 is left out by SKIP_STEPS.
skipped_by_user() { [[ " $SKIP_STEPS " == *" $1 "* ]]; }

# Runs one step under min(its timeout, what is left of the budget); prints nothing, returns the
# command's status (124 on timeout), sets STEP_SECONDS. Returns 200 without running when the
# budget is spent. Usage: run_step NAME TIMEOUT CMD...
run_step() {
    local name=$1 limit=$2 log="$LOGS/$1.log" start status left
    shift 2
    left=$((TIME_BUDGET - ($(date +%s) - START)))
    STEP_SECONDS=0
    if [ "$left" -lt 15 ]; then
        return 200
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    say "$name: running (timeout $limit s)"
    start=$(date +%s)
    timeout --kill-after=10 "$limit" "$@" >"$log" 2>&1
    status=$?
    STEP_SECONDS=$(($(date +%s) - start))
    [ "$status" -eq 124 ] && echo "[gpu-check] timed out after $limit s" >>"$log"
    return "$status"
}

# Records a step that did not start: left out, no budget, or missing.
not_run() { # step reason
    record "$1" skip 0 "" "" "" "$2"
}

# --- the machine --------------------------------------------------------------------------------
{
    echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "host: $(uname -a)"
    echo "CUDA_PATH=$CUDA_PATH"
    echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
    command -v nvidia-smi >/dev/null && nvidia-smi || echo "nvidia-smi: not found"
    ldconfig -p 2>/dev/null | grep -E 'libcuda\.so|libnvrtc' || echo "ldconfig: no libcuda/libnvrtc listed"
    ls -d /usr/local/cuda* 2>/dev/null || echo "no /usr/local/cuda*"
    ls "$CUDA_PATH/include/cuda_fp16.h" "$CUDA_PATH/targets/x86_64-linux/include/cuda_fp16.h" 2>&1
} >"$LOGS/machine.log" 2>&1

GPU_SEEN=0
command -v nvidia-smi >/dev/null && nvidia-smi -L 2>/dev/null | grep -q '^GPU' && GPU_SEEN=1
DRY_REASON=""
if [ "${GPU_CHECK_FORCE:-0}" = 1 ]; then
    DRY_REASON=""
elif [ "${GPU_CHECK_DRY_RUN:-0}" = 1 ]; then
    DRY_REASON="dry run (GPU_CHECK_DRY_RUN=1)"
elif ! ldconfig -p 2>/dev/null | grep -q 'libcuda\.so' && [ ! -e /proc/driver/nvidia/version ]; then
    DRY_REASON="dry run: no CUDA driver on this machine (no libcuda, no /proc/driver/nvidia)"
elif [ "$GPU_SEEN" = 0 ]; then
    DRY_REASON="dry run: nvidia-smi lists no GPU"
fi
MODE=${DRY_REASON:-"GPU run"}
say "$MODE"
publish

if [ -n "$DRY_REASON" ]; then
    for step in "${STEPS[@]}"; do not_run "$step" "$DRY_REASON"; done
    if [ -f "$BUNDLE/BUILD-INFO" ]; then say "bundle present: $(head -n 1 "$BUNDLE/BUILD-INFO")"; else say "no bundle at $BUNDLE"; fi
    publish
    say "summary written to $SUMMARY"
    exit 0
fi

# --- unpack ----------------------------------------------------------------------------------
if [ ! -f "$BUNDLE/bundle.tar.xz" ]; then
    say "no bundle at $BUNDLE/bundle.tar.xz: run scripts/gpu-bundle.sh where Rust is, and carry gpu-bundle"
    for step in "${STEPS[@]}"; do not_run "$step" "no bundle at $BUNDLE/bundle.tar.xz"; done
    exit 2
fi
if ! tar -C "$WORK" -xJf "$BUNDLE/bundle.tar.xz" 2>"$LOGS/unpack.log"; then
    say "cannot unpack $BUNDLE/bundle.tar.xz (see logs/unpack.log)"
    for step in "${STEPS[@]}"; do not_run "$step" "the bundle does not unpack"; done
    exit 2
fi
# Verify every binary against the manifest.
if ! (cd "$WORK" && tail -n +2 manifest.tsv | awk -F'\t' '{print $5 "  " $3}' | sha256sum -c --quiet) \
    >"$LOGS/manifest-check.log" 2>&1; then
    say "some binaries do not match the manifest (see logs/manifest-check.log)"
    fail_step
fi
chmod +x "$WORK"/bin/* 2>/dev/null || true
binary() { # kind name -> path or empty
    local path="$WORK/bin/$1-$2"
    [ -x "$path" ] && echo "$path"
}
# The number of conformance tests the bundle holds (recorded by gpu-bundle.sh).
EXPECTED_CONFORMANCE=$(awk -F': ' '$1 == "conformance_tests" {print $2}' "$BUNDLE/BUILD-INFO" 2>/dev/null)

# --- test binaries ------------------------------------------------------------------------------
test_step() { # name
    local name=$1 path status passed failed ignored skipped verdict
    if skipped_by_user "test-$name"; then not_run "test-$name" "SKIP_STEPS"; return; fi
    if ! path=$(binary test "$name"); then not_run "test-$name" "not in the bundle"; return; fi
    # --include-ignored runs the GPU tests (ignored without a GPU); --show-output keeps the
    # "skipping: <reason>" lines of a test that found no CUDA device after all.
    run_step "test-$name" "$STEP_TIMEOUT" "$path" --include-ignored --show-output
    status=$?
    if [ "$status" -eq 200 ]; then not_run "test-$name" "time budget spent"; return; fi
    read -r passed failed ignored < <(test_counts "$LOGS/test-$name.log")
    skipped=$(grep -c '^skipping' "$LOGS/test-$name.log")
    if [ "$status" -eq 0 ] && [ "$skipped" -gt 0 ]; then
        # This is a GPU run, so a test that found no CUDA device is a failure.
        verdict="fail"
        note="$skipped skipped: no CUDA device found by the tests"
        fail_step
    elif [ "$status" -eq 0 ]; then
        verdict=pass
        note="logs/test-$name.log"
    else
        verdict=fail
        note="exit $status; logs/test-$name.log"
        [ "$status" -eq 124 ] && note="timed out; logs/test-$name.log"
        fail_step
    fi
    record "test-$name" "$verdict" "$STEP_SECONDS" "$passed" "$failed" "$ignored" "$note"
}

test_step lib
test_step runtime
for path in "$WORK"/bin/test-*; do
    [ -e "$path" ] || continue
    name=${path##*/test-}
    case $name in lib | runtime | conformance_cuda) continue ;; esac
    test_step "$name"
done

# --- CubeCL's conformance suite -------------------------------------------------------------------
if skipped_by_user conformance_cuda; then
    not_run conformance_cuda "SKIP_STEPS"
elif ! path=$(binary test conformance_cuda); then
    not_run conformance_cuda "not in the bundle"
    fail_step
else
    run_step conformance_cuda "$CONFORMANCE_TIMEOUT" "$path"
    status=$?
    if [ "$status" -eq 200 ]; then
        not_run conformance_cuda "time budget spent"
    else
        read -r passed failed ignored < <(test_counts "$LOGS/conformance_cuda.log")
        grep -E '^test .* FAILED$' "$LOGS/conformance_cuda.log" >"$LOGS/conformance-failures.log"
        expected=${EXPECTED_CONFORMANCE:-0}
        CONFORMANCE="$passed passed, $failed failed, $ignored ignored (bundle holds ${EXPECTED_CONFORMANCE:-an unknown number of} tests)"
        if [ "$status" -ne 0 ]; then
            verdict=fail
            note="exit $status"
            [ "$status" -eq 124 ] && note="timed out"
        elif [ "$passed" -eq 0 ]; then
            verdict=fail
            note="no conformance test passed"
        elif [ "$expected" -gt 0 ] && [ $((passed + ignored)) -lt "$expected" ]; then
            verdict=fail
            note="$passed passed + $ignored ignored, $expected expected"
        else
            verdict=pass
            note="logs/conformance_cuda.log"
        fi
        [ "$verdict" = fail ] && fail_step
        record conformance_cuda "$verdict" "$STEP_SECONDS" "$passed" "$failed" "$ignored" "$note"
    fi
fi

# --- the programs ---------------------------------------------------------------------------------
program_step() { # name, then the command's arguments after the binary
    local name=$1 path status verdict note
    shift
    if skipped_by_user "$name"; then not_run "$name" "SKIP_STEPS"; return 1; fi
    if ! path=$(binary example "$name"); then not_run "$name" "not in the bundle"; return 1; fi
    run_step "$name" "$STEP_TIMEOUT" "$path" "$@"
    status=$?
    if [ "$status" -eq 200 ]; then not_run "$name" "time budget spent"; return 1; fi
    if [ "$status" -eq 0 ]; then
        verdict=pass
        note="logs/$name.log"
    else
        verdict=fail
        note="exit $status; logs/$name.log"
        [ "$status" -eq 124 ] && note="timed out; logs/$name.log"
        fail_step
    fi
    STEP_VERDICT=$verdict
    record "$name" "$verdict" "$STEP_SECONDS" "" "" "" "$note"
}

if [ ! -d "$MNIST_DATA" ]; then
    not_run mnist "no MNIST data in examples/mnist/data"
else
    # shellcheck disable=SC2086 # MNIST_ARGS is a list of arguments
    if program_step mnist --compare --backend caching-cuda --data-dir "$MNIST_DATA" \
        --report "$OUT/mnist-report.json" --timeline "$OUT/mnist-timeline.svg" $MNIST_ARGS; then
        MNIST_LINE="$STEP_VERDICT; report: mnist-report.json"
        publish
    fi
fi

program_step seed_walkthrough --device cuda

if path=$(binary example replay) && ! "$path" --help 2>&1 | grep -q -- '--device'; then
    not_run replay "the replay binary has no --device option (simulated device only)"
else
    program_step replay --device cuda --runs 3 --json "$OUT/replay.json" --svg "$OUT/replay-cuda.svg"
fi

for path in "$WORK"/bin/bench-*; do
    [ -e "$path" ] || continue
    name=${path##*/bench-}
    run_step "bench-$name" "$STEP_TIMEOUT" "$path" --bench
    status=$?
    if [ "$status" -eq 200 ]; then not_run "bench-$name" "time budget spent"; continue; fi
    if [ "$status" -eq 0 ]; then verdict=pass; else
        verdict=fail
        fail_step
    fi
    record "bench-$name" "$verdict" "$STEP_SECONDS" "" "" "" "logs/bench-$name.log"
done

# The side-by-side benchmark goes last: the first thing left out when the budget is short.
if [ $((TIME_BUDGET - ($(date +%s) - START))) -lt "$SIDE_BY_SIDE_MIN" ]; then
    not_run burn-side-by-side "under $SIDE_BY_SIDE_MIN s of budget left"
else
    # shellcheck disable=SC2086 # SIDE_BY_SIDE_ARGS is a list of arguments
    program_step burn-side-by-side --device cuda --json "$OUT/side-by-side.json" \
        $SIDE_BY_SIDE_ARGS
fi

publish
say "summary written to $SUMMARY"
[ "$FAILED_STEPS" -eq 0 ]
