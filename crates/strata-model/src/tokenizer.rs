//! The tokenizer, built from GGUF metadata: byte-level BPE (`tokenizer.ggml.model = gpt2`) with
//! the vocabulary and merges stored in the file, the `smollm` pre-tokenizer (every digit on its
//! own, then GPT-2's split regex, no prefix space), and control tokens as special tokens.

use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::{AddedToken, Tokenizer};

use crate::error::ModelError;
use crate::gguf::GgufHeader;

/// GGUF token type of control tokens (`<|im_start|>`, `<|endoftext|>`, ...).
const TOKEN_TYPE_CONTROL: i32 = 3;
const TOKEN_TYPE_USER_DEFINED: i32 = 4;

/// A tokenizer plus the ids the engine needs.
pub struct ModelTokenizer {
    pub inner: Tokenizer,
    pub bos: Option<u32>,
    pub eos: u32,
    /// Tokens that end a generation (eos and, for chat models, `<|im_end|>`).
    pub stop: Vec<u32>,
}

fn err(e: impl std::fmt::Display) -> ModelError {
    ModelError::Tokenizer(e.to_string())
}

impl ModelTokenizer {
    pub fn from_gguf(g: &GgufHeader) -> Result<ModelTokenizer, ModelError> {
        let model = g.string("tokenizer.ggml.model").unwrap_or("");
        if model != "gpt2" {
            return Err(err(format!(
                "tokenizer.ggml.model `{model}` is not supported (expected gpt2 byte-level BPE)"
            )));
        }
        let pre = g.string("tokenizer.ggml.pre").unwrap_or("default");
        let tokens: Vec<String> = g
            .array("tokenizer.ggml.tokens")?
            .iter()
            .map(|v| v.to_string().cloned().map_err(err))
            .collect::<Result<_, _>>()?;
        let merges: Vec<(String, String)> = g
            .array("tokenizer.ggml.merges")?
            .iter()
            .map(|v| {
                let s = v.to_string().map_err(err)?;
                let (a, b) = s
                    .split_once(' ')
                    .ok_or_else(|| err(format!("merge `{s}` is not two tokens")))?;
                Ok((a.to_string(), b.to_string()))
            })
            .collect::<Result<_, ModelError>>()?;
        let types: Vec<i32> = match g.array("tokenizer.ggml.token_type") {
            Ok(v) => v.iter().map(|x| x.to_i32().unwrap_or(1)).collect(),
            Err(_) => vec![1; tokens.len()],
        };
        let vocab: tokenizers::models::bpe::Vocab = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.clone(), i as u32))
            .collect();
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .build()
            .map_err(err)?;
        let mut tk = Tokenizer::new(bpe);
        let pretok: Vec<PreTokenizerWrapper> = match pre {
            // SmolLM / StarCoder: digits one by one, then the GPT-2 regex.
            "smollm" | "starcoder" | "refact" | "codeshell" => vec![
                Digits::new(true).into(),
                ByteLevel::new(false, true, true).into(),
            ],
            "default" | "gpt2" | "gpt-2" => vec![ByteLevel::new(false, true, true).into()],
            other => {
                return Err(err(format!(
                    "pre-tokenizer `{other}` is not supported (smollm, starcoder, gpt2)"
                )))
            }
        };
        tk.with_pre_tokenizer(Some(Sequence::new(pretok)));
        tk.with_decoder(Some(ByteLevelDecoder::default()));
        let specials: Vec<AddedToken> = tokens
            .iter()
            .zip(&types)
            .filter(|(_, &t)| t == TOKEN_TYPE_CONTROL || t == TOKEN_TYPE_USER_DEFINED)
            .map(|(s, _)| AddedToken::from(s.clone(), true))
            .collect();
        tk.add_special_tokens(&specials);
        let eos = g
            .u32("tokenizer.ggml.eos_token_id")
            .ok_or_else(|| err("tokenizer.ggml.eos_token_id missing"))?;
        let bos = g.u32("tokenizer.ggml.bos_token_id");
        let mut stop = vec![eos];
        if let Some(id) = tk.token_to_id("<|im_end|>") {
            if id != eos {
                stop.push(id);
            }
        }
        Ok(ModelTokenizer {
            inner: tk,
            bos,
            eos,
            stop,
        })
    }

    /// Token ids of `text`; special tokens written in the text are recognised.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, ModelError> {
        Ok(self
            .inner
            .encode(text, false)
            .map_err(err)?
            .get_ids()
            .to_vec())
    }

    /// Text of `ids` (special tokens included).
    pub fn decode(&self, ids: &[u32]) -> Result<String, ModelError> {
        self.inner.decode(ids, false).map_err(err)
    }

    pub fn token_to_id(&self, t: &str) -> Option<u32> {
        self.inner.token_to_id(t)
    }
}
