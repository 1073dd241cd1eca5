//! The llama forward pass over paged KV.
//!
//! K and V live in the cache core's device pool (one pool kind `kv`, layer-first, plane 0 = K,
//! plane 1 = V, `kv_heads × head_dim` values per token in the K/V dtype; two kinds `k` and `v`
//! when K and V are stored in different dtypes: [`kv`]). A forward call takes several
//! sequences, each with the tokens to compute, how many tokens it already has in its pages, and
//! its page list; it writes the new tokens' K/V into those pages and attends over all of them with
//! an online softmax (flash-style: no score matrix, memory linear in context). Prefill chunks and
//! batched decode are the same call. Weights stay in the file's block formats
//! ([`crate::qmat::QMatrix`]); each sequence's rows take one of three products ([`Path`]).

pub mod tp;
pub(crate) mod tp_ranks;

use rayon::prelude::*;
use strata_kv::dtype::Dtype;
use strata_kv::pool::DevicePool;
use strata_kv::PoolKind;

use crate::error::ModelError;
use crate::gguf::Config;
use crate::qmat::{QMatrix, PAR_MIN_ELEMS};
pub(crate) use crate::seq::check_seq;
pub use crate::seq::SeqInput;
use crate::shard::{Collective, Solo};

pub(crate) mod attend;
mod kv;
mod load;

pub(crate) use kv::kv_kinds;

/// Decode steps with at most this many tokens in a call use quantized activations and integer
/// dot products ([`QMatrix::matmul_q`]): they are bound by reading weights, which stay in their
/// 4- to 8-bit blocks.
pub const QUANTIZED_MAX_ROWS: usize = 8;

/// How a row's matrix products run, chosen per sequence (a row's result does not depend on
/// what else is in the batch: prompt rows by the panel product's construction, decode rows by
/// the batch-invariant kernels, unless `STRATA_ONE_ROW_KERNEL=fastest`: `qmat::pick`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Path {
    /// Quantized activations, integer dot products (decode steps).
    Quant,
    /// f32 activations against dequantized panels (prompt rows): a row's bits do not depend
    /// on the other rows, so neither on chunking nor on how much of a prompt was cached.
    Tiled,
}

struct Layer {
    /// Qwen2's Q/K/V biases.
    bias: Option<[Vec<f32>; 3]>,
    /// Qwen3's per-head RMSNorm weights of Q and K.
    qk_norm: Option<[Vec<f32>; 2]>,
    attn_norm: Vec<f32>,
    ffn_norm: Vec<f32>,
    wq: QMatrix,
    wk: QMatrix,
    wv: QMatrix,
    wo: QMatrix,
    wg: QMatrix,
    wu: QMatrix,
    wd: QMatrix,
}

/// A loaded model.
pub struct Model {
    pub config: Config,
    /// The token embeddings (rows dequantized at lookup).
    embed: QMatrix,
    /// The vocabulary projection when the file has its own (`output.weight`); else the
    /// embeddings (tied).
    output: Option<QMatrix>,
    norm: Vec<f32>,
    layers: Vec<Layer>,
    cos: Vec<f32>,
    sin: Vec<f32>,
    threads: usize,
    quantized_decode: bool,
    /// Most bytes of gathered K/V a group of sequences holds in attention
    /// (`attend::GATHER_BYTES`; smaller in tests, to run many groups).
    gather_budget: usize,
    /// This model's tensor-parallel rank (0 alone): its kinds come after the lower ranks'.
    kind: usize,
    /// How K and V are stored in their pages (`f16`, or quantized: [`crate::kvcodec`]); in
    /// one kind (`kv`) when they agree, in two (`k`, `v`) when they differ.
    k_dtype: Dtype,
    v_dtype: Dtype,
    /// The K/V kind's name: `kv`, a rank's `kv.tpR` (split: `k`/`v` with the same suffix).
    kind_name: String,
    /// The vocabulary rows `embed` / `output` hold (all of them but on a tensor-parallel rank).
    vocab_rows: std::ops::Range<usize>,
}

impl Model {
    /// Bytes of weights held: the matrices in their block formats, norms and biases as f32.
    pub fn weight_bytes(&self) -> usize {
        let f = |v: &[f32]| v.len() * 4;
        let layers: usize = self
            .layers
            .iter()
            .map(|w| {
                [&w.wq, &w.wk, &w.wv, &w.wo, &w.wg, &w.wu, &w.wd]
                    .iter()
                    .map(|m| m.bytes())
                    .sum::<usize>()
                    + f(&w.attn_norm)
                    + f(&w.ffn_norm)
                    + w.bias.iter().flatten().map(|b| f(b)).sum::<usize>()
                    + w.qk_norm.iter().flatten().map(|b| f(b)).sum::<usize>()
            })
            .sum();
        layers + self.embed.bytes() + self.output.as_ref().map_or(0, |m| m.bytes()) + f(&self.norm)
    }

    /// Index of this model's first pool kind in the page layout (every rank holds as many
    /// kinds: one, or K and V apart).
    pub(crate) fn first_kind(&self) -> usize {
        self.kind * if self.k_dtype == self.v_dtype { 1 } else { 2 }
    }

    /// Threads for attention (matrix products follow candle's own setting).
    pub fn set_threads(&mut self, n: usize) {
        self.threads = n.max(1);
    }

    /// The KV pool kind this model computes into when K and V share a dtype: K and V per
    /// layer of its KV heads (`kv`; a tensor-parallel rank's `kv.tpR`). With K and V in
    /// different dtypes there are two ([`Model::pool_kinds`]): this panics.
    pub fn pool_kind(&self) -> PoolKind {
        let mut kinds = self.pool_kinds();
        assert_eq!(kinds.len(), 1, "K and V are stored apart: use pool_kinds");
        kinds.remove(0)
    }

    /// The pool kinds this model computes into: `kv` (K and V planes) when K and V share a
    /// dtype, else `k` and `v` of one plane each (a rank's with its `.tpR`).
    pub fn pool_kinds(&self) -> Vec<PoolKind> {
        let c = &self.config;
        let suffix = self.kind_name.strip_prefix("kv").unwrap_or("");
        kv_kinds(
            suffix,
            c.layers,
            c.kv_heads,
            c.head_dim,
            self.k_dtype,
            self.v_dtype,
        )
    }

    /// Stores K and V as `dtype` from now on (before any page is written): `f16`, `q8_0` or
    /// `fp8_e4m3`; refused when a KV head does not hold whole blocks of it.
    pub fn set_kv_dtype(&mut self, dtype: Dtype) -> Result<(), ModelError> {
        self.set_kv_dtypes(dtype, dtype)
    }

    /// Stores K as `k` and V as `v` (llama.cpp's `-ctk` / `-ctv`), each as
    /// [`Model::set_kv_dtype`] checks it.
    pub fn set_kv_dtypes(&mut self, k: Dtype, v: Dtype) -> Result<(), ModelError> {
        for d in [k, v] {
            if !Dtype::KV.contains(&d) || !self.config.head_dim.is_multiple_of(d.block()) {
                return Err(ModelError::Unsupported(format!(
                    "K/V dtype {d} for KV heads of {} values",
                    self.config.head_dim
                )));
            }
        }
        (self.k_dtype, self.v_dtype) = (k, v);
        Ok(())
    }

    /// How K and V are stored: (K's dtype, V's).
    pub fn kv_dtypes(&self) -> (Dtype, Dtype) {
        (self.k_dtype, self.v_dtype)
    }

    /// `x · wᵀ` for several matrices of one input: the input quantized once when every row
    /// takes the quantized path (the bits [`Model::mm`] gives each).
    fn mm_shared<const N: usize>(
        &self,
        x: &[f32],
        paths: &[Path],
        ws: [&QMatrix; N],
    ) -> [Vec<f32>; N] {
        if paths.iter().all(|&p| p == Path::Quant) && ws.iter().all(|w| w.format.integer()) {
            let qx = crate::qmat::QActs::quantize(x);
            let mut outs = QMatrix::matmul_qacts_many(&ws, &qx, self.threads).into_iter();
            return std::array::from_fn(|_| outs.next().expect("one output per matrix"));
        }
        ws.map(|w| self.mm(x, paths, w, false))
    }

    /// `x · wᵀ` for the rows of `x`, each row by its [`Path`]. The vocabulary projection
    /// (`vocab`) of a decode row takes 8-bit activations like every other product of the row,
    /// as llama.cpp's does (ggml quantizes the activations of a Q8_0 product to Q8_0): next to
    /// llama.cpp's decode logits on SmolLM2 its argmax agrees as often as f32 activations'
    /// did (docs/BENCHMARKS.md), at the integer kernels' speed. A vocabulary matrix converted
    /// to Q8_0 at load ([`QMatrix::requantized`]) keeps f32 activations: rounding both sides
    /// once more is what once flipped an answer.
    fn mm(&self, x: &[f32], paths: &[Path], w: &QMatrix, vocab: bool) -> Vec<f32> {
        let n = paths.len();
        let k = x.len() / n;
        let run = |p: Path, x: &[f32]| match p {
            Path::Quant if vocab && w.requantized() => w.matmul_f32(x, self.threads),
            Path::Quant => w.matmul_q(x, self.threads),
            Path::Tiled => w.matmul_tiled(x),
        };
        if paths.iter().all(|&p| p == paths[0]) {
            return run(paths[0], x);
        }
        let m = w.rows;
        let mut out = vec![0f32; n * m];
        for p in [Path::Quant, Path::Tiled] {
            let idx: Vec<usize> = (0..n).filter(|&i| paths[i] == p).collect();
            if idx.is_empty() {
                continue;
            }
            let mut sub = Vec::with_capacity(idx.len() * k);
            for &i in &idx {
                sub.extend_from_slice(&x[i * k..(i + 1) * k]);
            }
            let o = run(p, &sub);
            for (&i, row) in idx.iter().zip(o.chunks_exact(m)) {
                out[i * m..(i + 1) * m].copy_from_slice(row);
            }
        }
        out
    }

    /// Sets the most bytes of gathered K/V one group of sequences holds in attention (tests:
    /// a row's bits must not depend on its group).
    #[doc(hidden)]
    pub fn set_gather_budget(&mut self, bytes: usize) {
        self.gather_budget = bytes;
    }

    /// Quantize the activations of sequences with at most [`QUANTIZED_MAX_ROWS`] tokens in a
    /// decode call (default on); off, they take f32 activations.
    pub fn set_quantized_decode(&mut self, on: bool) {
        self.quantized_decode = on;
    }

    fn rmsnorm(&self, x: &[f32], w: &[f32]) -> Vec<f32> {
        let h = self.config.hidden;
        let mut out = vec![0f32; x.len()];
        for (row, o) in x.chunks_exact(h).zip(out.chunks_exact_mut(h)) {
            let ss: f32 = row.iter().map(|v| v * v).sum::<f32>() / h as f32;
            let inv = 1.0 / (ss + self.config.rms_eps).sqrt();
            for ((o, &v), &g) in o.iter_mut().zip(row).zip(w) {
                *o = v * inv * g;
            }
        }
        out
    }

    /// RoPE on every head: adjacent pairs (llama, GGUF's order), or (x[i], x[i + d/2]) for
    /// NeoX-style families (Qwen).
    fn rope(&self, x: &mut [f32], heads: usize, positions: &[usize]) {
        let hd = self.config.head_dim;
        let half_dim = hd / 2;
        let neox = self.config.arch.rope_neox();
        for (row, &p) in x.chunks_exact_mut(heads * hd).zip(positions) {
            let (c, s) = (
                &self.cos[p * half_dim..(p + 1) * half_dim],
                &self.sin[p * half_dim..(p + 1) * half_dim],
            );
            for head in row.chunks_exact_mut(hd) {
                for i in 0..half_dim {
                    let (ia, ib) = if neox {
                        (i, i + half_dim)
                    } else {
                        (2 * i, 2 * i + 1)
                    };
                    let (a, b) = (head[ia], head[ib]);
                    head[ia] = a * c[i] - b * s[i];
                    head[ib] = a * s[i] + b * c[i];
                }
            }
        }
    }

    /// Qwen2's biases and Qwen3's per-head norms on the projected Q, K and V of every row.
    fn qkv_extras(&self, w: &Layer, q: &mut [f32], k: &mut [f32], v: &mut [f32]) {
        if let Some([bq, bk, bv]) = &w.bias {
            for (x, b) in [(&mut *q, bq), (&mut *k, bk), (&mut *v, bv)] {
                for row in x.chunks_exact_mut(b.len()) {
                    for (a, c) in row.iter_mut().zip(b) {
                        *a += c;
                    }
                }
            }
        }
        if let Some([nq, nk]) = &w.qk_norm {
            let eps = self.config.rms_eps;
            for (x, g) in [(q, nq), (k, nk)] {
                for head in x.chunks_exact_mut(g.len()) {
                    let ss: f32 = head.iter().map(|v| v * v).sum::<f32>() / g.len() as f32;
                    let inv = 1.0 / (ss + eps).sqrt();
                    for (a, c) in head.iter_mut().zip(g) {
                        *a = *a * inv * c;
                    }
                }
            }
        }
    }

    /// One sequence: its logits (last token, or every token with `all_logits`). A single token
    /// after position 0 counts as a decode step (see [`SeqInput::decode`]).
    pub fn forward_one(
        &self,
        pool: &DevicePool,
        tokens: &[u32],
        pos: usize,
        pages: &[u32],
        all_logits: bool,
    ) -> Result<Vec<f32>, ModelError> {
        let decode = tokens.len() == 1 && pos > 0;
        let seq = SeqInput {
            tokens,
            pos,
            pages,
            windows: &[],
            decode,
        };
        let mut v = self.forward(pool, &[seq], all_logits)?;
        Ok(v.remove(0))
    }

    /// Runs the model. Returns the logits of each sequence's last token (`all_logits`: of every
    /// token, sequence by sequence).
    pub fn forward(
        &self,
        pool: &DevicePool,
        seqs: &[SeqInput],
        all_logits: bool,
    ) -> Result<Vec<Vec<f32>>, ModelError> {
        self.forward_rows(pool, seqs, &vec![all_logits; seqs.len()])
    }

    /// [`Model::forward`], choosing per sequence: `all[i]` gives the logits of every token of
    /// sequence `i` (row after row), else of its last token only.
    pub fn forward_rows(
        &self,
        pool: &DevicePool,
        seqs: &[SeqInput],
        all: &[bool],
    ) -> Result<Vec<Vec<f32>>, ModelError> {
        assert_eq!(all.len(), seqs.len(), "one logits choice per sequence");
        // On a worker of the thread pool, so parallel matrix products split between this
        // thread and the others instead of waking the pool and sleeping on every call.
        rayon::scope(|_| self.forward_part(pool, seqs, all, &Solo))
            .map(|v| v.expect("a lone model keeps its logits"))
    }

    /// The forward pass of one tensor-parallel rank (or of the whole model, with [`Solo`]):
    /// partial sums of the output projections and embedding rows meet in `comm`'s all-reduce,
    /// the vocabulary's parts in its gather. The logits come back on the rank that gathers.
    pub(crate) fn forward_part(
        &self,
        pool: &DevicePool,
        seqs: &[SeqInput],
        all_logits: &[bool],
        comm: &dyn Collective,
    ) -> Result<Option<Vec<Vec<f32>>>, ModelError> {
        let rows = self.rows_of(pool, seqs)?; // (seq, position)
        let n = rows.len();
        if n == 0 {
            return Ok(Some(vec![Vec::new(); seqs.len()]));
        }
        let positions: Vec<usize> = rows.iter().map(|r| r.1).collect();
        // The product each row takes, decided per sequence (see `mm`).
        let paths: Vec<Path> = rows
            .iter()
            .map(|r| {
                let s = &seqs[r.0];
                if self.quantized_decode && s.decode && s.tokens.len() <= QUANTIZED_MAX_ROWS {
                    Path::Quant
                } else {
                    Path::Tiled
                }
            })
            .collect();
        let h = self.config.hidden;
        // Each rank looks up the tokens in its vocabulary rows; the all-reduce adds the
        // zeros of the others (exact).
        let mut x = vec![0f32; n * h];
        let tokens = seqs.iter().flat_map(|s| s.tokens);
        for (dst, &t) in x.chunks_exact_mut(h).zip(tokens) {
            if self.vocab_rows.contains(&(t as usize)) {
                self.embed.row_f32(t as usize - self.vocab_rows.start, dst);
            }
        }
        comm.all_reduce(&mut x);
        let batch = Batch {
            seqs,
            rows: &rows,
            positions: &positions,
            paths: &paths,
        };
        for (l, w) in self.layers.iter().enumerate() {
            self.layer(pool, l, w, &batch, &mut x, comm);
        }
        Ok(self.logits(&x, seqs, &paths, all_logits, comm))
    }

    /// Checks the pool and every sequence against the model; returns the rows of the call:
    /// (sequence, position) of each token to compute, in order.
    fn rows_of(
        &self,
        pool: &DevicePool,
        seqs: &[SeqInput],
    ) -> Result<Vec<(usize, usize)>, ModelError> {
        let c = &self.config;
        let (first, kinds) = (self.first_kind(), self.pool_kinds());
        if pool.layout().kinds().get(first..first + kinds.len()) != Some(&kinds[..]) {
            return Err(ModelError::Forward(format!(
                "device pool layout {:?} does not match the model's {kinds:?}",
                pool.layout().kinds(),
            )));
        }
        let mut rows = Vec::new();
        for (si, s) in seqs.iter().enumerate() {
            check_seq(pool, si, s, c.context_length, c.vocab)?;
            rows.extend((0..s.tokens.len()).map(|j| (si, s.pos + j)));
        }
        Ok(rows)
    }

    /// One transformer layer over the hidden states `x` of every row, in place: attention
    /// (writing the rows' K/V into their pages) and the feed-forward block, each residual.
    fn layer(
        &self,
        pool: &DevicePool,
        l: usize,
        w: &Layer,
        batch: &Batch,
        x: &mut [f32],
        comm: &dyn Collective,
    ) {
        // Each vector is dropped once read for the last time (a shadowing `let` would keep it
        // to the end of the layer): the plan's per-row bound (`crate::scratch::llama`) counts
        // what is alive at each phase's peak.
        let c = &self.config;
        let hn = self.rmsnorm(x, &w.attn_norm);
        let [mut q, mut k, mut v] = self.mm_shared(&hn, batch.paths, [&w.wq, &w.wk, &w.wv]);
        drop(hn);
        self.qkv_extras(w, &mut q, &mut k, &mut v);
        self.rope(&mut q, c.heads, batch.positions);
        self.rope(&mut k, c.kv_heads, batch.positions);
        self.write_kv(pool, l, batch, &k, &v);
        drop((k, v));
        let attn = self.attention(pool, l, batch.seqs, batch.rows, &q);
        drop(q);
        let mut o = self.mm(&attn, batch.paths, &w.wo, false);
        drop(attn);
        comm.all_reduce(&mut o);
        for (a, b) in x.iter_mut().zip(&o) {
            *a += b;
        }
        drop(o);
        let hn = self.rmsnorm(x, &w.ffn_norm);
        let [g, u] = self.mm_shared(&hn, batch.paths, [&w.wg, &w.wu]);
        drop(hn);
        // SiLU(g) · u, element by element (the same bits on any number of threads).
        let act: Vec<f32> = g
            .par_iter()
            .zip(&u)
            .with_min_len(PAR_MIN_ELEMS)
            .map(|(&g, &u)| g / (1.0 + (-g).exp()) * u)
            .collect();
        drop((g, u));
        let mut d = self.mm(&act, batch.paths, &w.wd, false);
        drop(act);
        comm.all_reduce(&mut d);
        for (a, b) in x.iter_mut().zip(&d) {
            *a += b;
        }
    }

    /// Writes every row's K and V of layer `l` (in the K/V dtype) into its sequence's page.
    fn write_kv(&self, pool: &DevicePool, l: usize, batch: &Batch, k: &[f32], v: &[f32]) {
        let c = &self.config;
        let ps = pool.layout().page_size();
        let kvd = c.kv_heads * c.head_dim;
        let mut buf = Vec::new();
        for (i, &(si, p)) in batch.rows.iter().enumerate() {
            let page = batch.seqs[si].pages[p / ps];
            for (plane, src) in [(0, k), (1, v)] {
                let (kind, kind_plane, dtype) = self.plane_at(plane);
                buf.resize(dtype.bytes_of(kvd).expect("checked when set"), 0);
                crate::kvcodec::encode(dtype, &src[i * kvd..(i + 1) * kvd], &mut buf);
                pool.write_token(kind, l, kind_plane, page, p % ps, &buf);
            }
        }
    }

    /// Logits for the rows asked for: each sequence's last row, or all of them.
    fn logits(
        &self,
        x: &[f32],
        seqs: &[SeqInput],
        layer_paths: &[Path],
        all_logits: &[bool],
        comm: &dyn Collective,
    ) -> Option<Vec<Vec<f32>>> {
        let c = &self.config;
        let h = c.hidden;
        // Rows whose logits are asked for, and their product: decode steps take the
        // quantized product as in the layers (see `mm`); prompt rows take the panels.
        let (mut pick, mut paths) = (Vec::new(), Vec::new());
        let mut at = 0;
        for (s, &all) in seqs.iter().zip(all_logits) {
            let len = s.tokens.len();
            let p = layer_paths.get(at).copied().unwrap_or(Path::Tiled);
            if all {
                pick.extend(at..at + len);
                paths.extend(std::iter::repeat_n(p, len));
            } else if len > 0 {
                pick.push(at + len - 1);
                paths.push(p);
            }
            at += len;
        }
        let mut sel = Vec::with_capacity(pick.len() * h);
        for &r in &pick {
            sel.extend_from_slice(&x[r * h..(r + 1) * h]);
        }
        let sel = self.rmsnorm(&sel, &self.norm);
        let head = self.output.as_ref().unwrap_or(&self.embed);
        let part = if pick.is_empty() {
            Vec::new()
        } else {
            self.mm(&sel, &paths, head, true)
        };
        let logits = comm.gather_vocab(part, pick.len())?;
        let mut out = Vec::with_capacity(seqs.len());
        let mut it = logits.chunks_exact(c.vocab);
        for (s, &all) in seqs.iter().zip(all_logits) {
            let take = if all {
                s.tokens.len()
            } else {
                usize::from(!s.tokens.is_empty())
            };
            let mut v = Vec::with_capacity(take * c.vocab);
            for _ in 0..take {
                v.extend_from_slice(it.next().expect("one row per pick"));
            }
            out.push(v);
        }
        Some(out)
    }
}

/// The sequences, rows and per-row inputs of one forward call, shared by its layers.
struct Batch<'a> {
    seqs: &'a [SeqInput<'a>],
    /// (sequence, position) of each row.
    rows: &'a [(usize, usize)],
    positions: &'a [usize],
    /// The product each row takes (see `Model::mm`).
    paths: &'a [Path],
}
