//! Where NVRTC finds CUDA's headers, checked when the device opens.
//!
//! CubeCL's CUDA C++ includes `cuda_fp16.h`, `cuda_bf16.h` and CCCL's headers, which ship with
//! the CUDA toolkit, not with the driver. Without them every kernel fails to compile at its
//! first launch, deep inside a training step; so the device refuses to open instead, naming
//! `CUDA_PATH` and where it looked. The roots are `cubecl-cuda`'s (`install::cuda_path`):
//! `$CUDA_PATH` when set, else `/usr/local/cuda`, `/opt/cuda`, `/usr`; in each, `include/` and
//! the toolkit's per-target `targets/x86_64-linux/include/`.

use std::path::{Path, PathBuf};

use crate::runtime::DriverError;

/// The header every CubeCL CUDA kernel may include.
pub const PROBE_HEADER: &str = "cuda_fp16.h";

/// Roots tried when `CUDA_PATH` is not set, in order.
pub const DEFAULT_ROOTS: [&str; 3] = ["/usr/local/cuda", "/opt/cuda", "/usr"];

/// The folders to pass to NVRTC with `--include-path`: the one that holds
/// [`PROBE_HEADER`], and CCCL's beside it when present.
pub fn find_include_dirs(
    cuda_path: Option<&Path>,
    default_roots: &[&str],
) -> Result<Vec<PathBuf>, DriverError> {
    let roots: Vec<PathBuf> = match cuda_path {
        Some(root) => vec![root.to_path_buf()],
        None => default_roots.iter().map(PathBuf::from).collect(),
    };
    let mut looked = Vec::new();
    for root in &roots {
        for include in [
            root.join("include"),
            root.join("targets/x86_64-linux/include"),
        ] {
            if include.join(PROBE_HEADER).is_file() {
                let mut dirs = vec![include.clone()];
                let cccl = include.join("cccl");
                if cccl.is_dir() {
                    dirs.push(cccl);
                }
                return Ok(dirs);
            }
            looked.push(include.display().to_string());
        }
    }
    let source = match cuda_path {
        Some(root) => format!("CUDA_PATH={}", root.display()),
        None => "CUDA_PATH is not set".to_string(),
    };
    Err(DriverError::Unsupported {
        api: "NVRTC",
        reason: format!(
            "CUDA's headers ({PROBE_HEADER}) were not found ({source}; looked in {}): kernels \
             cannot compile. Install the CUDA toolkit's headers and set CUDA_PATH to its root \
             (the folder holding include/{PROBE_HEADER}), e.g. CUDA_PATH=/usr/local/cuda",
            looked.join(", ")
        ),
    })
}

/// [`find_include_dirs`] for this process: `CUDA_PATH` from the environment.
pub fn include_dirs() -> Result<Vec<PathBuf>, DriverError> {
    let cuda_path = std::env::var_os("CUDA_PATH").map(PathBuf::from);
    find_include_dirs(cuda_path.as_deref(), &DEFAULT_ROOTS)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_root(name: &str) -> PathBuf {
        let root = std::env::temp_dir().join(format!(
            "burn-caching-alloc-headers-{name}-{}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(&root).expect("temp dir");
        root
    }

    #[test]
    fn missing_headers_name_cuda_path_and_every_folder_looked_in() {
        let root = temp_root("missing");
        let err = find_include_dirs(Some(&root), &DEFAULT_ROOTS).expect_err("no headers");
        let text = err.to_string();
        assert!(text.contains("CUDA_PATH="), "{text}");
        assert!(
            text.contains(&root.join("include").display().to_string()),
            "{text}"
        );
        assert!(
            text.contains(
                &root
                    .join("targets/x86_64-linux/include")
                    .display()
                    .to_string()
            ),
            "{text}"
        );
        // Without CUDA_PATH the default roots are listed.
        let err = find_include_dirs(None, &[root.to_str().expect("utf-8")]).expect_err("none");
        assert!(err.to_string().contains("CUDA_PATH is not set"), "{err}");
        let _ = std::fs::remove_dir_all(&root);
    }

    #[test]
    fn the_toolkit_layout_and_the_per_target_layout_are_both_found() {
        let root = temp_root("found");
        let target = root.join("targets/x86_64-linux/include");
        std::fs::create_dir_all(target.join("cccl")).expect("dirs");
        std::fs::write(target.join(PROBE_HEADER), "").expect("header");
        assert_eq!(
            find_include_dirs(Some(&root), &[]).expect("found"),
            vec![target.clone(), target.join("cccl")]
        );
        // `include/` wins when both exist.
        let include = root.join("include");
        std::fs::create_dir_all(&include).expect("dirs");
        std::fs::write(include.join(PROBE_HEADER), "").expect("header");
        assert_eq!(
            find_include_dirs(Some(&root), &[]).expect("found"),
            vec![include]
        );
        let _ = std::fs::remove_dir_all(&root);
    }
}
