//! The cost of constrained decoding per token on SmolLM2-135M's tokenizer (49 152 tokens;
//! `strata model fetch` puts the model in the cache; the tiny model stands in without it):
//! the mask of the next token (computed on a helper thread while the model runs), the commit
//! of the chosen token and the mask applied to the logits (both on the scheduler's path).
//!
//! `cargo bench -p strata-grammar --bench mask`

use std::sync::Arc;

use criterion::{criterion_group, criterion_main, Criterion};
use strata_engine::{ConstraintSource, TokenMask};
use strata_grammar::{Grammars, OutputConstraint};
use strata_model::{Gguf, ModelTokenizer};

fn tokenizer() -> (Arc<ModelTokenizer>, usize, &'static str) {
    let real = strata_model::fetch::cache_dir().join(strata_model::fetch::MODEL_FILE);
    let (path, name, _dir) = if real.exists() {
        (real, "smollm2", None)
    } else {
        let d = tempfile::tempdir().unwrap();
        let p = strata_test_support::tiny_model(d.path());
        (p, "tiny", Some(d))
    };
    let g = Gguf::open(&path).unwrap();
    let vocab = g.config.vocab;
    (
        Arc::new(ModelTokenizer::from_gguf(&g).unwrap()),
        vocab,
        name,
    )
}

/// A JSON answer of a schema with strings, numbers, an enum and an array: the tokens a model
/// would write, committed one by one.
const ANSWER: &str = r#"{"name":"Ada Lovelace","age":36,"city":"London","pet":"cat","tags":["math","engines","poetry"],"score":97.5}"#;
const SCHEMA: &str = r#"{"type":"object","properties":{"name":{"type":"string"},"age":{"type":"integer"},"city":{"type":"string"},"pet":{"enum":["cat","dog","none"]},"tags":{"type":"array","items":{"type":"string"}},"score":{"type":"number"}},"required":["name","age","city","pet","tags","score"],"additionalProperties":false}"#;

fn bench(c: &mut Criterion) {
    let (tk, vocab, name) = tokenizer();
    let g = Grammars::new(tk.clone(), vocab).unwrap();
    let compiled = g
        .compile(&OutputConstraint::JsonSchema(SCHEMA.into()))
        .unwrap();
    let tokens = tk.encode(ANSWER).unwrap();
    let n = tokens.len() as u32;
    let mut group = c.benchmark_group(format!("grammar/{name}"));
    group.sample_size(20);
    group.bench_function(
        format!("json_schema answer, mask + commit per token ({n} tokens)"),
        |b| {
            b.iter(|| {
                let mut m = compiled.start();
                for &t in &tokens {
                    let mask = m.mask().unwrap();
                    assert!(mask.allows(t));
                    m.commit(t).unwrap();
                }
            })
        },
    );
    group.bench_function(
        format!("json_schema answer, commit only ({n} tokens)"),
        |b| {
            b.iter(|| {
                let mut m = compiled.start();
                for &t in &tokens {
                    m.commit(t).unwrap();
                }
            })
        },
    );
    group.bench_function("start a request's matcher", |b| b.iter(|| compiled.start()));
    group.bench_function("compile the schema", |b| {
        b.iter(|| {
            g.compile(&OutputConstraint::JsonSchema(SCHEMA.into()))
                .unwrap()
        })
    });
    let mask = compiled.start().mask().unwrap();
    let logits: Vec<f32> = (0..vocab).map(|i| (i as f32 * 0.37).sin()).collect();
    group.bench_function(format!("apply a mask to {vocab} logits"), |b| {
        b.iter(|| {
            let mut l = logits.clone();
            TokenMask::apply(&mask, &mut l, &tk.stop);
            l
        })
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
