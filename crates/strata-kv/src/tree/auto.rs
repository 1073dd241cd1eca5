//! `auto`: GDSF whose credit for a leaf never seen before is learnt from the traffic.
//!
//! Everything is GDSF's (priority = L + frequency, L rising to each victim's priority, the
//! frequency of a removed node remembered in the eviction history under the key of where it
//! started), in fixed point ([`UNIT`] a whole access), with one difference: a new leaf whose key
//! the history does not know starts *on probation* with a credit below one access, so one-off
//! continuations go before what was used, while a leaf the history knows, or one that is hit,
//! starts or moves as under GDSF. How much credit a newcomer deserves depends on the workload
//! (a conversation's next turn comes back soon; a corpus of one-off documents never does), so it
//! is set the way ARC sets its target: a removed node's key is remembered for about one cache
//! of removed pages in one of two ghosts (removed on probation, or not: `policy::Newcomers`);
//! over each window of removed pages (an eighth of the cache), if pages removed on probation
//! came back (while remembered) more often per removed page than the others, newcomers were
//! under-rated and the credit rises one step, else it falls one step, within [0.25, 1] access.
//! Counts decay by a tenth per window, so the credit follows a workload that changes.
//!
//! Nothing here is tuned to a trace: the start (half an access), the step (a twentieth), the
//! window (an eighth of the cache) and the decay are round numbers; docs/BENCHMARKS.md
//! ("Eviction that learns the workload") shows what halving or doubling each does. Metadata:
//! one flag bit per node and half a byte per cached page (the two ghosts), beside
//! GDSF's.

use super::node::{PROBATION, RETIRED};
use super::RadixTree;
use crate::policy::UNIT;

impl RadixTree {
    /// The new leaf `id` (key `chain`, `pages` pages): back with its remembered accesses and
    /// one more, or on probation with the credit.
    pub(super) fn auto_place(&mut self, id: u32, chain: u64, pages: usize) {
        // A return whether or not the history still knows the key (it forgets on its own).
        self.adaptive.returned(chain, pages);
        let known = self.history.take(chain);
        let n = &mut self.nodes[id as usize];
        if known > 0 {
            n.set(PROBATION, false);
            self.set_freq(id, known.saturating_add(1).saturating_mul(UNIT));
        } else {
            n.set(PROBATION, true);
            self.set_freq(id, self.adaptive.credit());
        }
    }

    /// `id` (its key `chain`, `pages` pages) leaves the tree: its accesses go to the history
    /// (a part access, the insertion's, counts whole), its key to the probation ghost if it
    /// never earned one. Removals the policy did not choose teach the credit nothing: those
    /// the operator asked for (a flush), and retired answers (a session's signal, not the
    /// newcomers' worth).
    pub(super) fn auto_removed(&mut self, id: u32, chain: u64, pages: usize) {
        let accesses = self.freq(id).div_ceil(UNIT).max(1);
        self.history.record(chain, accesses);
        if !self.flushing && !self.nodes[id as usize].has(RETIRED) {
            let probation = self.nodes[id as usize].has(PROBATION);
            self.adaptive.removed(chain, probation, pages);
        }
    }

    /// What `auto` has learnt so far (the credit a newcomer gets now, and the removals and
    /// returns it came from); `None` under another policy.
    pub fn auto_learning(&self) -> Option<crate::stats::AutoLearning> {
        (self.policy == crate::EvictionPolicy::Auto).then(|| self.adaptive.learning())
    }
}
