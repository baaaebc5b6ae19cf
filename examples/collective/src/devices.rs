//! The `--devices` names: which devices a process trains on, one peer each.

use burn::backend::wgpu::WgpuDevice;

/// A name that is not a device of the backend.
#[derive(Debug, thiserror::Error, PartialEq)]
#[error("unknown device {name:?}: expected {expected} (N a number)")]
pub struct DeviceNameError {
    /// The name given.
    pub name: String,
    /// The names the backend takes.
    pub expected: &'static str,
}

/// A device type the command line names.
pub trait DeviceName: Sized {
    /// The device `name` stands for.
    ///
    /// # Errors
    ///
    /// A name that is not one of this device type.
    fn parse(name: &str) -> Result<Self, DeviceNameError>;
}

impl DeviceName for WgpuDevice {
    fn parse(name: &str) -> Result<Self, DeviceNameError> {
        parse(name)
    }
}

/// CUDA devices: `cuda:N` or `N`, the device's index.
#[cfg(feature = "cuda")]
impl DeviceName for burn::backend::cuda::CudaDevice {
    fn parse(name: &str) -> Result<Self, DeviceNameError> {
        let index = name.strip_prefix("cuda:").unwrap_or(name);
        index.parse().map(Self::new).map_err(|_| DeviceNameError {
            name: name.to_string(),
            expected: "cuda:N or N",
        })
    }
}

/// The wgpu device a name stands for: `default`, `cpu`, `discrete:N`, `integrated:N`, `virtual:N`.
pub fn parse(name: &str) -> Result<WgpuDevice, DeviceNameError> {
    let error = || DeviceNameError {
        name: name.to_string(),
        expected: "default, cpu, discrete:N, integrated:N or virtual:N",
    };
    match name {
        "default" => return Ok(WgpuDevice::DefaultDevice),
        "cpu" => return Ok(WgpuDevice::Cpu),
        _ => {}
    }
    let (kind, index) = name.split_once(':').ok_or_else(error)?;
    let index: usize = index.parse().map_err(|_| error())?;
    match kind {
        "discrete" => Ok(WgpuDevice::DiscreteGpu(index)),
        "integrated" => Ok(WgpuDevice::IntegratedGpu(index)),
        "virtual" => Ok(WgpuDevice::VirtualGpu(index)),
        _ => Err(error()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_map_to_wgpu_devices_and_others_are_errors() {
        assert_eq!(parse("cpu"), Ok(WgpuDevice::Cpu));
        assert_eq!(parse("default"), Ok(WgpuDevice::DefaultDevice));
        assert_eq!(parse("discrete:1"), Ok(WgpuDevice::DiscreteGpu(1)));
        assert_eq!(parse("integrated:0"), Ok(WgpuDevice::IntegratedGpu(0)));
        assert_eq!(parse("virtual:2"), Ok(WgpuDevice::VirtualGpu(2)));
        for bad in ["gpu", "discrete", "discrete:x", "cuda:0", ""] {
            assert_eq!(parse(bad).map_err(|e| e.name), Err(bad.to_string()));
        }
    }
}
