//! The tokenizer, built from GGUF metadata: byte-level BPE (`tokenizer.ggml.model = gpt2`) with
//! the vocabulary and merges stored in the file, the pre-tokenizer `tokenizer.ggml.pre` names
//! (llama.cpp's split regexes: `smollm` (every digit on its own, then GPT-2's), `gpt2`,
//! `llama-bpe` (Llama 3: digits in threes, whole pre-tokens found in the vocabulary taken as
//! they are, a BOS token first), `qwen2`, `deepseek-v3`), and control tokens as special
//! tokens. tests/tokenizer_llama_cpp.rs checks the ids against llama.cpp's.

mod bytes;
pub(crate) mod spm;

use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::{AddedToken, SplitDelimiterBehavior, Tokenizer};

use crate::error::ModelError;
use crate::gguf::GgufHeader;

/// GGUF token types: unknown (`<unk>`), control (`<|im_start|>`, `<|endoftext|>`, ...) and
/// user-defined tokens are special tokens (written in a text, they are their id), as llama.cpp
/// has them.
const TOKEN_TYPE_UNKNOWN: i32 = 2;
const TOKEN_TYPE_CONTROL: i32 = 3;
const TOKEN_TYPE_USER_DEFINED: i32 = 4;

/// llama.cpp's split regexes (src/llama-vocab.cpp, the case-insensitive contractions spelled
/// out as it does).
const LLAMA3_SPLIT: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2_SPLIT: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const DEEPSEEK3_SPLIT: [&str; 3] = [
    r"\p{N}{1,3}",
    "[一-龥぀-ゟ゠-ヿ]+",
    r##"[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"##,
];

/// One regex split, its matches and the text between them as pre-tokens.
fn split(re: &str) -> Result<PreTokenizerWrapper, ModelError> {
    let s = Split::new(
        SplitPattern::Regex(re.into()),
        SplitDelimiterBehavior::Isolated,
        false,
    )
    .map_err(err)?;
    Ok(s.into())
}

/// The pre-tokenizer llama.cpp uses for `pre`: the splits, whether a pre-token found whole in
/// the vocabulary skips the merges, and whether a BOS token comes first by default.
fn pre_tokenizer(pre: &str) -> Result<(Vec<PreTokenizerWrapper>, bool, bool), ModelError> {
    // After a regex split the bytes only need mapping (no second regex).
    let bytes = || -> PreTokenizerWrapper { ByteLevel::new(false, true, false).into() };
    Ok(match pre {
        // SmolLM / StarCoder: digits one by one, then the GPT-2 regex.
        "smollm" | "starcoder" | "refact" | "codeshell" => (
            vec![Digits::new(true).into(), ByteLevel::new(false, true, true).into()],
            false,
            false,
        ),
        "gpt2" | "gpt-2" => (vec![ByteLevel::new(false, true, true).into()], false, false),
        "llama3" | "llama-v3" | "llama-bpe" => (vec![split(LLAMA3_SPLIT)?, bytes()], true, true),
        "qwen2" | "deepseek-r1-qwen" => (vec![split(QWEN2_SPLIT)?, bytes()], false, false),
        "deepseek-v3" => {
            let mut v = DEEPSEEK3_SPLIT.iter().map(|r| split(r)).collect::<Result<Vec<_>, _>>()?;
            v.push(bytes());
            (v, false, false)
        }
        other => {
            return Err(err(format!(
                "pre-tokenizer `{other}` is not supported (smollm, starcoder, gpt2, llama-bpe, qwen2, deepseek-v3)"
            )))
        }
    })
}

/// A tokenizer plus the ids the engine needs.
pub struct ModelTokenizer {
    pub inner: Tokenizer,
    pub bos: Option<u32>,
    /// A BOS token starts every encoded text (`tokenizer.ggml.add_bos_token`, else the
    /// pre-tokenizer's default as llama.cpp has it).
    pub add_bos: bool,
    pub eos: u32,
    /// Tokens that end a generation (eos and, for chat models, `<|im_end|>`).
    pub stop: Vec<u32>,
    /// A SentencePiece vocabulary's tokenizer without the space it puts before a text: for
    /// fragments of output (None: `inner` serves).
    fragments: Option<Tokenizer>,
    /// The control tokens' texts (`<|im_start|>`, `<|eot_id|>`, ...): written in a text,
    /// each is its id (see [`crate::ChatTemplate::turn_marker_in`]).
    control: Vec<String>,
    /// The user-defined tokens' texts (read as their ids in any text, as llama.cpp does).
    user_defined: Vec<String>,
    /// Each token's GGUF type (a byte: the types are 1 to 6), for [`ModelTokenizer::token_bytes`].
    types: Vec<i8>,
    /// The vocabulary is GPT-2's byte-level one (else SentencePiece's).
    byte_level: bool,
    /// The most bytes of text one token stands for: no token's stored form is shorter than the
    /// text it covers (a byte-level token's form spells each byte as a character of one or
    /// two bytes; SentencePiece writes a space as `▁`, three), see [`ModelTokenizer::fewest_tokens`].
    longest: usize,
}

fn err(e: impl std::fmt::Display) -> ModelError {
    ModelError::Tokenizer(e.to_string())
}

/// A byte-level BPE vocabulary (`gpt2`): the merges stored in the file and the named
/// pre-tokenizer; whether a BOS token comes first by default.
fn byte_level_bpe(g: &GgufHeader, tokens: &[String]) -> Result<(Tokenizer, bool), ModelError> {
    // llama.cpp's `default` (no `pre` key) is a split of its own, not GPT-2's: refused.
    let pre = g.string("tokenizer.ggml.pre").unwrap_or("default");
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
    let vocab: tokenizers::models::bpe::Vocab = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), i as u32))
        .collect();
    let (pretok, ignore_merges, default_bos) = pre_tokenizer(pre)?;
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .ignore_merges(ignore_merges)
        .build()
        .map_err(err)?;
    let mut tk = Tokenizer::new(bpe);
    tk.with_pre_tokenizer(Some(Sequence::new(pretok)));
    tk.with_decoder(Some(ByteLevelDecoder::default()));
    Ok((tk, default_bos))
}

/// A SentencePiece vocabulary (`llama`): pieces and scores, `▁` for spaces, byte tokens
/// (`spm`); with a space prefix, also the tokenizer of fragments (without it).
fn sentencepiece(
    g: &GgufHeader,
    tokens: &[String],
    types: &[i32],
) -> Result<(Tokenizer, Option<Tokenizer>), ModelError> {
    let scores: Vec<f32> = g
        .array("tokenizer.ggml.scores")?
        .iter()
        .map(|v| v.to_f32().map_err(err))
        .collect::<Result<_, _>>()?;
    let add_space_prefix = match g.metadata.get("tokenizer.ggml.add_space_prefix") {
        Some(v) => v.to_bool().map_err(err)?,
        None => true,
    };
    let unk = g
        .u32("tokenizer.ggml.unknown_token_id")
        .and_then(|i| tokens.get(i as usize))
        .map(String::as_str);
    crate::tokenizer::spm::spm_tokenizers(tokens, &scores, types, add_space_prefix, unk)
}

/// The tokens and their types, checked as llama.cpp checks them: types that cover the
/// tokens, no token twice.
fn vocabulary(g: &GgufHeader) -> Result<(Vec<String>, Vec<i32>), ModelError> {
    let tokens: Vec<String> = g
        .array("tokenizer.ggml.tokens")?
        .iter()
        .map(|v| v.to_string().cloned().map_err(err))
        .collect::<Result<_, _>>()?;
    let types: Vec<i32> = match g.array("tokenizer.ggml.token_type") {
        Ok(v) => v
            .iter()
            .map(|x| x.to_i32().map_err(err))
            .collect::<Result<_, _>>()?,
        Err(_) => vec![1; tokens.len()],
    };
    // As llama.cpp refuses them: types that do not cover the tokens, a piece twice.
    if types.len() != tokens.len() {
        return Err(err(format!(
            "tokenizer.ggml.token_type has {} entries for {} tokens",
            types.len(),
            tokens.len()
        )));
    }
    let mut seen = std::collections::HashSet::with_capacity(tokens.len());
    if let Some(d) = tokens.iter().find(|t| !seen.insert(t.as_str())) {
        return Err(err(format!(
            "token `{d}` appears twice in tokenizer.ggml.tokens"
        )));
    }
    Ok((tokens, types))
}

/// The control tokens' texts, the user-defined tokens' texts, and every token the tokenizer
/// reads as special (unknown, control and user-defined: written in a text, each is its id).
fn special_tokens(tokens: &[String], types: &[i32]) -> (Vec<String>, Vec<String>, Vec<AddedToken>) {
    let of = |kind: i32| -> Vec<String> {
        tokens
            .iter()
            .zip(types)
            .filter(|(s, &t)| t == kind && !s.is_empty())
            .map(|(s, _)| s.clone())
            .collect()
    };
    let specials = tokens
        .iter()
        .zip(types)
        .filter(|(_, &t)| {
            t == TOKEN_TYPE_CONTROL || t == TOKEN_TYPE_USER_DEFINED || t == TOKEN_TYPE_UNKNOWN
        })
        .map(|(s, _)| AddedToken::from(s.clone(), true))
        .collect();
    (
        of(TOKEN_TYPE_CONTROL),
        of(TOKEN_TYPE_USER_DEFINED),
        specials,
    )
}

impl ModelTokenizer {
    pub fn from_gguf(g: &GgufHeader) -> Result<ModelTokenizer, ModelError> {
        let model = g.string("tokenizer.ggml.model").unwrap_or("");
        let (tokens, types) = vocabulary(g)?;
        let (mut tk, mut fragments, default_bos) = match model {
            "gpt2" => {
                let (t, bos) = byte_level_bpe(g, &tokens)?;
                (t, None, bos)
            }
            "llama" => {
                let (t, f) = sentencepiece(g, &tokens, &types)?;
                (t, f, true)
            }
            _ => {
                return Err(err(format!(
                    "tokenizer.ggml.model `{model}` is not supported (gpt2: byte-level BPE; \
                     llama: SentencePiece)"
                )))
            }
        };
        let (control, user_defined, specials) = special_tokens(&tokens, &types);
        tk.add_special_tokens(&specials);
        if let Some(f) = &mut fragments {
            f.add_special_tokens(&specials);
        }
        let eos = g
            .u32("tokenizer.ggml.eos_token_id")
            .ok_or_else(|| err("tokenizer.ggml.eos_token_id missing"))?;
        let bos = g.u32("tokenizer.ggml.bos_token_id");
        // A special token outside the vocabulary would never end a generation (or start a
        // prompt with an id the model has no row for).
        let eot = g.u32("tokenizer.ggml.eot_token_id");
        for (key, id) in [("eos", Some(eos)), ("bos", bos), ("eot", eot)] {
            if let Some(id) = id.filter(|&id| id as usize >= tokens.len()) {
                return Err(err(format!(
                    "tokenizer.ggml.{key}_token_id {id} is outside the vocabulary of {} tokens",
                    tokens.len()
                )));
            }
        }
        let add_bos = match g.metadata.get("tokenizer.ggml.add_bos_token") {
            Some(v) => v.to_bool().map_err(err)?,
            None => default_bos,
        } && bos.is_some();
        let mut stop = vec![eos];
        // Llama 3's turns end with an end-of-turn token other than eos.
        if let Some(id) = eot {
            if id != eos {
                stop.push(id);
            }
        }
        stop.extend(tk.token_to_id("<|im_end|>").filter(|&id| id != eos));
        Ok(ModelTokenizer {
            inner: tk,
            fragments,
            bos,
            add_bos,
            eos,
            stop,
            control,
            user_defined,
            types: types.iter().map(|&t| t.clamp(0, 127) as i8).collect(),
            byte_level: model == "gpt2",
            longest: tokens.iter().map(String::len).max().unwrap_or(1).max(1),
        })
    }

    /// A lower bound on the tokens `text` encodes to, without encoding it: its bytes over the
    /// most any token covers (a text far over the context is refused at once, not after
    /// seconds of tokenizing).
    pub fn fewest_tokens(&self, text: &str) -> usize {
        text.len().div_ceil(self.longest)
    }

    /// Whether `id` is a control token (`<|im_end|>`, `<|endoftext|>`, ...): output text
    /// leaves it out.
    pub fn is_control(&self, id: u32) -> bool {
        self.types.get(id as usize).map(|&t| i32::from(t)) == Some(TOKEN_TYPE_CONTROL)
    }

    /// The control tokens' texts.
    pub fn control_texts(&self) -> &[String] {
        &self.control
    }

    /// Token ids of `text` as it is (no BOS added); special tokens written in the text are
    /// recognised. Fragments of text (a grammar's tokens, a check) use this.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, ModelError> {
        Ok(self
            .inner
            .encode(text, false)
            .map_err(err)?
            .get_ids()
            .to_vec())
    }

    /// Token ids of `text` with every special token written in it read as text, as llama.cpp
    /// tokenizes with `parse_special = false`: `<|endoftext|>` in a chat message's content is
    /// the ids of its characters, not the control token (see [`crate::ChatTemplate::encode`],
    /// which splits the template's own markers off first). The tokenizer's normalizer,
    /// pre-tokenizer and model, without its search for special tokens.
    pub fn encode_text(&self, text: &str) -> Result<Vec<u32>, ModelError> {
        use tokenizers::{Model, Normalizer, OffsetReferential, OffsetType, PreTokenizer};
        if text.is_empty() {
            return Ok(Vec::new());
        }
        let mut s = tokenizers::PreTokenizedString::from(text);
        if let Some(n) = self.inner.get_normalizer() {
            s.normalize(|x| n.normalize(x)).map_err(err)?;
        }
        if let Some(p) = self.inner.get_pre_tokenizer() {
            p.pre_tokenize(&mut s).map_err(err)?;
        }
        let model = self.inner.get_model();
        s.tokenize(|x| model.tokenize(x.get())).map_err(err)?;
        Ok(s.get_splits(OffsetReferential::Original, OffsetType::None)
            .into_iter()
            .flat_map(|(_, _, tokens)| tokens.iter().flatten().map(|t| t.id))
            .collect())
    }

    /// `ids` of a prompt with the BOS token first where the vocabulary adds one (and `ids` do
    /// not already start with it), as [`ModelTokenizer::encode_prompt`] has it.
    pub fn with_bos(&self, ids: Vec<u32>) -> Vec<u32> {
        match self.bos {
            Some(b) if self.add_bos && ids.first() != Some(&b) => {
                let mut v = Vec::with_capacity(ids.len() + 1);
                v.push(b);
                v.extend(ids);
                v
            }
            _ => ids,
        }
    }

    /// The user-defined tokens' texts: llama.cpp reads them as their ids even where special
    /// tokens are text.
    pub fn user_defined_texts(&self) -> &[String] {
        &self.user_defined
    }

    /// Token ids of a fragment of output text (a grammar's forced bytes): as [`encode`], but a
    /// SentencePiece vocabulary puts no space before it.
    ///
    /// [`encode`]: ModelTokenizer::encode
    pub fn encode_fragment(&self, text: &str) -> Result<Vec<u32>, ModelError> {
        Ok(self
            .fragment_tokenizer()
            .encode(text, false)
            .map_err(err)?
            .get_ids()
            .to_vec())
    }

    /// Token ids of a prompt: with [`ModelTokenizer::add_bos`] they start with BOS, once (a
    /// text that starts with the BOS token's own text gets no second one, where llama.cpp
    /// would add it and warn).
    pub fn encode_prompt(&self, text: &str) -> Result<Vec<u32>, ModelError> {
        Ok(self.with_bos(self.encode(text)?))
    }

    /// Text of `ids` (special tokens included), as a whole text: a SentencePiece vocabulary's
    /// space before the text is dropped.
    pub fn decode(&self, ids: &[u32]) -> Result<String, ModelError> {
        self.inner.decode(ids, false).map_err(err)
    }

    /// Text of `ids` as a piece of output (generated tokens, one token's text): a leading
    /// `▁` stays a space, as llama.cpp's pieces have it (" Paris" after "The capital is").
    pub fn decode_fragment(&self, ids: &[u32]) -> Result<String, ModelError> {
        self.fragment_tokenizer().decode(ids, false).map_err(err)
    }

    /// The tokenizer of output fragments (no space before them).
    fn fragment_tokenizer(&self) -> &Tokenizer {
        self.fragments.as_ref().unwrap_or(&self.inner)
    }

    pub fn token_to_id(&self, t: &str) -> Option<u32> {
        self.inner.token_to_id(t)
    }
}
