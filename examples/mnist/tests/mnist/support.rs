//! The wgpu device the training tests run on, or why they skip.

use burn::backend::wgpu::WgpuDevice;
use burn_caching_alloc::wgpu::adapter_available;

/// Whether `CI` asks for failures instead of skips: set, non-empty, and neither `0` nor
/// `false`.
pub fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| !v.is_empty() && v != "0" && !v.eq_ignore_ascii_case("false"))
}

/// Points `XDG_RUNTIME_DIR` at a private folder under Cargo's test scratch folder when it is
/// unset or not a folder, as the binary does (see `mnist::headless`): without it, Mesa's Vulkan
/// device-select layer has libwayland print `error: XDG_RUNTIME_DIR is invalid ...` twice
/// whenever devices are enumerated.
#[cfg(unix)]
fn quiet_headless_wayland() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        if mnist::headless::is_valid_runtime_dir(std::env::var_os("XDG_RUNTIME_DIR").as_deref()) {
            return;
        }
        use std::os::unix::fs::PermissionsExt;
        let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("mnist-xdg-runtime");
        let made = std::fs::create_dir_all(&dir)
            .and_then(|()| std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)));
        if made.is_ok() {
            // SAFETY: this runs once, before the first wgpu call of this test binary (the only
            // code in it that reads the environment through libc; the other tests only read
            // and write files, and Rust's own reads take the lock `set_var` takes).
            unsafe { std::env::set_var("XDG_RUNTIME_DIR", &dir) };
        }
    });
}

/// Nothing to quiet off Unix.
#[cfg(not(unix))]
fn quiet_headless_wayland() {}

/// The device `mnist::train_on` trains the wgpu backends on (`DefaultDevice`: a GPU, or
/// lavapipe on a CPU), or `None` with the reason printed when it has no adapter. Under CI
/// (see [`in_ci`]) a missing adapter fails the test instead: CI proves the whole stack.
pub fn wgpu_device() -> Option<WgpuDevice> {
    quiet_headless_wayland();
    let device = WgpuDevice::DefaultDevice;
    if adapter_available(&device) {
        return Some(device);
    }
    let reason = "no wgpu adapter (on a CPU, install Mesa's lavapipe: apt-get install \
                  mesa-vulkan-drivers)";
    assert!(!in_ci(), "{reason}; CI is set, so this is a failure");
    eprintln!("skipping: {reason}");
    None
}
