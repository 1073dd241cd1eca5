//! Small GGUF files of the reference architecture with random weights, for tests: a byte-level
//! BPE tokenizer (the 256 byte symbols, a few merges, ChatML control tokens) and a llama model.

use std::path::Path;

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};

use crate::error::ModelError;

/// Shape of a tiny model.
#[derive(Clone, Debug)]
pub struct TinySpec {
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

impl Default for TinySpec {
    fn default() -> TinySpec {
        TinySpec {
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

/// Writes a tiny model to `path`; vocabulary size is 288.
pub fn write_tiny(path: &Path, spec: &TinySpec) -> Result<(), ModelError> {
    let vocab = tiny_vocab();
    let md = tiny_metadata(spec, &vocab);
    let tensors = tiny_tensors(spec, vocab.tokens.len())?;
    let mut f = std::fs::File::create(path).map_err(|e| ModelError::Open {
        path: path.display().to_string(),
        reason: e.to_string(),
    })?;
    let mdr: Vec<(&str, &Value)> = md.iter().map(|(k, v)| (*k, v)).collect();
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
    let chars = byte_chars();
    let mut tokens: Vec<String> = chars.iter().map(|c| c.to_string()).collect();
    let sp = chars[b' ' as usize];
    let merges = vec![
        (format!("{sp}"), "t".to_string()),
        ("h".into(), "e".into()),
        (format!("{sp}t"), "he".into()),
    ];
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
fn tiny_metadata(s: &TinySpec, v: &Vocab) -> Vec<(&'static str, Value)> {
    let vocab = v.tokens.len();
    let hd = s.hidden / s.heads;
    let mut md = vec![
        ("general.architecture", Value::String("llama".into())),
        ("general.name", Value::String("tiny".into())),
        ("llama.block_count", Value::U32(s.layers as u32)),
        ("llama.context_length", Value::U32(s.context as u32)),
        ("llama.embedding_length", Value::U32(s.hidden as u32)),
        ("llama.feed_forward_length", Value::U32(s.ffn as u32)),
        ("llama.attention.head_count", Value::U32(s.heads as u32)),
        (
            "llama.attention.head_count_kv",
            Value::U32(s.kv_heads as u32),
        ),
        ("llama.rope.freq_base", Value::F32(10000.0)),
        ("llama.attention.layer_norm_rms_epsilon", Value::F32(1e-5)),
        ("llama.vocab_size", Value::U32(vocab as u32)),
        ("llama.rope.dimension_count", Value::U32(hd as u32)),
    ];
    md.extend(tokenizer_metadata(v));
    md
}

/// The tiny tokenizer's metadata (any architecture).
pub(crate) fn tokenizer_metadata(v: &Vocab) -> Vec<(&'static str, Value)> {
    vec![
        ("tokenizer.ggml.model", Value::String("gpt2".into())),
        ("tokenizer.ggml.pre", Value::String("smollm".into())),
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

/// Every tensor of the model, random, in file order.
fn tiny_tensors(s: &TinySpec, vocab: usize) -> Result<Vec<(String, QTensor)>, ModelError> {
    let hd = s.hidden / s.heads;
    let mut rnd = random_weights(s.seed);
    let kvd = s.kv_heads * hd;
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
            ("attn_q", vec![s.hidden, s.hidden]),
            ("attn_k", vec![kvd, s.hidden]),
            ("attn_v", vec![kvd, s.hidden]),
            ("attn_output", vec![s.hidden, s.hidden]),
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
    }
    Ok(tensors)
}
