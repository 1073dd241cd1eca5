//! The runtime on tiny random-weight GGUF files written by the test: loading and validation,
//! tokenizer, chat template, and cache equivalence of the paged forward pass.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::quantized::GgmlDType;
use strata_kv::memory::HeapAllocator;
use strata_kv::pool::DevicePool;
use strata_kv::{CacheConfig, PageLayout, TieredCache, WritePolicy};
use strata_model::tiny::{write_tiny, TinySpec, TINY_TEMPLATE};
use strata_model::*;

fn tiny(dir: &Path, spec: &TinySpec) -> PathBuf {
    let p = dir.join("tiny.gguf");
    write_tiny(&p, spec).unwrap();
    p
}

fn load(spec: &TinySpec) -> (tempfile::TempDir, Gguf, Model) {
    let d = tempfile::tempdir().unwrap();
    let p = tiny(d.path(), spec);
    let mut g = Gguf::open(&p).unwrap();
    let mut m = Model::load(&mut g).unwrap();
    // Equivalence is a property of one weight format; the default switches to Q8_0 for calls
    // of few rows, which would compare two formats.
    m.set_quantized_decode(false);
    (d, g, m)
}

fn pool(m: &Model, page: usize, pages: u32) -> DevicePool {
    let layout = Arc::new(PageLayout::new(page, vec![m.pool_kind()]).unwrap());
    DevicePool::new(layout, pages, &HeapAllocator).unwrap()
}

fn prompt(n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| (i * 37 + 11) % 280).collect()
}

/// Largest difference relative to the logit's size (absolute below 1). Different row counts take
/// different f32 GEMM paths (last-bit differences), and K/V are stored as f16, where such a bit
/// can round to the neighbouring f16 value: so chunkings agree to ~1e-4, not to the bit. Moving
/// a page between tiers is exact (see the load-back test).
fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs() / x.abs().max(1.0))
        .fold(0.0, f32::max)
}

fn argmax(v: &[f32]) -> u32 {
    v.iter()
        .enumerate()
        .max_by(|a, b| a.1.total_cmp(b.1))
        .unwrap()
        .0 as u32
}

#[test]
fn validates_metadata_shapes_and_truncation() {
    let d = tempfile::tempdir().unwrap();
    let p = tiny(d.path(), &TinySpec::default());
    let g = Gguf::open(&p).unwrap();
    assert_eq!(
        (
            g.config.hidden,
            g.config.heads,
            g.config.kv_heads,
            g.config.head_dim,
            g.config.vocab
        ),
        (64, 4, 2, 16, 288)
    );
    // Truncated: clear error naming the sizes.
    let bytes = std::fs::read(&p).unwrap();
    let t = d.path().join("trunc.gguf");
    std::fs::write(&t, &bytes[..bytes.len() - 1000]).unwrap();
    let e = Gguf::open(&t).err().unwrap().to_string();
    assert!(e.contains("is truncated: tensor data needs"), "{e}");
    // Cut inside the header.
    std::fs::write(&t, &bytes[..100]).unwrap();
    let e = Gguf::open(&t).err().unwrap().to_string();
    assert!(e.contains("is not a readable GGUF file"), "{e}");
    // Foreign file.
    std::fs::write(&t, b"PK\x03\x04 this is a zip, not a model").unwrap();
    assert!(Gguf::open(&t)
        .err()
        .unwrap()
        .to_string()
        .contains("is not a readable GGUF file"));
    assert!(Gguf::open(&d.path().join("missing.gguf"))
        .err()
        .unwrap()
        .to_string()
        .starts_with("cannot open model"));
}

#[test]
fn tokenizer_roundtrip_specials_and_digits() {
    let (_d, g, _m) = load(&TinySpec::default());
    let tk = ModelTokenizer::from_gguf(&g).unwrap();
    for s in [
        "the cat",
        "héllo wörld ✓",
        "x=12345",
        "<|im_start|>user\nhi<|im_end|>",
    ] {
        let ids = tk.encode(s).unwrap();
        assert_eq!(tk.decode(&ids).unwrap(), s);
    }
    // The merges apply: " the" is one token; control tokens are single ids; digits split.
    let ids = tk.encode(" the").unwrap();
    assert_eq!(ids, vec![258]);
    assert_eq!(tk.encode("<|im_end|>").unwrap(), vec![261]);
    assert_eq!(tk.encode("123").unwrap().len(), 3);
    assert_eq!(tk.stop, vec![259, 261]);
}

#[test]
fn chat_template_renders_with_generation_prompt() {
    let t = ChatTemplate::new(TINY_TEMPLATE).unwrap();
    let s = t.render(&[Message::new("user", "Hi")], true).unwrap();
    assert_eq!(s, "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
    assert!(ChatTemplate::new("{% for %}").is_err());
}

/// Logits of a prompt in one pass equal those of a cached prefix plus the rest, for prefix
/// lengths on and off page boundaries and several chunk sizes.
#[test]
fn cache_equivalence_chunks_and_prefixes() {
    let (_d, _g, m) = load(&TinySpec::default());
    let ps = 8;
    let n = 53;
    let toks = prompt(n);
    let pl = pool(&m, ps, 64);
    let pages_a: Vec<u32> = (0..7).collect();
    let full = m.forward_one(&pl, &toks, 0, &pages_a, true).unwrap();
    assert_eq!(full.len(), n * 288);
    for prefix in [8, 13, 16, 31, 40] {
        for chunk in [1, 5, 16, 64] {
            let pages_b: Vec<u32> = (20..27).collect();
            let mut got = m
                .forward_one(&pl, &toks[..prefix], 0, &pages_b, true)
                .unwrap();
            let mut pos = prefix;
            while pos < n {
                let end = (pos + chunk).min(n);
                got.extend(
                    m.forward_one(&pl, &toks[pos..end], pos, &pages_b, true)
                        .unwrap(),
                );
                pos = end;
            }
            let d = max_diff(&full, &got);
            eprintln!("prefix {prefix} chunk {chunk}: max relative diff {d:.2e}");
            assert!(d < 5e-4, "prefix {prefix} chunk {chunk}: max diff {d}");
        }
    }
}

/// A prompt's last logits are the same bits whatever was cached before its rest and however
/// the rest was chunked: any prefix, down to the prompt's last token alone (prompt rows, in
/// the tile however few). The prefix is also an earlier, shorter prompt whose last token was
/// computed as its end: that token stores the K/V an inner token would (it once read the pages
/// as a decode row did, and every later layer's K/V of that position differed; a prompt
/// extending a cached one of whole pages got other bits).
#[test]
fn a_prompts_logits_are_the_same_bits_whatever_was_cached() {
    let (_d, _g, m) = load(&TinySpec::default());
    let ps = 8;
    let n = 37;
    let toks = prompt(n);
    let pl = pool(&m, ps, 64);
    let seq = |tokens: &'_ [u32], pos: usize, pages: &'_ [u32]| -> Vec<f32> {
        let s = SeqInput {
            tokens,
            pos,
            pages,
            windows: &[],
            decode: false,
        };
        m.forward(&pl, &[s], false).unwrap().remove(0)
    };
    let a: Vec<u32> = (0..5).collect();
    let whole = seq(&toks, 0, &a);
    for cached in [1, 8, 16, 20, n - 2, n - 1] {
        let b: Vec<u32> = (20..25).collect();
        seq(&toks[..cached], 0, &b);
        // The rest in chunks of 3: the prompt's end comes in the last one.
        let mut at = cached;
        let mut rest = Vec::new();
        while at < n {
            let end = (at + 3).min(n);
            rest = seq(&toks[at..end], at, &b);
            at = end;
        }
        let same = whole
            .iter()
            .zip(&rest)
            .all(|(x, y)| x.to_bits() == y.to_bits());
        assert!(
            same,
            "{cached} cached: max diff {}",
            max_diff(&whole, &rest)
        );
    }
}

/// A batch of sequences decodes exactly like each one alone, and greedy continuations from a
/// cached prefix equal those from a full recompute.
#[test]
fn batched_decode_and_greedy_continuations_match() {
    let (_d, _g, m) = load(&TinySpec::default());
    let ps = 4;
    let pl = pool(&m, ps, 128);
    let greedy = |prompt: &[u32], pages: &[u32], cached: usize| -> Vec<u32> {
        let mut out = Vec::new();
        let mut logits = if cached > 0 {
            m.forward_one(&pl, &prompt[cached..], cached, pages, false)
                .unwrap()
        } else {
            m.forward_one(&pl, prompt, 0, pages, false).unwrap()
        };
        for i in 0..10 {
            let t = argmax(&logits);
            out.push(t);
            logits = m
                .forward_one(&pl, &[t], prompt.len() + i, pages, false)
                .unwrap();
        }
        out
    };
    let p = prompt(21);
    let a_pages: Vec<u32> = (0..8).collect();
    let full = greedy(&p, &a_pages, 0);
    // Same prompt, prefix of 13 tokens computed earlier into other pages, then continued.
    let b_pages: Vec<u32> = (40..48).collect();
    m.forward_one(&pl, &p[..13], 0, &b_pages, false).unwrap();
    assert_eq!(greedy(&p, &b_pages, 13), full);
    // Batched decode step of two sequences equals each alone.
    let q = prompt(9);
    let c_pages: Vec<u32> = (60..70).collect();
    let d_pages: Vec<u32> = (80..90).collect();
    m.forward(
        &pl,
        &[
            SeqInput {
                tokens: &p,
                pos: 0,
                pages: &c_pages,
                windows: &[],
                decode: false,
            },
            SeqInput {
                tokens: &q,
                pos: 0,
                pages: &d_pages,
                windows: &[],
                decode: false,
            },
        ],
        false,
    )
    .unwrap();
    let both = m
        .forward(
            &pl,
            &[
                SeqInput {
                    tokens: &[5],
                    pos: p.len(),
                    pages: &c_pages,
                    windows: &[],
                    decode: true,
                },
                SeqInput {
                    tokens: &[7],
                    pos: q.len(),
                    pages: &d_pages,
                    windows: &[],
                    decode: true,
                },
            ],
            false,
        )
        .unwrap();
    let alone = m.forward_one(&pl, &[7], q.len(), &d_pages, false).unwrap();
    assert!(max_diff(&both[1], &alone) < 1e-4);
}

/// Through the tiered cache: a prefix computed, backed up, evicted from the device and loaded
/// back into different pages continues exactly like a full recompute.
#[test]
fn prefix_loaded_back_from_host_gives_identical_logits() {
    let (_d, _g, m) = load(&TinySpec {
        dtype: GgmlDType::Q8_0,
        ..TinySpec::default()
    });
    let ps = 4;
    let layout = PageLayout::new(ps, vec![m.pool_kind()]).unwrap();
    let mut cfg = CacheConfig::new(layout, 16, 64);
    cfg.write_policy = WritePolicy::WriteThrough;
    let mut cache = TieredCache::new(cfg, &HeapAllocator, None).unwrap();
    let p = prompt(30);
    // Reference: one pass in fresh pages.
    let all = cache.alloc_device(8).unwrap();
    let want = m
        .forward_one(cache.device_pool().unwrap(), &p, 0, &all, true)
        .unwrap();
    cache.free_device(&all).unwrap();
    // Compute the first 24 tokens (6 pages), insert, let the backup land, push them off device.
    let pages = cache.alloc_device(6).unwrap();
    m.forward_one(cache.device_pool().unwrap(), &p[..24], 0, &pages, false)
        .unwrap();
    cache.insert(&p[..24], &pages, 0);
    cache.wait_all();
    assert_eq!(cache.evict_device(16), 6);
    let mt = cache.match_prefix(&p);
    assert_eq!((mt.device_tokens, mt.host_tokens), (0, 24));
    cache.lock(mt.last);
    let t = cache.load_back(&mt).unwrap();
    cache.wait(t);
    let mut pages: Vec<u32> = cache
        .tree()
        .path_to(mt.last)
        .iter()
        .flat_map(|&n| cache.tree().view(n).device.to_vec())
        .collect();
    assert_eq!(pages.len(), 6);
    pages.extend(cache.alloc_device(2).unwrap());
    let got = m
        .forward_one(cache.device_pool().unwrap(), &p[24..], 24, &pages, true)
        .unwrap();
    let d = max_diff(&want[24 * 288..], &got);
    assert!(d < 5e-4, "max diff {d}");
    // Same shapes on the original pages (still on host, recomputed here into fresh pages): the
    // loaded-back prefix gives bit-identical logits.
    let fresh = cache.alloc_device(8).unwrap();
    m.forward_one(cache.device_pool().unwrap(), &p[..24], 0, &fresh, false)
        .unwrap();
    let again = m
        .forward_one(cache.device_pool().unwrap(), &p[24..], 24, &fresh, true)
        .unwrap();
    assert_eq!(again, got, "load-back must be exact");
}

#[test]
fn bad_forward_inputs_are_errors() {
    let (_d, _g, m) = load(&TinySpec::default());
    let pl = pool(&m, 4, 8);
    let e = m
        .forward(
            &pl,
            &[SeqInput {
                tokens: &[1, 2, 3, 4, 5],
                pos: 0,
                pages: &[0],
                windows: &[],
                decode: false,
            }],
            false,
        )
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("1 pages of 4 tokens cannot hold 5 tokens"),
        "{e}"
    );
    let e = m
        .forward(
            &pl,
            &[SeqInput {
                tokens: &[999],
                pos: 0,
                pages: &[0],
                windows: &[],
                decode: false,
            }],
            false,
        )
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("outside the vocabulary"), "{e}");
    let e = m
        .forward(
            &pl,
            &[SeqInput {
                tokens: &[1],
                pos: 0,
                pages: &[99],
                windows: &[],
                decode: false,
            }],
            false,
        )
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("outside the device pool"), "{e}");
}

/// With the default mixed formats, a decode step (Q8_0) stays close to the f32 result.
#[test]
fn quantized_decode_stays_close_to_f32() {
    let (_d, _g, mut m) = load(&TinySpec {
        dtype: GgmlDType::Q8_0,
        ..TinySpec::default()
    });
    let pl = pool(&m, 4, 16);
    let p = prompt(12);
    let pages: Vec<u32> = (0..4).collect();
    m.forward_one(&pl, &p[..11], 0, &pages, false).unwrap();
    let f32_step = m.forward_one(&pl, &p[11..], 11, &pages, false).unwrap();
    m.set_quantized_decode(true);
    let q8_step = m.forward_one(&pl, &p[11..], 11, &pages, false).unwrap();
    let d = max_diff(&f32_step, &q8_step);
    assert!(d > 0.0 && d < 0.5, "Q8_0 decode differs by {d}");
}

/// Attention gathers sequences' K/V in groups under a byte budget: sequences sharing a prefix's
/// pages, each computing a chunk after it (with a decode row among them, and a chunk that ends
/// its prompt), give the same bits in one group as each in a group of its own.
#[test]
fn attention_groups_do_not_change_a_rows_bits() {
    let (_d, _g, mut m) = load(&TinySpec::default());
    let ps = 4;
    let pl = pool(&m, ps, 128);
    let p = prompt(40);
    let prefix: Vec<u32> = (0..8).collect();
    m.forward_one(&pl, &p[..32], 0, &prefix, false).unwrap();
    // Four sequences on the shared 32-token prefix, each with its own pages after it.
    let pages: Vec<Vec<u32>> = (0..4u32)
        .map(|i| {
            prefix
                .iter()
                .copied()
                .chain(40 + 4 * i..44 + 4 * i)
                .collect()
        })
        .collect();
    let chunks: Vec<Vec<u32>> = (0..4).map(|i| prompt(40 + i)[32..].to_vec()).collect();
    let call = |m: &Model| {
        let seqs: Vec<SeqInput> = (0..4)
            .map(|i| SeqInput {
                tokens: if i == 2 { &chunks[i][..1] } else { &chunks[i] },
                pos: 32,
                pages: &pages[i],
                windows: &[],
                decode: i == 2,
            })
            .collect();
        m.forward(&pl, &seqs, true).unwrap()
    };
    let one_group = call(&m);
    m.set_gather_budget(0);
    let alone = call(&m);
    let bits = |v: &[Vec<f32>]| -> Vec<u32> { v.concat().iter().map(|x| x.to_bits()).collect() };
    assert_eq!(bits(&one_group), bits(&alone));
}
