//! Scope tags of live blocks and their byte counts (see `alloc::scope`).
//!
//! An allocation takes the tag of the request that made it; its block size is counted in
//! `MemoryStats::scopes` under the tag's name from `malloc` to `free`, like
//! `allocated_bytes`. A cache above the engine that hands a live block to a new request
//! (CubeCL's exact-size reuse in the runtime) moves the block to the new request's tag with
//! [`Engine::retag`].

use super::{CachedAbove, Engine};
use crate::alloc::block::BlockId;
use crate::alloc::error::AllocError;
use crate::alloc::history::PhaseStage;
use crate::alloc::scope::Tag;
use crate::alloc::stats::Stat;
use crate::device::DeviceMemory;

impl<D: DeviceMemory> Engine<D> {
    /// The scope of the request about to be served (`None` after it, or for no scope).
    pub fn set_request_tag(&mut self, tag: Option<Tag>) {
        if let Some(history) = &mut self.history {
            history.set_request_tag(tag.clone());
        }
        self.request_tag = tag;
    }

    /// Records that phase `name` begins or ends now (while the history is recorded).
    pub fn mark_phase(&mut self, name: &str, stage: PhaseStage) {
        if let Some(history) = &mut self.history {
            history.mark_phase(name, stage);
        }
    }

    /// Tags a block just allocated with the request's scope.
    pub(super) fn tag(&mut self, block: BlockId) {
        if let Some(tag) = self.request_tag.clone() {
            let size = self.blocks[block].size();
            self.scope_stat(&tag).increase(size);
            self.blocks[block].tag = Some(tag);
        }
    }

    /// Takes the tag off a block being freed, and its bytes off the tag's count.
    pub(super) fn untag(&mut self, block: BlockId) {
        if let Some(tag) = self.blocks[block].tag.take() {
            let size = self.blocks[block].size();
            self.scope_stat(&tag).decrease(size);
        }
    }

    /// Moves live allocation `id` (handed out as `block`) to `tag`'s count (`None`: no scope).
    ///
    /// # Errors
    /// [`AllocError::InvalidFree`] when `id` is not live as `block`.
    pub fn retag(&mut self, id: u64, block: BlockId, tag: Option<Tag>) -> Result<(), AllocError> {
        let block = self.live_block(id, block)?;
        if self.blocks[block].tag == tag {
            return Ok(());
        }
        self.untag(block);
        let saved = std::mem::replace(&mut self.request_tag, tag);
        self.tag(block);
        self.request_tag = saved;
        Ok(())
    }

    /// Moves every live allocation of scope `from` to `to` (`None`: no scope), but those a
    /// layer above caches (`cached`: no tensor holds them, they keep their scope until reused);
    /// returns the bytes moved.
    pub fn move_scope(&mut self, from: &str, to: Option<Tag>, cached: &CachedAbove) -> u64 {
        let cached: std::collections::HashSet<BlockId> =
            self.live_cached(cached).into_iter().collect();
        let moving: Vec<BlockId> = self
            .blocks
            .iter()
            .filter(|(id, b)| {
                b.tag.as_ref().is_some_and(|t| t.name() == from) && !cached.contains(id)
            })
            .map(|(id, _)| id)
            .collect();
        let saved = std::mem::replace(&mut self.request_tag, to);
        let mut moved = 0;
        for block in moving {
            moved += self.blocks[block].size();
            self.untag(block);
            self.tag(block);
        }
        self.request_tag = saved;
        moved
    }

    /// The count of `tag`'s bytes, made on first use.
    fn scope_stat(&mut self, tag: &Tag) -> &mut Stat {
        let scopes = &mut self.stats_mut().scopes;
        if !scopes.contains_key(tag.name()) {
            scopes.insert(tag.name().to_owned(), Stat::default());
        }
        scopes.get_mut(tag.name()).expect("inserted above")
    }
}
