//! Keeps the Wayland client library quiet on a machine without a display.
//!
//! Mesa installs an implicit Vulkan layer, `VK_LAYER_MESA_device_select`, which the Vulkan
//! loader puts under every instance (wgpu's, CubeCL's, ours). When devices are enumerated it
//! calls `wl_display_connect` to see whether a Wayland compositor prefers a GPU; without
//! `XDG_RUNTIME_DIR`, `libwayland-client` prints
//! `error: XDG_RUNTIME_DIR is invalid or not set in the environment.` to stderr (twice per
//! enumeration) before failing, which it would have done anyway: there is no compositor. On a
//! headless machine (a server, a container, CI with lavapipe) those are the first lines the
//! user sees, and they look like our failure. [`ensure_xdg_runtime_dir`] points the variable
//! at a fresh, empty, private folder when it is unset or not a folder, so the connection
//! fails quietly. The layer still runs (`NODEVICE_SELECT=1` would remove it, and with it the
//! device order it gives multi-GPU machines); Vulkan drivers and CUDA never read the variable.

use std::path::{Path, PathBuf};

/// The variable libwayland reads.
pub const XDG_RUNTIME_DIR: &str = "XDG_RUNTIME_DIR";

/// A private runtime folder made by [`ensure_xdg_runtime_dir`]; dropping it removes the
/// folder (it stays empty: nothing listens on a socket there).
#[derive(Debug)]
pub struct PrivateRuntimeDir {
    path: PathBuf,
}

impl PrivateRuntimeDir {
    /// The folder `XDG_RUNTIME_DIR` now names.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for PrivateRuntimeDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir(&self.path);
    }
}

/// Whether `value` names an existing folder, as libwayland requires of `XDG_RUNTIME_DIR`.
pub fn is_valid_runtime_dir(value: Option<&std::ffi::OsStr>) -> bool {
    value.is_some_and(|v| !v.is_empty() && Path::new(v).is_dir())
}

/// Sets `XDG_RUNTIME_DIR` to a new folder only this user can enter (mode 0700, under the
/// system's temporary folder) when it is unset or does not name a folder, and returns that
/// folder; `None` when the variable was already usable or the folder could not be made
/// (then nothing changes but the message). Not on Unix: does nothing.
///
/// # Safety
///
/// Changes the process environment: call it before any other thread starts (first thing in
/// `main`), as [`std::env::set_var`] requires.
pub unsafe fn ensure_xdg_runtime_dir() -> Option<PrivateRuntimeDir> {
    if !cfg!(unix) || is_valid_runtime_dir(std::env::var_os(XDG_RUNTIME_DIR).as_deref()) {
        return None;
    }
    let path = make_private_dir()?;
    // SAFETY: the caller guarantees no other thread runs yet.
    unsafe { std::env::set_var(XDG_RUNTIME_DIR, &path) };
    Some(PrivateRuntimeDir { path })
}

#[cfg(unix)]
fn make_private_dir() -> Option<PathBuf> {
    use std::os::unix::fs::DirBuilderExt;
    let base = std::env::temp_dir();
    let pid = std::process::id();
    // `create` (not `create_all`) fails on an existing path, so the folder is always ours.
    (0..16).find_map(|attempt| {
        let path = base.join(format!("mnist-xdg-runtime-{pid}-{attempt}"));
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(&path)
            .ok()
            .map(|()| path)
    })
}

#[cfg(not(unix))]
fn make_private_dir() -> Option<PathBuf> {
    None
}

#[cfg(test)]
mod tests {
    use super::is_valid_runtime_dir;
    use std::ffi::OsStr;

    #[test]
    fn only_an_existing_folder_is_a_valid_runtime_dir() {
        assert!(!is_valid_runtime_dir(None));
        assert!(!is_valid_runtime_dir(Some(OsStr::new(""))));
        assert!(!is_valid_runtime_dir(Some(OsStr::new(
            "/nonexistent/mnist-xdg-test"
        ))));
        let file = env!("CARGO_MANIFEST_DIR").to_string() + "/Cargo.toml";
        assert!(!is_valid_runtime_dir(Some(OsStr::new(&file))));
        assert!(is_valid_runtime_dir(Some(OsStr::new(env!(
            "CARGO_MANIFEST_DIR"
        )))));
    }
}
