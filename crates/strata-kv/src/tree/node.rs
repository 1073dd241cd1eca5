//! The compact node: 48 bytes and one heap block.
//!
//! A node's tokens and its page lists live in one boxed slice of words: the tokens first, in
//! the narrowest of 2, 3 or 4 bytes that holds every one of them (16 bits; 24, as tokens of a
//! 128k–256k vocabulary need; 32), then one device page per page if the node is on device,
//! then one host page per page if it is on host. Everything
//! else a node may carry is kept beside the arena only where it is used: page hashes (with a
//! hash namespace), window lists (layouts with window kinds), the policy's priority and GDSF's
//! key and frequency (policies other than LRU). Children are found through one edge map of the
//! whole tree, so a node holds only their count. This keeps the metadata per cached token small
//! at page size 1, where a node holds a dozen tokens (docs/BENCHMARKS.md, "Metadata").

use std::hash::Hasher;

use rustc_hash::FxHasher;

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
    /// Tokens (packed), then device pages, then host pages. Its length, the flags and the
    /// page size give the number of pages (see [`Node::pages`]).
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

/// A node's tokens, as stored.
#[derive(Clone, Copy, Debug)]
pub enum Tokens<'a> {
    Narrow(&'a [u16]),
    /// Three little-endian bytes a token.
    Mid(&'a [u8]),
    Wide(&'a [u32]),
}

/// The token in three little-endian bytes.
#[inline]
fn mid(b: &[u8]) -> u32 {
    b[0] as u32 | (b[1] as u32) << 8 | (b[2] as u32) << 16
}

/// Four tokens from their twelve bytes (three little-endian words: loads and shifts the
/// compiler vectorizes, where a byte at a time does not).
#[inline]
fn mid4(c: &[u8]) -> [u32; 4] {
    let w = |k: usize| u32::from_le_bytes([c[4 * k], c[4 * k + 1], c[4 * k + 2], c[4 * k + 3]]);
    let (w0, w1, w2) = (w(0), w(1), w(2));
    [
        w0 & 0xFF_FFFF,
        w0 >> 24 | (w1 & 0xFFFF) << 8,
        w1 >> 16 | (w2 & 0xFF) << 16,
        w2 >> 8,
    ]
}

/// Tokens (each below 2^24) into `3 × t.len()` bytes, four at a time.
fn put_mid(d: &mut [u8], t: &[u32]) {
    let whole = t.len() / 4 * 4;
    for (d, t) in d[..whole * 3].chunks_exact_mut(12).zip(t.chunks_exact(4)) {
        let w = [
            t[0] | t[1] << 24,
            t[1] >> 8 | t[2] << 16,
            t[2] >> 16 | t[3] << 8,
        ];
        for k in 0..3 {
            d[4 * k..4 * k + 4].copy_from_slice(&w[k].to_le_bytes());
        }
    }
    for (d, &x) in d[whole * 3..].chunks_exact_mut(3).zip(&t[whole..]) {
        d.copy_from_slice(&x.to_le_bytes()[..3]);
    }
}

/// 3-byte tokens as 32-bit ones.
fn mid_to_vec(t: &[u8]) -> Vec<u32> {
    let mut out = Vec::with_capacity(t.len() / 3);
    let whole = t.len() / 12 * 12;
    t[..whole]
        .chunks_exact(12)
        .for_each(|c| out.extend(mid4(c)));
    out.extend(t[whole..].chunks_exact(3).map(mid));
    out
}

impl<'a> Tokens<'a> {
    pub fn len(&self) -> usize {
        match self {
            Tokens::Narrow(t) => t.len(),
            Tokens::Mid(t) => t.len() / 3,
            Tokens::Wide(t) => t.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn get(&self, i: usize) -> u32 {
        match self {
            Tokens::Narrow(t) => t[i] as u32,
            Tokens::Mid(t) => mid(&t[3 * i..3 * i + 3]),
            Tokens::Wide(t) => t[i],
        }
    }

    pub fn to_vec(&self) -> Vec<u32> {
        match self {
            Tokens::Narrow(t) => t.iter().map(|&x| x as u32).collect(),
            Tokens::Mid(t) => mid_to_vec(t),
            Tokens::Wide(t) => t.to_vec(),
        }
    }

    /// The tokens from `a` to `b`, as stored.
    pub fn slice(&self, a: usize, b: usize) -> Tokens<'a> {
        match self {
            Tokens::Narrow(t) => Tokens::Narrow(&t[a..b]),
            Tokens::Mid(t) => Tokens::Mid(&t[3 * a..3 * b]),
            Tokens::Wide(t) => Tokens::Wide(&t[a..b]),
        }
    }

    /// Length of the common prefix with `other`.
    pub fn common_prefix(&self, other: &[u32]) -> usize {
        match self {
            Tokens::Wide(t) => common_prefix(t, other),
            Tokens::Mid(t) => common_prefix_mid(t, other),
            Tokens::Narrow(t) => common_prefix_narrow(t, other),
        }
    }

    /// The edge key of a page starting here ([`page_key`] of the same tokens).
    pub fn page_key(&self, ps: usize) -> u64 {
        match self {
            Tokens::Wide(t) => page_key(&t[..ps]),
            Tokens::Mid(t) => key_of(t[..3 * ps].chunks_exact(3).map(mid), ps),
            Tokens::Narrow(t) => key_of(t[..ps].iter().map(|&x| x as u32), ps),
        }
    }
}

impl PartialEq<[u32]> for Tokens<'_> {
    fn eq(&self, other: &[u32]) -> bool {
        self.len() == other.len() && self.common_prefix(other) == other.len()
    }
}

impl<const N: usize> PartialEq<[u32; N]> for Tokens<'_> {
    fn eq(&self, other: &[u32; N]) -> bool {
        *self == other[..]
    }
}

impl PartialEq<&[u32]> for Tokens<'_> {
    fn eq(&self, other: &&[u32]) -> bool {
        *self == **other
    }
}

/// The key of a page among its siblings (the token itself at page size 1).
pub(super) fn page_key(page: &[u32]) -> u64 {
    key_of(page.iter().copied(), page.len())
}

/// [`page_key`] of `len` tokens, whatever their stored width.
fn key_of(mut tokens: impl Iterator<Item = u32>, len: usize) -> u64 {
    if len == 1 {
        return tokens.next().unwrap_or(0) as u64;
    }
    let mut h = FxHasher::default();
    tokens.for_each(|t| h.write_u32(t));
    h.finish()
}

/// Length of the common prefix of `a` and `b`.
pub(super) fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    let n = a.len().min(b.len());
    // Compare in blocks so the compiler emits wide compares; finish token by token.
    const B: usize = 32;
    let mut i = 0;
    while i + B <= n && a[i..i + B] == b[i..i + B] {
        i += B;
    }
    while i < n && a[i] == b[i] {
        i += 1;
    }
    i
}

/// [`common_prefix`] of 16-bit stored tokens against 32-bit ones.
fn common_prefix_narrow(a: &[u16], b: &[u32]) -> usize {
    let n = a.len().min(b.len());
    const B: usize = 32;
    let mut i = 0;
    // A fold without early exit vectorizes (widen, compare, and-reduce).
    while i + B <= n
        && a[i..i + B]
            .iter()
            .zip(&b[i..i + B])
            .fold(true, |ok, (&x, &y)| ok & (x as u32 == y))
    {
        i += B;
    }
    while i < n && a[i] as u32 == b[i] {
        i += 1;
    }
    i
}

/// [`common_prefix`] of 3-byte stored tokens against 32-bit ones.
fn common_prefix_mid(a: &[u8], b: &[u32]) -> usize {
    let n = (a.len() / 3).min(b.len());
    const B: usize = 32;
    let mut i = 0;
    while i + B <= n
        && a[3 * i..3 * (i + B)]
            .chunks_exact(12)
            .zip(b[i..i + B].chunks_exact(4))
            .fold(true, |ok, (x, y)| ok & (mid4(x) == y))
    {
        i += B;
    }
    while i < n && mid(&a[3 * i..3 * i + 3]) == b[i] {
        i += 1;
    }
    i
}

/// Words that `n` tokens of `width` bytes take.
fn token_words(n: usize, width: usize) -> usize {
    (n * width).div_ceil(4)
}

/// The narrowest width (2, 3 or 4 bytes) that holds every token of `t`.
fn width_of(t: &[u32]) -> usize {
    match t.iter().fold(0, |m, &x| m | x) {
        0..=0xFFFF => 2,
        0x1_0000..=0xFF_FFFF => 3,
        _ => 4,
    }
}

impl Node {
    /// A node holding `tokens` (whole pages of `ps`), with the given page lists (each empty or
    /// one entry per page).
    pub fn pack(tokens: Tokens<'_>, ps: usize, device: &[u32], host: &[u32]) -> Node {
        let mut n = Node::default();
        n.repack(tokens, ps, device, host);
        n
    }

    /// Replaces the node's tokens and page lists (its other fields stay). Tokens are stored in
    /// the narrowest width that holds them all.
    pub fn repack(&mut self, tokens: Tokens<'_>, ps: usize, device: &[u32], host: &[u32]) {
        let len = tokens.len();
        debug_assert!(len > 0 && len.is_multiple_of(ps));
        let pages = len / ps;
        let fits = |v: &[u32]| v.is_empty() || v.len() == pages;
        assert!(fits(device) && fits(host), "one page index per page");
        let width = match tokens {
            Tokens::Wide(t) => width_of(t),
            // A part of 3-byte tokens (a split) may fit 16 bits: stored as it would be anew.
            Tokens::Mid(t) => match t.chunks_exact(3).fold(0, |m, c| m | c[2]) {
                0 => 2,
                _ => 3,
            },
            Tokens::Narrow(_) => 2,
        };
        let tw = token_words(len, width);
        let mut data = vec![0u32; tw + device.len() + host.len()].into_boxed_slice();
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut data[..tw]);
        // Each arm a plain loop the compiler vectorizes.
        match (tokens, width) {
            (Tokens::Wide(t), 4) => bytemuck::cast_slice_mut(bytes).copy_from_slice(t),
            (Tokens::Wide(t), 3) => put_mid(bytes, t),
            (Tokens::Wide(t), _) => {
                let dst: &mut [u16] = bytemuck::cast_slice_mut(bytes);
                dst.iter_mut().zip(t).for_each(|(d, &x)| *d = x as u16)
            }
            (Tokens::Mid(t), 3) => bytes[..t.len()].copy_from_slice(t),
            (Tokens::Mid(t), _) => {
                let dst: &mut [u16] = bytemuck::cast_slice_mut(bytes);
                let lo = |c: &[u8]| c[0] as u16 | (c[1] as u16) << 8;
                dst.iter_mut()
                    .zip(t.chunks_exact(3))
                    .for_each(|(d, c)| *d = lo(c))
            }
            (Tokens::Narrow(t), _) => {
                let dst: &mut [u16] = bytemuck::cast_slice_mut(bytes);
                dst[..len].copy_from_slice(t)
            }
        }
        data[tw..tw + device.len()].copy_from_slice(device);
        data[tw + device.len()..].copy_from_slice(host);
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
    fn pad(&self) -> usize {
        self.has(ODD) as usize | (self.has(PAD2) as usize) << 1
    }

    /// Pages, from the block's length: `4 × len = width × pages × ps + pad + 4 × slots ×
    /// pages` (the token bytes, their last word's padding, one word a page a slot).
    pub fn pages(&self, ps: usize) -> usize {
        let len = self.data.len();
        let slots = self.has(DEVICE) as usize + self.has(HOST) as usize;
        (4 * len - self.pad()) / (self.width() * ps + 4 * slots)
    }

    pub fn has(&self, flag: u16) -> bool {
        self.flags & flag != 0
    }

    pub fn set(&mut self, flag: u16, on: bool) {
        if on {
            self.flags |= flag;
        } else {
            self.flags &= !flag;
        }
    }

    pub fn live(&self) -> bool {
        self.has(LIVE)
    }

    fn token_words(&self, ps: usize) -> usize {
        token_words(self.pages(ps) * ps, self.width())
    }

    pub fn tokens(&self, ps: usize) -> Tokens<'_> {
        let len = self.pages(ps) * ps;
        let width = self.width();
        let bytes: &[u8] = bytemuck::cast_slice(&self.data[..token_words(len, width)]);
        match width {
            4 => Tokens::Wide(bytemuck::cast_slice(bytes)),
            3 => Tokens::Mid(&bytes[..3 * len]),
            _ => Tokens::Narrow(&bytemuck::cast_slice(bytes)[..len]),
        }
    }

    pub fn token_len(&self, ps: usize) -> usize {
        self.pages(ps) * ps
    }

    pub fn device(&self, ps: usize) -> &[u32] {
        if !self.has(DEVICE) {
            return &[];
        }
        let p = self.pages(ps);
        let at = token_words(p * ps, self.width());
        &self.data[at..at + p]
    }

    pub fn host(&self, ps: usize) -> &[u32] {
        if !self.has(HOST) {
            return &[];
        }
        let at = self.data.len() - self.pages(ps);
        &self.data[at..]
    }

    /// Sets (or, with an empty list, clears) the device pages.
    pub fn set_device(&mut self, ps: usize, pages: &[u32]) {
        let host = self.host(ps).to_vec();
        self.rebuild_pages(ps, pages, &host);
    }

    /// Sets (or clears) the host pages.
    pub fn set_host(&mut self, ps: usize, pages: &[u32]) {
        let device = self.device(ps).to_vec();
        self.rebuild_pages(ps, &device, pages);
    }

    fn rebuild_pages(&mut self, ps: usize, device: &[u32], host: &[u32]) {
        let tw = self.token_words(ps);
        let mut data = Vec::with_capacity(tw + device.len() + host.len());
        data.extend_from_slice(&self.data[..tw]);
        data.extend_from_slice(device);
        data.extend_from_slice(host);
        self.data = data.into_boxed_slice();
        self.set(DEVICE, !device.is_empty());
        self.set(HOST, !host.is_empty());
    }

    /// The block's length and flags agree: whole token words, then whole page lists.
    pub fn check_block(&self, ps: usize) -> Result<(), String> {
        let p = self.pages(ps);
        let width = self.width();
        let slots = self.has(DEVICE) as usize + self.has(HOST) as usize;
        let tw = token_words(p * ps, width);
        if self.data.len() != tw + slots * p {
            return Err(format!(
                "a block of {} words for {p} pages",
                self.data.len()
            ));
        }
        if self.has(WIDE) && self.has(MID) {
            return Err("tokens both 3 and 4 bytes wide".into());
        }
        if self.pad() != tw * 4 - p * ps * width {
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
    pub fn heap_bytes(&self) -> usize {
        self.data.len() * 4
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_is_48_bytes() {
        assert_eq!(std::mem::size_of::<Node>(), 48);
    }

    #[test]
    fn tokens_pack_narrow_when_they_fit_and_wide_otherwise() {
        let t = [1u32, 2, 65535, 7];
        let n = Node::pack(Tokens::Wide(&t), 2, &[9, 8], &[]);
        assert!(!n.has(WIDE));
        assert_eq!(n.heap_bytes(), 2 * 4 + 2 * 4);
        assert!(n.tokens(2) == t);
        assert_eq!(n.device(2), &[9, 8]);
        assert_eq!(n.host(2), &[] as &[u32]);
        let m3 = Node::pack(Tokens::Wide(&[1u32, 65536, 3, 4]), 2, &[], &[5, 6]);
        assert!(m3.has(MID) && !m3.has(WIDE));
        let w = [1u32, 1 << 24, 3, 4];
        let mut m = Node::pack(Tokens::Wide(&w), 2, &[], &[5, 6]);
        assert!(m.has(WIDE));
        assert!(m.tokens(2) == w);
        assert_eq!(m.host(2), &[5, 6]);
        m.set_device(2, &[1, 2]);
        assert_eq!((m.device(2), m.host(2)), (&[1, 2][..], &[5, 6][..]));
        m.set_host(2, &[]);
        assert_eq!((m.device(2), m.host(2)), (&[1, 2][..], &[][..]));
        assert!(m.tokens(2) == w);
        // An odd number of narrow tokens pads the last word.
        let mut o = Node::pack(Tokens::Wide(&[3, 4, 5]), 1, &[0, 1, 2], &[]);
        assert!(o.tokens(1) == [3, 4, 5]);
        assert_eq!(o.device(1), &[0, 1, 2]);
        o.set_host(1, &[7, 8, 9]);
        assert_eq!((o.device(1), o.host(1)), (&[0, 1, 2][..], &[7, 8, 9][..]));
        o.set_device(1, &[]);
        assert_eq!((o.pages(1), o.host(1)), (3, &[7, 8, 9][..]));
        o.set_host(1, &[]);
        assert_eq!(o.pages(1), 3, "pages without any slot");
        assert!(o.tokens(1) == [3, 4, 5]);
    }

    #[test]
    fn pages_follow_from_the_block_for_every_shape() {
        for ps in 1..=5usize {
            for pages in 1..=9usize {
                for big in [0, 1 << 20, 1 << 28] {
                    let t: Vec<u32> = (0..(pages * ps) as u32)
                        .map(|i| if i == 0 { big } else { i })
                        .collect();
                    let wide = big;
                    let pg: Vec<u32> = (0..pages as u32).collect();
                    for (d, h) in [(true, false), (false, true), (true, true), (false, false)] {
                        let dv = if d { &pg[..] } else { &[] };
                        let hv = if h { &pg[..] } else { &[] };
                        let n = Node::pack(Tokens::Wide(&t), ps, dv, hv);
                        assert_eq!(n.pages(ps), pages, "ps {ps} wide {wide} {d} {h}");
                        n.check_block(ps).unwrap();
                        assert!(n.tokens(ps) == t[..]);
                        assert_eq!((n.device(ps), n.host(ps)), (dv, hv));
                    }
                }
            }
        }
    }

    #[test]
    fn narrow_and_wide_compare_and_key_alike() {
        let t: Vec<u32> = (0..100).map(|i| i * 7 % 1000).collect();
        let n = Node::pack(Tokens::Wide(&t), 4, &[], &[0; 25]);
        let nt = n.tokens(4);
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
        let one = Node::pack(Tokens::Wide(&[42]), 1, &[0], &[]);
        assert_eq!(one.tokens(1).page_key(1), page_key(&[42]));
    }

    /// Tokens of a 128k–256k vocabulary take three bytes each, and compare, key, slice and
    /// split back exactly; a part that fits 16 bits is stored narrow again.
    #[test]
    fn three_byte_tokens_round_trip() {
        let t: Vec<u32> = (0..101).map(|i| (i * 7919 + 65_000) % 200_000).collect();
        let n = Node::pack(Tokens::Wide(&t), 1, &[0; 101], &[]);
        assert!(n.has(MID) && !n.has(WIDE));
        assert_eq!(n.heap_bytes(), (101 * 3usize).div_ceil(4) * 4 + 101 * 4);
        let nt = n.tokens(1);
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
        let m = Node::pack(Tokens::Wide(&mixed), 1, &[], &[0; 9]);
        let head = Node::pack(m.tokens(1).slice(0, 8), 1, &[], &[0; 8]);
        assert!(!head.has(MID) && !head.has(WIDE), "narrow again");
        assert!(head.tokens(1) == low[..]);
        // A part that still needs 24 bits is copied as stored, at any offset and length.
        for (a, b) in [(0, 101), (3, 40), (1, 2), (97, 101), (4, 16)] {
            let part = Node::pack(nt.slice(a, b), 1, &[], &[]);
            assert!(part.tokens(1) == t[a..b], "{a}..{b}");
            part.check_block(1).unwrap();
        }
    }
}
