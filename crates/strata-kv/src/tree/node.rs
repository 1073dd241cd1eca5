//! The compact node: 48 bytes and one heap block.
//!
//! A node's tokens and its page lists live in one boxed slice of words: the tokens first, in
//! the narrowest of 2, 3 or 4 bytes that holds every one of them (16 bits; 24, as tokens of a
//! 128k–256k vocabulary need; 32), then one device page per page if the node is on device,
//! then one host page per page if it is on host, each in the tree's page width (2, 3 or 4
//! bytes: the narrowest that holds every page index of the pools, see [`Geom`]). Everything
//! else a node may carry is kept beside the arena only where it is used: page hashes (with a
//! hash namespace), window lists (layouts with window kinds), the policy's priority and GDSF's
//! key and frequency (policies other than LRU). Children are found through one edge map of the
//! whole tree, so a node holds only their count. This keeps the metadata per cached token small
//! at page size 1, where a node holds a dozen tokens (docs/BENCHMARKS.md, "Metadata").

use super::packed::{put, view};
use super::packed::{Pages, Tokens};

/// The node is live (not a free arena slot).
pub(super) const LIVE: u16 = 1;
/// Its pages are in L3 storage.
pub(super) const IN_STORAGE: u16 = 1 << 1;
/// It holds device pages (one per page).
pub(super) const DEVICE: u16 = 1 << 2;
/// It holds host pages (one per page).
pub(super) const HOST: u16 = 1 << 3;
/// Its tokens are stored one to a word (some token ≥ 2^24).
pub(super) const WIDE: u16 = 1 << 4;
/// It sits in the device / host leaf set, the device / host window set (under its current
/// key: the key's parts change only while it is in none, see `RadixTree::rekey`).
pub(super) const IN_DEV: u16 = 1 << 5;
pub(super) const IN_HOST: u16 = 1 << 6;
pub(super) const IN_DWIN: u16 = 1 << 7;
pub(super) const IN_HWIN: u16 = 1 << 8;
/// SIEVE's visited bit: hit since the hand last passed it.
pub(super) const VISITED: u16 = 1 << 9;
/// It has window lists in the tree's window map.
pub(super) const WINDOWS: u16 = 1 << 10;
/// The padding bytes after the tokens in their last word (0 to 3): `ODD` its low bit, `PAD2`
/// its high bit (narrow tokens: 2 when their number is odd; 3-byte tokens: any).
const ODD: u16 = 1 << 11;
const PAD2: u16 = 1 << 15;
/// Its tokens are stored in three bytes each (some token ≥ 2^16, every one < 2^24: the
/// vocabularies of 128k–256k tokens).
pub(super) const MID: u16 = 1 << 14;
/// `auto`: a leaf new to the history and never hit since (see `auto.rs`).
pub(super) const PROBATION: u16 = 1 << 12;
/// A leaf its session moved past (see `RadixTree::retire`): evicted before the policy's own
/// choice until something uses it again.
pub(super) const RETIRED: u16 = 1 << 13;

pub(super) const IN_ANY: u16 = IN_DEV | IN_HOST | IN_DWIN | IN_HWIN;

#[derive(Debug, Default)]
pub(super) struct Node {
    /// Tokens (packed), then device pages, then host pages (in the tree's page width). Its
    /// length, the flags, the page size and the page width give the number of pages (see
    /// [`Node::pages`]).
    data: Box<[u32]>,
    /// Clock of the last access.
    pub stamp: u64,
    pub parent: u32,
    pub children: u32,
    pub device_children: u32,
    pub lock_ref: u32,
    /// Hits, saturating.
    pub hits: u16,
    /// Storage writes reading the host pages (a few at most: a node is written once).
    pub host_lock: u16,
    pub flags: u16,
    /// The policy's frequency (GDSF, `auto`, S3-FIFO), in what would be padding.
    pub freq: u16,
}

/// What every node of a tree shares: its page size in tokens, and the bytes a page index
/// takes in a node's page lists (2, 3 or 4: the narrowest that holds every page index of the
/// tree's pools; at page size 1 a page index costs as much as a token).
#[derive(Clone, Copy, Debug)]
pub struct Geom {
    pub ps: usize,
    pub pw: usize,
}

impl Geom {
    /// The page width for pools of at most `pages` pages (indices below it).
    pub fn page_width(pages: usize) -> usize {
        match pages {
            0..=0x1_0000 => 2,
            0x1_0001..=0x100_0000 => 3,
            _ => 4,
        }
    }
}

/// Words that `n` values of `width` bytes take.
#[inline]
fn token_words(n: usize, width: usize) -> usize {
    (n * width).div_ceil(4)
}

impl Node {
    /// A node holding `tokens` (whole pages of `g.ps`), with the given page lists (each empty
    /// or one entry per page).
    pub fn pack(tokens: Tokens<'_>, g: Geom, device: Pages<'_>, host: Pages<'_>) -> Node {
        let mut n = Node::default();
        n.repack(tokens, g, device, host);
        n
    }

    /// Replaces the node's tokens and page lists (its other fields stay). Tokens are stored in
    /// the narrowest width that holds them all, pages in the tree's page width.
    pub fn repack(&mut self, tokens: Tokens<'_>, g: Geom, device: Pages<'_>, host: Pages<'_>) {
        let len = tokens.len();
        debug_assert!(len > 0 && len.is_multiple_of(g.ps));
        let pages = len / g.ps;
        let fits = |v: Pages<'_>| v.is_empty() || v.len() == pages;
        assert!(fits(device) && fits(host), "one page index per page");
        // The tree checks indices it is given before it changes (`check_page_bound`); a
        // split copies lists already in the width.
        for v in [device, host] {
            debug_assert!(
                v.width_needed() <= g.pw,
                "a page index beyond the tree's page bound"
            );
        }
        let width = tokens.width_needed();
        let tw = token_words(len, width);
        let (dn, hn) = (device.len() * g.pw, host.len() * g.pw);
        let mut data = vec![0u32; tw + (dn + hn).div_ceil(4)].into_boxed_slice();
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut data);
        put(&mut bytes[..len * width], tokens, width);
        put(&mut bytes[4 * tw..4 * tw + dn], device, g.pw);
        put(&mut bytes[4 * tw + dn..4 * tw + dn + hn], host, g.pw);
        self.data = data;
        let pad = tw * 4 - len * width;
        self.flags &= !(WIDE | MID | DEVICE | HOST | ODD | PAD2);
        self.flags |= match width {
            4 => WIDE,
            3 => MID,
            _ => 0,
        } | if pad & 1 != 0 { ODD } else { 0 }
            | if pad & 2 != 0 { PAD2 } else { 0 }
            | if device.is_empty() { 0 } else { DEVICE }
            | if host.is_empty() { 0 } else { HOST };
    }

    /// Bytes a token takes in the block (2, 3 or 4).
    #[inline]
    fn width(&self) -> usize {
        if self.has(WIDE) {
            4
        } else if self.has(MID) {
            3
        } else {
            2
        }
    }

    /// Padding bytes after the tokens in their last word.
    #[inline]
    fn pad(&self) -> usize {
        self.has(ODD) as usize | (self.has(PAD2) as usize) << 1
    }

    #[inline]
    fn slots(&self) -> usize {
        self.has(DEVICE) as usize + self.has(HOST) as usize
    }

    /// Pages, from the block's length: `4 × len = width × pages × ps + pad + pw × slots ×
    /// pages + tail` (the token bytes, their last word's padding, a page index a page a slot,
    /// and the page lists' last word's padding: under 4 bytes, and none without a slot, so
    /// less than one page's share whenever there is one: the division's floor drops it).
    #[inline]
    pub fn pages(&self, g: Geom) -> usize {
        let len = self.data.len();
        (4 * len - self.pad()) / (self.width() * g.ps + g.pw * self.slots())
    }

    #[inline]
    pub fn has(&self, flag: u16) -> bool {
        self.flags & flag != 0
    }

    #[inline]
    pub fn set(&mut self, flag: u16, on: bool) {
        if on {
            self.flags |= flag;
        } else {
            self.flags &= !flag;
        }
    }

    #[inline]
    pub fn live(&self) -> bool {
        self.has(LIVE)
    }

    #[inline]
    fn token_words(&self, g: Geom) -> usize {
        token_words(self.pages(g) * g.ps, self.width())
    }

    #[inline]
    pub fn tokens(&self, g: Geom) -> Tokens<'_> {
        self.tokens_of(self.pages(g) * g.ps)
    }

    /// The first `len` tokens (all of them, given the node's token count).
    #[inline]
    fn tokens_of(&self, len: usize) -> Tokens<'_> {
        match self.width() {
            4 => Tokens::Wide(&self.data[..len]),
            3 => Tokens::Mid(&bytemuck::cast_slice(&self.data)[..3 * len]),
            _ => Tokens::Narrow(&bytemuck::cast_slice(&self.data)[..len]),
        }
    }

    #[inline]
    pub fn token_len(&self, g: Geom) -> usize {
        self.pages(g) * g.ps
    }

    /// Where the device (`device`) or host page list lies in the block, in bytes (empty when
    /// the node is not in that tier).
    #[inline]
    fn list_range(&self, g: Geom, p: usize, device: bool) -> std::ops::Range<usize> {
        let at = 4 * token_words(p * g.ps, self.width());
        let dn = if self.has(DEVICE) { p * g.pw } else { 0 };
        match device {
            true => at..at + dn,
            false if self.has(HOST) => at + dn..at + dn + p * g.pw,
            false => at + dn..at + dn,
        }
    }

    /// The device (`device`) or host page list, given the node's page count `p`.
    #[inline]
    fn list(&self, g: Geom, p: usize, device: bool) -> Pages<'_> {
        let bytes: &[u8] = bytemuck::cast_slice(&self.data);
        view(&bytes[self.list_range(g, p, device)], g.pw)
    }

    #[inline]
    pub fn device(&self, g: Geom) -> Pages<'_> {
        self.list(g, self.pages(g), true)
    }

    #[inline]
    pub fn host(&self, g: Geom) -> Pages<'_> {
        self.list(g, self.pages(g), false)
    }

    /// The tokens, device pages and host pages at once (the page count computed once).
    #[inline]
    pub fn parts(&self, g: Geom) -> (Tokens<'_>, Pages<'_>, Pages<'_>) {
        let p = self.pages(g);
        (
            self.tokens_of(p * g.ps),
            self.list(g, p, true),
            self.list(g, p, false),
        )
    }

    /// Sets (or, with an empty list, clears) the device pages.
    pub fn set_device(&mut self, g: Geom, pages: &[u32]) {
        self.set_list(g, true, pages);
    }

    /// Sets (or clears) the host pages.
    pub fn set_host(&mut self, g: Geom, pages: &[u32]) {
        self.set_list(g, false, pages);
    }

    /// Replaces the device (`device`) or host page list, copying the tokens and the other
    /// list as stored.
    fn set_list(&mut self, g: Geom, device: bool, pages: &[u32]) {
        let new = Pages::Wide(pages);
        debug_assert!(
            new.width_needed() <= g.pw,
            "a page index beyond the tree's page bound"
        );
        let tw = self.token_words(g);
        let kept = self.list_range(g, self.pages(g), !device);
        let (nn, kn) = (pages.len() * g.pw, kept.len());
        let mut data = vec![0u32; tw + (nn + kn).div_ceil(4)].into_boxed_slice();
        data[..tw].copy_from_slice(&self.data[..tw]);
        let old: &[u8] = bytemuck::cast_slice(&self.data);
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut data);
        let lists = &mut bytes[4 * tw..4 * tw + nn + kn];
        if device {
            let (d, h) = lists.split_at_mut(nn);
            put(d, new, g.pw);
            h.copy_from_slice(&old[kept]);
        } else {
            let (d, h) = lists.split_at_mut(kn);
            d.copy_from_slice(&old[kept]);
            put(h, new, g.pw);
        }
        self.data = data;
        let (this, other) = if device {
            (DEVICE, HOST)
        } else {
            (HOST, DEVICE)
        };
        self.set(this, !pages.is_empty());
        self.set(other, kn > 0);
    }

    /// The block's length and flags agree: whole token words, then whole page lists.
    pub fn check_block(&self, g: Geom) -> Result<(), String> {
        let p = self.pages(g);
        let width = self.width();
        let tw = token_words(p * g.ps, width);
        if self.data.len() != tw + (self.slots() * p * g.pw).div_ceil(4) {
            return Err(format!(
                "a block of {} words for {p} pages",
                self.data.len()
            ));
        }
        if self.has(WIDE) && self.has(MID) {
            return Err("tokens both 3 and 4 bytes wide".into());
        }
        if self.pad() != tw * 4 - p * g.ps * width {
            return Err("the padding flags are wrong".into());
        }
        Ok(())
    }

    /// Takes `other`'s tokens and page lists in place of its own.
    pub fn take_block(&mut self, other: Node) {
        const BLOCK: u16 = WIDE | MID | DEVICE | HOST | ODD | PAD2;
        self.data = other.data;
        self.flags = (self.flags & !BLOCK) | (other.flags & BLOCK);
    }

    /// Heap bytes of the node's block.
    #[inline]
    pub fn heap_bytes(&self) -> usize {
        self.data.len() * 4
    }
}

#[cfg(test)]
mod tests {
    use super::super::packed::page_key;
    use super::*;

    fn g(ps: usize) -> Geom {
        Geom { ps, pw: 4 }
    }

    fn both(n: &Node, g: Geom) -> (Vec<u32>, Vec<u32>) {
        (n.device(g).to_vec(), n.host(g).to_vec())
    }

    fn wide(v: &[u32]) -> Pages<'_> {
        Pages::Wide(v)
    }

    #[test]
    fn node_is_48_bytes() {
        assert_eq!(std::mem::size_of::<Node>(), 48);
    }

    #[test]
    fn tokens_pack_narrow_when_they_fit_and_wide_otherwise() {
        let t = [1u32, 2, 65535, 7];
        let n = Node::pack(Tokens::Wide(&t), g(2), wide(&[9, 8]), wide(&[]));
        assert!(!n.has(WIDE));
        assert_eq!(n.heap_bytes(), 2 * 4 + 2 * 4);
        assert!(n.tokens(g(2)) == t);
        assert_eq!(n.device(g(2)), &[9, 8]);
        assert_eq!(n.host(g(2)), &[] as &[u32]);
        let m3 = Node::pack(
            Tokens::Wide(&[1u32, 65536, 3, 4]),
            g(2),
            wide(&[]),
            wide(&[5, 6]),
        );
        assert!(m3.has(MID) && !m3.has(WIDE));
        let w = [1u32, 1 << 24, 3, 4];
        let mut m = Node::pack(Tokens::Wide(&w), g(2), wide(&[]), wide(&[5, 6]));
        assert!(m.has(WIDE));
        assert!(m.tokens(g(2)) == w);
        assert_eq!(m.host(g(2)), &[5, 6]);
        m.set_device(g(2), &[1, 2]);
        assert_eq!(both(&m, g(2)), (vec![1, 2], vec![5, 6]));
        m.set_host(g(2), &[]);
        assert_eq!(both(&m, g(2)), (vec![1, 2], vec![]));
        assert!(m.tokens(g(2)) == w);
        // An odd number of narrow tokens pads the last word.
        let mut o = Node::pack(Tokens::Wide(&[3, 4, 5]), g(1), wide(&[0, 1, 2]), wide(&[]));
        assert!(o.tokens(g(1)) == [3, 4, 5]);
        assert_eq!(o.device(g(1)), &[0, 1, 2]);
        o.set_host(g(1), &[7, 8, 9]);
        assert_eq!(both(&o, g(1)), (vec![0, 1, 2], vec![7, 8, 9]));
        o.set_device(g(1), &[]);
        assert_eq!((o.pages(g(1)), o.host(g(1)).to_vec()), (3, vec![7, 8, 9]));
        o.set_host(g(1), &[]);
        assert_eq!(o.pages(g(1)), 3, "pages without any slot");
        assert!(o.tokens(g(1)) == [3, 4, 5]);
    }

    #[test]
    fn pages_follow_from_the_block_for_every_shape() {
        for pw in [2, 3, 4] {
            let g = |ps| Geom { ps, pw };
            // Page indices up to the width's largest.
            let top = (1u64 << (8 * pw)) - 1;
            for ps in 1..=5usize {
                for pages in 1..=9usize {
                    for big in [0, 1 << 20, 1 << 28] {
                        let t: Vec<u32> = (0..(pages * ps) as u32)
                            .map(|i| if i == 0 { big } else { i })
                            .collect();
                        let pg: Vec<u32> = (0..pages as u64).map(|i| (top - i) as u32).collect();
                        for (d, h) in [(true, false), (false, true), (true, true), (false, false)] {
                            let dv = if d { &pg[..] } else { &[] };
                            let hv = if h { &pg[..] } else { &[] };
                            let what = format!("pw {pw} ps {ps} pages {pages} big {big} {d} {h}");
                            let mut n = Node::pack(Tokens::Wide(&t), g(ps), wide(dv), wide(hv));
                            assert_eq!(n.pages(g(ps)), pages, "{what}");
                            n.check_block(g(ps)).unwrap();
                            assert!(n.tokens(g(ps)) == t[..]);
                            assert_eq!(both(&n, g(ps)), (dv.to_vec(), hv.to_vec()), "{what}");
                            // Refilled slots keep the rest exact.
                            n.set_host(g(ps), &pg);
                            n.set_device(g(ps), &[]);
                            n.check_block(g(ps)).unwrap();
                            assert!(n.tokens(g(ps)) == t[..], "{what}");
                            assert_eq!(both(&n, g(ps)), (vec![], pg.clone()));
                        }
                    }
                }
            }
        }
        assert_eq!(Geom::page_width(65_536), 2);
        assert_eq!(Geom::page_width(65_537), 3);
        assert_eq!(Geom::page_width(1 << 24), 3);
        assert_eq!(Geom::page_width((1 << 24) + 1), 4);
    }

    #[test]
    #[should_panic(expected = "beyond the tree's page bound")]
    fn a_page_index_beyond_the_width_is_refused() {
        Node::pack(
            Tokens::Wide(&[1]),
            Geom { ps: 1, pw: 2 },
            wide(&[65_536]),
            wide(&[]),
        );
    }

    #[test]
    fn narrow_and_wide_compare_and_key_alike() {
        let t: Vec<u32> = (0..100).map(|i| i * 7 % 1000).collect();
        let n = Node::pack(Tokens::Wide(&t), g(4), wide(&[]), wide(&[0; 25]));
        let nt = n.tokens(g(4));
        assert!(matches!(nt, Tokens::Narrow(_)));
        for cut in [0, 1, 31, 32, 33, 64, 99] {
            let mut q = t.clone();
            q[cut] += 1;
            assert_eq!(nt.common_prefix(&q), cut);
            assert_eq!(Tokens::Wide(&t).common_prefix(&q), cut);
        }
        assert_eq!(nt.common_prefix(&t[..50]), 50);
        assert_eq!(nt.page_key(4), page_key(&t[..4]));
        assert_eq!(nt.slice(4, 8).page_key(4), page_key(&t[4..8]));
        let one = Node::pack(Tokens::Wide(&[42]), g(1), wide(&[0]), wide(&[]));
        assert_eq!(one.tokens(g(1)).page_key(1), page_key(&[42]));
    }

    /// Tokens of a 128k–256k vocabulary take three bytes each, and compare, key, slice and
    /// split back exactly; a part that fits 16 bits is stored narrow again.
    #[test]
    fn three_byte_tokens_round_trip() {
        let t: Vec<u32> = (0..101).map(|i| (i * 7919 + 65_000) % 200_000).collect();
        let n = Node::pack(Tokens::Wide(&t), g(1), wide(&[0; 101]), wide(&[]));
        assert!(n.has(MID) && !n.has(WIDE));
        assert_eq!(n.heap_bytes(), (101 * 3usize).div_ceil(4) * 4 + 101 * 4);
        let nt = n.tokens(g(1));
        assert!(matches!(nt, Tokens::Mid(_)));
        assert!(nt == t[..]);
        assert_eq!(nt.to_vec(), t);
        for cut in [0, 1, 31, 32, 33, 64, 100] {
            let mut q = t.clone();
            q[cut] += 1;
            assert_eq!(nt.common_prefix(&q), cut);
        }
        assert_eq!(nt.slice(5, 9).page_key(4), page_key(&t[5..9]));
        assert_eq!(nt.get(77), t[77]);
        let low: Vec<u32> = (0..8).collect();
        let mixed = [&low[..], &[70_000]].concat();
        let m = Node::pack(Tokens::Wide(&mixed), g(1), wide(&[]), wide(&[0; 9]));
        let head = Node::pack(m.tokens(g(1)).slice(0, 8), g(1), wide(&[]), wide(&[0; 8]));
        assert!(!head.has(MID) && !head.has(WIDE), "narrow again");
        assert!(head.tokens(g(1)) == low[..]);
        // A part that still needs 24 bits is copied as stored, at any offset and length.
        for (a, b) in [(0, 101), (3, 40), (1, 2), (97, 101), (4, 16)] {
            let part = Node::pack(nt.slice(a, b), g(1), wide(&[]), wide(&[]));
            assert!(part.tokens(g(1)) == t[a..b], "{a}..{b}");
            part.check_block(g(1)).unwrap();
        }
    }
}
