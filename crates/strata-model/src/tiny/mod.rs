//! Small GGUF files with random weights, for tests: a byte-level BPE tokenizer (the 256 byte
//! symbols, a few merges, ChatML control tokens) and a model of the llama family (llama, with
//! Llama 3's RoPE frequency factors and an output head of its own as options; qwen2; qwen3).

pub mod deepseek4;
pub(crate) mod spm;

use std::path::Path;

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};

use crate::error::ModelError;
use crate::gguf::Arch;

/// Shape of a tiny model.
#[derive(Clone, Debug)]
pub struct TinySpec {
    pub arch: Arch,
    /// Head size when it is not `hidden / heads` (written as `key_length`; qwen3).
    pub head_dim: Option<usize>,
    /// Llama 3's RoPE frequency factors (`rope_freqs.weight`).
    pub rope_freqs: bool,
    /// An output head of its own (`output.weight`) rather than the embeddings.
    pub untied_output: bool,
    pub rope_base: f32,
    /// `tokenizer.ggml.pre` (default `smollm`).
    pub pre: &'static str,
    /// More merges (digits, contractions, runs of spaces and newlines, words), so that how a
    /// pre-tokenizer splits shows in the ids (tests/tokenizer_llama_cpp.rs).
    pub rich_merges: bool,
    /// A SentencePiece vocabulary (`tokenizer.ggml.model = llama`, as Llama 2 and Mistral
    /// files have: `tiny_spm`) instead of the byte-level BPE one; `pre` and `rich_merges`
    /// then do not apply.
    pub spm: bool,
    pub hidden: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub ffn: usize,
    pub layers: usize,
    pub context: usize,
    /// Storage type of the matrices (F32 or a quantized type; dimensions are multiples of 32).
    pub dtype: GgmlDType,
    pub seed: u64,
}

impl TinySpec {
    /// The tiny model of a family, by the name `write_tiny` takes: `llama`, `llama3` (RoPE
    /// frequency factors, an output head, base 500000), `qwen2` (Q/K/V biases), `qwen3` (Q/K
    /// norms, head size 32 with 4 heads of a 64-wide embedding), `mistral` (llama with a
    /// SentencePiece vocabulary), `llama-h32` (llama with 2 KV heads of 32 values: q8_0 K/V).
    pub fn family(name: &str) -> Option<TinySpec> {
        let d = TinySpec::default();
        Some(match name {
            "llama" => d,
            "llama3" => TinySpec {
                rope_freqs: true,
                untied_output: true,
                rope_base: 500_000.0,
                ..d
            },
            "qwen2" => TinySpec {
                arch: Arch::Qwen2,
                ..d
            },
            "qwen3" => TinySpec {
                arch: Arch::Qwen3,
                head_dim: Some(32),
                untied_output: true,
                ..d
            },
            // Llama with KV heads of 32 values (a whole q8_0 block each): quantized K/V.
            "llama-h32" => TinySpec {
                hidden: 128,
                heads: 4,
                kv_heads: 2,
                ..d
            },
            // Mistral's files: the llama architecture with a SentencePiece vocabulary.
            "mistral" | "tok-spm" => TinySpec { spm: true, ..d },
            // Tokenizer files: the llama model with a pre-tokenizer and more merges.
            "tok-smollm" | "tok-gpt-2" | "tok-llama-bpe" | "tok-qwen2" | "tok-deepseek-v3" => {
                let pre = ["smollm", "gpt-2", "llama-bpe", "qwen2", "deepseek-v3"]
                    .into_iter()
                    .find(|p| name[4..] == **p)?;
                TinySpec {
                    pre,
                    rich_merges: true,
                    ..d
                }
            }
            _ => return None,
        })
    }

    fn head_dim(&self) -> usize {
        self.head_dim.unwrap_or(self.hidden / self.heads)
    }
}

impl Default for TinySpec {
    fn default() -> TinySpec {
        TinySpec {
            arch: Arch::Llama,
            head_dim: None,
            rope_freqs: false,
            untied_output: false,
            rope_base: 10000.0,
            pre: "smollm",
            rich_merges: false,
            spm: false,
            hidden: 64,
            heads: 4,
            kv_heads: 2,
            ffn: 128,
            layers: 2,
            context: 512,
            dtype: GgmlDType::F32,
            seed: 1,
        }
    }
}

/// GPT-2's byte → printable char table.
pub fn byte_chars() -> Vec<char> {
    let mut bs: Vec<u32> = (b'!' as u32..=b'~' as u32)
        .chain(0xA1..=0xAC)
        .chain(0xAE..=0xFF)
        .collect();
    let mut cs = bs.clone();
    let mut n = 0;
    for b in 0..256u32 {
        if !bs.contains(&b) {
            bs.push(b);
            cs.push(256 + n);
            n += 1;
        }
    }
    let mut out = vec![' '; 256];
    for (b, c) in bs.iter().zip(cs) {
        out[*b as usize] = char::from_u32(c).expect("valid char");
    }
    out
}

pub const TINY_TEMPLATE: &str = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

/// Writes a tiny model to `path`; vocabulary size is 288 (SentencePiece: 343).
pub fn write_tiny(path: &Path, spec: &TinySpec) -> Result<(), ModelError> {
    let (n_vocab, tok) = if spec.spm {
        let v = crate::tiny::spm::spm_vocab();
        let mut md = crate::tiny::spm::spm_metadata(&v);
        md.push((
            "tokenizer.chat_template",
            Value::String(TINY_TEMPLATE.into()),
        ));
        (v.tokens.len(), md)
    } else {
        let v = tiny_vocab_with(spec.rich_merges);
        (v.tokens.len(), tokenizer_metadata(&v, spec.pre))
    };
    let md = tiny_metadata(spec, n_vocab, tok);
    let tensors = tiny_tensors(spec, n_vocab)?;
    let mut f = std::fs::File::create(path).map_err(|e| ModelError::Open {
        path: path.display().to_string(),
        reason: e.to_string(),
    })?;
    let mdr: Vec<(&str, &Value)> = md.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let tr: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    gguf_file::write(&mut f, &mdr, &tr)?;
    Ok(())
}

/// The tiny tokenizer's vocabulary.
pub(crate) struct Vocab {
    pub(crate) tokens: Vec<String>,
    types: Vec<i32>,
    merges: Vec<(String, String)>,
}

/// The 256 byte symbols, three merges, the ChatML control tokens, padded to 288 tokens.
pub(crate) fn tiny_vocab() -> Vocab {
    tiny_vocab_with(false)
}

fn tiny_vocab_with(rich: bool) -> Vocab {
    let chars = byte_chars();
    let mut tokens: Vec<String> = chars.iter().map(|c| c.to_string()).collect();
    let sp = chars[b' ' as usize];
    let nl = chars[b'\n' as usize];
    let mut merges = vec![
        (format!("{sp}"), "t".to_string()),
        ("h".into(), "e".into()),
        (format!("{sp}t"), "he".into()),
    ];
    if rich {
        let m = |a: &str, b: &str| (a.to_string(), b.to_string());
        let (s, s2, n) = (sp.to_string(), format!("{sp}{sp}"), nl.to_string());
        merges.extend([
            m("1", "2"),
            m("12", "3"),
            m("4", "5"),
            m("'", "s"),
            m(&s, &s),
            m(&s2, &s2),
            m("l", "l"),
            m("he", "ll"),
            m("hell", "o"),
            m(&s, "w"),
            m("o", "r"),
            m(&format!("{sp}w"), "or"),
            m(&n, &n),
            m(&s, "1"),
            m("!", "!"),
        ]);
    }
    for (a, b) in &merges {
        tokens.push(format!("{a}{b}"));
    }
    let mut types = vec![1i32; tokens.len()];
    for s in ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] {
        tokens.push(s.into());
        types.push(3);
    }
    while tokens.len() < 288 {
        tokens.push(format!("<unused{}>", tokens.len()));
        types.push(1);
    }
    Vocab {
        tokens,
        types,
        merges,
    }
}

/// The GGUF metadata: llama hyper-parameters of `s` and the tokenizer.
fn tiny_metadata(
    s: &TinySpec,
    vocab: usize,
    tokenizer: Vec<(&'static str, Value)>,
) -> Vec<(String, Value)> {
    let hd = s.head_dim();
    let a = s.arch.name();
    let u = |x: usize| Value::U32(x as u32);
    let mut md: Vec<(String, Value)> = vec![
        ("general.architecture".into(), Value::String(a.into())),
        ("general.name".into(), Value::String("tiny".into())),
    ];
    for (k, v) in [
        ("block_count", u(s.layers)),
        ("context_length", u(s.context)),
        ("embedding_length", u(s.hidden)),
        ("feed_forward_length", u(s.ffn)),
        ("attention.head_count", u(s.heads)),
        ("attention.head_count_kv", u(s.kv_heads)),
        ("rope.freq_base", Value::F32(s.rope_base)),
        ("attention.layer_norm_rms_epsilon", Value::F32(1e-5)),
        ("vocab_size", u(vocab)),
        ("rope.dimension_count", u(hd)),
    ] {
        md.push((format!("{a}.{k}"), v));
    }
    if s.head_dim.is_some() {
        md.push((format!("{a}.attention.key_length"), u(hd)));
        md.push((format!("{a}.attention.value_length"), u(hd)));
    }
    md.extend(tokenizer.into_iter().map(|(k, v)| (k.to_string(), v)));
    md
}

/// The tiny tokenizer's metadata (any architecture).
pub(crate) fn tokenizer_metadata(v: &Vocab, pre: &str) -> Vec<(&'static str, Value)> {
    vec![
        ("tokenizer.ggml.model", Value::String("gpt2".into())),
        ("tokenizer.ggml.pre", Value::String(pre.into())),
        (
            "tokenizer.ggml.tokens",
            Value::Array(v.tokens.iter().map(|t| Value::String(t.clone())).collect()),
        ),
        (
            "tokenizer.ggml.token_type",
            Value::Array(v.types.iter().map(|&t| Value::I32(t)).collect()),
        ),
        (
            "tokenizer.ggml.merges",
            Value::Array(
                v.merges
                    .iter()
                    .map(|(a, b)| Value::String(format!("{a} {b}")))
                    .collect(),
            ),
        ),
        ("tokenizer.ggml.bos_token_id", Value::U32(259)),
        ("tokenizer.ggml.eos_token_id", Value::U32(259)),
        (
            "tokenizer.chat_template",
            Value::String(TINY_TEMPLATE.into()),
        ),
    ]
}

/// Weight generator seeded by `seed` (xorshift): `n` values uniform in `offset ± scale`.
pub(crate) fn random_weights(seed: u64) -> impl FnMut(usize, f32, f32) -> Vec<f32> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    move |n: usize, scale: f32, offset: f32| -> Vec<f32> {
        (0..n)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                offset + ((state >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 2.0 * scale
            })
            .collect()
    }
}

/// The vectors a family adds to layer `l`: (name, length, random scale, offset): Qwen2's
/// biases, Qwen3's Q/K norm weights.
fn family_extras(s: &TinySpec, l: usize) -> Vec<(String, usize, f32, f32)> {
    let hd = s.head_dim();
    let (qd, kvd) = (s.heads * hd, s.kv_heads * hd);
    let mut v = Vec::new();
    if s.arch.qkv_bias() {
        for (n, d) in [("attn_q", qd), ("attn_k", kvd), ("attn_v", kvd)] {
            v.push((format!("blk.{l}.{n}.bias"), d, 0.5, 0.0));
        }
    }
    if s.arch.qk_norm() {
        for n in ["attn_q_norm", "attn_k_norm"] {
            v.push((format!("blk.{l}.{n}.weight"), hd, 0.2, 1.0));
        }
    }
    v
}

/// Every tensor of the model, random, in file order.
fn tiny_tensors(s: &TinySpec, vocab: usize) -> Result<Vec<(String, QTensor)>, ModelError> {
    let hd = s.head_dim();
    let mut rnd = random_weights(s.seed);
    let (qd, kvd) = (s.heads * hd, s.kv_heads * hd);
    let mut tensors: Vec<(String, QTensor)> = Vec::new();
    let mut add = |name: String,
                   shape: Vec<usize>,
                   data: Vec<f32>,
                   dtype: GgmlDType|
     -> Result<(), ModelError> {
        let t = Tensor::from_vec(data, shape, &Device::Cpu)?;
        tensors.push((name, QTensor::quantize(&t, dtype)?));
        Ok(())
    };
    add(
        "token_embd.weight".into(),
        vec![vocab, s.hidden],
        rnd(vocab * s.hidden, 0.5, 0.0),
        s.dtype,
    )?;
    add(
        "output_norm.weight".into(),
        vec![s.hidden],
        rnd(s.hidden, 0.1, 1.0),
        GgmlDType::F32,
    )?;
    for l in 0..s.layers {
        for (n, shape) in [
            ("attn_q", vec![qd, s.hidden]),
            ("attn_k", vec![kvd, s.hidden]),
            ("attn_v", vec![kvd, s.hidden]),
            ("attn_output", vec![s.hidden, qd]),
            ("ffn_gate", vec![s.ffn, s.hidden]),
            ("ffn_up", vec![s.ffn, s.hidden]),
            ("ffn_down", vec![s.hidden, s.ffn]),
        ] {
            let n_el = shape.iter().product();
            add(
                format!("blk.{l}.{n}.weight"),
                shape,
                rnd(n_el, 0.25, 0.0),
                s.dtype,
            )?;
        }
        add(
            format!("blk.{l}.attn_norm.weight"),
            vec![s.hidden],
            rnd(s.hidden, 0.1, 1.0),
            GgmlDType::F32,
        )?;
        add(
            format!("blk.{l}.ffn_norm.weight"),
            vec![s.hidden],
            rnd(s.hidden, 0.1, 1.0),
            GgmlDType::F32,
        )?;
        for (name, n, scale, offset) in family_extras(s, l) {
            add(name, vec![n], rnd(n, scale, offset), GgmlDType::F32)?;
        }
    }
    if s.rope_freqs {
        // Llama 3's shape: the low frequencies slowed down (factors from 1 to 8).
        let f = (0..hd / 2)
            .map(|i| 1.0 + 7.0 * i as f32 / (hd / 2 - 1).max(1) as f32)
            .collect();
        add("rope_freqs.weight".into(), vec![hd / 2], f, GgmlDType::F32)?;
    }
    if s.untied_output {
        let w = rnd(vocab * s.hidden, 0.5, 0.0);
        add("output.weight".into(), vec![vocab, s.hidden], w, s.dtype)?;
    }
    Ok(tensors)
}
