#!/usr/bin/env bash
# Builds, here, everything scripts/gpu-check.sh runs on the GPU machine (CUDA 13 and a driver,
# but no Rust toolchain and no network), and packs it into the git-ignored gpu-bundle/ folder:
#
#   gpu-bundle/bundle.tar.xz   stripped test, example and benchmark binaries (xz-compressed)
#   gpu-bundle/manifest.tsv    kind, name, path in the archive, bytes, sha256 of every binary
#   gpu-bundle/BUILD-INFO      commit, toolchain, CUDA version, features, build time, and
#                              `conformance_tests: N`, the suite's test count gpu-check.sh requires
#
# The device tool carries the working tree and the carried gpu-bundle/ together, 64 MiB in
# all: this script fails if the two together are larger. It also fails if CubeCL's conformance
# suite does not build: a GPU check without it proves too little.
# Binaries are built with the `gpu-bundle` profile (release, no debug info, stripped) into
# target/gpu-bundle/, against CUDA 13.0's API (CUDARC_CUDA_VERSION=13000; override it to match
# another machine). Missing pieces (an example not written yet) are skipped with a message.
#
# Usage: scripts/gpu-bundle.sh            (from anywhere in the repository)
# Env:   CUDARC_CUDA_VERSION (default 13000), GPU_BUNDLE_FEATURES (default "cuda"),
#        GPU_BUNDLE_MAX_MIB (default 64)
#
# The MNIST data travels with the working tree (examples/mnist/data), so the bundle holds none.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"

export CUDARC_CUDA_VERSION=${CUDARC_CUDA_VERSION:-13000}
FEATURES=${GPU_BUNDLE_FEATURES:-cuda}
MAX_MIB=${GPU_BUNDLE_MAX_MIB:-64}
PROFILE=gpu-bundle
BUNDLE="$ROOT/gpu-bundle"
STAGE=$(mktemp -d)
trap 'rm -rf "$STAGE"' EXIT
mkdir -p "$STAGE/bin"
START=$(date +%s)

log() { printf '[gpu-bundle] %s\n' "$*" >&2; }

# The root crate's test binaries that hold GPU tests (each test skips with a printed reason
# without a GPU): `runtime` has the CUDA backend's tests; `cuda_fake` the tests CI runs under
# the fake CUDA driver, run on the real one there (gpu-check.sh sets BURN_CACHING_ALLOC_REAL_CUDA).
GPU_TESTS=(runtime cuda_fake)
# The programs run on the GPU machine: name and the cargo target that builds it.
PROGRAMS=(
    "seed_walkthrough|-p burn-caching-alloc --example seed_walkthrough"
    "mnist|-p mnist --bin mnist"
    "replay|-p replay --bin replay"
    "burn-side-by-side|-p bench-burn --bin burn-side-by-side"
)

# Runs cargo with JSON messages; prints "name<TAB>executable" for each built test/bench/example.
# Usage: executables SUBCOMMAND [ARGS...] (cargo's own options go before any `--`).
executables() {
    local subcommand=$1
    shift
    cargo "$subcommand" --profile "$PROFILE" --no-default-features --features "$FEATURES" \
        --message-format=json-render-diagnostics "$@" |
        python3 -c '
import json, sys
for line in sys.stdin:
    try:
        msg = json.loads(line)
    except ValueError:
        continue
    if msg.get("reason") == "compiler-artifact" and msg.get("executable"):
        print(msg["target"]["name"] + "\t" + msg["executable"])
'
}

# Copies one built binary into the stage as bin/<kind>-<name> and records it.
MANIFEST="$STAGE/manifest.tsv"
printf 'kind\tname\tfile\tbytes\tsha256\n' >"$MANIFEST"
add_binary() { # kind name path
    local kind=$1 name=$2 path=$3 dest="bin/$1-$2"
    [ -n "$path" ] || return 0
    cp "$path" "$STAGE/$dest"
    strip --strip-unneeded "$STAGE/$dest" 2>/dev/null || true
    printf '%s\t%s\t%s\t%s\t%s\n' "$kind" "$name" "$dest" \
        "$(stat -c %s "$STAGE/$dest")" "$(sha256sum "$STAGE/$dest" | cut -d' ' -f1)" >>"$MANIFEST"
    log "added $dest ($(du -h "$STAGE/$dest" | cut -f1))"
}

# 1. Library unit tests and the GPU integration tests, in one cargo call.
test_args=(test --no-run -p burn-caching-alloc --lib)
for name in "${GPU_TESTS[@]}"; do test_args+=(--test "$name"); done
log "building tests: lib ${GPU_TESTS[*]} (features: $FEATURES, CUDA API $CUDARC_CUDA_VERSION)"
out=$(executables "${test_args[@]}")
while IFS=$'\t' read -r name exe; do
    [ "$name" = burn_caching_alloc ] && name=lib
    add_binary test "$name" "$exe"
done <<<"$out"

# 2. CubeCL's conformance suite, compiled in only with --cfg gpu_conformance (for this crate).
#    A suite that does not build fails the bundle: a GPU check without it proves too little.
log "building the conformance suite (cfg gpu_conformance)"
if ! out=$(executables rustc -p burn-caching-alloc --test conformance_cuda -- --cfg gpu_conformance); then
    log "ERROR: the conformance suite does not build (see cargo's messages above)"
    exit 1
fi
while IFS=$'\t' read -r name exe; do add_binary test "$name" "$exe"; done <<<"$out"
if [ ! -x "$STAGE/bin/test-conformance_cuda" ]; then
    log "ERROR: cargo built no conformance_cuda test binary"
    exit 1
fi
# Listing runs no test and needs no GPU. A build without the cfg lists no test: at least two
# tests must be listed.
CONFORMANCE_TESTS=$("$STAGE/bin/test-conformance_cuda" --list 2>/dev/null | grep -c ': test$' || true)
if [ "${CONFORMANCE_TESTS:-0}" -lt 2 ]; then
    log "ERROR: the conformance binary lists ${CONFORMANCE_TESTS:-0} tests: built without --cfg gpu_conformance?"
    exit 1
fi
log "conformance suite: $CONFORMANCE_TESTS tests"

# 3. The programs: the seed walkthrough, the MNIST main job and the replay benchmark.
for program in "${PROGRAMS[@]}"; do
    read -r -a target <<<"${program#*|}"
    out=$(executables build "${target[@]}")
    while IFS=$'\t' read -r built exe; do add_binary example "$built" "$exe"; done <<<"$out"
done

# 4. Pack: binaries compressed together, data copied as is (already gzipped).
rm -rf "$BUNDLE"
mkdir -p "$BUNDLE"
log "compressing $(du -sh "$STAGE/bin" | cut -f1) of binaries with xz"
# -9: a 64 MiB dictionary, so that the binaries' shared code (Burn, CubeCL, cudarc in every
# one) compresses once across files; a stripped binary is about 45 MiB, 7 MiB after xz -6.
tar -C "$STAGE" -cf - bin manifest.tsv | xz -T0 -9 >"$BUNDLE/bundle.tar.xz"
cp "$MANIFEST" "$BUNDLE/manifest.tsv"
END=$(date +%s)
{
    echo "commit: $(git rev-parse HEAD 2>/dev/null || echo none) $(git status --porcelain 2>/dev/null | grep -q . && echo '(uncommitted changes)')"
    echo "built: $(date -u +%Y-%m-%dT%H:%M:%SZ) in $((END - START)) s"
    echo "rustc: $(rustc --version)"
    echo "profile: $PROFILE; features: $FEATURES; CUDARC_CUDA_VERSION=$CUDARC_CUDA_VERSION"
    echo "conformance_tests: $CONFORMANCE_TESTS"
} >"$BUNDLE/BUILD-INFO"

column -t -s $'\t' "$BUNDLE/manifest.tsv" >&2 || cat "$BUNDLE/manifest.tsv" >&2
# What travels: the working tree (tracked files and untracked ones git does not ignore) and
# the carried bundle.
BUNDLE_BYTES=$(du -sb "$BUNDLE" | cut -f1)
TREE_BYTES=$(git ls-files -z --cached --others --exclude-standard |
    du -cb --files0-from=- 2>/dev/null | tail -n 1 | cut -f1)
TOTAL_BYTES=$((BUNDLE_BYTES + TREE_BYTES))
mib() { echo $((($1 + 1048575) / 1048576)); }
log "travels: working tree $(mib "$TREE_BYTES") MiB + bundle $(mib "$BUNDLE_BYTES") MiB = $(mib "$TOTAL_BYTES") MiB of $MAX_MIB MiB; built in $((END - START)) s"
echo "travels: $TOTAL_BYTES bytes (tree $TREE_BYTES + bundle $BUNDLE_BYTES) of $MAX_MIB MiB" >>"$BUNDLE/BUILD-INFO"
if [ "$TOTAL_BYTES" -gt $((MAX_MIB * 1048576)) ]; then
    log "ERROR: the working tree and the bundle are over $MAX_MIB MiB together; the device tool cannot carry them"
    exit 1
fi
