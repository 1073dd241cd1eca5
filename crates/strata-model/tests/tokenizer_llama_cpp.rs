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

/// tests/fixtures/tiny_tokens.json: the texts and, per vocabulary, llama.cpp's ids.
fn fixture() -> Value {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/tiny_tokens.json"
    ))
    .unwrap();
    serde_json::from_str(&text).unwrap()
}

fn texts(f: &Value) -> Vec<&str> {
    let all = f["texts"].as_array().unwrap();
    all.iter().map(|t| t.as_str().unwrap()).collect()
}

#[test]
fn token_ids_equal_llama_cpps_for_every_pre_tokenizer() {
    let f = fixture();
    let texts = texts(&f);
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
            let mut llama = ids(&want["special"]);
            if tk.add_bos && llama.len() > 1 && llama[0] == llama[1] {
                // A text that starts with BOS's text: llama.cpp adds a second BOS (and warns),
                // Strata does not (`encode_prompt`).
                llama.remove(0);
            }
            assert_eq!(prompt, llama, "{pre}: prompt {t:?}");
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

/// A chat's text is tokenized with the template's turn markers as their tokens and every other
/// special token as text: llama.cpp's ids with `parse_special = false` (the fixture's "text"),
/// for texts without special tokens the same as with it, and a rendered chat's ids are those of the whole text tokenized with specials;
/// a control token's text in a message (`<|endoftext|>`, BOS's and EOS's texts) becomes the
/// ids of its characters, never the control token, and reads back as the same text.
#[test]
fn chat_content_special_tokens_are_text_for_every_vocabulary() {
    use strata_model::tiny::TINY_TEMPLATE;
    use strata_model::{ChatTemplate, Message};
    let f = fixture();
    let texts = texts(&f);
    let tpl = ChatTemplate::new(TINY_TEMPLATE).unwrap();
    let d = tempfile::tempdir().unwrap();
    for (pre, file) in f["files"].as_object().unwrap() {
        let path = d.path().join(format!("{pre}.gguf"));
        write_tiny(&path, &TinySpec::family(&format!("tok-{pre}")).unwrap()).unwrap();
        let tk = ModelTokenizer::from_gguf(&GgufHeader::open(&path).unwrap()).unwrap();
        let marker = |t: &str| tk.control_texts().iter().any(|c| t.contains(c.as_str()));
        for (t, want) in texts.iter().zip(file["ids"].as_array().unwrap()) {
            // llama.cpp's ids with `parse_special = false`: control tokens written in the text
            // are their characters (the same as with it where the text has none).
            let got = tk.encode_text(t).unwrap();
            assert_eq!(got, ids(&want["text"]), "{pre}: {t:?}");
            if !marker(t) {
                assert_eq!(got, ids(&want["plain"]), "{pre}: {t:?}");
            }
        }
        let plain: Vec<&str> = texts.iter().copied().filter(|t| !marker(t)).collect();
        let chat: Vec<Message> = plain
            .iter()
            .enumerate()
            .map(|(i, t)| Message::new(["system", "user", "assistant"][i % 3], t))
            .collect();
        let rendered = tpl.render(&chat, true).unwrap();
        let want = tk.encode_prompt(&rendered).unwrap();
        assert_eq!(tpl.encode(&tk, &rendered).unwrap(), want, "{pre}");
        // Every control token's text that is not one of the template's markers, in a message.
        let foreign: Vec<&String> = tk
            .control_texts()
            .iter()
            .filter(|c| !TINY_TEMPLATE.contains(c.as_str()))
            .collect();
        assert!(!foreign.is_empty(), "{pre}: no control token to write");
        let controls = |ids: &[u32]| ids.iter().filter(|&&id| tk.is_control(id)).count();
        let bare = tpl
            .render(&[Message::new("user", "say  now")], true)
            .unwrap();
        let turns = controls(&tpl.encode(&tk, &bare).unwrap());
        assert!(turns >= 2, "{pre}: {turns} markers");
        for c in foreign {
            let said = format!("say {c} now");
            let msgs = [Message::new("user", &said)];
            let rendered = tpl.render(&msgs, true).unwrap();
            let got = tpl.encode(&tk, &rendered).unwrap();
            assert_eq!(controls(&got), turns, "{pre}: {c} in {got:?}");
            assert_ne!(got, tk.encode_prompt(&rendered).unwrap(), "{pre}: {c}");
            let body = tk.encode_text(&said).unwrap();
            assert!(body.iter().all(|&id| !tk.is_control(id)), "{pre}: {c}");
            assert_eq!(tk.decode(&body).unwrap().trim_start(), said, "{pre}: {c}");
        }
    }
}

/// A template that builds its markers as it renders (`'<|im_' + 'start|>'`, as Phi's
/// `'<|' + role + '|>'` does) has them found by rendering: the chat's ids are still the whole
/// text's, and a message writing one is refused. A user-defined token is its id wherever it is
/// written (llama.cpp's rule), and never a marker.
#[test]
fn built_markers_and_user_defined_tokens() {
    use candle_core::quantized::gguf_file::Value as G;
    use strata_model::{ChatTemplate, Message};
    let d = tempfile::tempdir().unwrap();
    let path = d.path().join("m.gguf");
    write_tiny(&path, &TinySpec::family("tok-smollm").unwrap()).unwrap();
    let mut g = GgufHeader::open(&path).unwrap();
    let built = "{% for m in messages %}{{ '<|im_' + 'start|>' + m['role'] + '\n' + m['content'] + '<|im_' + 'end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_' + 'start|>assistant\n' }}{% endif %}";
    let tk = ModelTokenizer::from_gguf(&g).unwrap();
    let tpl = ChatTemplate::new(built).unwrap();
    assert!(!built.contains("<|im_start|>"));
    let s = tpl
        .render(
            &[
                Message::new("system", "Be brief."),
                Message::new("user", "hi"),
            ],
            true,
        )
        .unwrap();
    assert_eq!(tpl.encode(&tk, &s).unwrap(), tk.encode_prompt(&s).unwrap());
    assert_eq!(
        tpl.turn_marker_in(&tk, "a<|im_start|>b"),
        Some("<|im_start|>")
    );
    // One unused token made user-defined.
    let G::Array(types) = g.metadata.get_mut("tokenizer.ggml.token_type").unwrap() else {
        panic!("token types")
    };
    let last = types.len() - 1;
    types[last] = G::I32(4);
    let tk = ModelTokenizer::from_gguf(&g).unwrap();
    let ud = tk.user_defined_texts()[0].clone();
    let id = tk.token_to_id(&ud).unwrap();
    let plain = ChatTemplate::new(strata_model::tiny::TINY_TEMPLATE).unwrap();
    let said = format!("a {ud} b");
    let s = plain.render(&[Message::new("user", &said)], true).unwrap();
    let ids = plain.encode(&tk, &s).unwrap();
    assert!(ids.contains(&id), "{ids:?}");
    assert_eq!(plain.turn_marker_in(&tk, &said), None);
    // Not a marker even where the template writes it (the server writes such tokens in
    // messages itself: a Qwen vocabulary's `<tool_call>`), still its id.
    let writes = format!("{}{{{{ '{ud}' }}}}", strata_model::tiny::TINY_TEMPLATE);
    let writes = ChatTemplate::new(&writes).unwrap();
    assert_eq!(writes.turn_marker_in(&tk, &said), None);
    let s = writes.render(&[Message::new("user", &said)], true).unwrap();
    let ids = writes.encode(&tk, &s).unwrap();
    assert_eq!(ids.iter().filter(|&&t| t == id).count(), 2, "{ids:?}");
}
