//! Matrix products over the block formats against f32 GEMM (candle, the previous prefill
//! path) on SmolLM2's largest projection (1536 × 576), for decode-sized and prompt-sized
//! activation counts.

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use strata_model::qmat::QMatrix;

fn values(n: usize, seed: usize) -> Vec<f32> {
    (0..n)
        .map(|i| ((i.wrapping_mul(2654435761) ^ seed) % 1000) as f32 / 1000.0 - 0.5)
        .collect()
}

fn products(c: &mut Criterion) {
    let (rows, cols) = (1536, 576);
    let w = Tensor::from_vec(values(rows * cols, 1), (rows, cols), &Device::Cpu).unwrap();
    let wt = w.t().unwrap();
    let mut g = c.benchmark_group("qmat");
    g.sample_size(20);
    for (dt, name) in [(GgmlDType::Q4_1, "q4_1"), (GgmlDType::Q8_0, "q8_0")] {
        let m = QMatrix::from_qtensor(&QTensor::quantize(&w, dt).unwrap(), name).unwrap();
        for n in [1usize, 16, 512] {
            let x = values(n * cols, 7 + n);
            g.throughput(Throughput::Elements((2 * n * rows * cols) as u64));
            if n <= 16 {
                g.bench_function(BenchmarkId::new(format!("{name}/int"), n), |b| {
                    b.iter(|| m.matmul_q(&x, 2))
                });
                g.bench_function(BenchmarkId::new(format!("{name}/f32"), n), |b| {
                    b.iter(|| m.matmul_f32(&x, 2))
                });
            }
            g.bench_function(BenchmarkId::new(format!("{name}/tiled"), n), |b| {
                b.iter(|| m.matmul_tiled(&x))
            });
        }
    }
    let x = Tensor::from_vec(values(512 * cols, 9), (512, cols), &Device::Cpu).unwrap();
    g.throughput(Throughput::Elements((2 * 512 * rows * cols) as u64));
    g.bench_function(BenchmarkId::new("f32-weights/candle-gemm", 512), |b| {
        b.iter(|| x.matmul(&wt).unwrap())
    });
    // The same product the other way round (ffn_down's shape: 576 × 1536).
    let w2 = Tensor::from_vec(values(rows * cols, 3), (cols, rows), &Device::Cpu).unwrap();
    let m2 =
        QMatrix::from_qtensor(&QTensor::quantize(&w2, GgmlDType::Q4_1).unwrap(), "q4_1").unwrap();
    let x2 = values(512 * rows, 11);
    g.bench_function(BenchmarkId::new("q4_1-down/tiled", 512), |b| {
        b.iter(|| m2.matmul_tiled(&x2))
    });
    let (w2t, x2t) = (
        w2.t().unwrap(),
        Tensor::from_vec(x2.clone(), (512, rows), &Device::Cpu).unwrap(),
    );
    g.bench_function(BenchmarkId::new("f32-weights-down/candle-gemm", 512), |b| {
        b.iter(|| x2t.matmul(&w2t).unwrap())
    });
    g.finish();
}

criterion_group!(benches, products);
criterion_main!(benches);
