//! Shared LRU bookkeeping for capacity-capped backends.

use std::collections::BTreeMap;

use rustc_hash::FxHashMap;

use crate::hash::PageHash;

#[derive(Default)]
pub(crate) struct LruIndex {
    map: FxHashMap<PageHash, (u64, u64)>,
    order: BTreeMap<u64, PageHash>,
    tick: u64,
    pub(crate) bytes: u64,
}

impl LruIndex {
    pub(crate) fn len(&self) -> usize {
        self.map.len()
    }

    pub(crate) fn contains(&self, h: &PageHash) -> bool {
        self.map.contains_key(h)
    }

    /// Inserts or refreshes `h` with `size` bytes.
    pub(crate) fn touch(&mut self, h: PageHash, size: u64) {
        self.tick += 1;
        if let Some((t, s)) = self.map.insert(h, (self.tick, size)) {
            self.order.remove(&t);
            self.bytes -= s;
        }
        self.order.insert(self.tick, h);
        self.bytes += size;
    }

    pub(crate) fn remove(&mut self, h: &PageHash) -> bool {
        match self.map.remove(h) {
            Some((t, s)) => {
                self.order.remove(&t);
                self.bytes -= s;
                true
            }
            None => false,
        }
    }

    /// Entries larger than `size`.
    pub(crate) fn larger_than(&self, size: u64) -> Vec<PageHash> {
        self.map
            .iter()
            .filter(|(_, &(_, s))| s > size)
            .map(|(h, _)| *h)
            .collect()
    }

    /// Least recently used entry.
    pub(crate) fn oldest(&self) -> Option<PageHash> {
        self.order.first_key_value().map(|(_, h)| *h)
    }
}
