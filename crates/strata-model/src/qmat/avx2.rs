//! AVX2 kernels over the block formats: one 32-weight group is unpacked to 32 bytes in one
//! register ([`Unpack::group`]) and then multiplied with up to eight activation rows, either
//! quantized (`maddubs` integer dot products) or f32 (FMA), so each weight block is read and
//! unpacked once per pass of rows.
//!
//! Every function here needs AVX2 and FMA (the build's x86-64-v3 baseline); the callers in
//! `super` check the lengths these functions rely on.

use std::arch::x86_64::*;

use super::format::{Format, QActs, GROUP};

/// A format's 32-weight group in registers: the weights as bytes (signed, or unsigned when
/// `AFFINE`), Q6_K's per-half multipliers as 16 × i16, the group's scale and min.
pub(crate) struct Group {
    pub w: __m256i,
    pub sub: __m256i,
    pub scale: f32,
    pub min: f32,
}

/// Unpacks group `j` of a row; `SIGNED` weights go through `maddubs` with the sign trick,
/// unsigned ones (0..=15) directly; `SUB` formats scale the two halves by `sub`.
pub(crate) trait Unpack {
    const FORMAT: Format;
    const SIGNED: bool;
    const SUB: bool;
    const AFFINE: bool;
    /// One block per group with its f16 scale first (and its f16 min right after when
    /// `AFFINE`): the block's bytes. None for formats laid out otherwise (the K-quants).
    const FLAT: Option<usize> = None;
    /// # Safety
    /// AVX2; `row` holds at least the blocks of group `j`.
    unsafe fn group(row: *const u8, j: usize) -> Group;
}

#[inline(always)]
unsafe fn f16(p: *const u8) -> f32 {
    let h = u16::from_le_bytes([*p, *p.add(1)]) as i32;
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h)))
}

/// Two adjacent f16 values (a scale and a min) in one conversion.
#[inline(always)]
unsafe fn f16_pair(p: *const u8) -> (f32, f32) {
    let v = i32::from_le_bytes([*p, *p.add(1), *p.add(2), *p.add(3)]);
    let f = _mm_cvtph_ps(_mm_cvtsi32_si128(v));
    (_mm_cvtss_f32(f), _mm_cvtss_f32(_mm_movehdup_ps(f)))
}

/// 16 bytes of nibbles → 32 bytes: low nibbles first, then high.
#[inline(always)]
unsafe fn nibbles(p: *const u8) -> __m256i {
    let q = _mm_loadu_si128(p as *const __m128i);
    let m = _mm_set1_epi8(0x0F);
    let lo = _mm_and_si128(q, m);
    let hi = _mm_and_si128(_mm_srli_epi16(q, 4), m);
    _mm256_set_m128i(hi, lo)
}

#[inline(always)]
unsafe fn no_sub() -> __m256i {
    _mm256_set1_epi16(1)
}

pub(crate) struct Q8_0;
impl Unpack for Q8_0 {
    const FORMAT: Format = Format::Q8_0;
    const SIGNED: bool = true;
    const SUB: bool = false;
    const AFFINE: bool = false;
    const FLAT: Option<usize> = Some(34);
    #[inline(always)]
    unsafe fn group(row: *const u8, j: usize) -> Group {
        let b = row.add(j * 34);
        Group {
            w: _mm256_loadu_si256(b.add(2) as *const __m256i),
            sub: no_sub(),
            scale: f16(b),
            min: 0.0,
        }
    }
}

pub(crate) struct Q4_0;
impl Unpack for Q4_0 {
    const FORMAT: Format = Format::Q4_0;
    const SIGNED: bool = true;
    const SUB: bool = false;
    const AFFINE: bool = false;
    const FLAT: Option<usize> = Some(18);
    #[inline(always)]
    unsafe fn group(row: *const u8, j: usize) -> Group {
        let b = row.add(j * 18);
        Group {
            w: _mm256_sub_epi8(nibbles(b.add(2)), _mm256_set1_epi8(8)),
            sub: no_sub(),
            scale: f16(b),
            min: 0.0,
        }
    }
}

pub(crate) struct Q4_1;
impl Unpack for Q4_1 {
    const FORMAT: Format = Format::Q4_1;
    const SIGNED: bool = false;
    const SUB: bool = false;
    const AFFINE: bool = true;
    const FLAT: Option<usize> = Some(20);
    #[inline(always)]
    unsafe fn group(row: *const u8, j: usize) -> Group {
        let b = row.add(j * 20);
        let (scale, min) = f16_pair(b);
        Group {
            w: nibbles(b.add(4)),
            sub: no_sub(),
            scale,
            min,
        }
    }
}

pub(crate) struct Q4K;
impl Unpack for Q4K {
    const FORMAT: Format = Format::Q4K;
    const SIGNED: bool = false;
    const SUB: bool = false;
    const AFFINE: bool = true;
    #[inline(always)]
    unsafe fn group(row: *const u8, j: usize) -> Group {
        let (sb, g) = (j / 8, j % 8);
        let b = row.add(sb * 144);
        let sc = std::slice::from_raw_parts(b.add(4), 12);
        let (s, m) = super::format::scale_min_k4(g, sc);
        let q = _mm256_loadu_si256(b.add(16 + (g / 2) * 32) as *const __m256i);
        let q = if g % 2 == 0 {
            q
        } else {
            _mm256_srli_epi16(q, 4)
        };
        let (d, dmin) = f16_pair(b);
        Group {
            w: _mm256_and_si256(q, _mm256_set1_epi8(0x0F)),
            sub: no_sub(),
            scale: d * s as f32,
            min: -dmin * m as f32,
        }
    }
}

pub(crate) struct Q6K;
impl Unpack for Q6K {
    const FORMAT: Format = Format::Q6K;
    const SIGNED: bool = true;
    const SUB: bool = true;
    const AFFINE: bool = false;
    #[inline(always)]
    unsafe fn group(row: *const u8, j: usize) -> Group {
        let (sb, g) = (j / 8, j % 8);
        let b = row.add(sb * 210);
        let (n, t) = (g / 4, g % 4);
        let ql = _mm256_loadu_si256(b.add(n * 64 + (t & 1) * 32) as *const __m256i);
        let lo = if t < 2 { ql } else { _mm256_srli_epi16(ql, 4) };
        let lo = _mm256_and_si256(lo, _mm256_set1_epi8(0x0F));
        let qh = _mm256_loadu_si256(b.add(128 + n * 32) as *const __m256i);
        let hi = _mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * t as i32));
        let hi = _mm256_slli_epi16(_mm256_and_si256(hi, _mm256_set1_epi8(3)), 4);
        let w = _mm256_sub_epi8(_mm256_or_si256(lo, hi), _mm256_set1_epi8(32));
        let sc = b.add(192 + n * 8 + 2 * t) as *const i8;
        let (a, c) = (*sc as i16, *sc.add(1) as i16);
        Group {
            w,
            sub: _mm256_setr_epi16(a, a, a, a, a, a, a, a, c, c, c, c, c, c, c, c),
            scale: f16(b.add(208)),
            min: 0.0,
        }
    }
}

/// Sum of the eight lanes.
#[inline(always)]
pub(crate) unsafe fn hsum(a: __m256) -> f32 {
    let hi = _mm256_extractf128_ps(a, 1);
    let s4 = _mm_add_ps(_mm256_castps256_ps128(a), hi);
    let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    let s1 = _mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1));
    _mm_cvtss_f32(s1)
}

/// One weight row (`groups` groups) against `G` quantized activation rows starting at
/// activation row `r0`: `out[r] = Σ_j scale_j · d_rj · (w_j · q_rj) + min_j · s_rj`.
///
/// # Safety
/// AVX2 and FMA; `row` holds `groups` groups; `x` holds rows `r0..r0 + G` of `groups`
/// groups each (with their `d8` and `s8`); `out.len() >= G`.
#[inline(always)]
pub(crate) unsafe fn dot_int<U: Unpack, const G: usize>(
    row: *const u8,
    groups: usize,
    x: &QActs,
    r0: usize,
    out: &mut [f32],
) {
    let ones = _mm256_set1_epi16(1);
    let mut acc = [_mm256_setzero_ps(); G];
    let (xq, d8, s8) = (x.q.as_ptr(), x.d8.as_ptr(), x.s8.as_ptr());
    for j in 0..groups {
        let g = U::group(row, j);
        let aw = if U::SIGNED {
            _mm256_sign_epi8(g.w, g.w)
        } else {
            g.w
        };
        let mul = if U::SUB { g.sub } else { ones };
        let (scale, min) = (_mm256_set1_ps(g.scale), _mm256_set1_ps(g.min));
        for (r, a) in acc.iter_mut().enumerate() {
            let at = (r0 + r) * groups + j;
            let xv = _mm256_loadu_si256(xq.add(at * GROUP) as *const __m256i);
            let xv = if U::SIGNED {
                _mm256_sign_epi8(xv, g.w)
            } else {
                xv
            };
            let p = _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(aw, xv), mul));
            // Per-lane copies of the activation scale (d8) and of s / 8 (s8): no scalar
            // work per row.
            let d = _mm256_mul_ps(scale, _mm256_loadu_ps(d8.add(at * 8)));
            *a = _mm256_fmadd_ps(d, p, *a);
            if U::AFFINE {
                *a = _mm256_fmadd_ps(min, _mm256_loadu_ps(s8.add(at * 8)), *a);
            }
        }
    }
    for r in 0..G {
        out[r] = hsum(acc[r]);
    }
}

/// The integer sums `Σ w·q` of group `j` against activation group `j` of `xq`, as 8 × i32.
#[inline(always)]
unsafe fn group_sums<U: Unpack>(row: *const u8, j: usize, xq: *const i8) -> __m256i {
    let g = U::group(row, j);
    let aw = if U::SIGNED {
        _mm256_sign_epi8(g.w, g.w)
    } else {
        g.w
    };
    let xv = _mm256_loadu_si256(xq.add(j * GROUP) as *const __m256i);
    let xv = if U::SIGNED {
        _mm256_sign_epi8(xv, g.w)
    } else {
        xv
    };
    _mm256_madd_epi16(_mm256_maddubs_epi16(aw, xv), _mm256_set1_epi16(1))
}

/// Eight blocks' f16 values at `at` bytes into each block (blocks of `bb` bytes from group
/// `j`), converted at once.
#[inline(always)]
unsafe fn eight_f16(row: *const u8, j: usize, bb: usize, at: usize) -> __m256 {
    let h = |k: usize| {
        let p = row.add((j + k) * bb + at);
        u16::from_le_bytes([*p, *p.add(1)]) as i16
    };
    let v = _mm_setr_epi16(h(0), h(1), h(2), h(3), h(4), h(5), h(6), h(7));
    _mm256_cvtph_ps(v)
}

/// [`dot_int`] for one activation row of a `FLAT` format (Q4_0, Q4_1, Q8_0): the integer
/// sums of eight groups are reduced into one vector (lane k: group k) and scaled at once by
/// the eight blocks' scales (one conversion for eight) times the eight activation scales,
/// mins likewise; left-over groups one by one. Decode steps of one sequence.
///
/// # Safety
/// As [`dot_int`] with `G = 1`; `U::FLAT` is `Some`.
#[inline(always)]
pub(crate) unsafe fn dot_int_flat<U: Unpack>(
    row: *const u8,
    groups: usize,
    x: &QActs,
    r0: usize,
    out: &mut [f32],
) {
    const {
        assert!(
            U::FLAT.is_none() || !U::SUB,
            "flat formats have no sub-block multipliers"
        )
    };
    let bb = U::FLAT.expect("a flat format");
    let base = r0 * groups;
    let (xq, xd, xs) = (
        x.q.as_ptr().add(base * GROUP),
        x.d.as_ptr().add(base),
        x.s.as_ptr().add(base),
    );
    let mut acc = _mm256_setzero_ps();
    let mut j = 0;
    while j + 8 <= groups {
        let s = |k| group_sums::<U>(row, j + k, xq);
        let a = _mm256_hadd_epi32(_mm256_hadd_epi32(s(0), s(1)), _mm256_hadd_epi32(s(2), s(3)));
        let b = _mm256_hadd_epi32(_mm256_hadd_epi32(s(4), s(5)), _mm256_hadd_epi32(s(6), s(7)));
        // a = [g0..g3 over lanes 0-3 | g0..g3 over lanes 4-7], b likewise for g4..g7.
        let lo = _mm_add_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
        let hi = _mm_add_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1));
        let sums = _mm256_cvtepi32_ps(_mm256_set_m128i(hi, lo));
        let scale = _mm256_mul_ps(eight_f16(row, j, bb, 0), _mm256_loadu_ps(xd.add(j)));
        acc = _mm256_fmadd_ps(scale, sums, acc);
        if U::AFFINE {
            let mins = eight_f16(row, j, bb, 2);
            acc = _mm256_fmadd_ps(mins, _mm256_loadu_ps(xs.add(j)), acc);
        }
        j += 8;
    }
    let mut total = hsum(acc);
    while j < groups {
        let g = U::group(row, j);
        let sum = hsum(_mm256_cvtepi32_ps(group_sums::<U>(row, j, xq)));
        total += g.scale * *xd.add(j) * sum;
        if U::AFFINE {
            total += g.min * *xs.add(j);
        }
        j += 1;
    }
    out[0] = total;
}

/// Group `j` of a row as 32 f32 values in four registers.
///
/// # Safety
/// AVX2 and FMA; `row` holds group `j`.
#[inline(always)]
pub(crate) unsafe fn group_f32<U: Unpack>(row: *const u8, j: usize) -> [__m256; 4] {
    let g = U::group(row, j);
    let lo = _mm256_castsi256_si128(g.w);
    let hi = _mm256_extracti128_si256(g.w, 1);
    let (sa, sb) = if U::SUB {
        let s: [i16; 16] = std::mem::transmute(g.sub);
        (g.scale * s[0] as f32, g.scale * s[8] as f32)
    } else {
        (g.scale, g.scale)
    };
    let widen = |v: __m128i, s: f32| {
        let w = if U::SIGNED {
            _mm256_cvtepi8_epi32(v)
        } else {
            _mm256_cvtepu8_epi32(v)
        };
        _mm256_fmadd_ps(
            _mm256_cvtepi32_ps(w),
            _mm256_set1_ps(s),
            _mm256_set1_ps(g.min),
        )
    };
    [
        widen(lo, sa),
        widen(_mm_srli_si128(lo, 8), sa),
        widen(hi, sb),
        widen(_mm_srli_si128(hi, 8), sb),
    ]
}

/// Group `j` of an F32 row.
#[inline(always)]
pub(crate) unsafe fn group_f32_plain(row: *const u8, j: usize) -> [__m256; 4] {
    let p = row.add(j * 128) as *const f32;
    [0, 8, 16, 24].map(|i| _mm256_loadu_ps(p.add(i)))
}

/// Group `j` of an F16 row.
#[inline(always)]
pub(crate) unsafe fn group_f32_half(row: *const u8, j: usize) -> [__m256; 4] {
    let p = row.add(j * 64);
    [0, 16, 32, 48].map(|i| _mm256_cvtph_ps(_mm_loadu_si128(p.add(i) as *const __m128i)))
}

/// One weight row (`groups` groups, unpacked by `load`) against `G` f32 activation rows
/// starting at row `r0` of `x` (rows of `groups · 32`): each group's four chunks summed
/// apart, then added, so many multiplies are in flight even for one row. For products no
/// other kernel must match bit for bit (decode rows against F32 and F16 weights).
///
/// # Safety
/// AVX2 and FMA; `load` reads within `row` for every `j < groups`; `x` holds rows
/// `r0..r0 + G`; `out.len() >= G`.
#[inline(always)]
pub(crate) unsafe fn dot_f32<const G: usize>(
    load: impl Fn(usize) -> [__m256; 4],
    groups: usize,
    x: &[f32],
    r0: usize,
    out: &mut [f32],
) {
    let cols = groups * GROUP;
    let mut acc = [_mm256_setzero_ps(); G];
    for j in 0..groups {
        let w = load(j);
        for (r, a) in acc.iter_mut().enumerate() {
            let xp = x.as_ptr().add((r0 + r) * cols + j * GROUP);
            let mut t = _mm256_mul_ps(w[0], _mm256_loadu_ps(xp));
            t = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xp.add(8)), t);
            t = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xp.add(16)), t);
            t = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xp.add(24)), t);
            *a = _mm256_add_ps(*a, t);
        }
    }
    for r in 0..G {
        out[r] = hsum(acc[r]);
    }
}

/// Transposes eight rows of eight floats in place.
#[inline(always)]
unsafe fn transpose8(r: &mut [__m256; 8]) {
    let t0 = _mm256_unpacklo_ps(r[0], r[1]);
    let t1 = _mm256_unpackhi_ps(r[0], r[1]);
    let t2 = _mm256_unpacklo_ps(r[2], r[3]);
    let t3 = _mm256_unpackhi_ps(r[2], r[3]);
    let t4 = _mm256_unpacklo_ps(r[4], r[5]);
    let t5 = _mm256_unpackhi_ps(r[4], r[5]);
    let t6 = _mm256_unpacklo_ps(r[6], r[7]);
    let t7 = _mm256_unpackhi_ps(r[6], r[7]);
    let u0 = _mm256_shuffle_ps(t0, t2, 0b01_00_01_00);
    let u1 = _mm256_shuffle_ps(t0, t2, 0b11_10_11_10);
    let u2 = _mm256_shuffle_ps(t1, t3, 0b01_00_01_00);
    let u3 = _mm256_shuffle_ps(t1, t3, 0b11_10_11_10);
    let u4 = _mm256_shuffle_ps(t4, t6, 0b01_00_01_00);
    let u5 = _mm256_shuffle_ps(t4, t6, 0b11_10_11_10);
    let u6 = _mm256_shuffle_ps(t5, t7, 0b01_00_01_00);
    let u7 = _mm256_shuffle_ps(t5, t7, 0b11_10_11_10);
    r[0] = _mm256_permute2f128_ps(u0, u4, 0x20);
    r[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
    r[2] = _mm256_permute2f128_ps(u2, u6, 0x20);
    r[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
    r[4] = _mm256_permute2f128_ps(u0, u4, 0x31);
    r[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
    r[6] = _mm256_permute2f128_ps(u2, u6, 0x31);
    r[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
}

/// Packs eight weight rows (`rows[i]`, each `groups` groups unpacked by `load`) into
/// columns `c0..c0 + 8` of a transposed panel (`panel[k · PANEL + c]`), dequantized.
///
/// # Safety
/// AVX2; `load` reads within each row for every `j < groups`; `panel` holds
/// `groups · 32 · PANEL` floats and `c0 + 8 <= PANEL`.
#[inline(always)]
pub(crate) unsafe fn pack8(
    load: impl Fn(*const u8, usize) -> [__m256; 4],
    rows: [*const u8; 8],
    groups: usize,
    panel: *mut f32,
    c0: usize,
) {
    use super::PANEL;
    for j in 0..groups {
        let g: [[__m256; 4]; 8] = std::array::from_fn(|i| load(rows[i], j));
        for c in 0..4usize {
            let mut t: [__m256; 8] = g.map(|row| row[c]);
            transpose8(&mut t);
            for (kk, v) in t.into_iter().enumerate() {
                let k = j * GROUP + c * 8 + kk;
                _mm256_storeu_ps(panel.add(k * PANEL + c0), v);
            }
        }
    }
}

/// `R` activation rows (rows of `cols` from `x`) against a transposed panel of 32 weight
/// rows: `out[r · ld + c] = Σ_k x[r][k] · panel[k][c]`, one FMA per k in order for every
/// output (no other sum), the order the AVX-512 kernel follows too.
///
/// # Safety
/// AVX2 and FMA; `x` holds `R` rows of `cols`, `panel` `cols · 32` floats, `out` `R` rows
/// of `ld ≥ 32`.
#[inline(always)]
pub(crate) unsafe fn panel_rows<const R: usize>(
    x: *const f32,
    cols: usize,
    panel: *const f32,
    out: *mut f32,
    ld: usize,
) {
    use super::PANEL;
    // 32 outputs per row as two halves of 16 (two registers each): 2R accumulators.
    for half in 0..2 {
        let mut acc = [[_mm256_setzero_ps(); 2]; R];
        let p = panel.add(16 * half);
        for k in 0..cols {
            let w0 = _mm256_loadu_ps(p.add(k * PANEL));
            let w1 = _mm256_loadu_ps(p.add(k * PANEL + 8));
            for (r, a) in acc.iter_mut().enumerate() {
                let xb = _mm256_broadcast_ss(&*x.add(r * cols + k));
                a[0] = _mm256_fmadd_ps(xb, w0, a[0]);
                a[1] = _mm256_fmadd_ps(xb, w1, a[1]);
            }
        }
        for (r, a) in acc.iter().enumerate() {
            let o = out.add(r * ld + 16 * half);
            _mm256_storeu_ps(o, a[0]);
            _mm256_storeu_ps(o.add(8), a[1]);
        }
    }
}

/// Dequantizes a whole row (`groups` groups) into `out`.
///
/// # Safety
/// AVX2 and FMA; `load` reads within the row for every `j < groups`; `out.len() >=
/// groups · 32`.
#[inline(always)]
pub(crate) unsafe fn row_f32(load: impl Fn(usize) -> [__m256; 4], groups: usize, out: &mut [f32]) {
    assert!(out.len() >= groups * GROUP);
    for j in 0..groups {
        let w = load(j);
        let p = out.as_mut_ptr().add(j * GROUP);
        for (i, v) in w.into_iter().enumerate() {
            _mm256_storeu_ps(p.add(8 * i), v);
        }
    }
}
