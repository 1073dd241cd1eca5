use super::*;
use crate::layout::{PageLayout, PoolKind};
use node::PROBATION;

fn tree(ps: usize, policy: EvictionPolicy) -> RadixTree {
    let layout = PageLayout::new(ps, vec![PoolKind::aux("kv", 1, 1)]).unwrap();
    RadixTree::new(ps, policy, Some(HashNamespace::new("t", &layout)))
}

fn ins(t: &mut RadixTree, tokens: &[u32], first_page: u32) -> Inserted {
    let n = tokens.len() / t.page_size();
    let pages: Vec<u32> = (first_page..first_page + n as u32).collect();
    t.insert(tokens, &pages, Slot::Device, 0)
}

#[test]
fn match_splits_nodes_at_page_boundaries() {
    let mut t = tree(2, EvictionPolicy::Lru);
    let r = ins(&mut t, &[1, 2, 3, 4, 5, 6, 7, 8], 0);
    assert_eq!(r.filled.len(), 1);
    assert_eq!(t.node_count(), 2);
    // Diverges inside the third page: two whole pages match, the node splits after them.
    let m = t.match_prefix(&[1, 2, 3, 4, 5, 9, 7]);
    assert_eq!(m.device_tokens, 4);
    assert_eq!(m.path.len(), 1);
    assert_eq!(t.node_count(), 3);
    let prefix = t.view(m.last);
    assert_eq!(prefix.tokens.to_vec(), [1, 2, 3, 4]);
    assert_eq!(prefix.device, &[0, 1]);
    // The deeper half kept the original id and the rest of the pages and hashes.
    let suffix = t.view(r.last);
    assert_eq!(suffix.tokens.to_vec(), [5, 6, 7, 8]);
    assert_eq!(suffix.device, &[2, 3]);
    assert_eq!(suffix.parent, m.last);
    t.check().unwrap();
    // A trailing partial page never matches.
    assert_eq!(t.match_prefix(&[1, 2, 3]).device_tokens, 2);
}

#[test]
fn insert_returns_duplicates_and_adds_the_new_suffix() {
    let mut t = tree(1, EvictionPolicy::Lru);
    ins(&mut t, &[1, 2, 3], 0);
    let r = ins(&mut t, &[1, 2, 4, 5], 10);
    assert_eq!(r.unused, vec![10, 11]);
    assert_eq!(t.view(r.last).device, &[12, 13]);
    assert_eq!(r.tokens, 4);
    t.check().unwrap();
    assert_eq!(t.pages_in(Slot::Device), 5);
}

#[test]
fn lru_evicts_least_recent_leaf_and_locks_protect() {
    let mut t = tree(1, EvictionPolicy::Lru);
    let a = ins(&mut t, &[1, 2], 0).last;
    let b = ins(&mut t, &[3, 4], 2).last;
    t.match_prefix(&[1, 2]);
    assert_eq!(t.device_victim(), Some(b));
    t.lock(b);
    assert_eq!(t.device_victim(), Some(a));
    t.lock(a);
    assert_eq!(t.device_victim(), None);
    t.unlock(b);
    assert_eq!(t.device_victim(), Some(b));
    t.unlock(a);
    let pages = t.take_device(b);
    assert_eq!(pages, vec![2, 3]);
    assert!(!t.is_live(b));
    t.check().unwrap();
}

#[test]
fn inner_nodes_are_evicted_only_after_their_children() {
    let mut t = tree(1, EvictionPolicy::Lru);
    ins(&mut t, &[1, 2, 3], 0);
    let child = ins(&mut t, &[1, 2, 9], 10).last;
    let parent = t.view(child).parent;
    // Parent [1,2] has two device children: never a victim before them.
    for _ in 0..2 {
        let v = t.device_victim().unwrap();
        assert_ne!(v, parent);
        t.take_device(v);
    }
    assert_eq!(t.device_victim(), Some(parent));
    t.check().unwrap();
}

#[test]
fn host_eviction_only_touches_nodes_off_device() {
    let mut t = tree(1, EvictionPolicy::Lru);
    let a = ins(&mut t, &[1, 2], 0).last;
    t.set_pages(a, Slot::Host, vec![7, 8]);
    assert_eq!(t.host_victim(), None, "still on device");
    assert_eq!(t.take_device(a), vec![0, 1]);
    assert!(t.is_live(a), "backed-up node stays, host only");
    assert_eq!(t.match_prefix(&[1, 2]).host_tokens, 2);
    assert_eq!(t.host_victim(), Some(a));
    t.lock(a);
    assert_eq!(t.host_victim(), None);
    t.unlock(a);
    assert_eq!(t.take_host(a), vec![7, 8]);
    assert_eq!(t.node_count(), 1);
    t.check().unwrap();
}

#[test]
fn gdsf_keeps_frequent_prefix_over_recent_one_offs() {
    let mut t = tree(1, EvictionPolicy::Gdsf);
    let hot = ins(&mut t, &[1, 1], 0).last;
    for _ in 0..5 {
        t.match_prefix(&[1, 1]);
    }
    let cold = ins(&mut t, &[2, 2], 2).last;
    assert_eq!(t.device_victim(), Some(cold));
    // Under LRU the same history evicts the hot prefix first once it is older.
    let mut l = tree(1, EvictionPolicy::Lru);
    let hot_l = ins(&mut l, &[1, 1], 0).last;
    for _ in 0..5 {
        l.match_prefix(&[1, 1]);
    }
    ins(&mut l, &[2, 2], 2);
    assert_eq!(l.device_victim(), Some(hot_l));
    let _ = hot;
}

#[test]
fn gdsf_remembers_frequency_of_evicted_pages() {
    let mut t = tree(1, EvictionPolicy::Gdsf);
    let hot = ins(&mut t, &[1, 1], 0).last;
    for _ in 0..5 {
        t.match_prefix(&[1, 1]);
    }
    t.take_device(hot);
    // Re-inserted after eviction, it is still ranked above a fresh one-off.
    ins(&mut t, &[1, 1], 0);
    let cold = ins(&mut t, &[3, 3], 2).last;
    assert_eq!(t.device_victim(), Some(cold));
    t.check().unwrap();
}

#[test]
fn hashes_chain_across_splits_and_match_namespace() {
    let mut t = tree(2, EvictionPolicy::Lru);
    let r = ins(&mut t, &[1, 2, 3, 4], 0);
    let ns = t.namespace().unwrap().clone();
    let want = ns.chain(PageHash::ROOT, &[1, 2, 3, 4], 2);
    assert_eq!(t.view(r.last).hashes, &want[..]);
    t.match_prefix(&[1, 2, 9, 9]);
    assert_eq!(t.view(r.last).hashes, &want[1..]);
    assert_eq!(t.last_hash(r.last), Some(want[1]));
    t.check().unwrap();
}

#[test]
fn peek_does_not_change_anything() {
    let mut t = tree(1, EvictionPolicy::Lru);
    ins(&mut t, &[1, 2, 3], 0);
    assert_eq!(t.peek(&[1, 2, 7]), (2, 0));
    assert_eq!(t.node_count(), 2);
}

#[test]
fn window_pages_split_with_their_node_and_are_not_prefix_closed() {
    let mut t = tree(2, EvictionPolicy::Lru);
    let toks = [1, 2, 3, 4, 5, 6, 7, 8];
    let r = t.insert_with_windows(
        &toks,
        &[0, 1, 2, 3],
        &[10, NO_PAGE, 12, 13],
        Slot::Device,
        0,
    );
    assert!(r.unused_windows.is_empty());
    assert_eq!(t.window_pages_in(Slot::Device), 3);
    // Splitting after the second page: the head keeps [10, NO_PAGE], the suffix [12, 13].
    let m = t.match_prefix(&[1, 2, 3, 4, 9, 9]);
    assert_eq!(t.view(m.last).device_win, &[10, NO_PAGE]);
    assert_eq!(t.view(r.last).device_win, &[12, 13]);
    t.check().unwrap();
    // An inner node is a window victim (window pages are not prefix-closed) while its main
    // pages are not evictable (it has a child on device).
    assert_eq!(t.device_victim(), Some(r.last));
    // The inner head goes first, although the match touched it more recently than the
    // suffix (a sequence end, a leaf); skipping it, the leaf is next.
    let inner = t.window_victim(Slot::Device, |_| false).unwrap();
    assert_eq!(inner, m.last);
    assert_eq!(t.window_victim(Slot::Device, |n| n == inner), Some(r.last));
    assert_eq!(t.take_windows(inner, Slot::Device), vec![10]);
    assert!(t.view(inner).device_win.is_empty());
    // Locked nodes are not victims.
    t.lock(r.last);
    assert_eq!(t.window_victim(Slot::Device, |_| false), None);
    t.unlock(r.last);
    // Inserting the same tokens again adopts window pages where the node lacks them and
    // hands back the rest.
    let again = t.insert_with_windows(
        &toks,
        &[4, 5, 6, 7],
        &[20, 21, 22, NO_PAGE],
        Slot::Device,
        0,
    );
    assert_eq!(again.unused, vec![4, 5, 6, 7]);
    assert_eq!(again.unused_windows, vec![22]);
    assert_eq!(t.view(m.last).device_win, &[20, 21]);
    assert_eq!(t.window_pages_in(Slot::Device), 4);
    t.check().unwrap();
    // Main pages leave a tier only after their window pages.
    let w = t.take_windows(r.last, Slot::Device);
    assert_eq!(w, vec![12, 13]);
    t.take_device(r.last);
    t.check().unwrap();
}

#[test]
fn a_match_can_be_cut_back_to_a_page_boundary() {
    let mut t = tree(2, EvictionPolicy::Lru);
    ins(&mut t, &[1, 2, 3, 4, 5, 6], 0);
    let mut m = t.match_prefix(&[1, 2, 3, 4, 5, 6, 7]);
    assert_eq!(m.device_tokens, 6);
    t.truncate_match(&mut m, 2);
    assert_eq!((m.device_tokens, m.path.len()), (2, 1));
    assert_eq!(t.view(m.last).tokens.to_vec(), [1, 2]);
    t.check().unwrap();
    t.truncate_match(&mut m, 0);
    assert_eq!((m.tokens(), m.last), (0, ROOT));
}

#[test]
fn sieve_keeps_visited_leaves_in_place_and_sweeps_from_the_hand() {
    let mut t = tree(1, EvictionPolicy::Sieve);
    let a = ins(&mut t, &[1, 1], 0).last;
    let b = ins(&mut t, &[2, 2], 2).last;
    let c = ins(&mut t, &[3, 3], 4).last;
    // A hit on the oldest only marks it: the hand passes it (clearing the mark) and takes b.
    t.match_prefix(&[1, 1]);
    assert_eq!(t.device_victim_excluding(&[]), Some(b));
    t.take_device(b);
    // The hand stays where it stopped: c is next, then a (its mark was cleared), then none.
    assert_eq!(t.device_victim_excluding(&[]), Some(c));
    assert_eq!(t.device_victim_excluding(&[c]), Some(a));
    t.take_device(c);
    t.match_prefix(&[1, 1]);
    // Every leaf marked: one full turn clears them, the second finds the oldest.
    assert_eq!(t.device_victim_excluding(&[]), Some(a));
    t.lock(a);
    assert_eq!(t.device_victim_excluding(&[]), None);
    t.unlock(a);
    t.check().unwrap();
    // Under LRU the same accesses evict b, then c, then a too, but a hit reorders: after
    // touching a it would go last; SIEVE keeps insertion order for leaves that are unmarked.
    let d = ins(&mut t, &[4, 4], 6).last;
    assert_eq!(
        t.device_victim_excluding(&[]),
        Some(a),
        "older unmarked leaf first"
    );
    let _ = d;
}

/// A split's head (the older part of one insertion) is behind SIEVE's hand once its suffix is
/// evicted, whichever of the two the arena gave the lower id: the same victims either way.
#[test]
fn sieve_puts_a_split_head_behind_the_hand_whatever_its_id() {
    for head_low in [false, true] {
        let mut t = tree(1, EvictionPolicy::Sieve);
        // A freed slot below the node's gives its head the lower id.
        let x = head_low.then(|| ins(&mut t, &[9], 20).last);
        let a = ins(&mut t, &[1, 1, 1, 1], 0).last;
        if let Some(x) = x {
            t.take_device(x);
        }
        t.split_tail(a, 2);
        let head = NodeId(t.view(a).parent.0);
        assert_eq!(head.0 < a.0, head_low);
        let newer = ins(&mut t, &[5, 5], 10).last;
        assert_eq!(t.device_victim_excluding(&[]), Some(a));
        t.take_device(a);
        assert_eq!(
            t.device_victim_excluding(&[]),
            Some(newer),
            "head low: {head_low}"
        );
        t.take_device(newer);
        assert_eq!(t.device_victim_excluding(&[]), Some(head));
        t.check().unwrap();
    }
}

#[test]
fn s3fifo_promotes_hit_small_leaves_and_recognises_ghosts() {
    let mut t = tree(1, EvictionPolicy::S3Fifo);
    let a = ins(&mut t, &[1, 1], 0).last;
    let b = ins(&mut t, &[2, 2], 2).last;
    let c = ins(&mut t, &[3, 3], 4).last;
    // All small (over a tenth of the pages): the oldest small leaf that was hit moves to main,
    // the next one goes.
    t.match_prefix(&[1, 1]);
    assert_eq!(t.device_victim_excluding(&[]), Some(b));
    assert!(!t.s3_small(a.0), "a hit small leaf moves to main");
    t.take_device(b);
    t.check().unwrap();
    assert_eq!(t.device_victim_excluding(&[]), Some(c));
    t.take_device(c);
    // b's start is in the ghost: inserted again, it goes straight to main.
    let b2 = ins(&mut t, &[2, 2], 2).last;
    assert!(!t.s3_small(b2.0));
    let d = ins(&mut t, &[4, 4], 4).last;
    assert!(t.s3_small(d.0));
    t.check().unwrap();
    // Main leaves hit go round once more; unhit ones go in order.
    t.match_prefix(&[2, 2]);
    assert_eq!(t.device_victim_excluding(&[d]), Some(a));
    t.take_device(a);
    assert_eq!(
        t.device_victim_excluding(&[d]),
        Some(b2),
        "its hit was spent going round"
    );
    t.check().unwrap();
}

#[test]
fn policy_state_is_8_bytes_a_node() {
    assert_eq!(std::mem::size_of::<GdsfNode>(), 8);
}

#[test]
fn an_inner_node_keeps_the_last_window_pages_a_short_sequence_end_below_it_reads() {
    // Pages of 2 tokens: a 5-page sequence, then one that shares its first 4 pages and ends
    // one page later (a short turn): its end's span of 3 pages reaches 2 pages into the
    // shared node, which is now inner.
    let mut t = tree(2, EvictionPolicy::Lru);
    let a = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10];
    t.insert_with_windows(&a, &[0, 1, 2, 3, 4], &[10, 11, 12, 13, 14], Slot::Device, 0);
    let b = [1, 2, 3, 4, 5, 6, 7, 8, 40, 41];
    let r = t.insert_with_windows(&b, &[5, 6, 7, 8, 9], &[20, 21, 22, 23, 24], Slot::Device, 0);
    t.check().unwrap();
    let shared = t.view(r.last).parent;
    assert_eq!(t.view(shared).device_win, &[10, 11, 12, 13]);
    let protect = t.window_protection(Slot::Device, 3);
    assert_eq!(protect.get(&shared), Some(&2));
    // The inner node goes first, but only its pages before the last two.
    let (v, keep) = t
        .window_victim_protected(Slot::Device, &protect, |_| false)
        .unwrap();
    assert_eq!((v, keep), (shared, 2));
    assert_eq!(t.take_windows_before(v, Slot::Device, keep), vec![10, 11]);
    assert_eq!(t.view(shared).device_win, &[NO_PAGE, NO_PAGE, 12, 13]);
    t.check().unwrap();
    // Nothing left before them: the next victims are whole nodes in the policy's order.
    let (next, keep) = t
        .window_victim_protected(Slot::Device, &protect, |_| false)
        .unwrap();
    assert_eq!(keep, 0);
    assert_ne!(
        next, shared,
        "the shared node's last pages go after the ends"
    );
}

#[test]
fn auto_puts_a_newcomer_on_probation_below_a_used_leaf_gdsf_would_evict() {
    // Z is hit once, W and Y are one-offs; W goes first (L rises to its priority), then Y
    // arrives. GDSF ranks Y level with Z (L + 1 against 1 + 1) and evicts the older, Z; `auto`
    // starts Y on probation at L + ½ and evicts Y.
    let victim_after = |policy| {
        let mut t = tree(1, policy);
        let z = ins(&mut t, &[1, 1], 0).last;
        t.match_prefix(&[1, 1]);
        let w = ins(&mut t, &[2, 2], 2).last;
        assert_eq!(t.device_victim(), Some(w), "{policy:?}");
        t.take_device(w);
        let y = ins(&mut t, &[3, 3], 4).last;
        t.check().unwrap();
        (t.device_victim().unwrap(), z, y)
    };
    let (v, z, _) = victim_after(EvictionPolicy::Gdsf);
    assert_eq!(v, z);
    let (v, _, y) = victim_after(EvictionPolicy::Auto);
    assert_eq!(v, y);
}

#[test]
fn auto_probation_splits_with_its_node_and_ends_with_a_hit() {
    let mut t = tree(1, EvictionPolicy::Auto);
    assert_eq!(t.auto_learning().unwrap().newcomer_credit, 0.5);
    let a = ins(&mut t, &[7, 7, 7, 7], 0).last;
    assert!(t.nodes[a.0 as usize].has(PROBATION));
    // A second prompt sharing two tokens splits the node: both halves stay on probation,
    // until the shared head is hit.
    ins(&mut t, &[7, 7, 8, 8], 4);
    let head = t.nodes[a.0 as usize].parent;
    assert!(t.nodes[head as usize].has(PROBATION) && t.nodes[a.0 as usize].has(PROBATION));
    t.match_prefix(&[7, 7]);
    assert!(!t.nodes[head as usize].has(PROBATION));
    assert!(t.nodes[a.0 as usize].has(PROBATION));
    t.check().unwrap();
    // Removed and back: the history knows it, no probation.
    let leaf = t.match_prefix(&[7, 7, 7, 7]).last;
    t.take_device(leaf);
    let again = ins(&mut t, &[7, 7, 7, 7], 8).last;
    assert!(!t.nodes[again.0 as usize].has(PROBATION));
    t.check().unwrap();
    // The evidence (the metrics' counters): the leaf, hit by the match before it went, counts
    // as two used pages removed, and back.
    let l = t.auto_learning().unwrap();
    assert_eq!([l.used_removed_pages, l.used_returned_pages], [2, 2]);
    assert_eq!(
        [l.probation_removed_pages, l.probation_returned_pages],
        [0, 0]
    );
    assert_eq!(tree(1, EvictionPolicy::Lru).auto_learning(), None);
}

#[test]
fn auto_learns_nothing_from_a_flush() {
    // A window of removed one-offs (64 pages) moves the credit down a step; the same removals
    // by the operator (a flush) leave it.
    let removals = |flushing: bool| {
        let mut t = tree(1, EvictionPolicy::Auto);
        t.set_history_cap(1024, 128);
        let leaves: Vec<_> = (0..64u32)
            .map(|k| ins(&mut t, &[1000 + k], 2 * k).last)
            .collect();
        t.set_flushing(flushing);
        for l in leaves {
            t.take_device(l);
        }
        t.set_flushing(false);
        t.check().unwrap();
        let l = t.auto_learning().unwrap();
        (l.newcomer_credit, l.probation_removed_pages)
    };
    assert_eq!(removals(true), (0.5, 0));
    assert_eq!(removals(false), (0.45, 64));
}
