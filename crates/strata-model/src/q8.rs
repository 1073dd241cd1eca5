//! Q8_0 weights times f32 activations, for decode-sized calls.
//!
//! Decode is bound by reading weights: Q8_0 (one f32 scale + 32 int8 per block) reads 28 % of
//! f32's bytes. Activations are quantized to Q8_0 too, so each 32-block is one integer dot
//! product (AVX2 `maddubs`); results stay within ~1 % of the f32 product.

use rayon::prelude::*;

const QK: usize = 32;
/// Activation rows sharing one read of each weight block.
const ROWS_PER_PASS: usize = 8;

/// A `[rows, cols]` matrix in Q8_0 blocks along each row.
pub struct Q8Matrix {
    pub rows: usize,
    pub cols: usize,
    scales: Vec<f32>,
    qs: Vec<i8>,
}

impl Q8Matrix {
    /// Quantizes row-major f32 weights; `cols` must be a multiple of 32.
    pub fn quantize(w: &[f32], rows: usize, cols: usize) -> Q8Matrix {
        assert!(
            cols.is_multiple_of(QK) && w.len() == rows * cols,
            "Q8_0 needs rows of whole 32-blocks"
        );
        let mut scales = Vec::with_capacity(rows * cols / QK);
        let mut qs = Vec::with_capacity(rows * cols);
        for block in w.chunks_exact(QK) {
            let amax = block.iter().fold(0f32, |m, v| m.max(v.abs()));
            let d = amax / 127.0;
            let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
            scales.push(d);
            qs.extend(block.iter().map(|v| (v * inv).round() as i8));
        }
        Q8Matrix {
            rows,
            cols,
            scales,
            qs,
        }
    }

    /// Like [`Q8Matrix::matmul`] with f32 activations (no activation rounding): for outputs
    /// whose argmax matters more than speed (the vocabulary projection).
    pub fn matmul_f32(&self, x: &[f32], threads: usize) -> Vec<f32> {
        let cols = self.cols;
        self.passes(x.len() / cols, threads, 4, |sc, q, r, dst| {
            dot_rows_f32(sc, q, &x[r * cols..(r + dst.len()) * cols], dst)
        })
    }

    /// `out[r][i] = Σ_j x[r][j] · w[i][j]` for each of the `x.len() / cols` rows of `x`.
    /// Activations are quantized to Q8_0 per 32-block (as llama.cpp does for its quantized
    /// dot products) so each block is one integer dot product; every weight block is read
    /// once for up to eight activation rows.
    pub fn matmul(&self, x: &[f32], threads: usize) -> Vec<f32> {
        let (cols, bpr) = (self.cols, self.cols / QK);
        let (xd, xq) = quantize_rows(x);
        self.passes(x.len() / cols, threads, ROWS_PER_PASS, |wd, wq, r, dst| {
            let g = dst.len();
            dot_rows(
                wd,
                wq,
                &xd[r * bpr..(r + g) * bpr],
                &xq[r * cols..(r + g) * cols],
                dst,
            )
        })
    }

    /// Runs `kernel(scales, weights, first activation row, outputs)` for every weight row and
    /// every group of at most `group` of the `n` activation rows, weight rows split over
    /// threads; returns `[n][rows]`.
    fn passes(
        &self,
        n: usize,
        threads: usize,
        group: usize,
        kernel: impl Fn(&[f32], &[i8], usize, &mut [f32]) + Sync,
    ) -> Vec<f32> {
        let bpr = self.cols / QK;
        let mut out_t = vec![0f32; self.rows * n]; // [row i][x row r]
        let chunk = self.rows.div_ceil(threads.max(1) * 4).max(64);
        out_t
            .par_chunks_mut(chunk * n)
            .enumerate()
            .for_each(|(ci, o)| {
                for (k, dst) in o.chunks_exact_mut(n).enumerate() {
                    let i = ci * chunk + k;
                    let sc = &self.scales[i * bpr..(i + 1) * bpr];
                    let q = &self.qs[i * self.cols..(i + 1) * self.cols];
                    let mut r = 0;
                    while r < n {
                        let g = (n - r).min(group);
                        kernel(sc, q, r, &mut dst[r..r + g]);
                        r += g;
                    }
                }
            });
        transpose(&out_t, n, self.rows)
    }
}

/// `[rows][n]` → `[n][rows]`.
fn transpose(t: &[f32], n: usize, rows: usize) -> Vec<f32> {
    let mut out = vec![0f32; n * rows];
    for (i, v) in t.chunks_exact(n).enumerate() {
        for (r, &x) in v.iter().enumerate() {
            out[r * rows + i] = x;
        }
    }
    out
}

/// [`dot_rows`] for exactly G activation rows, accumulators in registers.
///
/// # Safety
/// AVX2 and FMA must be available; `wq` holds bpr·32 values, `xq` G·bpr·32, `xd` G·bpr,
/// `out` G, where bpr = `wd.len()`.
#[cfg(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma"
))]
#[inline]
unsafe fn dot_rows_avx<const G: usize>(
    wd: &[f32],
    wq: &[i8],
    xd: &[f32],
    xq: &[i8],
    out: &mut [f32],
) {
    use std::arch::x86_64::*;
    let bpr = wd.len();
    let ones = _mm256_set1_epi16(1);
    let mut acc = [_mm256_setzero_ps(); G];
    for b in 0..bpr {
        let w = _mm256_loadu_si256(wq.as_ptr().add(b * QK) as *const __m256i);
        let aw = _mm256_sign_epi8(w, w);
        let dw = *wd.get_unchecked(b);
        for (r, a) in acc.iter_mut().enumerate() {
            let xv = _mm256_loadu_si256(xq.as_ptr().add((r * bpr + b) * QK) as *const __m256i);
            let p16 = _mm256_maddubs_epi16(aw, _mm256_sign_epi8(xv, w));
            let p32 = _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, ones));
            let d = _mm256_set1_ps(dw * *xd.get_unchecked(r * bpr + b));
            *a = _mm256_fmadd_ps(d, p32, *a);
        }
    }
    for (o, a) in out.iter_mut().zip(acc) {
        *o = hsum(a);
    }
}

/// One weight row against `out.len()` (≤ 4) f32 activation rows: Σ over blocks of scale ×
/// (int8 block · f32 block); each weight block is widened once for all rows.
fn dot_rows_f32(scales: &[f32], q: &[i8], x: &[f32], out: &mut [f32]) {
    let (bpr, g) = (scales.len(), out.len());
    assert!(q.len() == bpr * QK && x.len() == g * q.len() && g <= 4);
    #[cfg(all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma"
    ))]
    {
        // SAFETY: the build targets x86-64-v3 (AVX2, FMA); lengths were checked above.
        unsafe {
            match g {
                1 => dot_rows_f32_avx::<1>(scales, q, x, out),
                2 => dot_rows_f32_avx::<2>(scales, q, x, out),
                3 => dot_rows_f32_avx::<3>(scales, q, x, out),
                _ => dot_rows_f32_avx::<4>(scales, q, x, out),
            }
        }
    }
    #[cfg(not(all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma"
    )))]
    for (r, o) in out.iter_mut().enumerate() {
        let xr = &x[r * q.len()..(r + 1) * q.len()];
        let mut total = 0f32;
        for ((&d, qb), xb) in scales
            .iter()
            .zip(q.chunks_exact(QK))
            .zip(xr.chunks_exact(QK))
        {
            total += d * qb.iter().zip(xb).map(|(&a, &b)| a as f32 * b).sum::<f32>();
        }
        *o = total;
    }
}

/// Sum of the eight lanes.
///
/// # Safety
/// AVX2 must be available.
#[cfg(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma"
))]
#[inline]
unsafe fn hsum(a: std::arch::x86_64::__m256) -> f32 {
    use std::arch::x86_64::*;
    let hi = _mm256_extractf128_ps(a, 1);
    let s4 = _mm_add_ps(_mm256_castps256_ps128(a), hi);
    let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    let s1 = _mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1));
    _mm_cvtss_f32(s1)
}

/// [`dot_rows_f32`] for exactly G rows.
///
/// # Safety
/// AVX2 and FMA must be available; `q` holds bpr·32 values, `x` G·bpr·32, `out` G.
#[cfg(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma"
))]
#[inline]
unsafe fn dot_rows_f32_avx<const G: usize>(scales: &[f32], q: &[i8], x: &[f32], out: &mut [f32]) {
    use std::arch::x86_64::*;
    let cols = q.len();
    let mut acc = [_mm256_setzero_ps(); G];
    for (b, &d) in scales.iter().enumerate() {
        let qp = q.as_ptr().add(b * QK);
        let mut w = [_mm256_setzero_ps(); 4];
        for (l, wl) in w.iter_mut().enumerate() {
            let q8 = _mm_loadl_epi64(qp.add(l * 8) as *const __m128i);
            *wl = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q8));
        }
        let dv = _mm256_set1_ps(d);
        for (r, a) in acc.iter_mut().enumerate() {
            let xp = x.as_ptr().add(r * cols + b * QK);
            let mut t = _mm256_mul_ps(w[0], _mm256_loadu_ps(xp));
            t = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xp.add(8)), t);
            t = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xp.add(16)), t);
            t = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xp.add(24)), t);
            *a = _mm256_fmadd_ps(dv, t, *a);
        }
    }
    for (o, a) in out.iter_mut().zip(acc) {
        *o = hsum(a);
    }
}

/// Q8_0 of activation rows: a scale per 32-block and the int8 values.
fn quantize_rows(x: &[f32]) -> (Vec<f32>, Vec<i8>) {
    let mut d = Vec::with_capacity(x.len() / QK);
    let mut q = Vec::with_capacity(x.len());
    for block in x.chunks_exact(QK) {
        let amax = block.iter().fold(0f32, |m, v| m.max(v.abs()));
        let s = amax / 127.0;
        let inv = if s > 0.0 { 1.0 / s } else { 0.0 };
        d.push(s);
        q.extend(block.iter().map(|v| (v * inv).round() as i8));
    }
    (d, q)
}

/// One weight row against `out.len()` (≤ 8) quantized activation rows: Σ over blocks of
/// wd × xd × (int8 block · int8 block).
#[inline]
fn dot_rows(wd: &[f32], wq: &[i8], xd: &[f32], xq: &[i8], out: &mut [f32]) {
    let (bpr, g) = (wd.len(), out.len());
    assert!(
        wq.len() == bpr * QK
            && xd.len() == g * bpr
            && xq.len() == g * bpr * QK
            && g <= ROWS_PER_PASS
    );
    #[cfg(all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma"
    ))]
    {
        // SAFETY: the build targets x86-64-v3 (AVX2, FMA); the lengths the kernel relies on
        // were checked above.
        unsafe {
            match g {
                1 => dot_rows_avx::<1>(wd, wq, xd, xq, out),
                2 => dot_rows_avx::<2>(wd, wq, xd, xq, out),
                3 => dot_rows_avx::<3>(wd, wq, xd, xq, out),
                4 => dot_rows_avx::<4>(wd, wq, xd, xq, out),
                5 => dot_rows_avx::<5>(wd, wq, xd, xq, out),
                6 => dot_rows_avx::<6>(wd, wq, xd, xq, out),
                7 => dot_rows_avx::<7>(wd, wq, xd, xq, out),
                _ => dot_rows_avx::<8>(wd, wq, xd, xq, out),
            }
        }
    }
    #[cfg(not(all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma"
    )))]
    for (r, o) in out.iter_mut().enumerate() {
        let mut total = 0f32;
        for b in 0..bpr {
            let wb = &wq[b * QK..(b + 1) * QK];
            let xb = &xq[(r * bpr + b) * QK..(r * bpr + b + 1) * QK];
            let dot: i32 = wb.iter().zip(xb).map(|(&a, &c)| a as i32 * c as i32).sum();
            total += wd[b] * xd[r * bpr + b] * dot as f32;
        }
        *o = total;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn close_to_f32() {
        let (rows, cols) = (70, 96);
        let w: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 7919 % 1000) as f32 - 500.0) / 3000.0)
            .collect();
        let x: Vec<f32> = (0..6 * cols)
            .map(|i| ((i * 31 % 97) as f32 - 48.0) / 50.0)
            .collect();
        let q = Q8Matrix::quantize(&w, rows, cols);
        let exact = q.matmul_f32(&x, 2);
        let got = q.matmul(&x, 2);
        for r in 0..6 {
            for i in 0..rows {
                let want: f32 = (0..cols).map(|j| x[r * cols + j] * w[i * cols + j]).sum();
                assert!(
                    (got[r * rows + i] - want).abs() < 0.02 * want.abs().max(1.0),
                    "{r},{i}: {} vs {want}",
                    got[r * rows + i]
                );
                assert!(
                    (exact[r * rows + i] - want).abs() < 0.01 * want.abs().max(1.0),
                    "f32 activations {r},{i}: {} vs {want}",
                    exact[r * rows + i]
                );
            }
        }
    }
}
