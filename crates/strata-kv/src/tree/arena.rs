//! The node arena: slots taken lowest first, cut off its end when freed there, and the side
//! tables beside it (hashes, priorities, history keys) kept the arena's length and capacity.

use std::cmp::Reverse;

use super::{GdsfNode, Node, RadixTree};
use crate::policy::EvictionPolicy;

impl RadixTree {
    /// Puts `node` in a free arena slot (or a new one) and returns its id.
    pub(super) fn alloc_node(&mut self, node: Node) -> u32 {
        match self.free_ids.pop().map(|Reverse(i)| i) {
            Some(i) => {
                self.nodes[i as usize] = node;
                i
            }
            None => {
                if self.nodes.len() == self.nodes.capacity() {
                    // Grow by a quarter, not twice: the arena's slack is metadata too.
                    self.nodes.reserve_exact(self.nodes.len() / 4 + 16);
                }
                self.nodes.push(node);
                let len = self.nodes.len();
                self.grow_side_tables(len);
                (len - 1) as u32
            }
        }
    }

    /// Gives the cleared slot `i` back. The lowest free slot is reused first, and free slots
    /// at the arena's end are cut off, its capacity too once a third of it is spare: the
    /// arena (and the side tables beside it) follows the live nodes down as well as up.
    pub(super) fn release_id(&mut self, i: u32) {
        let mut len = self.nodes.len();
        if i as usize + 1 < len {
            self.free_ids.push(Reverse(i));
            return;
        }
        while len > 1 && !self.nodes[len - 1].live() {
            len -= 1;
        }
        self.nodes.truncate(len);
        if len < i as usize {
            // Free slots below `i` were cut too (`i` itself was never filed).
            self.free_ids.retain(|&Reverse(f)| (f as usize) < len);
        }
        if self.free_ids.capacity() > 2 * self.free_ids.len() + 64 {
            self.free_ids.shrink_to(self.free_ids.len() + 32);
        }
        if self.nodes.capacity() > len + len / 2 + 32 {
            self.nodes.shrink_to(len + len / 4 + 16);
        }
        let cap = self.nodes.capacity();
        fn cut<T>(v: &mut Vec<T>, len: usize, cap: usize) {
            v.truncate(len);
            v.shrink_to(cap);
        }
        cut(&mut self.hashes, len, cap);
        cut(&mut self.prio, len, cap);
        cut(&mut self.gdsf, len, cap);
    }

    /// Makes the side tables cover node ids below `len`, with the arena's capacity.
    pub(super) fn grow_side_tables(&mut self, len: usize) {
        let cap = self.nodes.capacity();
        fn grow<T: Clone>(v: &mut Vec<T>, len: usize, cap: usize, fill: T) {
            if v.len() < len {
                v.reserve_exact(cap - v.len());
                v.resize(len, fill);
            }
        }
        if self.namespace.is_some() {
            grow(&mut self.hashes, len, cap, Box::default());
        }
        if self.policy != EvictionPolicy::Lru {
            grow(&mut self.prio, len, cap, 0);
        }
        if self.policy.has_history() {
            grow(&mut self.gdsf, len, cap, GdsfNode::default());
        }
    }
}
