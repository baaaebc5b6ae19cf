//! Device memory over host memory: physical allocations (from `cuMemAlloc` or `cuMemCreate`),
//! the addresses they are reachable at (an allocation's own range, or a mapping inside a range
//! from `cuMemAddressReserve`), who may access them, and pinned host allocations.
//!
//! Device addresses are fake and never reused: each device allocates from its own region of
//! 1 TiB, reserved ranges from a shared region above them, so a stale pointer resolves to
//! nothing and a use after free is an error, not a silent read of someone else's bytes.

use std::collections::{BTreeMap, BTreeSet, HashMap};

/// Where `cuMemAlloc` addresses of device `d` start.
fn alloc_region(device: usize) -> u64 {
    (device as u64 + 1) << 40
}

/// Where reserved ranges start (above every device's allocation region).
const RESERVE_REGION: u64 = 0x100 << 40;

/// Bytes left unused after every allocation and range, so that an overrun reaches no neighbour.
const GUARD: u64 = 1 << 20;

/// `cuMemAlloc`'s alignment (CUDA guarantees 256 bytes).
pub const ALLOC_ALIGNMENT: u64 = 256;

/// Allocations up to this size are filled with [`UNWRITTEN`] so that a read of bytes never
/// written shows; larger ones start zeroed (untouched pages cost no host memory).
const FILL_LIMIT: u64 = 64 << 20;
pub const UNWRITTEN: u8 = 0xCD;

/// One physical allocation.
#[derive(Debug)]
pub struct Physical {
    pub device: usize,
    pub data: Vec<u8>,
    /// From `cuMemCreate` (`true`) or `cuMemAlloc`.
    pub created: bool,
    /// Mappings of it (created ones only).
    pub mappings: u32,
    /// `cuMemRelease` was called: freed when its last mapping goes.
    pub released: bool,
}

/// A `cuMemAlloc` allocation at its base address.
#[derive(Debug)]
pub struct Allocation {
    pub phys: u64,
    pub size: u64,
    pub device: usize,
}

/// A physical allocation mapped at an offset of a reserved range.
#[derive(Debug)]
pub struct Mapping {
    pub size: u64,
    pub phys: u64,
    /// Devices that may read and write it (`cuMemSetAccess`).
    pub access: BTreeSet<usize>,
}

/// A range from `cuMemAddressReserve`.
#[derive(Debug)]
pub struct Reservation {
    pub size: u64,
    pub mappings: BTreeMap<u64, Mapping>,
}

/// Why `[at, end)` of a reservation is not exactly a run of whole mappings.
pub enum NotWholeMappings {
    /// A mapping starts before the range, ends after it, or leaves a gap before it.
    PartOfAMapping,
    /// Bytes at the end of the range are not mapped.
    NotAllMapped,
}

impl Reservation {
    /// The mappings (offset, physical handle) that exactly cover `[at, end)`, in order: every
    /// byte mapped, whole mappings only (what `cuMemSetAccess` and `cuMemUnmap` require).
    pub fn whole_mappings(&self, at: u64, end: u64) -> Result<Vec<(u64, u64)>, NotWholeMappings> {
        let mut covered = at;
        let mut found = Vec::new();
        for (offset, mapping) in self.mappings.range(..end) {
            if offset + mapping.size <= at {
                continue;
            }
            if *offset != covered || offset + mapping.size > end {
                return Err(NotWholeMappings::PartOfAMapping);
            }
            covered = offset + mapping.size;
            found.push((*offset, mapping.phys));
        }
        if covered != end {
            return Err(NotWholeMappings::NotAllMapped);
        }
        Ok(found)
    }
}

/// A pinned host allocation (`cuMemHostAlloc`).
#[derive(Debug)]
pub struct HostAllocation {
    pub size: usize,
    pub layout: std::alloc::Layout,
}

/// A piece of physical memory a device address range resolves to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Piece {
    pub phys: u64,
    pub offset: u64,
    pub len: u64,
}

/// What a device range resolves to, and which devices own the memory.
#[derive(Debug, Clone)]
pub struct Resolved {
    pub pieces: Vec<Piece>,
}

#[derive(Debug, Default)]
pub struct Memory {
    pub phys: HashMap<u64, Physical>,
    pub allocations: BTreeMap<u64, Allocation>,
    pub reservations: BTreeMap<u64, Reservation>,
    pub host: BTreeMap<usize, HostAllocation>,
    next_alloc: HashMap<usize, u64>,
    next_reserve: u64,
    next_phys: u64,
    /// Physical bytes in use per device.
    pub used: HashMap<usize, u64>,
}

impl Memory {
    fn new_phys(&mut self, device: usize, size: u64, created: bool) -> u64 {
        self.next_phys += 1;
        let id = 0x9000_0000 + self.next_phys;
        let fill = if size <= FILL_LIMIT { UNWRITTEN } else { 0 };
        let data = if fill == 0 {
            vec![0u8; size as usize]
        } else {
            vec![fill; size as usize]
        };
        self.phys.insert(
            id,
            Physical {
                device,
                data,
                created,
                mappings: 0,
                released: false,
            },
        );
        *self.used.entry(device).or_default() += size;
        id
    }

    fn drop_phys(&mut self, id: u64) {
        if let Some(phys) = self.phys.remove(&id) {
            *self.used.entry(phys.device).or_default() -= phys.data.len() as u64;
        }
    }

    pub fn used(&self, device: usize) -> u64 {
        self.used.get(&device).copied().unwrap_or(0)
    }

    /// `cuMemAlloc`: a new allocation of `size` bytes on `device` (capacity checked by the caller).
    pub fn alloc(&mut self, device: usize, size: u64) -> u64 {
        let phys = self.new_phys(device, size, false);
        let next = self
            .next_alloc
            .entry(device)
            .or_insert_with(|| alloc_region(device));
        let base = *next;
        *next = (base + size + GUARD).next_multiple_of(ALLOC_ALIGNMENT);
        self.allocations
            .insert(base, Allocation { phys, size, device });
        base
    }

    /// `cuMemFree` of the allocation at `base` (checked by the caller).
    pub fn free(&mut self, base: u64) -> Option<Allocation> {
        let allocation = self.allocations.remove(&base)?;
        self.drop_phys(allocation.phys);
        Some(allocation)
    }

    /// `cuMemCreate`.
    pub fn create(&mut self, device: usize, size: u64) -> u64 {
        self.new_phys(device, size, true)
    }

    /// `cuMemRelease`: frees now, or at its last unmap.
    pub fn release(&mut self, handle: u64) {
        let free_now = match self.phys.get_mut(&handle) {
            Some(phys) => {
                phys.released = true;
                phys.mappings == 0
            }
            None => false,
        };
        if free_now {
            self.drop_phys(handle);
        }
    }

    /// `cuMemAddressReserve`: a range of `size` bytes aligned to `alignment`.
    pub fn reserve(&mut self, size: u64, alignment: u64) -> u64 {
        if self.next_reserve == 0 {
            self.next_reserve = RESERVE_REGION;
        }
        let base = self.next_reserve.next_multiple_of(alignment.max(1));
        self.next_reserve = base + size + GUARD;
        self.reservations.insert(
            base,
            Reservation {
                size,
                mappings: BTreeMap::new(),
            },
        );
        base
    }

    /// The reservation holding `address`, with its base.
    pub fn reservation_at(&self, address: u64) -> Option<(u64, &Reservation)> {
        let (base, reservation) = self.reservations.range(..=address).next_back()?;
        (address < base + reservation.size).then_some((*base, reservation))
    }

    pub fn reservation_at_mut(&mut self, address: u64) -> Option<(u64, &mut Reservation)> {
        let (base, reservation) = self.reservations.range_mut(..=address).next_back()?;
        (address < *base + reservation.size).then_some((*base, reservation))
    }

    /// The allocation holding `address`, with its base.
    pub fn allocation_at(&self, address: u64) -> Option<(u64, &Allocation)> {
        let (base, allocation) = self.allocations.range(..=address).next_back()?;
        (address < base + allocation.size).then_some((*base, allocation))
    }

    /// The device memory `[address, address + len)` resolves to, checking that `device` (the
    /// device doing the access) may access every byte of it: its own `cuMemAlloc` memory, or
    /// another device's where `peer(device, owner)` holds; mapped memory where `cuMemSetAccess`
    /// gave `device` access. `Err` says what is wrong.
    pub fn resolve(
        &self,
        address: u64,
        len: u64,
        device: usize,
        peer: &dyn Fn(usize, usize) -> bool,
    ) -> Result<Resolved, String> {
        if let Some((base, allocation)) = self.allocation_at(address) {
            if address + len > base + allocation.size {
                return Err(format!(
                    "{len} bytes at {address:#x} overrun the allocation at {base:#x} of {} bytes",
                    allocation.size
                ));
            }
            if allocation.device != device && !peer(device, allocation.device) {
                return Err(format!(
                    "device {device} accesses {address:#x}, memory of device {}, without peer access enabled",
                    allocation.device
                ));
            }
            return Ok(Resolved {
                pieces: vec![Piece {
                    phys: allocation.phys,
                    offset: address - base,
                    len,
                }],
            });
        }
        if let Some((base, reservation)) = self.reservation_at(address) {
            if address + len > base + reservation.size {
                return Err(format!(
                    "{len} bytes at {address:#x} overrun the reserved range at {base:#x} of {} bytes",
                    reservation.size
                ));
            }
            let mut pieces = Vec::new();
            let mut at = address - base;
            let end = at + len;
            while at < end {
                let Some((offset, mapping)) = reservation.mappings.range(..=at).next_back() else {
                    return Err(format!("{:#x} is reserved but not mapped", base + at));
                };
                if at >= offset + mapping.size {
                    return Err(format!("{:#x} is reserved but not mapped", base + at));
                }
                if !mapping.access.contains(&device) {
                    return Err(format!(
                        "device {device} accesses {:#x}, mapped without access for it (cuMemSetAccess)",
                        base + at
                    ));
                }
                let take = (offset + mapping.size).min(end) - at;
                pieces.push(Piece {
                    phys: mapping.phys,
                    offset: at - offset,
                    len: take,
                });
                at += take;
            }
            return Ok(Resolved { pieces });
        }
        if len == 0 {
            return Ok(Resolved { pieces: Vec::new() });
        }
        Err(format!(
            "{address:#x} is not device memory (never allocated, or freed)"
        ))
    }

    /// The pinned host allocation holding `[ptr, ptr + len)`, if any.
    pub fn host_at(&self, ptr: usize, len: usize) -> Option<usize> {
        let (base, host) = self.host.range(..=ptr).next_back()?;
        (ptr + len <= base + host.size).then_some(*base)
    }

    /// Reads the pieces into one buffer.
    pub fn read(&self, pieces: &[Piece]) -> Result<Vec<u8>, String> {
        let mut out = Vec::new();
        for piece in pieces {
            let phys = self
                .phys
                .get(&piece.phys)
                .ok_or("physical memory freed while in use")?;
            out.extend_from_slice(
                &phys.data[piece.offset as usize..(piece.offset + piece.len) as usize],
            );
        }
        Ok(out)
    }

    /// Writes `bytes` over the pieces.
    pub fn write(&mut self, pieces: &[Piece], bytes: &[u8]) -> Result<(), String> {
        let mut at = 0usize;
        for piece in pieces {
            let phys = self
                .phys
                .get_mut(&piece.phys)
                .ok_or("physical memory freed while in use")?;
            let len = piece.len as usize;
            phys.data[piece.offset as usize..piece.offset as usize + len]
                .copy_from_slice(&bytes[at..at + len]);
            at += len;
        }
        Ok(())
    }

    /// Unmaps the mapping at `offset` of the range at `base`; frees its physical memory if it
    /// was released and this was its last mapping.
    pub fn unmap(&mut self, base: u64, offset: u64) -> Option<Mapping> {
        let mapping = self.reservations.get_mut(&base)?.mappings.remove(&offset)?;
        let free = match self.phys.get_mut(&mapping.phys) {
            Some(phys) => {
                phys.mappings -= 1;
                phys.released && phys.mappings == 0
            }
            None => false,
        };
        if free {
            self.drop_phys(mapping.phys);
        }
        Some(mapping)
    }
}
