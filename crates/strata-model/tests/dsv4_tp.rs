//! DeepSeek-V4 over tensor-parallel ranks (`strata_model::deepseek4::tp`, the tiny model): at TP 2
//! and TP 4 the reference prompts give llama.cpp's logits within the reference tolerance and
//! TP 1's greedy tokens; at each TP size a batch, any chunking and a prefix moved through the
//! host layout give the bits of one sequence computed at once; pages cross to the whole
//! model's layout and into a server of another TP size.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde_json::Value;
use strata_kv::memory::HeapAllocator;
use strata_kv::pool::DevicePool;
use strata_kv::PageLayout;
use strata_model::tiny::deepseek4::{write_tiny_dsv4, TinyDsv4Spec};
use strata_model::{load, LoadOptions, RankPlacement, Runtime, SeqInput};

/// llama.cpp's tolerance of the reference pass (tests/dsv4_reference.rs).
const TOL: f32 = 1e-4;
const PS: usize = 16;

fn tiny(dir: &Path) -> PathBuf {
    let p = dir.join("tiny-dsv4.gguf");
    write_tiny_dsv4(&p, &TinyDsv4Spec::default()).unwrap();
    p
}

fn model(path: &Path, tp: usize) -> Box<dyn Runtime> {
    let ranks = if tp == 1 {
        Vec::new()
    } else {
        vec![RankPlacement::default(); tp]
    };
    load(
        path,
        LoadOptions {
            ranks,
            ..LoadOptions::new(1)
        },
    )
    .unwrap()
    .runtime
}

fn pool(m: &dyn Runtime, pages: u32) -> DevicePool {
    let layout = Arc::new(PageLayout::new(PS, m.pool_kinds(PS).unwrap()).unwrap());
    DevicePool::with_window(layout, pages, pages, &HeapAllocator).unwrap()
}

fn argmax(l: &[f32]) -> u32 {
    (0..l.len()).fold(0, |b, i| if l[i] > l[b] { i } else { b }) as u32
}

fn diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn prompt(n: usize, seed: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (i * 37 + 11 + seed * 101) % 280)
        .collect()
}

/// Every token's logits (rows of the vocabulary) of `toks` from position `from` on, computed
/// in chunks of `chunk` into `pages` (each page its own window page).
fn rows(
    m: &dyn Runtime,
    pool: &DevicePool,
    pages: &[u32],
    toks: &[u32],
    from: usize,
    chunk: usize,
) -> Vec<Vec<f32>> {
    let v = m.vocab();
    let mut out = Vec::new();
    let mut at = from;
    while at < toks.len() {
        let n = chunk.min(toks.len() - at);
        let seq = SeqInput {
            tokens: &toks[at..at + n],
            pos: at,
            pages,
            windows: pages,
            decode: n == 1,
        };
        let l = m.forward_rows(pool, &[seq], &[true]).unwrap().remove(0);
        out.extend(l.chunks_exact(v).map(<[f32]>::to_vec));
        at += n;
    }
    out
}

/// The prompt's logits, then `steps` greedy decode steps: (every row, the tokens chosen).
fn greedy(m: &dyn Runtime, toks: &[u32], steps: usize) -> (Vec<Vec<f32>>, Vec<u32>) {
    let pages: Vec<u32> = (0..(toks.len() + steps).div_ceil(PS) as u32).collect();
    let pool = pool(m, pages.len() as u32);
    let mut all = toks.to_vec();
    let mut out = rows(m, &pool, &pages, &all, 0, 24);
    let mut chosen = Vec::new();
    for _ in 0..steps {
        let t = argmax(out.last().unwrap());
        chosen.push(t);
        all.push(t);
        let at = all.len() - 1;
        out.extend(rows(m, &pool, &pages, &all, at, 1));
    }
    (out, chosen)
}

#[test]
fn tp_2_and_4_give_llama_cpps_logits_and_tp_1s_greedy_tokens() {
    let d = tempfile::tempdir().unwrap();
    let path = tiny(d.path());
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/tiny_dsv4_logits.json"
    ))
    .unwrap();
    let f: Value = serde_json::from_str(&text).unwrap();
    let one = model(&path, 1);
    for tp in [2, 4] {
        let m = model(&path, tp);
        let (mut worst_ref, mut worst_tp1) = (0.0f32, 0.0f32);
        for p in f["prompts"].as_array().unwrap() {
            let name = p["name"].as_str().unwrap();
            let toks: Vec<u32> = p["tokens"]
                .as_array()
                .unwrap()
                .iter()
                .map(|t| t.as_u64().unwrap() as u32)
                .collect();
            // llama.cpp's logits at its positions, and after its decode tokens.
            let mut fed = toks.clone();
            let steps = p["decode"].as_array().unwrap();
            fed.extend(steps.iter().map(|s| s["token"].as_u64().unwrap() as u32));
            let pages: Vec<u32> = (0..fed.len().div_ceil(PS) as u32).collect();
            let pool = pool(&*m, pages.len() as u32);
            let got = rows(&*m, &pool, &pages, &fed, 0, 24);
            for (pos, want) in p["logits"].as_object().unwrap() {
                let want: Vec<f32> = want
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|x| x.as_f64().unwrap() as f32)
                    .collect();
                let dv = diff(&got[pos.parse::<usize>().unwrap()], &want);
                assert!(dv <= TOL, "TP {tp}, {name} at {pos}: {dv}");
                worst_ref = worst_ref.max(dv);
            }
            for (s, step) in steps.iter().enumerate() {
                let want: Vec<f32> = step["logits"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|x| x.as_f64().unwrap() as f32)
                    .collect();
                let dv = diff(&got[toks.len() + s], &want);
                assert!(dv <= TOL, "TP {tp}, {name}: decode step {s}: {dv}");
                worst_ref = worst_ref.max(dv);
            }
            // Greedy decoding from the prompt: TP 1's tokens.
            let (a, ta) = greedy(&*one, &toks, 12);
            let (b, tb) = greedy(&*m, &toks, 12);
            assert_eq!(ta, tb, "TP {tp}, {name}: greedy tokens");
            for (x, y) in a.iter().zip(&b) {
                worst_tp1 = worst_tp1.max(diff(x, y));
            }
        }
        eprintln!("TP {tp}: largest difference from llama.cpp {worst_ref}, from TP 1 {worst_tp1}");
    }
}

#[test]
fn at_each_tp_size_batches_chunks_and_moved_prefixes_give_the_same_bits() {
    let d = tempfile::tempdir().unwrap();
    let path = tiny(d.path());
    for tp in [2, 4] {
        let m = model(&path, tp);
        let (a, b) = (prompt(150, 1), prompt(133, 2));
        let pool = pool(&*m, 40);
        let pa: Vec<u32> = (0..10).collect();
        let pb: Vec<u32> = (20..29).collect();
        let whole_a = rows(&*m, &pool, &pa, &a, 0, 150).concat();
        let whole_b = rows(&*m, &pool, &pb, &b, 0, 133).concat();
        // Chunks of every size.
        for c in [1, 7, 64] {
            assert_eq!(
                bits(&rows(&*m, &pool, &pa, &a, 0, c).concat()),
                bits(&whole_a),
                "TP {tp}, chunks of {c}"
            );
        }
        // Both in one call, of different lengths.
        let seqs = [
            SeqInput {
                tokens: &a,
                pos: 0,
                pages: &pa,
                windows: &pa,
                decode: false,
            },
            SeqInput {
                tokens: &b,
                pos: 0,
                pages: &pb,
                windows: &pb,
                decode: false,
            },
        ];
        let out = m.forward_rows(&pool, &seqs, &[false, true]).unwrap();
        assert_eq!(
            bits(&out[0]),
            bits(&whole_a[whole_a.len() - m.vocab()..]),
            "TP {tp}"
        );
        assert_eq!(bits(&out[1]), bits(&whole_b), "TP {tp}");
        // A prefix copied out in the host layout, to the wire layout and back, into other
        // pages, continues with the same bits.
        let layout = pool.layout().clone();
        let moved: Vec<u32> = (30..40).collect();
        for (&src, &dst) in pa.iter().zip(&moved).take(128 / PS) {
            let mut blob = vec![0u8; layout.page_bytes()];
            pool.read_page_host_layout(src, Some(src), &mut blob);
            let wire = m.page_to_wire(PS, &blob).unwrap().unwrap();
            assert_eq!(wire.len() * tp, blob.len());
            let back = m.page_from_wire(PS, &wire).unwrap().unwrap();
            assert!(back == blob, "TP {tp}: every rank's copy is the same bits");
            pool.write_page_host_layout(dst, Some(dst), &back);
        }
        let cont = rows(&*m, &pool, &moved, &a, 128, 22).concat();
        assert_eq!(
            bits(&cont),
            bits(&whole_a[128 * m.vocab()..]),
            "TP {tp}: moved prefix"
        );
        // A page of another size is refused, not cut.
        let e = m.page_from_wire(PS, &[0u8; 100]).unwrap_err().to_string();
        assert!(e.contains("a state page of 100 bytes"), "{e}");
    }
}

/// A prefix computed at one TP size continues at another (what PD does between a prefill
/// server and a decode server of different sizes): greedy tokens as the receiver computing it
/// all, logits within rounding.
#[test]
fn a_prefix_crosses_between_tp_sizes() {
    let d = tempfile::tempdir().unwrap();
    let path = tiny(d.path());
    let toks = prompt(200, 5);
    let hit = 160;
    for (from, to) in [(2, 1), (1, 4), (4, 2)] {
        let (src, dst) = (model(&path, from), model(&path, to));
        let pages: Vec<u32> = (0..(toks.len() + 8).div_ceil(PS) as u32).collect();
        let (sp, dp) = (
            pool(&*src, pages.len() as u32),
            pool(&*dst, pages.len() as u32),
        );
        rows(&*src, &sp, &pages, &toks[..hit], 0, 64);
        let (sl, dl) = (sp.layout().clone(), dp.layout().clone());
        for &p in &pages[..hit / PS] {
            let mut blob = vec![0u8; sl.page_bytes()];
            sp.read_page_host_layout(p, Some(p), &mut blob);
            let wire = src.page_to_wire(PS, &blob).unwrap().unwrap_or(blob);
            let local = dst.page_from_wire(PS, &wire).unwrap().unwrap_or(wire);
            assert_eq!(local.len(), dl.page_bytes());
            dp.write_page_host_layout(p, Some(p), &local);
        }
        let got = rows(&*dst, &dp, &pages, &toks, hit, 16);
        let (own, _) = greedy(&*dst, &toks, 0);
        let mut worst = 0.0f32;
        for (g, o) in got.iter().zip(&own[hit..]) {
            assert_eq!(argmax(g), argmax(o), "TP {from} → TP {to}");
            worst = worst.max(diff(g, o));
        }
        assert!(worst < 1e-3, "TP {from} → TP {to}: {worst}");
    }
}

#[test]
fn sizes_the_model_cannot_split_are_refused_by_name() {
    let d = tempfile::tempdir().unwrap();
    let path = tiny(d.path());
    let e = load(
        &path,
        LoadOptions {
            ranks: vec![RankPlacement::default(); 5],
            ..LoadOptions::new(1)
        },
    )
    .err()
    .unwrap()
    .to_string();
    assert!(
        e.contains("--tp-size 5") && e.contains("4 attention heads"),
        "{e}"
    );
    // A layout of another TP size is refused before any rank waits on another.
    let (two, four) = (model(&path, 2), model(&path, 4));
    let p = pool(&*four, 4);
    let pages = [0u32];
    let seq = SeqInput {
        tokens: &[1, 2],
        pos: 0,
        pages: &pages,
        windows: &pages,
        decode: false,
    };
    let e = two
        .forward_rows(&p, &[seq], &[false])
        .unwrap_err()
        .to_string();
    assert!(e.contains("rank 0 of 2"), "{e}");
    // A part that is no part of this model, or a part run alone, is refused.
    use strata_model::deepseek4::load::load_dsv4_part;
    use strata_model::deepseek4::part::Dsv4Part;
    let c = strata_model::deepseek4::load::read_dsv4_config(&path).unwrap();
    let mut bad = Dsv4Part::split(&c, 2).unwrap().remove(1);
    bad.vocab = 100..400;
    let e = load_dsv4_part(&path, bad).err().unwrap().to_string();
    assert!(
        e.contains("vocabulary 100..400 is not a non-empty part of 0..288"),
        "{e}"
    );
    let half = load_dsv4_part(&path, Dsv4Part::split(&c, 2).unwrap().remove(0)).unwrap();
    let p = pool(&half, 4);
    let seq = SeqInput {
        tokens: &[1, 2],
        pos: 0,
        pages: &pages,
        windows: &pages,
        decode: false,
    };
    let e = half
        .forward_rows(&p, &[seq], &[false])
        .unwrap_err()
        .to_string();
    assert!(e.contains("runs with the other ranks"), "{e}");
}

#[test]
fn parts_cover_heads_width_and_vocabulary_and_groups_split_between_ranks() {
    use strata_model::deepseek4::part::Dsv4Part;
    let d = tempfile::tempdir().unwrap();
    let c = strata_model::deepseek4::load::read_dsv4_config(&tiny(d.path())).unwrap();
    let p = Dsv4Part::split(&c, 4).unwrap();
    assert_eq!(p[3].heads, 3..4);
    assert_eq!(p[1].ffn, 8..16);
    assert_eq!(p.iter().map(|p| p.vocab.len()).sum::<usize>(), c.vocab);
    // 4 heads of 128 in 2 groups of 256 inputs: rank 1 holds the second half of group 0.
    assert_eq!(p[1].groups(&c), vec![(0, 128..256)]);
    assert_eq!(
        Dsv4Part::split(&c, 2).unwrap()[1].groups(&c),
        vec![(1, 0..256)]
    );
    assert_eq!(
        Dsv4Part::whole(&c).groups(&c),
        vec![(0, 0..256), (1, 0..256)]
    );
    let e = Dsv4Part::split(&c, 5).unwrap_err().to_string();
    assert!(e.contains("its 4 attention heads"), "{e}");
}
