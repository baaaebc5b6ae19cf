#!/usr/bin/env bash
# Runs the patches' own tests on the patched crates (after `cargo patch-crate`). Each crate is
# copied out of the repository first: inside it, Cargo takes the crate for a member of the root
# workspace (whose members include "."), which it is not. Copies in $TMPDIR/burn-022-patched/,
# artifacts in target/patched-tests/.
#   ./test-patches.sh        cubecl-server's unit test, cubecl-wgpu's test (needs an adapter:
#                            lavapipe will do, VK_ICD_FILENAMES=.../lvp_icd.x86_64.json)
#   ./test-patches.sh cuda   also cubecl-cuda's storage test (no GPU needed, but cubecl-cuda
#                            0.11.3 builds cubecl-llvm, whose build script downloads LLVM)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
src="${TMPDIR:-/tmp}/burn-022-patched"
export CARGO_TARGET_DIR="$here/target/patched-tests"
rm -rf "$src" && mkdir -p "$src"
cp -r "$here"/target/patch/cubecl-{server,wgpu,cuda}-0.11.3 "$src/"
server="patch.crates-io.cubecl-server.path=\"$src/cubecl-server-0.11.3\""
(cd "$src/cubecl-server-0.11.3" && cargo test --lib storage::external)
(cd "$src/cubecl-wgpu-0.11.3" && cargo test --config "$server" --test external_allocator)
if [[ "${1:-}" == cuda ]]; then
    (cd "$src/cubecl-cuda-0.11.3" && cargo test --config "$server" --lib external_allocator)
fi
