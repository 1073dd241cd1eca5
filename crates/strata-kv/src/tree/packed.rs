//! Values as a node stores them (its tokens, its page lists): 2, 3 or 4 little-endian bytes
//! each, read, compared and keyed without widening them first.

use std::hash::Hasher;

use rustc_hash::FxHasher;

/// Values as a node stores them: 2, 3 or 4 bytes each.
#[derive(Clone, Copy, Debug)]
pub enum Packed<'a> {
    Narrow(&'a [u16]),
    /// Three little-endian bytes a value.
    Mid(&'a [u8]),
    Wide(&'a [u32]),
}

/// A node's tokens, as stored.
pub type Tokens<'a> = Packed<'a>;
/// A node's page indices in one slot, as stored (in the tree's page width).
pub type Pages<'a> = Packed<'a>;

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

/// 3-byte values appended to `out` as 32-bit ones.
fn extend_mid(out: &mut Vec<u32>, t: &[u8]) {
    out.reserve(t.len() / 3);
    let whole = t.len() / 12 * 12;
    t[..whole]
        .chunks_exact(12)
        .for_each(|c| out.extend(mid4(c)));
    out.extend(t[whole..].chunks_exact(3).map(mid));
}

impl<'a> Packed<'a> {
    /// No values.
    pub const EMPTY: Packed<'static> = Packed::Wide(&[]);

    #[inline]
    pub fn len(&self) -> usize {
        match self {
            Tokens::Narrow(t) => t.len(),
            Tokens::Mid(t) => t.len() / 3,
            Tokens::Wide(t) => t.len(),
        }
    }

    #[inline]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    #[inline]
    pub fn get(&self, i: usize) -> u32 {
        match self {
            Tokens::Narrow(t) => t[i] as u32,
            Tokens::Mid(t) => mid(&t[3 * i..3 * i + 3]),
            Tokens::Wide(t) => t[i],
        }
    }

    /// The `i`-th value, if there is one.
    #[inline]
    pub fn try_get(&self, i: usize) -> Option<u32> {
        (i < self.len()).then(|| self.get(i))
    }

    /// The values in order.
    #[inline]
    pub fn iter(self) -> impl Iterator<Item = u32> + 'a {
        (0..self.len()).map(move |i| self.get(i))
    }

    /// Appends the values to `out`.
    #[inline]
    pub fn extend_into(&self, out: &mut Vec<u32>) {
        match self {
            Packed::Wide(t) => out.extend_from_slice(t),
            Packed::Narrow(t) => out.extend(t.iter().map(|&x| x as u32)),
            Packed::Mid(t) => extend_mid(out, t),
        }
    }

    /// The narrowest width (2, 3 or 4 bytes) that holds every value.
    pub(super) fn width_needed(&self) -> usize {
        match self {
            Packed::Wide(t) => width_of(t),
            // A part of 3-byte values (a split) may fit 16 bits: stored as it would be anew.
            Packed::Mid(t) => match t.chunks_exact(3).fold(0, |m, c| m | c[2]) {
                0 => 2,
                _ => 3,
            },
            Packed::Narrow(_) => 2,
        }
    }

    #[inline]
    pub fn to_vec(&self) -> Vec<u32> {
        match self {
            Tokens::Narrow(t) => t.iter().map(|&x| x as u32).collect(),
            Tokens::Mid(t) => {
                let mut out = Vec::new();
                extend_mid(&mut out, t);
                out
            }
            Tokens::Wide(t) => t.to_vec(),
        }
    }

    /// The tokens from `a` to `b`, as stored.
    #[inline]
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

impl PartialEq<[u32]> for Packed<'_> {
    fn eq(&self, other: &[u32]) -> bool {
        self.len() == other.len() && self.common_prefix(other) == other.len()
    }
}

impl<const N: usize> PartialEq<[u32; N]> for Packed<'_> {
    fn eq(&self, other: &[u32; N]) -> bool {
        *self == other[..]
    }
}

impl PartialEq<&[u32]> for Packed<'_> {
    fn eq(&self, other: &&[u32]) -> bool {
        *self == **other
    }
}

impl<const N: usize> PartialEq<&[u32; N]> for Packed<'_> {
    fn eq(&self, other: &&[u32; N]) -> bool {
        *self == other[..]
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

/// The narrowest width (2, 3 or 4 bytes) that holds every value of `t`.
pub(super) fn width_of(t: &[u32]) -> usize {
    match t.iter().fold(0, |m, &x| m | x) {
        0..=0xFFFF => 2,
        0x1_0000..=0xFF_FFFF => 3,
        _ => 4,
    }
}

/// `src` into `dst` in `width` bytes a value (which must hold every one of them). Each arm a
/// plain loop the compiler vectorizes.
#[inline]
pub(super) fn put(dst: &mut [u8], src: Packed<'_>, width: usize) {
    match (src, width) {
        (Packed::Wide(t), 4) => dst.copy_from_slice(bytemuck::cast_slice(t)),
        (Packed::Wide(t), 3) => put_mid(dst, t),
        (Packed::Wide(t), _) => {
            // Page lists start at even offsets, as tokens do.
            let dst: &mut [u16] = bytemuck::cast_slice_mut(dst);
            dst.iter_mut().zip(t).for_each(|(d, &x)| *d = x as u16)
        }
        (Packed::Mid(t), 3) => dst.copy_from_slice(t),
        (Packed::Mid(t), 2) => {
            for (d, c) in dst.chunks_exact_mut(2).zip(t.chunks_exact(3)) {
                d.copy_from_slice(&c[..2]);
            }
        }
        (Packed::Narrow(t), 2) => dst.copy_from_slice(bytemuck::cast_slice(t)),
        (other, _) => put(dst, Packed::Wide(&other.to_vec()), width),
    }
}

/// `bytes` as values of `width` bytes.
#[inline]
pub(super) fn view(bytes: &[u8], width: usize) -> Packed<'_> {
    match width {
        4 => Packed::Wide(bytemuck::cast_slice(bytes)),
        3 => Packed::Mid(bytes),
        _ => Packed::Narrow(bytemuck::cast_slice(bytes)),
    }
}
