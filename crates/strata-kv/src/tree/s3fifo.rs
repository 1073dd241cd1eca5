//! S3-FIFO (Yang et al., SOSP '23) over the tree's evictable leaves, per tier.
//!
//! Every node is in the small queue (new nodes) or the main queue (nodes that were hit while
//! small, or whose start is in the ghost: the eviction history remembers where evicted nodes
//! started, under the same per-node key GDSF uses). A node's priority is its queue (the top bit:
//! small sorts first) and its position (a sequence number, taken again on reinsertion); a hit
//! only raises its 2-bit frequency. A victim is taken from the small queue while small nodes
//! hold over a tenth of the tier's pages: its oldest leaf moves to main if it was hit, else it
//! goes; from the main queue, the oldest leaf that was hit is reinserted at the tail with one
//! hit fewer, else it goes. Queues are over leaves only: an inner node waits for its children.

use super::{key_id, NodeId, RadixTree, Slot};

/// The main queue's bit of a priority.
pub(super) const MAIN: u64 = 1 << 63;

/// The most hits a node counts.
const MAX_FREQ: u32 = 3;

impl RadixTree {
    /// Places the new node `id` (its key `chain` where it starts) in a queue.
    pub(super) fn s3_place(&mut self, id: u32, chain: u64) {
        let ghost = self.history.take(chain) > 0;
        self.seq += 1;
        self.prio[id as usize] = self.seq | if ghost { MAIN } else { 0 };
        self.set_freq(id, 0);
    }

    pub(super) fn s3_small(&self, id: u32) -> bool {
        self.prio[id as usize] & MAIN == 0
    }

    /// A hit: one more (up to 3), no reordering.
    pub(super) fn s3_hit(&mut self, id: u32) {
        self.set_freq(id, (self.freq(id) + 1).min(MAX_FREQ));
    }

    /// Pages of small nodes in `slot` change by `delta` pages of `id` (a no-op for main nodes).
    pub(super) fn s3_count(&mut self, id: u32, slot: Slot, pages: usize, add: bool) {
        if self.s3_small(id) {
            let c = &mut self.small_pages[slot as usize];
            *c = if add { *c + pages } else { *c - pages };
        }
    }

    /// Moves `id` to the main queue's tail with frequency `freq`.
    fn s3_requeue(&mut self, id: u32, freq: u32) {
        self.unfile(id);
        if self.s3_small(id) {
            let (d, h) = (
                self.slot(id, Slot::Device).len(),
                self.slot(id, Slot::Host).len(),
            );
            self.s3_count(id, Slot::Device, d, false);
            self.s3_count(id, Slot::Host, h, false);
        }
        self.seq += 1;
        self.prio[id as usize] = self.seq | MAIN;
        self.set_freq(id, freq);
        self.refresh(id);
    }

    /// The next victim of `slot`'s leaves not in `skip`, moving and reinserting leaves on the
    /// way as S3-FIFO does. Each step either returns or lowers some leaf's frequency or moves a
    /// small leaf to main, so it ends.
    pub(super) fn s3_victim(&mut self, slot: Slot, skip: &[NodeId]) -> Option<NodeId> {
        let split = (MAIN as u128) << 64;
        loop {
            let set = match slot {
                Slot::Device => &self.device_leaves,
                Slot::Host => &self.host_leaves,
            };
            let ok = |k: &&u128| !skip.contains(&key_id(k));
            let small = set.range(..split).find(ok).copied();
            let main = set.range(split..).find(ok).copied();
            let over = self.small_pages[slot as usize] * 10 > self.pages_in(slot);
            let pick = match (small, main) {
                (Some(s), Some(_)) if over => s,
                (Some(_), Some(m)) => m,
                (Some(s), None) => s,
                (None, Some(m)) => m,
                (None, None) => return None,
            };
            let id = key_id(&pick).0;
            let freq = self.freq(id);
            if freq == 0 {
                return Some(NodeId(id));
            }
            // A small leaf that was hit moves to main; a main leaf goes round once more.
            let next = if self.s3_small(id) { 0 } else { freq - 1 };
            self.s3_requeue(id, next);
        }
    }
}
