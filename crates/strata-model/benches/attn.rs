//! One decode step's attention (`attn::row`) over every layer of SmolLM2-135M's shape (9 query
//! heads, 3 KV heads of 64, 30 layers) at context 512 and 2,048, f16 K/V in 16-slot pages: the
//! layers' planes (47 MB at 2,048) do not fit in cache, as in a real step.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use half::f16;
use strata_model::attn::{self, Plane, Shape};

fn decode_rows(c: &mut Criterion) {
    let shape = Shape {
        heads: 9,
        kv_heads: 3,
        head_dim: 64,
    };
    let (kvd, h, ps, layers) = (192usize, 576usize, 16usize, 30usize);
    let mut g = c.benchmark_group("attn_row");
    g.sample_size(20);
    for (threads, ctx) in [(2, 512usize), (2, 2048), (1, 2048)] {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        let pages: Vec<u32> = (0..ctx.div_ceil(ps) as u32).collect();
        let slots = pages.len() * ps;
        let plane = |seed: usize| -> Vec<f16> {
            (0..slots * kvd)
                .map(|i| {
                    f16::from_f32(((i.wrapping_mul(2654435761) ^ seed) % 1000) as f32 / 500.0 - 1.0)
                })
                .collect()
        };
        let kv: Vec<(Vec<f16>, Vec<f16>)> = (0..layers)
            .map(|l| (plane(2 * l), plane(2 * l + 1)))
            .collect();
        let q: Vec<f32> = (0..h).map(|i| (i % 17) as f32 / 17.0 - 0.5).collect();
        let mut out = vec![0f32; h];
        g.throughput(Throughput::Elements(ctx as u64));
        g.bench_function(
            BenchmarkId::new(format!("f16_30_layers/{threads}_threads"), ctx),
            |b| {
                b.iter(|| {
                    pool.install(|| {
                        for (k, v) in &kv {
                            let (kp, vp) = (Plane::F16(k), Plane::F16(v));
                            attn::row(shape, kp, vp, &pages, ps, &q, ctx - 1, &mut out, 0.125);
                        }
                    })
                })
            },
        );
    }
}

criterion_group!(benches, decode_rows);
criterion_main!(benches);
