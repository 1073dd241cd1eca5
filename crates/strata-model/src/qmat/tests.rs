//! Every format against candle's dequantization (the GGUF reference) and every kernel against
//! the scalar reference, for row counts across the kernels' row groups and tails.

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};

use super::format::{self, Format, QActs, GROUP};
use super::{kernels, QMatrix};

const ALL: [(GgmlDType, Format); 7] = [
    (GgmlDType::F32, Format::F32),
    (GgmlDType::F16, Format::F16),
    (GgmlDType::Q4_0, Format::Q4_0),
    (GgmlDType::Q4_1, Format::Q4_1),
    (GgmlDType::Q8_0, Format::Q8_0),
    (GgmlDType::Q4K, Format::Q4K),
    (GgmlDType::Q6K, Format::Q6K),
];

fn values(n: usize, seed: usize) -> Vec<f32> {
    // A deterministic spread of magnitudes and signs, with an offset (exercises mins).
    (0..n)
        .map(|i| {
            let h = (i.wrapping_mul(2654435761) ^ seed.wrapping_mul(40503)) % 10007;
            (h as f32 / 10007.0 - 0.45) * (1.0 + (i % 7) as f32 / 3.0)
        })
        .collect()
}

/// A `rows × cols` matrix quantized by candle, and candle's dequantization of it.
fn matrix(d: GgmlDType, rows: usize, cols: usize, seed: usize) -> (QMatrix, Vec<f32>) {
    let w = Tensor::from_vec(values(rows * cols, seed), (rows, cols), &Device::Cpu).unwrap();
    let q = QTensor::quantize(&w, d).unwrap();
    let deq = q
        .dequantize(&Device::Cpu)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    (QMatrix::from_qtensor(&q, "test").unwrap(), deq)
}

fn cols_for(f: Format) -> usize {
    // An odd number of groups where the format allows (the AVX-512 kernels' tail).
    if f.block_weights() == GROUP {
        7 * GROUP
    } else {
        3 * 256
    }
}

fn close(got: f32, want: f32, rel: f32, what: &str) {
    assert!(
        (got - want).abs() <= rel * want.abs().max(1.0),
        "{what}: {got} vs {want}"
    );
}

#[test]
fn dequantization_matches_candle() {
    for (d, f) in ALL {
        let (rows, cols) = (5, cols_for(f));
        let (m, deq) = matrix(d, rows, cols, 1);
        assert_eq!(m.format, f);
        let mut row = vec![0f32; cols];
        let mut g = [0f32; GROUP];
        for i in 0..rows {
            m.row_f32(i, &mut row);
            for (j, chunk) in row.chunks_exact(GROUP).enumerate() {
                format::group_f32(f, m.row(i), j, &mut g);
                for k in 0..GROUP {
                    let want = deq[i * cols + j * GROUP + k];
                    close(
                        chunk[k],
                        want,
                        1e-6,
                        &format!("{f:?} simd row {i} group {j}"),
                    );
                    close(g[k], want, 1e-6, &format!("{f:?} scalar row {i} group {j}"));
                }
            }
        }
    }
}

#[test]
fn products_match_the_reference() {
    for (d, f) in ALL {
        let (rows, cols) = (67, cols_for(f));
        let (m, deq) = matrix(d, rows, cols, 2);
        for n in [1, 2, 3, 4, 5, 8, 9, 13, 17] {
            let x = values(n * cols, 100 + n);
            let exact: Vec<f32> = (0..n * rows)
                .map(|k| {
                    let (r, i) = (k / rows, k % rows);
                    let xr = &x[r * cols..(r + 1) * cols];
                    xr.iter()
                        .zip(&deq[i * cols..(i + 1) * cols])
                        .map(|(a, b)| a * b)
                        .sum()
                })
                .collect();
            let (f32s, tiled, q) = (m.matmul_f32(&x, 2), m.matmul_tiled(&x), m.matmul_q(&x, 2));
            let qx = QActs::quantize(&x);
            let groups = cols / GROUP;
            for k in 0..n * rows {
                let what = format!("{f:?} n {n} out {k}");
                close(f32s[k], exact[k], 1e-4, &format!("f32 {what}"));
                close(tiled[k], exact[k], 1e-4, &format!("tiled {what}"));
                if f.integer() {
                    let (r, i) = (k / rows, k % rows);
                    let want = format::dot_int(f, m.row(i), &qx, r * groups, groups);
                    close(q[k], want, 1e-4, &format!("int {what}"));
                    // Activation rounding moves each activation by at most half its group's
                    // step: the product by at most Σ |w| · step / 2.
                    let xr = &x[r * cols..(r + 1) * cols];
                    let wr = &deq[i * cols..(i + 1) * cols];
                    let bound: f32 = xr
                        .chunks_exact(GROUP)
                        .zip(wr.chunks_exact(GROUP))
                        .map(|(xb, wb)| {
                            let step = xb.iter().fold(0f32, |m, v| m.max(v.abs())) / 127.0;
                            wb.iter().map(|w| w.abs()).sum::<f32>() * step / 2.0
                        })
                        .sum();
                    assert!(
                        (q[k] - exact[k]).abs() <= bound * 1.01 + 1e-4,
                        "int vs exact {what}: {} vs {} (bound {bound})",
                        q[k],
                        exact[k]
                    );
                } else {
                    assert_eq!(q[k], f32s[k], "{what}: F32/F16 take f32 activations");
                }
            }
        }
    }
}

/// The AVX2 kernels against the scalar reference even on a CPU where AVX-512 is picked.
#[cfg(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma"
))]
#[test]
fn avx2_kernels_where_avx512_is_picked() {
    // An odd count of groups, and (blocks of 32) two runs of eight groups plus three: the
    // one-row kernel reduces eight groups at a time.
    let shapes = ALL
        .into_iter()
        .filter(|(_, f)| f.integer())
        .flat_map(|(d, f)| {
            [
                (d, f, cols_for(f)),
                (d, f, 19 * f.block_weights().max(GROUP)),
            ]
        });
    for (d, f, cols) in shapes {
        let rows = 9;
        let (m, _) = matrix(d, rows, cols, 3);
        let groups = cols / GROUP;
        let n = 12;
        let qx = QActs::quantize(&values(n * cols, 7));
        let k = kernels::int_kernel_avx2(f);
        for i in 0..rows {
            let mut out = [0f32; 8];
            for (r0, g) in [(0, 8), (8, 3), (11, 1)] {
                k(m.row(i), groups, &qx, r0, &mut out[..g]);
                for (r, &got) in out[..g].iter().enumerate() {
                    let want = format::dot_int(f, m.row(i), &qx, (r0 + r) * groups, groups);
                    close(got, want, 1e-4, &format!("{f:?} row {i} act {}", r0 + r));
                }
            }
        }
    }
}

#[test]
fn shapes_that_are_not_whole_blocks_are_refused() {
    assert!(QMatrix::new(Format::Q4_1, 2, 48, vec![0; 2 * 30]).is_none());
    assert!(QMatrix::new(Format::Q4K, 1, 32, vec![0; 18]).is_none());
    assert!(QMatrix::new(Format::Q8_0, 2, 32, vec![0; 67]).is_none());
    assert!(QMatrix::new(Format::Q8_0, usize::MAX, 32, vec![0; 34]).is_none());
    assert!(QMatrix::new(Format::Q8_0, 2, 32, vec![0; 68]).is_some());
}

#[test]
fn other_formats_become_q8_0() {
    let (m, deq) = matrix(GgmlDType::Q5_1, 3, 64, 4);
    assert_eq!(m.format, Format::Q8_0);
    let mut row = vec![0f32; 64];
    for i in 0..3 {
        m.row_f32(i, &mut row);
        for (k, &v) in row.iter().enumerate() {
            // Q8_0 of the dequantized values: within half a step of 8 bits.
            close(v, deq[i * 64 + k], 0.01, &format!("row {i} col {k}"));
        }
    }
}

/// A row's f32 product is the same bits whatever other rows share the call (prompt logits
/// must not depend on chunking or on how much of a prompt was cached).
#[test]
fn tiled_rows_do_not_depend_on_the_batch() {
    for (d, f) in ALL {
        let (rows, cols) = (45, cols_for(f));
        let (m, _) = matrix(d, rows, cols, 5);
        let n = 29;
        let x = values(n * cols, 13);
        let all = m.matmul_tiled(&x);
        for (a, b) in [(0, 1), (3, 4), (5, 18), (17, 29), (1, 14)] {
            let part = m.matmul_tiled(&x[a * cols..b * cols]);
            for r in a..b {
                for i in 0..rows {
                    assert_eq!(
                        part[(r - a) * rows + i].to_bits(),
                        all[r * rows + i].to_bits(),
                        "{f:?} rows {a}..{b}: row {r} out {i}"
                    );
                }
            }
        }
    }
}

/// A decode row's integer product is the same bits whatever other rows share the call (a
/// greedy or seeded answer must not depend on the server's load): the default, batch-invariant
/// kernels, for every row count across the kernels' tiles and tails.
#[test]
fn decode_rows_do_not_depend_on_the_batch() {
    if super::pick::mode() != super::pick::OneRow::Invariant {
        return; // STRATA_ONE_ROW_KERNEL asked for the faster, batch-variant one-row kernel
    }
    for (d, f) in ALL {
        let (rows, cols) = (45, cols_for(f));
        let (m, _) = matrix(d, rows, cols, 7);
        let n = 21;
        let x = values(n * cols, 17);
        // The integer products, and the f32 ones (`--f32-decode`, F16/F32 weights).
        for f32 in [false, true] {
            let mm = |x: &[f32]| {
                if f32 {
                    m.matmul_f32(x, 2)
                } else {
                    m.matmul_q(x, 2)
                }
            };
            let all = mm(&x);
            for (a, b) in [(0, 1), (4, 5), (20, 21), (3, 12), (5, 14), (1, 18), (2, 19)] {
                let part = mm(&x[a * cols..b * cols]);
                for r in a..b {
                    for i in 0..rows {
                        assert_eq!(
                            part[(r - a) * rows + i].to_bits(),
                            all[r * rows + i].to_bits(),
                            "{f:?} (f32 {f32}) rows {a}..{b}: row {r} out {i}"
                        );
                    }
                }
            }
        }
    }
}

/// Any bytes in the blocks (a hostile file: NaN and infinite scales, −128 weights, any Q6_K
/// multipliers): every product runs without panicking, and where the scalar reference is
/// finite the integer kernels agree with it.
#[test]
fn any_block_bytes_are_safe() {
    let mut seed = 0x9E37_79B9_7F4A_7C15u64;
    let mut byte = || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed as u8
    };
    for (_, f) in ALL {
        let (rows, cols) = (9, cols_for(f));
        let bytes = rows * cols / f.block_weights() * f.block_bytes();
        let data: Vec<u8> = (0..bytes).map(|_| byte()).collect();
        let m = QMatrix::new(f, rows, cols, data).unwrap();
        let n = 5;
        let x = values(n * cols, 17);
        let (q, a, t) = (m.matmul_q(&x, 2), m.matmul_f32(&x, 2), m.matmul_tiled(&x));
        assert_eq!((q.len(), a.len(), t.len()), (n * rows, n * rows, n * rows));
        if f.integer() {
            let qx = QActs::quantize(&x);
            let groups = cols / GROUP;
            for (k, &got) in q.iter().enumerate() {
                let (r, i) = (k / rows, k % rows);
                let want = format::dot_int(f, m.row(i), &qx, r * groups, groups);
                if want.is_finite() && got.is_finite() {
                    close(got, want, 1e-3, &format!("{f:?} hostile bytes, out {k}"));
                }
            }
        }
    }
}

/// One of the three products, for tests over all of them.
type Product = fn(&QMatrix, &[f32]) -> Vec<f32>;

/// A tensor-parallel rank's slices: rows are the same bytes; products over column slices
/// add up to the whole matrix's (each product in its own rounding).
#[test]
fn row_and_column_slices_add_up() {
    for d in [
        GgmlDType::Q4_1,
        GgmlDType::Q8_0,
        GgmlDType::Q4K,
        GgmlDType::F32,
    ] {
        let f = Format::of(d).unwrap();
        let cols = 3 * cols_for(f);
        let (m, _) = matrix(d, 40, cols, 7);
        let x = values(2 * cols, 3);
        let part = m.rows_range(8..24);
        let (want, got) = (m.matmul_tiled(&x), part.matmul_tiled(&x));
        for r in 0..2 {
            assert_eq!(&got[r * 16..(r + 1) * 16], &want[r * 40 + 8..r * 40 + 24]);
        }
        for split in [cols_for(f), cols / 2 / 32 * 32] {
            let (a, b) = (
                m.cols_range(0..split).unwrap(),
                m.cols_range(split..cols).unwrap(),
            );
            let xs = |r: std::ops::Range<usize>| -> Vec<f32> {
                x.chunks_exact(cols)
                    .flat_map(|row| row[r.clone()].to_vec())
                    .collect()
            };
            let prods: [Product; 3] = [
                |m, x| m.matmul_q(x, 1),
                |m, x| m.matmul_f32(x, 1),
                QMatrix::matmul_tiled,
            ];
            for prod in prods {
                let whole = prod(&m, &x);
                let pa = prod(&a, &xs(0..split));
                let pb = prod(&b, &xs(split..cols));
                // Off block boundaries the slices are requantized to Q8_0: 8-bit rounding of
                // every weight, ~1 % of the outputs' scale.
                let blocks = split.is_multiple_of(f.block_weights());
                let tol = if blocks { 2e-3 } else { 3e-2 };
                let scale = whole.iter().fold(1f32, |m, v| m.max(v.abs()));
                for i in 0..whole.len() {
                    let err = (pa[i] + pb[i] - whole[i]).abs();
                    assert!(
                        err <= tol * scale,
                        "{} split {split}: {err} of {scale}",
                        f.name()
                    );
                }
            }
        }
    }
}

/// The affine formats' min terms, gathered sixteen groups at a time by the AVX-512 kernel:
/// rows of several chunks and a partial one (odd group counts), against the scalar product.
#[test]
fn affine_min_terms_across_chunks() {
    for (d, f, cols) in [
        (GgmlDType::Q4_1, Format::Q4_1, 37 * GROUP),
        (GgmlDType::Q4K, Format::Q4K, 5 * 256),
    ] {
        let rows = 5;
        let (m, _) = matrix(d, rows, cols, 11);
        let groups = cols / GROUP;
        for n in [1usize, 3, 16] {
            let x = values(n * cols, 40 + n);
            let (q, qx) = (m.matmul_q(&x, 2), QActs::quantize(&x));
            for (k, &got) in q.iter().enumerate() {
                let (r, i) = (k / rows, k % rows);
                let want = format::dot_int(f, m.row(i), &qx, r * groups, groups);
                close(got, want, 1e-4, &format!("{f:?} n {n} out {k}"));
            }
        }
    }
}

/// Several matrices in one split over the threads give each matrix's own product, bit for
/// bit, and each output where the scalar reference puts it: weight rows across jobs and
/// output tiles (137 rows), activation rows across the kernels' row groups (1, 17, 33).
#[test]
fn matrices_sharing_one_input_give_their_own_products() {
    let ints: Vec<_> = ALL.into_iter().filter(|(_, f)| f.integer()).collect();
    let cols = ints.iter().map(|&(_, f)| cols_for(f)).max().unwrap();
    let mats: Vec<QMatrix> = ints
        .iter()
        .enumerate()
        .map(|(k, &(d, _))| matrix(d, 137 + 64 * k, cols, k).0)
        .collect();
    let ws: Vec<&QMatrix> = mats.iter().collect();
    for n in [1, 17, 33] {
        let qx = QActs::quantize(&values(n * cols, 11 + n));
        for threads in [1, 3] {
            let many = QMatrix::matmul_qacts_many(&ws, &qx, threads);
            for (w, got) in ws.iter().zip(&many) {
                let one = w.matmul_qacts(&qx, 2);
                assert_eq!(got.len(), n * w.rows);
                assert!(got
                    .iter()
                    .zip(&one)
                    .all(|(a, b)| a.to_bits() == b.to_bits()));
                for (r, i) in [(0, 0), (n - 1, w.rows - 1), (n / 2, 70)] {
                    let want = format::dot_int(w.format, w.row(i), &qx, r * w.groups(), w.groups());
                    close(
                        got[r * w.rows + i],
                        want,
                        1e-4,
                        &format!("{:?} {r} {i}", w.format),
                    );
                }
            }
        }
    }
    assert!(QMatrix::matmul_qacts_many(&[], &QActs::quantize(&[]), 2).is_empty());
}

/// Where AVX-512 is picked, each flat format's one-row kernel is measured (a time ratio,
/// AVX2 only past the margin, the same answer when asked again); the K-quants have no one-row
/// kernel of their own and are never moved; the description names every flat format.
#[cfg(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma"
))]
#[test]
fn the_one_row_kernel_is_picked_by_measured_speed() {
    if !super::avx512::available() || super::pick::mode() != super::pick::OneRow::Fastest {
        return;
    }
    for f in [Format::Q4_0, Format::Q4_1, Format::Q8_0] {
        let p = kernels::one_row_pick(f).expect("a flat format on AVX-512");
        let r = p.ratio.expect("measured");
        assert!(r > 0.0 && r.is_finite(), "{f:?}: {p:?}");
        assert_eq!(p.avx2, r >= super::pick::MARGIN, "{f:?}: {p:?}");
        assert_eq!(kernels::one_row_pick(f), Some(p), "{f:?} measured once");
    }
    for f in [Format::Q4K, Format::Q6K] {
        assert!(kernels::one_row_pick(f).is_none(), "{f:?}");
    }
    let d = super::kernel_description();
    for f in ["Q4_0", "Q4_1", "Q8_0"] {
        assert!(
            d.starts_with("avx512-vnni (one row: ") && d.contains(f),
            "{d}"
        );
    }
}
