#!/usr/bin/env bash
# Applies patches/<crate>+<version>.patch to a copy of each registry crate under
# target/patch/<crate>-<version>/, where [patch.crates-io] points: what `cargo patch-crate`
# does, with cargo and GNU patch alone (patch-crate takes 11 minutes to install on two cores and needs
# `--locked` on rustc 1.95). Run from anywhere; safe to run again (the copies are remade).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cd "$here"
cargo_home=${CARGO_HOME:-$HOME/.cargo}

# The crates to patch, downloaded into the registry. Not by `cargo fetch` here: on a fresh
# clone [patch.crates-io] points at copies that do not exist yet, and cargo refuses to resolve.
# A throwaway manifest that names them at the patches' versions fetches them instead.
fetcher=$(mktemp -d)
trap 'rm -rf "$fetcher"' EXIT
mkdir "$fetcher/src"
: > "$fetcher/src/lib.rs"
{
    printf '[package]\nname = "fetch-crates-to-patch"\nversion = "0.0.0"\nedition = "2021"\n'
    printf '[workspace]\n[dependencies]\n'
    for patch in patches/*.patch; do
        name=$(basename "$patch" .patch)    # cubecl-wgpu+0.11.3
        printf '%s = { version = "=%s", default-features = false }\n' "${name%+*}" "${name#*+}"
    done
} > "$fetcher/Cargo.toml"
cargo fetch --quiet --manifest-path "$fetcher/Cargo.toml"

mkdir -p target/patch
for patch in patches/*.patch; do
    name=$(basename "$patch" .patch)
    crate=${name%+*}
    version=${name#*+}
    source=$(ls -d "$cargo_home"/registry/src/*/"$crate-$version" 2>/dev/null | head -n 1)
    [[ -n "$source" ]] || { echo "apply-patches: $crate $version is not in $cargo_home/registry/src" >&2; exit 1; }
    target="target/patch/$crate-$version"
    rm -rf "$target"
    cp -r "$source" "$target"
    patch --quiet --forward -p1 -d "$target" < "$patch"
    echo "apply-patches: $crate $version patched"
done
# Everything else the example's Cargo.lock pins, now that [patch.crates-io] resolves.
cargo fetch --quiet
