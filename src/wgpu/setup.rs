//! Opening a wgpu device for the caching runtime: adapter, device, queue and CubeCL properties.
//!
//! Device properties (supported element types, subgroup sizes, limits) are what cubecl-wgpu
//! itself detects: its feature detection is not exported, so we build a stock `WgpuServer`
//! for the same device id through its public `DeviceService::init`, read its properties and
//! compilation options, and drop it. The probe allocates no memory; it costs one extra wgpu
//! device creation when a device is opened.

use cubecl_common::device::{Device, DeviceId, DeviceService};
use cubecl_common::future::block_on;
use cubecl_core::WgpuCompilationOptions;
use cubecl_core::server::ComputeServer;
use cubecl_ir::DeviceProperties;
use cubecl_wgpu::{AutoGraphicsApi, GraphicsApi, WgpuDevice, WgpuServer};

use crate::runtime::DriverError;

/// What to do when no adapter is found.
const NO_ADAPTER_HINT: &str = "install a Vulkan, Metal or DX12 driver; on a machine without a GPU, \
                               Mesa's lavapipe: apt-get install mesa-vulkan-drivers";

fn no_device(reason: String) -> DriverError {
    DriverError::NoDevice {
        api: "wgpu",
        reason,
        hint: NO_ADAPTER_HINT,
    }
}

/// An opened wgpu device.
pub(super) struct WgpuSetup {
    pub(super) adapter: wgpu::Adapter,
    pub(super) device: wgpu::Device,
    pub(super) queue: wgpu::Queue,
    pub(super) backend: wgpu::Backend,
}

fn instance(backend: wgpu::Backend) -> wgpu::Instance {
    wgpu::Instance::new(wgpu::InstanceDescriptor {
        backends: backend.into(),
        ..wgpu::InstanceDescriptor::new_without_display_handle()
    })
}

fn device_type_matches(device: &WgpuDevice, kind: wgpu::DeviceType) -> Option<bool> {
    Some(match device {
        WgpuDevice::DiscreteGpu(_) => kind == wgpu::DeviceType::DiscreteGpu,
        WgpuDevice::IntegratedGpu(_) => kind == wgpu::DeviceType::IntegratedGpu,
        WgpuDevice::VirtualGpu(_) => kind == wgpu::DeviceType::VirtualGpu,
        WgpuDevice::Cpu => kind == wgpu::DeviceType::Cpu,
        _ => return None,
    })
}

/// `CUBECL_WGPU_DEFAULT_DEVICE` (spelled like a `WgpuDevice`, e.g. `Cpu` or
/// `DiscreteGpu(1)`), which stock cubecl-wgpu also honours for `DefaultDevice`.
fn default_device_override() -> Option<WgpuDevice> {
    let var = std::env::var("CUBECL_WGPU_DEFAULT_DEVICE").ok()?;
    let indexed = |prefix: &str| {
        var.strip_prefix(prefix)?
            .strip_suffix(')')?
            .parse::<usize>()
            .ok()
    };
    if var == "Cpu" {
        Some(WgpuDevice::Cpu)
    } else if let Some(n) = indexed("DiscreteGpu(") {
        Some(WgpuDevice::DiscreteGpu(n))
    } else if let Some(n) = indexed("IntegratedGpu(") {
        Some(WgpuDevice::IntegratedGpu(n))
    } else {
        indexed("VirtualGpu(").map(WgpuDevice::VirtualGpu)
    }
}

/// The adapter `device` names, with the platform's default graphics API.
fn select_adapter(device: &WgpuDevice) -> Result<(wgpu::Adapter, wgpu::Backend), DriverError> {
    #[allow(deprecated)]
    if matches!(
        device,
        WgpuDevice::DefaultDevice | WgpuDevice::BestAvailable
    ) && let Some(device) = default_device_override()
    {
        return select_adapter(&device);
    }
    let backend = AutoGraphicsApi::backend();
    let instance = instance(backend);
    let index = match device {
        WgpuDevice::DiscreteGpu(n) | WgpuDevice::IntegratedGpu(n) | WgpuDevice::VirtualGpu(n) => *n,
        WgpuDevice::Cpu => 0,
        WgpuDevice::Existing(id) => {
            return Err(DriverError::Unsupported {
                api: "wgpu",
                reason: format!(
                    "WgpuDevice::Existing({id}) is a stock cubecl-wgpu setup; the caching \
                     runtime opens its own devices (use Cpu, DiscreteGpu(n), IntegratedGpu(n), \
                     VirtualGpu(n) or DefaultDevice)"
                ),
            });
        }
        _ => {
            let adapter = block_on(instance.request_adapter(&wgpu::RequestAdapterOptions {
                power_preference: wgpu::PowerPreference::HighPerformance,
                force_fallback_adapter: false,
                compatible_surface: None,
            }))
            .map_err(|err| no_device(format!("no adapter for {backend:?}: {err}")))?;
            return Ok((adapter, backend));
        }
    };
    let adapters = block_on(instance.enumerate_adapters(backend.into()));
    let found: Vec<String> = adapters
        .iter()
        .map(|a| format!("{:?} ({:?})", a.get_info().name, a.get_info().device_type))
        .collect();
    adapters
        .into_iter()
        .filter(|a| device_type_matches(device, a.get_info().device_type).unwrap_or(false))
        .nth(index)
        .map(|adapter| (adapter, backend))
        .ok_or_else(|| {
            no_device(format!(
                "no adapter for {device:?} on {backend:?}; found {found:?}"
            ))
        })
}

/// Whether `device` has a wgpu adapter here: the caching runtime can open it. Tests use this to
/// skip (or fail under CI) where there is none.
pub fn adapter_available(device: &WgpuDevice) -> bool {
    select_adapter(device).is_ok()
}

/// Opens the device with CubeCL id `id`.
pub(super) fn open(id: DeviceId) -> Result<WgpuSetup, DriverError> {
    let device = WgpuDevice::from_id(id);
    let (adapter, backend) = select_adapter(&device)?;
    let (device, queue) = block_on(
        adapter.request_device(&wgpu::DeviceDescriptor {
            label: Some("burn-caching-alloc"),
            required_features: adapter
                .features()
                .difference(wgpu::Features::MAPPABLE_PRIMARY_BUFFERS),
            required_limits: adapter.limits(),
            memory_hints: wgpu::MemoryHints::MemoryUsage,
            ..Default::default()
        }),
    )
    .map_err(|err| {
        DriverError::call(
            "wgpu",
            "request_device",
            format!("{:?}: {err}", adapter.get_info()),
        )
    })?;
    Ok(WgpuSetup {
        adapter,
        device,
        queue,
        backend,
    })
}

/// cubecl-wgpu's own properties and compilation options for device `id` (see module docs).
pub(super) fn probe_properties(
    id: DeviceId,
) -> Result<(DeviceProperties, WgpuCompilationOptions), DriverError> {
    let probe =
        std::panic::catch_unwind(|| <WgpuServer as DeviceService>::init(id)).map_err(|_| {
            DriverError::call(
                "wgpu",
                "cubecl-wgpu's device probe",
                format!("could not open {id} to detect its properties"),
            )
        })?;
    let properties = ComputeServer::utilities(&probe).properties.clone();
    Ok((properties, probe.compilation_options))
}
