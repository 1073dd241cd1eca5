//! The GGUF block formats a [`super::QMatrix`] keeps, and their meaning per 32-weight group in
//! plain Rust: the reference the SIMD kernels are tested against, and the path on machines
//! without AVX2.
//!
//! Every format is read as groups of 32 weights. A group is `scale · (w − offset)` for integer
//! weights `w` (two 16-weight halves with their own integer multiplier in Q6_K) plus `min`:
//!
//! | format | bytes / block | weights | group |
//! |---|---|---|---|
//! | Q8_0 | 34 | 32 | f16 d, 32 × i8 |
//! | Q4_0 | 18 | 32 | f16 d, 16 bytes of nibbles − 8 (low nibbles are weights 0–15) |
//! | Q4_1 | 20 | 32 | f16 d, f16 m, 16 bytes of nibbles |
//! | Q4_K | 144 | 256 | f16 d, f16 dmin, 12 bytes of 6-bit scales/mins, 128 of nibbles |
//! | Q6_K | 210 | 256 | 128 bytes low nibbles, 64 of 2-bit highs, 16 × i8 scales, f16 d |
//! | F16, F32 | 64, 128 | 32 | the values |

use candle_core::quantized::GgmlDType;
use half::f16;
use rayon::prelude::*;

/// Weights per group: every format is read 32 weights at a time.
pub const GROUP: usize = 32;

/// A block format kept in memory as the file has it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q8_0,
    Q4K,
    Q6K,
}

impl Format {
    /// The formats kept as they are; any other is converted to Q8_0 when loaded.
    pub fn of(d: GgmlDType) -> Option<Format> {
        Some(match d {
            GgmlDType::F32 => Format::F32,
            GgmlDType::F16 => Format::F16,
            GgmlDType::Q4_0 => Format::Q4_0,
            GgmlDType::Q4_1 => Format::Q4_1,
            GgmlDType::Q8_0 => Format::Q8_0,
            GgmlDType::Q4K => Format::Q4K,
            GgmlDType::Q6K => Format::Q6K,
            _ => return None,
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            Format::F32 => "F32",
            Format::F16 => "F16",
            Format::Q4_0 => "Q4_0",
            Format::Q4_1 => "Q4_1",
            Format::Q8_0 => "Q8_0",
            Format::Q4K => "Q4_K",
            Format::Q6K => "Q6_K",
        }
    }

    /// Weights per block.
    pub fn block_weights(self) -> usize {
        match self {
            Format::Q4K | Format::Q6K => 256,
            _ => GROUP,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            Format::F32 => 128,
            Format::F16 => 64,
            Format::Q4_0 => 18,
            Format::Q4_1 => 20,
            Format::Q8_0 => 34,
            Format::Q4K => 144,
            Format::Q6K => 210,
        }
    }

    /// Whether the matrix products quantize activations for this format (integer dot
    /// products); F32 and F16 weights multiply f32 activations.
    pub fn integer(self) -> bool {
        !matches!(self, Format::F32 | Format::F16)
    }
}

/// Group `j` of a quantized row as integers: weights `w` (signed, or unsigned 0..=15 for the
/// affine formats), `sub` the integer multipliers of its two 16-weight halves (1, 1 but in
/// Q6_K), and the group's value is `scale · sub · w + min`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct IntGroup {
    pub w: [i8; GROUP],
    pub sub: [i32; 2],
    pub scale: f32,
    pub min: f32,
}

pub(crate) fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// Q4_K's 6-bit scale and min of sub-block `j` (0..8) from its 12 packed bytes.
pub(crate) fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// Group `j` of `row` (one matrix row in `f`'s blocks) as integers; `f` must be integer.
pub fn int_group(f: Format, row: &[u8], j: usize) -> IntGroup {
    let mut w = [0i8; GROUP];
    let one = [1, 1];
    match f {
        Format::Q8_0 => {
            let b = &row[j * 34..(j + 1) * 34];
            for (o, &v) in w.iter_mut().zip(&b[2..]) {
                *o = v as i8;
            }
            IntGroup {
                w,
                sub: one,
                scale: f16_at(b, 0),
                min: 0.0,
            }
        }
        Format::Q4_0 | Format::Q4_1 => {
            let (bytes, qs_at) = if f == Format::Q4_0 { (18, 2) } else { (20, 4) };
            let b = &row[j * bytes..(j + 1) * bytes];
            let off = if f == Format::Q4_0 { 8 } else { 0 };
            for (i, &q) in b[qs_at..].iter().enumerate() {
                w[i] = (q & 0xF) as i8 - off;
                w[i + 16] = (q >> 4) as i8 - off;
            }
            let min = if f == Format::Q4_1 { f16_at(b, 2) } else { 0.0 };
            IntGroup {
                w,
                sub: one,
                scale: f16_at(b, 0),
                min,
            }
        }
        Format::Q4K => {
            let (sb, g) = (j / 8, j % 8);
            let b = &row[sb * 144..(sb + 1) * 144];
            let (sc, m) = scale_min_k4(g, &b[4..16]);
            let qs = &b[16 + (g / 2) * 32..16 + (g / 2 + 1) * 32];
            for (o, &q) in w.iter_mut().zip(qs) {
                *o = if g % 2 == 0 { q & 0xF } else { q >> 4 } as i8;
            }
            IntGroup {
                w,
                sub: one,
                scale: f16_at(b, 0) * sc as f32,
                min: -f16_at(b, 2) * m as f32,
            }
        }
        Format::Q6K => {
            let (sb, g) = (j / 8, j % 8);
            let b = &row[sb * 210..(sb + 1) * 210];
            let (n, t) = (g / 4, g % 4);
            let ql = &b[n * 64 + (t & 1) * 32..][..32];
            let qh = &b[128 + n * 32..][..32];
            for (l, o) in w.iter_mut().enumerate() {
                let lo = if t < 2 { ql[l] & 0xF } else { ql[l] >> 4 };
                let hi = (qh[l] >> (2 * t)) & 3;
                *o = (lo | (hi << 4)) as i8 - 32;
            }
            let sc = &b[192..208];
            IntGroup {
                w,
                sub: [
                    sc[n * 8 + 2 * t] as i8 as i32,
                    sc[n * 8 + 2 * t + 1] as i8 as i32,
                ],
                scale: f16_at(b, 208),
                min: 0.0,
            }
        }
        Format::F32 | Format::F16 => unreachable!("{} has no integer groups", f.name()),
    }
}

/// Group `j` of `row` as f32 values.
pub fn group_f32(f: Format, row: &[u8], j: usize, out: &mut [f32]) {
    let out = &mut out[..GROUP];
    match f {
        Format::F32 => {
            for (o, b) in out
                .iter_mut()
                .zip(row[j * 128..(j + 1) * 128].chunks_exact(4))
            {
                *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        Format::F16 => {
            for (o, b) in out
                .iter_mut()
                .zip(row[j * 64..(j + 1) * 64].chunks_exact(2))
            {
                *o = f16::from_le_bytes([b[0], b[1]]).to_f32();
            }
        }
        _ => {
            let g = int_group(f, row, j);
            for (i, (o, &w)) in out.iter_mut().zip(&g.w).enumerate() {
                *o = g.scale * (g.sub[i / 16] * w as i32) as f32 + g.min;
            }
        }
    }
}

/// Activations quantized for the integer products: per 32-group a scale `d`, 32 × i8 and
/// `s = d · Σ q` (for the affine formats' min), row after row; `d8` and `s8` hold `d` and
/// `s / 8` eight times per group (one per 32-bit lane of a group's sums, for the AVX-512
/// kernels).
pub struct QActs {
    pub d: Vec<f32>,
    pub s: Vec<f32>,
    pub q: Vec<i8>,
    pub d8: Vec<f32>,
    pub s8: Vec<f32>,
}

impl QActs {
    pub fn quantize(x: &[f32]) -> QActs {
        let n = x.len() / GROUP;
        let (mut d, mut s, mut q) = (vec![0f32; n], vec![0f32; n], vec![0i8; n * GROUP]);
        let (mut d8, mut s8) = (vec![0f32; n * 8], vec![0f32; n * 8]);
        // Each group on its own: the same bits whichever thread takes it.
        x.par_chunks_exact(GROUP)
            .zip(q.par_chunks_exact_mut(GROUP))
            .zip(d.par_iter_mut().zip(s.par_iter_mut()))
            .zip(d8.par_chunks_exact_mut(8).zip(s8.par_chunks_exact_mut(8)))
            .with_min_len(super::PAR_MIN_ELEMS / GROUP)
            .for_each(|(((block, qb), (d, s)), (d8, s8))| {
                (*d, *s) = quantize_group(block, qb);
                d8.fill(*d);
                s8.fill(*s / 8.0);
            });
        QActs { d, s, q, d8, s8 }
    }
}

/// One group of activations to 8 bits: returns `d` (the step) and `d · Σ q`.
fn quantize_group(block: &[f32], qb: &mut [i8]) -> (f32, f32) {
    // A NaN activation is skipped by the max and becomes 0 (`as i8`); the f32 products carry it
    // through instead. Activations come from the model's own arithmetic.
    let amax = block.iter().fold(0f32, |m, v| m.max(v.abs()));
    let scale = amax / 127.0;
    let inv = if scale > 0.0 { 1.0 / scale } else { 0.0 };
    let mut sum = 0i32;
    for (o, v) in qb.iter_mut().zip(block) {
        // Within ±127 even when 1 / scale overflows (a subnormal group): the kernels' sign
        // trick needs no −128.
        *o = (v * inv).round().clamp(-127.0, 127.0) as i8;
        sum += *o as i32;
    }
    (scale, scale * sum as f32)
}

/// One row of `f` against one quantized activation row (`groups` groups from `g0`): the
/// scalar integer product.
pub fn dot_int(f: Format, row: &[u8], x: &QActs, g0: usize, groups: usize) -> f32 {
    let mut total = 0f32;
    for j in 0..groups {
        let g = int_group(f, row, j);
        let xq = &x.q[(g0 + j) * GROUP..(g0 + j + 1) * GROUP];
        let mut p = [0i32; 2];
        for (i, (&w, &q)) in g.w.iter().zip(xq).enumerate() {
            p[i / 16] += w as i32 * q as i32;
        }
        let dot = p[0] * g.sub[0] + p[1] * g.sub[1];
        total += g.scale * x.d[g0 + j] * dot as f32 + g.min * x.s[g0 + j];
    }
    total
}

/// One row of `f` against one f32 activation row: the scalar f32 product.
pub fn dot_f32(f: Format, row: &[u8], x: &[f32]) -> f32 {
    let mut w = [0f32; GROUP];
    let mut total = 0f32;
    for (j, xb) in x.chunks_exact(GROUP).enumerate() {
        group_f32(f, row, j, &mut w);
        total += w.iter().zip(xb).map(|(a, b)| a * b).sum::<f32>();
    }
    total
}
