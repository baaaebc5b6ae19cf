#!/usr/bin/env bash
# Runs on the GPU machine (CUDA driver, no Rust, no network), in the repository root, with the
# bundle from scripts/gpu-bundle.sh in gpu-bundle/ and $OUT set to a folder that comes back:
#
#   $OUT/summary.md        one line per step, the conformance count, the MNIST comparison
#   $OUT/results.tsv       step, status (pass/fail/skip), seconds, passed, failed, ignored, log
#   $OUT/logs/*.log        full output of every step
#   $OUT/mnist-report.json, $OUT/mnist-timeline.svg   the MNIST comparison (when it ran)
#   $OUT/replay.json, $OUT/replay-cuda.svg   the replay of the built-in traces on the device
#
# Steps: every test binary (GPU tests skip themselves with a reason where CUDA is missing),
# CubeCL's conformance suite on CachingCudaRuntime, the seed walkthrough on the device, the
# MNIST comparison (caching-cuda against Burn's stock cuda), the replay example on the device
# if it supports one, and any GPU benchmark in the bundle. A missing piece is a skip with a
# message. Exit status: 1 if any test binary or the conformance suite failed, else 0.
#
# Env: GPU_BUNDLE_DIR (default gpu-bundle), STEP_TIMEOUT seconds per step (default 900),
#      MNIST_ARGS (default "--epochs 1"), SKIP_MNIST=1 to leave MNIST out.
set -uo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
MNIST_DATA="$ROOT/examples/mnist/data"
OUT=${OUT:-$PWD/gpu-check-out}
BUNDLE=${GPU_BUNDLE_DIR:-gpu-bundle}
STEP_TIMEOUT=${STEP_TIMEOUT:-900}
MNIST_ARGS=${MNIST_ARGS:---epochs 1}
mkdir -p "$OUT/logs"
RESULTS="$OUT/results.tsv"
SUMMARY="$OUT/summary.md"
printf 'step\tstatus\tseconds\tpassed\tfailed\tignored\tlog\n' >"$RESULTS"
FAILED_TESTS=0

say() { printf '[gpu-check] %s\n' "$*" | tee -a "$OUT/logs/gpu-check.log" >&2; }

record() { # step status seconds passed failed ignored log
    printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$@" >>"$RESULTS"
    say "$1: $2 ($3 s${4:+, passed $4}${5:+, failed $5}${6:+, ignored $6})"
}

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

# Runs one step with a timeout; prints its exit status. Usage: run_step NAME CMD...
run_step() {
    local name=$1 log="$OUT/logs/$1.log" start status
    shift
    start=$(date +%s)
    timeout --kill-after=30 "$STEP_TIMEOUT" "$@" >"$log" 2>&1
    status=$?
    STEP_SECONDS=$(($(date +%s) - start))
    [ "$status" -eq 124 ] && echo "[gpu-check] timed out after $STEP_TIMEOUT s" >>"$log"
    return "$status"
}

# --- the machine ----------------------------------------------------------------------------
{
    echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "host: $(uname -a)"
    command -v nvidia-smi >/dev/null && nvidia-smi || echo "nvidia-smi: not found"
    ldconfig -p 2>/dev/null | grep -E 'libcuda\.so|libnvrtc' || echo "ldconfig: no libcuda/libnvrtc listed"
    ls -d /usr/local/cuda* 2>/dev/null || echo "no /usr/local/cuda*"
} >"$OUT/logs/machine.log" 2>&1

GPU_SEEN=0
command -v nvidia-smi >/dev/null && nvidia-smi -L 2>/dev/null | grep -q '^GPU' && GPU_SEEN=1

# --- unpack ----------------------------------------------------------------------------------
if [ ! -f "$BUNDLE/bundle.tar.xz" ]; then
    say "no bundle at $BUNDLE/bundle.tar.xz: run scripts/gpu-bundle.sh where Rust is, and carry gpu-bundle"
    printf '# GPU check\n\nNo bundle found at `%s`; nothing ran.\n' "$BUNDLE" >"$SUMMARY"
    exit 2
fi
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
if ! tar -C "$WORK" -xJf "$BUNDLE/bundle.tar.xz"; then
    say "cannot unpack $BUNDLE/bundle.tar.xz"
    exit 2
fi
cp "$BUNDLE/BUILD-INFO" "$OUT/" 2>/dev/null || true
# Verify every binary against the manifest.
if ! (cd "$WORK" && tail -n +2 manifest.tsv | awk -F'\t' '{print $5 "  " $3}' | sha256sum -c --quiet) \
    >"$OUT/logs/manifest-check.log" 2>&1; then
    say "some binaries do not match the manifest (see logs/manifest-check.log)"
    FAILED_TESTS=$((FAILED_TESTS + 1))
fi
chmod +x "$WORK"/bin/* 2>/dev/null || true
binary() { # kind name -> path or empty
    local path="$WORK/bin/$1-$2"
    [ -x "$path" ] && echo "$path"
}

# --- test binaries (conformance last: it is the longest) --------------------------------------
for path in "$WORK"/bin/test-*; do
    [ -e "$path" ] || continue
    name=${path##*/test-}
    [ "$name" = conformance_cuda ] && continue
    # --show-output keeps the "skipping: <reason>" lines of tests that skip without CUDA.
    run_step "test-$name" "$path" --show-output
    status=$?
    read -r passed failed ignored < <(test_counts "$OUT/logs/test-$name.log")
    skipped=$(grep -c '^skipping' "$OUT/logs/test-$name.log")
    if [ "$status" -eq 0 ] && [ "$skipped" -gt 0 ] && [ "$GPU_SEEN" = 1 ]; then
        # nvidia-smi sees a GPU, so a test that found no CUDA device is a failure.
        verdict="fail ($skipped skipped although nvidia-smi sees a GPU)"
        FAILED_TESTS=$((FAILED_TESTS + 1))
    elif [ "$status" -eq 0 ]; then
        verdict=pass
        [ "$skipped" -gt 0 ] && verdict="pass ($skipped skipped: no CUDA)"
    else
        verdict=fail
        FAILED_TESTS=$((FAILED_TESTS + 1))
    fi
    record "test-$name" "$verdict" "$STEP_SECONDS" "$passed" "$failed" "$ignored" "logs/test-$name.log"
done

CONFORMANCE="not run"
if path=$(binary test conformance_cuda); then
    run_step conformance_cuda "$path"
    status=$?
    read -r passed failed ignored < <(test_counts "$OUT/logs/conformance_cuda.log")
    CONFORMANCE="$passed passed, $failed failed, $ignored ignored"
    if [ "$status" -eq 0 ]; then verdict=pass; else
        verdict=fail
        FAILED_TESTS=$((FAILED_TESTS + 1))
        grep -E '^test .* FAILED$' "$OUT/logs/conformance_cuda.log" >"$OUT/conformance-failures.txt"
    fi
    record conformance_cuda "$verdict" "$STEP_SECONDS" "$passed" "$failed" "$ignored" logs/conformance_cuda.log
else
    record conformance_cuda skip 0 "" "" "" "not in the bundle"
fi

# --- examples -----------------------------------------------------------------------------------
if path=$(binary example seed_walkthrough); then
    run_step seed_walkthrough "$path" --device cuda
    if [ $? -eq 0 ]; then verdict=pass; else verdict=fail; fi
    record seed_walkthrough "$verdict" "$STEP_SECONDS" "" "" "" logs/seed_walkthrough.log
else
    record seed_walkthrough skip 0 "" "" "" "not in the bundle"
fi

MNIST_LINE="not run"
if [ "${SKIP_MNIST:-0}" = 1 ]; then
    record mnist skip 0 "" "" "" "SKIP_MNIST=1"
elif ! path=$(binary example mnist); then
    record mnist skip 0 "" "" "" "not in the bundle"
elif [ ! -d "$MNIST_DATA" ]; then
    record mnist skip 0 "" "" "" "no MNIST data in examples/mnist/data"
else
    # shellcheck disable=SC2086 # MNIST_ARGS is a list of arguments
    run_step mnist "$path" --compare --backend caching-cuda --data-dir "$MNIST_DATA" \
        --report "$OUT/mnist-report.json" --timeline "$OUT/mnist-timeline.svg" $MNIST_ARGS
    if [ $? -eq 0 ]; then verdict=pass; else verdict=fail; fi
    record mnist "$verdict" "$STEP_SECONDS" "" "" "" logs/mnist.log
    MNIST_LINE="$verdict; report: mnist-report.json"
fi

if path=$(binary example replay); then
    if "$path" --help 2>&1 | grep -q -- '--device'; then
        run_step replay "$path" --device cuda --runs 3 --json "$OUT/replay.json" --svg "$OUT/replay-cuda.svg"
        if [ $? -eq 0 ]; then verdict=pass; else verdict=fail; fi
        record replay "$verdict" "$STEP_SECONDS" "" "" "" logs/replay.log
    else
        record replay skip 0 "" "" "" "the replay example has no --device option (simulated device only)"
    fi
else
    record replay skip 0 "" "" "" "not in the bundle"
fi

for path in "$WORK"/bin/bench-*; do
    [ -e "$path" ] || continue
    name=${path##*/bench-}
    run_step "bench-$name" "$path" --bench
    if [ $? -eq 0 ]; then verdict=pass; else verdict=fail; fi
    record "bench-$name" "$verdict" "$STEP_SECONDS" "" "" "" "logs/bench-$name.log"
done

# --- summary ------------------------------------------------------------------------------------
{
    echo "# GPU check"
    echo
    echo '```'
    cat "$OUT/BUILD-INFO" 2>/dev/null
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null ||
        echo "nvidia-smi unavailable"
    echo '```'
    echo
    echo "| step | status | seconds | passed | failed | ignored | log |"
    echo "|---|---|---|---|---|---|---|"
    tail -n +2 "$RESULTS" | awk -F'\t' '{printf "| %s | %s | %s | %s | %s | %s | %s |\n", $1, $2, $3, $4, $5, $6, $7}'
    echo
    echo "- CubeCL conformance on CachingCudaRuntime: $CONFORMANCE"
    echo "- MNIST --compare (caching-cuda vs cuda): $MNIST_LINE"
    if [ -s "$OUT/logs/mnist.log" ]; then
        echo
        echo '```'
        tail -n 40 "$OUT/logs/mnist.log"
        echo '```'
    fi
    if grep -q '^| trace | allocator' "$OUT/logs/replay.log" 2>/dev/null; then
        echo
        echo "Replay on the CUDA device (real cuMemAlloc/cuMemFree):"
        echo
        grep '^|' "$OUT/logs/replay.log"
    fi
    if [ -s "$OUT/conformance-failures.txt" ]; then
        echo
        echo "Conformance failures:"
        echo '```'
        head -n 50 "$OUT/conformance-failures.txt"
        echo '```'
    fi
    echo
    echo "Failed test binaries: $FAILED_TESTS"
} >"$SUMMARY"
say "summary written to $SUMMARY"
[ "$FAILED_TESTS" -eq 0 ]
