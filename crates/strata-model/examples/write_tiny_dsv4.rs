//! Writes the tiny DeepSeek-V4 test model (`TinyDsv4Spec::default()`) to the path given:
//! `cargo run -p strata-model --example write_tiny_dsv4 -- OUT.gguf` (scripts/dsv4/reference.py
//! runs llama.cpp on it).

fn main() {
    let Some(out) = std::env::args().nth(1) else {
        eprintln!("usage: write_tiny_dsv4 OUT.gguf");
        std::process::exit(2);
    };
    let spec = strata_model::tiny_dsv4::TinyDsv4Spec::default();
    if let Err(e) = strata_model::tiny_dsv4::write_tiny_dsv4(std::path::Path::new(&out), &spec) {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}
