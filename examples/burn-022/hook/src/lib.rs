//! The caching engine behind CubeCL 0.11's external-allocator hook (added by the patches in
//! `../patches/`), so that Burn 0.22.1's stock `Wgpu` backend keeps every tensor in the engine.
//!
//! Call [`install_wgpu`] before the first tensor is made. Each wgpu device gets one engine,
//! registered in [`caching_alloc_engine::registry`] as `("wgpu", n)` (devices numbered in the
//! order CubeCL first allocates on them), where statistics, snapshots and `empty_cache` are read.
//! CubeCL reserves in `Dedicated` mode under the hook: one engine block per reservation, given
//! back at CubeCL's next reservation after the tensor dropped, or at `memory_cleanup`, which
//! also empties the engine's cache.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use caching_alloc_engine::alloc::{AllocError, Allocation, AllocatorConfig, CachingAllocator};
use caching_alloc_engine::device::DeviceStream;
use caching_alloc_engine::registry::{self, DeviceKey};
use cubecl_environment::backtrace::BackTrace;
use cubecl_server::server::IoError;
use cubecl_server::storage::{ExternalAllocator, set_external_allocator};
use cubecl_wgpu::{WgpuAllocationSite, WgpuExternalBuffer, WgpuExternalMemory, wgpu};

pub mod wgpu_memory;

/// The guide's chapters on Burn 0.22 (`docs/src/burn-022.md`) and on the CubeCL change the
/// patches make (`docs/src/upstream-hook.md`): their Rust blocks compiled as doc tests here,
/// where Burn 0.22 and the patched CubeCL 0.11 are (the root's Burn 0.21 graph has neither).
#[cfg(doctest)]
mod guide_doctests {
    /// `docs/src/burn-022.md`.
    #[doc = include_str!("../../../../docs/src/burn-022.md")]
    pub struct Burn022;
    /// `docs/src/upstream-hook.md`.
    #[doc = include_str!("../../../../docs/src/upstream-hook.md")]
    pub struct UpstreamHook;
}

pub use caching_alloc_engine;
use wgpu_memory::WgpuSegments;

/// The engine of one wgpu device.
pub type WgpuEngine = CachingAllocator<WgpuSegments>;

/// One device's engine and the blocks CubeCL holds from it.
struct WgpuDevice {
    key: DeviceKey,
    engine: Arc<WgpuEngine>,
    live: Mutex<HashMap<(wgpu::Buffer, u64), Allocation<wgpu::Buffer>>>,
}

/// The external allocator for CubeCL's wgpu storage: one engine per device.
pub struct WgpuHook {
    config: AllocatorConfig,
    devices: Mutex<Vec<(wgpu::Device, Arc<WgpuDevice>)>>,
}

impl WgpuHook {
    fn device(&self, site: &WgpuAllocationSite) -> Result<Arc<WgpuDevice>, IoError> {
        let mut devices = self.devices.lock().unwrap();
        if let Some((_, found)) = devices.iter().find(|(device, _)| *device == site.device) {
            return Ok(found.clone());
        }
        let key = DeviceKey::new("wgpu", devices.len() as u32);
        let total = wgpu_memory::host_memory_total().unwrap_or(8 << 30);
        let segments = WgpuSegments::new(site.device.clone(), site.usage, total);
        let engine = CachingAllocator::new(segments, self.config.clone())
            .map(Arc::new)
            .map_err(|err| unknown(format!("caching engine for {key}: {err}")))?;
        engine.set_device_index(key.index as u16);
        registry::register(key, &engine);
        let device = Arc::new(WgpuDevice {
            key,
            engine,
            live: Mutex::default(),
        });
        devices.push((site.device.clone(), device.clone()));
        Ok(device)
    }

    /// The engine of the `index`th device CubeCL allocated on, if it has.
    pub fn engine(&self, index: usize) -> Option<Arc<WgpuEngine>> {
        let devices = self.devices.lock().unwrap();
        devices.get(index).map(|(_, device)| device.engine.clone())
    }
}

impl ExternalAllocator<WgpuExternalMemory> for WgpuHook {
    fn alloc(&self, site: &WgpuAllocationSite, size: u64) -> Result<WgpuExternalBuffer, IoError> {
        let device = self.device(site)?;
        let block = device
            .engine
            .malloc(size, DeviceStream(site.stream))
            .map_err(|err| io_error(err, size))?;
        if block.offset() % site.alignment.max(1) != 0 {
            let offset = block.offset();
            let _ = device.engine.free(block);
            return Err(unknown(format!(
                "engine offset {offset} is not a multiple of the device's {}",
                site.alignment
            )));
        }
        let buffer = WgpuExternalBuffer {
            buffer: block.segment().clone(),
            offset: block.offset(),
        };
        let mut live = device.live.lock().unwrap();
        live.insert((buffer.buffer.clone(), buffer.offset), block);
        Ok(buffer)
    }

    fn free(&self, site: &WgpuAllocationSite, allocation: WgpuExternalBuffer, _size: u64) {
        let Ok(device) = self.device(site) else {
            return;
        };
        let block = device
            .live
            .lock()
            .unwrap()
            .remove(&(allocation.buffer, allocation.offset));
        match block.map(|block| device.engine.free(block)) {
            Some(Ok(())) => {}
            Some(Err(err)) => log::error!("{}: free failed: {err}", device.key),
            None => log::error!("{}: free of a block the hook never gave", device.key),
        }
    }

    fn empty_cache(&self, site: &WgpuAllocationSite) {
        if let Ok(device) = self.device(site)
            && let Err(err) = device.engine.empty_cache()
        {
            log::error!("{}: empty_cache failed: {err}", device.key);
        }
    }
}

fn unknown(description: String) -> IoError {
    IoError::Unknown {
        description,
        backtrace: BackTrace::capture(),
    }
}

fn io_error(err: AllocError, size: u64) -> IoError {
    match err {
        AllocError::OutOfMemory { .. } => IoError::OutOfMemory {
            size,
            backtrace: BackTrace::capture(),
        },
        AllocError::TooLarge { .. } => IoError::BufferTooBig {
            size,
            backtrace: BackTrace::capture(),
        },
        other => unknown(other.to_string()),
    }
}

static WGPU: OnceLock<WgpuHook> = OnceLock::new();

/// Puts every wgpu storage CubeCL creates from now on in the caching engine, configured by
/// `config` (or [`AllocatorConfig::from_env`] when `None`). The first call installs; later ones
/// answer the hook installed.
///
/// # Errors
///
/// The environment's configuration, when it is malformed.
pub fn install_wgpu(
    config: Option<AllocatorConfig>,
) -> Result<&'static WgpuHook, caching_alloc_engine::alloc::ConfigError> {
    let mut config = match config {
        Some(config) => config,
        None => AllocatorConfig::from_env()?,
    };
    // Each CubeCL stream records into its own encoder and submits when it flushes, so work
    // queued on one stream may still be unsubmitted when another submits: a block freed on one
    // stream is safe only for that stream (whose later work is ordered after it). The engine's
    // wgpu fences pass at once, so it could not tell; PyTorch's per-stream rule holds here.
    config.cross_stream_reuse = false;
    let mut installed = false;
    let hook = WGPU.get_or_init(|| {
        installed = true;
        WgpuHook {
            config,
            devices: Mutex::default(),
        }
    });
    if installed {
        set_external_allocator::<WgpuExternalMemory>(hook);
    }
    Ok(hook)
}
