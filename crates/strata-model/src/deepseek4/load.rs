//! Loading a DeepSeek-V4 GGUF (`general.architecture = deepseek4`) into [`Dsv4`]: the
//! configuration from llama.cpp's metadata keys and the tensors by name. candle's reader
//! refuses GGML's I32 type (the hash layers' token → experts table), so this reads the file
//! itself, after `gguf::scan` has checked every length and count of the header against the
//! file. The configuration is checked (`Dsv4Config::validate`), then every tensor's type and
//! extent against the file, before any weight is read; then each tensor is read on its own. F32
//! and I32 tensors only, for now (the tiny test model).

use std::collections::HashMap;
use std::path::Path;

use crate::deepseek4::{Dsv4, Dsv4Config, Dsv4Part, Weights};
use candle_core::quantized::gguf_file::Value;

use crate::error::ModelError;
use crate::gguf::meta;

/// GGML type ids this loader reads.
const F32: u32 = 0;
const I32: u32 = 26;

fn bad(path: &Path, key: &str, reason: &str) -> ModelError {
    ModelError::Metadata {
        path: path.display().to_string(),
        key: key.into(),
        reason: reason.into(),
    }
}

/// An integer of any width.
fn int_of(v: &Value) -> Option<i64> {
    Some(match v {
        Value::U8(x) => *x as i64,
        Value::I8(x) => *x as i64,
        Value::U16(x) => *x as i64,
        Value::I16(x) => *x as i64,
        Value::U32(x) => *x as i64,
        Value::I32(x) => *x as i64,
        Value::U64(x) => i64::try_from(*x).ok()?,
        Value::I64(x) => *x,
        _ => return None,
    })
}

/// A number: a float or an integer.
fn number_of(v: &Value) -> Option<f64> {
    match v {
        Value::F32(f) => Some(*f as f64),
        Value::F64(f) => Some(*f),
        v => int_of(v).map(|i| i as f64),
    }
}

/// Typed reads of `deepseek4.*` keys; errors name the key.
struct Keys<'a> {
    path: &'a Path,
    m: &'a HashMap<String, Value>,
}

impl Keys<'_> {
    fn get(&self, k: &str) -> (String, Option<&Value>) {
        let key = format!("deepseek4.{k}");
        let v = self.m.get(&key);
        (key, v)
    }

    fn int(&self, k: &str) -> Result<usize, ModelError> {
        match self.get(k) {
            (_, Some(v)) if int_of(v).is_some_and(|i| i >= 0) => {
                Ok(int_of(v).expect("checked") as usize)
            }
            (key, Some(_)) => Err(bad(self.path, &key, "not a non-negative integer")),
            (key, None) => Err(bad(self.path, &key, "missing")),
        }
    }

    fn float(&self, k: &str) -> Result<f32, ModelError> {
        match self.get(k) {
            (key, Some(v)) => number_of(v)
                .map(|f| f as f32)
                .ok_or_else(|| bad(self.path, &key, "not a number")),
            (key, None) => Err(bad(self.path, &key, "missing")),
        }
    }

    /// An array of numbers, or one number for every layer.
    fn per_layer(&self, k: &str, layers: usize) -> Result<Vec<f64>, ModelError> {
        match self.get(k) {
            (key, Some(Value::Array(a))) => {
                let v: Option<Vec<f64>> = a.iter().map(number_of).collect();
                match v {
                    Some(v) if v.len() >= layers => Ok(v[..layers].to_vec()),
                    _ => Err(bad(self.path, &key, "needs a number per block")),
                }
            }
            _ => Ok(vec![self.float(k)? as f64; layers]),
        }
    }
}

/// The configuration from the `deepseek4.*` keys.
fn config(path: &Path, m: &HashMap<String, Value>) -> Result<Dsv4Config, ModelError> {
    let k = Keys { path, m };
    let layers = k.int("block_count")?;
    if !(1..=crate::deepseek4::config::MAX_LAYERS).contains(&layers) {
        let max = crate::deepseek4::config::MAX_LAYERS;
        return Err(bad(
            path,
            "deepseek4.block_count",
            &format!("{layers}: expected 1 to {max}"),
        ));
    }
    let ratios: Vec<usize> = k
        .per_layer("attention.compress_ratios", layers)?
        .iter()
        .map(|&r| {
            if r == 0.0 || r == 4.0 || r == 128.0 {
                r as usize
            } else {
                usize::MAX
            }
        })
        .collect();
    if ratios.contains(&usize::MAX) {
        let key = "deepseek4.attention.compress_ratios";
        return Err(bad(path, key, "one of 0, 4, 128 per block"));
    }
    if k.get("expert_gating_func").1.is_some() && k.int("expert_gating_func")? != 4 {
        let key = "deepseek4.expert_gating_func";
        return Err(bad(path, key, "only sqrt-softplus (4) is supported"));
    }
    let vocab = match m.get("tokenizer.ggml.tokens") {
        Some(Value::Array(a)) => a.len(),
        _ => k.int("vocab_size")?,
    };
    let clamp = k.per_layer("swiglu_clamp_exp", layers)?;
    let norm = matches!(k.get("expert_weights_norm").1, Some(Value::Bool(true)));
    let cfg = Dsv4Config {
        embd: k.int("embedding_length")?,
        vocab,
        context: k.int("context_length")?,
        heads: k.int("attention.head_count")?,
        head_dim: k.int("attention.key_length")?,
        rope_dims: k.int("rope.dimension_count")?,
        q_lora_rank: k.int("attention.q_lora_rank")?,
        window: k.int("attention.sliding_window")?,
        ratios,
        experts: k.int("expert_count")?,
        experts_used: k.int("expert_used_count")?,
        expert_ffn: k.int("expert_feed_forward_length")?,
        hash_layers: k.int("hash_layer_count")?,
        indexer_heads: k.int("attention.indexer.head_count")?,
        indexer_dim: k.int("attention.indexer.key_length")?,
        indexer_top_k: k.int("attention.indexer.top_k")?,
        out_groups: k.int("attention.output_group_count")?,
        out_lora_rank: k.int("attention.output_lora_rank")?,
        hc: k.int("hyper_connection.count")?,
        sinkhorn_iters: k.int("hyper_connection.sinkhorn_iterations")?,
        eps_rms: k.float("attention.layer_norm_rms_epsilon")?,
        eps_hc: k.float("hyper_connection.epsilon")?,
        rope_base: k.float("rope.freq_base")?,
        compress_rope_base: k.float("attention.compress_rope_freq_base")?,
        swiglu_clamp: clamp.iter().map(|&c| c as f32).collect(),
        expert_weights_scale: k.float("expert_weights_scale")?,
        expert_weights_norm: norm,
    };
    cfg.validate()
        .map_err(|reason| bad(path, "deepseek4.*", &reason))?;
    Ok(cfg)
}

/// The hyper-parameters of a DeepSeek-V4 GGUF from its header alone (sizing a model of any
/// size without reading its weights).
pub fn read_dsv4_config(path: &Path) -> Result<Dsv4Config, ModelError> {
    dsv4_config(path, &meta::read(path)?.metadata)
}

/// [`read_dsv4_config`] from a header already read (`m`, of the file at `path`).
pub(crate) fn dsv4_config(
    path: &Path,
    m: &HashMap<String, Value>,
) -> Result<Dsv4Config, ModelError> {
    check_architecture(&path.display().to_string(), m)?;
    config(path, m)
}

fn check_architecture(p: &str, meta: &HashMap<String, Value>) -> Result<(), ModelError> {
    match meta.get("general.architecture") {
        Some(Value::String(a)) if a == "deepseek4" => Ok(()),
        other => {
            let found = match other {
                Some(Value::String(a)) => a.clone(),
                _ => "(none)".into(),
            };
            Err(ModelError::Architecture {
                path: p.into(),
                found,
            })
        }
    }
}

/// Every tensor the model reads has its shape, checked from the header before any is read (a
/// rank cuts each as it is read: the whole model is never in memory at once).
fn check_shapes(
    p: &str,
    cfg: &Dsv4Config,
    tensors: &[(String, Vec<usize>, u32, u64)],
) -> Result<(), ModelError> {
    let want: HashMap<String, Vec<usize>> = crate::deepseek4::expected(cfg).into_iter().collect();
    for (name, ne, _, _) in tensors {
        if let Some(exp) = want.get(name).filter(|e| *e != ne) {
            return Err(ModelError::Tensor {
                path: p.to_string(),
                name: name.clone(),
                reason: format!("shape {ne:?}, expected {exp:?}"),
            });
        }
    }
    Ok(())
}

/// Loads a DeepSeek-V4 GGUF.
pub fn load_dsv4(path: &Path) -> Result<Dsv4, ModelError> {
    load_dsv4_part(path, None)
}

/// Loads a tensor-parallel rank's part of a DeepSeek-V4 GGUF (None: the whole model).
pub fn load_dsv4_part(path: &Path, part: impl Into<Option<Dsv4Part>>) -> Result<Dsv4, ModelError> {
    let part = part.into();
    use std::io::{Read, Seek, SeekFrom};
    let p = path.display().to_string();
    let open_err = |e: std::io::Error| ModelError::Open {
        path: p.clone(),
        reason: e.to_string(),
    };
    // The header alone first: the configuration, and every tensor's type and extent, are
    // checked before any weight is read (a quantized file is refused by name, not read).
    let h = meta::read(path)?;
    check_architecture(&p, &h.metadata)?;
    let cfg = config(path, &h.metadata)?;
    let mut f = crate::gguf::open_regular(path).map_err(open_err)?;
    let len = f.metadata().map_err(open_err)?.len();
    let mut extents = Vec::with_capacity(h.tensors.len());
    let mut placed = Vec::with_capacity(h.tensors.len());
    for (name, ne, ty, off) in &h.tensors {
        let terr = |reason: String| ModelError::Tensor {
            path: p.clone(),
            name: name.clone(),
            reason,
        };
        if *ty != F32 && *ty != I32 {
            return Err(terr(format!(
                "GGML type {ty}: only F32 and I32 are read yet"
            )));
        }
        let n = ne.iter().try_fold(1u64, |a, &d| a.checked_mul(d as u64));
        let bytes = n.and_then(|n| n.checked_mul(4));
        let start = (h.data_start as u64).checked_add(*off);
        let end = bytes.zip(start).and_then(|(n, s)| s.checked_add(n));
        let (Some(start), Some(end)) = (start, end.filter(|&e| e <= len)) else {
            return Err(terr("its data lies past the end of the file".into()));
        };
        extents.push((start, end));
        placed.push((name.as_str(), *off, end - start));
    }
    // Tensors of a real file do not overlap (else a few bytes of header could make every
    // tensor the whole file, and the weights its square).
    crate::gguf::check_extents(&p, h.align, placed)?;
    check_shapes(&p, &cfg, &h.tensors)?;
    let part = part.unwrap_or_else(|| Dsv4Part::whole(&cfg));
    part.check(&cfg).map_err(ModelError::Forward)?;
    let mut w: Weights = HashMap::new();
    for ((name, ne, _, _), (start, end)) in h.tensors.into_iter().zip(extents) {
        // Bounded by the file's length (checked above).
        let mut raw = vec![0u8; (end - start) as usize];
        f.seek(SeekFrom::Start(start)).map_err(open_err)?;
        f.read_exact(&mut raw).map_err(open_err)?;
        // I32 values travel as their bit patterns (`Dsv4` reads them with `to_bits`).
        let vals = raw
            .chunks_exact(4)
            .map(|c| f32::from_bits(u32::from_le_bytes(c.try_into().expect("4 bytes"))))
            .collect();
        let cut = part.cut_one(&cfg, &name, ne, vals);
        w.insert(name, cut);
    }
    Dsv4::from_cut(cfg, w, part).map_err(|reason| ModelError::Tensor {
        path: p,
        name: "(the model)".into(),
        reason,
    })
}
