//! End to end on the reference model (SmolLM2-135M-Instruct Q4_1). `scripts/test.sh` fetches it
//! first (`strata model fetch`); without it these tests fail and say how to get it.

use std::path::PathBuf;
use std::sync::Arc;

use strata_kv::memory::HeapAllocator;
use strata_kv::pool::DevicePool;
use strata_kv::PageLayout;
use strata_model::fetch::{cache_dir, MODEL_FILE};
use strata_model::*;

fn model_path() -> PathBuf {
    let p = cache_dir().join(MODEL_FILE);
    assert!(
        p.exists(),
        "{} is missing: run `strata model fetch` (scripts/test.sh does it first)",
        p.display()
    );
    p
}

fn load() -> (Gguf, Model, ModelTokenizer) {
    let mut g = Gguf::open(&model_path()).unwrap();
    let tk = ModelTokenizer::from_gguf(&g).unwrap();
    let m = Model::load(&mut g).unwrap();
    (g, m, tk)
}

/// Ids checked against llama.cpp's `llama-tokenize` on the same file.
#[test]
fn tokenizer_fixed_vectors_and_roundtrip() {
    let g = Gguf::open(&model_path()).unwrap();
    assert_eq!(g.config.layers, 30);
    assert_eq!(
        (
            g.config.heads,
            g.config.kv_heads,
            g.config.head_dim,
            g.config.vocab
        ),
        (9, 3, 64, 49152)
    );
    let tk = ModelTokenizer::from_gguf(&g).unwrap();
    let cases: [(&str, &[u32]); 7] = [
        ("Hello world", &[19556, 905]),
        (
            "The year 2024 was great!",
            &[504, 713, 216, 34, 32, 34, 36, 436, 1109, 17],
        ),
        (
            "héllo wörld — ça va?",
            &[
                88, 2756, 31394, 267, 29989, 400, 1841, 5549, 117, 81, 46316, 47,
            ],
        ),
        ("<|im_start|>user\nHi<|im_end|>", &[1, 4093, 198, 26843, 2]),
        (
            "日本語のテキスト",
            &[
                23274, 115, 40993, 179, 120, 248, 26453, 11100, 224, 10391, 251, 10391, 134, 11100,
                226,
            ],
        ),
        ("  two  spaces\ttab", &[216, 827, 216, 5600, 197, 15999]),
        ("can't won't I'm", &[4055, 982, 3763, 982, 339, 5248]),
    ];
    for (s, want) in cases {
        let ids = tk.encode(s).unwrap();
        assert_eq!(ids, want, "{s:?}");
        assert_eq!(tk.decode(&ids).unwrap(), s);
    }
    assert_eq!(tk.stop, vec![2]);
}

#[test]
fn chat_template_from_the_file() {
    let g = Gguf::open(&model_path()).unwrap();
    let t = ChatTemplate::new(g.string("tokenizer.chat_template").unwrap()).unwrap();
    let s = t.render(&[Message::new("user", "Hi")], true).unwrap();
    assert_eq!(
        s,
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    );
    // A chat's ids are the whole text's (markers as tokens), but a control token's text in a
    // message (`<|endoftext|>`, `<repo_name>`: not the template's) is text.
    let tk = strata_model::ModelTokenizer::from_gguf(&g).unwrap();
    assert_eq!(t.encode(&tk, &s).unwrap(), tk.encode_prompt(&s).unwrap());
    for c in ["<|endoftext|>", "<repo_name>", "<file_sep>"] {
        let said = format!("Hi {c} there");
        let s = t.render(&[Message::new("user", &said)], true).unwrap();
        let ids = t.encode(&tk, &s).unwrap();
        let one = tk.token_to_id(c).unwrap();
        assert!(tk.encode_prompt(&s).unwrap().contains(&one), "{c}");
        assert!(!ids.contains(&one), "{c}: {ids:?}");
        assert!(tk.decode(&ids).unwrap().contains(&said), "{c}");
    }
}

fn greedy(
    m: &Model,
    pool: &DevicePool,
    prompt: &[u32],
    cached: usize,
    pages: &[u32],
    n: usize,
    stop: &[u32],
) -> Vec<u32> {
    let mut logits = m
        .forward_one(pool, &prompt[cached..], cached, pages, false)
        .unwrap();
    let mut out = Vec::new();
    for i in 0..n {
        let t = logits
            .iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .unwrap()
            .0 as u32;
        if stop.contains(&t) {
            break;
        }
        out.push(t);
        logits = m
            .forward_one(pool, &[t], prompt.len() + i, pages, false)
            .unwrap();
    }
    out
}

/// "What is the capital of France?" in the file's chat template, as token ids.
fn capital_question(g: &Gguf, tk: &ModelTokenizer) -> Vec<u32> {
    let t = ChatTemplate::new(g.string("tokenizer.chat_template").unwrap()).unwrap();
    let text = t
        .render(
            &[Message::new("user", "What is the capital of France?")],
            true,
        )
        .unwrap();
    tk.encode(&text).unwrap()
}

/// A simple chat question gets a sensible answer; a cached prefix (system prompt and question,
/// computed earlier into other pages) gives the identical greedy answer.
#[test]
fn answers_a_simple_question_with_and_without_cached_prefix() {
    let (g, m, tk) = load();
    let p = capital_question(&g, &tk);
    let layout = Arc::new(PageLayout::new(16, vec![m.pool_kind()]).unwrap());
    let pool = DevicePool::new(layout, 32, &HeapAllocator).unwrap();
    let a: Vec<u32> = (0..8).collect();
    let answer = greedy(&m, &pool, &p, 0, &a, 24, &tk.stop);
    let s = tk.decode(&answer).unwrap();
    assert!(s.contains("Paris"), "answer: {s}");
    // The first 21 tokens (off a page boundary) computed earlier, in other pages.
    let b: Vec<u32> = (16..24).collect();
    m.forward_one(&pool, &p[..21], 0, &b, false).unwrap();
    assert_eq!(greedy(&m, &pool, &p, 21, &b, 24, &tk.stop), answer);
}

/// Logits in one pass versus cached prefix + rest, f32 weights throughout.
#[test]
fn cache_equivalence_on_the_real_model() {
    let (_g, mut m, tk) = load();
    m.set_quantized_decode(false);
    let p = tk.encode("In 1969, the first humans walked on the Moon. The mission was called Apollo 11, and the astronauts were").unwrap();
    let layout = Arc::new(PageLayout::new(16, vec![m.pool_kind()]).unwrap());
    let pool = DevicePool::new(layout, 16, &HeapAllocator).unwrap();
    let a: Vec<u32> = (0..4).collect();
    let full = m.forward_one(&pool, &p, 0, &a, true).unwrap();
    let vocab = m.config.vocab;
    for prefix in [16, 13] {
        let b: Vec<u32> = (8..12).collect();
        m.forward_one(&pool, &p[..prefix], 0, &b, false).unwrap();
        let rest = m
            .forward_one(&pool, &p[prefix..], prefix, &b, true)
            .unwrap();
        let d = full[prefix * vocab..]
            .iter()
            .zip(&rest)
            .map(|(x, y)| (x - y).abs() / x.abs().max(1.0))
            .fold(0f32, f32::max);
        assert!(d < 5e-4, "prefix {prefix}: max relative diff {d}");
    }
}

/// The logits of every step of `answer` after `prompt` (teacher-forced), through the runtime
/// trait (one rank or several).
fn logits_along(m: &dyn Runtime, prompt: &[u32], answer: &[u32]) -> Vec<Vec<f32>> {
    let layout = PageLayout::new(16, m.pool_kinds(16).unwrap()).unwrap();
    let pool = DevicePool::new(Arc::new(layout), 8, &HeapAllocator).unwrap();
    let pages: Vec<u32> = (0..8).collect();
    let step = |toks: &[u32], pos: usize| {
        let seq = SeqInput {
            tokens: toks,
            pos,
            pages: &pages,
            windows: &[],
            decode: pos > 0,
        };
        m.forward_rows(&pool, &[seq], &[false]).unwrap().remove(0)
    };
    let mut out = vec![step(prompt, 0)];
    for (i, t) in answer
        .iter()
        .enumerate()
        .take(answer.len().saturating_sub(1))
    {
        out.push(step(std::slice::from_ref(t), prompt.len() + i));
    }
    out
}

fn top2(l: &[f32]) -> (u32, f32) {
    let mut idx: Vec<usize> = (0..l.len()).collect();
    idx.select_nth_unstable_by(1, |a, b| l[*b].total_cmp(&l[*a]));
    let (a, b) = if l[idx[0]] >= l[idx[1]] {
        (idx[0], idx[1])
    } else {
        (idx[1], idx[0])
    };
    (a as u32, l[a] - l[b])
}

fn max_abs_diff(a: &[Vec<Vec<f32>>], b: &[Vec<Vec<f32>>]) -> f32 {
    let rows = a.iter().flatten().zip(b.iter().flatten());
    rows.flat_map(|(x, y)| x.iter().zip(y).map(|(p, q)| (p - q).abs()))
        .fold(0f32, f32::max)
}

/// SmolLM2's 9 heads and 3 KV heads over 2 ranks (KV heads 0–1 | 2) and over 4 (KV heads
/// 0 | 0 | 1 | 2, the first replicated), along one rank's greedy answers (teacher-forced: a
/// flipped near tie would change every later step):
/// * f32 decode rows: every step's argmax is one rank's; logits agree to rounding (partial
///   sums added in another order, K/V rounded to f16);
/// * quantized decode rows (the default): 8-bit activations turn those rounding differences
///   into whole quantization steps: the logits differ by less than twice one rank's own
///   quantized-vs-f32 difference (two roundings of that size), and an argmax differs only where one rank's
///   top two are closer than that difference.
#[test]
fn tp_ranks_answer_as_one_rank_on_smollm2() {
    let g = Gguf::open(&model_path()).unwrap();
    let tk = ModelTokenizer::from_gguf(&g).unwrap();
    let t = ChatTemplate::new(g.string("tokenizer.chat_template").unwrap()).unwrap();
    let prompts: Vec<Vec<u32>> = [
        "What is the capital of France?",
        "Write a haiku about the sea.",
    ]
    .iter()
    .map(|q| {
        let text = t.render(&[Message::new("user", q)], true).unwrap();
        tk.encode(&text).unwrap()
    })
    .collect();
    let load_tp = |tp: usize, quantized_decode: bool| {
        let ranks = if tp == 1 {
            Vec::new()
        } else {
            vec![RankPlacement::default(); tp]
        };
        let opts = LoadOptions {
            ranks,
            quantized_decode,
            ..LoadOptions::new(2 / tp.min(2))
        };
        strata_model::load(&model_path(), opts).unwrap().runtime
    };
    let one_q = load_tp(1, true);
    let mut answers = Vec::new();
    for p in &prompts {
        let mut a: Vec<u32> = Vec::new();
        while a.len() < 20 && !a.last().is_some_and(|t| tk.stop.contains(t)) {
            let l = logits_along(&*one_q, p, &a);
            a.push(top2(l.last().unwrap()).0);
        }
        answers.push(a);
    }
    assert!(tk.decode(&answers[0]).unwrap().contains("Paris"));
    let along = |m: &dyn Runtime| -> Vec<Vec<Vec<f32>>> {
        prompts
            .iter()
            .zip(&answers)
            .map(|(p, a)| logits_along(m, p, a))
            .collect()
    };
    let want_q = along(&*one_q);
    let want_f = along(&*load_tp(1, false));
    let own_noise = max_abs_diff(&want_q, &want_f);
    for (tp, quantized) in [(2, false), (4, false), (2, true), (4, true)] {
        let m = load_tp(tp, quantized);
        assert_eq!(m.pool_kinds(16).unwrap().len(), tp);
        let got = along(&*m);
        let want = if quantized { &want_q } else { &want_f };
        let diff = max_abs_diff(&got, want);
        let bound = if quantized { 2.0 * own_noise } else { 0.1 };
        assert!(
            diff < bound,
            "TP {tp} quantized {quantized}: logits differ by {diff} (bound {bound})"
        );
        let mut flips = 0;
        for (g, w) in got.iter().flatten().zip(want.iter().flatten()) {
            let ((ga, _), (wa, gap)) = (top2(g), top2(w));
            if ga != wa {
                assert!(
                    quantized && gap <= diff,
                    "TP {tp}: argmax {ga} vs {wa}, gap {gap}"
                );
                flips += 1;
            }
        }
        eprintln!(
            "TP {tp} quantized {quantized}: logits within {diff} of TP 1 (TP 1 quantized vs f32: \
             {own_noise}), {flips} near ties flipped"
        );
    }
}

/// SmolLM2 with K/V stored as q8_0 and as fp8_e4m3 (heads of 64 values: two Q8_0 blocks) still
/// answers the question; its pages take the dtype's bytes.
#[test]
fn quantized_kv_answers_on_smollm2() {
    let (g, mut m, tk) = load();
    let p = capital_question(&g, &tk);
    for (dtype, row) in [
        (strata_kv::dtype::Dtype::Q8_0, 3 * 2 * 34),
        (strata_kv::dtype::Dtype::Fp8E4m3, 3 * 64),
    ] {
        m.set_kv_dtype(dtype).unwrap();
        assert_eq!(m.pool_kind().plane_bytes_per_token, row);
        let layout = Arc::new(PageLayout::new(16, vec![m.pool_kind()]).unwrap());
        let pool = DevicePool::new(layout, 8, &HeapAllocator).unwrap();
        let a: Vec<u32> = (0..8).collect();
        let s = tk
            .decode(&greedy(&m, &pool, &p, 0, &a, 24, &tk.stop))
            .unwrap();
        eprintln!("{dtype}: {s}");
        assert!(s.contains("Paris"), "{dtype}: {s}");
    }
}
