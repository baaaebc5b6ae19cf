//! Whether this run is CI, where a missing wgpu adapter is a failure instead of a skip.

/// `CI` set to anything but empty, `0` or `false` (in any case): CI services set `CI=true`,
/// some `CI=1` or `CI=True`.
pub fn is_ci() -> bool {
    std::env::var_os("CI").is_some_and(|value| {
        let value = value.to_string_lossy();
        let value = value.trim();
        !(value.is_empty() || value == "0" || value.eq_ignore_ascii_case("false"))
    })
}
