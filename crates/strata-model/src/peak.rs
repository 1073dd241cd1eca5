//! This machine's measured ceilings for decode, against which `strata model bench --streams`
//! states its FLOP/s and bytes/s.
//!
//! * Compute: the decode kernel itself ([`QMatrix::matmul_q`], Q8_0 weights × 8-bit
//!   activations, integer dot products: AVX-512 VNNI where the CPU has it, else AVX2) on the model's largest projection shapes against
//!   64 activation rows, the same call repeated so its weights (under 1 MB for SmolLM2) come
//!   from cache, on every thread: the most multiply-adds per second this kernel reaches,
//!   its own per-call costs (quantizing the activations, the thread split) included. Smaller
//!   matrices reach less (256 × 576: ~55 %), larger about the same. The best of five windows
//!   of at least a quarter second each: as long as a batched-decode measurement, so the
//!   ceiling is not a burst the decode steps could never be timed in.
//! * Memory: a sum over a 512 MiB buffer split over the threads: the read bandwidth a
//!   weight-streaming step can have.

use std::time::Instant;

use rayon::prelude::*;

use crate::qmat::QMatrix;

/// The best FLOP/s (2 per multiply-add) of the Q8_0 decode kernel over `shapes` (weight rows ×
/// columns, columns a multiple of 32) with 64 activation rows and cached weights.
pub fn kernel_flops(shapes: &[(usize, usize)], threads: usize) -> f64 {
    kernel_flops_windows(shapes, threads, 5)
}

/// [`kernel_flops`] over `windows` windows per shape (one: a ceiling measured beside another
/// measurement, so that both see the same machine).
pub fn kernel_flops_windows(shapes: &[(usize, usize)], threads: usize, windows: usize) -> f64 {
    shapes
        .iter()
        .map(|&(r, c)| kernel_flops_at(r, c, 64, threads, windows))
        .fold(0.0, f64::max)
}

/// [`kernel_flops`] for one `rows × cols` weight matrix and `n` activation rows; the best of
/// `windows` windows of at least [`WINDOW_S`].
pub fn kernel_flops_at(rows: usize, cols: usize, n: usize, threads: usize, windows: usize) -> f64 {
    let w: Vec<f32> = (0..rows * cols)
        .map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0)
        .collect();
    let m = QMatrix::quantize_q8_0(&w, rows, cols);
    let x: Vec<f32> = (0..n * cols)
        .map(|i| ((i * 13 % 29) as f32 - 14.0) / 14.0)
        .collect();
    let mut best = 0f64;
    for _ in 0..windows.max(1) {
        let (t, mut calls) = (Instant::now(), 0usize);
        let mut sink = 0f32;
        while calls < 4 || t.elapsed().as_secs_f64() < WINDOW_S {
            sink += m.matmul_q(&x, threads)[0];
            calls += 1;
        }
        let s = t.elapsed().as_secs_f64();
        std::hint::black_box(sink);
        best = best.max(2.0 * (calls * n * rows * cols) as f64 / s);
    }
    best
}

/// The shortest window [`kernel_flops_at`] times.
const WINDOW_S: f64 = 0.25;

/// Bytes per second read by `threads` threads summing a 512 MiB buffer; best of 3 runs.
pub fn read_bandwidth(threads: usize) -> f64 {
    let words: usize = 64 << 20; // 512 MiB of u64
    let buf: Vec<u64> = (0..words as u64).collect();
    let chunk = words.div_ceil(threads.max(1));
    let mut best = 0f64;
    for _ in 0..3 {
        let t = Instant::now();
        let sum: u64 = buf
            .par_chunks(chunk)
            .map(|c| c.iter().fold(0u64, |a, &v| a.wrapping_add(v)))
            .reduce(|| 0, u64::wrapping_add);
        let s = t.elapsed().as_secs_f64();
        std::hint::black_box(sum);
        best = best.max((words * 8) as f64 / s);
    }
    best
}
