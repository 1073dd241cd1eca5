//! Loading a DeepSeek-V4 GGUF (`general.architecture = deepseek4`) into [`Dsv4`]: the
//! configuration from llama.cpp's metadata keys and the tensors by name. candle's reader
//! refuses GGML's I32 type (the hash layers' token → experts table), so this reads the file
//! itself, after `gguf_scan` has checked every length and count of the header against the
//! file; every tensor's extent is checked against the file before it is read. F32 and I32
//! tensors only, for now (the tiny test model); the file is read whole.

use std::collections::HashMap;
use std::path::Path;

use crate::dsv4::{Dsv4, Dsv4Config, Weights};
use crate::error::ModelError;

/// A metadata value, as much as the configuration needs.
#[derive(Clone, Debug)]
enum Meta {
    Int(i64),
    Float(f64),
    Bool(bool),
    Str(String),
    Arr(Vec<Meta>),
}

struct Reader<'a> {
    b: &'a [u8],
    pos: usize,
}

impl Reader<'_> {
    /// The next `n` bytes (the scan has checked they exist; a short file is still an error).
    fn take(&mut self, n: usize) -> Result<&[u8], String> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.b.len());
        let end = end.ok_or_else(|| format!("truncated at byte {}", self.pos))?;
        let s = &self.b[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    fn u32(&mut self) -> Result<u32, String> {
        Ok(u32::from_le_bytes(
            self.take(4)?.try_into().expect("4 bytes"),
        ))
    }

    fn u64(&mut self) -> Result<u64, String> {
        Ok(u64::from_le_bytes(
            self.take(8)?.try_into().expect("8 bytes"),
        ))
    }

    fn string(&mut self) -> Result<String, String> {
        let n = self.u64()? as usize;
        Ok(String::from_utf8_lossy(self.take(n)?).into_owned())
    }

    fn value(&mut self, ty: u32) -> Result<Meta, String> {
        let fixed = |r: &mut Self, n: usize| -> Result<[u8; 8], String> {
            let mut a = [0u8; 8];
            a[..n].copy_from_slice(r.take(n)?);
            Ok(a)
        };
        Ok(match ty {
            0 => Meta::Int(fixed(self, 1)?[0] as i64),
            1 => Meta::Int(fixed(self, 1)?[0] as i8 as i64),
            2 => Meta::Int(u16::from_le_bytes(self.take(2)?.try_into().expect("2")) as i64),
            3 => Meta::Int(i16::from_le_bytes(self.take(2)?.try_into().expect("2")) as i64),
            4 => Meta::Int(self.u32()? as i64),
            5 => Meta::Int(self.u32()? as i32 as i64),
            6 => Meta::Float(f32::from_bits(self.u32()?) as f64),
            7 => Meta::Bool(fixed(self, 1)?[0] != 0),
            8 => Meta::Str(self.string()?),
            9 => {
                let et = self.u32()?;
                let n = self.u64()?;
                let mut v = Vec::with_capacity((n as usize).min(1 << 16));
                for _ in 0..n {
                    v.push(self.value(et)?);
                }
                Meta::Arr(v)
            }
            10 => Meta::Int(self.u64()? as i64),
            11 => Meta::Int(self.u64()? as i64),
            12 => Meta::Float(f64::from_bits(self.u64()?)),
            t => return Err(format!("metadata value type {t}")),
        })
    }
}

/// GGML type ids this loader reads, and their element size.
const F32: u32 = 0;
const I32: u32 = 26;

/// The header's metadata and tensor infos (name, `ne`, type, offset), and where data starts.
type Header = (
    HashMap<String, Meta>,
    Vec<(String, Vec<usize>, u32, u64)>,
    usize,
);

fn header(b: &[u8]) -> Result<Header, String> {
    let mut r = Reader { b, pos: 4 };
    let version = r.u32()?;
    if version < 2 {
        return Err(format!("GGUF version {version}: 2 or later"));
    }
    let (n_tensors, n_kv) = (r.u64()?, r.u64()?);
    let mut meta = HashMap::new();
    for _ in 0..n_kv {
        let k = r.string()?;
        let ty = r.u32()?;
        meta.insert(k, r.value(ty)?);
    }
    let mut infos = Vec::new();
    for _ in 0..n_tensors {
        let name = r.string()?;
        let nd = r.u32()? as usize;
        let mut ne = Vec::with_capacity(nd.min(4));
        for _ in 0..nd {
            ne.push(r.u64()? as usize);
        }
        let ty = r.u32()?;
        infos.push((name, ne, ty, r.u64()?));
    }
    let align = match meta.get("general.alignment") {
        Some(Meta::Int(a)) if *a > 0 => *a as usize,
        _ => 32,
    };
    Ok((meta, infos, r.pos.div_ceil(align) * align))
}

fn bad(path: &Path, key: &str, reason: &str) -> ModelError {
    ModelError::Metadata {
        path: path.display().to_string(),
        key: key.into(),
        reason: reason.into(),
    }
}

/// Typed reads of `deepseek4.*` keys; errors name the key.
struct Keys<'a> {
    path: &'a Path,
    m: &'a HashMap<String, Meta>,
}

impl Keys<'_> {
    fn get(&self, k: &str) -> (String, Option<&Meta>) {
        let key = format!("deepseek4.{k}");
        let v = self.m.get(&key);
        (key, v)
    }

    fn int(&self, k: &str) -> Result<usize, ModelError> {
        match self.get(k) {
            (_, Some(Meta::Int(v))) if *v >= 0 => Ok(*v as usize),
            (key, Some(_)) => Err(bad(self.path, &key, "not a non-negative integer")),
            (key, None) => Err(bad(self.path, &key, "missing")),
        }
    }

    fn float(&self, k: &str) -> Result<f32, ModelError> {
        match self.get(k) {
            (_, Some(Meta::Float(v))) => Ok(*v as f32),
            (_, Some(Meta::Int(v))) => Ok(*v as f32),
            (key, Some(_)) => Err(bad(self.path, &key, "not a number")),
            (key, None) => Err(bad(self.path, &key, "missing")),
        }
    }

    /// An array of numbers, or one number for every layer.
    fn per_layer(&self, k: &str, layers: usize) -> Result<Vec<f64>, ModelError> {
        match self.get(k) {
            (key, Some(Meta::Arr(a))) => {
                let v: Option<Vec<f64>> = a
                    .iter()
                    .map(|x| match x {
                        Meta::Int(i) => Some(*i as f64),
                        Meta::Float(f) => Some(*f),
                        _ => None,
                    })
                    .collect();
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
fn config(path: &Path, m: &HashMap<String, Meta>) -> Result<Dsv4Config, ModelError> {
    let k = Keys { path, m };
    let layers = k.int("block_count")?;
    let ratios: Vec<usize> = k
        .per_layer("attention.compress_ratios", layers)?
        .iter()
        .map(|&r| r as usize)
        .collect();
    if ratios.iter().any(|r| ![0, 4, 128].contains(r)) {
        let key = "deepseek4.attention.compress_ratios";
        return Err(bad(path, key, "one of 0, 4, 128 per block"));
    }
    if k.get("expert_gating_func").1.is_some() && k.int("expert_gating_func")? != 4 {
        let key = "deepseek4.expert_gating_func";
        return Err(bad(path, key, "only sqrt-softplus (4) is supported"));
    }
    let vocab = match m.get("tokenizer.ggml.tokens") {
        Some(Meta::Arr(a)) => a.len(),
        _ => k.int("vocab_size")?,
    };
    let clamp = k.per_layer("swiglu_clamp_exp", layers)?;
    let norm = matches!(k.get("expert_weights_norm").1, Some(Meta::Bool(true)));
    Ok(Dsv4Config {
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
    })
}

/// Loads a DeepSeek-V4 GGUF.
pub fn load_dsv4(path: &Path) -> Result<Dsv4, ModelError> {
    let p = path.display().to_string();
    let not_gguf = |reason: String| ModelError::NotGguf {
        path: p.clone(),
        reason,
    };
    let b = std::fs::read(path).map_err(|e| ModelError::Open {
        path: p.clone(),
        reason: e.to_string(),
    })?;
    crate::gguf_scan::scan(&mut std::io::Cursor::new(&b), b.len() as u64).map_err(not_gguf)?;
    let (meta, infos, data) = header(&b).map_err(not_gguf)?;
    match meta.get("general.architecture") {
        Some(Meta::Str(a)) if a == "deepseek4" => {}
        other => {
            let found = match other {
                Some(Meta::Str(a)) => a.clone(),
                _ => "(none)".into(),
            };
            return Err(ModelError::Architecture { path: p, found });
        }
    }
    let cfg = config(path, &meta)?;
    let mut w: Weights = HashMap::new();
    for (name, ne, ty, off) in infos {
        let terr = |reason: String| ModelError::Tensor {
            path: p.clone(),
            name: name.clone(),
            reason,
        };
        if ty != F32 && ty != I32 {
            return Err(terr(format!(
                "GGML type {ty}: only F32 and I32 are read yet"
            )));
        }
        let n = ne.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
        let bytes = n.and_then(|n| n.checked_mul(4));
        let start = data.checked_add(off as usize);
        let end = bytes.zip(start).and_then(|(len, s)| s.checked_add(len));
        let (Some(start), Some(end)) = (start, end.filter(|&e| e <= b.len())) else {
            return Err(terr("its data lies past the end of the file".into()));
        };
        // I32 values travel as their bit patterns (`Dsv4` reads them with `to_bits`).
        let vals = b[start..end]
            .chunks_exact(4)
            .map(|c| f32::from_bits(u32::from_le_bytes(c.try_into().expect("4 bytes"))))
            .collect();
        w.insert(name, (ne, vals));
    }
    Dsv4::new(cfg, w).map_err(|reason| ModelError::Tensor {
        path: p,
        name: "(the model)".into(),
        reason,
    })
}
