//! The eviction sets' ordered set of keys: sorted runs of at most [`RUN`] keys, in a B-tree by
//! a lower bound of each run's keys (above every key of the run before: a run's first key when
//! it was made, 0 for the first run). A run that fills splits in two, except past the set's
//! last key, where a new run starts (keys given in order, as the clock gives them, fill their
//! runs whole); a run that falls under a quarter merges into a neighbour that has room. Taking
//! a run's first key leaves its bound as it is, so draining the oldest run (LRU's pattern)
//! touches that run only. Its memory is what [`KeySet::bytes`] reports: runs by capacity, the
//! B-tree at 80 bytes a run.

use std::collections::BTreeMap;
use std::ops::{Bound, RangeBounds};

/// Keys in a run at most.
const RUN: usize = 64;
/// Spare room a run grows by, and keeps at most twice of (a vector's doubling would leave
/// runs half empty).
const GROW: usize = 8;

/// Gives back `run`'s spare capacity beyond [`GROW`] once it passes twice that.
fn trim(run: &mut Vec<u128>) {
    if run.capacity() - run.len() > 2 * GROW {
        run.shrink_to(run.len() + GROW);
    }
}

/// Room in `run` for one more key.
fn room(run: &mut Vec<u128>) {
    if run.len() == run.capacity() {
        run.reserve_exact(GROW);
    }
}

#[derive(Debug, Default)]
pub(super) struct KeySet {
    /// Non-empty sorted runs by their bounds.
    runs: BTreeMap<u128, Vec<u128>>,
    len: usize,
}

impl KeySet {
    pub fn new() -> KeySet {
        KeySet::default()
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn first(&self) -> Option<&u128> {
        self.runs.values().next().map(|r| &r[0])
    }

    /// The bound of the run that holds `k`, or would.
    fn run_of(&self, k: u128) -> Option<u128> {
        self.runs.range(..=k).next_back().map(|(&b, _)| b)
    }

    /// The run that holds `k`, or would, with its bound: one search of the B-tree (the first
    /// run's bound is 0, so every key has one at or below it).
    fn run_mut(runs: &mut BTreeMap<u128, Vec<u128>>, k: u128) -> Option<(u128, &mut Vec<u128>)> {
        runs.range_mut(..=k).next_back().map(|(&b, r)| (b, r))
    }

    /// Adds `k`; false if it was there.
    pub fn insert(&mut self, k: u128) -> bool {
        let Some((b, run)) = KeySet::run_mut(&mut self.runs, k) else {
            self.runs.insert(0, vec![k]);
            self.len = 1;
            return true;
        };
        let Err(i) = run.binary_search(&k) else {
            return false;
        };
        self.len += 1;
        if run.len() < RUN {
            room(run);
            run.insert(i, k);
        } else if i == RUN && self.runs.last_key_value().is_some_and(|(&l, _)| l == b) {
            // Past the last key: a new run, so that keys given in order fill theirs whole.
            self.runs.insert(k, vec![k]);
            return true;
        } else {
            let run = self.runs.get_mut(&b).expect("the run");
            let mut tail = Vec::with_capacity(RUN / 2 + GROW);
            tail.extend_from_slice(&run[RUN / 2..]);
            run.truncate(RUN / 2);
            run.shrink_to(RUN / 2 + GROW);
            if i <= RUN / 2 {
                run.insert(i, k);
            } else {
                tail.insert(i - RUN / 2, k);
            }
            self.runs.insert(tail[0], tail);
        }
        true
    }

    /// Takes `k` out; false if it was not there.
    pub fn remove(&mut self, k: &u128) -> bool {
        let Some((b, run)) = KeySet::run_mut(&mut self.runs, *k) else {
            return false;
        };
        let Ok(i) = run.binary_search(k) else {
            return false;
        };
        run.remove(i);
        let (empty, short) = (run.is_empty(), run.len() < RUN / 4);
        if !empty && !short {
            trim(run);
        }
        self.len -= 1;
        if empty {
            self.runs.remove(&b);
            if b == 0 {
                // The next run is the first: its bound comes down to 0.
                if let Some((&n, _)) = self.runs.first_key_value() {
                    let run = self.runs.remove(&n).expect("the run");
                    self.runs.insert(0, run);
                }
            }
        } else if short {
            self.merge(b);
        }
        true
    }

    /// Merges the short run under bound `b` into a neighbour with room (the merged run keeps
    /// the lower bound), or else gives back its spare capacity beyond [`GROW`].
    fn merge(&mut self, b: u128) {
        let len = self.runs[&b].len();
        let after = (Bound::Excluded(b), Bound::Unbounded);
        let next = self.runs.range(after).next().map(|(&n, r)| (n, r.len()));
        let prev = self.runs.range(..b).next_back().map(|(&p, r)| (p, r.len()));
        let (into, from) = match (next, prev) {
            (Some((n, nl)), _) if len + nl <= RUN => (b, n),
            (_, Some((p, pl))) if len + pl <= RUN => (p, b),
            _ => {
                trim(self.runs.get_mut(&b).expect("the run"));
                return;
            }
        };
        let moved = self.runs.remove(&from).expect("the neighbour");
        let run = self.runs.get_mut(&into).expect("the run");
        run.reserve_exact(moved.len());
        run.extend_from_slice(&moved);
    }

    /// Every key in order.
    pub fn iter(&self) -> impl Iterator<Item = &u128> + '_ {
        self.runs.values().flatten()
    }

    /// The keys within `range`, in order.
    pub fn range(&self, range: impl RangeBounds<u128>) -> impl Iterator<Item = &u128> + '_ {
        let start = match range.start_bound() {
            Bound::Unbounded => None,
            Bound::Included(&lo) => Some((lo, true)),
            Bound::Excluded(&lo) => Some((lo, false)),
        };
        let from = start.and_then(|(lo, _)| self.run_of(lo));
        let runs = match from {
            Some(b) => self.runs.range(b..),
            None => self.runs.range(..),
        };
        let end = range.end_bound().cloned();
        runs.enumerate()
            .flat_map(move |(j, (_, run))| {
                let skip = match start {
                    Some((lo, with)) if j == 0 => {
                        run.partition_point(|&x| x < lo || (!with && x == lo))
                    }
                    _ => 0,
                };
                run[skip..].iter()
            })
            .take_while(move |&&k| match end {
                Bound::Unbounded => true,
                Bound::Included(hi) => k <= hi,
                Bound::Excluded(hi) => k < hi,
            })
    }

    /// Heap bytes: every run's allocation by capacity, and the B-tree of runs at 80 bytes a
    /// run (a 16-byte bound and a 24-byte vector, its nodes about half full).
    pub fn bytes(&self) -> usize {
        self.runs.values().map(|r| r.capacity() * 16).sum::<usize>() + self.runs.len() * 80
    }

    /// The runs are non-empty, within bounds, sorted, each above the one before and at or
    /// above its bound, and the count agrees with them.
    pub fn check(&self) -> Result<(), String> {
        let mut prev = None;
        let mut n = 0;
        if self.runs.keys().next().is_some_and(|&b| b != 0) {
            return Err("key set's first run is not bound at 0".into());
        }
        for (&b, run) in &self.runs {
            if run.is_empty() || run.len() > RUN || run[0] < b {
                return Err(format!("key set run of {} keys is malformed", run.len()));
            }
            for &k in run {
                if prev.is_some_and(|p| p >= k) {
                    return Err("key set out of order".into());
                }
                prev = Some(k);
            }
            n += run.len();
        }
        if n != self.len {
            return Err(format!("key set counts {} keys, holds {n}", self.len));
        }
        Ok(())
    }
}

impl<'a> IntoIterator for &'a KeySet {
    type Item = &'a u128;
    type IntoIter = std::iter::Flatten<std::collections::btree_map::Values<'a, u128, Vec<u128>>>;

    fn into_iter(self) -> Self::IntoIter {
        self.runs.values().flatten()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeSet;

    #[test]
    fn keys_in_order_fill_their_runs_whole() {
        let mut s = KeySet::new();
        for k in 0..10 * RUN as u128 {
            assert!(s.insert(k));
        }
        s.check().unwrap();
        assert_eq!(s.runs.len(), 10);
        // Draining from the front keeps one run's bound and shifts nothing else.
        for k in 0..RUN as u128 / 2 {
            assert!(s.remove(&k));
        }
        s.check().unwrap();
        assert_eq!(s.first(), Some(&(RUN as u128 / 2)));
        assert!(s.bytes() <= 10 * ((RUN + GROW) * 16 + 80), "{}", s.bytes());
    }

    proptest! {
        /// Any sequence of inserts and removes leaves the same keys, in the same order, as a
        /// B-tree given the same, and every range agrees.
        #[test]
        fn agrees_with_a_btree(
            ops in proptest::collection::vec((any::<bool>(), 0u128..400), 0..2000),
            probes in proptest::collection::vec(0u128..420, 8),
        ) {
            let (mut s, mut b) = (KeySet::new(), BTreeSet::new());
            for (add, k) in ops {
                let k = k << 60 | k; // high and low halves both matter
                if add {
                    prop_assert_eq!(s.insert(k), b.insert(k));
                } else {
                    prop_assert_eq!(s.remove(&k), b.remove(&k));
                }
                prop_assert_eq!(s.len(), b.len());
            }
            s.check().unwrap();
            prop_assert!(s.iter().eq(b.iter()));
            prop_assert_eq!(s.first(), b.first());
            for p in probes {
                let p = p << 60 | p;
                prop_assert!(s.range(p..).eq(b.range(p..)));
                prop_assert!(s.range(..p).eq(b.range(..p)));
                prop_assert!(s.range(..=p).eq(b.range(..=p)));
                let ex = (Bound::Excluded(p), Bound::Unbounded);
                prop_assert!(s.range(ex).eq(b.range(ex)));
                let q = p.saturating_add(5 << 60 | 5);
                prop_assert!(s.range(p..q).eq(b.range(p..q)));
            }
        }
    }
}
