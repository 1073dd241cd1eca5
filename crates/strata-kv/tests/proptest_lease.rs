//! The request lease's lifecycle under random interleavings (no model): admit, advance as
//! copies land, compute into the lease's pages, commit, release or drop — several leases at
//! once, with evictions, polls and every write policy, with and without L3.
//!
//! Checked after every step: the cache's page accounting (`check`); a ready lease's pages
//! before its start position hold exactly the K/V of the prompt's pages (the prefix it was
//! handed, copy-on-write page included), and with window kinds the window pages of its span
//! (with checkpoints, committed prefixes keep only some: a hit must back off to where they
//! are); and at the end, with every lease gone, no page is held by anyone but the tree and
//! every cached page holds the right bytes.

use proptest::prelude::*;

mod common;
use strata_kv::testing::{compute_in_chunks, expected_chunk, verify_tree_bytes};
use strata_kv::{
    Class, EvictionPolicy, Lease, PrefetchPolicy, Slot, TieredCache, WritePolicy, NO_PAGE,
};

#[derive(Clone, Debug)]
enum Op {
    /// Prompt, length, new tokens, and whether it names its session (its prompt's: the same
    /// prompt at two lengths is a conversation and its next turn).
    Admit(u8, u8, u8, bool),
    /// A conversation's next turn, whole (admitted, advanced, committed): prompt `s`'s
    /// session, its prompt this many tokens past its last one, this many new tokens.
    Turn(u8, u8, u8),
    Advance(u8),
    /// Which lease, and the chunk size it computes in.
    Commit(u8, u8),
    Release(u8),
    Drop(u8),
    EvictDevice(u8),
    EvictHost(u8),
    EvictWindows(u8),
    Poll,
    WaitAll,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0u8..6, 1u8..40, 1u8..8, any::<bool>()).prop_map(|(s, l, n, k)| Op::Admit(s, l, n, k)),
        2 => (0u8..6, 1u8..8, 1u8..8).prop_map(|(s, m, n)| Op::Turn(s, m, n)),
        4 => any::<u8>().prop_map(Op::Advance),
        3 => (any::<u8>(), 1u8..12).prop_map(|(i, c)| Op::Commit(i, c)),
        1 => any::<u8>().prop_map(Op::Release),
        1 => any::<u8>().prop_map(Op::Drop),
        1 => (1u8..12).prop_map(Op::EvictDevice),
        1 => (1u8..12).prop_map(Op::EvictHost),
        1 => (1u8..12).prop_map(Op::EvictWindows),
        1 => Just(Op::Poll),
        1 => Just(Op::WaitAll),
    ]
}

/// Prompts share prefixes by group so nodes split and share.
fn tokens(s: u8, len: u8) -> Vec<u32> {
    common::tokens(s, len, 2, 12)
}

struct Live {
    lease: Lease,
    prompt: Vec<u32>,
    new: usize,
}

struct World {
    cache: TieredCache,
    ps: usize,
    live: Vec<Live>,
    /// Each prompt's last turn's length ([`Op::Turn`]).
    turns: [u8; 6],
}

impl World {
    fn pick(&self, i: u8) -> Option<usize> {
        (!self.live.is_empty()).then(|| i as usize % self.live.len())
    }

    /// The pages before a ready lease's start hold the prompt's K/V; with window kinds, the
    /// window pages of the pages covering the window before the start do too.
    fn check_prefix(&self, l: &Live) {
        let dev = self.cache.device_pool().unwrap();
        let layout = dev.layout();
        let hashes = self.cache.page_hashes(&l.prompt);
        // A partial page before the start is the copy-on-write of a whole prompt page.
        let start = l.lease.start();
        let whole = start.div_ceil(self.ps).min(hashes.len());
        let span_from = start.saturating_sub(layout.window_tokens()) / self.ps;
        let windows = l.lease.windows();
        if layout.has_window() {
            assert_eq!(
                windows.len(),
                l.lease.pages().len(),
                "a window entry per page"
            );
        }
        for (i, &page) in l.lease.pages()[..whole].iter().enumerate() {
            for (ci, c) in layout.chunks().iter().enumerate() {
                let page = match c.class {
                    Class::Main => page,
                    Class::Window if i < span_from => continue,
                    Class::Window => {
                        assert_ne!(windows[i], NO_PAGE, "window page {i} before start {start}");
                        windows[i]
                    }
                };
                let mut got = vec![0; c.bytes];
                dev.read_chunk(c.kind, c.layer, c.plane, page, &mut got);
                assert_eq!(
                    got,
                    expected_chunk(&hashes[i], ci, c.bytes),
                    "prefix page {i}"
                );
            }
        }
    }

    /// Computes the rest of the prompt and the new tokens into the lease's pages in chunks
    /// (securing the window pages of each, which checks the window state each reads), then
    /// commits the whole pages.
    fn commit(&mut self, mut l: Live, chunk: usize) {
        if !l.lease.is_ready() {
            self.cache.release(l.lease);
            return;
        }
        self.check_prefix(&l);
        // Outputs are a function of the prompt (the same prompt → the same answer).
        let mut all = l.prompt.clone();
        all.extend((0..l.new as u32).map(|i| 50_000 + l.prompt.len() as u32 * 10 + i));
        let computed = all.len() - 1;
        let from = l.lease.start();
        compute_in_chunks(&mut self.cache, &mut l.lease, &all, (from, computed), chunk);
        self.cache.check().unwrap();
        self.cache.commit(l.lease, &all, computed);
    }

    fn step(&mut self, op: &Op) {
        match *op {
            Op::Admit(s, len, new, session) => {
                let prompt = tokens(s, len);
                let new = new as usize;
                let p = PrefetchPolicy::WaitComplete;
                if let Some(mut lease) = self.cache.admit(&prompt, new, true, p) {
                    assert!(lease.own_pages() >= 1);
                    if session {
                        self.cache.set_session(&mut lease, s as u64);
                    }
                    self.live.push(Live { lease, prompt, new });
                }
            }
            Op::Turn(s, more, new) => {
                let len = self.turns[s as usize].saturating_add(more).min(48);
                self.turns[s as usize] = len;
                let prompt = tokens(s, len);
                let p = PrefetchPolicy::WaitComplete;
                if let Some(mut lease) = self.cache.admit(&prompt, new as usize, true, p) {
                    self.cache.set_session(&mut lease, s as u64);
                    // The pages it needs may be held by leases still live: it waits for
                    // them to finish (as the scheduler's requests do), and must be ready
                    // once none is left.
                    while !common::ready_once_copies_land(&mut self.cache, &mut lease) {
                        let l = self.live.pop().expect("a lone lease becomes ready");
                        self.cache.release(l.lease);
                    }
                    let l = Live {
                        lease,
                        prompt,
                        new: new as usize,
                    };
                    self.commit(l, 4);
                }
            }
            Op::Advance(i) => {
                if let Some(i) = self.pick(i) {
                    if self.cache.advance(&mut self.live[i].lease) {
                        let l = &self.live[i];
                        assert!(
                            l.lease.start() < l.prompt.len(),
                            "the last token is computed"
                        );
                        let need = (l.prompt.len() + l.new).div_ceil(self.ps);
                        assert_eq!(l.lease.pages().len(), need, "pages for every position");
                        self.check_prefix(l);
                    }
                }
            }
            Op::Commit(i, chunk) => {
                if let Some(i) = self.pick(i) {
                    let l = self.live.swap_remove(i);
                    self.commit(l, chunk as usize);
                }
            }
            Op::Release(i) => {
                if let Some(i) = self.pick(i) {
                    let l = self.live.swap_remove(i);
                    self.cache.release(l.lease);
                }
            }
            Op::Drop(i) => {
                if let Some(i) = self.pick(i) {
                    drop(self.live.swap_remove(i));
                }
            }
            Op::EvictDevice(n) => {
                self.cache.evict_device(n as usize);
            }
            Op::EvictHost(n) => {
                self.cache.evict_host(n as usize);
            }
            Op::EvictWindows(n) => {
                self.cache.evict_device_windows(n as usize);
                self.cache.evict_host_windows(n as usize);
            }
            Op::Poll => {
                self.cache.poll();
            }
            Op::WaitAll => self.cache.wait_all(),
        }
        self.cache.check().unwrap();
    }
}

/// `window`: with window kinds reading the last `w` tokens, committed prefixes keeping their
/// window pages every `k` pages (0: every page).
fn world(
    ps: usize,
    wp: WritePolicy,
    ev: EvictionPolicy,
    l3: bool,
    window: Option<(usize, usize)>,
) -> World {
    let sizes = (96 / ps as u32 + 8, 64 / ps as u32 + 4);
    let (layout, windows) = match window {
        None => (common::layout(ps), None),
        // Fewer window pages than pages: room for the largest request (48 tokens) and its
        // span, so window pages are evicted while main pages stay.
        Some((w, k)) => {
            let d = 48 / ps as u32 + 1 + (w / ps) as u32 + 3;
            (common::window_layout(ps, w), Some((d, sizes.1 / 3, k)))
        }
    };
    let l3 = l3.then_some(40);
    World {
        cache: common::cache_with_windows(layout, sizes, windows, wp, ev, l3),
        ps,
        live: Vec::new(),
        turns: [0; 6],
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    #[test]
    fn leases_hold_the_right_pages_and_release_everything(
        ps in prop_oneof![Just(1usize), Just(2), Just(4)],
        wp in common::write_policy(),
        policy in 0..EvictionPolicy::ALL.len(),
        l3 in any::<bool>(),
        window in prop_oneof![Just(None), (1usize..7, 0usize..4).prop_map(Some)],
        ops in prop::collection::vec(op(), 1..80),
    ) {
        let ev = EvictionPolicy::ALL[policy];
        let mut w = world(ps, wp, ev, l3, window);
        for op in &ops {
            w.step(op);
        }
        // Half the survivors are released, half dropped: both give everything back.
        for (k, l) in std::mem::take(&mut w.live).into_iter().enumerate() {
            if k % 2 == 0 {
                w.cache.release(l.lease);
            } else {
                drop(l);
            }
        }
        w.cache.wait_all();
        w.cache.check().unwrap();
        verify_tree_bytes(&w.cache);
        let tree_pages = w.cache.tree().pages_in(Slot::Device) as u64;
        prop_assert_eq!(w.cache.device_usage().pages_used, tree_pages, "pages held outside the tree");
        let tree_windows = w.cache.tree().window_pages_in(Slot::Device) as u64;
        prop_assert_eq!(w.cache.window_usage().0.pages_used, tree_windows, "window pages held outside the tree");
        let s = w.cache.stats();
        prop_assert!(s.session_retired_tokens <= s.inserted_tokens);
        prop_assert!(w.cache.sessions() <= 6);
        // With every lease gone everything is evictable: no lock leaked.
        common::assert_all_evictable(&mut w.cache);
    }
}
