//! Strata's forward pass against llama.cpp's logits on the same tiny file of each family
//! (tests/fixtures/tiny_{llama,llama3,qwen2,qwen3,mistral}_logits.json, written by
//! scripts/llamacpp/reference.py with the llama.cpp version recorded): llama, llama with
//! Llama 3's RoPE frequency factors and its own output head, qwen2 (Q/K/V biases, NeoX RoPE),
//! qwen3 (per-head Q/K norms, a head size that is not embedding / heads), mistral (llama with a
//! SentencePiece vocabulary, as Mistral's files are). Every prompt's
//! logits at page boundaries and its last position, the argmax of every position, and greedy
//! decode steps, computed through the paged pool in one prefill call and then one token a
//! call (f32 weights, and Q8_0 for decode steps).

use std::sync::Arc;

use serde_json::Value;
use sha2::{Digest, Sha256};
use strata_kv::memory::HeapAllocator;
use strata_kv::pool::DevicePool;
use strata_kv::PageLayout;
use strata_model::tiny::{write_tiny, TinySpec};
use strata_model::{Gguf, Model};

/// Largest |Strata − llama.cpp| allowed per logit. Both compute in f32; Strata keeps K/V in
/// f16 pages (llama.cpp's reference: F32 K/V): measured ≤ 7.2e-3 on these files.
const TOL: f32 = 2e-2;

/// The same with Q8_0 weights for decode steps (Strata's default for calls of few rows):
/// measured ≤ 0.22 on these files' logits of magnitude ~3.
const TOL_Q8: f32 = 0.3;

fn fixture(family: &str) -> Value {
    let path = format!(
        "{}/tests/fixtures/tiny_{family}_logits.json",
        env!("CARGO_MANIFEST_DIR")
    );
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn row(v: &Value) -> Vec<f32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect()
}

fn argmax(l: &[f32]) -> usize {
    (0..l.len()).fold(0, |b, i| if l[i] > l[b] { i } else { b })
}

/// Max |a − b|.
fn diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

fn check(family: &str, quantized_decode: bool) -> f32 {
    let tol_decode = if quantized_decode { TOL_Q8 } else { TOL };
    let d = tempfile::tempdir().unwrap();
    let path = d.path().join("tiny.gguf");
    write_tiny(&path, &TinySpec::family(family).unwrap()).unwrap();
    let f = fixture(family);
    let sha = Sha256::digest(std::fs::read(&path).unwrap());
    let hex: String = sha.iter().map(|b| format!("{b:02x}")).collect();
    assert_eq!(
        f["model_sha256"], hex,
        "the generator changed: rerun scripts/llamacpp/reference.py"
    );
    let mut m = Model::load(&mut Gguf::open(&path).unwrap()).unwrap();
    m.set_quantized_decode(quantized_decode);
    let layout = Arc::new(PageLayout::new(16, vec![m.pool_kind()]).unwrap());
    let mut worst = 0.0f32;
    for p in f["prompts"].as_array().unwrap() {
        let name = p["name"].as_str().unwrap();
        let toks: Vec<u32> = p["tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_u64().unwrap() as u32)
            .collect();
        let decode = p["decode"].as_array().unwrap();
        let pages = (toks.len() + decode.len()).div_ceil(16) as u32;
        let pool = DevicePool::new(layout.clone(), pages, &HeapAllocator).unwrap();
        let table: Vec<u32> = (0..pages).collect();
        let all = m.forward_one(&pool, &toks, 0, &table, true).unwrap();
        let vocab = all.len() / toks.len();
        for (i, want) in p["argmax"].as_array().unwrap().iter().enumerate() {
            let got = argmax(&all[i * vocab..(i + 1) * vocab]) as u64;
            // A near tie may go either way: then the choice is llama.cpp's runner-up.
            let (second, gap) = (&p["runner_up"][i], p["gap"][i].as_f64().unwrap() as f32);
            let tie = second.as_u64() == Some(got) && gap <= TOL;
            assert!(
                got == want.as_u64().unwrap() || tie,
                "{name}: argmax at {i}: {got} vs {want} (gap {gap})"
            );
        }
        for (pos, want) in p["logits"].as_object().unwrap() {
            let i: usize = pos.parse().unwrap();
            let dv = diff(&all[i * vocab..(i + 1) * vocab], &row(want));
            assert!(dv <= TOL, "{name} at {i}: {dv}");
            worst = worst.max(dv);
        }
        for (s, step) in decode.iter().enumerate() {
            let t = step["token"].as_u64().unwrap() as u32;
            let l = m
                .forward_one(&pool, &[t], toks.len() + s, &table, false)
                .unwrap();
            let want = row(&step["logits"]);
            // Equal argmax, but for a near tie (within the tolerance in llama.cpp's logits).
            let (got, best) = (argmax(&l), argmax(&want));
            let gap = want[best] - want[got];
            assert!(
                got == best || gap <= tol_decode,
                "{name}: decode step {s}: {got} vs {best} (gap {gap})"
            );
            let dv = diff(&l, &want);
            assert!(dv <= tol_decode, "{name}: decode step {s}: {dv}");
            worst = worst.max(dv);
        }
    }
    worst
}

const FAMILIES: [&str; 5] = ["llama", "llama3", "qwen2", "qwen3", "mistral"];

#[test]
fn logits_equal_llama_cpps_on_every_familys_tiny_model() {
    for family in FAMILIES {
        let worst = check(family, false);
        eprintln!("{family}: largest logit difference from llama.cpp (f32 weights): {worst}");
    }
}

#[test]
fn quantized_decode_steps_stay_within_the_tolerance() {
    for family in FAMILIES {
        let worst = check(family, true);
        eprintln!("{family}: largest logit difference from llama.cpp (Q8_0 decode steps): {worst}");
    }
}
