//! Two logical devices on one adapter in one process: Burn's stock `Wgpu` device, and a second
//! one whose main memory is the caching engine's.
//!
//! A CubeCL storage takes the external allocator installed when it is created and keeps it.
//! Each device's server makes one storage per stream, and a stream per thread as threads first
//! use it; so the stock device is opened (and its main thread's stream created) before the hook
//! is installed, and the allocator is installed only while the hooked side works
//! ([`Pair::enter`]): a stream either side opens later gets the right allocator.

use std::sync::Arc;

use burn::tensor::{Device, DeviceKind, Tensor, TensorData};
use burn_022_caching_hook::caching_alloc_engine::registry::{self, DeviceKey};
use burn_022_caching_hook::{WgpuEngine, WgpuHook, install_wgpu};
use cubecl_server::storage::{remove_external_allocator, set_external_allocator};
use cubecl_wgpu::WgpuExternalMemory;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    Stock,
    Hooked,
}

/// What one side holds on the device, in bytes.
#[derive(Clone, Copy, Debug, Default)]
pub struct Reading {
    /// Everything reserved: for the stock side, CubeCL's pools as Burn reports them; for the
    /// hooked side, the engine's segments plus CubeCL's own staging and uniform buffers.
    pub total: u64,
    /// `Device::memory_pool_usage().bytes_reserved` (all of CubeCL's memories and streams).
    pub cubecl: u64,
    /// The engine's reserved bytes (hooked side only).
    pub engine: Option<u64>,
}

pub struct Pair {
    pub stock: Device,
    pub hooked: Device,
    hook: &'static WgpuHook,
    engine: Arc<WgpuEngine>,
}

impl Pair {
    /// Opens the stock device, then installs the hook and opens the hooked one; checks that
    /// only the hooked one reached the engine. [`Pair::adapters`] names both adapters.
    pub fn open() -> Self {
        // What a Burn user gets from `Device::default()` with the `wgpu` feature.
        let stock = Device::wgpu(DeviceKind::DefaultDevice);
        touch(&stock);
        let hook = install_wgpu(None).expect("BURN_CACHING_ALLOC_CONF is malformed");
        assert!(
            registry::engine(DeviceKey::new("wgpu", 0)).is_none(),
            "the stock device reached the engine"
        );

        // Another logical device (its own wgpu device and CubeCL server) on the same adapter.
        let hooked = Device::wgpu(DeviceKind::Cpu);
        assert_ne!(stock, hooked, "two logical devices");
        touch(&hooked);
        let engine = hook
            .engine(0)
            .expect("the hooked device reached the engine");

        let pair = Self {
            stock,
            hooked,
            hook,
            engine,
        };
        pair.check_one_engine();
        pair.check_isolation();
        pair
    }

    /// No storage of the stock device ever reached the hook (the hook makes an engine per wgpu
    /// device it serves): call after the work, threads included.
    pub fn check_one_engine(&self) {
        assert!(
            self.hook.engine(1).is_none() && registry::engine(DeviceKey::new("wgpu", 1)).is_none(),
            "a stock storage reached the hook"
        );
    }

    /// The adapters' names, as CubeCL reports them.
    pub fn adapters(&self) -> (String, String) {
        let name = |device: &Device| device.identity().map_or("?".into(), |id| id.name);
        (name(&self.stock), name(&self.hooked))
    }

    pub fn engine(&self) -> &WgpuEngine {
        &self.engine
    }

    /// The device of `side`, with the external allocator installed for the hooked side only.
    /// Call before each side's work (and before a side's threads start).
    pub fn enter(&self, side: Side) -> &Device {
        match side {
            Side::Stock => {
                remove_external_allocator::<WgpuExternalMemory>();
                &self.stock
            }
            Side::Hooked => {
                set_external_allocator::<WgpuExternalMemory>(self.hook);
                &self.hooked
            }
        }
    }

    /// What `side` holds now. Reading drains Burn's fusion queue (a sync) on that device.
    pub fn read(&self, side: Side) -> Reading {
        let device = match side {
            Side::Stock => &self.stock,
            Side::Hooked => &self.hooked,
        };
        let cubecl = device
            .memory_pool_usage()
            .map_or(0, |usage| usage.bytes_reserved);
        match side {
            Side::Stock => Reading {
                total: cubecl,
                cubecl,
                engine: None,
            },
            Side::Hooked => {
                let stats = self.engine.stats();
                // CubeCL's reserved bytes are its dedicated and persistent allocations (engine
                // blocks, counted by the engine as requested) plus its staging and uniform
                // buffers, which are not the engine's.
                let auxiliary = cubecl.saturating_sub(stats.requested_bytes.all.current);
                Reading {
                    total: stats.memory_reserved() + auxiliary,
                    cubecl,
                    engine: Some(stats.memory_reserved()),
                }
            }
        }
    }

    /// Gives back what both sides cache and restarts the engine's peak: each row starts clean.
    pub fn reset(&self) {
        for side in [Side::Stock, Side::Hooked] {
            let device = self.enter(side);
            device.sync().expect("sync");
            device.memory_cleanup();
        }
        self.engine.reset_peak_memory_stats();
    }

    /// A tensor on the stock device moves only CubeCL's stock pools; one on the hooked device
    /// moves the engine.
    fn check_isolation(&self) {
        let allocated = || self.engine.stats().memory_allocated();
        let before = allocated();
        let stock = Tensor::<1>::zeros([1 << 20], self.enter(Side::Stock)) + 1.0;
        let _ = stock.clone().sum().into_scalar::<f32>();
        assert_eq!(allocated(), before, "a stock tensor is not in the engine");
        let hooked = Tensor::<1>::zeros([1 << 20], self.enter(Side::Hooked)) + 1.0;
        let _ = hooked.clone().sum().into_scalar::<f32>();
        assert!(
            allocated() >= before + (4 << 20),
            "a hooked tensor is in the engine"
        );
        drop((stock, hooked));
    }
}

/// One read, so the device's server and this thread's stream (and its storage) exist.
fn touch(device: &Device) {
    let data = TensorData::new(vec![1f32; 4], [4]);
    let _ = Tensor::<1>::from_data(data, device).into_data();
}
