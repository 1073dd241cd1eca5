//! Attention for one row (a decode step), read straight from the pages: flash-decoding.
//!
//! The row's positions `0..=p` are cut into parts of [`PART`] keys. Each part is reduced on its
//! own into a partial softmax state per query head (running maximum `m`, sum `l`, output `o`
//! not yet divided by `l`), on the rayon pool the forward pass runs on; the partials are then
//! merged in part order. The part size is fixed, never derived from the thread count, so a
//! row's output is the same bits whatever `--threads` is (and whether it was decoded alone or
//! in a batch).
//!
//! Inside a part, keys go in blocks of [`BK`]: each slot's whole K and V rows (every KV head,
//! contiguous in the page) are widened to f32 once (F16C for f16, the codec for a quantized
//! dtype) into two small buffers that stay in L1, and shared by the group's query heads. Per
//! query head, scores are taken eight keys at a time (eight FMA chains, one transpose-reduce),
//! the block's exponentials eight lanes at a time, and the output update keeps the head's
//! output row in registers. AVX2 + FMA + F16C where the build has them (`x86-64-v3`: every x86
//! server, the same kernel on both vendors' cores), portable loops otherwise.

use super::{fast_exp, round_trip, Plane, Shape};
use rayon::prelude::*;

/// Keys per part (the unit of parallel work and of the merge).
pub const PART: usize = 256;
/// Keys per block inside a part (one softmax rescale per block); a multiple of 8.
const BK: usize = 16;

/// One part's softmax state per query head: maximum, sum of exponentials, and the output not
/// yet divided by the sum (`[head][head_dim]`).
struct Partial {
    m: Vec<f32>,
    l: Vec<f32>,
    o: Vec<f32>,
}

impl Partial {
    fn empty(shape: Shape) -> Partial {
        Partial {
            m: vec![f32::NEG_INFINITY; shape.heads],
            l: vec![0.0; shape.heads],
            o: vec![0.0; shape.heads * shape.head_dim],
        }
    }
}

/// Attention of the query row `q` (every head) at position `p` over positions `0..=p`, whose
/// K/V are in pages `pages` of `ps` slots; writes every head's output into `out`.
#[allow(clippy::too_many_arguments)]
pub fn row(
    shape: Shape,
    kp: Plane,
    vp: Plane,
    pages: &[u32],
    ps: usize,
    q: &[f32],
    p: usize,
    out: &mut [f32],
    scale: f32,
) {
    let hd = shape.head_dim;
    let h = shape.heads * hd;
    // The queries rounded as the K plane asks (a q8_0 K: to q8_0), then scaled.
    let mut qs = q[..h].to_vec();
    let mut buf = Vec::new();
    for qh in qs.chunks_exact_mut(hd) {
        round_trip(kp.query_rounding(), qh, &mut buf);
        qh.iter_mut().for_each(|x| *x *= scale);
    }
    let n = p + 1;
    let ctx = Ctx {
        shape,
        kp,
        vp,
        pages,
        ps,
        q: &qs,
    };
    let parts = n.div_ceil(PART);
    let merged = if parts == 1 {
        ctx.part(0, n)
    } else {
        let partials: Vec<Partial> = (0..parts)
            .into_par_iter()
            .map(|i| ctx.part(i * PART, ((i + 1) * PART).min(n)))
            .collect();
        merge(shape, &partials)
    };
    for (i, orow) in out[..h].chunks_exact_mut(hd).enumerate() {
        let inv = 1.0 / merged.l[i];
        for (d, &x) in orow.iter_mut().zip(&merged.o[i * hd..(i + 1) * hd]) {
            *d = x * inv;
        }
    }
}

/// The partials of consecutive parts merged, in order, into one.
fn merge(shape: Shape, parts: &[Partial]) -> Partial {
    let hd = shape.head_dim;
    let mut acc = Partial::empty(shape);
    for pt in parts {
        for i in 0..shape.heads {
            let m = acc.m[i].max(pt.m[i]);
            let (fa, fp) = (fast_exp(acc.m[i] - m), fast_exp(pt.m[i] - m));
            acc.m[i] = m;
            acc.l[i] = acc.l[i] * fa + pt.l[i] * fp;
            let (ao, po) = (
                &mut acc.o[i * hd..(i + 1) * hd],
                &pt.o[i * hd..(i + 1) * hd],
            );
            for (a, &b) in ao.iter_mut().zip(po) {
                *a = *a * fa + b * fp;
            }
        }
    }
    acc
}

/// What every part of one row reads.
struct Ctx<'a> {
    shape: Shape,
    kp: Plane<'a>,
    vp: Plane<'a>,
    pages: &'a [u32],
    ps: usize,
    /// Rounded and scaled queries, `[head][head_dim]`.
    q: &'a [f32],
}

impl Ctx<'_> {
    /// The softmax state of every query head over keys `t0..t1`.
    fn part(&self, t0: usize, t1: usize) -> Partial {
        let kvd = self.shape.kvd();
        let mut pt = Partial::empty(self.shape);
        let mut kb = vec![0f32; BK * kvd];
        let mut vb = vec![0f32; BK * kvd];
        for b0 in (t0..t1).step_by(BK) {
            let nb = (t1 - b0).min(BK);
            for b in 0..nb {
                let t = b0 + b;
                let sl = self.pages[t / self.ps] as usize * self.ps + t % self.ps;
                let (kd, vd) = (
                    &mut kb[b * kvd..(b + 1) * kvd],
                    &mut vb[b * kvd..(b + 1) * kvd],
                );
                match (self.kp, self.vp) {
                    (Plane::F16(k), Plane::F16(v)) => {
                        widen(&k[sl * kvd..(sl + 1) * kvd], kd);
                        widen(&v[sl * kvd..(sl + 1) * kvd], vd);
                    }
                    _ => {
                        self.kp.read(sl, kvd, 0, kd);
                        self.vp.read(sl, kvd, 0, vd);
                    }
                }
            }
            self.block(&kb, &vb, nb, &mut pt);
        }
        pt
    }

    /// Keys `0..nb` of one block (`k`, `v`: `[BK][kv_heads · head_dim]`) into the part's
    /// state.
    #[inline]
    fn block(&self, k: &[f32], v: &[f32], nb: usize, pt: &mut Partial) {
        let sh = self.shape;
        let (hd, kvd, group) = (sh.head_dim, sh.kvd(), sh.group());
        let mut s = [0f32; BK];
        for head in 0..sh.heads {
            let off = (head / group) * hd;
            let qh = &self.q[head * hd..(head + 1) * hd];
            scores(qh, &k[off..], kvd, &mut s);
            s[nb..].fill(f32::NEG_INFINITY);
            let oh = &mut pt.o[head * hd..(head + 1) * hd];
            let bmax = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            if bmax > pt.m[head] {
                let f = fast_exp(pt.m[head] - bmax);
                pt.l[head] *= f;
                oh.iter_mut().for_each(|x| *x *= f);
                pt.m[head] = bmax;
            }
            pt.l[head] += exp_sum(&mut s, nb, pt.m[head]);
            accumulate(oh, &s[..nb], &v[off..], kvd);
        }
    }
}

/// `src` in f32, F16C eight at a time where the build has it.
#[inline]
fn widen(src: &[half::f16], dst: &mut [f32]) {
    assert_eq!(src.len(), dst.len());
    let mut i = 0;
    #[cfg(all(
        target_arch = "x86_64",
        target_feature = "avx",
        target_feature = "f16c"
    ))]
    while i + 8 <= src.len() {
        use std::arch::x86_64::*;
        // SAFETY: i + 8 ≤ the length of both slices; AVX and F16C are enabled at compile
        // time.
        unsafe {
            let x = _mm256_cvtph_ps(_mm_loadu_si128(src.as_ptr().add(i).cast::<__m128i>()));
            _mm256_storeu_ps(dst.as_mut_ptr().add(i), x);
        }
        i += 8;
    }
    for (d, s) in dst[i..].iter_mut().zip(&src[i..]) {
        *d = s.to_f32();
    }
}

/// `s[b] = q · k[b * ldk..][..q.len()]` for every `b < BK`.
#[inline]
fn scores(q: &[f32], k: &[f32], ldk: usize, s: &mut [f32; BK]) {
    let hd = q.len();
    assert!(k.len() >= (BK - 1) * ldk + hd);
    #[cfg(all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma"
    ))]
    if hd.is_multiple_of(8) {
        for b in (0..BK).step_by(8) {
            // SAFETY: rows b..b + 8 of hd values, ldk apart, are inside k (checked above);
            // s holds BK ≥ b + 8 values; AVX2 and FMA are enabled at compile time.
            unsafe {
                x86::scores8(
                    q.as_ptr(),
                    k.as_ptr().add(b * ldk),
                    ldk,
                    hd,
                    s.as_mut_ptr().add(b),
                )
            };
        }
        return;
    }
    for (b, x) in s.iter_mut().enumerate() {
        *x = q
            .iter()
            .zip(&k[b * ldk..b * ldk + hd])
            .map(|(a, b)| a * b)
            .sum();
    }
}

/// `s[b] = e^(s[b] - m)` for `b < nb` and 0 past it; returns their sum (lanes of eight, then
/// across: a fixed order).
#[inline]
fn exp_sum(s: &mut [f32; BK], nb: usize, m: f32) -> f32 {
    #[cfg(all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma"
    ))]
    {
        debug_assert!(s[nb..].iter().all(|&x| x == f32::NEG_INFINITY));
        // SAFETY: s holds BK values, a multiple of 8; AVX2 and FMA are enabled at compile
        // time. The entries past nb are -∞ (the caller's padding): their exponentials are 0.
        return unsafe { x86::exp_sum(s, m) };
    }
    #[allow(unreachable_code)]
    {
        s[nb..].fill(0.0);
        let mut acc = [0f32; 8];
        for (i, x) in s[..nb].iter_mut().enumerate() {
            *x = fast_exp(*x - m);
            acc[i % 8] += *x;
        }
        acc.iter().sum()
    }
}

/// `o += Σ_b e[b] · v[b * ldv..][..o.len()]`.
#[inline]
fn accumulate(o: &mut [f32], e: &[f32], v: &[f32], ldv: usize) {
    let hd = o.len();
    assert!(e.is_empty() || v.len() >= (e.len() - 1) * ldv + hd);
    #[cfg(all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma"
    ))]
    if hd.is_multiple_of(8) {
        for d0 in (0..hd).step_by(64) {
            let w = (hd - d0).min(64);
            // SAFETY: columns d0..d0 + w of rows 0..e.len() are inside v (checked above) and
            // inside o; AVX2 and FMA are enabled at compile time.
            unsafe { x86::axpy_rows(&mut o[d0..d0 + w], e, v.as_ptr().add(d0), ldv) };
        }
        return;
    }
    for (b, &eb) in e.iter().enumerate() {
        for (x, &y) in o.iter_mut().zip(&v[b * ldv..b * ldv + hd]) {
            *x += eb * y;
        }
    }
}

#[cfg(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma"
))]
mod x86 {
    use super::BK;
    use std::arch::x86_64::*;

    /// Eight dot products `q · k[b * ldk..][..hd]`, `b < 8`, into `s[0..8]`.
    ///
    /// # Safety
    /// `q` holds `hd` values (a multiple of 8), `k` eight rows of `hd` values `ldk` apart,
    /// `s` eight values; AVX2 and FMA are available.
    #[inline]
    pub unsafe fn scores8(q: *const f32, k: *const f32, ldk: usize, hd: usize, s: *mut f32) {
        // SAFETY: every offset stays below hd in q and in each row (the caller's contract).
        unsafe {
            let mut acc = [_mm256_setzero_ps(); 8];
            let mut d = 0;
            while d < hd {
                let qv = _mm256_loadu_ps(q.add(d));
                for (b, a) in acc.iter_mut().enumerate() {
                    *a = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k.add(b * ldk + d)), *a);
                }
                d += 8;
            }
            // Transpose-reduce: lane b of the result is the sum of acc[b]'s lanes.
            let t0 = _mm256_hadd_ps(acc[0], acc[1]);
            let t1 = _mm256_hadd_ps(acc[2], acc[3]);
            let t2 = _mm256_hadd_ps(acc[4], acc[5]);
            let t3 = _mm256_hadd_ps(acc[6], acc[7]);
            let u0 = _mm256_hadd_ps(t0, t1);
            let u1 = _mm256_hadd_ps(t2, t3);
            let lo = _mm256_permute2f128_ps::<0x20>(u0, u1);
            let hi = _mm256_permute2f128_ps::<0x31>(u0, u1);
            _mm256_storeu_ps(s, _mm256_add_ps(lo, hi));
        }
    }

    /// [`super::fast_exp`] on eight lanes (the same steps, unfused, so the same values), except
    /// that -∞ gives exactly 0.
    #[inline]
    pub unsafe fn exp8(x: __m256) -> __m256 {
        // SAFETY: register-only arithmetic; AVX2 and FMA are available (the caller's contract).
        unsafe {
            let live = _mm256_cmp_ps::<_CMP_NEQ_OQ>(x, _mm256_set1_ps(f32::NEG_INFINITY));
            let x = _mm256_max_ps(x, _mm256_set1_ps(-87.0));
            let y = _mm256_mul_ps(x, _mm256_set1_ps(std::f32::consts::LOG2_E));
            let n = _mm256_floor_ps(y);
            let f = _mm256_sub_ps(y, n);
            let c = super::super::EXP2_TAYLOR;
            let mut p = _mm256_set1_ps(c[7]);
            for k in (0..7).rev() {
                p = _mm256_add_ps(_mm256_set1_ps(c[k]), _mm256_mul_ps(f, p));
            }
            let p = _mm256_add_ps(_mm256_set1_ps(1.0), _mm256_mul_ps(f, p));
            let bits = _mm256_slli_epi32::<23>(_mm256_add_epi32(
                _mm256_cvttps_epi32(n),
                _mm256_set1_epi32(127),
            ));
            _mm256_and_ps(_mm256_mul_ps(_mm256_castsi256_ps(bits), p), live)
        }
    }

    /// `s[i] = e^(s[i] - m)` for every lane; returns their sum (lane-wise over the blocks of
    /// eight, then across the lanes).
    ///
    /// # Safety
    /// AVX2 and FMA are available.
    #[inline]
    pub unsafe fn exp_sum(s: &mut [f32; BK], m: f32) -> f32 {
        // SAFETY: offsets i + 8 ≤ BK; register arithmetic otherwise.
        unsafe {
            let mv = _mm256_set1_ps(m);
            let mut acc = _mm256_setzero_ps();
            for i in (0..BK).step_by(8) {
                let e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s.as_ptr().add(i)), mv));
                _mm256_storeu_ps(s.as_mut_ptr().add(i), e);
                acc = _mm256_add_ps(acc, e);
            }
            let h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps::<1>(acc));
            let h = _mm_add_ps(h, _mm_movehl_ps(h, h));
            _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)))
        }
    }

    /// `o += Σ_b e[b] · v[b * ldv..][..o.len()]` with `o` (≤ 64 values, a multiple of 8)
    /// held in registers.
    ///
    /// # Safety
    /// `v` holds `e.len()` rows of `o.len()` values `ldv` apart; AVX2 and FMA are available.
    #[inline]
    pub unsafe fn axpy_rows(o: &mut [f32], e: &[f32], v: *const f32, ldv: usize) {
        // SAFETY: the caller's contract, passed on.
        unsafe {
            match o.len() / 8 {
                8 => axpy::<8>(o, e, v, ldv),
                4 => axpy::<4>(o, e, v, ldv),
                2 => axpy::<2>(o, e, v, ldv),
                lanes => {
                    for i in 0..lanes {
                        axpy::<1>(&mut o[i * 8..(i + 1) * 8], e, v.add(i * 8), ldv);
                    }
                }
            }
        }
    }

    /// [`axpy_rows`] for `o.len() == 8 * N` (a fixed count, so the sums stay in registers).
    ///
    /// # Safety
    /// As [`axpy_rows`].
    #[inline(always)]
    unsafe fn axpy<const N: usize>(o: &mut [f32], e: &[f32], v: *const f32, ldv: usize) {
        debug_assert_eq!(o.len(), 8 * N);
        // SAFETY: offsets stay below 8·N = o.len() in o and in each row of v.
        unsafe {
            let mut acc: [__m256; N] =
                std::array::from_fn(|i| _mm256_loadu_ps(o.as_ptr().add(i * 8)));
            for (b, &eb) in e.iter().enumerate() {
                let ev = _mm256_set1_ps(eb);
                let row = v.add(b * ldv);
                for (i, a) in acc.iter_mut().enumerate() {
                    *a = _mm256_fmadd_ps(ev, _mm256_loadu_ps(row.add(i * 8)), *a);
                }
            }
            for (i, a) in acc.iter().enumerate() {
                _mm256_storeu_ps(o.as_mut_ptr().add(i * 8), *a);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::f16;

    fn rand(seed: &mut u64) -> f32 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((*seed >> 40) as f32 / (1u64 << 24) as f32) - 0.5
    }

    /// softmax(q·Kᵀ·scale)·V in f64 for every head of one row at position `p`.
    fn naive(
        shape: Shape,
        kp: &[f16],
        vp: &[f16],
        at: &dyn Fn(usize) -> usize,
        q: &[f32],
        p: usize,
    ) -> Vec<f64> {
        let (hd, group) = (shape.head_dim, shape.heads / shape.kv_heads);
        let mut out = vec![0f64; shape.heads * hd];
        for head in 0..shape.heads {
            let g = head / group;
            let qh = &q[head * hd..(head + 1) * hd];
            let sc: Vec<f64> = (0..=p)
                .map(|t| {
                    (0..hd)
                        .map(|d| qh[d] as f64 * 0.125 * kp[at(t) + g * hd + d].to_f64())
                        .sum()
                })
                .collect();
            let mx = sc.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = sc.iter().map(|s| (s - mx).exp()).collect();
            let z: f64 = e.iter().sum();
            for d in 0..hd {
                out[head * hd + d] = (0..=p)
                    .map(|t| e[t] / z * vp[at(t) + g * hd + d].to_f64())
                    .sum();
            }
        }
        out
    }

    /// Rows over one and several parts, with part and block boundaries on and off, head
    /// dimensions on the SIMD path (64, 16) and off it (12), against the f64 reference; and the
    /// same bits on one thread as on three.
    #[test]
    fn row_matches_naive_and_ignores_thread_count() {
        for (heads, kv_heads, hd) in [(9usize, 3usize, 64usize), (6, 2, 16), (4, 4, 12)] {
            let shape = Shape {
                heads,
                kv_heads,
                head_dim: hd,
            };
            let kvd = kv_heads * hd;
            let (ps, n) = (16usize, 2 * PART + 37);
            let mut seed = 11 + hd as u64;
            let pages: Vec<u32> = (0..n.div_ceil(ps) as u32).rev().collect();
            let slots = pages.len() * ps;
            let kp: Vec<f16> = (0..slots * kvd)
                .map(|_| f16::from_f32(rand(&mut seed) * 4.0))
                .collect();
            let vp: Vec<f16> = (0..slots * kvd)
                .map(|_| f16::from_f32(rand(&mut seed)))
                .collect();
            let at = |t: usize| (pages[t / ps] as usize * ps + t % ps) * kvd;
            let h = heads * hd;
            for p in [0usize, 7, 15, 16, PART - 1, PART, PART + 5, 2 * PART, n - 1] {
                let q: Vec<f32> = (0..h).map(|_| rand(&mut seed) * 4.0).collect();
                let run = |threads: usize| {
                    let pool = rayon::ThreadPoolBuilder::new()
                        .num_threads(threads)
                        .build()
                        .unwrap();
                    let mut out = vec![0f32; h];
                    pool.install(|| {
                        row(
                            shape,
                            Plane::F16(&kp),
                            Plane::F16(&vp),
                            &pages,
                            ps,
                            &q,
                            p,
                            &mut out,
                            0.125,
                        )
                    });
                    out
                };
                let (one, three) = (run(1), run(3));
                assert_eq!(
                    one.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                    three.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                    "hd {hd} p {p}: thread count changed the bits"
                );
                let want = naive(shape, &kp, &vp, &at, &q, p);
                for (i, (&got, &w)) in one.iter().zip(&want).enumerate() {
                    assert!(
                        (got as f64 - w).abs() < 1e-4,
                        "hd {hd} p {p} [{i}]: {got} vs {w}"
                    );
                }
            }
        }
    }

    /// Packed planes (q8_0 K, with its rounded queries; fp8 V) decoded per block: the same
    /// outputs as the tiled path over the same planes, across parts.
    #[test]
    fn packed_row_matches_tile() {
        use strata_kv::dtype::Dtype;
        let shape = Shape {
            heads: 9,
            kv_heads: 3,
            head_dim: 64,
        };
        let (kvd, h, ps, n) = (192usize, 576usize, 16usize, PART + 40);
        let mut seed = 5;
        let pages: Vec<u32> = (0..n.div_ceil(ps) as u32).rev().collect();
        let slots = pages.len() * ps;
        let pack = |dtype: Dtype, amp: f32, seed: &mut u64| {
            let row = dtype.bytes_of(kvd).unwrap();
            let mut bytes = vec![0u8; slots * row];
            for r in bytes.chunks_exact_mut(row) {
                let x: Vec<f32> = (0..kvd).map(|_| rand(seed) * amp).collect();
                crate::kvcodec::encode(dtype, &x, r);
            }
            (bytes, row)
        };
        let (kbytes, krow) = pack(Dtype::Q8_0, 4.0, &mut seed);
        let (vbytes, vrow) = pack(Dtype::Fp8E4m3, 1.0, &mut seed);
        let kp = Plane::Packed {
            bytes: &kbytes,
            dtype: Dtype::Q8_0,
            row: krow,
        };
        let vp = Plane::Packed {
            bytes: &vbytes,
            dtype: Dtype::Fp8E4m3,
            row: vrow,
        };
        let kv = super::super::SeqKv::gather(shape, kp, vp, &pages, ps, n);
        for p in [3usize, PART - 1, PART + 17, n - 1] {
            let q: Vec<f32> = (0..h).map(|_| rand(&mut seed) * 4.0).collect();
            let (mut direct, mut tiled) = (vec![0f32; h], vec![0f32; h]);
            row(shape, kp, vp, &pages, ps, &q, p, &mut direct, 0.125);
            super::super::tile(shape, &kv, &q, &[p], &mut tiled, 0.125);
            for (a, b) in direct.iter().zip(&tiled) {
                assert!((a - b).abs() < 1e-5, "p {p}: row() {a} vs tile() {b}");
            }
        }
    }

    /// The eight-lane exponential gives fast_exp's bits, and exactly 0 for -∞.
    #[cfg(all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma"
    ))]
    #[test]
    fn exp8_matches_fast_exp() {
        use std::arch::x86_64::*;
        let mut xs: Vec<f32> = (0..4000).map(|i| -(i as f32) * 0.0271).collect();
        xs.extend([
            0.0,
            -0.0,
            -86.9,
            -87.0,
            -87.5,
            -1e30,
            f32::NEG_INFINITY,
            f32::MIN_POSITIVE,
        ]);
        xs.resize(xs.len().next_multiple_of(8), -1.0);
        for c in xs.chunks_exact(8) {
            let mut got = [0f32; 8];
            // SAFETY: AVX2 and FMA are enabled at compile time; both arrays hold 8 values.
            unsafe { _mm256_storeu_ps(got.as_mut_ptr(), x86::exp8(_mm256_loadu_ps(c.as_ptr()))) };
            for (&x, &g) in c.iter().zip(&got) {
                let want = if x == f32::NEG_INFINITY {
                    0.0
                } else {
                    fast_exp(x)
                };
                assert_eq!(g.to_bits(), want.to_bits(), "e^{x}: {g} vs {want}");
            }
        }
    }
}
