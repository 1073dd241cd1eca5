//! A small GGUF of the DeepSeek-V4 architecture (`deepseek4`, llama.cpp's tensor names and
//! metadata keys) with random weights, for tests and for llama.cpp's reference logits
//! (`scripts/llamacpp/`): every kind of layer (compression ratio 0, 4 with the indexer, 128),
//! a sliding window, an indexer top-k, experts with a shared one and a hash-routed first layer,
//! hyper-connections and the grouped low-rank output, all small enough that prompts of a few
//! hundred tokens cross the window, 4-token and 128-token block boundaries.
//!
//! Shapes below are written as llama.cpp states them (`ne`: fastest dimension first); the file
//! stores them that way (candle's shapes are the reverse).

use std::path::Path;

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};

use crate::error::ModelError;
use crate::tiny::{random_weights, tiny_vocab, tokenizer_metadata};

/// Shape of a tiny DeepSeek-V4 model.
#[derive(Clone, Debug)]
pub struct TinyDsv4Spec {
    pub embd: usize,
    pub heads: usize,
    /// Key = value length of the one KV head.
    pub head_dim: usize,
    /// RoPE on the last `rope_dims` of each head.
    pub rope_dims: usize,
    pub q_lora_rank: usize,
    pub window: usize,
    /// Per layer: 0 (window only), 4 (compressed 4:1, sparse through the indexer) or 128.
    pub ratios: Vec<i32>,
    pub experts: usize,
    pub experts_used: usize,
    pub expert_ffn: usize,
    /// The first this many layers route tokens by a fixed token → experts table.
    pub hash_layers: usize,
    pub indexer_heads: usize,
    /// A multiple of 64 (llama.cpp rotates the indexer's keys by a Hadamard transform).
    pub indexer_dim: usize,
    pub indexer_top_k: usize,
    pub out_groups: usize,
    pub out_lora_rank: usize,
    /// Residual streams.
    pub hc: usize,
    pub swiglu_clamp: f32,
    pub context: usize,
    pub seed: u64,
}

impl Default for TinyDsv4Spec {
    fn default() -> TinyDsv4Spec {
        TinyDsv4Spec {
            embd: 64,
            heads: 4,
            head_dim: 128,
            rope_dims: 16,
            q_lora_rank: 32,
            window: 32,
            ratios: vec![0, 4, 128, 4, 128, 0],
            experts: 4,
            experts_used: 2,
            expert_ffn: 32,
            hash_layers: 1,
            indexer_heads: 4,
            indexer_dim: 64,
            indexer_top_k: 8,
            out_groups: 2,
            out_lora_rank: 16,
            hc: 4,
            swiglu_clamp: 1.5,
            context: 1024,
            seed: 7,
        }
    }
}

/// GGML's I32 tensor type (candle has none: such tensors are written as F32 with the same
/// bytes and their type patched in the header).
const GGML_TYPE_I32: u32 = 26;

/// Writes the model to `path` (the tiny tokenizer's 288-token vocabulary).
pub fn write_tiny_dsv4(path: &Path, s: &TinyDsv4Spec) -> Result<(), ModelError> {
    let vocab = tiny_vocab();
    let mut md = metadata(s, vocab.tokens.len());
    md.extend(tokenizer_metadata(&vocab, "smollm"));
    let (tensors, int_tensors) = tensors(s)?;
    let mut buf = std::io::Cursor::new(Vec::new());
    let mdr: Vec<(&str, &Value)> = md.iter().map(|(k, v)| (*k, v)).collect();
    let tr: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    gguf_file::write(&mut buf, &mdr, &tr)?;
    let mut bytes = buf.into_inner();
    for name in &int_tensors {
        patch_type(&mut bytes, name, GGML_TYPE_I32)?;
    }
    std::fs::write(path, bytes).map_err(|e| ModelError::Open {
        path: path.display().to_string(),
        reason: e.to_string(),
    })
}

/// Sets the type of tensor `name` in a GGUF header: its info is the name (u64 length, bytes),
/// the dimension count (u32), the dimensions (u64 each), the type (u32), the offset (u64).
fn patch_type(bytes: &mut [u8], name: &str, ty: u32) -> Result<(), ModelError> {
    let mut key = (name.len() as u64).to_le_bytes().to_vec();
    key.extend_from_slice(name.as_bytes());
    let at = bytes
        .windows(key.len())
        .position(|w| w == key.as_slice())
        .ok_or_else(|| ModelError::Tensor {
            path: "(being written)".into(),
            name: name.into(),
            reason: "not in the header".into(),
        })?;
    let dims_at = at + key.len();
    let n_dims = u32::from_le_bytes(bytes[dims_at..dims_at + 4].try_into().expect("4 bytes"));
    let ty_at = dims_at + 4 + 8 * n_dims as usize;
    bytes[ty_at..ty_at + 4].copy_from_slice(&ty.to_le_bytes());
    Ok(())
}

fn metadata(s: &TinyDsv4Spec, vocab: usize) -> Vec<(&'static str, Value)> {
    let layers = s.ratios.len() as u32;
    let u = |v: usize| Value::U32(v as u32);
    vec![
        ("general.architecture", Value::String("deepseek4".into())),
        ("general.name", Value::String("tiny-dsv4".into())),
        ("deepseek4.block_count", Value::U32(layers)),
        ("deepseek4.context_length", u(s.context)),
        ("deepseek4.embedding_length", u(s.embd)),
        ("deepseek4.vocab_size", u(vocab)),
        ("deepseek4.attention.head_count", u(s.heads)),
        ("deepseek4.attention.head_count_kv", u(1)),
        ("deepseek4.attention.key_length", u(s.head_dim)),
        ("deepseek4.attention.value_length", u(s.head_dim)),
        (
            "deepseek4.attention.layer_norm_rms_epsilon",
            Value::F32(1e-6),
        ),
        ("deepseek4.attention.q_lora_rank", u(s.q_lora_rank)),
        ("deepseek4.attention.sliding_window", u(s.window)),
        ("deepseek4.attention.indexer.head_count", u(s.indexer_heads)),
        ("deepseek4.attention.indexer.key_length", u(s.indexer_dim)),
        ("deepseek4.attention.indexer.top_k", u(s.indexer_top_k)),
        ("deepseek4.attention.output_group_count", u(s.out_groups)),
        ("deepseek4.attention.output_lora_rank", u(s.out_lora_rank)),
        (
            "deepseek4.attention.compress_rope_freq_base",
            Value::F32(160000.0),
        ),
        (
            "deepseek4.attention.compress_ratios",
            Value::Array(s.ratios.iter().map(|&r| Value::I32(r)).collect()),
        ),
        ("deepseek4.rope.dimension_count", u(s.rope_dims)),
        ("deepseek4.rope.freq_base", Value::F32(10000.0)),
        ("deepseek4.expert_count", u(s.experts)),
        ("deepseek4.expert_used_count", u(s.experts_used)),
        ("deepseek4.expert_feed_forward_length", u(s.expert_ffn)),
        ("deepseek4.expert_shared_count", u(1)),
        ("deepseek4.expert_weights_scale", Value::F32(1.5)),
        ("deepseek4.expert_weights_norm", Value::Bool(true)),
        // sqrt(softplus(x)) scoring: the only one llama.cpp's loader takes for this model.
        ("deepseek4.expert_gating_func", u(4)),
        (
            "deepseek4.swiglu_clamp_exp",
            Value::Array(vec![Value::F32(s.swiglu_clamp); layers as usize]),
        ),
        ("deepseek4.hyper_connection.count", u(s.hc)),
        ("deepseek4.hyper_connection.sinkhorn_iterations", u(20)),
        ("deepseek4.hyper_connection.epsilon", Value::F32(1e-6)),
        ("deepseek4.hash_layer_count", u(s.hash_layers)),
    ]
}

/// The tensors being built, in file order: name, shape as llama.cpp states it (`ne`), values.
/// Matrices and vectors draw from two seeded streams, always in the same order.
struct Builder<M, V> {
    specs: Vec<(String, Vec<usize>, Vec<f32>)>,
    /// Tensors whose values are I32 bit patterns.
    ints: Vec<String>,
    mat_rng: M,
    vec_rng: V,
}

impl<M: FnMut(usize, f32, f32) -> Vec<f32>, V: FnMut(usize, f32, f32) -> Vec<f32>> Builder<M, V> {
    fn mat(&mut self, name: String, ne: Vec<usize>, scale: f32) {
        let n = ne.iter().product();
        let data = (self.mat_rng)(n, scale, 0.0);
        self.specs.push((name, ne, data));
    }

    fn vec1(&mut self, name: String, n: usize, scale: f32, offset: f32) {
        let data = (self.vec_rng)(n, scale, offset);
        self.specs.push((name, vec![n], data));
    }

    fn ints(&mut self, name: String, ne: Vec<usize>, values: Vec<u32>) {
        self.ints.push(name.clone());
        let data = values.into_iter().map(f32::from_bits).collect();
        self.specs.push((name, ne, data));
    }
}

/// The tensors to write, and the names of the I32 ones.
type Tensors = (Vec<(String, QTensor)>, Vec<String>);

/// A tensor's name, shape as llama.cpp states it (`ne`) and values.
pub type NamedWeights = (String, Vec<usize>, Vec<f32>);

/// Every tensor of the model in file order: name, shape as llama.cpp states it (`ne`), values
/// (an I32 tensor's values are its integers' bit patterns); and the names of the I32 ones.
pub fn tiny_dsv4_weights(s: &TinyDsv4Spec) -> (Vec<NamedWeights>, Vec<String>) {
    let vocab = tiny_vocab().tokens.len();
    let mut b = Builder {
        specs: Vec::new(),
        ints: Vec::new(),
        mat_rng: random_weights(s.seed),
        vec_rng: random_weights(s.seed ^ 0x5eed),
    };
    let (e, hc_dim) = (s.embd, s.hc * s.embd);
    b.mat("token_embd.weight".into(), vec![e, vocab], 0.5);
    b.mat("output.weight".into(), vec![e, vocab], 0.25);
    b.mat("output_hc_fn.weight".into(), vec![hc_dim, s.hc], 0.1);
    b.vec1("output_norm.weight".into(), e, 0.1, 1.0);
    b.vec1("output_hc_base.weight".into(), s.hc, 0.1, 0.0);
    b.vec1("output_hc_scale.weight".into(), 1, 0.1, 1.0);
    for (l, &ratio) in s.ratios.iter().enumerate() {
        attention(&mut b, s, l);
        if ratio != 0 {
            compressor(&mut b, s, l, ratio as usize);
        }
        ffn(&mut b, s, l, vocab);
    }
    (b.specs, b.ints)
}

/// Every tensor, random, in file order; and the names of the I32 ones.
fn tensors(s: &TinyDsv4Spec) -> Result<Tensors, ModelError> {
    let (specs, ints) = tiny_dsv4_weights(s);
    let mut out = Vec::with_capacity(specs.len());
    for (name, ne, data) in specs {
        let shape: Vec<usize> = ne.iter().rev().copied().collect();
        let t = Tensor::from_vec(data, shape, &Device::Cpu)?;
        out.push((name, QTensor::quantize(&t, GgmlDType::F32)?));
    }
    Ok((out, ints))
}

/// Layer `l`'s attention and hyper-connection tensors.
fn attention<M, V>(b: &mut Builder<M, V>, s: &TinyDsv4Spec, l: usize)
where
    M: FnMut(usize, f32, f32) -> Vec<f32>,
    V: FnMut(usize, f32, f32) -> Vec<f32>,
{
    let n = |x: &str| format!("blk.{l}.{x}");
    let (e, hd) = (s.embd, s.head_dim);
    let (hc_dim, hc_mix) = (s.hc * e, (2 + s.hc) * s.hc);
    b.vec1(n("attn_norm.weight"), e, 0.1, 1.0);
    b.vec1(n("attn_sinks.weight"), s.heads, 0.5, 0.0);
    b.mat(n("attn_q_a.weight"), vec![e, s.q_lora_rank], 0.25);
    b.vec1(n("attn_q_a_norm.weight"), s.q_lora_rank, 0.1, 1.0);
    b.mat(
        n("attn_q_b.weight"),
        vec![s.q_lora_rank, s.heads * hd],
        0.25,
    );
    b.mat(n("attn_kv.weight"), vec![e, hd], 0.25);
    b.vec1(n("attn_kv_a_norm.weight"), hd, 0.1, 1.0);
    // Stored 2-D; the loader reshapes it to (heads·dim / groups, rank, groups).
    let o_in = s.heads * hd / s.out_groups;
    let o_out = s.out_lora_rank * s.out_groups;
    b.mat(n("attn_output_a.weight"), vec![o_in, o_out], 0.1);
    b.mat(n("attn_output_b.weight"), vec![o_out, e], 0.25);
    for which in ["attn", "ffn"] {
        b.mat(
            n(&format!("hc_{which}_fn.weight")),
            vec![hc_dim, hc_mix],
            0.1,
        );
        b.vec1(n(&format!("hc_{which}_base.weight")), hc_mix, 0.1, 0.0);
        b.vec1(n(&format!("hc_{which}_scale.weight")), 3, 0.1, 1.0);
    }
}

/// Layer `l`'s compressor (ratio 4: twice as wide, overlapping blocks) and, at ratio 4, the
/// indexer with its own compressor.
fn compressor<M, V>(b: &mut Builder<M, V>, s: &TinyDsv4Spec, l: usize, ratio: usize)
where
    M: FnMut(usize, f32, f32) -> Vec<f32>,
    V: FnMut(usize, f32, f32) -> Vec<f32>,
{
    let n = |x: &str| format!("blk.{l}.{x}");
    let (e, hd) = (s.embd, s.head_dim);
    let coff = if ratio == 4 { 2 } else { 1 };
    b.mat(n("attn_compressor_kv.weight"), vec![e, coff * hd], 0.25);
    b.mat(n("attn_compressor_gate.weight"), vec![e, coff * hd], 0.25);
    b.mat(n("attn_compressor_ape.weight"), vec![coff * hd, ratio], 0.5);
    b.vec1(n("attn_compressor_norm.weight"), hd, 0.1, 1.0);
    if ratio == 4 {
        let id = s.indexer_dim;
        b.mat(n("indexer.proj.weight"), vec![e, s.indexer_heads], 0.25);
        let q = vec![s.q_lora_rank, s.indexer_heads * id];
        b.mat(n("indexer.attn_q_b.weight"), q, 0.25);
        b.mat(n("indexer_compressor_kv.weight"), vec![e, 2 * id], 0.25);
        b.mat(n("indexer_compressor_gate.weight"), vec![e, 2 * id], 0.25);
        b.mat(n("indexer_compressor_ape.weight"), vec![2 * id, ratio], 0.5);
        b.vec1(n("indexer_compressor_norm.weight"), id, 0.1, 1.0);
    }
}

/// Layer `l`'s router (a token → experts table on hash layers), experts and shared expert.
fn ffn<M, V>(b: &mut Builder<M, V>, s: &TinyDsv4Spec, l: usize, vocab: usize)
where
    M: FnMut(usize, f32, f32) -> Vec<f32>,
    V: FnMut(usize, f32, f32) -> Vec<f32>,
{
    let n = |x: &str| format!("blk.{l}.{x}");
    let (e, f, x) = (s.embd, s.expert_ffn, s.experts);
    b.mat(n("ffn_gate_inp.weight"), vec![e, x], 0.25);
    if l < s.hash_layers {
        // Distinct experts per token: token t uses experts t, t+1, … (mod the count).
        let used = s.experts_used;
        let ids = (0..vocab)
            .flat_map(|t| (0..used).map(move |k| ((t + k) % x) as u32))
            .collect();
        b.ints(n("ffn_gate_tid2eid.weight"), vec![used, vocab], ids);
    } else {
        b.vec1(n("exp_probs_b.bias"), x, 0.1, 0.0);
    }
    b.vec1(n("ffn_norm.weight"), e, 0.1, 1.0);
    b.mat(n("ffn_gate_exps.weight"), vec![e, f, x], 0.25);
    b.mat(n("ffn_down_exps.weight"), vec![f, e, x], 0.25);
    b.mat(n("ffn_up_exps.weight"), vec![e, f, x], 0.25);
    b.mat(n("ffn_gate_shexp.weight"), vec![e, f], 0.25);
    b.mat(n("ffn_down_shexp.weight"), vec![f, e], 0.25);
    b.mat(n("ffn_up_shexp.weight"), vec![e, f], 0.25);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_file_is_deterministic_with_every_kind_of_layer_and_an_i32_table() {
        let d = tempfile::tempdir().unwrap();
        let (a, b) = (d.path().join("a.gguf"), d.path().join("b.gguf"));
        let s = TinyDsv4Spec::default();
        write_tiny_dsv4(&a, &s).unwrap();
        write_tiny_dsv4(&b, &s).unwrap();
        let bytes = std::fs::read(&a).unwrap();
        assert_eq!(bytes, std::fs::read(&b).unwrap());
        // A well-formed header (every length and count within the file).
        let mut f = std::fs::File::open(&a).unwrap();
        crate::gguf::scan::scan(&mut f, bytes.len() as u64).unwrap();
        let (t, ints) = tensors(&s).unwrap();
        let names: Vec<&str> = t.iter().map(|(n, _)| n.as_str()).collect();
        for name in [
            "blk.1.indexer.proj.weight",
            "blk.2.attn_compressor_ape.weight",
            "blk.0.ffn_gate_tid2eid.weight",
            "blk.5.exp_probs_b.bias",
        ] {
            assert!(names.contains(&name), "{name}");
        }
        // A ratio-128 layer has no indexer; a window layer no compressor; a hash layer no bias.
        assert!(!names.contains(&"blk.2.indexer.proj.weight"));
        assert!(!names.contains(&"blk.0.attn_compressor_kv.weight"));
        assert!(!names.contains(&"blk.0.exp_probs_b.bias"));
        // The attention compressor of a ratio-4 layer is twice as wide: ne (embd, 2·head_dim).
        let kv = &t[names
            .iter()
            .position(|n| *n == "blk.1.attn_compressor_kv.weight")
            .unwrap()];
        assert_eq!(kv.1.shape().dims(), &[256, 64]);
        // The token → experts table is typed I32 in the header.
        assert_eq!(ints, vec!["blk.0.ffn_gate_tid2eid.weight".to_string()]);
        let name = "blk.0.ffn_gate_tid2eid.weight";
        let mut key = (name.len() as u64).to_le_bytes().to_vec();
        key.extend_from_slice(name.as_bytes());
        let at = bytes
            .windows(key.len())
            .position(|w| w == key.as_slice())
            .unwrap();
        let ty_at = at + key.len() + 4 + 8 * 2;
        assert_eq!(&bytes[ty_at..ty_at + 4], &GGML_TYPE_I32.to_le_bytes());
    }
}
