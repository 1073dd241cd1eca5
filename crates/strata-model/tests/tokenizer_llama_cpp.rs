//! Strata's tokenizer against llama.cpp's token ids (tests/fixtures/tiny_tokens.json, written by
//! scripts/llamacpp/tokens.py with the llama.cpp version recorded) for every pre-tokenizer it
//! reads (smollm, gpt-2, llama-bpe, qwen2, deepseek-v3) and for a SentencePiece vocabulary
//! (`spm`: Llama 2, Mistral): tiny files with merges that make the splits show (digit runs,
//! contractions, runs of spaces and newlines; pieces with scores and byte fallback), texts with
//! non-ASCII letters, CJK, a special token; with and without the BOS token the vocabulary adds.

use serde_json::Value;
use sha2::{Digest, Sha256};
use strata_model::tiny::{write_tiny, TinySpec};
use strata_model::{GgufHeader, ModelTokenizer};

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

#[test]
fn token_ids_equal_llama_cpps_for_every_pre_tokenizer() {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/tiny_tokens.json"
    ))
    .unwrap();
    let f: Value = serde_json::from_str(&text).unwrap();
    let texts: Vec<&str> = f["texts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_str().unwrap())
        .collect();
    let d = tempfile::tempdir().unwrap();
    let files = f["files"].as_object().unwrap();
    assert_eq!(files.len(), 6);
    for (pre, file) in files {
        let path = d.path().join(format!("{pre}.gguf"));
        write_tiny(&path, &TinySpec::family(&format!("tok-{pre}")).unwrap()).unwrap();
        let sha = Sha256::digest(std::fs::read(&path).unwrap());
        let hex: String = sha.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(
            file["model_sha256"], hex,
            "{pre}: rerun scripts/llamacpp/tokens.py"
        );
        let tk = ModelTokenizer::from_gguf(&GgufHeader::open(&path).unwrap()).unwrap();
        for (t, want) in texts.iter().zip(file["ids"].as_array().unwrap()) {
            // Text as it is: llama.cpp's ids without specials added; a prompt: with them (BOS
            // exactly where the vocabulary adds one).
            assert_eq!(tk.encode(t).unwrap(), ids(&want["plain"]), "{pre}: {t:?}");
            // The bound a prompt is refused by before tokenizing never exceeds the count.
            let text_twice = t.repeat(2);
            for x in [*t, &text_twice] {
                let n = tk.encode(x).unwrap().len();
                assert!(tk.fewest_tokens(x) <= n, "{pre}: {x:?} has {n} tokens");
            }
            let prompt = tk.encode_prompt(t).unwrap();
            assert_eq!(prompt, ids(&want["special"]), "{pre}: prompt {t:?}");
        }
        // Llama 3 and SentencePiece vocabularies add BOS; the others do not.
        assert_eq!(tk.add_bos, pre == "llama-bpe" || pre == "spm", "{pre}");
        if tk.add_bos {
            // A prompt that starts with BOS's own text (as chat templates write it) gets one.
            let bos = tk.bos.unwrap();
            let text = format!("{}hi", tk.inner.id_to_token(bos).unwrap());
            let p = tk.encode_prompt(&text).unwrap();
            assert_eq!(p[0], bos);
            assert_eq!(p.iter().filter(|&&t| t == bos).count(), 1, "{p:?}");
        }
    }
}
