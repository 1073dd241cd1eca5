//! Tensor-parallel ranks of a llama-family model inside one server.
//!
//! Each rank is a [`Model`] holding its [`Part`]: the Q/K/V rows of its heads and the output
//! projection's columns over them, its slice of the feed-forward (gate/up rows, down
//! columns), and its rows of the vocabulary (embedding lookup and vocabulary projection). Its
//! K/V go to its own pool kind (`kv.tpR`, its KV heads only) in every page, so one radix tree
//! and one page allocator serve all ranks: a page is allocated in every rank's pool at once.
//!
//! Each rank has its own rayon pool whose workers are pinned to the rank's CPUs (its NUMA
//! node's, [`RankPlacement`]); a rank's weights are copied out of the file by those workers,
//! so the kernel's first-touch policy puts them on the rank's node. A call runs each rank as a
//! job on its own pool while the caller waits: no thread is started per call. The ranks meet
//! over shared memory (`crate::llama::tp_ranks`): an all-reduce after each output and down projection (and
//! after the embedding lookup), a gather of the vocabulary's parts at the end. Every rank
//! adds the partial sums in rank order, so all ranks hold the same hidden state bit for bit;
//! the sum differs from one rank's by rounding, and where a rank's input columns do not fall
//! on the format's blocks (a K-quant's 256-column super-blocks split by heads) by that slice's
//! requantization to Q8_0 (greedy outputs equal TP 1's in the tests).

use std::ops::Range;

use strata_kv::dtype::Dtype;
use strata_kv::pool::DevicePool;
use strata_kv::PoolKind;

use crate::error::ModelError;
use crate::gguf::{Config, Gguf};
pub use crate::llama::tp_ranks::RankPlacement;
use crate::llama::tp_ranks::RankSet;
use crate::llama::{check_seq, Model, SeqInput};
pub use crate::shard::Part;

/// A llama-family model split over tensor-parallel ranks (see the module notes).
pub struct TpModel {
    config: Config,
    parts: Vec<Part>,
    models: Vec<Model>,
    ranks: RankSet,
}

/// How to load a [`TpModel`].
#[derive(Clone, Debug)]
pub struct TpOptions {
    /// One per rank: the rank count is its length.
    pub placements: Vec<RankPlacement>,
    pub threads_per_rank: usize,
    pub quantized_decode: bool,
}

impl TpModel {
    /// Loads each rank's part on the rank's own (pinned) threads.
    pub fn load(path: &std::path::Path, opts: &TpOptions) -> Result<TpModel, ModelError> {
        let tp = opts.placements.len();
        let g = Gguf::open(path)?;
        let config = g.config.clone();
        let ffn_block = g.block_weights("blk.0.ffn_down.weight").unwrap_or(32);
        drop(g);
        let parts = Part::split(&config, tp, ffn_block)?;
        let ranks = RankSet::new(&opts.placements, opts.threads_per_rank)?;
        let models = ranks.load(&|r| {
            let mut g = Gguf::open(path)?;
            let mut m = Model::load_part(&mut g, &parts[r])?;
            m.set_threads(opts.threads_per_rank);
            m.set_quantized_decode(opts.quantized_decode);
            Ok(m)
        })?;
        Ok(TpModel {
            config,
            parts,
            models,
            ranks,
        })
    }

    /// The whole model's configuration.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// Ranks.
    pub fn tp(&self) -> usize {
        self.models.len()
    }

    /// Bytes of weights all ranks hold.
    pub fn weight_bytes(&self) -> usize {
        self.models.iter().map(|m| m.weight_bytes()).sum()
    }

    /// Runs every rank over the call; rank 0 gathers the logits. A rank's error fails the
    /// call; a rank's panic panics here (on the caller's thread, where the engine sees it).
    pub fn forward_rows(
        &self,
        pool: &DevicePool,
        seqs: &[SeqInput],
        all: &[bool],
    ) -> Result<Vec<Vec<f32>>, ModelError> {
        assert_eq!(all.len(), seqs.len(), "one logits choice per sequence");
        // Every check a rank makes, made before any rank waits on another.
        for m in &self.models {
            let (first, k) = (m.first_kind(), m.pool_kinds());
            if pool.layout().kinds().get(first..first + k.len()) != Some(&k[..]) {
                return Err(ModelError::Forward(format!(
                    "device pool layout {:?} lacks rank pools {k:?}",
                    pool.layout().kinds()
                )));
            }
        }
        for (si, s) in seqs.iter().enumerate() {
            check_seq(pool, si, s, self.config.context_length, self.config.vocab)?;
        }
        self.ranks
            .run(&|r, c| self.models[r].forward_part(pool, seqs, all, c))
    }

    /// A page of this server's layout (the ranks' kinds, page-first) as the whole model's
    /// (one kind, every KV head once): what crosses to another worker.
    pub fn page_to_wire(&self, page_size: usize, blob: &[u8]) -> Result<Vec<u8>, ModelError> {
        self.reshard(page_size, blob, true)
    }

    /// A page of the whole model's layout as this server's ranks' (KV heads copied to every
    /// rank that holds them).
    pub fn page_from_wire(&self, page_size: usize, blob: &[u8]) -> Result<Vec<u8>, ModelError> {
        self.reshard(page_size, blob, false)
    }

    /// Stores K and V as `dtype` on every rank ([`Model::set_kv_dtype`]).
    pub fn set_kv_dtype(&mut self, dtype: Dtype) -> Result<(), ModelError> {
        self.set_kv_dtypes(dtype, dtype)
    }

    /// Stores K as `k` and V as `v` on every rank ([`Model::set_kv_dtypes`]).
    pub fn set_kv_dtypes(&mut self, k: Dtype, v: Dtype) -> Result<(), ModelError> {
        self.models
            .iter_mut()
            .try_for_each(|m| m.set_kv_dtypes(k, v))
    }

    /// Per pool kind of a rank (`kv`, or `k` and `v`), the bytes of one KV head's row in each
    /// of its planes (heads hold whole blocks of the dtypes: checked when set).
    fn kind_head_bytes(&self) -> Vec<Vec<usize>> {
        let (k, v) = self.models[0].kv_dtypes();
        let hb = |d: Dtype| d.bytes_of(self.config.head_dim).expect("checked when set");
        if k == v {
            vec![vec![hb(k), hb(v)]]
        } else {
            vec![vec![hb(k)], vec![hb(v)]]
        }
    }

    fn reshard(&self, ps: usize, blob: &[u8], to_wire: bool) -> Result<Vec<u8>, ModelError> {
        let c = &self.config;
        let kinds = self.kind_head_bytes();
        let per_head: usize = kinds.iter().flatten().sum::<usize>() * c.layers;
        let kvs: Vec<Range<usize>> = self.parts.iter().map(|p| p.heads.kv.clone()).collect();
        let local_tok: usize = kvs.iter().map(|k| k.len()).sum::<usize>() * per_head;
        let wire_tok = c.kv_heads * per_head;
        let (from_tok, to_tok) = if to_wire {
            (local_tok, wire_tok)
        } else {
            (wire_tok, local_tok)
        };
        if ps.checked_mul(from_tok) != Some(blob.len()) {
            return Err(ModelError::Forward(format!(
                "a KV page of {} bytes, expected {ps} tokens of {from_tok} bytes",
                blob.len()
            )));
        }
        let mut out = vec![0u8; ps * to_tok];
        // Page-first blobs: per kind, per layer, per plane, `ps` token rows of the kind's heads
        // (a rank's kinds after the lower ranks'; the wire's with every head).
        let mut local = 0;
        for kv in &kvs {
            let mut wire = 0;
            for hbs in &kinds {
                for _layer in 0..c.layers {
                    for &head in hbs {
                        let row = kv.len() * head;
                        for t in 0..ps {
                            let l = local + t * row;
                            let w = wire + (t * c.kv_heads + kv.start) * head;
                            if to_wire {
                                out[w..w + row].copy_from_slice(&blob[l..l + row]);
                            } else {
                                out[l..l + row].copy_from_slice(&blob[w..w + row]);
                            }
                        }
                        local += ps * row;
                        wire += ps * c.kv_heads * head;
                    }
                }
            }
        }
        Ok(out)
    }
}

impl crate::Runtime for TpModel {
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
        Ok(self.models.iter().flat_map(|m| m.pool_kinds()).collect())
    }
    fn decode_rows_differ(&self) -> bool {
        true
    }
    fn wire_kinds(&self, _page_size: usize) -> Result<Vec<PoolKind>, ModelError> {
        let c = &self.config;
        let (k, v) = self.models[0].kv_dtypes();
        Ok(super::kv_kinds("", c.layers, c.kv_heads, c.head_dim, k, v))
    }
    fn page_to_wire(&self, ps: usize, blob: &[u8]) -> Result<Option<Vec<u8>>, ModelError> {
        TpModel::page_to_wire(self, ps, blob).map(Some)
    }
    fn page_from_wire(&self, ps: usize, blob: &[u8]) -> Result<Option<Vec<u8>>, ModelError> {
        TpModel::page_from_wire(self, ps, blob).map(Some)
    }
    fn forward_rows(
        &self,
        pool: &DevicePool,
        seqs: &[SeqInput],
        all: &[bool],
    ) -> Result<Vec<Vec<f32>>, ModelError> {
        TpModel::forward_rows(self, pool, seqs, all)
    }
}
