//! Writes a tiny test model to the path given: `cargo run -p strata-model --example write_tiny
//! -- ARCH OUT.gguf` with ARCH `llama`, `llama3`, `llama-h32`, `qwen2`, `qwen3`, `mistral`
//! (`TinySpec::family`) or `deepseek4` (`TinyDsv4Spec::default()`), or a tokenizer file
//! `tok-PRE` (PRE: smollm, gpt-2, llama-bpe, qwen2, deepseek-v3, spm); scripts/llamacpp/reference.py and tokens.py run llama.cpp
//! on them.

use std::path::Path;

use strata_model::tiny::deepseek4::{write_tiny_dsv4, TinyDsv4Spec};
use strata_model::tiny::{write_tiny, TinySpec};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [arch, out] = args.as_slice() else {
        eprintln!(
            "usage: write_tiny llama|llama3|llama-h32|qwen2|qwen3|mistral|deepseek4 OUT.gguf"
        );
        std::process::exit(2);
    };
    let out = Path::new(out);
    let r = match (arch.as_str(), TinySpec::family(arch)) {
        ("deepseek4", _) => write_tiny_dsv4(out, &TinyDsv4Spec::default()),
        (_, Some(spec)) => write_tiny(out, &spec),
        (a, None) => {
            eprintln!(
                "unknown architecture `{a}`: llama, llama3, llama-h32, qwen2, qwen3, mistral or deepseek4"
            );
            std::process::exit(2);
        }
    };
    if let Err(e) = r {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}
