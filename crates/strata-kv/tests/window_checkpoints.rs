//! Committed prefixes of a layout with window kinds keep their window pages only where a
//! continuation can start: at their end (and one token before it) and at a checkpoint every
//! K pages. A later hit that ends between checkpoints backs off to the nearest kept boundary
//! (the rest is recomputed); with K = 0 every page keeps its window page.

#[allow(dead_code)] // helpers the other test files use
mod common;
use strata_kv::memory::HeapAllocator;
use strata_kv::testing::compute_in_chunks;
use strata_kv::{CacheConfig, PrefetchPolicy, TieredCache, WritePolicy, NO_PAGE};

const PS: usize = 4;

/// A cache of pages of 4 tokens whose window kinds read the last `window` tokens, with
/// checkpoints every `k` pages.
fn cache(window: usize, k: usize) -> TieredCache {
    let mut cfg = CacheConfig::new(common::window_layout(PS, window), 64, 32);
    cfg.window_checkpoint_pages = k;
    cfg.write_policy = WritePolicy::WriteBack;
    cfg.hashing = true;
    TieredCache::new(cfg, &HeapAllocator, None).unwrap()
}

/// Computes `tokens` through a lease (in chunks of 5 tokens, as the scheduler would) and
/// commits them all.
fn run(c: &mut TieredCache, tokens: &[u32]) -> usize {
    let mut lease = c
        .admit(tokens, 1, true, PrefetchPolicy::WaitComplete)
        .expect("room");
    assert!(
        common::ready_once_copies_land(c, &mut lease),
        "a lone lease becomes ready"
    );
    let start = lease.start();
    compute_in_chunks(c, &mut lease, tokens, (start, tokens.len()), 5);
    c.commit(lease, tokens, tokens.len());
    c.check().unwrap();
    start
}

/// Pages of the path to `tokens`' match that hold a device window page.
fn kept(c: &mut TieredCache, tokens: &[u32]) -> Vec<usize> {
    let m = c.lookup(tokens);
    let mut out = Vec::new();
    let mut at = 0;
    for n in m.path {
        let v = c.tree().view(n);
        let pages = v.tokens.len() / PS;
        for i in 0..pages {
            if v.device_win.get(i).is_some_and(|&w| w != NO_PAGE) {
                out.push(at + i);
            }
        }
        at += pages;
    }
    out
}

fn seq(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32).map(|i| i * 7 + salt).collect()
}

#[test]
fn a_commit_keeps_window_pages_at_its_end_and_its_checkpoints_only() {
    // Window of 4 tokens (one page), a checkpoint every 2 pages, a 10-page sequence: the end
    // keeps pages 8 and 9 ([39 − 4, 40)), checkpoints 2, 4, 6, 8 keep pages 1, 3, 5, 7.
    let mut c = cache(4, 2);
    let a = seq(40, 1);
    run(&mut c, &a);
    assert_eq!(kept(&mut c, &a), vec![1, 3, 5, 7, 8, 9]);
    let (dwin, _) = c.window_usage();
    assert_eq!(dwin.pages_used, 6, "the other window pages were given back");

    // A hit ending at page 7 (the query diverges inside page 7) cannot resume at 7 (page 6
    // has no window page): it backs off to the checkpoint at 6, and recomputes from there.
    let mut b = a[..30].to_vec();
    b.extend(seq(10, 900));
    let m = c.match_prefix(&b);
    assert_eq!(
        m.device_tokens, 24,
        "backed off to the checkpoint at page 6"
    );
    assert_eq!(m.window_cut_tokens, 4);
    assert_eq!(c.stats().window_hits_backed_off, 1);
    // Continuing at its end: used whole.
    let mut d = a.clone();
    d.extend(seq(8, 500));
    let m = c.match_prefix(&d);
    assert_eq!(m.device_tokens, 40);
    assert_eq!(m.window_cut_tokens, 0);
    // The same prompt again (page-aligned: it resumes at its last token): whole but the
    // last page, which is recomputed as always.
    let m = c.match_prefix(&a);
    assert_eq!(m.window_cut_tokens, 0);
    assert_eq!(c.stats().window_hits_as_matched, 2);

    // The continuation that resumed at the checkpoint commits its own end; the shared part
    // keeps what it had.
    let start = run(&mut c, &b);
    assert_eq!(start, 24);
    let kept_b = kept(&mut c, &b);
    assert!(kept_b.starts_with(&[1, 3, 5]), "{kept_b:?}");
    assert!(kept_b.ends_with(&[8, 9]), "{kept_b:?}");
}

#[test]
fn without_checkpoints_every_page_keeps_its_window_page() {
    let mut c = cache(4, 0);
    let a = seq(40, 3);
    run(&mut c, &a);
    assert_eq!(kept(&mut c, &a), (0..10).collect::<Vec<_>>());
}

#[test]
fn a_window_wider_than_the_interval_keeps_every_page_it_covers() {
    // Window of 9 tokens (3 pages back from a boundary), a checkpoint every 2 pages.
    let mut c = cache(9, 2);
    let a = seq(48, 5);
    run(&mut c, &a);
    let k = kept(&mut c, &a);
    // Checkpoint c covers pages from (4c − 9) / 4: c = 2 → 0..2, 4 → 1..4, ...: every page.
    assert_eq!(k, (0..12).collect::<Vec<_>>());
    // A wider interval: checkpoints 4, 8 keep 1..4 and 5..8; the end (48) keeps 9..12.
    let mut c = cache(9, 4);
    run(&mut c, &a);
    assert_eq!(kept(&mut c, &a), vec![1, 2, 3, 5, 6, 7, 9, 10, 11]);
}

#[test]
fn the_point_where_a_prompt_left_the_cache_keeps_its_window_pages_for_the_next() {
    // Window of 4 tokens, checkpoints too far apart to matter: a shared prefix of 6 pages (a
    // system prompt) then different questions.
    let mut c = cache(4, 100);
    let system = seq(24, 7);
    let ask = |q: u32| {
        let mut p = system.clone();
        p.extend(seq(16, 1000 + q * 50));
        p
    };
    run(&mut c, &ask(0));
    // The first sequence kept only its end: the second cannot resume at the system prompt's
    // end (page 5 has no window page) and computes it all...
    let m = c.match_prefix(&ask(1));
    assert_eq!((m.cached_tokens(), m.window_cut_tokens), (0, 24));
    run(&mut c, &ask(1));
    // ...but keeps the window pages before where it left the cache (page 5): the third
    // resumes there.
    let m = c.match_prefix(&ask(2));
    assert_eq!((m.cached_tokens(), m.window_cut_tokens), (24, 0));
}

#[test]
fn a_named_shared_prefix_keeps_its_window_pages_from_the_first_request_on() {
    // The same system prompt and questions as above, but the first request names its
    // shared prefix (the system prompt, 23 tokens: the point falls inside page 5, whose
    // start is where the others resume): the second resumes there at once.
    let mut c = cache(4, 100);
    let system = seq(23, 7);
    let ask = |q: u32| {
        let mut p = system.clone();
        p.extend(seq(17, 1000 + q * 50));
        p
    };
    let a = ask(0);
    let mut lease = c.admit(&a, 1, true, PrefetchPolicy::WaitComplete).unwrap();
    lease.set_shared_prefix(23);
    assert!(c.advance(&mut lease));
    compute_in_chunks(&mut c, &mut lease, &a, (0, a.len()), 5);
    c.commit(lease, &a, a.len());
    // Kept: the span before page 5 (page 4), and the end's (pages 8 and 9).
    assert_eq!(kept(&mut c, &a), vec![4, 8, 9]);
    let m = c.match_prefix(&ask(1));
    assert_eq!((m.cached_tokens(), m.window_cut_tokens), (20, 0));
}

#[test]
fn a_running_request_holds_window_pages_for_its_span_only() {
    // Six device window pages (a one-token step reads at most 2 own pages of 4 tokens with a
    // window of 4) and a 300-token request (75 pages): without the ring it could not start.
    let mut cfg = CacheConfig::new(common::window_layout(PS, 4), 96, 32);
    cfg.device_window_pages = 6;
    cfg.host_window_pages = 8;
    cfg.window_checkpoint_pages = 8;
    cfg.hashing = true;
    let mut c = TieredCache::new(cfg, &HeapAllocator, None).unwrap();
    let a = seq(300, 11);
    let mut lease = c
        .admit(&a, 20, true, PrefetchPolicy::WaitComplete)
        .expect("admitted with a ring, not a window page per page");
    assert!(c.advance(&mut lease));
    let mut peak = 0;
    let mut pos = 0;
    while pos < a.len() {
        let end = (pos + 7).min(a.len());
        compute_in_chunks(&mut c, &mut lease, &a, (pos, end), 7);
        peak = peak.max(c.window_usage().0.pages_used);
        c.check().unwrap();
        pos = end;
    }
    assert!(peak <= 6, "{peak} window pages held at once");
    // Decode steps go on in the same ring.
    let mut all = a.clone();
    all.extend(seq(20, 77));
    for p in a.len()..all.len() - 1 {
        assert_eq!(c.secure_windows(&mut lease, p, p + 1), p + 1);
    }
    c.commit(lease, &all, all.len() - 1);
    c.check().unwrap();
    // What the commit kept: its end span on device at least (checkpoints fight for six
    // pages and may have been given up).
    let kept = kept(&mut c, &all[..all.len() - 1]);
    let whole = (all.len() - 1) / PS;
    assert!(kept.ends_with(&[whole - 2, whole - 1]), "{kept:?}");
}

#[test]
fn a_ring_keeps_the_checkpoints_when_window_pages_allow() {
    // Plenty of window pages: the ring gives back what no commit keeps while it runs, so at
    // most its span plus the checkpoints so far are held.
    let mut c = cache(4, 4);
    let a = seq(160, 13);
    let mut lease = c.admit(&a, 1, true, PrefetchPolicy::WaitComplete).unwrap();
    assert!(c.advance(&mut lease));
    let mut pos = 0;
    while pos < a.len() {
        let end = (pos + 6).min(a.len());
        compute_in_chunks(&mut c, &mut lease, &a, (pos, end), 6);
        let held = c.window_usage().0.pages_used as usize;
        // The checkpoints before `end` (one page each: the window is one page), the span
        // and the chunk (≤ 4 pages), the ring (≤ 2).
        assert!(held <= end / 16 + 4 + 2, "{held} held at {end}");
        pos = end;
    }
    c.commit(lease, &a, a.len());
    let k = kept(&mut c, &a);
    assert_eq!(k, vec![3, 7, 11, 15, 19, 23, 27, 31, 35, 38, 39]);
}

#[test]
fn the_prompts_end_keeps_its_window_pages_for_a_next_turn_that_renders_the_answer_otherwise() {
    // Window of 4 tokens, checkpoints too far apart to matter: a 24-token prompt and a
    // 16-token answer. The next turn re-sends the prompt with another rendering of the
    // answer: it leaves the sequence at the prompt's end (page 6) and resumes there.
    let mut c = cache(4, 100);
    let prompt = seq(24, 9);
    let mut turn = prompt.clone();
    turn.extend(seq(16, 3000));
    let mut lease = c
        .admit(&prompt, 16, true, PrefetchPolicy::WaitComplete)
        .unwrap();
    assert!(c.advance(&mut lease));
    compute_in_chunks(&mut c, &mut lease, &turn, (0, turn.len()), 5);
    c.commit(lease, &turn, turn.len());
    let mut next = prompt.clone();
    next.extend(seq(20, 7000));
    let m = c.match_prefix(&next);
    assert_eq!((m.cached_tokens(), m.window_cut_tokens), (24, 0));
}

#[test]
fn evicting_part_of_a_sequence_keeps_its_end_an_end() {
    // Window of 4 tokens, no checkpoint that matters, 24 device pages, write-through. A: a
    // 24-token prompt and a 16-token answer (its prompt's end, page 5, keeps a window page);
    // then C, and D continuing it (C's end is now state a sequence moved past).
    let mut cfg = CacheConfig::new(common::window_layout(PS, 4), 24, 64);
    cfg.window_checkpoint_pages = 100;
    cfg.hashing = true;
    let mut c = TieredCache::new(cfg, &HeapAllocator, None).unwrap();
    let prompt = seq(24, 23);
    let mut a = prompt.clone();
    a.extend(seq(16, 5000));
    let mut lease = c
        .admit(&prompt, 16, true, PrefetchPolicy::WaitComplete)
        .unwrap();
    assert!(c.advance(&mut lease));
    compute_in_chunks(&mut c, &mut lease, &a, (0, a.len()), 5);
    c.commit(lease, &a, a.len());
    let cs = seq(20, 21);
    let mut d = cs.clone();
    d.extend(seq(20, 4000));
    run(&mut c, &cs);
    run(&mut c, &d);
    // A new request needs 4 pages more than are free: the device evicts from A (the least
    // recently used sequence), which must stay one sequence end rather than become a head
    // (an inner node, whose window pages go first) and a tail.
    let b = seq(31, 6000);
    let lease = c.admit(&b, 1, true, PrefetchPolicy::WaitComplete).unwrap();
    c.release(lease);
    c.wait_all();
    c.check().unwrap();
    // Window pressure on both tiers: state a sequence moved past (C's end) goes first.
    c.evict_device_windows(1);
    c.evict_host_windows(1);
    c.check().unwrap();
    let mut next = prompt.clone();
    next.extend(seq(20, 7000));
    let m = c.match_prefix(&next);
    assert_eq!((m.cached_tokens(), m.window_cut_tokens), (24, 0));
}
