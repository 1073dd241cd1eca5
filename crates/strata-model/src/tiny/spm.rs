//! The tiny SentencePiece vocabulary (`tokenizer.ggml.model = llama`, as Llama 2 and Mistral
//! files have): `<unk>`, `<s>`, `</s>`, the 256 byte tokens, single characters, pieces that
//! merge into words, digit runs and runs of `▁`, and the ChatML control tokens. Newlines,
//! tabs and non-ASCII characters have no piece: they come out as byte tokens.

use crate::tokenizer::spm::SPACE;
use candle_core::quantized::gguf_file::Value;

/// Tokens, their scores and GGUF token types.
pub(crate) struct SpmVocab {
    pub(crate) tokens: Vec<String>,
    scores: Vec<f32>,
    types: Vec<i32>,
}

/// Pieces of two or more characters, best first (each is two shorter pieces).
const PIECES: [&str; 40] = [
    "_t", "he", "_the", "ll", "llo", "_he", "_hello", "_w", "or", "_wor", "ld", "_world", "12",
    "123", "_1", "__", "____", "'s", "it", "_it", "an", "nd", "_an", "_and", "!!", "_H", "He",
    "ok", "_ok", "at", "wh", "_wh", "_what", "_x", "_y", "va", "_va", "_T", "TH", "EY",
];

pub(crate) fn spm_vocab() -> SpmVocab {
    let mut v = SpmVocab {
        tokens: Vec::new(),
        scores: Vec::new(),
        types: Vec::new(),
    };
    let push = |v: &mut SpmVocab, t: String, score: f32, ty: i32| {
        v.tokens.push(t);
        v.scores.push(score);
        v.types.push(ty);
    };
    push(&mut v, "<unk>".into(), 0.0, 2);
    push(&mut v, "<s>".into(), 0.0, 3);
    push(&mut v, "</s>".into(), 0.0, 3);
    for b in 0..=255u8 {
        push(&mut v, format!("<0x{b:02X}>"), 0.0, 6);
    }
    let chars = "_abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789!'=+;?.,-()<>|:";
    for (i, c) in chars.chars().enumerate() {
        let c = if c == '_' {
            SPACE.to_string()
        } else {
            c.to_string()
        };
        push(&mut v, c, -1000.0 - i as f32, 1);
    }
    for (i, p) in PIECES.iter().enumerate() {
        push(&mut v, p.replace('_', SPACE), -1.0 - i as f32, 1);
    }
    for s in ["<|im_start|>", "<|im_end|>"] {
        push(&mut v, s.into(), 0.0, 3);
    }
    v
}

/// Its GGUF metadata (the chat template aside).
pub(crate) fn spm_metadata(v: &SpmVocab) -> Vec<(&'static str, Value)> {
    vec![
        ("tokenizer.ggml.model", Value::String("llama".into())),
        (
            "tokenizer.ggml.tokens",
            Value::Array(v.tokens.iter().map(|t| Value::String(t.clone())).collect()),
        ),
        (
            "tokenizer.ggml.scores",
            Value::Array(v.scores.iter().map(|&s| Value::F32(s)).collect()),
        ),
        (
            "tokenizer.ggml.token_type",
            Value::Array(v.types.iter().map(|&t| Value::I32(t)).collect()),
        ),
        ("tokenizer.ggml.unknown_token_id", Value::U32(0)),
        ("tokenizer.ggml.bos_token_id", Value::U32(1)),
        ("tokenizer.ggml.eos_token_id", Value::U32(2)),
        ("tokenizer.ggml.add_space_prefix", Value::Bool(true)),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_piece_is_two_shorter_pieces() {
        let v = spm_vocab();
        for p in PIECES {
            let p = p.replace('_', SPACE);
            let two = p.char_indices().skip(1).any(|(at, _)| {
                let (a, b) = p.split_at(at);
                v.tokens.iter().any(|t| t == a) && v.tokens.iter().any(|t| t == b)
            });
            assert!(two, "{p}");
        }
    }
}
