//! `EngineStorage`: the caching engine seen through CubeCL's `ComputeStorage` trait.
//!
//! CubeCL's memory handles are opaque outside cubecl-runtime, so only CubeCL's own
//! `MemoryManagement` can reserve, bind and resolve them. We therefore keep one
//! `MemoryManagement` per stream, in persistent mode with no dynamic pools, and give it this
//! storage: every slice it creates is one engine block.
//!
//! - `alloc(size)` is an engine `malloc` on the storage's stream (in the private pool the
//!   server routes the reservation to, if any), remembered under a fresh `StorageId`;
//! - `dealloc(id)` is an engine `free` of that block;
//! - `get(handle)` is the block's segment handle plus the block's offset (plus the offset the
//!   handle adds inside the slice).
//!
//! The storage can be told to serve from the engine's cache only ([`Growth::CacheOnly`]), or
//! from anything short of the engine's cache flush ([`Growth::BeforeFlush`]): then an `alloc`
//! beyond that is refused, and the refusal is remembered so that the caller (the reclaim
//! policy, the server's out-of-memory path) can first hand CubeCL's free slices back.
//!
//! One slice per stream has no block: the guard slice of
//! [`StreamMemory`](super::StreamMemory), which no tensor ever holds. It holds no memory, the
//! engine never sees it, and `get` refuses it ([`EngineStorage::is_unbacked`]).

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use cubecl_common::backtrace::BackTrace;
use cubecl_ir::MemoryDeviceProperties;
use cubecl_runtime::logging::ServerLogger;
use cubecl_runtime::memory_management::{
    MemoryAllocationMode, MemoryConfiguration, MemoryManagement, MemoryManagementOptions,
};
use cubecl_runtime::server::IoError;
use cubecl_runtime::storage::{ComputeStorage, StorageHandle, StorageId, StorageUtilization};

use crate::alloc::{AllocError, Allocation, CachingAllocator, MemPoolId, MissPath, Tag};
use crate::device::{DeviceError, DeviceMemory, DeviceStream};

/// One engine block behind a CubeCL slice.
struct Held<H> {
    block: Allocation<H>,
    /// The bytes CubeCL asked for (0 for an empty tensor's block).
    size: u64,
    /// The private pool the block came from.
    pool: Option<MemPoolId>,
}

/// Where a kernel finds a slice: the segment's device handle, and a byte range in it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EngineResource<H> {
    /// The device handle of the segment holding the block (a buffer, a device pointer).
    pub segment: H,
    /// Byte offset of the slice inside the segment.
    pub offset: u64,
    /// Size of the slice in bytes (what the handle covers, after its own offsets).
    pub size: u64,
}

/// Whether an `alloc` may make the engine allocate a new segment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Growth {
    /// Any request goes to the engine's full `malloc` (cache, then device, then its OOM path).
    Allowed,
    /// Only a cached engine block may serve; otherwise the request is refused.
    CacheOnly,
    /// The engine's path short of flushing its cache (cache, new device memory, release of
    /// oversize blocks); a request only the flush could serve is refused, and nothing is
    /// counted as an out-of-memory yet.
    BeforeFlush,
    /// No engine call at all: only a free CubeCL slice (exact-size reuse) may serve; any
    /// `alloc` is refused. The reclaim policy uses it to learn whether CubeCL's pool holds the
    /// size before it decides to walk.
    PoolOnly,
}

/// The caching engine as a CubeCL `ComputeStorage`, for one stream.
pub struct EngineStorage<D: DeviceMemory> {
    allocator: Arc<CachingAllocator<D>>,
    stream: DeviceStream,
    alignment: u64,
    /// Each block, with the bytes CubeCL asked for it (0 for an empty tensor's block) and the
    /// private pool it came from (what CubeCL's exact-size reuse must not hand to a request
    /// outside that pool, see `StreamMemory`).
    blocks: HashMap<StorageId, Held<D::Handle>>,
    growth: Growth,
    /// The private pool the next blocks come from (`None`: the allocator's own pools).
    mem_pool: Option<MemPoolId>,
    /// How many of `blocks` came from private pools.
    pooled: usize,
    refused: bool,
    last_error: Option<AllocError>,
    held_bytes: u64,
    /// Whether the next `alloc` makes a slice with no block ([`EngineStorage::unbacked_next`]).
    unbacked_next: bool,
    /// The slices with no block behind them.
    unbacked: HashSet<StorageId>,
}

impl<D: DeviceMemory> core::fmt::Debug for EngineStorage<D> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("EngineStorage")
            .field("stream", &self.stream)
            .field("blocks", &self.blocks.len())
            .field("held_bytes", &self.held_bytes)
            .finish()
    }
}

impl<D: DeviceMemory> EngineStorage<D> {
    /// A storage that allocates engine blocks on `stream`, with offsets aligned to `alignment`
    /// (a power of two, at most the engine's 512-byte block granularity).
    pub fn new(allocator: Arc<CachingAllocator<D>>, stream: DeviceStream, alignment: u64) -> Self {
        Self {
            allocator,
            stream,
            alignment: alignment.max(1),
            blocks: HashMap::new(),
            growth: Growth::Allowed,
            mem_pool: None,
            pooled: 0,
            refused: false,
            last_error: None,
            held_bytes: 0,
            unbacked_next: false,
            unbacked: HashSet::new(),
        }
    }

    /// The engine behind this storage.
    pub fn allocator(&self) -> &Arc<CachingAllocator<D>> {
        &self.allocator
    }

    /// The engine stream this storage allocates on.
    pub fn stream(&self) -> DeviceStream {
        self.stream
    }

    /// Sets whether `alloc` may grow the engine.
    pub fn set_growth(&mut self, growth: Growth) {
        self.growth = growth;
    }

    /// Takes the next blocks from private pool `pool` (`None`: the allocator's own pools).
    pub fn set_mem_pool(&mut self, pool: Option<MemPoolId>) {
        self.mem_pool = pool;
    }

    /// The private pool the next blocks come from.
    pub fn mem_pool(&self) -> Option<MemPoolId> {
        self.mem_pool
    }

    /// Whether this storage holds blocks of private pools.
    pub fn holds_pool_blocks(&self) -> bool {
        self.pooled > 0
    }

    /// The private pool of slice `id`'s block (`None`: the allocator's own, or not a block).
    pub fn pool_of(&self, id: StorageId) -> Option<MemPoolId> {
        self.blocks.get(&id).and_then(|held| held.pool)
    }

    /// Whether an `alloc` was refused (in [`Growth::CacheOnly`] or [`Growth::PoolOnly`]) since
    /// the last call; clears it.
    pub fn take_refused(&mut self) -> bool {
        core::mem::take(&mut self.refused)
    }

    /// The engine error behind the last failed `alloc`, if any; clears it.
    pub fn take_error(&mut self) -> Option<AllocError> {
        self.last_error.take()
    }

    /// Number of engine blocks this storage holds (CubeCL's slices, live or free).
    pub fn blocks(&self) -> usize {
        self.blocks.len()
    }

    /// The engine block behind slice `id` (`None` for a slice with no block, or an unknown id).
    pub fn block_of(&self, id: StorageId) -> Option<&Allocation<D::Handle>> {
        self.blocks.get(&id).map(|held| &held.block)
    }

    /// The distinct sizes CubeCL asked for across the blocks held: the keys of CubeCL's
    /// exact-size pool, under which its free slices can be found.
    pub fn held_sizes(&self) -> std::collections::BTreeSet<u64> {
        self.blocks.values().map(|held| held.size).collect()
    }

    /// Counts the block of slice `id` under memory scope `tag` (`None`: no scope).
    pub fn retag(&self, id: StorageId, tag: Option<Tag>) {
        if let Some(held) = self.blocks.get(&id)
            && let Err(err) = self.allocator.retag(&held.block, tag)
        {
            log::warn!("EngineStorage: engine refused to retag a block: {err}");
        }
    }

    /// Bytes CubeCL asked for across the blocks held (before the engine's 512-byte rounding).
    pub fn held_bytes(&self) -> u64 {
        self.held_bytes
    }

    /// The next `alloc` (only that one) makes a slice with no engine block behind it: no
    /// memory, no engine call, and [`ComputeStorage::get`] refuses it. For a stream's guard
    /// slice (see [`StreamMemory`](super::StreamMemory)), which no tensor ever holds.
    pub(crate) fn unbacked_next(&mut self) {
        self.unbacked_next = true;
    }

    /// Whether slice `id` has no block behind it: a stream's guard slice (see
    /// [`StreamMemory`](super::StreamMemory)).
    pub fn is_unbacked(&self, id: StorageId) -> bool {
        self.unbacked.contains(&id)
    }
}

impl<D: DeviceMemory> ComputeStorage for EngineStorage<D> {
    type Resource = EngineResource<D::Handle>;

    fn alignment(&self) -> usize {
        self.alignment as usize
    }

    fn get(&mut self, handle: &StorageHandle) -> Self::Resource {
        // The server refuses every handle that resolves to an unbacked slice (a handle whose
        // reservation failed) before it asks for a resource.
        assert!(
            !self.unbacked.contains(&handle.id),
            "EngineStorage: {} is a slice with no block on {} (a stream's guard slice)",
            handle.id,
            self.stream
        );
        // MemoryManagement only resolves handles of slices it holds, and every slice it holds
        // was created by `alloc` and is removed only by `dealloc`: a miss is a broken invariant.
        let Held { block, .. } = self.blocks.get(&handle.id).unwrap_or_else(|| {
            panic!(
                "EngineStorage: {} is not a live block of {} (CubeCL resolved a slice it had \
                 already deallocated)",
                handle.id, self.stream
            )
        });
        // The server refuses offsets past a slice before they reach CubeCL's unchecked
        // subtraction; a range outside the block here would let a kernel write into its
        // neighbours, so it is a broken invariant too.
        let end = handle.offset().checked_add(handle.size());
        assert!(
            end.is_some_and(|end| end <= block.size()),
            "EngineStorage: {} resolves bytes {}..{:?} outside its {}-byte block",
            handle.id,
            handle.offset(),
            end,
            block.size()
        );
        EngineResource {
            segment: block.segment().clone(),
            offset: block.offset() + handle.offset(),
            size: handle.size(),
        }
    }

    fn alloc(&mut self, size: u64) -> Result<StorageHandle, IoError> {
        if core::mem::take(&mut self.unbacked_next) {
            let id = StorageId::new();
            self.unbacked.insert(id);
            return Ok(StorageHandle::new(
                id,
                StorageUtilization { offset: 0, size },
            ));
        }
        // CubeCL creates zero-sized handles (empty tensors); they still need a distinct
        // binding, so they take the engine's smallest block.
        let request = size.max(1);
        let path = match self.growth {
            Growth::Allowed => Some(MissPath::Allowed),
            Growth::CacheOnly => Some(MissPath::CacheOnly),
            Growth::BeforeFlush => Some(MissPath::BeforeFlush),
            Growth::PoolOnly => None,
        };
        let result = match path {
            Some(path) => self
                .allocator
                .malloc_in_with(self.mem_pool, request, self.stream, path),
            None => Ok(None),
        };
        match result {
            Ok(Some(block)) => {
                let id = StorageId::new();
                self.held_bytes += size;
                let pool = self.mem_pool;
                self.blocks.insert(id, Held { block, size, pool });
                self.pooled += usize::from(self.mem_pool.is_some());
                Ok(StorageHandle::new(
                    id,
                    StorageUtilization { offset: 0, size },
                ))
            }
            Ok(None) => {
                self.refused = true;
                Err(IoError::Unknown {
                    description: format!(
                        "no cached block of the caching allocator fits {size} bytes on {} \
                         (cache-only request)",
                        self.stream
                    ),
                    backtrace: BackTrace::capture(),
                })
            }
            Err(err) => {
                let too_large = matches!(err, AllocError::TooLarge { .. });
                let io = storage_error(size, too_large, format_args!("caching allocator: {err}"));
                self.last_error = Some(err);
                Err(io)
            }
        }
    }

    fn dealloc(&mut self, id: StorageId) {
        if self.unbacked.remove(&id) {
            return;
        }
        let Some(Held { block, size, pool }) = self.blocks.remove(&id) else {
            log::warn!("EngineStorage: dealloc of unknown {id} on {}", self.stream);
            return;
        };
        self.held_bytes -= size;
        self.pooled -= usize::from(pool.is_some());
        if let Err(err) = self.allocator.free(block) {
            log::error!("EngineStorage: engine refused to free a block: {err}");
        }
    }

    fn flush(&mut self) {}
}

/// Dropping the storage (its stream memory, its server) frees every block it still holds in
/// the engine: CubeCL's slices, live or free, die with it, and their blocks go back to the
/// engine's cache (and from there to the device at `empty_cache` or when the engine is
/// dropped). A block the engine refuses is logged.
impl<D: DeviceMemory> Drop for EngineStorage<D> {
    fn drop(&mut self) {
        let mut refused = 0usize;
        let mut last = None;
        self.pooled = 0;
        for (_, Held { block, .. }) in self.blocks.drain() {
            if let Err(err) = self.allocator.free(block) {
                refused += 1;
                last = Some(err);
            }
        }
        self.held_bytes = 0;
        if let Some(err) = last {
            log::error!(
                "EngineStorage of {}: the engine refused {refused} block(s) at drop (last: {err})",
                self.stream
            );
        }
    }
}

/// The error a `ComputeStorage::alloc` of `size` bytes reports to CubeCL: `BufferTooBig` when
/// no device could hold it, otherwise the failure described.
fn storage_error(size: u64, too_large: bool, failure: impl core::fmt::Display) -> IoError {
    if too_large {
        IoError::BufferTooBig {
            size,
            backtrace: BackTrace::capture(),
        }
    } else {
        IoError::Unknown {
            description: failure.to_string(),
            backtrace: BackTrace::capture(),
        }
    }
}

/// A device failure as CubeCL's storage reports it: `BufferTooBig` when no single buffer of
/// that size can exist on the device, otherwise `Unknown` with the device's message. For any
/// `ComputeStorage` over a [`DeviceMemory`].
pub fn device_io_error(err: DeviceError) -> IoError {
    {
        let size = match err {
            DeviceError::OutOfMemory { requested } | DeviceError::TooLarge { requested, .. } => {
                requested
            }
            _ => 0,
        };
        let too_large = matches!(err, DeviceError::TooLarge { .. });
        storage_error(size, too_large, format_args!("device: {err}"))
    }
}

/// The CubeCL memory manager users run, for one stream: CubeCL's persistent pool (exact-size
/// reuse of freed slices) in front of the engine (PyTorch's placement for everything else).
pub type PersistentManager<D> = MemoryManagement<EngineStorage<D>>;

/// Builds the [`PersistentManager`] for `stream`: no dynamic pools
/// (`MemoryConfiguration::Custom` with an empty list) and `MemoryAllocationMode::Persistent`,
/// so every reservation goes to CubeCL's persistent pool and every new slice is one engine
/// block. `properties.alignment` is the slice alignment; `max_page_size` bounds nothing in
/// persistent mode but is kept for CubeCL's bookkeeping.
pub fn persistent_manager<D: DeviceMemory>(
    allocator: Arc<CachingAllocator<D>>,
    stream: DeviceStream,
    properties: &MemoryDeviceProperties,
) -> PersistentManager<D> {
    let storage = EngineStorage::new(allocator, stream, properties.alignment);
    MemoryManagement::from_configuration(
        storage,
        properties,
        MemoryConfiguration::Custom {
            pool_options: vec![],
        },
        Arc::new(ServerLogger::default()),
        MemoryManagementOptions::new(format!("caching allocator, {stream}"))
            .mode(MemoryAllocationMode::Persistent),
    )
}
