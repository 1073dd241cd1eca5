//! Sessions: the workload signal a request may carry (the API's `prompt_cache_key`, else its
//! `user`; here an opaque 64-bit key the caller derives with a keyed hash).
//!
//! A conversation's next turn is its last prompt, the answer, and a new message; an agent's
//! next step extends the context it kept. So the cache remembers, per session, the prompt of
//! its last request (length and hash) and the leaf that request committed (prompt and answer),
//! with that leaf's last access then. When the session's next request commits, and its prompt
//! begins with that whole earlier prompt (it continues that conversation), but the leaf went
//! unused in between (neither this request's match or insertion nor any other request touched
//! it), the session moved past the cached answer: an answer the client did not keep, a
//! regenerated turn, a tool result the agent dropped, or a chat template that renders the
//! previous answer with other tokens than were generated. The leaf is retired
//! (`RadixTree::retire`): evicted, on every tier, before whatever the policy would choose,
//! until something uses it again. Its ancestors (the part the session did continue) keep
//! their place.
//!
//! The prompt check makes a coarse key safe: a `user` with several conversations, or a key
//! shared by many clients, retires nothing when the next request is another conversation. The
//! earlier request is the one the session had when this request was admitted
//! ([`TieredCache::set_session`]): requests of one session in flight together (an agent's
//! parallel tool calls) do not retire each other's answers. Without a session nothing changes.
//! At most [`MAX_SESSIONS`] sessions are remembered: past that, the older half is forgotten (a
//! client inventing keys costs the map's bounded size, nothing else). All a key can do is mark
//! an unused answer of the same conversation evict-first, which a use of it undoes.

use rustc_hash::FxHashMap;

use super::lease::Lease;
use super::TieredCache;
use crate::tree::{NodeId, ROOT};

/// Sessions remembered at most.
pub const MAX_SESSIONS: usize = 1 << 16;

/// A session's last request: its prompt, and the leaf it committed with that leaf's last
/// access then.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Last {
    pub node: NodeId,
    pub stamp: u64,
    pub prompt_len: u32,
    pub prompt_hash: u64,
}

/// What a lease carries: its session and that session's last request when it was admitted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct LeaseSession {
    pub key: u64,
    pub prior: Option<Last>,
}

#[derive(Debug, Default)]
pub(super) struct Sessions {
    map: FxHashMap<u64, (Last, u64)>,
    seq: u64,
}

impl Sessions {
    fn get(&self, key: u64) -> Option<Last> {
        self.map.get(&key).map(|&(l, _)| l)
    }

    fn put(&mut self, key: u64, last: Last) {
        self.seq += 1;
        if self.map.len() >= MAX_SESSIONS && !self.map.contains_key(&key) {
            // Forget the older half (by when each was last remembered).
            let cut = self.seq.saturating_sub(MAX_SESSIONS as u64 / 2);
            self.map.retain(|_, &mut (_, s)| s >= cut);
        }
        self.map.insert(key, (last, self.seq));
    }

    /// Sessions remembered.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Heap bytes of the map (its entries and a control byte each).
    pub fn bytes(&self) -> usize {
        self.map.capacity() * (std::mem::size_of::<(u64, (Last, u64))>() + 1)
    }
}

/// In one pass (XXH3 over the bytes, streamed): the hash of the prompt's first `n` tokens
/// (None if it is shorter), and of the whole prompt.
fn prompt_hashes(prompt: &[u32], n: usize) -> (Option<u64>, u64) {
    let bytes: &[u8] = bytemuck::cast_slice(prompt);
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    let head = (n <= prompt.len()).then(|| {
        h.update(&bytes[..n * 4]);
        h.digest()
    });
    h.update(&bytes[head.map_or(0, |_| n * 4)..]);
    (head, h.digest())
}

impl TieredCache {
    /// Names the session `lease`'s request belongs to (call it after admission, before the
    /// commit): see the module docs. The session's last request as of now is the one the
    /// commit compares with.
    pub fn set_session(&mut self, lease: &mut Lease, key: u64) {
        let prior = self.sessions.get(key);
        lease.held_mut().session = Some(LeaseSession { key, prior });
    }

    /// Sessions remembered now.
    pub fn sessions(&self) -> usize {
        self.sessions.len()
    }

    /// After a commit of `tokens` (the first `prompt_len` its prompt) whose deepest node is
    /// `last`: retires the session's earlier leaf if this prompt continues that request's and
    /// the leaf went unused, and remembers this request as the session's last.
    pub(super) fn session_committed(
        &mut self,
        s: LeaseSession,
        tokens: &[u32],
        prompt_len: usize,
        last: NodeId,
    ) {
        let prompt = &tokens[..prompt_len.min(tokens.len())];
        let n = s.prior.map_or(usize::MAX, |p| p.prompt_len as usize);
        let (head, whole) = prompt_hashes(prompt, n);
        if let Some(p) = s.prior {
            let continues = head == Some(p.prompt_hash);
            if continues && p.node != last && self.tree.retire(p.node, p.stamp) {
                self.stats.session_retired_nodes += 1;
                self.stats.session_retired_tokens += self.tree.view(p.node).tokens.len() as u64;
            }
        }
        // (A prompt of 2^32 tokens or more is not remembered: none is that long.)
        if let (false, Ok(prompt_len)) = (last == ROOT, u32::try_from(prompt.len())) {
            let last = Last {
                node: last,
                stamp: self.tree.view(last).last_access,
                prompt_len,
                prompt_hash: whole,
            };
            self.sessions.put(s.key, last);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::CacheConfig;
    use crate::layout::{PageLayout, PoolKind};
    use crate::memory::HeapAllocator;
    use crate::policy::{EvictionPolicy, PrefetchPolicy};

    /// A metadata-only cache of `dev` device pages of 4 tokens under `policy`.
    fn cache(dev: u32, policy: EvictionPolicy) -> TieredCache {
        let layout = PageLayout::new(4, vec![PoolKind::kv("kv", 1, 1, 4, 2)]).unwrap();
        let mut cfg = CacheConfig::new(layout, dev, 0);
        cfg.with_data = false;
        cfg.eviction = policy;
        TieredCache::new(cfg, &HeapAllocator, None).unwrap()
    }

    fn admit(c: &mut TieredCache, prompt: &[u32], answer: &[u32], session: Option<u64>) -> Lease {
        let new = answer.len() + 1;
        let mut lease = c
            .admit(prompt, new, true, PrefetchPolicy::WaitComplete)
            .expect("room");
        if let Some(k) = session {
            c.set_session(&mut lease, k);
        }
        while !c.advance(&mut lease) {
            c.poll();
        }
        lease
    }

    /// One request through admit → commit (its prompt and its answer), in `session` if given.
    fn request(c: &mut TieredCache, prompt: &[u32], answer: &[u32], session: Option<u64>) {
        let lease = admit(c, prompt, answer, session);
        let all = cat(prompt, answer);
        c.commit(lease, &all, all.len());
        c.check().unwrap();
    }

    fn seq(a: u32, n: u32) -> Vec<u32> {
        (a..a + n).collect()
    }

    fn cat(a: &[u32], b: &[u32]) -> Vec<u32> {
        [a, b].concat()
    }

    /// Whether the cache holds `tokens` whole.
    fn holds(c: &mut TieredCache, tokens: &[u32]) -> bool {
        c.tree.peek(tokens).0 == tokens.len()
    }

    /// A turn whose answer the next turn did not keep (it renders the answer differently):
    /// that answer goes first, before an older unrelated prefix the policy alone would evict.
    #[test]
    fn an_answer_the_next_turn_left_goes_first() {
        for policy in EvictionPolicy::ALL {
            let mut c = cache(9, policy);
            let other = seq(1000, 8);
            let turn1 = seq(0, 8);
            let answer = seq(100, 8);
            let rendered = seq(200, 4);
            request(&mut c, &other, &[], None);
            request(&mut c, &turn1, &answer, Some(7));
            let turn2 = cat(&turn1, &rendered);
            request(&mut c, &turn2, &[], Some(7));
            assert_eq!(c.stats().session_retired_nodes, 1, "{policy:?}");
            assert_eq!(c.stats().session_retired_tokens, 8, "{policy:?}");
            // Two pages must go for the next request: the dead answer, not the older prefix.
            request(&mut c, &seq(3000, 8), &[], None);
            assert!(!holds(&mut c, &cat(&turn1, &answer)), "{policy:?}");
            assert!(holds(&mut c, &other), "{policy:?}");
            assert!(holds(&mut c, &turn2), "{policy:?}");
        }
    }

    /// Another conversation of the same key (a `user` with two chats) retires nothing: its
    /// prompt does not begin with the earlier one.
    #[test]
    fn another_conversation_of_the_key_retires_nothing() {
        let mut c = cache(64, EvictionPolicy::Auto);
        let system = seq(0, 8);
        request(&mut c, &cat(&system, &seq(100, 4)), &seq(300, 8), Some(5));
        request(&mut c, &cat(&system, &seq(200, 4)), &seq(400, 8), Some(5));
        assert_eq!(c.stats().session_retired_nodes, 0);
    }

    /// A retired answer longer than what eviction needs goes whole, not just its tail.
    #[test]
    fn a_retired_answer_goes_whole() {
        let mut c = cache(9, EvictionPolicy::Auto);
        let (t1, answer) = (seq(0, 8), seq(100, 16));
        request(&mut c, &t1, &answer, Some(9));
        request(&mut c, &cat(&t1, &seq(200, 4)), &[], Some(9));
        assert_eq!(c.stats().session_retired_tokens, 16);
        // Seven pages are used of nine; a request of 8 tokens needs three, one more than free.
        request(&mut c, &seq(5000, 8), &[], None);
        assert!(
            c.tree.peek(&cat(&t1, &answer)).0 == t1.len(),
            "all four pages gone"
        );
    }

    /// A turn that continues the last one (answer kept) retires nothing; without a session
    /// nothing is remembered or retired.
    #[test]
    fn a_continued_turn_or_no_session_retires_nothing() {
        let mut c = cache(64, EvictionPolicy::Auto);
        let (t1, a1) = (seq(0, 8), seq(100, 8));
        let t2 = cat(&cat(&t1, &a1), &seq(200, 4));
        let a2 = seq(300, 8);
        let t3 = cat(&cat(&t2, &a2), &seq(400, 4));
        request(&mut c, &t1, &a1, Some(1));
        request(&mut c, &t2, &a2, Some(1));
        request(&mut c, &t3, &[], Some(1));
        assert_eq!(c.stats().session_retired_nodes, 0);
        assert_eq!(c.sessions(), 1);
        request(&mut c, &seq(500, 8), &seq(550, 8), None);
        request(&mut c, &cat(&seq(500, 8), &seq(560, 4)), &[], None);
        assert_eq!(c.stats().session_retired_nodes, 0);
        assert_eq!(c.sessions(), 1);
    }

    /// An answer someone used after its session left it is not retired; one retired and then
    /// used again is no longer first to go.
    #[test]
    fn a_used_answer_is_not_retired_and_a_use_revives() {
        let mut c = cache(64, EvictionPolicy::Lru);
        let (t1, a1) = (seq(0, 8), seq(100, 8));
        request(&mut c, &t1, &a1, Some(1));
        request(&mut c, &cat(&t1, &a1), &[], None); // another client uses it
        let t2 = cat(&t1, &seq(200, 4));
        request(&mut c, &t2, &seq(300, 8), Some(1));
        assert_eq!(c.stats().session_retired_nodes, 0, "used since: kept");
        request(&mut c, &cat(&t2, &seq(400, 4)), &[], Some(1));
        assert_eq!(
            c.stats().session_retired_nodes,
            1,
            "the second answer went unused"
        );
        let dead = cat(&t2, &seq(300, 8));
        assert!(c.tree.view(c.tree.device_victim().unwrap()).tokens == seq(300, 8)[..]);
        let m = c.match_prefix(&dead);
        assert_eq!(m.device_tokens, dead.len());
        let first = c.tree.device_victim().unwrap();
        assert!(
            c.tree.view(first).tokens != seq(300, 8)[..],
            "a use revives it"
        );
    }

    /// Two requests of one session in flight together: the second to commit does not retire
    /// the first's answer (both were admitted before either committed).
    #[test]
    fn parallel_requests_of_a_session_keep_each_other() {
        let mut c = cache(64, EvictionPolicy::Auto);
        let x = seq(0, 8);
        let ax = seq(300, 8);
        request(&mut c, &seq(900, 4), &[], Some(3));
        // y continues x's prompt, not its answer; both are admitted before either commits.
        let y = cat(&x, &seq(200, 4));
        let ay = seq(400, 8);
        let lx = admit(&mut c, &x, &ax, Some(3));
        let ly = admit(&mut c, &y, &ay, Some(3));
        let (xa, ya) = (cat(&x, &ax), cat(&y, &ay));
        c.commit(lx, &xa, xa.len());
        c.commit(ly, &ya, ya.len());
        c.check().unwrap();
        // y was admitted before x's answer existed: it retires nothing of x's (a read of the
        // session at commit would have retired x's answer).
        assert_eq!(c.stats().session_retired_nodes, 0);
        assert!(holds(&mut c, &xa));
    }

    #[test]
    fn a_prompts_head_hashes_as_that_prompt_alone() {
        let p: Vec<u32> = (0..1000).collect();
        for n in [0, 1, 17, 999, 1000] {
            let (head, _) = prompt_hashes(&p, n);
            assert_eq!(head, Some(prompt_hashes(&p[..n], usize::MAX).1), "{n}");
        }
        assert_eq!(prompt_hashes(&p, 1001).0, None);
        assert_ne!(prompt_hashes(&p[..2], 9).1, prompt_hashes(&[0, 2], 9).1);
    }

    /// The map stays bounded whatever keys clients invent.
    #[test]
    fn sessions_are_bounded() {
        let mut s = Sessions::default();
        let last = Last {
            node: NodeId(1),
            stamp: 1,
            prompt_len: 1,
            prompt_hash: 1,
        };
        for k in 0..(MAX_SESSIONS as u64 * 3) {
            s.put(k, last);
            assert!(s.len() <= MAX_SESSIONS);
        }
        // The newest are kept.
        assert!(s.get(MAX_SESSIONS as u64 * 3 - 1).is_some());
        assert!(s.get(0).is_none());
    }
}
