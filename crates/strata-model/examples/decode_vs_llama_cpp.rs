//! SmolLM2's decode-step logits next to llama.cpp's on the same file and tokens: the check
//! behind docs/BENCHMARKS.md's "Decode logits next to llama.cpp". Run by
//! `scripts/llamacpp/decode_logits.sh` (which builds `scripts/llamacpp/logits.c` against a
//! local llama.cpp):
//!
//! * `decode_vs_llama_cpp model` prints the model's path (`strata model fetch` puts it there);
//! * `decode_vs_llama_cpp prompts` prints the prompts (four chat questions, templated) as the
//!   TSV `logits.c` reads, each with 24 greedy decode steps;
//! * `decode_vs_llama_cpp compare OUT.jsonl [f32-decode]` replays llama.cpp's decode tokens
//!   (teacher-forced) and prints how often the argmax agrees and how far the logits are.
use std::sync::Arc;
use strata_kv::memory::HeapAllocator;
use strata_kv::pool::DevicePool;
use strata_kv::PageLayout;
use strata_model::fetch::{cache_dir, MODEL_FILE};
use strata_model::*;

const QUESTIONS: [&str; 4] = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "List three prime numbers.",
];

fn argmax(l: &[f32]) -> usize {
    l.iter()
        .enumerate()
        .max_by(|a, b| a.1.total_cmp(b.1))
        .map_or(0, |x| x.0)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let path = cache_dir().join(MODEL_FILE);
    let g = Gguf::open(&path).expect("the reference model: run `strata model fetch`");
    let tk = ModelTokenizer::from_gguf(&g).unwrap();
    let t = ChatTemplate::new(g.string("tokenizer.chat_template").unwrap()).unwrap();
    let prompts: Vec<Vec<u32>> = QUESTIONS
        .iter()
        .map(|q| {
            let text = t.render(&[Message::new("user", q)], true).unwrap();
            tk.encode(&text).unwrap()
        })
        .collect();
    match args.get(1).map(String::as_str) {
        Some("model") => println!("{}", path.display()),
        Some("prompts") => {
            for (i, p) in prompts.iter().enumerate() {
                let ids: Vec<String> = p.iter().map(|x| x.to_string()).collect();
                println!("p{i}\t{}\t24\t{}", p.len() - 1, ids.join(" "));
            }
        }
        Some("compare") => {
            let f32_decode = args.get(3).is_some_and(|a| a == "f32-decode");
            let opts = LoadOptions {
                quantized_decode: !f32_decode,
                ..LoadOptions::new(2)
            };
            let m = strata_model::load(&path, opts).unwrap().runtime;
            let text = std::fs::read_to_string(&args[2]).unwrap();
            compare(&*m, &prompts, &text, f32_decode);
        }
        _ => {
            eprintln!("usage: decode_vs_llama_cpp model | prompts | compare OUT.jsonl [f32-decode]")
        }
    }
}

fn compare(m: &dyn Runtime, prompts: &[Vec<u32>], text: &str, f32_decode: bool) {
    let (mut max, mut sum, mut n, mut agree, mut steps) = (0f32, 0f64, 0usize, 0, 0);
    for (line, p) in text.lines().zip(prompts) {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
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
        step(p, 0);
        for (s, d) in v["decode"].as_array().unwrap().iter().enumerate() {
            let tok = d["token"].as_u64().unwrap() as u32;
            let want: Vec<f32> = d["logits"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap() as f32)
                .collect();
            let got = step(&[tok], p.len() + s);
            agree += usize::from(argmax(&got) == argmax(&want));
            steps += 1;
            for (a, b) in got.iter().zip(&want) {
                max = max.max((a - b).abs());
                sum += f64::from((a - b).abs());
                n += 1;
            }
        }
    }
    let mode = if f32_decode {
        "f32 activations"
    } else {
        "8-bit activations"
    };
    println!(
        "decode rows with {mode}: {steps} steps, argmax as llama.cpp's in {agree}, logits within {max:.3} (mean {:.4})",
        sum / n.max(1) as f64
    );
}
