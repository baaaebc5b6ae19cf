#!/usr/bin/env bash
# Checks scripts/gpu-check.sh without a GPU: its dry run, and its verdicts on a fake bundle
# whose "binaries" are shell scripts printing what libtest prints (a missing conformance pass
# count, a test that skipped, a step that hangs). CI runs it; it takes a few seconds.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
fails=0
check() { # description, then a command that must succeed
    local what=$1
    shift
    if "$@"; then echo "ok: $what"; else
        echo "FAILED: $what"
        fails=$((fails + 1))
    fi
}
status_of() { awk -F'\t' -v s="$2" '$1 == s {print $2}' "$1/results.tsv"; }
note_of() { awk -F'\t' -v s="$2" '$1 == s {print $7}' "$1/results.tsv"; }
top_files() { find "$1" -mindepth 1 -maxdepth 1 | wc -l; }

# --- 1. the dry run: every step skipped with why, the same files, exit 0 ------------------------
out="$TMP/dry"
start=$(date +%s)
GPU_CHECK_DRY_RUN=1 OUT="$out" GPU_BUNDLE_DIR="$TMP/none" "$ROOT/scripts/gpu-check.sh" 2>/dev/null
check "dry run exits 0 in under two minutes" test $(($(date +%s) - start)) -lt 120
check "dry run writes summary.md, results.tsv, logs.tar.gz" \
    test -s "$out/summary.md" -a -s "$out/results.tsv" -a -s "$out/logs.tar.gz"
check "dry run: seven steps, every one skipped with a reason" \
    test "$(tail -n +2 "$out/results.tsv" | awk -F'\t' '$2 == "skip" && $7 != ""' | wc -l)" -eq 7

# --- 2. a fake bundle -----------------------------------------------------------------------------
make_bundle() { # dir conformance_passed expected
    local dir=$1 passed=$2 expected=$3 stage="$1/stage"
    mkdir -p "$stage/bin"
    printf '#!/bin/sh\necho "test a ... ok"\necho "test result: ok. 4 passed; 0 failed; 2 ignored; 0 measured"\n' >"$stage/bin/test-lib"
    printf '#!/bin/sh\necho "skipping: no CUDA driver library"\necho "test result: ok. 7 passed; 0 failed; 0 ignored"\n' >"$stage/bin/test-runtime"
    printf '#!/bin/sh\necho "test result: ok. %s passed; 0 failed; 0 ignored"\n' "$passed" >"$stage/bin/test-conformance_cuda"
    printf '#!/bin/sh\nsleep 30\n' >"$stage/bin/example-seed_walkthrough"
    printf '#!/bin/sh\necho "usage: replay [--runs N]"\n' >"$stage/bin/example-replay"
    chmod +x "$stage"/bin/*
    printf 'kind\tname\tfile\tbytes\tsha256\n' >"$stage/manifest.tsv"
    for f in "$stage"/bin/*; do
        printf 'x\tx\tbin/%s\t0\t%s\n' "${f##*/}" "$(sha256sum "$f" | cut -d' ' -f1)" >>"$stage/manifest.tsv"
    done
    tar -C "$stage" -cf - bin manifest.tsv | xz >"$dir/bundle.tar.xz"
    printf 'commit: fake\nconformance_tests: %s\n' "$expected" >"$dir/BUILD-INFO"
}

make_bundle "$TMP/short" 3 5
out="$TMP/short-out"
set +e
GPU_CHECK_FORCE=1 STEP_TIMEOUT=2 OUT="$out" GPU_BUNDLE_DIR="$TMP/short" "$ROOT/scripts/gpu-check.sh" 2>/dev/null
rc=$?
set -e
check "a failed step makes the exit status 1" test "$rc" -eq 1
check "test-lib passes with its counts" test "$(status_of "$out" test-lib)" = pass
check "a test that skipped in a GPU run fails its step" test "$(status_of "$out" test-runtime)" = fail
check "fewer conformance passes than the bundle holds fail the step" \
    test "$(status_of "$out" conformance_cuda)" = fail
check "the conformance note gives both counts" grep -q '3 passed + 0 ignored, 5 expected' "$out/results.tsv"
check "a hung step times out and fails" test "$(note_of "$out" seed_walkthrough)" = "timed out; logs/seed_walkthrough.log"
check "a replay without --device is skipped, saying so" test "$(status_of "$out" replay)" = skip
check "mnist missing from the bundle is skipped" test "$(note_of "$out" mnist)" = "not in the bundle"
check "at most 8 files come back" test "$(top_files "$out")" -le 8
check "every step's log is in logs.tar.gz" \
    test "$(tar tzf "$out/logs.tar.gz" | grep -c -E 'logs/(test-lib|test-runtime|conformance_cuda|seed_walkthrough)\.log')" -eq 4

make_bundle "$TMP/zero" 0 0
out="$TMP/zero-out"
GPU_CHECK_FORCE=1 STEP_TIMEOUT=2 OUT="$out" GPU_BUNDLE_DIR="$TMP/zero" "$ROOT/scripts/gpu-check.sh" 2>/dev/null || true
check "no conformance test passing fails the step" \
    test "$(note_of "$out" conformance_cuda)" = "no conformance test passed"

make_bundle "$TMP/full" 5 5
out="$TMP/full-out"
GPU_CHECK_FORCE=1 STEP_TIMEOUT=2 SKIP_STEPS="seed_walkthrough" OUT="$out" GPU_BUNDLE_DIR="$TMP/full" \
    "$ROOT/scripts/gpu-check.sh" 2>/dev/null || true
check "all expected conformance passes pass the step" test "$(status_of "$out" conformance_cuda)" = pass
check "SKIP_STEPS leaves a step out, saying so" test "$(note_of "$out" seed_walkthrough)" = SKIP_STEPS

if [ "$fails" -gt 0 ]; then
    echo "gpu-check self-test: $fails check(s) failed"
    exit 1
fi
echo "gpu-check self-test: all checks passed"
