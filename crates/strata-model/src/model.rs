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

use crate::error::ModelError;
use crate::gguf::{Config, Gguf};
use crate::q8::Q8Matrix;

/// Calls with at most this many rows (decode steps) use Q8_0 weights with f32 activations
/// ([`Q8Matrix`]): they are bound by memory bandwidth, and Q8_0 reads 28 % of f32's bytes.
/// Longer calls (prefill chunks) are bound by arithmetic and use f32 GEMM.
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

/// One sequence of a forward call.
#[derive(Clone, Copy, Debug)]
pub struct SeqInput<'a> {
    /// Tokens to compute now.
    pub tokens: &'a [u32],
    /// Tokens of this sequence already in its pages (the cached prefix and earlier chunks).
    pub pos: usize,
    /// Device pages holding positions `0..pos + tokens.len()`, in order.
    pub pages: &'a [u32],
}

/// A loaded model.
pub struct Model {
    pub config: Config,
    embed: Linear,
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
        let dev = Device::Cpu;
        let mut t =
            |name: &str| -> Result<Tensor, ModelError> { Ok(g.tensor(name)?.dequantize(&dev)?) };
        let embed = t("token_embd.weight")?;
        let norm = vec1(&t("output_norm.weight")?)?;
        let mut layers = Vec::with_capacity(c.layers);
        for l in 0..c.layers {
            let mut w = |n: &str| t(&format!("blk.{l}.{n}.weight"));
            layers.push(Layer {
                attn_norm: vec1(&w("attn_norm")?)?,
                ffn_norm: vec1(&w("ffn_norm")?)?,
                wq: Linear::new(w("attn_q")?)?,
                wk: Linear::new(w("attn_k")?)?,
                wv: Linear::new(w("attn_v")?)?,
                wo: Linear::new(w("attn_output")?)?,
                wg: Linear::new(w("ffn_gate")?)?,
                wu: Linear::new(w("ffn_up")?)?,
                wd: Linear::new(w("ffn_down")?)?,
            });
        }
        let half_dim = c.head_dim / 2;
        let mut cos = Vec::with_capacity(c.context_length * half_dim);
        let mut sin = Vec::with_capacity(c.context_length * half_dim);
        for p in 0..c.context_length {
            for i in 0..half_dim {
                let theta =
                    p as f64 * (c.rope_base as f64).powf(-2.0 * i as f64 / c.head_dim as f64);
                cos.push(theta.cos() as f32);
                sin.push(theta.sin() as f32);
            }
        }
        let embed_rows = vec1(&embed)?;
        Ok(Model {
            config: c,
            embed: Linear::new(embed)?,
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

    fn mm(&self, x: &[f32], n: usize, w: &Linear) -> Result<Vec<f32>, ModelError> {
        let k = x.len() / n;
        if n <= QUANTIZED_MAX_ROWS && self.quantized_decode {
            Ok(w.q8.matmul(x, self.threads))
        } else {
            let xt = Tensor::from_slice(x, (n, k), &Device::Cpu)?;
            vec1(&xt.matmul(&w.f32.t()?)?)
        }
    }

    /// Use Q8_0 weights for calls of at most [`QUANTIZED_MAX_ROWS`] rows (default on).
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

    fn rope(&self, x: &mut [f32], heads: usize, positions: &[usize]) {
        let hd = self.config.head_dim;
        let half_dim = hd / 2;
        for (row, &p) in x.chunks_exact_mut(heads * hd).zip(positions) {
            let (c, s) = (
                &self.cos[p * half_dim..(p + 1) * half_dim],
                &self.sin[p * half_dim..(p + 1) * half_dim],
            );
            for head in row.chunks_exact_mut(hd) {
                for i in 0..half_dim {
                    let (a, b) = (head[2 * i], head[2 * i + 1]);
                    head[2 * i] = a * c[i] - b * s[i];
                    head[2 * i + 1] = a * s[i] + b * c[i];
                }
            }
        }
    }

    /// One sequence: its logits (last token, or every token with `all_logits`).
    pub fn forward_one(
        &self,
        pool: &DevicePool,
        tokens: &[u32],
        pos: usize,
        pages: &[u32],
        all_logits: bool,
    ) -> Result<Vec<f32>, ModelError> {
        let mut v = self.forward(pool, &[SeqInput { tokens, pos, pages }], all_logits)?;
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
        let c = &self.config;
        let ps = pool.layout().page_size();
        if pool.layout().kinds().first() != Some(&self.pool_kind()) {
            return Err(ModelError::Forward(format!(
                "device pool layout {:?} does not match the model's {:?}",
                pool.layout().kinds(),
                self.pool_kind()
            )));
        }
        let mut rows = Vec::new(); // (seq, position)
        for (si, s) in seqs.iter().enumerate() {
            let end = s.pos + s.tokens.len();
            if end > c.context_length {
                return Err(ModelError::Forward(format!(
                    "sequence {si}: {end} tokens exceed the context length {}",
                    c.context_length
                )));
            }
            if s.pages.len() * ps < end {
                return Err(ModelError::Forward(format!(
                    "sequence {si}: {} pages of {ps} tokens cannot hold {end} tokens",
                    s.pages.len()
                )));
            }
            if let Some(&p) = s.pages.iter().find(|&&p| p >= pool.pages()) {
                return Err(ModelError::Forward(format!(
                    "sequence {si}: page {p} is outside the device pool"
                )));
            }
            for (j, &t) in s.tokens.iter().enumerate() {
                if t as usize >= c.vocab {
                    return Err(ModelError::Forward(format!(
                        "token id {t} is outside the vocabulary ({})",
                        c.vocab
                    )));
                }
                rows.push((si, s.pos + j));
            }
        }
        let n = rows.len();
        if n == 0 {
            return Ok(vec![Vec::new(); seqs.len()]);
        }
        let positions: Vec<usize> = rows.iter().map(|r| r.1).collect();
        let h = c.hidden;
        let kvd = c.kv_heads * c.head_dim;
        let mut x = Vec::with_capacity(n * h);
        for s in seqs {
            for &t in s.tokens {
                x.extend_from_slice(&self.embed_rows[t as usize * h..(t as usize + 1) * h]);
            }
        }
        for (l, w) in self.layers.iter().enumerate() {
            let hn = self.rmsnorm(&x, &w.attn_norm);
            let mut q = self.mm(&hn, n, &w.wq)?;
            let mut k = self.mm(&hn, n, &w.wk)?;
            let v = self.mm(&hn, n, &w.wv)?;
            self.rope(&mut q, c.heads, &positions);
            self.rope(&mut k, c.kv_heads, &positions);
            let mut buf = vec![0u8; kvd * 2];
            for (i, &(si, p)) in rows.iter().enumerate() {
                let page = seqs[si].pages[p / ps];
                for (plane, src) in [(0, &k), (1, &v)] {
                    for (d, &val) in buf.chunks_exact_mut(2).zip(&src[i * kvd..(i + 1) * kvd]) {
                        d.copy_from_slice(&f16::from_f32(val).to_le_bytes());
                    }
                    pool.write_token(0, l, plane, page, p % ps, &buf);
                }
            }
            let attn = self.attention(pool, l, seqs, &rows, &q);
            let o = self.mm(&attn, n, &w.wo)?;
            for (a, b) in x.iter_mut().zip(&o) {
                *a += b;
            }
            let hn = self.rmsnorm(&x, &w.ffn_norm);
            let g = self.mm(&hn, n, &w.wg)?;
            let u = self.mm(&hn, n, &w.wu)?;
            let act: Vec<f32> = g
                .iter()
                .zip(&u)
                .map(|(&g, &u)| g / (1.0 + (-g).exp()) * u)
                .collect();
            let d = self.mm(&act, n, &w.wd)?;
            for (a, b) in x.iter_mut().zip(&d) {
                *a += b;
            }
        }
        // Logits for the rows asked for.
        let mut pick = Vec::new();
        let mut at = 0;
        for s in seqs {
            let len = s.tokens.len();
            if all_logits {
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
        let logits = self.mm(&sel, pick.len(), &self.embed)?;
        let mut out = Vec::with_capacity(seqs.len());
        let mut it = logits.chunks_exact(c.vocab);
        for s in seqs {
            let take = if all_logits {
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

    /// Online-softmax attention of every row over its sequence's pages (causal). Each
    /// sequence's K/V are first gathered from its pages into f32 (once per layer, not once per
    /// row); then rows are split across threads and keys are taken in blocks: block scores,
    /// one rescale per block, vectorised exponentials.
    fn attention(
        &self,
        pool: &DevicePool,
        layer: usize,
        seqs: &[SeqInput],
        rows: &[(usize, usize)],
        q: &[f32],
    ) -> Vec<f32> {
        let c = &self.config;
        let (hd, h) = (c.head_dim, c.hidden);
        let kvd = c.kv_heads * hd;
        let group = c.heads / c.kv_heads;
        let ps = pool.layout().page_size();
        let kp = as_f16(pool.plane(0, layer, 0));
        let vp = as_f16(pool.plane(0, layer, 1));
        // Gather each sequence's K/V up to the last position this call attends to.
        let mut ctx = vec![0usize; seqs.len()];
        for &(si, p) in rows {
            ctx[si] = ctx[si].max(p + 1);
        }
        let gathered: Vec<(Vec<f32>, Vec<f32>)> = seqs
            .iter()
            .zip(&ctx)
            .map(|(s, &n)| {
                let (mut kf, mut vf) = (Vec::with_capacity(n * kvd), Vec::with_capacity(n * kvd));
                for t in 0..n {
                    let base = (s.pages[t / ps] as usize * ps + t % ps) * kvd;
                    kf.extend(kp[base..base + kvd].iter().map(|x| x.to_f32()));
                    vf.extend(vp[base..base + kvd].iter().map(|x| x.to_f32()));
                }
                (kf, vf)
            })
            .collect();
        let scale = 1.0 / (hd as f32).sqrt();
        let mut out = vec![0f32; rows.len() * h];
        // Threads only pay for themselves on enough work (a decode step is done inline).
        let work: usize = rows.iter().map(|r| r.1 + 1).sum();
        let threads = if work < 4096 { 1 } else { self.threads };
        let gathered = &gathered;
        let run = |first: usize, chunk: &mut [f32]| {
            // Key blocks of B positions are shared by a tile of up to R rows of one sequence,
            // so each block of K/V is read from memory once per tile, not once per row.
            const B: usize = 32;
            const R: usize = 8;
            let n_rows = chunk.len() / h;
            let mut sco = [0f32; B];
            let mut m = vec![0f32; R * group];
            let mut lsum = vec![0f32; R * group];
            let mut acc = vec![0f32; R * group * hd];
            let mut r0 = 0;
            while r0 < n_rows {
                let si = rows[first + r0].0;
                let mut r1 = r0 + 1;
                while r1 < n_rows && r1 - r0 < R && rows[first + r1].0 == si {
                    r1 += 1;
                }
                let tile = r1 - r0;
                let pmax = (r0..r1)
                    .map(|r| rows[first + r].1)
                    .max()
                    .expect("non-empty tile");
                let (kf, vf) = &gathered[si];
                for g in 0..c.kv_heads {
                    m.fill(f32::NEG_INFINITY);
                    lsum.fill(0.0);
                    acc.fill(0.0);
                    let mut t0 = 0;
                    while t0 <= pmax {
                        let t1 = (t0 + B).min(pmax + 1);
                        for r in 0..tile {
                            let row = first + r0 + r;
                            let p = rows[row].1;
                            if t0 > p {
                                continue;
                            }
                            let nb = t1.min(p + 1) - t0;
                            let qi = &q[row * h..(row + 1) * h];
                            for j in 0..group {
                                let st = r * group + j;
                                let qh = &qi[(g * group + j) * hd..(g * group + j + 1) * hd];
                                let sj = &mut sco[..nb];
                                for (b, sv) in sj.iter_mut().enumerate() {
                                    let k =
                                        &kf[(t0 + b) * kvd + g * hd..(t0 + b) * kvd + (g + 1) * hd];
                                    *sv = dot(qh, k) * scale;
                                }
                                let bmax = sj.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                                let mnew = m[st].max(bmax);
                                let a = &mut acc[st * hd..(st + 1) * hd];
                                if mnew > m[st] {
                                    let f = (m[st] - mnew).exp();
                                    lsum[st] *= f;
                                    for x in a.iter_mut() {
                                        *x *= f;
                                    }
                                    m[st] = mnew;
                                }
                                for sv in sj.iter_mut() {
                                    *sv = fast_exp(*sv - mnew);
                                }
                                lsum[st] += sj.iter().sum::<f32>();
                                for (b, &e) in sj.iter().enumerate() {
                                    let v =
                                        &vf[(t0 + b) * kvd + g * hd..(t0 + b) * kvd + (g + 1) * hd];
                                    for (x, &vv) in a.iter_mut().zip(v) {
                                        *x += e * vv;
                                    }
                                }
                            }
                        }
                        t0 = t1;
                    }
                    for r in 0..tile {
                        let o = &mut chunk[(r0 + r) * h..(r0 + r + 1) * h];
                        for j in 0..group {
                            let st = r * group + j;
                            let dst = &mut o[(g * group + j) * hd..(g * group + j + 1) * hd];
                            for (d, &a) in dst.iter_mut().zip(&acc[st * hd..(st + 1) * hd]) {
                                *d = a / lsum[st];
                            }
                        }
                    }
                }
                r0 = r1;
            }
        };
        if threads == 1 {
            run(0, &mut out);
        } else {
            // Split rows so each thread gets the same attention work (a row's work grows with
            // its position, so equal row counts would leave the last thread the most).
            let mut bounds = vec![0];
            let mut acc = 0;
            for (i, r) in rows.iter().enumerate() {
                acc += r.1 + 1;
                if acc * threads >= work * bounds.len() && bounds.len() < threads {
                    bounds.push(i + 1);
                }
            }
            bounds.push(rows.len());
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

/// Dot product with 8 independent accumulators, so the compiler can keep it in SIMD lanes.
#[inline]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    let mut s: f32 = acc.iter().sum();
    for (x, y) in ra.iter().zip(rb) {
        s += x * y;
    }
    s
}

/// e^x for x ≤ 0 (softmax arguments), branch-free so loops over it vectorise: 2^(x·log2 e) by
/// splitting into integer and fraction, with a degree-8 polynomial for 2^f (relative error
/// below 1e-5, from rounding x·log2 e in f32); arguments below -87 give about 0.
#[inline]
fn fast_exp(x: f32) -> f32 {
    let x = x.max(-87.0);
    let y = x * std::f32::consts::LOG2_E;
    let n = y.floor();
    let f = y - n;
    // Taylor series of 2^f = e^(f ln 2) to the 8th power: truncation error below 2e-7.
    let c = [
        std::f32::consts::LN_2,
        0.240_226_5,
        0.055_504_11,
        0.009_618_129,
        0.001_333_355,
        0.000_154_035_3,
        0.000_015_252_73,
        0.000_001_321_548,
    ];
    let mut p = c[7];
    for k in (0..7).rev() {
        p = c[k] + f * p;
    }
    let p = 1.0 + f * p;
    f32::from_bits(((n as i32 + 127) as u32) << 23) * p
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fast_exp_matches_exp() {
        let mut worst = 0f32;
        let mut x = -87.0f32;
        while x <= 0.0 {
            let r = (fast_exp(x) - x.exp()).abs() / x.exp();
            worst = worst.max(r);
            x += 0.0137;
        }
        // Bounded by rounding x·log2(e) in f32 for large |x| (half an ulp of 125 is 4e-6).
        assert!(worst < 1e-5, "relative error {worst}");
        assert!(fast_exp(-1000.0) >= 0.0 && fast_exp(-1000.0) < 1e-37);
        assert!((fast_exp(0.0) - 1.0).abs() < 1e-7);
    }

    #[test]
    fn dot_matches_naive() {
        let a: Vec<f32> = (0..67).map(|i| i as f32 * 0.1).collect();
        let b: Vec<f32> = (0..67).map(|i| 1.0 - i as f32 * 0.01).collect();
        let naive: f32 = a.iter().zip(&b).map(|(x, y)| x * y).sum();
        assert!((dot(&a, &b) - naive).abs() < 1e-3);
    }
}
