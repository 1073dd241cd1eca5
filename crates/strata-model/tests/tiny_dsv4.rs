//! The tiny DeepSeek-V4 model and llama.cpp's reference logits for it
//! (tests/fixtures/tiny_dsv4_logits.json, written by scripts/llamacpp/reference.py): the generator
//! still writes exactly the file the fixture was computed on, and the fixture holds, for every
//! prompt, the argmax of each position, whole logits at the window and block boundaries and
//! greedy decode steps. (The forward pass of this architecture is compared with it once it
//! exists; until then this keeps the fixture and the generator from drifting apart.)

use serde_json::Value;
use sha2::{Digest, Sha256};
use strata_model::tiny::deepseek4::{write_tiny_dsv4, TinyDsv4Spec};

fn fixture() -> Value {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/tiny_dsv4_logits.json"
    ))
    .unwrap();
    serde_json::from_str(&text).unwrap()
}

#[test]
fn the_generator_writes_the_file_llama_cpp_scored() {
    let d = tempfile::tempdir().unwrap();
    let path = d.path().join("tiny-dsv4.gguf");
    write_tiny_dsv4(&path, &TinyDsv4Spec::default()).unwrap();
    let sha = Sha256::digest(std::fs::read(&path).unwrap());
    let hex: String = sha.iter().map(|b| format!("{b:02x}")).collect();
    let f = fixture();
    assert_eq!(
        f["model_sha256"], hex,
        "the generator changed: rerun scripts/llamacpp/reference.py"
    );
    assert!(f["llama_cpp"]["commit"].as_str().unwrap().len() >= 7);
}

#[test]
fn the_fixture_covers_every_boundary_with_whole_rows() {
    let f = fixture();
    let prompts = f["prompts"].as_array().unwrap();
    let lens: Vec<usize> = prompts
        .iter()
        .map(|p| p["tokens"].as_array().unwrap().len())
        .collect();
    // Before and past the 32-token window, the 4- and the 128-token blocks, two 128-blocks.
    assert!(
        lens.contains(&1) && lens.iter().any(|&n| n > 256),
        "{lens:?}"
    );
    for p in prompts {
        let n = p["tokens"].as_array().unwrap().len();
        assert_eq!(p["argmax"].as_array().unwrap().len(), n);
        let rows = p["logits"].as_object().unwrap();
        assert!(rows.contains_key(&(n - 1).to_string()), "the last position");
        for row in rows.values() {
            assert_eq!(row.as_array().unwrap().len(), 288);
        }
        let decode = p["decode"].as_array().unwrap();
        assert!(!decode.is_empty());
        // Greedy: each step feeds the argmax of the logits before it.
        let last = &p["argmax"][n - 1];
        assert_eq!(&decode[0]["token"], last);
    }
}
