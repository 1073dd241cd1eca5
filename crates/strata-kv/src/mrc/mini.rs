//! Miniature simulations (Waldspurger et al., "Cache Modeling and Optimization using
//! Miniature Simulations", ATC '17): a cache of `C × rate` pages replayed over the sampled
//! page stream hits about the ratio a cache of `C` pages would over the whole stream, for any
//! policy. Here: Belady's MIN (with bypass: what no policy could beat) and page-granular forms
//! of the tree's policies (LRU, GDSF of equal-size pages, SIEVE, S3-FIFO, `auto`), over a bounded
//! window of recent sampled references.
//!
//! The references are dense ids (`0..n`, [`dense`]); each simulation counts the hits at the
//! references `counted` marks, the others only warming the cache (the window's first half) or
//! bringing a page in unasked (a request's generated tokens, cached when it ends).

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};

use rustc_hash::FxHashMap;

use crate::policy::{EvictionPolicy, Newcomers, UNIT};

/// `refs` renumbered densely in order of first appearance, and how many distinct there are.
pub fn dense(refs: &[u64]) -> (Vec<u32>, usize) {
    let mut ids: FxHashMap<u64, u32> = FxHashMap::default();
    let v = refs
        .iter()
        .map(|r| {
            let n = ids.len() as u32;
            *ids.entry(*r).or_insert(n)
        })
        .collect();
    (v, ids.len())
}

/// Counted references whose page was referenced before (the hits of a cache that never
/// evicts): the most any cache hits.
pub fn reuses(ids: &[u32], n: usize, counted: &[bool]) -> u64 {
    let mut seen = vec![false; n];
    let mut hits = 0;
    for (i, &p) in ids.iter().enumerate() {
        if std::mem::replace(&mut seen[p as usize], true) && counted[i] {
            hits += 1;
        }
    }
    hits
}

/// Counted hits of Belady's MIN with room for `cap` pages: evicts the page whose next counted
/// use is furthest ahead, and does not admit a page used later than everything cached; any
/// reference may admit its page (a policy can only do so at a reference): a bound no policy
/// beats on the counted references.
pub fn belady(ids: &[u32], n: usize, cap: usize, counted: &[bool]) -> u64 {
    const NEVER: u32 = u32::MAX;
    let mut next = vec![NEVER; ids.len()];
    let mut last = vec![NEVER; n];
    // The next counted use: an uncounted one earns nothing, it only lets the page in free.
    for i in (0..ids.len()).rev() {
        next[i] = last[ids[i] as usize];
        if counted[i] {
            last[ids[i] as usize] = i as u32;
        }
    }
    // A cached page's next use (NEVER: not cached), and a heap of (next use, page) whose
    // entries are live while they match it.
    let mut cached = vec![None::<u32>; n];
    let (mut len, mut hits) = (0usize, 0u64);
    let mut heap: BinaryHeap<(u32, u32)> = BinaryHeap::new();
    for (i, &p) in ids.iter().enumerate() {
        let nu = next[i];
        if let Some(e) = cached[p as usize].as_mut() {
            hits += counted[i] as u64;
            *e = nu;
            heap.push((nu, p));
            continue;
        }
        if nu == NEVER || cap == 0 {
            continue;
        }
        if len >= cap {
            let far = loop {
                let &(u, q) = heap.peek().expect("the cache is full");
                if cached[q as usize] == Some(u) {
                    break (u, q);
                }
                heap.pop();
            };
            if far.0 <= nu {
                continue;
            }
            heap.pop();
            cached[far.1 as usize] = None;
            len -= 1;
        }
        cached[p as usize] = Some(nu);
        len += 1;
        heap.push((nu, p));
    }
    hits
}

/// Counted hits of a cache of `cap` pages under `policy`, page by page.
pub fn policy(policy: EvictionPolicy, ids: &[u32], n: usize, cap: usize, counted: &[bool]) -> u64 {
    if cap == 0 {
        return 0;
    }
    match policy {
        EvictionPolicy::Lru => lru(ids, n, cap, counted),
        EvictionPolicy::Gdsf => gdsf(ids, n, cap, counted),
        EvictionPolicy::Sieve => sieve(ids, n, cap, counted),
        EvictionPolicy::S3Fifo => s3fifo(ids, n, cap, counted),
        EvictionPolicy::Auto => auto(ids, n, cap, counted),
    }
}

/// A doubly linked list over ids `0..n` (`NIL`: none), newest at the head.
struct List {
    prev: Vec<u32>,
    next: Vec<u32>,
    head: u32,
    tail: u32,
    len: usize,
}

const NIL: u32 = u32::MAX;

impl List {
    fn new(n: usize) -> List {
        List {
            prev: vec![NIL; n],
            next: vec![NIL; n],
            head: NIL,
            tail: NIL,
            len: 0,
        }
    }

    fn push_head(&mut self, p: u32) {
        self.prev[p as usize] = NIL;
        self.next[p as usize] = self.head;
        if self.head != NIL {
            self.prev[self.head as usize] = p;
        } else {
            self.tail = p;
        }
        self.head = p;
        self.len += 1;
    }

    fn remove(&mut self, p: u32) {
        let (a, b) = (self.prev[p as usize], self.next[p as usize]);
        match a {
            NIL => self.head = b,
            a => self.next[a as usize] = b,
        }
        match b {
            NIL => self.tail = a,
            b => self.prev[b as usize] = a,
        }
        self.len -= 1;
    }
}

fn lru(ids: &[u32], n: usize, cap: usize, counted: &[bool]) -> u64 {
    let mut list = List::new(n);
    let mut cached = vec![false; n];
    let mut hits = 0;
    for (i, &p) in ids.iter().enumerate() {
        if cached[p as usize] {
            hits += counted[i] as u64;
            list.remove(p);
        } else {
            if list.len >= cap {
                let t = list.tail;
                list.remove(t);
                cached[t as usize] = false;
            }
            cached[p as usize] = true;
        }
        list.push_head(p);
    }
    hits
}

/// GDSF of equal-size pages: priority = L + frequency; L rises to each victim's priority; an
/// evicted page's frequency is remembered (within the window: the tree keeps it in a bounded
/// sketch).
fn gdsf(ids: &[u32], n: usize, cap: usize, counted: &[bool]) -> u64 {
    let mut freq = vec![0u64; n];
    let mut prio = vec![None::<u64>; n];
    let mut heap: BinaryHeap<Reverse<(u64, u32)>> = BinaryHeap::new();
    let (mut l, mut len, mut hits) = (0u64, 0usize, 0u64);
    for (i, &p) in ids.iter().enumerate() {
        freq[p as usize] += 1;
        if prio[p as usize].is_some() {
            hits += counted[i] as u64;
        } else {
            if len >= cap {
                (l, _) = pop_least(&mut heap, &mut prio);
                len -= 1;
            }
            len += 1;
        }
        let v = l + freq[p as usize];
        prio[p as usize] = Some(v);
        heap.push(Reverse((v, p)));
    }
    hits
}

/// Takes the cached page of least priority out of `heap` (entries whose priority changed since
/// are stale and skipped) and `prio`: its priority and id.
fn pop_least(heap: &mut BinaryHeap<Reverse<(u64, u32)>>, prio: &mut [Option<u64>]) -> (u64, u32) {
    loop {
        let Reverse((v, q)) = heap.pop().expect("the cache is full");
        if prio[q as usize] == Some(v) {
            prio[q as usize] = None;
            return (v, q);
        }
    }
}

/// `auto`: GDSF's order (every access counted over the window) where a page never seen before
/// starts on probation with the credit [`Newcomers`] learns from which removed pages return.
fn auto(ids: &[u32], n: usize, cap: usize, counted: &[bool]) -> u64 {
    let (mut seen, mut freq) = (vec![0u64; n], vec![0u64; n]);
    let mut prio = vec![None::<u64>; n];
    let mut probation = vec![false; n];
    let mut newcomers = Newcomers::new(cap);
    let mut heap: BinaryHeap<Reverse<(u64, u32)>> = BinaryHeap::new();
    let (mut l, mut len, mut hits) = (0u64, 0usize, 0u64);
    for (i, &p) in ids.iter().enumerate() {
        let u = p as usize;
        seen[u] += 1;
        if prio[u].is_some() {
            hits += counted[i] as u64;
            freq[u] += UNIT as u64;
            probation[u] = false;
        } else {
            if len >= cap {
                let q;
                (l, q) = pop_least(&mut heap, &mut prio);
                len -= 1;
                newcomers.removed(q as u64, probation[q as usize], 1);
            }
            len += 1;
            newcomers.returned(u as u64, 1);
            probation[u] = seen[u] == 1;
            freq[u] = if probation[u] {
                newcomers.credit() as u64
            } else {
                seen[u] * UNIT as u64
            };
        }
        let v = l + freq[u];
        prio[u] = Some(v);
        heap.push(Reverse((v, p)));
    }
    hits
}

/// SIEVE: insertion order, a hit sets a visited bit, a hand from the oldest towards the newest
/// clears bits and evicts the first page without one.
fn sieve(ids: &[u32], n: usize, cap: usize, counted: &[bool]) -> u64 {
    let mut list = List::new(n);
    let mut cached = vec![false; n];
    let mut visited = vec![false; n];
    let (mut hand, mut hits) = (NIL, 0u64);
    for (i, &p) in ids.iter().enumerate() {
        if cached[p as usize] {
            hits += counted[i] as u64;
            visited[p as usize] = true;
            continue;
        }
        if list.len >= cap {
            let mut h = if hand == NIL { list.tail } else { hand };
            while visited[h as usize] {
                visited[h as usize] = false;
                h = match list.prev[h as usize] {
                    NIL => list.tail,
                    x => x,
                };
            }
            hand = list.prev[h as usize];
            list.remove(h);
            cached[h as usize] = false;
        }
        cached[p as usize] = true;
        visited[p as usize] = false;
        list.push_head(p);
    }
    hits
}

/// Where a page is in S3-FIFO.
#[derive(Clone, Copy, PartialEq)]
enum Queue {
    None,
    Small,
    Main,
}

/// S3-FIFO: new pages in a small FIFO (a tenth), promoted to the main FIFO when hit there or
/// remembered by the ghost FIFO of pages evicted from it; 2-bit frequencies, reinsertion.
fn s3fifo(ids: &[u32], n: usize, cap: usize, counted: &[bool]) -> u64 {
    let small_cap = (cap / 10).max(1);
    let mut at = vec![Queue::None; n];
    let mut freq = vec![0u8; n];
    // Ghost entries are live while their stamp is the page's.
    let mut ghost_stamp = vec![0u32; n];
    let (mut small, mut main) = (VecDeque::new(), VecDeque::new());
    let mut ghost: VecDeque<(u32, u32)> = VecDeque::new();
    let mut hits = 0u64;
    for (i, &p) in ids.iter().enumerate() {
        if at[p as usize] != Queue::None {
            hits += counted[i] as u64;
            freq[p as usize] = (freq[p as usize] + 1).min(3);
            continue;
        }
        while small.len() + main.len() >= cap {
            if small.len() >= small_cap || main.is_empty() {
                let t: u32 = small.pop_front().expect("the small queue holds pages");
                if freq[t as usize] > 0 {
                    freq[t as usize] = 0;
                    at[t as usize] = Queue::Main;
                    main.push_back(t);
                } else {
                    at[t as usize] = Queue::None;
                    let stamp = i as u32 + 1;
                    ghost_stamp[t as usize] = stamp;
                    ghost.push_back((t, stamp));
                    if ghost.len() > cap {
                        ghost.pop_front();
                    }
                }
            } else {
                let t: u32 = main.pop_front().expect("the main queue holds pages");
                if freq[t as usize] > 0 {
                    freq[t as usize] -= 1;
                    main.push_back(t);
                } else {
                    at[t as usize] = Queue::None;
                }
            }
        }
        let remembered = ghost_stamp[p as usize] != 0
            && ghost
                .front()
                .is_some_and(|&(_, s)| s <= ghost_stamp[p as usize]);
        ghost_stamp[p as usize] = 0;
        freq[p as usize] = 0;
        if remembered {
            at[p as usize] = Queue::Main;
            main.push_back(p);
        } else {
            at[p as usize] = Queue::Small;
            small.push_back(p);
        }
    }
    hits
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all(v: &[u32]) -> Vec<bool> {
        vec![true; v.len()]
    }

    fn ids(v: &[u32]) -> (Vec<u32>, usize) {
        dense(&v.iter().map(|&x| x as u64).collect::<Vec<_>>())
    }

    #[test]
    fn belady_on_a_known_sequence() {
        // 1 2 3 1 2 4 1 2 with two pages: MIN keeps 1 and 2 (4 bypassed): hits 1 2 1 2.
        let (v, n) = ids(&[1, 2, 3, 1, 2, 4, 1, 2]);
        assert_eq!(belady(&v, n, 2, &all(&v)), 4);
        // LRU with two pages hits nothing (3 evicts 1, 1 evicts 2, ...).
        assert_eq!(lru(&v, n, 2, &all(&v)), 0);
        assert_eq!(reuses(&v, n, &all(&v)), 4);
    }

    #[test]
    fn a_cache_holding_everything_hits_every_reuse() {
        let v: Vec<u32> = (0..5000u32).map(|i| (i * 7919) % 613).collect();
        let (v, n) = ids(&v);
        let c: Vec<bool> = (0..v.len()).map(|i| i >= 100 && i % 7 != 0).collect();
        let every = reuses(&v, n, &c);
        assert_eq!(belady(&v, n, n, &c), every);
        for p in EvictionPolicy::ALL {
            assert_eq!(policy(p, &v, n, n, &c), every, "{}", p.name());
        }
    }

    #[test]
    fn no_policy_beats_belady_and_hits_grow_with_size() {
        let mut x = 12345u64;
        let v: Vec<u32> = (0..20_000)
            .map(|_| {
                x = x
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                // Skewed: most references to few pages.
                let r = (x >> 33) as u32 % 1000;
                r * r / 1000
            })
            .collect();
        let (v, n) = ids(&v);
        let mut prev = 0;
        for cap in [4, 16, 64, 256, 1000] {
            let min = belady(&v, n, cap, &all(&v));
            assert!(min >= prev, "MIN grows with the size");
            prev = min;
            for p in EvictionPolicy::ALL {
                let h = policy(p, &v, n, cap, &all(&v));
                assert!(h <= min, "{} at {cap}: {h} > MIN {min}", p.name());
                assert!(h > 0, "{} at {cap} hits something", p.name());
            }
        }
    }
}
