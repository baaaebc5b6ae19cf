//! The `--devices` names: which wgpu devices a process trains on, one peer each.

use burn::backend::wgpu::WgpuDevice;

/// A name that is not a wgpu device.
#[derive(Debug, thiserror::Error, PartialEq)]
#[error(
    "unknown device {0:?}: expected default, cpu, discrete:N, integrated:N or virtual:N \
     (N a number)"
)]
pub struct DeviceNameError(pub String);

/// The device a name stands for: `default`, `cpu`, `discrete:N`, `integrated:N`, `virtual:N`.
pub fn parse(name: &str) -> Result<WgpuDevice, DeviceNameError> {
    let error = || DeviceNameError(name.to_string());
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
            assert_eq!(parse(bad), Err(DeviceNameError(bad.to_string())));
        }
    }
}
