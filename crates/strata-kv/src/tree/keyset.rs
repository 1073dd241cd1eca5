//! The eviction sets' ordered set of keys: sorted runs of at most [`RUN`] keys, each found by
//! its first key. A run that fills splits in two, except past the set's last key, where a new
//! run starts (keys given in order, as the clock gives them, fill their runs whole); a run
//! that falls under a quarter merges into a neighbour that has room. Its memory is what
//! [`KeySet::bytes`] reports, allocations by their capacity: 17–25 bytes a key as the
//! policies use it (a B-tree of the same 16-byte keys takes about 32).

use std::ops::{Bound, RangeBounds};

/// Keys in a run at most.
const RUN: usize = 64;
/// Spare room a run grows by, and keeps at most twice of (a vector's doubling would leave
/// runs half empty).
const GROW: usize = 8;

/// Room in `run` for one more key.
fn room(run: &mut Vec<u128>) {
    if run.len() == run.capacity() {
        run.reserve_exact(GROW);
    }
}

#[derive(Debug, Default)]
pub(super) struct KeySet {
    /// Sorted, non-empty runs, each after the one before.
    runs: Vec<Vec<u128>>,
    /// `runs[i][0]`, for the search.
    firsts: Vec<u128>,
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
        self.runs.first().map(|r| &r[0])
    }

    /// The run that holds `k`, or would (0 when it would come before every key).
    fn run_of(&self, k: u128) -> usize {
        self.firsts.partition_point(|&f| f <= k).saturating_sub(1)
    }

    /// Adds `k`; false if it was there.
    pub fn insert(&mut self, k: u128) -> bool {
        if self.runs.is_empty() {
            self.runs.push(vec![k]);
            self.firsts.push(k);
            self.len = 1;
            return true;
        }
        let r = self.run_of(k);
        let Err(i) = self.runs[r].binary_search(&k) else {
            return false;
        };
        self.len += 1;
        if self.runs[r].len() < RUN {
            room(&mut self.runs[r]);
            self.runs[r].insert(i, k);
            self.firsts[r] = self.runs[r][0];
            return true;
        }
        if i == RUN && r + 1 == self.runs.len() {
            // Past the last key: a new run, so that keys given in order fill theirs whole.
            self.runs.push(vec![k]);
            self.firsts.push(k);
            return true;
        }
        let head = &mut self.runs[r];
        let mut tail = Vec::with_capacity(RUN / 2 + GROW);
        tail.extend_from_slice(&head[RUN / 2..]);
        head.truncate(RUN / 2);
        head.shrink_to(RUN / 2 + GROW);
        if i <= RUN / 2 {
            head.insert(i, k);
        } else {
            tail.insert(i - RUN / 2, k);
        }
        self.firsts[r] = self.runs[r][0];
        self.firsts.insert(r + 1, tail[0]);
        self.runs.insert(r + 1, tail);
        true
    }

    /// Takes `k` out; false if it was not there.
    pub fn remove(&mut self, k: &u128) -> bool {
        if self.runs.is_empty() {
            return false;
        }
        let r = self.run_of(*k);
        let Ok(i) = self.runs[r].binary_search(k) else {
            return false;
        };
        self.len -= 1;
        let run = &mut self.runs[r];
        run.remove(i);
        if run.is_empty() {
            self.runs.remove(r);
            self.firsts.remove(r);
            return true;
        }
        self.firsts[r] = run[0];
        if run.len() < RUN / 4 {
            self.merge(r);
        } else if run.capacity() - run.len() > 2 * GROW {
            run.shrink_to(run.len() + GROW);
        }
        true
    }

    /// Merges the short run `r` into a neighbour with room, or else gives back its spare
    /// capacity beyond [`GROW`].
    fn merge(&mut self, r: usize) {
        let fits = |a: usize, b: usize| self.runs[a].len() + self.runs[b].len() <= RUN;
        let pair = if r + 1 < self.runs.len() && fits(r, r + 1) {
            Some(r)
        } else if r > 0 && fits(r - 1, r) {
            Some(r - 1)
        } else {
            None
        };
        match pair {
            Some(a) => {
                let b = self.runs.remove(a + 1);
                self.firsts.remove(a + 1);
                let run = &mut self.runs[a];
                run.reserve_exact(b.len());
                run.extend_from_slice(&b);
            }
            None => {
                let run = &mut self.runs[r];
                if run.capacity() - run.len() > 2 * GROW {
                    run.shrink_to(run.len() + GROW);
                }
            }
        }
    }

    /// Every key in order.
    pub fn iter(&self) -> impl Iterator<Item = &u128> + '_ {
        self.runs.iter().flatten()
    }

    /// The keys within `range`, in order.
    pub fn range(&self, range: impl RangeBounds<u128>) -> impl Iterator<Item = &u128> + '_ {
        let from = |lo: u128, with: bool| {
            if self.runs.is_empty() {
                return (0, 0);
            }
            let r = self.run_of(lo);
            (
                r,
                self.runs[r].partition_point(|&x| x < lo || (!with && x == lo)),
            )
        };
        let (r, i) = match range.start_bound() {
            Bound::Unbounded => (0, 0),
            Bound::Included(&lo) => from(lo, true),
            Bound::Excluded(&lo) => from(lo, false),
        };
        let end = range.end_bound().cloned();
        let head = self.runs.get(r).map_or(&[][..], |run| &run[i..]);
        head.iter()
            .chain(self.runs.iter().skip(r + 1).flatten())
            .take_while(move |&&k| match end {
                Bound::Unbounded => true,
                Bound::Included(hi) => k <= hi,
                Bound::Excluded(hi) => k < hi,
            })
    }

    /// Heap bytes: every run's allocation and the two lists of runs, by capacity.
    pub fn bytes(&self) -> usize {
        self.runs.iter().map(|r| r.capacity() * 16).sum::<usize>()
            + self.runs.capacity() * std::mem::size_of::<Vec<u128>>()
            + self.firsts.capacity() * 16
    }

    /// The runs are sorted, non-empty, within bounds and after one another, and the firsts
    /// and the count agree with them.
    pub fn check(&self) -> Result<(), String> {
        let mut prev = None;
        let mut n = 0;
        for (r, run) in self.runs.iter().enumerate() {
            if run.is_empty() || run.len() > RUN || self.firsts.get(r) != run.first() {
                return Err(format!(
                    "key set run {r} of {} keys is malformed",
                    run.len()
                ));
            }
            for &k in run {
                if prev.is_some_and(|p| p >= k) {
                    return Err(format!("key set out of order at run {r}"));
                }
                prev = Some(k);
            }
            n += run.len();
        }
        if n != self.len || self.firsts.len() != self.runs.len() {
            return Err(format!("key set counts {} keys, holds {n}", self.len));
        }
        Ok(())
    }
}

impl<'a> IntoIterator for &'a KeySet {
    type Item = &'a u128;
    type IntoIter = std::iter::Flatten<std::slice::Iter<'a, Vec<u128>>>;

    fn into_iter(self) -> Self::IntoIter {
        self.runs.iter().flatten()
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
        assert!(s.bytes() < 10 * RUN * 16 + 1024, "{}", s.bytes());
        assert!(!s.insert(5));
        assert_eq!(s.first(), Some(&0));
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
            }
        }
    }
}
