//! Random operation sequences against the tiered cache, checked after every step against a
//! simple reference model: the set of page prefixes ever computed, the locks held, and the bytes
//! each page must contain.

use std::collections::HashSet;

use proptest::prelude::*;

mod common;
use strata_kv::memory::HeapAllocator;
use strata_kv::testing::{verify_tree_bytes, write_expected_page};
use strata_kv::{
    CacheConfig, CacheMatch, EvictionPolicy, HashNamespace, NodeId, PageHash, PageLayout, PoolKind,
    Ticket, TieredCache, WritePolicy,
};

#[derive(Clone, Debug)]
enum Op {
    Run(u8, u8),
    Match(u8, u8),
    Hold(u8, u8),
    Release(u8),
    LoadBackAsync(u8, u8),
    EvictDevice(u8),
    EvictHost(u8),
    Poll,
    WaitAll,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0u8..8, 1u8..40).prop_map(|(s, l)| Op::Run(s, l)),
        2 => (0u8..8, 1u8..40).prop_map(|(s, l)| Op::Match(s, l)),
        1 => (0u8..8, 1u8..40).prop_map(|(s, l)| Op::Hold(s, l)),
        1 => any::<u8>().prop_map(Op::Release),
        1 => (0u8..8, 1u8..40).prop_map(|(s, l)| Op::LoadBackAsync(s, l)),
        1 => (1u8..12).prop_map(Op::EvictDevice),
        1 => (1u8..12).prop_map(Op::EvictHost),
        1 => Just(Op::Poll),
        1 => Just(Op::WaitAll),
    ]
}

/// Sequences share prefixes by group so nodes split and share.
fn tokens(s: u8, len: u8) -> Vec<u32> {
    common::tokens(s, len, 3, 10)
}

struct World {
    cache: TieredCache,
    ns: HashNamespace,
    ps: usize,
    /// Every page prefix ever computed (the reference for "no false hits").
    computed: HashSet<Vec<u32>>,
    /// Held locks: node, tokens and how many tokens were cached when locked.
    held: Vec<(NodeId, Vec<u32>, usize, Option<Ticket>)>,
}

impl World {
    fn longest_computed(&self, t: &[u32]) -> usize {
        let mut k = 0;
        while k + self.ps <= t.len() && self.computed.contains(&t[..k + self.ps]) {
            k += self.ps;
        }
        k
    }

    fn check_match(&self, t: &[u32], m: &CacheMatch) {
        let tree_part = m.device_tokens + m.host_tokens;
        assert!(
            tree_part <= self.longest_computed(t),
            "false hit: {tree_part} tokens of {t:?}"
        );
        assert!(
            m.cached_tokens() <= self.longest_computed(t),
            "false L3 hit"
        );
    }

    fn run(&mut self, t: &[u32]) {
        let m = self.cache.match_prefix(t);
        self.check_match(t, &m);
        self.cache.lock(m.last);
        if let Some(tk) = self.cache.prefetch(t, &m) {
            self.cache.wait(tk);
        }
        let m2 = self.cache.match_prefix(t);
        self.check_match(t, &m2);
        self.cache.lock(m2.last);
        if let Some(tk) = self.cache.load_back(&m2) {
            self.cache.wait(tk);
        }
        // Whatever did not come back to device (no room) is recomputed, like a real engine would.
        let have = self.cache.tree().peek(t).0 / self.ps;
        let total = t.len() / self.ps;
        if let Some(pages) = self.cache.alloc_device(total - have) {
            let hashes = self
                .ns
                .chain(PageHash::ROOT, &t[..total * self.ps], self.ps);
            let dev = self.cache.device_pool().unwrap();
            for (i, &p) in pages.iter().enumerate() {
                write_expected_page(dev, p, &hashes[have + i]);
            }
            self.cache.insert(t, &pages, have);
            for k in 1..=total {
                self.computed.insert(t[..k * self.ps].to_vec());
            }
        }
        self.cache.unlock(m2.last);
        self.cache.unlock(m.last);
    }

    fn verify_bytes(&self) {
        verify_tree_bytes(&self.cache);
    }

    fn step(&mut self, op: &Op) {
        match *op {
            Op::Run(s, l) => self.run(&tokens(s, l)),
            Op::Match(s, l) => {
                let t = tokens(s, l);
                let m = self.cache.match_prefix(&t);
                self.check_match(&t, &m);
            }
            Op::Hold(s, l) => {
                let t = tokens(s, l);
                let m = self.cache.match_prefix(&t);
                self.check_match(&t, &m);
                self.cache.lock(m.last);
                let have = self.cache.tree().peek(&t);
                self.held.push((m.last, t, have.0 + have.1, None));
            }
            Op::LoadBackAsync(s, l) => {
                let t = tokens(s, l);
                let m = self.cache.match_prefix(&t);
                self.check_match(&t, &m);
                self.cache.lock(m.last);
                let tk = self.cache.load_back(&m);
                let have = self.cache.tree().peek(&t);
                self.held.push((m.last, t, have.0 + have.1, tk));
            }
            Op::Release(i) => {
                if !self.held.is_empty() {
                    let (n, _, _, tk) = self.held.remove(i as usize % self.held.len());
                    if let Some(tk) = tk {
                        self.cache.wait(tk);
                    }
                    self.cache.unlock(n);
                }
            }
            Op::EvictDevice(n) => {
                self.cache.evict_device(n as usize);
            }
            Op::EvictHost(n) => {
                self.cache.evict_host(n as usize);
            }
            Op::Poll => {
                self.cache.poll();
            }
            Op::WaitAll => {
                self.cache.wait_all();
                self.verify_bytes();
            }
        }
        self.cache.check().unwrap();
        // Locked prefixes stay cached.
        for (_, t, have, _) in &self.held {
            let (d, h) = self.cache.tree().peek(t);
            assert!(
                d + h >= *have,
                "locked prefix lost: had {have}, now {}",
                d + h
            );
        }
    }
}

fn world(ps: usize, wp: WritePolicy, ev: EvictionPolicy, l3: bool) -> World {
    let layout = common::layout(ps);
    let sizes = (24 / ps as u32 + 4, 48 / ps as u32 + 4);
    World {
        cache: common::cache(layout.clone(), sizes, wp, ev, l3.then_some(20)),
        ns: HashNamespace::new("model", &layout),
        ps,
        computed: HashSet::new(),
        held: Vec::new(),
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    #[test]
    fn cache_invariants_hold_after_every_step(
        ps in prop_oneof![Just(1usize), Just(2), Just(4)],
        wp in common::write_policy(),
        policy in 0..EvictionPolicy::ALL.len(),
        l3 in any::<bool>(),
        ops in prop::collection::vec(op(), 1..60),
    ) {
        let ev = EvictionPolicy::ALL[policy];
        let mut w = world(ps, wp, ev, l3);
        for op in &ops {
            w.step(op);
        }
        while let Some((n, _, _, tk)) = w.held.pop() {
            if let Some(tk) = tk {
                w.cache.wait(tk);
            }
            w.cache.unlock(n);
        }
        w.cache.wait_all();
        w.cache.check().unwrap();
        w.verify_bytes();
        // With every lock released everything is evictable: no page can leak.
        common::assert_all_evictable(&mut w.cache);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    /// With room for everything nothing is evicted, so the tree must hit exactly what the
    /// reference computed: no false hits and no lost entries.
    #[test]
    fn ample_cache_hits_exactly_the_reference(
        ps in prop_oneof![Just(1usize), Just(2), Just(4)],
        reqs in prop::collection::vec((0u8..8, 1u8..40), 1..40),
    ) {
        let layout = PageLayout::new(ps, vec![PoolKind::kv("kv", 1, 1, 4, 2)]).unwrap();
        let mut cfg = CacheConfig::new(layout.clone(), 4000, 4000);
        cfg.hashing = true;
        let mut w = World {
            cache: TieredCache::new(cfg, &HeapAllocator, None).unwrap(),
            ns: HashNamespace::new("model", &layout),
            ps,
            computed: HashSet::new(),
            held: Vec::new(),
        };
        for (s, l) in reqs {
            let t = tokens(s, l);
            let want = w.longest_computed(&t);
            prop_assert_eq!(w.cache.tree().peek(&t), (want, 0));
            w.run(&t);
            w.cache.check().unwrap();
        }
        prop_assert_eq!(w.cache.stats().evicted_device_nodes, 0);
    }
}
