//! What the engine needs of a model, whatever its architecture: the pool kinds its state takes
//! in the tiered cache's pages, and the paged, batched forward pass over them. A GGUF file's
//! `general.architecture` picks the implementation ([`load`]).

use std::path::Path;

use strata_kv::pool::DevicePool;
use strata_kv::PoolKind;

use crate::deepseek4::Dsv4;
use crate::error::ModelError;
use crate::gguf::{Gguf, GgufHeader};
use crate::llama::{Model, SeqInput};
use crate::{ChatTemplate, ModelTokenizer};

/// A model the engine can run.
pub trait Runtime: Send + Sync {
    /// `general.architecture` of the file it came from.
    fn architecture(&self) -> &'static str;
    fn context_length(&self) -> usize;
    fn vocab(&self) -> usize;
    /// The pool kinds of one rank's state in pages of `page_size` tokens, or why that page
    /// size cannot hold it.
    fn pool_kinds(&self, page_size: usize) -> Result<Vec<PoolKind>, ModelError>;
    /// The pool kinds of a page crossing to another worker (a KV transfer): the whole
    /// model's state, however this server splits it over ranks. Prefill and decode workers
    /// of different tensor-parallel sizes agree on it.
    fn wire_kinds(&self, page_size: usize) -> Result<Vec<PoolKind>, ModelError> {
        self.pool_kinds(page_size)
    }
    /// A page of `page_size` tokens (host layout) in the wire layout; None when the layouts
    /// are the same. A blob of another size is an error.
    fn page_to_wire(&self, _page_size: usize, _blob: &[u8]) -> Result<Option<Vec<u8>>, ModelError> {
        Ok(None)
    }
    /// A page of `page_size` tokens in the wire layout as this server's; None when the layouts
    /// are the same. A blob of another size is an error.
    fn page_from_wire(
        &self,
        _page_size: usize,
        _blob: &[u8],
    ) -> Result<Option<Vec<u8>>, ModelError> {
        Ok(None)
    }
    /// Whether a decode step stores other bits for its position's K/V than a prompt row would
    /// (its products and attention take other kernels): then a later prompt that extends a
    /// cached answer would read K/V a fresh computation never makes, and the engine computes
    /// an answer's positions again as prompt rows before caching them
    /// (`EngineConfig::cache_outputs`). No default: each model says (a wrapper that forgot
    /// to forward it would cache answers as decoded).
    fn decode_rows_differ(&self) -> bool;
    /// Computes the sequences' new tokens into their pages; per sequence the logits of its
    /// last token, or (`all[i]`) of every new token, row after row.
    fn forward_rows(
        &self,
        pool: &DevicePool,
        seqs: &[SeqInput],
        all: &[bool],
    ) -> Result<Vec<Vec<f32>>, ModelError>;
}

impl Runtime for Model {
    fn architecture(&self) -> &'static str {
        self.config.arch.name()
    }
    fn context_length(&self) -> usize {
        self.config.context_length
    }
    fn vocab(&self) -> usize {
        self.config.vocab
    }
    fn pool_kinds(&self, _page_size: usize) -> Result<Vec<PoolKind>, ModelError> {
        Ok(Model::pool_kinds(self))
    }
    fn decode_rows_differ(&self) -> bool {
        true
    }
    fn forward_rows(
        &self,
        pool: &DevicePool,
        seqs: &[SeqInput],
        all: &[bool],
    ) -> Result<Vec<Vec<f32>>, ModelError> {
        Model::forward_rows(self, pool, seqs, all)
    }
}

impl Runtime for Dsv4 {
    fn architecture(&self) -> &'static str {
        "deepseek4"
    }
    fn context_length(&self) -> usize {
        self.cfg.context
    }
    fn vocab(&self) -> usize {
        self.cfg.vocab
    }
    fn pool_kinds(&self, page_size: usize) -> Result<Vec<PoolKind>, ModelError> {
        Dsv4::pool_kinds(self, page_size)
    }
    /// Its pass never looks at `SeqInput::decode`: a generated position is computed as a
    /// prompt's would be.
    fn decode_rows_differ(&self) -> bool {
        false
    }
    fn forward_rows(
        &self,
        pool: &DevicePool,
        seqs: &[SeqInput],
        all: &[bool],
    ) -> Result<Vec<Vec<f32>>, ModelError> {
        Dsv4::forward_rows(self, pool, seqs, all)
    }
}

impl<R: Runtime + ?Sized> Runtime for Box<R> {
    fn architecture(&self) -> &'static str {
        (**self).architecture()
    }
    fn context_length(&self) -> usize {
        (**self).context_length()
    }
    fn vocab(&self) -> usize {
        (**self).vocab()
    }
    fn pool_kinds(&self, page_size: usize) -> Result<Vec<PoolKind>, ModelError> {
        (**self).pool_kinds(page_size)
    }
    fn wire_kinds(&self, page_size: usize) -> Result<Vec<PoolKind>, ModelError> {
        (**self).wire_kinds(page_size)
    }
    fn page_to_wire(&self, ps: usize, blob: &[u8]) -> Result<Option<Vec<u8>>, ModelError> {
        (**self).page_to_wire(ps, blob)
    }
    fn page_from_wire(&self, ps: usize, blob: &[u8]) -> Result<Option<Vec<u8>>, ModelError> {
        (**self).page_from_wire(ps, blob)
    }
    fn decode_rows_differ(&self) -> bool {
        (**self).decode_rows_differ()
    }
    fn forward_rows(
        &self,
        pool: &DevicePool,
        seqs: &[SeqInput],
        all: &[bool],
    ) -> Result<Vec<Vec<f32>>, ModelError> {
        (**self).forward_rows(pool, seqs, all)
    }
}

/// How to load a model (DeepSeek-V4 has no quantized decode: its pass is plain f32 loops,
/// threaded over sequences by rayon's pool, or over its tensor-parallel ranks' pools).
#[derive(Clone, Debug)]
pub struct LoadOptions {
    /// Threads (per rank with tensor-parallel ranks).
    pub threads: usize,
    /// 8-bit activations and integer products for decode steps (see
    /// [`Model::set_quantized_decode`]).
    pub quantized_decode: bool,
    /// Tensor-parallel ranks, one placement each ([`crate::TpModel`]); empty or one
    /// unpinned rank: the whole model on the caller's thread pool.
    pub ranks: Vec<crate::RankPlacement>,
    /// How the llama family stores K and V ([`Model::set_kv_dtype`]); DeepSeek-V4 keeps its
    /// state kinds in the dtypes it defines and refuses anything but f16.
    pub kv_dtype: strata_kv::dtype::Dtype,
    /// V's own dtype when it differs from K's (llama.cpp's `-ctv`; [`Model::set_kv_dtypes`]):
    /// `kv_dtype` is then K's alone.
    pub v_dtype: Option<strata_kv::dtype::Dtype>,
}

impl LoadOptions {
    /// One rank on `threads` threads.
    pub fn new(threads: usize) -> LoadOptions {
        LoadOptions {
            threads,
            quantized_decode: true,
            ranks: Vec::new(),
            kv_dtype: strata_kv::dtype::Dtype::F16,
            v_dtype: None,
        }
    }
}

/// A loaded model with its text side.
pub struct Loaded {
    pub runtime: Box<dyn Runtime>,
    pub tokenizer: ModelTokenizer,
    pub template: Option<ChatTemplate>,
}

/// Architectures [`load`] runs.
pub const ARCHITECTURES: &[&str] = &["llama", "qwen2", "qwen3", "deepseek4"];

/// Loads the model at `path` by its `general.architecture`.
pub fn load(path: &Path, opts: LoadOptions) -> Result<Loaded, ModelError> {
    let header = GgufHeader::open(path)?;
    let tokenizer = ModelTokenizer::from_gguf(&header)?;
    let template = header.chat_template()?;
    let split = opts.ranks.len() > 1 || opts.ranks.iter().any(|r| r.cpus.is_some());
    let (k, v) = (opts.kv_dtype, opts.v_dtype.unwrap_or(opts.kv_dtype));
    let f16 = strata_kv::dtype::Dtype::F16;
    if header.architecture() == Some("deepseek4") && (k, v) != (f16, f16) {
        return Err(ModelError::Unsupported(format!(
            "K/V dtype {k} / {v} for deepseek4: its state kinds keep the dtypes the model defines"
        )));
    }
    if header.architecture() != Some("deepseek4") && opts.quantized_decode {
        // The llama family's one-row kernels measured now, at start, not inside a first
        // forward pass.
        crate::qmat::kernel_description();
    }
    let runtime: Box<dyn Runtime> = match header.architecture() {
        Some("deepseek4") if split => Box::new(crate::deepseek4::tp::Dsv4Tp::load(
            path,
            &opts.ranks,
            opts.threads,
        )?),
        Some("deepseek4") => Box::new(crate::deepseek4::load::load_dsv4(path)?),
        _ if split => {
            let mut m = crate::TpModel::load(
                path,
                &crate::TpOptions {
                    placements: opts.ranks,
                    threads_per_rank: opts.threads,
                    quantized_decode: opts.quantized_decode,
                },
            )?;
            m.set_kv_dtypes(k, v)?;
            Box::new(m)
        }
        _ => {
            // Gguf::open names the architecture it found when it is not llama.
            let mut g = Gguf::open(path)?;
            let mut m = Model::load(&mut g)?;
            m.set_threads(opts.threads);
            m.set_quantized_decode(opts.quantized_decode);
            m.set_kv_dtypes(k, v)?;
            Box::new(m)
        }
    };
    Ok(Loaded {
        runtime,
        tokenizer,
        template,
    })
}
