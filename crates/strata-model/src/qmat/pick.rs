//! Which kernel takes a single activation row of a flat format (Q4_0, Q4_1, Q8_0) where the CPU
//! has AVX-512 VNNI: measured once per format at first use, not assumed from the instruction
//! set. AVX-512's kernel shares each weight group among up to 16 rows, which one row cannot
//! use; AVX2's one-row kernel (`avx2::dot_int_flat`) reduces eight groups at once and scales
//! them with one conversion. Which is faster depends on the core: on AMD Zen 4 (512-bit
//! operations issued as two 256-bit halves) the AVX2 one is ~1.2× faster per decode step
//! (docs/BENCHMARKS.md), so a machine-independent rule would be wrong on one vendor or the other.
//!
//! The AVX2 kernel is picked only when it is at least [`MARGIN`] faster, so a machine near
//! parity keeps one answer from start to start (the two kernels agree to rounding, not bit
//! for bit). `STRATA_ONE_ROW_KERNEL=avx2` or `=avx512` skips the measurement.

use std::hint::black_box;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use super::format::{Format, QActs, GROUP};

/// How much faster (time ratio) the AVX2 one-row kernel must be to be picked.
pub(crate) const MARGIN: f64 = 1.10;

/// The pick per format (indexed as `kernels::FORMATS`).
static PICKS: [OnceLock<Pick>; 7] = [const { OnceLock::new() }; 7];

/// One format's measured choice.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Pick {
    pub avx2: bool,
    /// AVX-512 time over AVX2 time for the same work (0 when not measured).
    pub ratio: f64,
}

/// The pick for `f` (`index`: its place in the format table), measured with `time_avx512`
/// and `time_avx2` (each: one pass over a test matrix) the first time it is asked for.
pub(crate) fn one_row(
    index: usize,
    time_avx512: impl Fn(&[u8], usize, &QActs),
    time_avx2: impl Fn(&[u8], usize, &QActs),
    f: Format,
) -> Pick {
    *PICKS[index].get_or_init(|| {
        match std::env::var("STRATA_ONE_ROW_KERNEL").as_deref() {
            Ok("avx2") => {
                return Pick {
                    avx2: true,
                    ratio: 0.0,
                }
            }
            Ok("avx512") => {
                return Pick {
                    avx2: false,
                    ratio: 0.0,
                }
            }
            _ => {}
        }
        let (data, groups, x) = test_matrix(f);
        let t512 = best_of(|| time_avx512(&data, groups, &x));
        let t2 = best_of(|| time_avx2(&data, groups, &x));
        let ratio = t512.as_secs_f64() / t2.as_secs_f64().max(1e-9);
        Pick {
            avx2: ratio >= MARGIN,
            ratio,
        }
    })
}

/// The pick of the format at `index`, once measured.
pub(crate) fn cached(index: usize) -> Option<Pick> {
    PICKS[index].get().copied()
}

/// The fastest of nine timed passes, after one untimed.
fn best_of(pass: impl Fn()) -> Duration {
    pass();
    (0..9)
        .map(|_| {
            let t = Instant::now();
            pass();
            t.elapsed()
        })
        .min()
        .expect("nine passes")
}

/// Rows of the test matrix: 256 × 1,536 weights (SmolLM2's feed-forward width, 250–420 KB:
/// in L2 after the first pass, as a decode step's weights are not, so the
/// kernels' own rates are compared).
const ROWS: usize = 256;
const COLS: usize = 1536;

/// A matrix of flat format `f` (random weights, small finite scales) as bytes, its groups per
/// row, and one quantized activation row.
fn test_matrix(f: Format) -> (Vec<u8>, usize, QActs) {
    let bb = f.block_bytes();
    let groups = COLS / GROUP;
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = || {
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (seed >> 33) as u8
    };
    let mut data: Vec<u8> = (0..ROWS * groups * bb).map(|_| next()).collect();
    // Scale (and min) halves: 0x2000 is 2^-7 in f16, finite.
    let halves = if bb == 20 { 2 } else { 1 };
    for block in data.chunks_exact_mut(bb) {
        for h in 0..halves {
            block[2 * h..2 * h + 2].copy_from_slice(&0x2000u16.to_le_bytes());
        }
    }
    let x: Vec<f32> = (0..COLS)
        .map(|i| ((i * 37) % 101) as f32 / 50.0 - 1.0)
        .collect();
    (data, groups, QActs::quantize(&x))
}

/// One pass of `kernel` over every row of the test matrix (outputs kept alive).
pub(crate) fn pass(
    data: &[u8],
    groups: usize,
    x: &QActs,
    bb: usize,
    kernel: impl Fn(&[u8], &QActs, &mut [f32]),
) {
    let mut out = [0f32; 1];
    for row in data.chunks_exact(groups * bb) {
        kernel(row, x, &mut out);
        black_box(out[0]);
    }
}
