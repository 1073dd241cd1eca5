//! GGUF loading and validation (the llama family: llama, qwen2, qwen3): the header through
//! `meta` (after `scan` bounded it), tensors through candle.

pub(crate) mod meta;
pub mod scan;

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufReader, Read, Seek, SeekFrom};
use std::ops::Range;
use std::path::{Path, PathBuf};

use candle_core::quantized::gguf_file::{Content, Value};
use candle_core::quantized::QTensor;
use candle_core::Device;

use crate::error::ModelError;

/// candle errors may carry a backtrace after the message; keep the message.
fn first_line(e: &impl std::fmt::Display) -> String {
    e.to_string()
        .lines()
        .next()
        .unwrap_or("")
        .trim()
        .to_string()
}

/// The transformer families this forward pass runs (`general.architecture`). Mistral's
/// files are `llama`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    Llama,
    /// Q/K/V projections with a bias; NeoX RoPE.
    Qwen2,
    /// An RMSNorm per head on Q and K before RoPE; head size from `key_length`; NeoX RoPE.
    Qwen3,
}

impl Arch {
    pub fn name(&self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Qwen2 => "qwen2",
            Arch::Qwen3 => "qwen3",
        }
    }

    fn parse(s: &str) -> Option<Arch> {
        match s {
            "llama" => Some(Arch::Llama),
            "qwen2" => Some(Arch::Qwen2),
            "qwen3" => Some(Arch::Qwen3),
            _ => None,
        }
    }

    /// RoPE rotates (x[i], x[i + d/2]) rather than adjacent pairs.
    pub fn rope_neox(&self) -> bool {
        matches!(self, Arch::Qwen2 | Arch::Qwen3)
    }

    pub fn qkv_bias(&self) -> bool {
        matches!(self, Arch::Qwen2)
    }

    pub fn qk_norm(&self) -> bool {
        matches!(self, Arch::Qwen3)
    }
}

/// Hyper-parameters of a model of the llama family ([`Arch`]).
#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    pub arch: Arch,
    pub vocab: usize,
    pub hidden: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub ffn: usize,
    pub context_length: usize,
    pub rope_base: f32,
    pub rms_eps: f32,
}

/// A GGUF file's header of any architecture, its lengths checked (the tokenizer, the chat
/// template and `general.architecture` come from here).
pub struct GgufHeader {
    pub path: PathBuf,
    pub metadata: HashMap<String, Value>,
}

/// An opened, validated GGUF file of the llama architecture (its header through `Deref`).
pub struct Gguf {
    header: GgufHeader,
    /// The tensor infos (its metadata moved into the header).
    content: Content,
    pub config: Config,
    file: BufReader<File>,
}

impl std::ops::Deref for Gguf {
    type Target = GgufHeader;
    fn deref(&self) -> &GgufHeader {
        &self.header
    }
}

impl GgufHeader {
    /// Reads the header of `path` only.
    pub fn open(path: &Path) -> Result<GgufHeader, ModelError> {
        let h = crate::gguf::meta::read(path)?;
        Ok(GgufHeader {
            path: path.to_path_buf(),
            metadata: h.metadata,
        })
    }

    /// `general.architecture`, when it is a string.
    pub fn architecture(&self) -> Option<&str> {
        self.string("general.architecture")
    }

    /// The chat template, when the file has one.
    pub fn chat_template(&self) -> Result<Option<crate::ChatTemplate>, ModelError> {
        self.string("tokenizer.chat_template")
            .map(crate::ChatTemplate::new)
            .transpose()
    }
}

impl Gguf {
    /// Opens `path`, reads the header and checks architecture, metadata, every tensor's
    /// presence, shape and that its data lies inside the file. Never panics on bad input.
    pub fn open(path: &Path) -> Result<Gguf, ModelError> {
        let (header, file, len) = meta::read_with_file(path)?;
        Gguf::from_header(path, header, file, len)
    }

    /// [`Gguf::open`] from the header `meta::read_with_file` read, its open file and length.
    pub(crate) fn from_header(
        path: &Path,
        header: meta::Header,
        file: BufReader<File>,
        len: u64,
    ) -> Result<Gguf, ModelError> {
        let p = path.display().to_string();
        let align = header.align;
        let mut content = header
            .into_content()
            .map_err(|reason| ModelError::NotGguf {
                path: p.clone(),
                reason,
            })?;
        let config = read_config(&Meta {
            content: &content,
            path: &p,
        })?;
        check_bounds(&content, &config, &p)?;
        check_tensors(&content, &config, &p)?;
        let extents = content.tensor_infos.iter().map(|(name, info)| {
            let d = info.ggml_dtype;
            let bytes = (info.shape.elem_count() / d.block_size()).saturating_mul(d.type_size());
            (name.as_str(), info.offset, bytes as u64)
        });
        let data = check_extents(&p, align, extents.collect())?;
        let end = content.tensor_data_offset.saturating_add(data);
        if end > len {
            return Err(ModelError::Truncated {
                path: p,
                need: end,
                have: len,
            });
        }
        Ok(Gguf {
            header: GgufHeader {
                path: path.to_path_buf(),
                metadata: std::mem::take(&mut content.metadata),
            },
            content,
            config,
            file,
        })
    }

    /// Bytes of all tensors' data in the file, in their stored formats.
    pub fn tensor_bytes(&self) -> u64 {
        self.content
            .tensor_infos
            .values()
            .map(|t| {
                let d = t.ggml_dtype;
                (t.shape.elem_count() / d.block_size() * d.type_size()) as u64
            })
            .sum()
    }

    /// Weights per block of tensor `name`'s stored format (1 for F32/F16, 32, 256 for the
    /// K-quants); None without that tensor.
    pub fn block_weights(&self, name: &str) -> Option<usize> {
        self.content
            .tensor_infos
            .get(name)
            .map(|t| t.ggml_dtype.block_size())
    }

    /// Rows `rows` (all of them: None) of the matrix tensor `name`, read straight from the
    /// file into its block format when [`QMatrix`](crate::qmat::QMatrix) keeps that format:
    /// only those rows' bytes are read (a tensor-parallel rank's share). None when the format
    /// or shape needs [`Gguf::tensor`] and a conversion instead.
    pub fn matrix_rows(
        &mut self,
        name: &str,
        rows: Option<&Range<usize>>,
    ) -> Result<Option<crate::qmat::QMatrix>, ModelError> {
        let err = |reason: String| ModelError::Tensor {
            path: self.header.path.display().to_string(),
            name: name.into(),
            reason,
        };
        let Some(info) = self.content.tensor_infos.get(name) else {
            return Err(err("not in the file".into()));
        };
        let Some(format) = crate::qmat::Format::of(info.ggml_dtype) else {
            return Ok(None);
        };
        let (r, c) = match info.shape.dims() {
            [c] => (1, *c),
            [r, c] => (*r, *c),
            _ => return Ok(None),
        };
        if c == 0 || !c.is_multiple_of(format.block_weights()) {
            return Ok(None);
        }
        let row_bytes = c / format.block_weights() * format.block_bytes();
        let rows = rows.cloned().unwrap_or(0..r);
        if rows.is_empty() || rows.end > r {
            return Err(err(format!("rows {rows:?} of {r}")));
        }
        // Inside the file: `Gguf::open` checked every tensor's extent.
        let at = self.content.tensor_data_offset + info.offset + (rows.start * row_bytes) as u64;
        let mut data = vec![0u8; rows.len() * row_bytes];
        self.file
            .seek(SeekFrom::Start(at))
            .and_then(|_| self.file.read_exact(&mut data))
            .map_err(|e| err(e.to_string()))?;
        Ok(crate::qmat::QMatrix::new(format, rows.len(), c, data))
    }

    /// Whether the file has tensor `name`.
    pub fn content_has(&self, name: &str) -> bool {
        self.content.tensor_infos.contains_key(name)
    }

    /// Reads one tensor (quantized as stored).
    pub fn tensor(&mut self, name: &str) -> Result<QTensor, ModelError> {
        self.content
            .tensor(&mut self.file, name, &Device::Cpu)
            .map_err(|e| ModelError::Tensor {
                path: self.header.path.display().to_string(),
                name: name.into(),
                reason: first_line(&e),
            })
    }
}

impl GgufHeader {
    /// A string metadata value.
    pub fn string(&self, key: &str) -> Option<&str> {
        self.metadata
            .get(key)
            .and_then(|v| v.to_string().ok())
            .map(|s| s.as_str())
    }

    pub fn u32(&self, key: &str) -> Option<u32> {
        self.metadata.get(key).and_then(|v| v.to_u32().ok())
    }

    /// An array metadata value.
    pub fn array(&self, key: &str) -> Result<&Vec<Value>, ModelError> {
        self.metadata
            .get(key)
            .ok_or_else(|| ModelError::Metadata {
                path: self.path.display().to_string(),
                key: key.into(),
                reason: "missing".into(),
            })?
            .to_vec()
            .map_err(|e| ModelError::Metadata {
                path: self.path.display().to_string(),
                key: key.into(),
                reason: first_line(&e),
            })
    }
}

/// Opens a file to read (a model, a trace, a key file): a regular file only (opened without
/// blocking, so a FIFO given by mistake is refused at once, not waited on; a device or a
/// directory is refused by name).
pub fn open_regular(path: &Path) -> std::io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)?;
    let t = f.metadata()?.file_type();
    if !t.is_file() {
        let what = if t.is_dir() {
            "a directory"
        } else {
            "a FIFO, a socket or a device"
        };
        return Err(std::io::Error::other(format!("{what}, not a regular file")));
    }
    Ok(f)
}

/// Typed reads of the header metadata; errors name the file and the key.
struct Meta<'a> {
    content: &'a Content,
    path: &'a str,
}

impl Meta<'_> {
    /// A metadata error about `key`.
    fn err(&self, key: &str, reason: String) -> ModelError {
        ModelError::Metadata {
            path: self.path.into(),
            key: key.into(),
            reason,
        }
    }

    /// The value of `key`, which must be present.
    fn get(&self, key: &str) -> Result<&Value, ModelError> {
        self.content
            .metadata
            .get(key)
            .ok_or_else(|| self.err(key, "missing".into()))
    }

    /// A positive integer (u32 or u64 in the file).
    fn uint(&self, key: &str) -> Result<usize, ModelError> {
        let v = self.get(key)?;
        let n = v
            .to_u32()
            .map(|x| x as u64)
            .or_else(|_| v.to_u64())
            .map_err(|e| self.err(key, first_line(&e)))?;
        if n == 0 {
            return Err(self.err(key, "must be positive".into()));
        }
        Ok(n as usize)
    }

    /// A float.
    fn float(&self, key: &str) -> Result<f32, ModelError> {
        self.get(key)?
            .to_f32()
            .map_err(|e| self.err(key, first_line(&e)))
    }
}

/// The hyper-parameters from the `{arch}.*` metadata, after checking the architecture.
fn read_config(md: &Meta) -> Result<Config, ModelError> {
    let name = md
        .get("general.architecture")?
        .to_string()
        .map_err(|e| md.err("general.architecture", first_line(&e)))?
        .clone();
    let Some(arch) = Arch::parse(&name) else {
        return Err(ModelError::Architecture {
            path: md.path.into(),
            found: name,
        });
    };
    let key = |k: &str| format!("{name}.{k}");
    let hidden = md.uint(&key("embedding_length"))?;
    let heads = md.uint(&key("attention.head_count"))?;
    let kv_heads = md.uint(&key("attention.head_count_kv"))?;
    if hidden > 1 << 20 || heads > 1 << 12 {
        return Err(md.err(
            &key("embedding_length"),
            format!("embedding {hidden} / {heads} heads: at most 2^20 and 2^12"),
        ));
    }
    if heads > hidden || heads % kv_heads != 0 {
        return Err(md.err(
            &key("attention.head_count"),
            format!("{heads} heads / {kv_heads} KV heads: at most one head per embedding value, and whole query groups"),
        ));
    }
    // Qwen3 states its head size; the others divide the embedding.
    let head_dim = match md.content.metadata.get(&key("attention.key_length")) {
        Some(_) => md.uint(&key("attention.key_length"))?,
        None if hidden.is_multiple_of(heads) => hidden / heads,
        None => {
            return Err(md.err(
                &key("attention.head_count"),
                format!("{heads} heads do not divide embedding length {hidden}"),
            ))
        }
    };
    if head_dim > 1 << 12 {
        return Err(md.err(
            &key("attention.key_length"),
            format!("{head_dim}: at most 4096"),
        ));
    }
    check_rope(md, &name, head_dim)?;
    let (rope_base, rms_eps) = rope_and_eps(md, &name)?;
    let tokens_len = md
        .get("tokenizer.ggml.tokens")?
        .to_vec()
        .map_err(|e| md.err("tokenizer.ggml.tokens", first_line(&e)))?
        .len();
    Ok(Config {
        arch,
        vocab: md
            .content
            .metadata
            .get(&key("vocab_size"))
            .and_then(|v| v.to_u32().ok())
            .map(|v| v as usize)
            .unwrap_or(tokens_len),
        hidden,
        layers: md.uint(&key("block_count"))?,
        heads,
        kv_heads,
        head_dim,
        ffn: md.uint(&key("feed_forward_length"))?,
        context_length: md.uint(&key("context_length"))?,
        rope_base,
        rms_eps,
    })
}

/// The RoPE base and the RMS epsilon, which steer every product: a NaN or infinite one would
/// make every logit NaN without an error (the norm adds the epsilon, which must be > 0).
fn rope_and_eps(md: &Meta, arch: &str) -> Result<(f32, f32), ModelError> {
    let key = |k: &str| format!("{arch}.{k}");
    let rope_base = md.float(&key("rope.freq_base")).unwrap_or(10_000.0);
    if !(rope_base.is_finite() && rope_base > 1.0) {
        let why = format!("{rope_base}: expected a finite number above 1");
        return Err(md.err(&key("rope.freq_base"), why));
    }
    let rms_eps = md.float(&key("attention.layer_norm_rms_epsilon"))?;
    if !(rms_eps.is_finite() && rms_eps > 0.0 && rms_eps < 1.0) {
        let why = format!("{rms_eps}: expected a finite number in (0, 1)");
        return Err(md.err(&key("attention.layer_norm_rms_epsilon"), why));
    }
    Ok((rope_base, rms_eps))
}

/// What this pass does not implement is refused, not ignored: RoPE scaling other than Llama
/// 3's frequency factors, and RoPE on part of a head.
fn check_rope(md: &Meta, arch: &str, head_dim: usize) -> Result<(), ModelError> {
    let key = |k: &str| format!("{arch}.{k}");
    if let Some(t) = md.content.metadata.get(&key("rope.scaling.type")) {
        let t = t.to_string().map(|s| s.as_str()).unwrap_or("?");
        if t != "none" {
            return Err(md.err(&key("rope.scaling.type"), format!("`{t}` is not supported")));
        }
    }
    if md
        .content
        .metadata
        .contains_key(&key("rope.dimension_count"))
    {
        let rot = md.uint(&key("rope.dimension_count"))?;
        if rot != head_dim {
            return Err(md.err(
                &key("rope.dimension_count"),
                format!("RoPE on {rot} of {head_dim} dimensions: only whole heads are supported"),
            ));
        }
    }
    Ok(())
}

/// Sizes that steer allocation and arithmetic, bounded before use: every layer has 9
/// tensors in the file; contexts beyond 2^24 tokens are not a model of this runtime.
fn check_bounds(content: &Content, config: &Config, p: &str) -> Result<(), ModelError> {
    let bound = |key: &str, v: usize, max: usize| -> Result<(), ModelError> {
        if v > max {
            return Err(ModelError::Metadata {
                path: p.into(),
                key: key.into(),
                reason: format!("{v} is beyond what this file or runtime can hold (at most {max})"),
            });
        }
        Ok(())
    };
    let a = config.arch.name();
    bound(
        &format!("{a}.block_count"),
        config.layers,
        content.tensor_infos.len() / 9,
    )?;
    bound(
        &format!("{a}.context_length"),
        config.context_length,
        1 << 24,
    )?;
    bound(
        &format!("{a}.attention.head_count"),
        config.heads,
        config.hidden,
    )?;
    // The RoPE tables hold context × head/2 values each.
    bound(
        &format!("{a}.context_length"),
        config.context_length * (config.head_dim / 2).max(1),
        1 << 28,
    )
}

/// Every tensor a llama model of `c` needs, with its shape.
fn expected_tensors(c: &Config) -> Vec<(String, Vec<usize>)> {
    let mut want: Vec<(String, Vec<usize>)> = vec![
        ("token_embd.weight".into(), vec![c.vocab, c.hidden]),
        ("output_norm.weight".into(), vec![c.hidden]),
    ];
    for l in 0..c.layers {
        let (q, kv) = (c.heads * c.head_dim, c.kv_heads * c.head_dim);
        for (n, s) in [
            ("attn_norm", vec![c.hidden]),
            ("ffn_norm", vec![c.hidden]),
            ("attn_q", vec![q, c.hidden]),
            ("attn_k", vec![kv, c.hidden]),
            ("attn_v", vec![kv, c.hidden]),
            ("attn_output", vec![c.hidden, q]),
            ("ffn_gate", vec![c.ffn, c.hidden]),
            ("ffn_up", vec![c.ffn, c.hidden]),
            ("ffn_down", vec![c.hidden, c.ffn]),
        ] {
            want.push((format!("blk.{l}.{n}.weight"), s));
        }
        if c.arch.qkv_bias() {
            for (n, d) in [("attn_q", q), ("attn_k", kv), ("attn_v", kv)] {
                want.push((format!("blk.{l}.{n}.bias"), vec![d]));
            }
        }
        if c.arch.qk_norm() {
            for n in ["attn_q_norm", "attn_k_norm"] {
                want.push((format!("blk.{l}.{n}.weight"), vec![c.head_dim]));
            }
        }
    }
    want
}

/// Checks the optional tensors' shapes (the output head, Llama 3's RoPE frequency factors),
/// then every expected tensor's presence and shape.
fn check_tensors(content: &Content, c: &Config, p: &str) -> Result<(), ModelError> {
    let want = expected_tensors(c);
    // A tensor this pass would not read (an attention-output or FFN bias, a bias another
    // family has) is refused: ignoring it would give other logits than llama.cpp's.
    for name in content.tensor_infos.keys() {
        let known = name == "output.weight"
            || name == "rope_freqs.weight"
            || want.iter().any(|(w, _)| w == name);
        if !known {
            return Err(ModelError::Tensor {
                path: p.into(),
                name: name.clone(),
                reason: format!(
                    "not used by the {} pass: refused rather than ignored",
                    c.arch.name()
                ),
            });
        }
    }
    if let Some(o) = content.tensor_infos.get("rope_freqs.weight") {
        if o.shape.dims() != [c.head_dim / 2] {
            return Err(ModelError::Tensor {
                path: p.into(),
                name: "rope_freqs.weight".into(),
                reason: format!("shape {:?}, expected [{}]", o.shape.dims(), c.head_dim / 2),
            });
        }
    }
    if let Some(o) = content.tensor_infos.get("output.weight") {
        if o.shape.dims() != [c.vocab, c.hidden] {
            return Err(ModelError::Tensor {
                path: p.into(),
                name: "output.weight".into(),
                reason: format!(
                    "shape {:?}, expected {:?}",
                    o.shape.dims(),
                    [c.vocab, c.hidden]
                ),
            });
        }
    }
    for (name, shape) in &want {
        let info = content
            .tensor_infos
            .get(name)
            .ok_or_else(|| ModelError::Tensor {
                path: p.into(),
                name: name.clone(),
                reason: "missing".into(),
            })?;
        if info.shape.dims() != shape.as_slice() {
            return Err(ModelError::Tensor {
                path: p.into(),
                name: name.clone(),
                reason: format!("shape {:?}, expected {:?}", info.shape.dims(), shape),
            });
        }
    }
    Ok(())
}

/// Every tensor's data (name, offset in the data section, bytes) starts at a multiple of the
/// file's alignment and overlaps no other tensor's, as llama.cpp's reader requires: tensors
/// that overlap would read one tensor's bytes as another's weights (nonsense served, not an
/// error). The end of the last tensor's data in the data section (saturating: a hostile
/// offset or size reads as beyond the file, not as an overflow).
pub(crate) fn check_extents(
    p: &str,
    align: u64,
    mut t: Vec<(&str, u64, u64)>,
) -> Result<u64, ModelError> {
    let bad = |name: &str, reason: String| ModelError::Tensor {
        path: p.into(),
        name: name.into(),
        reason,
    };
    // An empty tensor where another's data begins overlaps nothing: it sorts first.
    t.sort_unstable_by_key(|&(_, at, bytes)| (at, bytes));
    let mut end = (0u64, "");
    for (name, at, bytes) in t {
        if !at.is_multiple_of(align) {
            return Err(bad(
                name,
                format!("its data at {at} is not aligned to {align} bytes"),
            ));
        }
        if at < end.0 {
            let reason = format!(
                "its data at {at} overlaps `{}`'s, which ends at {}",
                end.1, end.0
            );
            return Err(bad(name, reason));
        }
        // Not before the last end (checked above): the last end is the greatest.
        end = (at.saturating_add(bytes), name);
    }
    Ok(end.0)
}
