//! Writes a tiny test model to the path given: `cargo run -p strata-model --example write_tiny
//! -- ARCH OUT.gguf` with ARCH `llama` (`TinySpec::default()`) or `deepseek4`
//! (`TinyDsv4Spec::default()`); scripts/llamacpp/reference.py runs llama.cpp on it.

use std::path::Path;

use strata_model::tiny::{write_tiny, TinySpec};
use strata_model::tiny_dsv4::{write_tiny_dsv4, TinyDsv4Spec};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [arch, out] = args.as_slice() else {
        eprintln!("usage: write_tiny llama|deepseek4 OUT.gguf");
        std::process::exit(2);
    };
    let out = Path::new(out);
    let r = match arch.as_str() {
        "llama" => write_tiny(out, &TinySpec::default()),
        "deepseek4" => write_tiny_dsv4(out, &TinyDsv4Spec::default()),
        a => {
            eprintln!("unknown architecture `{a}`: llama or deepseek4");
            std::process::exit(2);
        }
    };
    if let Err(e) = r {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}
