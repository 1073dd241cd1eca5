//! AVX-512 VNNI integer products, picked at run time where the CPU has them (`vpdpbusd`:
//! 64 unsigned × signed byte products summed into 16 lanes in one instruction, no 16-bit
//! saturation). Two 32-weight groups share one 512-bit register, so each int → float
//! conversion and scale multiply covers 64 weights (AVX2 covers 32).
//!
//! `vpdpbusd` multiplies unsigned by signed bytes. The affine formats (Q4_1, Q4_K) have
//! unsigned weights and multiply the signed activations directly; the signed ones (Q8_0,
//! Q4_0, Q6_K) multiply activations shifted to unsigned (`q + 128`) and start the sum at
//! `−128 · Σ w`, computed once per weight pair for all activation rows. The affine formats'
//! `min · s` terms are taken sixteen groups at a time: the weight row's mins against each
//! activation row's group sums, one FMA per row (the activations' per-lane copies of `s` are
//! for the AVX2 kernels).
//!
//! `STRATA_NO_AVX512=1` keeps the AVX2 kernels (to compare the two side by side).

use std::arch::x86_64::*;
use std::sync::OnceLock;

use super::avx2::{Group, Unpack};
use super::format::{QActs, GROUP};

/// Whether this CPU runs the AVX-512 VNNI kernels (and `STRATA_NO_AVX512` is not set).
pub(crate) fn available() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| {
        std::env::var_os("STRATA_NO_AVX512").is_none_or(|v| v.is_empty() || v == "0")
            && std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bw")
            && std::arch::is_x86_feature_detected!("avx512dq")
            && std::arch::is_x86_feature_detected!("avx512vl")
            && std::arch::is_x86_feature_detected!("avx512vnni")
    })
}

/// The name of the integer kernels in use, for logs and benchmarks.
pub(crate) fn kernel_name() -> &'static str {
    if available() {
        "avx512-vnni"
    } else {
        "avx2"
    }
}

/// One weight row against `out.len()` (1..=16) quantized activation rows from `r0`.
///
/// # Safety
/// The CPU has AVX-512 F/BW/DQ/VL/VNNI ([`available`]); `row` holds `groups` groups; `x` holds
/// rows `r0..r0 + out.len()` with their `d8`/`s8` expansions.
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma")]
pub(crate) unsafe fn int_rows<U: Unpack>(
    row: *const u8,
    groups: usize,
    x: &QActs,
    r0: usize,
    out: &mut [f32],
) {
    match out.len() {
        1 => dot::<U, 1>(row, groups, x, r0, out),
        2 => dot::<U, 2>(row, groups, x, r0, out),
        3 => dot::<U, 3>(row, groups, x, r0, out),
        4 => dot::<U, 4>(row, groups, x, r0, out),
        5 => dot::<U, 5>(row, groups, x, r0, out),
        6 => dot::<U, 6>(row, groups, x, r0, out),
        7 => dot::<U, 7>(row, groups, x, r0, out),
        8 => dot::<U, 8>(row, groups, x, r0, out),
        9 => dot::<U, 9>(row, groups, x, r0, out),
        10 => dot::<U, 10>(row, groups, x, r0, out),
        11 => dot::<U, 11>(row, groups, x, r0, out),
        12 => dot::<U, 12>(row, groups, x, r0, out),
        13 => dot::<U, 13>(row, groups, x, r0, out),
        14 => dot::<U, 14>(row, groups, x, r0, out),
        15 => dot::<U, 15>(row, groups, x, r0, out),
        _ => dot::<U, 16>(row, groups, x, r0, out),
    }
}

/// A pair of groups ready for every row: weight bytes, the starting sums (`−128 · Σ w` per
/// lane for signed formats) and per-lane scales (times Q6_K's half multipliers); the affine
/// formats' mins are taken by [`dot`] itself.
struct Pair {
    w: __m512i,
    start: __m512i,
    scale: __m512,
}

/// Per-lane scale of a group: its scale times the multiplier of the half each lane (four
/// weights) falls in.
#[inline(always)]
unsafe fn lane_scales<U: Unpack>(g: &Group) -> __m256 {
    if U::SUB {
        // `sub` holds 8 × a then 8 × b (i16); qwords 0 and 2 put a, a, a, a, b, b, b, b in
        // the low half: lanes 0..3 of the group (weights 0..15) take a, 4..7 take b.
        let s = _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(
            _mm256_permute4x64_epi64(g.sub, 0b10_00_10_00),
        )));
        _mm256_mul_ps(s, _mm256_set1_ps(g.scale))
    } else {
        _mm256_set1_ps(g.scale)
    }
}

#[inline(always)]
unsafe fn pair<U: Unpack>(g0: Group, g1: Option<Group>) -> Pair {
    let (w1, s1) = match &g1 {
        Some(g) => (g.w, lane_scales::<U>(g)),
        None => (_mm256_setzero_si256(), _mm256_setzero_ps()),
    };
    let w = _mm512_inserti64x4(_mm512_castsi256_si512(g0.w), w1, 1);
    let start = if U::SIGNED {
        // −128 · (sum of each lane's four weights).
        let sums = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8(-128), w);
        _mm512_sub_epi32(_mm512_setzero_si512(), sums)
    } else {
        _mm512_setzero_si512()
    };
    let scale = _mm512_insertf32x8(_mm512_castps256_ps512(lane_scales::<U>(&g0)), s1, 1);
    Pair { w, start, scale }
}

/// Groups whose mins are gathered before their activations' sums are multiplied in.
const MIN_CHUNK: usize = 16;

#[inline(always)]
unsafe fn dot<U: Unpack, const G: usize>(
    row: *const u8,
    groups: usize,
    x: &QActs,
    r0: usize,
    out: &mut [f32],
) {
    let mut acc = [_mm512_setzero_ps(); G];
    let flip = _mm512_set1_epi8(-128);
    let (xq, d8, s) = (x.q.as_ptr(), x.d8.as_ptr(), x.s.as_ptr());
    // The affine formats' `min · s` terms: the weight row's mins of up to 16 groups are
    // gathered into the lanes of a register (not through memory: a vector load of scalar
    // stores would wait on store forwarding), then each activation row's 16 sums `s` are
    // multiplied in by one FMA (not one per pair of groups and row).
    let mut mins = _mm512_setzero_ps();
    let mut j = 0;
    while j < groups {
        let whole = j + 1 < groups;
        let g0 = U::group(row, j);
        let g1 = whole.then(|| U::group(row, j + 1));
        if U::AFFINE {
            let lane = (j % MIN_CHUNK) as u32;
            mins = _mm512_mask_mov_ps(mins, 1 << lane, _mm512_set1_ps(g0.min));
            if let Some(g) = &g1 {
                mins = _mm512_mask_mov_ps(mins, 1 << (lane + 1), _mm512_set1_ps(g.min));
            }
        }
        let p = pair::<U>(g0, g1);
        for (r, a) in acc.iter_mut().enumerate() {
            let at = (r0 + r) * groups + j;
            let (xv, d) = if whole {
                (
                    _mm512_loadu_si512(xq.add(at * GROUP) as *const _),
                    _mm512_loadu_ps(d8.add(at * 8)),
                )
            } else {
                (
                    _mm512_zextsi256_si512(_mm256_loadu_si256(xq.add(at * GROUP) as *const _)),
                    _mm512_zextps256_ps512(_mm256_loadu_ps(d8.add(at * 8))),
                )
            };
            let sums = if U::SIGNED {
                _mm512_dpbusd_epi32(p.start, _mm512_xor_si512(xv, flip), p.w)
            } else {
                _mm512_dpbusd_epi32(p.start, p.w, xv)
            };
            *a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), _mm512_mul_ps(p.scale, d), *a);
        }
        j += 2;
        let done = j.min(groups);
        if U::AFFINE && (done % MIN_CHUNK == 0 || done == groups) {
            // Groups c0..done of this chunk (16, or the rest).
            let c0 = (done - 1) / MIN_CHUNK * MIN_CHUNK;
            let mask: __mmask16 = ((1u32 << (done - c0)) - 1) as __mmask16;
            // Lanes past the chunk's groups hold an earlier chunk's mins: masked out.
            let mv = _mm512_maskz_mov_ps(mask, mins);
            for (r, a) in acc.iter_mut().enumerate() {
                let sv = _mm512_maskz_loadu_ps(mask, s.add((r0 + r) * groups + c0));
                *a = _mm512_fmadd_ps(mv, sv, *a);
            }
        }
    }
    for (o, a) in out.iter_mut().zip(acc) {
        *o = _mm512_reduce_add_ps(a);
    }
}

/// [`super::avx2::panel_rows`] on AVX-512 (the same order of operations: one FMA per k in
/// order for every output) for `rows` (1..=12) activation rows at once.
///
/// # Safety
/// The CPU has the features of [`available`]; `x` holds `rows` rows of `cols`, `panel`
/// `cols · 32` floats, `out` `rows` rows of `ld ≥ 32`.
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma")]
pub(crate) unsafe fn panel_rows(
    rows: usize,
    x: *const f32,
    cols: usize,
    panel: *const f32,
    out: *mut f32,
    ld: usize,
) {
    match rows {
        1 => micro::<1>(x, cols, panel, out, ld),
        2 => micro::<2>(x, cols, panel, out, ld),
        3 => micro::<3>(x, cols, panel, out, ld),
        4 => micro::<4>(x, cols, panel, out, ld),
        5 => micro::<5>(x, cols, panel, out, ld),
        6 => micro::<6>(x, cols, panel, out, ld),
        7 => micro::<7>(x, cols, panel, out, ld),
        8 => micro::<8>(x, cols, panel, out, ld),
        9 => micro::<9>(x, cols, panel, out, ld),
        10 => micro::<10>(x, cols, panel, out, ld),
        11 => micro::<11>(x, cols, panel, out, ld),
        _ => micro::<12>(x, cols, panel, out, ld),
    }
}

/// Activation rows per AVX-512 panel pass (24 accumulators).
pub(crate) const PANEL_ROWS: usize = 12;

#[inline(always)]
unsafe fn micro<const R: usize>(
    x: *const f32,
    cols: usize,
    panel: *const f32,
    out: *mut f32,
    ld: usize,
) {
    use super::PANEL;
    let mut acc = [[_mm512_setzero_ps(); 2]; R];
    for k in 0..cols {
        let w0 = _mm512_loadu_ps(panel.add(k * PANEL));
        let w1 = _mm512_loadu_ps(panel.add(k * PANEL + 16));
        for (r, a) in acc.iter_mut().enumerate() {
            let xb = _mm512_set1_ps(*x.add(r * cols + k));
            a[0] = _mm512_fmadd_ps(xb, w0, a[0]);
            a[1] = _mm512_fmadd_ps(xb, w1, a[1]);
        }
    }
    for (r, a) in acc.iter().enumerate() {
        _mm512_storeu_ps(out.add(r * ld), a[0]);
        _mm512_storeu_ps(out.add(r * ld + 16), a[1]);
    }
}

/// [`super::avx2::dot_f32`] on AVX-512: one weight row against `out.len()` (1..=8) f32
/// activation rows from row `r0` of `x`, two 16-lane accumulators per row.
///
/// # Safety
/// The CPU has the features of [`available`]; `load` reads within the row for every
/// `j < groups`; `x` holds rows `r0..r0 + out.len()` of `groups · 32`.
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma")]
pub(crate) unsafe fn f32_rows(
    load: impl Fn(usize) -> [__m256; 4],
    groups: usize,
    x: &[f32],
    r0: usize,
    out: &mut [f32],
) {
    match out.len() {
        1 => dot_f32::<1>(load, groups, x, r0, out),
        2 => dot_f32::<2>(load, groups, x, r0, out),
        3 => dot_f32::<3>(load, groups, x, r0, out),
        4 => dot_f32::<4>(load, groups, x, r0, out),
        5 => dot_f32::<5>(load, groups, x, r0, out),
        6 => dot_f32::<6>(load, groups, x, r0, out),
        7 => dot_f32::<7>(load, groups, x, r0, out),
        _ => dot_f32::<8>(load, groups, x, r0, out),
    }
}

#[inline(always)]
unsafe fn dot_f32<const G: usize>(
    load: impl Fn(usize) -> [__m256; 4],
    groups: usize,
    x: &[f32],
    r0: usize,
    out: &mut [f32],
) {
    let cols = groups * GROUP;
    let mut acc = [[_mm512_setzero_ps(); 2]; G];
    for j in 0..groups {
        let w = load(j);
        let w0 = _mm512_insertf32x8(_mm512_castps256_ps512(w[0]), w[1], 1);
        let w1 = _mm512_insertf32x8(_mm512_castps256_ps512(w[2]), w[3], 1);
        for (r, a) in acc.iter_mut().enumerate() {
            let xp = x.as_ptr().add((r0 + r) * cols + j * GROUP);
            a[0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xp), a[0]);
            a[1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xp.add(16)), a[1]);
        }
    }
    for r in 0..G {
        out[r] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]));
    }
}
