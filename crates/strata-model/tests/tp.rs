//! Tensor-parallel ranks on the tiny random-weight models of every family: TP 2 and TP 4
//! give TP 1's greedy tokens and its logits to rounding, pages re-shard to the whole model's
//! layout and back, and bad placements or layouts are refused without a rank left waiting.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::quantized::GgmlDType;
use strata_kv::memory::HeapAllocator;
use strata_kv::pool::DevicePool;
use strata_kv::PageLayout;
use strata_model::tiny::{write_tiny, TinySpec};
use strata_model::*;

const PAGE: usize = 16;

fn tiny(dir: &Path, spec: &TinySpec) -> PathBuf {
    let p = dir.join("tiny.gguf");
    write_tiny(&p, spec).unwrap();
    p
}

fn opts(ranks: usize) -> LoadOptions {
    LoadOptions {
        ranks: vec![RankPlacement::default(); ranks],
        ..LoadOptions::new(1)
    }
}

fn pool(m: &dyn Runtime, pages: u32) -> DevicePool {
    let layout = PageLayout::new(PAGE, m.pool_kinds(PAGE).unwrap()).unwrap();
    DevicePool::new(Arc::new(layout), pages, &HeapAllocator).unwrap()
}

fn argmax(v: &[f32]) -> u32 {
    v.iter()
        .enumerate()
        .max_by(|a, b| a.1.total_cmp(b.1))
        .unwrap()
        .0 as u32
}

fn prompt(n: usize, seed: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (i * 37 + 11 + seed * 53) % 280)
        .collect()
}

/// Two sequences in every call (so the gather carries several rows): their prompts in two
/// chunks, then greedy decode steps. Returns both answers and the prompts' last logits.
fn run(m: &dyn Runtime, steps: usize) -> (Vec<Vec<u32>>, Vec<Vec<f32>>) {
    let pool = pool(m, 16);
    let pages: [Vec<u32>; 2] = [(0..8).collect(), (8..16).collect()];
    let prompts = [prompt(37, 0), prompt(21, 1)];
    let mut last = Vec::new();
    for (a, b) in [(0, 20), (20, usize::MAX)] {
        let seqs: Vec<SeqInput> = (0..2)
            .map(|i| SeqInput {
                tokens: &prompts[i][a.min(prompts[i].len())..b.min(prompts[i].len())],
                pos: a.min(prompts[i].len()),
                pages: &pages[i],
                windows: &[],
                decode: false,
            })
            .collect();
        last = m.forward_rows(&pool, &seqs, &[false, false]).unwrap();
    }
    let mut answers: Vec<Vec<u32>> = last.iter().map(|l| vec![argmax(l)]).collect();
    let first_logits = last.clone();
    for _ in 0..steps {
        let seqs: Vec<SeqInput> = (0..2)
            .map(|i| SeqInput {
                tokens: std::slice::from_ref(answers[i].last().unwrap()),
                pos: prompts[i].len() + answers[i].len() - 1,
                pages: &pages[i],
                windows: &[],
                decode: true,
            })
            .collect();
        let out = m.forward_rows(&pool, &seqs, &[false, false]).unwrap();
        for (a, l) in answers.iter_mut().zip(&out) {
            a.push(argmax(l));
        }
    }
    (answers, first_logits)
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs() / x.abs().max(1.0))
        .fold(0.0, f32::max)
}

/// A wider llama whose heads are 32 values (four ranks of one head each are whole groups).
fn wide(dtype: GgmlDType) -> TinySpec {
    TinySpec {
        hidden: 128,
        ffn: 256,
        dtype,
        ..TinySpec::default()
    }
}

#[test]
fn tp_ranks_answer_as_one_rank() {
    let cases: Vec<(&str, TinySpec, &[usize])> = vec![
        ("llama", TinySpec::family("llama").unwrap(), &[2]),
        ("llama3", TinySpec::family("llama3").unwrap(), &[2]),
        ("qwen2", TinySpec::family("qwen2").unwrap(), &[2]),
        ("qwen3", TinySpec::family("qwen3").unwrap(), &[2, 4]),
        ("mistral", TinySpec::family("mistral").unwrap(), &[2]),
        ("wide f32", wide(GgmlDType::F32), &[2, 4]),
        ("wide q8_0", wide(GgmlDType::Q8_0), &[2, 4]),
        ("wide q4_1", wide(GgmlDType::Q4_1), &[2, 4]),
    ];
    for (name, spec, tps) in cases {
        let d = tempfile::tempdir().unwrap();
        let p = tiny(d.path(), &spec);
        let one = load(&p, LoadOptions::new(1)).unwrap().runtime;
        let (want, want_logits) = run(&*one, 12);
        for &tp in tps {
            let m = load(&p, opts(tp)).unwrap().runtime;
            assert_eq!(m.pool_kinds(PAGE).unwrap().len(), tp, "{name}");
            let (got, logits) = run(&*m, 12);
            assert_eq!(got, want, "{name} TP {tp}: greedy tokens");
            for (a, b) in logits.iter().zip(&want_logits) {
                let diff = max_diff(a, b);
                assert!(
                    diff < 1e-3,
                    "{name} TP {tp}: prompt logits differ by {diff}"
                );
            }
        }
    }
}

/// Layer 0's K/V do not depend on the split (the embedding all-reduce is exact, K and V rows
/// are the same products): a TP-2 page in the wire layout equals TP 1's there, and the wire
/// page re-shards to the TP-2 page itself.
#[test]
fn pages_reshard_to_the_whole_model_and_back() {
    let d = tempfile::tempdir().unwrap();
    let p = tiny(d.path(), &wide(GgmlDType::F32));
    let one = load(&p, LoadOptions::new(1)).unwrap().runtime;
    for tp in [2, 4] {
        let m = load(&p, opts(tp)).unwrap().runtime;
        assert_eq!(m.wire_kinds(PAGE).unwrap(), one.pool_kinds(PAGE).unwrap());
        let toks = prompt(PAGE, 3);
        let mut blobs = Vec::new();
        for r in [&one, &m] {
            let pool = pool(&**r, 1);
            let seq = SeqInput {
                tokens: &toks,
                pos: 0,
                pages: &[0],
                windows: &[],
                decode: false,
            };
            r.forward_rows(&pool, &[seq], &[false]).unwrap();
            let mut blob = vec![0u8; pool.layout().page_bytes()];
            pool.read_page_host_layout(0, None, &mut blob);
            blobs.push(blob);
        }
        let wire = m.page_to_wire(PAGE, &blobs[1]).unwrap().unwrap();
        assert_eq!(wire.len(), blobs[0].len());
        // Layer 0: its K and V chunks, PAGE rows of 2 KV heads × 32 f16 values each.
        let layer0 = 2 * PAGE * 2 * 32 * 2;
        assert_eq!(&wire[..layer0], &blobs[0][..layer0], "TP {tp}: layer 0 K/V");
        assert_eq!(m.page_from_wire(PAGE, &wire).unwrap().unwrap(), blobs[1]);
        for bad in [&wire[1..], &wire[..wire.len() / 2], &[][..]] {
            let e = m.page_from_wire(PAGE, bad).unwrap_err().to_string();
            assert!(e.contains("expected 16 tokens of"), "{e}");
        }
        assert!(m.page_to_wire(PAGE / 2, &blobs[1]).is_err());
    }
}

#[test]
fn bad_splits_layouts_and_placements_are_refused() {
    let d = tempfile::tempdir().unwrap();
    let p = tiny(d.path(), &TinySpec::default());
    // Four ranks of one 16-value head each are not whole 32-value groups.
    let e = load(&p, opts(4)).err().unwrap().to_string();
    assert!(e.contains("not whole 32-value groups"), "{e}");
    let e = load(&p, opts(5)).err().unwrap().to_string();
    assert!(e.contains("exceeds the model's 4 attention heads"), "{e}");
    // A CPU this process cannot run on.
    let mut o = opts(2);
    o.ranks[1].cpus = Some(vec![1000]);
    let e = load(&p, o).err().unwrap().to_string();
    assert!(
        e.contains("rank 1: cannot pin threads to CPUs [1000]"),
        "{e}"
    );
    // Pinned to CPU 0: runs (and answers as one rank does).
    let mut o = opts(2);
    o.ranks[0].cpus = Some(vec![0]);
    o.ranks[1].cpus = Some(vec![0]);
    let m = load(&p, o).unwrap().runtime;
    let one = load(&p, LoadOptions::new(1)).unwrap().runtime;
    assert_eq!(run(&*m, 4).0, run(&*one, 4).0);
    // A pool without the ranks' kinds: an error before any rank runs, and the ranks still
    // serve the next call.
    let wrong = pool(&*one, 4);
    let seq = SeqInput {
        tokens: &[1, 2, 3],
        pos: 0,
        pages: &[0],
        windows: &[],
        decode: false,
    };
    let e = m
        .forward_rows(&wrong, &[seq], &[false])
        .unwrap_err()
        .to_string();
    assert!(e.contains("lacks rank pool"), "{e}");
    let bad = SeqInput {
        tokens: &[100_000],
        ..seq
    };
    let good = pool(&*m, 4);
    assert!(m.forward_rows(&good, &[bad], &[false]).is_err());
    assert_eq!(
        m.forward_rows(&good, &[seq], &[false]).unwrap()[0].len(),
        288
    );
}
