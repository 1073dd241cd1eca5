//! `strata model bench --streams 1,4,16,64`: batched decode in process, as FLOP/s and bytes/s
//! against this machine's measured ceilings (`strata_model::peak`).

use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Result};
use strata_kv::memory::HeapAllocator;
use strata_kv::pool::DevicePool;
use strata_kv::PageLayout;
use strata_model::{peak, SeqInput};

/// The model a benchmark runs: one rank or tensor-parallel ranks, behind the engine's trait.
pub struct BenchModel {
    pub rt: Box<dyn strata_model::Runtime>,
    pub config: strata_model::Config,
    pub weight_bytes: usize,
}

/// What one decode step of `n` streams at context `ctx` computes and reads.
struct Work {
    flop: f64,
    bytes: f64,
}

/// Weights the decode step multiplies: every layer's projections and the vocabulary head.
fn weights(m: &BenchModel) -> f64 {
    let c = &m.config;
    let (h, q, kv) = (c.hidden, c.heads * c.head_dim, c.kv_heads * c.head_dim);
    let layer = q * h + 2 * kv * h + h * q + 3 * c.ffn * h;
    (c.layers * layer + c.vocab * h) as f64
}

fn work(m: &BenchModel, n: usize, ctx: f64) -> Work {
    let c = &m.config;
    let w = weights(m);
    // Q·Kᵀ and P·V: 2 multiply-adds per context token, head dimension and head.
    let attn = 4.0 * ctx * (c.heads * c.head_dim * c.layers) as f64;
    // K and V in f16 per context token, read once per stream.
    let kv_token = (2 * c.layers * c.kv_heads * c.head_dim * 2) as f64;
    Work {
        flop: n as f64 * (2.0 * w + attn),
        // The weights as held (the file's block formats), once per step.
        bytes: m.weight_bytes as f64 + n as f64 * ctx * kv_token,
    }
}

/// This machine's measured ceilings for the model's decode shapes (printed): kernel FLOP/s
/// and memory read bytes/s.
fn ceilings(m: &BenchModel, threads: usize) -> (f64, f64) {
    let (h, f) = (m.config.hidden, m.config.ffn);
    let flops_peak = peak::kernel_flops(&[(f, h), (h, f)], threads);
    let read_peak = peak::read_bandwidth(threads);
    println!(
        "ceilings ({threads} threads): decode kernel {:.1} GFLOP/s (Q8_0 × 8-bit activations, {}, {f} × {h} and {h} × {f} weights from cache, 64 rows), memory read {:.1} GB/s",
        flops_peak / 1e9,
        strata_model::qmat::kernel_name(),
        read_peak / 1e9
    );
    (flops_peak, read_peak)
}

/// Decodes `steps` tokens for each count of `streams` (each stream with its own `ctx`-token
/// context in its own pages, all streams in one forward call per step) and prints tokens/s,
/// FLOP/s and bytes/s next to the measured ceilings: each row's share of the kernel's is
/// against the best of windows of it timed between the row's repetitions.
/// `n` streams' tokens, `len` each: spread over the vocabulary, different per stream.
fn stream_tokens(n: usize, len: usize, vocab: usize) -> Vec<Vec<u32>> {
    (0..n)
        .map(|s| {
            (0..len)
                .map(|i| ((i * 7919 + s * 104_729 + 13) % vocab) as u32)
                .collect()
        })
        .collect()
}

pub fn run(
    m: &BenchModel,
    streams: &[usize],
    ctx: usize,
    steps: usize,
    threads: usize,
) -> Result<()> {
    let Some(&most) = streams.iter().max() else {
        return Ok(());
    };
    if most == 0 || most > 256 || ctx == 0 || steps == 0 {
        bail!("--streams takes counts from 1 to 256; --streams-context and --streams-steps ≥ 1");
    }
    let ps = 16;
    let per = (ctx + steps).div_ceil(ps);
    let layout = Arc::new(PageLayout::new(ps, m.rt.pool_kinds(ps)?)?);
    let pool = DevicePool::new(layout, (per * most) as u32, &HeapAllocator)?;
    let vocab = m.config.vocab;
    let pages: Vec<Vec<u32>> = (0..most)
        .map(|s| ((s * per) as u32..((s + 1) * per) as u32).collect())
        .collect();
    let toks = stream_tokens(most, ctx + steps, vocab);
    let seq = |s: usize, a: usize, b: usize, decode: bool| SeqInput {
        tokens: &toks[s][a..b],
        pos: a,
        pages: &pages[s],
        windows: &[],
        decode,
    };
    let t = Instant::now();
    for group in (0..most).collect::<Vec<_>>().chunks(8) {
        let seqs: Vec<SeqInput> = group.iter().map(|&s| seq(s, 0, ctx, false)).collect();
        m.rt.forward_rows(&pool, &seqs, &vec![false; seqs.len()])?;
    }
    eprintln!(
        "prefilled {most} × {ctx} tokens in {:.1} s",
        t.elapsed().as_secs_f64()
    );
    let (_, read_peak) = ceilings(m, threads);
    println!(
        "| streams | tok/s | step ms | GFLOP/s | of kernel peak | GB/s read | of read peak | kernel GFLOP/s beside |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    let (h, f) = (m.config.hidden, m.config.ffn);
    for &n in streams {
        // Each repetition beside a window of the kernel ceiling: the best of each, measured
        // in the same seconds (a shared machine's speed drifts between rows and runs).
        let (mut best, mut beside) = (f64::MAX, 0f64);
        for _ in 0..3 {
            beside = beside.max(peak::kernel_flops_windows(&[(f, h), (h, f)], threads, 1));
            let t = Instant::now();
            for i in 0..steps {
                let pos = ctx + i;
                let seqs: Vec<SeqInput> = (0..n).map(|s| seq(s, pos, pos + 1, true)).collect();
                m.rt.forward_rows(&pool, &seqs, &vec![false; seqs.len()])?;
            }
            best = best.min(t.elapsed().as_secs_f64());
        }
        let step = best / steps as f64;
        let w = work(m, n, ctx as f64 + steps as f64 / 2.0);
        let (flops, bytes) = (w.flop / step, w.bytes / step);
        println!(
            "| {n} | {:.1} | {:.2} | {:.1} | {:.0} % | {:.1} | {:.0} % | {:.1} |",
            n as f64 / step,
            step * 1e3,
            flops / 1e9,
            100.0 * flops / beside,
            bytes / 1e9,
            100.0 * bytes / read_peak,
            beside / 1e9
        );
    }
    Ok(())
}
