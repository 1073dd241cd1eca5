//! Q8_0 weights times f32 activations, for decode-sized calls.
//!
//! Decode is bound by reading weights: Q8_0 (one f32 scale + 32 int8 per block) reads 28 % of
//! f32's bytes. Unlike candle's quantized matmul, activations stay f32 (no second quantization),
//! so results stay within ~0.5 % of the f32 product.

use rayon::prelude::*;

const QK: usize = 32;

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

    /// `out[r][i] = Σ_j x[r][j] · w[i][j]` for each of the `x.len() / cols` rows of `x`.
    pub fn matmul(&self, x: &[f32], threads: usize) -> Vec<f32> {
        let n = x.len() / self.cols;
        let mut out = vec![0f32; n * self.rows];
        let bpr = self.cols / QK;
        let chunk = self.rows.div_ceil(threads.max(1) * 4).max(64);
        for (xr, orow) in x
            .chunks_exact(self.cols)
            .zip(out.chunks_exact_mut(self.rows))
        {
            orow.par_chunks_mut(chunk).enumerate().for_each(|(ci, o)| {
                for (k, dst) in o.iter_mut().enumerate() {
                    let i = ci * chunk + k;
                    let sc = &self.scales[i * bpr..(i + 1) * bpr];
                    let q = &self.qs[i * self.cols..(i + 1) * self.cols];
                    *dst = dot_row(sc, q, xr);
                }
            });
        }
        out
    }
}

/// One output: Σ over blocks of scale × (int8 block · f32 block).
#[inline]
fn dot_row(scales: &[f32], q: &[i8], x: &[f32]) -> f32 {
    #[cfg(all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma"
    ))]
    {
        // SAFETY: the build targets x86-64-v3, so AVX2 and FMA are present; every load reads 8
        // i8 or 8 f32 inside `q` / `x`, whose lengths are scales.len() × 32 (checked below).
        assert!(q.len() == scales.len() * QK && x.len() == q.len());
        unsafe {
            use std::arch::x86_64::*;
            let mut total = _mm256_setzero_ps();
            for (b, &d) in scales.iter().enumerate() {
                let qp = q.as_ptr().add(b * QK);
                let xp = x.as_ptr().add(b * QK);
                let mut acc = _mm256_setzero_ps();
                for l in 0..4 {
                    let q8 = _mm_loadl_epi64(qp.add(l * 8) as *const __m128i);
                    let qf = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q8));
                    acc = _mm256_fmadd_ps(qf, _mm256_loadu_ps(xp.add(l * 8)), acc);
                }
                total = _mm256_fmadd_ps(_mm256_set1_ps(d), acc, total);
            }
            let hi = _mm256_extractf128_ps(total, 1);
            let s4 = _mm_add_ps(_mm256_castps256_ps128(total), hi);
            let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
            let s1 = _mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1));
            _mm_cvtss_f32(s1)
        }
    }
    #[cfg(not(all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma"
    )))]
    {
        let mut total = 0f32;
        for ((&d, qb), xb) in scales
            .iter()
            .zip(q.chunks_exact(QK))
            .zip(x.chunks_exact(QK))
        {
            total += d * qb.iter().zip(xb).map(|(&a, &b)| a as f32 * b).sum::<f32>();
        }
        total
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
        let x: Vec<f32> = (0..2 * cols)
            .map(|i| ((i * 31 % 97) as f32 - 48.0) / 50.0)
            .collect();
        let q = Q8Matrix::quantize(&w, rows, cols);
        let got = q.matmul(&x, 2);
        for r in 0..2 {
            for i in 0..rows {
                let want: f32 = (0..cols).map(|j| x[r * cols + j] * w[i * cols + j]).sum();
                assert!(
                    (got[r * rows + i] - want).abs() < 0.01 * want.abs().max(1.0),
                    "{r},{i}: {} vs {want}",
                    got[r * rows + i]
                );
            }
        }
    }
}
