//! KV-cache events: what a KV-aware router needs to mirror this cache (vLLM's `BlockStored`,
//! `BlockRemoved`, `AllBlocksCleared`). The block manager records one wherever a tier's set of
//! cached blocks changes, in order; the owner takes them once per step (`take`).
//!
//! A consumer that starts empty and applies every event in order holds exactly the cached block
//! names of each tier (`BlockManager::cached_block_hashes`). Names are the 64-bit external part
//! of each block's identity (`BlockHash::external`); a stored event carries the block's tokens, so
//! a consumer can name blocks its own way (Dynamo's indexer hashes the tokens).

use crate::device::Device;
use crate::kv::prefix_cache::BlockHash;

/// One change to the cached blocks of a tier.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvEvent {
    /// Full blocks became cached, each the child of the one before it (the first of
    /// `parent_block_hash`, None for a prompt's first block). `token_ids` holds every block's
    /// tokens in order, `block_size` each.
    BlockStored {
        block_hashes: Vec<u64>,
        parent_block_hash: Option<u64>,
        token_ids: Vec<u32>,
        block_size: usize,
        /// The prefix-cache extra key (adapter and cache salt), None for plain prompts.
        extra_key: Option<u64>,
        medium: Device,
        /// The KV-cache group whose blocks these are (vLLM's `group_idx`; 0 with one group).
        group: usize,
    },
    /// Cached blocks left the tier (evicted, or their content became stale).
    BlockRemoved { block_hashes: Vec<u64>, medium: Device, group: usize },
    /// Every tier was emptied (`reset_prefix_cache`).
    AllBlocksCleared,
}

/// The events since the last `take`, off until `enable` (nothing is kept for nobody).
#[derive(Debug, Clone, Default)]
pub struct KvEventLog {
    enabled: bool,
    events: Vec<KvEvent>,
}

impl KvEventLog {
    pub fn enable(&mut self) {
        self.enabled = true;
    }

    pub fn is_enabled(&self) -> bool {
        self.enabled
    }

    /// A block became cached. Joins the last event when it continues that event's chain.
    pub fn stored(
        &mut self,
        hash: BlockHash,
        parent: Option<BlockHash>,
        tokens: &[u32],
        extra_key: Option<u64>,
        medium: Device,
    ) {
        if !self.enabled {
            return;
        }
        let (group, hash, parent) = (hash.group(), hash.external(), parent.map(BlockHash::external));
        if let Some(KvEvent::BlockStored {
            block_hashes,
            token_ids,
            block_size,
            extra_key: last_extra_key,
            medium: last_medium,
            group: last_group,
            ..
        }) = self.events.last_mut()
        {
            if *last_medium == medium
                && *last_group == group
                && *last_extra_key == extra_key
                && *block_size == tokens.len()
                && parent.is_some()
                && block_hashes.last().copied() == parent
            {
                block_hashes.push(hash);
                token_ids.extend_from_slice(tokens);
                return;
            }
        }
        self.events.push(KvEvent::BlockStored {
            block_hashes: vec![hash],
            parent_block_hash: parent,
            token_ids: tokens.to_vec(),
            block_size: tokens.len(),
            extra_key,
            medium,
            group,
        });
    }

    /// A cached block left its tier. Joins the last event when that removed blocks of the same
    /// tier and group.
    pub fn removed(&mut self, hash: BlockHash, medium: Device) {
        if !self.enabled {
            return;
        }
        let group = hash.group();
        if let Some(KvEvent::BlockRemoved { block_hashes, medium: last_medium, group: last_group }) =
            self.events.last_mut()
        {
            if *last_medium == medium && *last_group == group {
                block_hashes.push(hash.external());
                return;
            }
        }
        self.events.push(KvEvent::BlockRemoved { block_hashes: vec![hash.external()], medium, group });
    }

    pub fn cleared(&mut self) {
        if self.enabled {
            self.events.push(KvEvent::AllBlocksCleared);
        }
    }

    /// Every event since the last call, oldest first.
    pub fn take(&mut self) -> Vec<KvEvent> {
        std::mem::take(&mut self.events)
    }

    pub fn len(&self) -> usize {
        self.events.len()
    }

    pub fn is_empty(&self) -> bool {
        self.events.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(value: u128) -> BlockHash {
        BlockHash(value)
    }

    #[test]
    fn nothing_is_kept_until_enabled() {
        let mut log = KvEventLog::default();
        log.stored(h(1), None, &[1, 2], None, Device::Gpu);
        log.cleared();
        assert!(log.take().is_empty());
    }

    #[test]
    fn a_chain_of_stores_is_one_event_and_removes_of_a_tier_join() {
        let mut log = KvEventLog::default();
        log.enable();
        log.stored(h(1), None, &[1, 2], None, Device::Gpu);
        log.stored(h(2), Some(h(1)), &[3, 4], None, Device::Gpu);
        log.stored(h(3), Some(h(9)), &[5, 6], None, Device::Gpu); // another chain
        log.stored(h(4), Some(h(3)), &[7, 8], None, Device::Cpu); // another tier
        log.removed(h(1), Device::Gpu);
        log.removed(h(2), Device::Gpu);
        log.removed(h(4), Device::Cpu);
        log.cleared();
        let events = log.take();
        assert_eq!(
            events[0],
            KvEvent::BlockStored {
                block_hashes: vec![1, 2],
                parent_block_hash: None,
                token_ids: vec![1, 2, 3, 4],
                block_size: 2,
                extra_key: None,
                medium: Device::Gpu,
                group: 0,
            }
        );
        assert!(
            matches!(&events[1], KvEvent::BlockStored { block_hashes, parent_block_hash: Some(9), .. } if *block_hashes == vec![3])
        );
        assert!(matches!(&events[2], KvEvent::BlockStored { medium: Device::Cpu, .. }));
        assert_eq!(events[3], KvEvent::BlockRemoved { block_hashes: vec![1, 2], medium: Device::Gpu, group: 0 });
        assert_eq!(events[4], KvEvent::BlockRemoved { block_hashes: vec![4], medium: Device::Cpu, group: 0 });
        assert_eq!(events[5], KvEvent::AllBlocksCleared);
        assert!(log.take().is_empty());
    }

    #[test]
    fn events_carry_the_kv_group_and_do_not_join_across_groups() {
        let mut log = KvEventLog::default();
        log.enable();
        log.stored(h(1), None, &[1, 2], None, Device::Gpu);
        log.stored(h(2).in_group(1), Some(h(1).in_group(1)), &[3, 4], None, Device::Gpu);
        log.removed(h(1), Device::Gpu);
        log.removed(h(2).in_group(1), Device::Gpu);
        let events = log.take();
        assert_eq!(events.len(), 4);
        assert!(
            matches!(&events[1], KvEvent::BlockStored { block_hashes, parent_block_hash: Some(1), group: 1, .. } if *block_hashes == vec![2])
        );
        assert_eq!(events[3], KvEvent::BlockRemoved { block_hashes: vec![2], medium: Device::Gpu, group: 1 });
    }
}
