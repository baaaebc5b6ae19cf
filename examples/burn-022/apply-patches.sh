#!/usr/bin/env bash
# Applies patches/<crate>+<version>.patch to a copy of each registry crate under
# target/patch/<crate>-<version>/, where [patch.crates-io] points: what `cargo patch-crate`
# does, with cargo and GNU patch alone (patch-crate takes 11 minutes to install on two cores and needs
# `--locked` on rustc 1.95). Run from anywhere; safe to run again (the copies are remade).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cd "$here"
# The crates as Cargo.lock pins them, downloaded into the registry.
cargo fetch --quiet
registry=$(ls -d "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/ | head -n 1)
mkdir -p target/patch
for patch in patches/*.patch; do
    name=$(basename "$patch" .patch)    # cubecl-wgpu+0.11.3
    crate=${name%+*}
    version=${name#*+}
    source="$registry/$crate-$version"
    [[ -d "$source" ]] || { echo "apply-patches: $crate $version is not in $registry" >&2; exit 1; }
    target="target/patch/$crate-$version"
    rm -rf "$target"
    cp -r "$source" "$target"
    patch --quiet --forward -p1 -d "$target" < "$patch"
    echo "apply-patches: $crate $version patched"
done
