//! Causal attention over paged KV with an online softmax (flash-style: no score matrix, memory
//! linear in context).
//!
//! Per layer, each sequence's K/V are gathered from its pages into f32 once ([`SeqKv`]): K
//! transposed in blocks of [`KB`] keys (`[kv_head][block][dim][KB]`, so a block's scores are a
//! small GEMM whose loads are contiguous, with no 4 KiB aliasing between dimensions) and V row
//! by row. Rows are then taken in tiles of up to [`TILE_ROWS`] rows of one sequence; for each KV
//! head a tile's query vectors (rows × query heads of the group) share every K/V block: scores
//! `Q·Kᵀ` and the update `O += P·V` are register-blocked micro-kernels ([`QB`] query vectors ×
//! 16 lanes), AVX2+FMA where the build has them, portable loops otherwise.
//!
//! A decode row (one position of a sequence whose K/V are not gathered) reads the pages in
//! place instead, split into fixed parts reduced in parallel and merged: [`decode`].
//!
//! K stored as q8_0 is dotted with queries rounded to q8_0 as well, as ggml does (its q8_0 dot
//! product takes both sides in blocks of 32 signed bytes and a scale): Strata's logits then
//! follow llama.cpp's `-ctk q8_0` to within f32 rounding instead of within one more rounding
//! of every query. The rounded query is decoded to f32, so the kernels stay the f32 ones.

use half::f16;
use half::slice::HalfFloatSliceExt;
use strata_kv::dtype::Dtype;

mod decode;
pub use decode::row;

/// Keys per block.
pub const KB: usize = 32;
/// Query vectors per micro-kernel call.
pub const QB: usize = 6;
/// Rows (positions of one sequence) per tile.
pub const TILE_ROWS: usize = 8;

/// Shape of the attention: heads, KV heads and head dimension.
#[derive(Clone, Copy, Debug)]
pub struct Shape {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

impl Shape {
    fn group(&self) -> usize {
        self.heads / self.kv_heads
    }
    fn kvd(&self) -> usize {
        self.kv_heads * self.head_dim
    }
}

/// One K or V plane of a layer, `[page][slot][kv_head * head_dim]` values in the pool's dtype:
/// f16 read as it is, a quantized dtype ([`crate::kvcodec`]) decoded a head at a time.
#[derive(Clone, Copy)]
pub enum Plane<'a> {
    F16(&'a [f16]),
    Packed {
        bytes: &'a [u8],
        dtype: Dtype,
        /// Bytes of one slot's row (every KV head).
        row: usize,
    },
}

impl Plane<'_> {
    /// The dtype queries are rounded to before their dot products with this (K) plane: q8_0
    /// for a q8_0 plane, as ggml's `vec_dot_q8_0_q8_0` takes them; none otherwise.
    fn query_rounding(&self) -> Option<Dtype> {
        match *self {
            Plane::Packed {
                dtype: Dtype::Q8_0, ..
            } => Some(Dtype::Q8_0),
            _ => None,
        }
    }

    /// Values `from..from + out.len()` of slot `slot` (page × page size + offset) whose rows
    /// hold `kvd` values, in f32 (`from` and the length whole blocks of the dtype).
    #[inline]
    pub fn read(&self, slot: usize, kvd: usize, from: usize, out: &mut [f32]) {
        match *self {
            Plane::F16(p) => {
                let b = slot * kvd + from;
                p[b..b + out.len()].convert_to_f32_slice(out);
            }
            Plane::Packed { bytes, dtype, row } => {
                let at = slot * row + dtype.bytes_of(from).expect("whole blocks");
                let n = dtype.bytes_of(out.len()).expect("whole blocks");
                crate::kvcodec::decode(dtype, &bytes[at..at + n], out);
            }
        }
    }
}

/// One sequence's K/V for one layer, in f32, padded with zeros to whole blocks.
pub struct SeqKv {
    /// `[kv_head][block][dim][KB]`.
    kt: Vec<f32>,
    /// `[position][kv_head * head_dim]`.
    v: Vec<f32>,
    blocks: usize,
    /// Queries are rounded to this dtype before their K dot products ([`Plane`]).
    q_round: Option<Dtype>,
}

/// `x` rounded to `dtype` and back, in place (a head's query: whole blocks of the dtype).
#[inline]
fn round_trip(dtype: Option<Dtype>, x: &mut [f32], buf: &mut Vec<u8>) {
    let Some(d) = dtype else { return };
    buf.resize(d.bytes_of(x.len()).expect("whole blocks"), 0);
    crate::kvcodec::encode(d, x, buf);
    crate::kvcodec::decode(d, buf, x);
}

/// Blocks of positions one job of a gather copies (a context longer than this is copied by
/// several threads).
const GATHER_SPAN: usize = 32;

impl SeqKv {
    /// Gathers positions `0..n` from the K/V planes: spans of [`GATHER_SPAN`] blocks on the
    /// pool (a copy: the same values however it is split).
    pub fn gather(shape: Shape, kp: Plane, vp: Plane, pages: &[u32], ps: usize, n: usize) -> Self {
        use rayon::prelude::*;
        let (hd, kvd) = (shape.head_dim, shape.kvd());
        let blocks = n.div_ceil(KB);
        let mut kt = vec![0f32; shape.kv_heads * blocks * hd * KB];
        let mut v = vec![0f32; blocks * KB * kvd];
        // Each job's part of every KV head's transposed K, and its part of V.
        let jobs = blocks.div_ceil(GATHER_SPAN).max(1);
        let mut ks: Vec<Vec<&mut [f32]>> = (0..jobs).map(|_| Vec::new()).collect();
        for head in kt.chunks_mut((blocks * hd * KB).max(1)) {
            for (j, part) in head.chunks_mut(GATHER_SPAN * hd * KB).enumerate() {
                ks[j].push(part);
            }
        }
        let span = |(j, (mut k, v)): (usize, (Vec<&mut [f32]>, &mut [f32]))| {
            let t0 = j * GATHER_SPAN * KB;
            let mut row = vec![0f32; kvd];
            for t in t0..n.min(t0 + GATHER_SPAN * KB) {
                let slot = pages[t / ps] as usize * ps + t % ps;
                kp.read(slot, kvd, 0, &mut row);
                let (b, i) = ((t - t0) / KB, t % KB);
                for (g, kg) in k.iter_mut().enumerate() {
                    let kg = &mut kg[b * hd * KB..(b + 1) * hd * KB];
                    for (d, &x) in row[g * hd..(g + 1) * hd].iter().enumerate() {
                        kg[d * KB + i] = x;
                    }
                }
                vp.read(slot, kvd, 0, &mut v[(t - t0) * kvd..(t - t0 + 1) * kvd]);
            }
        };
        let vs = v.chunks_mut(GATHER_SPAN * KB * kvd);
        if jobs == 1 {
            ks.into_iter().zip(vs).enumerate().for_each(span);
        } else {
            ks.into_par_iter()
                .zip(vs.collect::<Vec<_>>())
                .enumerate()
                .for_each(span);
        }
        SeqKv {
            kt,
            v,
            blocks,
            q_round: kp.query_rounding(),
        }
    }
}

/// Attention for a tile of rows of one sequence. `q` holds the tile's rows (`heads * head_dim`
/// each), `pos` their positions, `out` receives their outputs (same layout as `q`).
pub fn tile(shape: Shape, kv: &SeqKv, q: &[f32], pos: &[usize], out: &mut [f32], scale: f32) {
    if pos.len() == 1 && pos[0] >= LONE_PARALLEL_FROM && shape.kv_heads > 1 {
        // A lone row over a long context (a prompt's last token after a full prefix hit): its
        // KV heads on the pool, each computed as the loop computes it (the same bits).
        use rayon::prelude::*;
        let part = shape.group() * shape.head_dim;
        out[..shape.heads * shape.head_dim]
            .par_chunks_mut(part)
            .enumerate()
            .for_each(|(g, o)| {
                let mut row = vec![0f32; shape.heads * shape.head_dim];
                tile_heads(shape, kv, q, pos, &mut row, scale, g..g + 1);
                o.copy_from_slice(&row[g * part..(g + 1) * part]);
            });
        return;
    }
    tile_heads(shape, kv, q, pos, out, scale, 0..shape.kv_heads)
}

/// A lone row attending to at least this many positions splits its KV heads over threads.
const LONE_PARALLEL_FROM: usize = 1024;

/// [`tile`] for the KV heads `heads` (the outputs of their query heads in `out`).
fn tile_heads(
    shape: Shape,
    kv: &SeqKv,
    q: &[f32],
    pos: &[usize],
    out: &mut [f32],
    scale: f32,
    heads: std::ops::Range<usize>,
) {
    let (hd, group) = (shape.head_dim, shape.group());
    let nq = pos.len() * group;
    let pmax = *pos.iter().max().expect("non-empty tile");
    let mut qb = vec![0f32; nq * hd];
    let mut s = vec![0f32; nq * KB];
    let mut m = vec![f32::NEG_INFINITY; nq];
    let mut l = vec![0f32; nq];
    let mut o = vec![0f32; nq * hd];
    for g in heads {
        scaled_queries(shape, g, q, scale, kv.q_round, &mut qb);
        m.fill(f32::NEG_INFINITY);
        l.fill(0.0);
        o.fill(0.0);
        for b in 0..=pmax / KB {
            let t0 = b * KB;
            let kt = &kv.kt[((g * kv.blocks + b) * hd) * KB..((g * kv.blocks + b + 1) * hd) * KB];
            block_scores(nq, &qb, kt, hd, &mut s);
            // Mask, online-softmax rescale, exponentials.
            for i in 0..nq {
                let sr = &mut s[i * KB..(i + 1) * KB];
                let oi = &mut o[i * hd..(i + 1) * hd];
                softmax_step(sr, pos[i / group], t0, &mut m[i], &mut l[i], oi);
            }
            let kvd = shape.kvd();
            let v = &kv.v[t0 * kvd + g * hd..];
            block_update(nq, &s, v, kvd, &mut o, hd);
        }
        normalized_out(shape, g, &o, &l, out);
    }
}

/// Query vectors of KV head `g` from the tile's rows `q`, rounded to `round` (a q8_0 K) and
/// scaled, into `qb`: index r * group + j.
#[inline]
fn scaled_queries(
    shape: Shape,
    g: usize,
    q: &[f32],
    scale: f32,
    round: Option<Dtype>,
    qb: &mut [f32],
) {
    let (hd, group) = (shape.head_dim, shape.group());
    let h = shape.heads * hd;
    let mut buf = Vec::new();
    for (r, qr) in q.chunks_exact(h).enumerate() {
        for j in 0..group {
            let src = &qr[(g * group + j) * hd..(g * group + j + 1) * hd];
            let dst = &mut qb[(r * group + j) * hd..(r * group + j + 1) * hd];
            dst.copy_from_slice(src);
            round_trip(round, dst, &mut buf);
            for d in dst.iter_mut() {
                *d *= scale;
            }
        }
    }
}

/// Scores of all `nq` query vectors against one K block, [`QB`] vectors per kernel call.
#[inline]
fn block_scores(nq: usize, qb: &[f32], kt: &[f32], hd: usize, s: &mut [f32]) {
    let mut i = 0;
    while i < nq {
        let n = QB.min(nq - i);
        qk(
            n,
            &qb[i * hd..(i + n) * hd],
            kt,
            hd,
            &mut s[i * KB..(i + n) * KB],
        );
        i += n;
    }
}

/// One query vector's scores `sr` of the block at `t0` for a row at position `p`: masks keys
/// after `p`, rescales the running max `m`, sum `l` and output `o`, and turns `sr` into weights.
#[inline]
fn softmax_step(sr: &mut [f32], p: usize, t0: usize, m: &mut f32, l: &mut f32, o: &mut [f32]) {
    if t0 > p {
        sr.fill(0.0);
        return;
    }
    let valid = (p + 1 - t0).min(KB);
    sr[valid..].fill(f32::NEG_INFINITY);
    let bmax = sr.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if bmax > *m {
        let f = fast_exp(*m - bmax);
        *l *= f;
        for x in o.iter_mut() {
            *x *= f;
        }
        *m = bmax;
    }
    let mi = *m;
    for x in sr.iter_mut() {
        *x = fast_exp(*x - mi);
    }
    sr[valid..].fill(0.0);
    *l += sr.iter().sum::<f32>();
}

/// `O += P·V` for all `nq` query vectors over one V block, [`QB`] vectors per kernel call.
#[inline]
fn block_update(nq: usize, s: &[f32], v: &[f32], kvd: usize, o: &mut [f32], hd: usize) {
    let mut i = 0;
    while i < nq {
        let n = QB.min(nq - i);
        pv(
            n,
            &s[i * KB..(i + n) * KB],
            v,
            kvd,
            &mut o[i * hd..(i + n) * hd],
            hd,
        );
        i += n;
    }
}

/// Writes KV head `g`'s outputs `o / l` into the tile's output rows.
#[inline]
fn normalized_out(shape: Shape, g: usize, o: &[f32], l: &[f32], out: &mut [f32]) {
    let (hd, group) = (shape.head_dim, shape.group());
    let h = shape.heads * hd;
    for (r, orow) in out.chunks_exact_mut(h).enumerate() {
        for j in 0..group {
            let i = r * group + j;
            let dst = &mut orow[(g * group + j) * hd..(g * group + j + 1) * hd];
            for (d, &x) in dst.iter_mut().zip(&o[i * hd..(i + 1) * hd]) {
                *d = x / l[i];
            }
        }
    }
}

/// `s[i][0..KB] = Σ_d q[i][d] · kt[d][0..KB]` for `n ≤ QB` query vectors.
fn qk(n: usize, q: &[f32], kt: &[f32], hd: usize, s: &mut [f32]) {
    assert!(q.len() == n * hd && kt.len() == hd * KB && s.len() == n * KB && hd.is_multiple_of(8));
    #[cfg(all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma"
    ))]
    {
        // SAFETY: the lengths were checked above; every pointer offset the kernel forms stays
        // inside q (n·hd), kt (hd·KB) and s (n·KB). AVX2 and FMA are enabled at compile time.
        unsafe {
            match n {
                1 => avx::qk::<1>(q.as_ptr(), kt.as_ptr(), hd, s.as_mut_ptr()),
                2 => avx::qk::<2>(q.as_ptr(), kt.as_ptr(), hd, s.as_mut_ptr()),
                3 => avx::qk::<3>(q.as_ptr(), kt.as_ptr(), hd, s.as_mut_ptr()),
                4 => avx::qk::<4>(q.as_ptr(), kt.as_ptr(), hd, s.as_mut_ptr()),
                5 => avx::qk::<5>(q.as_ptr(), kt.as_ptr(), hd, s.as_mut_ptr()),
                _ => avx::qk::<6>(q.as_ptr(), kt.as_ptr(), hd, s.as_mut_ptr()),
            }
        }
    }
    #[cfg(not(all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma"
    )))]
    qk_portable(n, q, kt, hd, s);
}

/// `o[i][0..hd] += Σ_t p[i][t] · v[t][0..hd]` (`v` rows `ldv` apart) for `n ≤ QB` vectors.
fn pv(n: usize, p: &[f32], v: &[f32], ldv: usize, o: &mut [f32], hd: usize) {
    assert!(p.len() == n * KB && o.len() == n * hd && hd.is_multiple_of(16));
    assert!(v.len() >= (KB - 1) * ldv + hd);
    #[cfg(all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma"
    ))]
    {
        // SAFETY: the lengths were checked above; the kernel reads p (n·KB), v rows 0..KB of
        // hd values ldv apart, and reads and writes o (n·hd). AVX2 and FMA are enabled.
        unsafe {
            let (pp, vp, op) = (p.as_ptr(), v.as_ptr(), o.as_mut_ptr());
            match n {
                1 => avx::pv::<1>(pp, vp, ldv, op, hd),
                2 => avx::pv::<2>(pp, vp, ldv, op, hd),
                3 => avx::pv::<3>(pp, vp, ldv, op, hd),
                4 => avx::pv::<4>(pp, vp, ldv, op, hd),
                5 => avx::pv::<5>(pp, vp, ldv, op, hd),
                _ => avx::pv::<6>(pp, vp, ldv, op, hd),
            }
        }
    }
    #[cfg(not(all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma"
    )))]
    pv_portable(n, p, v, ldv, o, hd);
}

#[cfg_attr(
    all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma"
    ),
    allow(dead_code)
)]
fn qk_portable(n: usize, q: &[f32], kt: &[f32], hd: usize, s: &mut [f32]) {
    for i in 0..n {
        let sr = &mut s[i * KB..(i + 1) * KB];
        sr.fill(0.0);
        for d in 0..hd {
            let x = q[i * hd + d];
            for (a, &k) in sr.iter_mut().zip(&kt[d * KB..(d + 1) * KB]) {
                *a += x * k;
            }
        }
    }
}

#[cfg_attr(
    all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma"
    ),
    allow(dead_code)
)]
fn pv_portable(n: usize, p: &[f32], v: &[f32], ldv: usize, o: &mut [f32], hd: usize) {
    for i in 0..n {
        let orow = &mut o[i * hd..(i + 1) * hd];
        for t in 0..KB {
            let w = p[i * KB + t];
            for (a, &x) in orow.iter_mut().zip(&v[t * ldv..t * ldv + hd]) {
                *a += w * x;
            }
        }
    }
}

#[cfg(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma"
))]
mod avx {
    use super::KB;
    use std::arch::x86_64::*;

    /// Scores of N query vectors against one block: N × 16 accumulators per half block.
    ///
    /// # Safety
    /// `q` must hold N·hd floats, `kt` hd·KB, `s` N·KB.
    #[inline]
    pub unsafe fn qk<const N: usize>(q: *const f32, kt: *const f32, hd: usize, s: *mut f32) {
        for half in 0..KB / 16 {
            let mut acc = [[_mm256_setzero_ps(); 2]; N];
            for d in 0..hd {
                let k = kt.add(d * KB + half * 16);
                let (k0, k1) = (_mm256_loadu_ps(k), _mm256_loadu_ps(k.add(8)));
                for (i, a) in acc.iter_mut().enumerate() {
                    let x = _mm256_broadcast_ss(&*q.add(i * hd + d));
                    a[0] = _mm256_fmadd_ps(x, k0, a[0]);
                    a[1] = _mm256_fmadd_ps(x, k1, a[1]);
                }
            }
            for (i, a) in acc.iter().enumerate() {
                let dst = s.add(i * KB + half * 16);
                _mm256_storeu_ps(dst, a[0]);
                _mm256_storeu_ps(dst.add(8), a[1]);
            }
        }
    }

    /// `O += P·V` for N query vectors, 16 output lanes at a time.
    ///
    /// # Safety
    /// `p` must hold N·KB floats, `v` KB rows of hd floats `ldv` apart, `o` N·hd.
    #[inline]
    pub unsafe fn pv<const N: usize>(
        p: *const f32,
        v: *const f32,
        ldv: usize,
        o: *mut f32,
        hd: usize,
    ) {
        for c in (0..hd).step_by(16) {
            let mut acc = [[_mm256_setzero_ps(); 2]; N];
            for (i, a) in acc.iter_mut().enumerate() {
                a[0] = _mm256_loadu_ps(o.add(i * hd + c));
                a[1] = _mm256_loadu_ps(o.add(i * hd + c + 8));
            }
            for t in 0..KB {
                let vr = v.add(t * ldv + c);
                let (v0, v1) = (_mm256_loadu_ps(vr), _mm256_loadu_ps(vr.add(8)));
                for (i, a) in acc.iter_mut().enumerate() {
                    let w = _mm256_broadcast_ss(&*p.add(i * KB + t));
                    a[0] = _mm256_fmadd_ps(w, v0, a[0]);
                    a[1] = _mm256_fmadd_ps(w, v1, a[1]);
                }
            }
            for (i, a) in acc.iter().enumerate() {
                _mm256_storeu_ps(o.add(i * hd + c), a[0]);
                _mm256_storeu_ps(o.add(i * hd + c + 8), a[1]);
            }
        }
    }
}

/// Taylor series of 2^f = e^(f ln 2) to the 8th power (after the constant 1): truncation error
/// below 2e-7 on [0, 1).
const EXP2_TAYLOR: [f32; 8] = [
    std::f32::consts::LN_2,
    0.240_226_5,
    0.055_504_11,
    0.009_618_129,
    0.001_333_355,
    0.000_154_035_3,
    0.000_015_252_73,
    0.000_001_321_548,
];

/// e^x for x ≤ 0 (softmax arguments), branch-free so loops over it vectorise: 2^(x·log2 e) by
/// splitting into integer and fraction, with a degree-8 polynomial for 2^f (relative error
/// below 1e-5, from rounding x·log2 e in f32); arguments below -87 (and -∞) give about 0.
#[inline]
pub fn fast_exp(x: f32) -> f32 {
    let x = x.max(-87.0);
    let y = x * std::f32::consts::LOG2_E;
    let n = y.floor();
    let f = y - n;
    let c = EXP2_TAYLOR;
    let mut p = c[7];
    for k in (0..7).rev() {
        p = c[k] + f * p;
    }
    let p = 1.0 + f * p;
    f32::from_bits(((n as i32 + 127) as u32) << 23) * p
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fast_exp_matches_exp() {
        let mut worst = 0f32;
        let mut x = -87.0f32;
        while x <= 0.0 {
            let r = (fast_exp(x) - x.exp()).abs() / x.exp();
            worst = worst.max(r);
            x += 0.0137;
        }
        // Bounded by rounding x·log2(e) in f32 for large |x| (half an ulp of 125 is 4e-6).
        assert!(worst < 1e-5, "relative error {worst}");
        assert!(fast_exp(-1000.0) >= 0.0 && fast_exp(-1000.0) < 1e-37);
        assert!(fast_exp(f32::NEG_INFINITY) < 1e-37);
        assert!((fast_exp(0.0) - 1.0).abs() < 1e-7);
    }

    fn rand(seed: &mut u64) -> f32 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((*seed >> 40) as f32 / (1u64 << 24) as f32) - 0.5
    }

    /// Random K (within ±2) and V (within ±0.5) planes of `slots` slots of `kvd` values.
    fn planes(seed: &mut u64, slots: usize, kvd: usize) -> (Vec<f16>, Vec<f16>) {
        let kp = (0..slots * kvd)
            .map(|_| f16::from_f32(rand(seed) * 4.0))
            .collect();
        let vp = (0..slots * kvd)
            .map(|_| f16::from_f32(rand(seed)))
            .collect();
        (kp, vp)
    }

    /// A long context is gathered by several jobs, each value where one job would put it; a
    /// lone row over it (its KV heads on the pool) gets the bits it gets as the last row of a
    /// tile (computed head after head).
    #[test]
    fn a_lone_rows_heads_in_parallel_are_the_tiles_bits() {
        let shape = Shape {
            heads: 6,
            kv_heads: 3,
            head_dim: 16,
        };
        let (kvd, h, ps) = (48, 96, 16usize);
        let n = LONE_PARALLEL_FROM + 77;
        let mut seed = 11;
        let pages: Vec<u32> = (0..n.div_ceil(ps) as u32).collect();
        let (kp, vp) = planes(&mut seed, pages.len() * ps, kvd);
        let kv = SeqKv::gather(shape, Plane::F16(&kp), Plane::F16(&vp), &pages, ps, n);
        // The gather (several spans here, on the pool) put every value where it belongs.
        let blocks = n.div_ceil(KB);
        for t in 0..n {
            let slot = pages[t / ps] as usize * ps + t % ps;
            for c in 0..kvd {
                let (g, d) = (c / 16, c % 16);
                let k = kv.kt[((g * blocks + t / KB) * 16 + d) * KB + t % KB];
                assert_eq!(k, kp[slot * kvd + c].to_f32(), "K of position {t}");
                assert_eq!(kv.v[t * kvd + c], vp[slot * kvd + c].to_f32(), "V of {t}");
            }
        }
        let q: Vec<f32> = (0..2 * h).map(|_| rand(&mut seed) * 4.0).collect();
        let mut two = vec![0f32; 2 * h];
        tile(shape, &kv, &q, &[n - 2, n - 1], &mut two, 0.25);
        let mut one = vec![0f32; h];
        tile(shape, &kv, &q[h..], &[n - 1], &mut one, 0.25);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&one), bits(&two[h..]));
    }

    /// The tiled kernels against a plain softmax(QKᵀ)V, for odd tiles, positions on and off
    /// block boundaries, and every micro-kernel width.
    #[test]
    fn tile_matches_naive_attention() {
        let shape = Shape {
            heads: 6,
            kv_heads: 2,
            head_dim: 16,
        };
        let (hd, kvd, h) = (16, 32, 96);
        let (ps, n) = (4usize, 75usize);
        let mut seed = 7;
        // Pages in a scrambled order, to check the gather follows the page table.
        let pages: Vec<u32> = (0..n.div_ceil(ps) as u32).rev().collect();
        let (kp, vp) = planes(&mut seed, pages.len() * ps, kvd);
        let kv = SeqKv::gather(shape, Plane::F16(&kp), Plane::F16(&vp), &pages, ps, n);
        let at = |t: usize| (pages[t / ps] as usize * ps + t % ps) * kvd;
        for rows in [1usize, 2, 5, 8] {
            for first in [0usize, 30, 31, 32, 75 - rows] {
                let pos: Vec<usize> = (first..first + rows).collect();
                let q: Vec<f32> = (0..rows * h).map(|_| rand(&mut seed) * 4.0).collect();
                let mut out = vec![0f32; rows * h];
                tile(shape, &kv, &q, &pos, &mut out, 0.25);
                if rows == 1 {
                    let mut direct = vec![0f32; h];
                    row(
                        shape,
                        Plane::F16(&kp),
                        Plane::F16(&vp),
                        &pages,
                        ps,
                        &q,
                        first,
                        &mut direct,
                        0.25,
                    );
                    for (a, b) in direct.iter().zip(&out) {
                        assert!((a - b).abs() < 1e-5, "row() {a} vs tile() {b}");
                    }
                }
                for (r, &p) in pos.iter().enumerate() {
                    for head in 0..6 {
                        let g = head / 3;
                        let qh = &q[r * h + head * hd..r * h + (head + 1) * hd];
                        let sc: Vec<f64> = (0..=p)
                            .map(|t| {
                                (0..hd)
                                    .map(|d| qh[d] as f64 * 0.25 * kp[at(t) + g * hd + d].to_f64())
                                    .sum()
                            })
                            .collect();
                        let mx = sc.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                        let e: Vec<f64> = sc.iter().map(|s| (s - mx).exp()).collect();
                        let z: f64 = e.iter().sum();
                        for d in 0..hd {
                            let want: f64 = (0..=p)
                                .map(|t| e[t] / z * vp[at(t) + g * hd + d].to_f64())
                                .sum();
                            let got = out[r * h + head * hd + d] as f64;
                            assert!(
                                (got - want).abs() < 1e-4,
                                "rows {rows} pos {p} head {head} dim {d}: {got} vs {want}"
                            );
                        }
                    }
                }
            }
        }
    }
}
