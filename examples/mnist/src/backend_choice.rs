//! Which backend the MNIST showcase trains on, and whether it can run here.

use std::fmt;
use std::str::FromStr;

/// A backend the showcase can train on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BackendChoice {
    /// `caching-cuda` if a CUDA device is present, else `caching-wgpu`.
    Auto,
    /// This crate's allocator under CubeCL's CUDA runtime.
    CachingCuda,
    /// Burn's stock CUDA backend (CubeCL's default pool).
    Cuda,
    /// This crate's allocator under CubeCL's wgpu runtime.
    CachingWgpu,
    /// Burn's stock wgpu backend (CubeCL's default pool).
    Wgpu,
}

impl BackendChoice {
    /// Every choice, in command-line order.
    pub const ALL: [BackendChoice; 5] = [
        BackendChoice::Auto,
        BackendChoice::CachingCuda,
        BackendChoice::Cuda,
        BackendChoice::CachingWgpu,
        BackendChoice::Wgpu,
    ];

    /// The command-line spelling.
    pub fn name(self) -> &'static str {
        match self {
            BackendChoice::Auto => "auto",
            BackendChoice::CachingCuda => "caching-cuda",
            BackendChoice::Cuda => "cuda",
            BackendChoice::CachingWgpu => "caching-wgpu",
            BackendChoice::Wgpu => "wgpu",
        }
    }

    /// Whether this is one of the caching backends.
    pub fn is_caching(self) -> bool {
        matches!(
            self,
            BackendChoice::CachingCuda | BackendChoice::CachingWgpu
        )
    }

    /// The stock backend over the same driver (for `--compare`).
    pub fn stock_counterpart(self) -> BackendChoice {
        match self {
            BackendChoice::CachingCuda | BackendChoice::Cuda => BackendChoice::Cuda,
            BackendChoice::CachingWgpu | BackendChoice::Wgpu => BackendChoice::Wgpu,
            BackendChoice::Auto => BackendChoice::Auto,
        }
    }

    /// The caching backend over the same driver (for `--compare`).
    pub fn caching_counterpart(self) -> BackendChoice {
        match self {
            BackendChoice::CachingCuda | BackendChoice::Cuda => BackendChoice::CachingCuda,
            BackendChoice::CachingWgpu | BackendChoice::Wgpu => BackendChoice::CachingWgpu,
            BackendChoice::Auto => BackendChoice::Auto,
        }
    }

    /// Replaces `Auto` by `caching-cuda` when `cuda_present`, else `caching-wgpu`.
    pub fn resolve(self, cuda_present: bool) -> BackendChoice {
        match self {
            BackendChoice::Auto if cuda_present => BackendChoice::CachingCuda,
            BackendChoice::Auto => BackendChoice::CachingWgpu,
            other => other,
        }
    }

    /// The Cargo feature this backend needs.
    pub fn feature(self) -> Option<&'static str> {
        match self {
            BackendChoice::Auto => None,
            BackendChoice::CachingCuda | BackendChoice::Cuda => Some("cuda"),
            BackendChoice::CachingWgpu | BackendChoice::Wgpu => Some("wgpu"),
        }
    }

    /// Whether the backend's feature was compiled in.
    pub fn compiled_in(self) -> bool {
        match self.feature() {
            None => true,
            Some("cuda") => cfg!(feature = "cuda"),
            Some(_) => cfg!(feature = "wgpu"),
        }
    }
}

impl fmt::Display for BackendChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Whether the backend fuses kernels (Burn's `Fusion<CubeBackend<..>>`, the default of a Burn
/// user's `Cuda`/`Wgpu`) or runs every operation as its own kernel (the plain `CubeBackend`).
/// Both sides of `--compare` use the same.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Fusion {
    /// `Fusion<CubeBackend<..>>`: Burn's stock `Wgpu`/`Cuda` with default features, and
    /// `CachingWgpu`/`CachingCuda` (needs this crate's `fusion` feature, on by default).
    Fused,
    /// The plain `CubeBackend`: Burn's backends without their `fusion` feature, and
    /// `CachingWgpuUnfused`/`CachingCudaUnfused`.
    Unfused,
}

impl Fusion {
    /// Fused when the `fusion` feature is compiled in (as Burn's defaults are), else unfused.
    pub fn default_for_build() -> Fusion {
        if cfg!(feature = "fusion") {
            Fusion::Fused
        } else {
            Fusion::Unfused
        }
    }

    /// The name a run on `choice` with this fusion setting goes by: `wgpu`, `caching-wgpu`
    /// when fused, `wgpu-unfused`, `caching-wgpu-unfused` when not.
    pub fn run_name(self, choice: BackendChoice) -> String {
        match self {
            Fusion::Fused => choice.name().to_string(),
            Fusion::Unfused => format!("{}-unfused", choice.name()),
        }
    }

    /// Why this setting cannot run in this build, if it cannot.
    pub fn unavailable_reason(self) -> Option<String> {
        (self == Fusion::Fused && !cfg!(feature = "fusion")).then(|| {
            "fused backends need the `fusion` feature (on by default): rebuild with it, or pass \
             --unfused"
                .to_string()
        })
    }
}

/// An unknown backend name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown backend {0:?}; expected one of auto, caching-cuda, cuda, caching-wgpu, wgpu")]
pub struct UnknownBackend(pub String);

impl FromStr for BackendChoice {
    type Err = UnknownBackend;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        BackendChoice::ALL
            .into_iter()
            .find(|c| c.name() == s)
            .ok_or_else(|| UnknownBackend(s.to_string()))
    }
}

/// Whether a CUDA driver is installed and device 0 can be opened: the library's
/// probe, run once per process, which never panics.
#[cfg(feature = "cuda")]
pub fn cuda_device_present() -> bool {
    burn_caching_alloc::cuda::cuda_available().is_ok()
}

/// Whether a CUDA driver is installed and device 0 can be opened (always
/// `false`: this build has no `cuda` feature).
#[cfg(not(feature = "cuda"))]
pub fn cuda_device_present() -> bool {
    false
}

/// Whether wgpu has an adapter for the default device the wgpu backends train on (a GPU, or
/// lavapipe on a CPU), found as the caching runtime finds it.
#[cfg(feature = "wgpu")]
pub fn wgpu_adapter_present() -> bool {
    burn_caching_alloc::wgpu::adapter_available(&burn::backend::wgpu::WgpuDevice::DefaultDevice)
}

/// Whether wgpu finds any adapter (always `false`: this build has no `wgpu` feature).
#[cfg(not(feature = "wgpu"))]
pub fn wgpu_adapter_present() -> bool {
    false
}

/// Why a backend cannot run here, as one line that says what to pick
/// instead; `None` when it can run.
pub fn unavailable_reason(choice: BackendChoice) -> Option<String> {
    let choice = choice.resolve(cuda_device_present());
    if !choice.compiled_in() {
        let feature = choice.feature().unwrap_or("?");
        let other = if feature == "cuda" { "wgpu" } else { "cuda" };
        return Some(format!(
            "backend {choice} is not compiled in: rebuild with `--features {feature}`, or pick --backend {other} / caching-{other}"
        ));
    }
    match choice {
        BackendChoice::CachingCuda | BackendChoice::Cuda if !cuda_device_present() => {
            Some(format!(
                "backend {choice} needs a CUDA device and none was found (no libcuda or no device 0); pick --backend caching-wgpu or wgpu"
            ))
        }
        BackendChoice::CachingWgpu | BackendChoice::Wgpu if !wgpu_adapter_present() => {
            Some(format!(
                "backend {choice} found no wgpu adapter (on a CPU, install Mesa's lavapipe: apt-get install mesa-vulkan-drivers); pick --backend caching-cuda or cuda on a CUDA machine"
            ))
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for choice in BackendChoice::ALL {
            assert_eq!(choice.name().parse::<BackendChoice>(), Ok(choice));
        }
        assert_eq!(
            "caching".parse::<BackendChoice>(),
            Err(UnknownBackend("caching".into()))
        );
    }

    #[test]
    fn auto_prefers_cuda_when_present() {
        assert_eq!(
            BackendChoice::Auto.resolve(true),
            BackendChoice::CachingCuda
        );
        assert_eq!(
            BackendChoice::Auto.resolve(false),
            BackendChoice::CachingWgpu
        );
        assert_eq!(BackendChoice::Wgpu.resolve(true), BackendChoice::Wgpu);
    }

    #[test]
    fn compare_pairs_the_same_driver() {
        for (choice, stock, caching) in [
            (
                BackendChoice::Cuda,
                BackendChoice::Cuda,
                BackendChoice::CachingCuda,
            ),
            (
                BackendChoice::CachingCuda,
                BackendChoice::Cuda,
                BackendChoice::CachingCuda,
            ),
            (
                BackendChoice::Wgpu,
                BackendChoice::Wgpu,
                BackendChoice::CachingWgpu,
            ),
            (
                BackendChoice::CachingWgpu,
                BackendChoice::Wgpu,
                BackendChoice::CachingWgpu,
            ),
        ] {
            assert_eq!(choice.stock_counterpart(), stock);
            assert_eq!(choice.caching_counterpart(), caching);
            assert!(!stock.is_caching() && caching.is_caching());
        }
    }
}
