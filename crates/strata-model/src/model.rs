//! The llama forward pass over paged KV.
//!
//! K and V live in the cache core's device pool (one pool kind `kv`, layer-first, plane 0 = K,
//! plane 1 = V, f16, `kv_heads × head_dim` values per token). A forward call takes several
//! sequences, each with the tokens to compute, how many tokens it already has in its pages, and
//! its page list; it writes the new tokens' K/V into those pages and attends over all of them with
//! an online softmax (flash-style: no score matrix, memory linear in context). Prefill chunks and
//! batched decode are the same call. Weights are dequantized to f32 once; matrix products use
//! candle's CPU GEMM.

use candle_core::{Device, Tensor};
use half::f16;
use strata_kv::pool::DevicePool;
use strata_kv::PoolKind;

use crate::attn;
use crate::error::ModelError;
use crate::gguf::{Config, Gguf};
use crate::q8::Q8Matrix;
pub(crate) use crate::seq::check_seq;
pub use crate::seq::SeqInput;

/// Decode steps with at most this many tokens in a call use Q8_0 weights ([`Q8Matrix`]): they
/// are bound by memory bandwidth, and Q8_0 reads 28 % of f32's bytes. Prompt tokens (prefill
/// chunks of any length, including the few left after a cache hit) use f32 GEMM.
pub const QUANTIZED_MAX_ROWS: usize = 8;

/// A weight matrix `[out, in]` in both formats.
struct Linear {
    f32: Tensor,
    q8: Q8Matrix,
}

impl Linear {
    fn new(f32: Tensor) -> Result<Linear, ModelError> {
        let (rows, cols) = f32.dims2()?;
        let q8 = Q8Matrix::quantize(&vec1(&f32)?, rows, cols);
        Ok(Linear { f32, q8 })
    }
}

struct Layer {
    /// Qwen2's Q/K/V biases.
    bias: Option<[Vec<f32>; 3]>,
    /// Qwen3's per-head RMSNorm weights of Q and K.
    qk_norm: Option<[Vec<f32>; 2]>,
    attn_norm: Vec<f32>,
    ffn_norm: Vec<f32>,
    wq: Linear,
    wk: Linear,
    wv: Linear,
    wo: Linear,
    wg: Linear,
    wu: Linear,
    wd: Linear,
}

/// A loaded model.
pub struct Model {
    pub config: Config,
    /// The vocabulary projection: the file's own head (`output.weight`), else the embeddings
    /// (tied); the embeddings' rows are kept apart for the lookup only.
    head: Linear,
    embed_rows: Vec<f32>,
    norm: Vec<f32>,
    layers: Vec<Layer>,
    cos: Vec<f32>,
    sin: Vec<f32>,
    threads: usize,
    quantized_decode: bool,
}

fn vec1(t: &Tensor) -> Result<Vec<f32>, ModelError> {
    Ok(t.flatten_all()?.to_vec1::<f32>()?)
}

impl Model {
    /// Loads and dequantizes every weight to f32.
    pub fn load(g: &mut Gguf) -> Result<Model, ModelError> {
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
        let output = g.content_has("output.weight");
        let freqs = g.content_has("rope_freqs.weight");
        let mut t =
            |name: &str| -> Result<Tensor, ModelError> { Ok(g.tensor(name)?.dequantize(&dev)?) };
        let embed = t("token_embd.weight")?;
        let norm = vec1(&t("output_norm.weight")?)?;
        let output = if output {
            Some(t("output.weight")?)
        } else {
            None
        };
        let freqs = if freqs {
            Some(vec1(&t("rope_freqs.weight")?)?)
        } else {
            None
        };
        let layers = (0..c.layers)
            .map(|l| load_layer(&c, l, &mut t))
            .collect::<Result<Vec<_>, _>>()?;
        let (cos, sin) = rope_tables(&c, freqs.as_deref());
        let embed_rows = vec1(&embed)?;
        let head = Linear::new(output.unwrap_or(embed))?;
        Ok(Model {
            config: c,
            head,
            embed_rows,
            norm,
            layers,
            cos,
            sin,
            threads: 2,
            quantized_decode: true,
        })
    }

    /// Threads for attention (matrix products follow candle's own setting).
    pub fn set_threads(&mut self, n: usize) {
        self.threads = n.max(1);
    }

    /// The KV pool kind this model computes into: f16 K and V per layer (one rank).
    pub fn pool_kind(&self) -> PoolKind {
        PoolKind::kv(
            "kv",
            self.config.layers,
            self.config.kv_heads,
            self.config.head_dim,
            2,
        )
    }

    /// `x · wᵀ` for the rows of `x`; rows flagged in `q8` (those of sequences with few tokens
    /// in this call: decode steps) use the Q8_0 weights, the others f32 GEMM. The choice is per
    /// sequence, so a sequence's result does not depend on what else is in the batch.
    fn mm(&self, x: &[f32], q8: &[bool], w: &Linear, vocab: bool) -> Result<Vec<f32>, ModelError> {
        let n = q8.len();
        let k = x.len() / n;
        let quant = |x: &[f32]| {
            if vocab {
                w.q8.matmul_f32(x, self.threads)
            } else {
                w.q8.matmul(x, self.threads)
            }
        };
        let gemm = |x: &[f32], rows: usize| -> Result<Vec<f32>, ModelError> {
            let xt = Tensor::from_slice(x, (rows, k), &Device::Cpu)?;
            vec1(&xt.matmul(&w.f32.t()?)?)
        };
        let nq = q8.iter().filter(|&&b| b).count();
        if nq == n {
            return Ok(quant(x));
        }
        if nq == 0 {
            return gemm(x, n);
        }
        let (mut xq, mut xf) = (Vec::with_capacity(nq * k), Vec::with_capacity((n - nq) * k));
        for (row, &b) in x.chunks_exact(k).zip(q8) {
            if b { &mut xq } else { &mut xf }.extend_from_slice(row);
        }
        let (oq, of) = (quant(&xq), gemm(&xf, n - nq)?);
        let m = oq.len() / nq;
        let mut out = Vec::with_capacity(n * m);
        let (mut iq, mut jf) = (oq.chunks_exact(m), of.chunks_exact(m));
        for &b in q8 {
            let r = if b { iq.next() } else { jf.next() };
            out.extend_from_slice(r.expect("one output row per input row"));
        }
        Ok(out)
    }

    /// Use Q8_0 weights for sequences with at most [`QUANTIZED_MAX_ROWS`] tokens in a call
    /// (default on).
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
        rayon::scope(|_| self.forward_inner(pool, seqs, all))
    }

    fn forward_inner(
        &self,
        pool: &DevicePool,
        seqs: &[SeqInput],
        all_logits: &[bool],
    ) -> Result<Vec<Vec<f32>>, ModelError> {
        let rows = self.rows_of(pool, seqs)?; // (seq, position)
        let n = rows.len();
        if n == 0 {
            return Ok(vec![Vec::new(); seqs.len()]);
        }
        let positions: Vec<usize> = rows.iter().map(|r| r.1).collect();
        // Weight format per row, decided per sequence (see `mm`).
        let q8: Vec<bool> = rows
            .iter()
            .map(|r| {
                let s = &seqs[r.0];
                self.quantized_decode && s.decode && s.tokens.len() <= QUANTIZED_MAX_ROWS
            })
            .collect();
        let h = self.config.hidden;
        let mut x = Vec::with_capacity(n * h);
        for s in seqs {
            for &t in s.tokens {
                x.extend_from_slice(&self.embed_rows[t as usize * h..(t as usize + 1) * h]);
            }
        }
        let batch = Batch {
            seqs,
            rows: &rows,
            positions: &positions,
            q8: &q8,
        };
        for (l, w) in self.layers.iter().enumerate() {
            self.layer(pool, l, w, &batch, &mut x)?;
        }
        self.logits(&x, seqs, &q8, all_logits)
    }

    /// Checks the pool and every sequence against the model; returns the rows of the call:
    /// (sequence, position) of each token to compute, in order.
    fn rows_of(
        &self,
        pool: &DevicePool,
        seqs: &[SeqInput],
    ) -> Result<Vec<(usize, usize)>, ModelError> {
        let c = &self.config;
        if pool.layout().kinds().first() != Some(&self.pool_kind()) {
            return Err(ModelError::Forward(format!(
                "device pool layout {:?} does not match the model's {:?}",
                pool.layout().kinds(),
                self.pool_kind()
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
    ) -> Result<(), ModelError> {
        let c = &self.config;
        let hn = self.rmsnorm(x, &w.attn_norm);
        let mut q = self.mm(&hn, batch.q8, &w.wq, false)?;
        let mut k = self.mm(&hn, batch.q8, &w.wk, false)?;
        let mut v = self.mm(&hn, batch.q8, &w.wv, false)?;
        self.qkv_extras(w, &mut q, &mut k, &mut v);
        self.rope(&mut q, c.heads, batch.positions);
        self.rope(&mut k, c.kv_heads, batch.positions);
        self.write_kv(pool, l, batch, &k, &v);
        let attn = self.attention(pool, l, batch.seqs, batch.rows, &q);
        let o = self.mm(&attn, batch.q8, &w.wo, false)?;
        for (a, b) in x.iter_mut().zip(&o) {
            *a += b;
        }
        let hn = self.rmsnorm(x, &w.ffn_norm);
        let g = self.mm(&hn, batch.q8, &w.wg, false)?;
        let u = self.mm(&hn, batch.q8, &w.wu, false)?;
        let act: Vec<f32> = g
            .iter()
            .zip(&u)
            .map(|(&g, &u)| g / (1.0 + (-g).exp()) * u)
            .collect();
        let d = self.mm(&act, batch.q8, &w.wd, false)?;
        for (a, b) in x.iter_mut().zip(&d) {
            *a += b;
        }
        Ok(())
    }

    /// Writes every row's K and V of layer `l` (f16) into its sequence's page.
    fn write_kv(&self, pool: &DevicePool, l: usize, batch: &Batch, k: &[f32], v: &[f32]) {
        let c = &self.config;
        let ps = pool.layout().page_size();
        let kvd = c.kv_heads * c.head_dim;
        let mut buf = vec![0u8; kvd * 2];
        for (i, &(si, p)) in batch.rows.iter().enumerate() {
            let page = batch.seqs[si].pages[p / ps];
            for (plane, src) in [(0, k), (1, v)] {
                for (d, &val) in buf.chunks_exact_mut(2).zip(&src[i * kvd..(i + 1) * kvd]) {
                    d.copy_from_slice(&f16::from_f32(val).to_le_bytes());
                }
                pool.write_token(0, l, plane, page, p % ps, &buf);
            }
        }
    }

    /// Logits for the rows asked for: each sequence's last row, or all of them.
    fn logits(
        &self,
        x: &[f32],
        seqs: &[SeqInput],
        q8: &[bool],
        all_logits: &[bool],
    ) -> Result<Vec<Vec<f32>>, ModelError> {
        let c = &self.config;
        let h = c.hidden;
        let mut pick = Vec::new();
        let mut at = 0;
        for (s, &all) in seqs.iter().zip(all_logits) {
            let len = s.tokens.len();
            if all {
                pick.extend(at..at + len);
            } else if len > 0 {
                pick.push(at + len - 1);
            }
            at += len;
        }
        let mut sel = Vec::with_capacity(pick.len() * h);
        for &r in &pick {
            sel.extend_from_slice(&x[r * h..(r + 1) * h]);
        }
        let sel = self.rmsnorm(&sel, &self.norm);
        let pick_q8: Vec<bool> = pick.iter().map(|&r| q8[r]).collect();
        let head = &self.head;
        let logits = self.mm(&sel, &pick_q8, head, true)?;
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
        Ok(out)
    }

    /// Causal attention of every row over its sequence's pages ([`crate::attn`]): each
    /// sequence's K/V are gathered once per layer, rows go in tiles of one sequence, and rows
    /// are split across threads by work.
    fn attention(
        &self,
        pool: &DevicePool,
        layer: usize,
        seqs: &[SeqInput],
        rows: &[(usize, usize)],
        q: &[f32],
    ) -> Vec<f32> {
        let c = &self.config;
        let shape = attn::Shape {
            heads: c.heads,
            kv_heads: c.kv_heads,
            head_dim: c.head_dim,
        };
        // A row of queries (and of outputs): every head.
        let h = c.heads * c.head_dim;
        let ps = pool.layout().page_size();
        let kp = as_f16(pool.plane(0, layer, 0));
        let vp = as_f16(pool.plane(0, layer, 1));
        let gathered = gather(shape, kp, vp, ps, seqs, rows);
        let scale = 1.0 / (c.head_dim as f32).sqrt();
        let mut out = vec![0f32; rows.len() * h];
        // Threads only pay for themselves on enough work (a decode step is done inline).
        let work: usize = rows.iter().map(|r| r.1 + 1).sum();
        let threads = if work < 4096 { 1 } else { self.threads };
        let gathered = &gathered;
        let run = |first: usize, chunk: &mut [f32]| {
            let n_rows = chunk.len() / h;
            let mut pos = Vec::with_capacity(attn::TILE_ROWS);
            let mut r0 = 0;
            while r0 < n_rows {
                let si = rows[first + r0].0;
                let mut r1 = r0 + 1;
                while r1 < n_rows && r1 - r0 < attn::TILE_ROWS && rows[first + r1].0 == si {
                    r1 += 1;
                }
                pos.clear();
                pos.extend((r0..r1).map(|r| rows[first + r].1));
                let qs = &q[(first + r0) * h..(first + r1) * h];
                let o = &mut chunk[r0 * h..r1 * h];
                match &gathered[si] {
                    Some(kv) => attn::tile(shape, kv, qs, &pos, o, scale),
                    None => {
                        let s = &seqs[si];
                        attn::row(shape, kp, vp, s.pages, ps, qs, pos[0], o, scale)
                    }
                }
                r0 = r1;
            }
        };
        if threads == 1 {
            run(0, &mut out);
        } else {
            let bounds = split_by_work(rows, threads, work);
            let run = &run;
            std::thread::scope(|sc| {
                let mut rest: &mut [f32] = &mut out;
                for w in bounds.windows(2) {
                    let (chunk, tail) = rest.split_at_mut((w[1] - w[0]) * h);
                    rest = tail;
                    let first = w[0];
                    sc.spawn(move || run(first, chunk));
                }
            });
        }
        out
    }
}

/// Layer `l`'s weights through `t` (a tensor by name, dequantized).
fn load_layer(
    c: &Config,
    l: usize,
    t: &mut impl FnMut(&str) -> Result<Tensor, ModelError>,
) -> Result<Layer, ModelError> {
    let bias = if c.arch.qkv_bias() {
        let mut b = |n: &str| vec1(&t(&format!("blk.{l}.{n}.bias"))?);
        Some([b("attn_q")?, b("attn_k")?, b("attn_v")?])
    } else {
        None
    };
    let qk_norm = if c.arch.qk_norm() {
        let mut n = |x: &str| vec1(&t(&format!("blk.{l}.{x}.weight"))?);
        Some([n("attn_q_norm")?, n("attn_k_norm")?])
    } else {
        None
    };
    let mut w = |n: &str| t(&format!("blk.{l}.{n}.weight"));
    Ok(Layer {
        bias,
        qk_norm,
        attn_norm: vec1(&w("attn_norm")?)?,
        ffn_norm: vec1(&w("ffn_norm")?)?,
        wq: Linear::new(w("attn_q")?)?,
        wk: Linear::new(w("attn_k")?)?,
        wv: Linear::new(w("attn_v")?)?,
        wo: Linear::new(w("attn_output")?)?,
        wg: Linear::new(w("ffn_gate")?)?,
        wu: Linear::new(w("ffn_up")?)?,
        wd: Linear::new(w("ffn_down")?)?,
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

/// The sequences, rows and per-row inputs of one forward call, shared by its layers.
struct Batch<'a> {
    seqs: &'a [SeqInput<'a>],
    /// (sequence, position) of each row.
    rows: &'a [(usize, usize)],
    positions: &'a [usize],
    /// Q8_0 weights for the row (see `Model::mm`).
    q8: &'a [bool],
}

/// Gathers the K/V of each sequence with several rows up to the last position this call
/// attends to (single rows, decode steps, read the pages directly).
fn gather(
    shape: attn::Shape,
    kp: &[f16],
    vp: &[f16],
    ps: usize,
    seqs: &[SeqInput],
    rows: &[(usize, usize)],
) -> Vec<Option<attn::SeqKv>> {
    let mut ctx = vec![0usize; seqs.len()];
    for &(si, p) in rows {
        ctx[si] = ctx[si].max(p + 1);
    }
    seqs.iter()
        .zip(&ctx)
        .map(|(s, &n)| {
            (s.tokens.len() > 1).then(|| attn::SeqKv::gather(shape, kp, vp, s.pages, ps, n))
        })
        .collect()
}

/// Splits rows so each of `threads` gets the same attention work (a row's work grows with
/// its position, so equal row counts would leave the last thread the most); returns the
/// boundaries, first 0 and last `rows.len()`.
fn split_by_work(rows: &[(usize, usize)], threads: usize, work: usize) -> Vec<usize> {
    let mut bounds = vec![0];
    let mut acc = 0;
    for (i, r) in rows.iter().enumerate() {
        acc += r.1 + 1;
        if acc * threads >= work * bounds.len() && bounds.len() < threads {
            bounds.push(i + 1);
        }
    }
    bounds.push(rows.len());
    bounds
}

fn as_f16(b: &[u8]) -> &[f16] {
    // SAFETY: f16 is a plain 2-byte value for which every bit pattern is valid; align_to only
    // reinterprets the aligned middle, and pool planes start 4 KiB aligned with even lengths.
    let (pre, mid, post) = unsafe { b.align_to::<f16>() };
    assert!(
        pre.is_empty() && post.is_empty(),
        "pool plane is not f16-aligned"
    );
    mid
}
