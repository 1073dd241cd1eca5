//! Weight matrices kept in the GGUF's own block formats, and their products with activations.
//!
//! A [`QMatrix`] holds the file's bytes for a `[rows, cols]` weight (Q4_0, Q4_1, Q8_0, Q4_K,
//! Q6_K, F16, F32; any other format is converted to Q8_0 when loaded), row after row. Three
//! products, all `out[r][i] = Σ_j x[r][j] · w[i][j]`:
//!
//! * [`QMatrix::matmul_q`]: activations quantized per 32-group to 8 bits (as llama.cpp does for
//!   its quantized dot products), an integer dot product per group and row; each weight group
//!   is read and unpacked once for up to eight activation rows. Decode steps.
//! * [`QMatrix::matmul_tiled`]: f32 activations; a panel of 32 weight rows at a time is
//!   dequantized and transposed into a scratch buffer, then every output is one FMA per
//!   column in order, 12 activation rows × 32 outputs in registers (AVX-512; 6 × 16 on
//!   AVX2); panels run on the thread pool. Prompt rows, any number: a row's result is the
//!   same bits however the prompt was chunked or how much of it was cached.
//! * [`QMatrix::matmul_f32`]: f32 activations, each group unpacked in registers for up to
//!   four rows, no panel: decode rows against F32 and F16 weights (no integer kernel).
//!
//! Kernels are AVX2 ([`avx2`], the build's x86-64-v3 baseline), with AVX-512 VNNI ones picked
//! at run time where the CPU has them ([`avx512`]), except that a call of a single activation
//! row of a flat format takes AVX2's one-row kernel where that measured clearly faster
//! (`pick`); [`format`] is the scalar reference.

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
pub mod format;
mod kernels;
#[cfg(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma"
))]
mod pick;

use candle_core::quantized::QTensor;
use candle_core::Device;
use rayon::prelude::*;

use crate::error::ModelError;
pub use format::{Format, QActs, GROUP};

/// Weight rows dequantized together into one panel (the f32 products' outputs per pass).
pub(crate) const PANEL: usize = 32;
/// Activation rows sharing one read of each weight group (integer products): 8 on AVX2, 16
/// on AVX-512 (twice the registers).
pub(crate) const INT_ROWS: usize = 16;
/// The same for f32 activations: 4 on AVX2, 8 on AVX-512.
pub(crate) const F32_ROWS: usize = 8;
/// The fewest elements an element-wise step (quantizing activations, the feed-forward
/// activation) hands to one thread: below it a step stays on the calling thread (one decode
/// row), above it a batch's rows are shared by the pool.
pub(crate) const PAR_MIN_ELEMS: usize = 4096;

/// The integer kernels this CPU runs: `avx512-vnni`, `avx2` or `scalar`.
pub fn kernel_name() -> &'static str {
    #[cfg(all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma"
    ))]
    return avx512::kernel_name();
    #[cfg(not(all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma"
    )))]
    "scalar"
}

/// The integer kernels this CPU runs, with the one-row choice of each flat format where
/// AVX-512 is picked (measured now if not yet): e.g. `avx512-vnni (one row: Q4_0 avx512
/// 1.17×, Q4_1 avx2 1.46×, Q8_0 avx512 1.14×)`, the ratio AVX-512's time over AVX2's.
pub fn kernel_description() -> String {
    #[cfg(all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma"
    ))]
    if avx512::available() {
        let picks: Vec<String> = [Format::Q4_0, Format::Q4_1, Format::Q8_0]
            .iter()
            .filter_map(|&f| kernels::one_row_pick(f).map(|p| (f, p)))
            .map(|(f, p)| {
                let k = if p.avx2 { "avx2" } else { "avx512" };
                match p.ratio {
                    Some(r) => format!("{} {k} {r:.2}×", f.name()),
                    None => format!("{} {k} (STRATA_ONE_ROW_KERNEL)", f.name()),
                }
            })
            .collect();
        if picks.is_empty() {
            return format!("{} (batch-invariant)", kernel_name());
        }
        return format!("{} (one row: {})", kernel_name(), picks.join(", "));
    }
    kernel_name().to_string()
}

/// A `[rows, cols]` weight matrix in a block format.
pub struct QMatrix {
    pub format: Format,
    pub rows: usize,
    pub cols: usize,
    row_bytes: usize,
    data: Vec<u8>,
    /// Converted to Q8_0 from another format (or columns cut off block boundaries): one
    /// rounding more than the file's weights ([`QMatrix::requantized`]).
    requantized: bool,
}

impl std::fmt::Debug for QMatrix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "QMatrix({} {}×{})",
            self.format.name(),
            self.rows,
            self.cols
        )
    }
}

impl QMatrix {
    /// A matrix over `data` (rows of whole blocks); `None` when `cols` is not a whole number
    /// of blocks or the length is not `rows` rows.
    pub fn new(format: Format, rows: usize, cols: usize, data: Vec<u8>) -> Option<QMatrix> {
        let bw = format.block_weights();
        if cols == 0 || !cols.is_multiple_of(bw) {
            return None;
        }
        let row_bytes = (cols / bw).checked_mul(format.block_bytes())?;
        if rows.checked_mul(row_bytes)? != data.len() {
            return None;
        }
        Some(QMatrix {
            format,
            rows,
            cols,
            row_bytes,
            data,
            requantized: false,
        })
    }

    /// Whether the weights were converted to Q8_0 at load (not the file's blocks): a decode
    /// row's vocabulary projection keeps f32 activations against such a matrix, where a second
    /// rounding of the activations once flipped an answer.
    pub fn requantized(&self) -> bool {
        self.requantized
    }

    /// A GGUF tensor `[rows, cols]` (GGUF's dims reversed) kept in its own format, or
    /// converted to Q8_0 if the format is not one [`Format`] has.
    pub fn from_qtensor(t: &QTensor, name: &str) -> Result<QMatrix, ModelError> {
        let bad = |reason: String| ModelError::Forward(format!("tensor {name}: {reason}"));
        let (rows, cols) = match t.shape().dims() {
            [c] => (1, *c),
            [r, c] => (*r, *c),
            d => return Err(bad(format!("expected a matrix, got shape {d:?}"))),
        };
        if let Some(f) = Format::of(t.dtype()) {
            let data = t.data()?.into_owned();
            return QMatrix::new(f, rows, cols, data).ok_or_else(|| {
                bad(format!(
                    "{} rows of {cols} columns are not whole {}-weight blocks of {}",
                    rows,
                    f.block_weights(),
                    f.name()
                ))
            });
        }
        if !cols.is_multiple_of(GROUP) {
            return Err(bad(format!(
                "{:?} with {cols} columns cannot be converted to Q8_0",
                t.dtype()
            )));
        }
        let w = t
            .dequantize(&Device::Cpu)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        Ok(QMatrix::quantize_q8_0(&w, rows, cols))
    }

    /// Row-major f32 weights quantized to Q8_0 (GGUF's blocks: f16 scale, 32 × i8).
    pub fn quantize_q8_0(w: &[f32], rows: usize, cols: usize) -> QMatrix {
        assert!(cols.is_multiple_of(GROUP) && w.len() == rows * cols);
        let mut data = Vec::with_capacity(w.len() / GROUP * 34);
        for block in w.chunks_exact(GROUP) {
            let amax = block.iter().fold(0f32, |m, v| m.max(v.abs()));
            let d = amax / 127.0;
            let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
            data.extend_from_slice(&half::f16::from_f32(d).to_le_bytes());
            data.extend(block.iter().map(|v| (v * inv).round() as i8 as u8));
        }
        let mut m = QMatrix::new(Format::Q8_0, rows, cols, data).expect("whole blocks");
        m.requantized = true;
        m
    }

    /// Rows `r` (a copy in the same format): a tensor-parallel rank's output rows.
    pub fn rows_range(&self, r: std::ops::Range<usize>) -> QMatrix {
        assert!(
            r.start < r.end && r.end <= self.rows,
            "rows {r:?} of {}",
            self.rows
        );
        let data = self.data[r.start * self.row_bytes..r.end * self.row_bytes].to_vec();
        let mut m = QMatrix::new(self.format, r.len(), self.cols, data).expect("whole rows");
        m.requantized = self.requantized;
        m
    }

    /// Columns `c`, a tensor-parallel rank's input columns: the same blocks when `c` falls on
    /// block boundaries, else the weights dequantized and requantized to Q8_0 (`c.len()` a
    /// multiple of 32). None when neither is possible.
    pub fn cols_range(&self, c: std::ops::Range<usize>) -> Option<QMatrix> {
        if c.start >= c.end || c.end > self.cols {
            return None;
        }
        let bw = self.format.block_weights();
        if c.start.is_multiple_of(bw) && c.end.is_multiple_of(bw) {
            let bb = self.format.block_bytes();
            let (b0, b1) = (c.start / bw * bb, c.end / bw * bb);
            let mut data = Vec::with_capacity(self.rows * (b1 - b0));
            for i in 0..self.rows {
                data.extend_from_slice(&self.row(i)[b0..b1]);
            }
            return QMatrix::new(self.format, self.rows, c.len(), data);
        }
        if !c.len().is_multiple_of(GROUP) {
            return None;
        }
        let mut w = Vec::with_capacity(self.rows * c.len());
        let mut row = vec![0f32; self.cols];
        for i in 0..self.rows {
            self.row_f32(i, &mut row);
            w.extend_from_slice(&row[c.clone()]);
        }
        Some(QMatrix::quantize_q8_0(&w, self.rows, c.len()))
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.data.len()
    }

    fn groups(&self) -> usize {
        self.cols / GROUP
    }

    fn row(&self, i: usize) -> &[u8] {
        &self.data[i * self.row_bytes..(i + 1) * self.row_bytes]
    }

    /// Row `i` dequantized into `out[..cols]` (an embedding lookup).
    pub fn row_f32(&self, i: usize, out: &mut [f32]) {
        assert!(i < self.rows && out.len() >= self.cols);
        kernels::row_f32(self.format, self.row(i), self.groups(), out);
    }

    /// `x · wᵀ` with `x` quantized to 8 bits per 32-group (integer formats; F32 and F16
    /// weights take f32 activations). `x` holds whole rows of `cols`; returns `[n][rows]`.
    pub fn matmul_q(&self, x: &[f32], threads: usize) -> Vec<f32> {
        if !self.format.integer() {
            return self.matmul_f32(x, threads);
        }
        self.check(x);
        self.matmul_qacts(&QActs::quantize(x), threads)
    }

    /// [`QMatrix::matmul_q`] with the activations already quantized (several matrices
    /// sharing one input quantize it once). Integer formats only.
    pub fn matmul_qacts(&self, qx: &QActs, threads: usize) -> Vec<f32> {
        assert!(
            self.format.integer(),
            "{} is not an integer format",
            self.format.name()
        );
        let n = qx.q.len() / self.cols;
        assert_eq!(
            qx.q.len(),
            n * self.cols,
            "activations of {} columns",
            self.cols
        );
        let groups = self.groups();
        let kernel = kernels::int_kernel_for(self.format, n);
        self.passes(n, threads, kernels::int_rows(), |row, r0, dst| {
            kernel(row, groups, qx, r0, dst)
        })
    }

    /// `x · wᵀ` with f32 activations, each weight group unpacked in registers once for up to
    /// four rows, in an order of its own (bits differ from [`QMatrix::matmul_tiled`]'s by
    /// rounding): fast for one or two rows without packing a panel. Decode rows against F32
    /// and F16 weights, which have no integer kernel.
    pub fn matmul_f32(&self, x: &[f32], threads: usize) -> Vec<f32> {
        let n = self.check(x);
        let groups = self.groups();
        let kernel = kernels::f32_kernel(self.format);
        self.passes(n, threads, kernels::f32_rows(), |row, r0, dst| {
            kernel(row, groups, x, r0, dst)
        })
    }

    /// `x · wᵀ` with f32 activations: panels of [`PANEL`] weight rows dequantized and
    /// transposed, then each output one FMA per column in order (`Σ_k x[r][k] · w[i][k]`
    /// from k = 0, nothing else), whatever the number of rows: a row's result does not depend
    /// on the other rows of the call. Panels run on the thread pool.
    pub fn matmul_tiled(&self, x: &[f32]) -> Vec<f32> {
        let n = self.check(x);
        let (cols, m, groups) = (self.cols, self.rows, self.groups());
        if n == 0 {
            return Vec::new();
        }
        // Panels in batches whose scratch outputs stay under 16 MiB (a vocabulary product over
        // a long prompt would otherwise hold its logits twice); a layer's projections fit in
        // one batch, so the pool is entered once per product.
        let mut out = vec![0f32; n * m];
        let panels = m.div_ceil(PANEL);
        let batch = ((16 << 20) / (n * PANEL * 4)).max(rayon::current_num_threads() * 4);
        for first in (0..panels).step_by(batch) {
            let done: Vec<Vec<f32>> = (first..panels.min(first + batch))
                .into_par_iter()
                .map(|p| {
                    let r0 = p * PANEL;
                    let rows: Vec<&[u8]> = (r0..m.min(r0 + PANEL)).map(|i| self.row(i)).collect();
                    let mut panel = vec![0f32; cols * PANEL];
                    kernels::pack_panel(self.format, &rows, groups, &mut panel);
                    let mut o = vec![0f32; n * PANEL];
                    kernels::panel_product(x, cols, &panel, &mut o);
                    o
                })
                .collect();
            for (p, o) in (first..).zip(&done) {
                let r0 = p * PANEL;
                let nb = PANEL.min(m - r0);
                for (dst, src) in out.chunks_exact_mut(m).zip(o.chunks_exact(PANEL)) {
                    dst[r0..r0 + nb].copy_from_slice(&src[..nb]);
                }
            }
        }
        out
    }

    /// The number of activation rows in `x`, which must be whole rows.
    fn check(&self, x: &[f32]) -> usize {
        assert!(
            x.len().is_multiple_of(self.cols),
            "activations are not whole rows of {}",
            self.cols
        );
        x.len() / self.cols
    }

    /// Runs `kernel(weight row, first activation row, outputs)` for every weight row and
    /// every group of at most `group` of the `n` activation rows, weight rows split over
    /// threads; returns `[n][rows]`.
    fn passes(
        &self,
        n: usize,
        threads: usize,
        group: usize,
        kernel: impl Fn(&[u8], usize, &mut [f32]) + Sync,
    ) -> Vec<f32> {
        let mut outs = passes_many(&[self], n, threads, group, |_, row, r0, dst| {
            kernel(row, r0, dst)
        });
        outs.pop().expect("one output per matrix")
    }

    /// [`QMatrix::matmul_qacts`] of several matrices sharing one input, in one split over
    /// the threads (one wait for the slowest thread instead of one per matrix).
    pub fn matmul_qacts_many(ws: &[&QMatrix], qx: &QActs, threads: usize) -> Vec<Vec<f32>> {
        for w in ws {
            assert!(
                w.format.integer(),
                "{} is not an integer format",
                w.format.name()
            );
            assert_eq!(qx.q.len() % w.cols, 0, "activations of {} columns", w.cols);
        }
        let Some(first) = ws.first() else {
            return Vec::new();
        };
        let n = qx.q.len() / first.cols;
        assert!(
            ws.iter().all(|w| w.cols == first.cols),
            "one input for every matrix"
        );
        let kernels: Vec<_> = ws
            .iter()
            .map(|w| kernels::int_kernel_for(w.format, n))
            .collect();
        passes_many(ws, n, threads, kernels::int_rows(), |m, row, r0, dst| {
            kernels[m](row, ws[m].groups(), qx, r0, dst)
        })
    }
}

/// [`QMatrix::passes`] over several matrices at once, `kernel` told which (its index in
/// `mats`): each job a range of one matrix's weight rows, writing its column range of every
/// output row (no transpose afterwards, no serial step after the parallel one). Returns
/// `[n][rows]` per matrix.
fn passes_many(
    mats: &[&QMatrix],
    n: usize,
    threads: usize,
    group: usize,
    kernel: impl Fn(usize, &[u8], usize, &mut [f32]) + Sync,
) -> Vec<Vec<f32>> {
    let mut outs: Vec<Vec<f32>> = mats.iter().map(|m| vec![0f32; n * m.rows]).collect();
    if n == 0 {
        return outs;
    }
    // (matrix, first weight row, the job's segment of each output row)
    let mut jobs: Vec<(usize, usize, Vec<&mut [f32]>)> = Vec::new();
    for (mi, (m, out)) in mats.iter().zip(outs.iter_mut()).enumerate() {
        let chunk = m.rows.div_ceil(threads.max(1) * 4).max(64);
        let first = jobs.len();
        jobs.extend((0..m.rows.div_ceil(chunk)).map(|ci| (mi, ci * chunk, Vec::with_capacity(n))));
        for out_row in out.chunks_exact_mut(m.rows) {
            for (job, seg) in jobs[first..].iter_mut().zip(out_row.chunks_mut(chunk)) {
                job.2.push(seg);
            }
        }
    }
    jobs.into_par_iter().for_each(|(mi, i0, mut segs)| {
        // A tile of TILE weight rows × n outputs, then copied out a row of outputs at a time.
        let mut tile = vec![0f32; TILE * n];
        let len = segs[0].len();
        for k0 in (0..len).step_by(TILE) {
            let b = TILE.min(len - k0);
            for (kk, dst) in tile.chunks_exact_mut(n).take(b).enumerate() {
                let row = mats[mi].row(i0 + k0 + kk);
                let mut r = 0;
                while r < n {
                    let g = (n - r).min(group);
                    kernel(mi, row, r, &mut dst[r..r + g]);
                    r += g;
                }
            }
            for (r, seg) in segs.iter_mut().enumerate() {
                for (o, t) in seg[k0..k0 + b].iter_mut().zip(tile.chunks_exact(n)) {
                    *o = t[r];
                }
            }
        }
    });
    outs
}

/// Weight rows whose outputs [`passes_many`] gathers before writing them out.
const TILE: usize = 16;

#[cfg(test)]
mod tests;
