//! Loading a model (or a tensor-parallel rank's part of it) from a GGUF file.

use std::ops::Range;

use candle_core::{Device, Tensor};

use super::{Layer, Model};
use crate::error::ModelError;
use crate::gguf::{Config, Gguf};
use crate::qmat::QMatrix;
use crate::shard::Part;

fn vec1(t: &Tensor) -> Result<Vec<f32>, ModelError> {
    Ok(t.flatten_all()?.to_vec1::<f32>()?)
}

impl Model {
    /// Loads every weight, matrices in their block formats.
    pub fn load(g: &mut Gguf) -> Result<Model, ModelError> {
        let c = &g.config;
        let whole = Part::whole(c);
        Model::load_part(g, &whole)
    }

    /// Loads the weights of one tensor-parallel rank ([`Part`]): its heads' rows of Q, K, V
    /// and columns of the output projection, its slice of the feed-forward, its rows of the
    /// vocabulary. Its config states the rank's heads and feed-forward size.
    pub(crate) fn load_part(g: &mut Gguf, part: &Part) -> Result<Model, ModelError> {
        let c = g.config.clone();
        if !c.head_dim.is_multiple_of(16)
            || !c.hidden.is_multiple_of(32)
            || !c.ffn.is_multiple_of(32)
            || !(c.heads * c.head_dim).is_multiple_of(32)
        {
            return Err(ModelError::Metadata {
                path: g.path.display().to_string(),
                key: format!("{}.embedding_length", c.arch.name()),
                reason: format!(
                    "head dimension {} must be a multiple of 16, hidden size {}, feed-forward \
                     size {} and heads × head dimension of 32 (attention and Q8_0 kernels)",
                    c.head_dim, c.hidden, c.ffn
                ),
            });
        }
        let dev = Device::Cpu;
        let has_output = g.content_has("output.weight");
        let freqs = g.content_has("rope_freqs.weight");
        let vec = |g: &mut Gguf, name: &str| -> Result<Vec<f32>, ModelError> {
            vec1(&g.tensor(name)?.dequantize(&dev)?)
        };
        let norm = vec(g, "output_norm.weight")?;
        let freqs = if freqs {
            Some(vec(g, "rope_freqs.weight")?)
        } else {
            None
        };
        let vocab = Some(&part.vocab);
        let embed = matrix(g, part, "token_embd.weight", vocab, None)?;
        let output = if has_output {
            Some(matrix(g, part, "output.weight", vocab, None)?)
        } else {
            None
        };
        let layers = (0..c.layers)
            .map(|l| load_layer(&c, l, g, part))
            .collect::<Result<Vec<_>, _>>()?;
        let (cos, sin) = rope_tables(&c, freqs.as_deref());
        let mut config = c;
        config.heads = part.heads.q.len();
        config.kv_heads = part.heads.kv.len();
        config.ffn = part.ffn.len();
        Ok(Model {
            config,
            embed,
            output,
            norm,
            layers,
            cos,
            sin,
            threads: 2,
            quantized_decode: true,
            gather_budget: super::attend::GATHER_BYTES,
            kind: part.kind,
            k_dtype: strata_kv::dtype::Dtype::F16,
            v_dtype: strata_kv::dtype::Dtype::F16,
            kind_name: part.kind_name.clone(),
            vocab_rows: part.vocab.clone(),
        })
    }
}

/// Layer `l`'s weights from the file: matrices in their block formats, the rest as f32.
fn load_layer(c: &Config, l: usize, g: &mut Gguf, part: &Part) -> Result<Layer, ModelError> {
    let hd = c.head_dim;
    let (q, kv) = (&part.heads.q, &part.heads.kv);
    let (q, kv) = (q.start * hd..q.end * hd, kv.start * hd..kv.end * hd);
    let mut vec = |n: &str| -> Result<Vec<f32>, ModelError> {
        vec1(
            &g.tensor(&format!("blk.{l}.{n}"))?
                .dequantize(&Device::Cpu)?,
        )
    };
    let bias = if c.arch.qkv_bias() {
        let mut slice = |n: &str, r: &std::ops::Range<usize>| -> Result<Vec<f32>, ModelError> {
            let b = vec(n)?;
            b.get(r.clone()).map(<[f32]>::to_vec).ok_or_else(|| {
                ModelError::Forward(format!("blk.{l}.{n}: {} values, expected more", b.len()))
            })
        };
        Some([
            slice("attn_q.bias", &q)?,
            slice("attn_k.bias", &kv)?,
            slice("attn_v.bias", &kv)?,
        ])
    } else {
        None
    };
    let qk_norm = if c.arch.qk_norm() {
        Some([vec("attn_q_norm.weight")?, vec("attn_k_norm.weight")?])
    } else {
        None
    };
    let (attn_norm, ffn_norm) = (vec("attn_norm.weight")?, vec("ffn_norm.weight")?);
    // A rank's output rows (Q/K/V of its heads, its gate/up slice) or input columns (the
    // output and down projections over its heads / slice): the whole matrix on one rank.
    let mut w = |n: &str, rows: Option<&Range<usize>>, cols: Option<&Range<usize>>| {
        matrix(g, part, &format!("blk.{l}.{n}.weight"), rows, cols)
    };
    let ffn = &part.ffn;
    Ok(Layer {
        bias,
        qk_norm,
        attn_norm,
        ffn_norm,
        wq: w("attn_q", Some(&q), None)?,
        wk: w("attn_k", Some(&kv), None)?,
        wv: w("attn_v", Some(&kv), None)?,
        wo: w("attn_output", None, Some(&q))?,
        wg: w("ffn_gate", Some(ffn), None)?,
        wu: w("ffn_up", Some(ffn), None)?,
        wd: w("ffn_down", None, Some(ffn))?,
    })
}

/// RoPE's cos and sin per position and pair; Llama 3's frequency factors divide each pair's
/// angle (as ggml's rope_ext).
fn rope_tables(c: &Config, freqs: Option<&[f32]>) -> (Vec<f32>, Vec<f32>) {
    let half_dim = c.head_dim / 2;
    let mut cos = Vec::with_capacity(c.context_length * half_dim);
    let mut sin = Vec::with_capacity(c.context_length * half_dim);
    for p in 0..c.context_length {
        for i in 0..half_dim {
            let ff = freqs.map_or(1.0, |f| f[i] as f64);
            let theta =
                p as f64 * (c.rope_base as f64).powf(-2.0 * i as f64 / c.head_dim as f64) / ff;
            cos.push(theta.cos() as f32);
            sin.push(theta.sin() as f32);
        }
    }
    (cos, sin)
}

/// A rank's piece of weight matrix `name`: `rows` of its outputs read alone from the file
/// where its format is kept as stored, else the whole tensor read (and converted) and cut by
/// [`Part::slice`]; `cols` of its inputs cut from whole rows.
fn matrix(
    g: &mut Gguf,
    part: &Part,
    name: &str,
    rows: Option<&Range<usize>>,
    cols: Option<&Range<usize>>,
) -> Result<QMatrix, ModelError> {
    match g.matrix_rows(name, rows)? {
        Some(m) => part.slice(m, None, cols, name),
        None => {
            let m = QMatrix::from_qtensor(&g.tensor(name)?, name)?;
            part.slice(m, rows, cols, name)
        }
    }
}
