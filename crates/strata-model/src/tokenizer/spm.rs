//! SentencePiece vocabularies as GGUF stores them (`tokenizer.ggml.model = llama`: Llama 2,
//! Mistral, and other SPM models): pieces with scores, `▁` for a space, `<0xXX>` byte tokens
//! for what no piece covers, no merge list. llama.cpp's SPM tokenizer starts from the text's
//! characters (a space first, with `add_space_prefix`, and after every special token; spaces
//! as `▁`) and keeps merging the adjacent pair whose concatenation is a piece, the highest
//! scored first; characters no piece covers become their bytes' tokens. Here that is a BPE
//! model whose merges are every split of every piece into two pieces, ranked by the piece's
//! score: the same merges in the same order (on equal scores llama.cpp takes the leftmost
//! pair, BPE the earlier-listed piece; real vocabularies' scores are distinct).

use std::collections::HashMap;

use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as Decoders;
use tokenizers::decoders::strip::Strip;
use tokenizers::models::bpe::BPE;
use tokenizers::normalizers::utils::Sequence as Normalizers;
use tokenizers::normalizers::{Prepend, Replace};
use tokenizers::{DecoderWrapper, NormalizerWrapper, Tokenizer};

use crate::error::ModelError;

/// A space in a piece.
pub(crate) const SPACE: &str = "\u{2581}";
/// GGUF token types that never come out of a merge: unknown, control, user-defined and byte
/// tokens.
const TOKEN_TYPE_NORMAL: i32 = 1;
const TOKEN_TYPE_UNKNOWN: i32 = 2;
const TOKEN_TYPE_CONTROL: i32 = 3;
const TOKEN_TYPE_USER_DEFINED: i32 = 4;
const TOKEN_TYPE_BYTE: i32 = 6;

fn err(e: impl std::fmt::Display) -> ModelError {
    ModelError::Tokenizer(e.to_string())
}

/// Longest piece read (bytes): real vocabularies' pieces are a few dozen; longer ones would
/// make the merge list's construction quadratic in them.
const MAX_PIECE: usize = 256;
/// Most merges per token (real vocabularies: one to three).
const MAX_MERGES_PER_TOKEN: usize = 32;

/// Every split of a piece into two pieces, as merges ranked by the piece's score (highest
/// first; equal scores in vocabulary order). Refuses pieces past [`MAX_PIECE`], a merge list
/// past [`MAX_MERGES_PER_TOKEN`] per token, and a piece with a character no piece is (llama.cpp
/// could still merge such a character; a BPE takes its bytes at once).
fn merges(
    tokens: &[String],
    scores: &[f32],
    types: &[i32],
) -> Result<Vec<(String, String)>, ModelError> {
    let ids: HashMap<&str, usize> = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.as_str(), i))
        .collect();
    let mut out: Vec<(f32, usize, String, String)> = Vec::new();
    for (i, t) in tokens.iter().enumerate() {
        // Special pieces are split off a text before the merges (or, where special tokens
        // are text, must never come out of them: a message's `</s>` stays its characters).
        if matches!(
            types.get(i),
            Some(
                &TOKEN_TYPE_UNKNOWN
                    | &TOKEN_TYPE_CONTROL
                    | &TOKEN_TYPE_USER_DEFINED
                    | &TOKEN_TYPE_BYTE
            )
        ) {
            continue;
        }
        if t.len() > MAX_PIECE {
            return Err(err(format!(
                "piece {i} is {} bytes long (at most {MAX_PIECE} are read)",
                t.len()
            )));
        }
        if types.get(i) == Some(&TOKEN_TYPE_NORMAL) && t.chars().nth(1).is_some() {
            let mut buf = [0u8; 4];
            if let Some(c) = t
                .chars()
                .find(|c| !ids.contains_key(&*c.encode_utf8(&mut buf)))
            {
                return Err(err(format!(
                    "piece {i} `{t}` has a character no piece is (`{c}`): not a SentencePiece \
                     vocabulary this tokenizer reads"
                )));
            }
        }
        for (at, _) in t.char_indices().skip(1) {
            let (a, b) = t.split_at(at);
            if ids.contains_key(a) && ids.contains_key(b) {
                out.push((scores[i], i, a.to_string(), b.to_string()));
            }
        }
        if out.len() > MAX_MERGES_PER_TOKEN * tokens.len() {
            return Err(err(format!(
                "more than {MAX_MERGES_PER_TOKEN} merges per token: not a SentencePiece vocabulary"
            )));
        }
    }
    out.sort_by(|x, y| {
        y.0.partial_cmp(&x.0)
            .unwrap_or(std::cmp::Ordering::Equal)
            .then(x.1.cmp(&y.1))
    });
    Ok(out.into_iter().map(|(_, _, a, b)| (a, b)).collect())
}

/// The tokenizer of an SPM vocabulary, and (with `add_space_prefix`) the same without the
/// space before a text, for output fragments (special tokens are added by the caller).
pub(crate) fn spm_tokenizers(
    tokens: &[String],
    scores: &[f32],
    types: &[i32],
    add_space_prefix: bool,
    unk: Option<&str>,
) -> Result<(Tokenizer, Option<Tokenizer>), ModelError> {
    if scores.len() != tokens.len() {
        return Err(err(format!(
            "tokenizer.ggml.scores has {} entries for {} tokens",
            scores.len(),
            tokens.len()
        )));
    }
    let vocab: tokenizers::models::bpe::Vocab = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), i as u32))
        .collect();
    let merges = merges(tokens, scores, types)?;
    let build = |prefix: bool| -> Result<Tokenizer, ModelError> {
        let mut b = BPE::builder()
            .vocab_and_merges(vocab.clone(), merges.clone())
            .byte_fallback(true);
        if let Some(u) = unk {
            b = b.unk_token(u.to_string());
        }
        let mut tk = Tokenizer::new(b.build().map_err(err)?);
        let mut norm: Vec<NormalizerWrapper> = Vec::new();
        if prefix {
            norm.push(Prepend::new(SPACE.into()).into());
        }
        norm.push(Replace::new(" ", SPACE).map_err(err)?.into());
        tk.with_normalizer(Some(Normalizers::new(norm)));
        let mut dec: Vec<DecoderWrapper> = vec![
            Replace::new(SPACE, " ").map_err(err)?.into(),
            ByteFallback::new().into(),
            Fuse::new().into(),
        ];
        if prefix {
            dec.push(Strip::new(' ', 1, 0).into());
        }
        tk.with_decoder(Some(Decoders::new(dec)));
        Ok(tk)
    };
    Ok((
        build(add_space_prefix)?,
        add_space_prefix.then(|| build(false)).transpose()?,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merges_are_every_split_ranked_by_score() {
        let t: Vec<String> = ["a", "b", "c", "ab", "bc", "abc"]
            .map(String::from)
            .to_vec();
        let m = merges(&t, &[0.0, 0.0, 0.0, -2.0, -1.0, -3.0], &[1; 6]).unwrap();
        let m: Vec<(&str, &str)> = m.iter().map(|(a, b)| (a.as_str(), b.as_str())).collect();
        assert_eq!(m, [("b", "c"), ("a", "b"), ("a", "bc"), ("ab", "c")]);
    }

    #[test]
    fn hostile_vocabularies_are_refused() {
        let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
        // A character no piece is; a piece past the length read.
        let e = merges(&s(&["a", "ab"]), &[0.0, -1.0], &[1, 1]).unwrap_err();
        assert!(e.to_string().contains("no piece is (`b`)"), "{e}");
        let long = "a".repeat(MAX_PIECE + 1);
        let e = merges(&s(&["a", &long]), &[0.0, -1.0], &[1, 1]).unwrap_err();
        assert!(e.to_string().contains("bytes long"), "{e}");
        // Runs of one character, every split valid: bounded, then refused.
        let runs: Vec<String> = (1..=200).map(|n| "a".repeat(n)).collect();
        let e = merges(&runs, &vec![0.0; 200], &vec![1; 200]).unwrap_err();
        assert!(e.to_string().contains("merges per token"), "{e}");
    }
}
