//! DeepSeek-V4's forward pass, one token at a time, as docs/DSV4-FORWARD.md specifies it
//! (section numbers below are that document's): the reference the paged, batched forward pass
//! will be checked against, itself checked against llama.cpp's logits on the tiny model
//! (tests/dsv4_reference.rs). Plain loops in f32 (sums of squares in f64, as ggml); every
//! state a sequence keeps is held here whole ([`Dsv4State`]), per layer kind.

use std::collections::HashMap;

/// The hyper-parameters the forward pass needs.
#[derive(Clone, Debug)]
pub struct Dsv4Config {
    pub embd: usize,
    pub vocab: usize,
    pub heads: usize,
    pub head_dim: usize,
    pub rope_dims: usize,
    pub q_lora_rank: usize,
    pub window: usize,
    pub ratios: Vec<usize>,
    pub experts: usize,
    pub experts_used: usize,
    pub expert_ffn: usize,
    pub hash_layers: usize,
    pub indexer_heads: usize,
    pub indexer_dim: usize,
    pub indexer_top_k: usize,
    pub out_groups: usize,
    pub out_lora_rank: usize,
    pub hc: usize,
    pub sinkhorn_iters: usize,
    pub eps_rms: f32,
    pub eps_hc: f32,
    pub rope_base: f32,
    pub compress_rope_base: f32,
    pub swiglu_clamp: f32,
    pub expert_weights_scale: f32,
}

/// A tensor: shape as llama.cpp states it (`ne`, fastest first) and its values.
pub type Weights = HashMap<String, (Vec<usize>, Vec<f32>)>;

/// The model: configuration and weights by GGUF name.
pub struct Dsv4 {
    pub cfg: Dsv4Config,
    w: Weights,
}

/// What one sequence keeps per layer between tokens (§11), whole.
#[derive(Default)]
struct LayerState {
    /// Raw K (= V) of every position (only the last `window` are read).
    raw: Vec<Vec<f32>>,
    /// Compressor rows (value, score) of every position: the attention compressor's and the
    /// indexer's.
    rows: Vec<(Vec<f32>, Vec<f32>)>,
    index_rows: Vec<(Vec<f32>, Vec<f32>)>,
    /// Compressed blocks: K (CSA or HCA) and indexer keys.
    blocks: Vec<Vec<f32>>,
    index_keys: Vec<Vec<f32>>,
}

/// A sequence's state: per layer, and the next position.
pub struct Dsv4State {
    layers: Vec<LayerState>,
    pos: usize,
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// `W · x` for W with `ne = [in, out]` (out rows of `in`).
fn matvec(w: &[f32], x: &[f32]) -> Vec<f32> {
    w.chunks_exact(x.len()).map(|row| dot(row, x)).collect()
}

fn rms_scale(x: &[f32], eps: f32) -> f32 {
    let ss: f64 = x.iter().map(|&v| v as f64 * v as f64).sum();
    1.0 / ((ss / x.len() as f64) as f32 + eps).sqrt()
}

fn rmsnorm(x: &[f32], eps: f32) -> Vec<f32> {
    let s = rms_scale(x, eps);
    x.iter().map(|v| v * s).collect()
}

fn rmsnorm_w(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let s = rms_scale(x, eps);
    x.iter().zip(w).map(|(v, g)| v * s * g).collect()
}

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

/// RoPE (§3.1): adjacent pairs on the last `r` dims of `x`, at position `p`; `sign` −1 is the
/// inverse rotation.
fn rope(x: &mut [f32], r: usize, p: usize, base: f32, sign: f32) {
    let o = x.len() - r;
    let ts = base.powf(-2.0 / r as f32);
    let mut theta = p as f32;
    for k in 0..r / 2 {
        let (c, s) = (theta.cos(), sign * theta.sin());
        let i = o + 2 * k;
        let (a, b) = (x[i], x[i + 1]);
        x[i] = a * c - b * s;
        x[i + 1] = a * s + b * c;
        theta *= ts;
    }
}

/// The orthonormal Walsh–Hadamard transform of a 64-value vector (§5.3).
fn hadamard(x: &[f32]) -> Vec<f32> {
    let n = x.len();
    let scale = 1.0 / (n as f32).sqrt();
    (0..n)
        .map(|i| {
            (0..n)
                .map(|j| {
                    let sign = if (i & j).count_ones() % 2 == 0 {
                        1.0
                    } else {
                        -1.0
                    };
                    sign * x[j]
                })
                .sum::<f32>()
                * scale
        })
        .collect()
}

/// The `k` largest of `scores` as llama.cpp's `ggml_top_k` chooses them: `std::partial_sort`
/// of the indices with `score[a] > score[b]`, whose set on ties is libstdc++'s heap-select
/// (a heap of the first `k`, then each later index replaces the heap's top, its smallest,
/// only when strictly larger). Exact ties are common here: a block whose every ReLU term is
/// zero scores exactly 0. The heap operations follow libstdc++'s `bits/stl_heap.h`.
fn heap_select(scores: &[f32], k: usize) -> Vec<usize> {
    let n = scores.len();
    if n <= k {
        return (0..n).collect();
    }
    let comp = |a: usize, b: usize| scores[a] > scores[b];
    let mut h: Vec<usize> = (0..k).collect();
    let push = |h: &mut [usize], mut hole: usize, top: usize, value: usize| {
        while hole > top {
            let parent = (hole - 1) / 2;
            if !comp(h[parent], value) {
                break;
            }
            h[hole] = h[parent];
            hole = parent;
        }
        h[hole] = value;
    };
    let adjust = |h: &mut [usize], mut hole: usize, len: usize, value: usize| {
        let top = hole;
        let mut second = hole;
        while second < (len - 1) / 2 {
            second = 2 * (second + 1);
            if comp(h[second], h[second - 1]) {
                second -= 1;
            }
            h[hole] = h[second];
            hole = second;
        }
        if len.is_multiple_of(2) && second == (len - 2) / 2 {
            second = 2 * (second + 1);
            h[hole] = h[second - 1];
            hole = second - 1;
        }
        push(h, hole, top, value);
    };
    if k >= 2 {
        let mut parent = (k - 2) / 2;
        loop {
            let v = h[parent];
            adjust(&mut h, parent, k, v);
            if parent == 0 {
                break;
            }
            parent -= 1;
        }
    }
    for i in k..n {
        if comp(i, h[0]) {
            // __pop_heap(first, middle, i): *i = *first (irrelevant here), then sift i in.
            adjust(&mut h, 0, k, i);
        }
    }
    h
}

impl Dsv4 {
    pub fn new(cfg: Dsv4Config, w: Weights) -> Dsv4 {
        Dsv4 { cfg, w }
    }

    fn t(&self, name: &str) -> &[f32] {
        &self
            .w
            .get(name)
            .unwrap_or_else(|| panic!("tensor {name} missing"))
            .1
    }

    fn l(&self, l: usize, name: &str) -> &[f32] {
        self.t(&format!("blk.{l}.{name}"))
    }

    pub fn new_state(&self) -> Dsv4State {
        Dsv4State {
            layers: (0..self.cfg.ratios.len())
                .map(|_| LayerState::default())
                .collect(),
            pos: 0,
        }
    }

    /// The logits after `token` at the state's next position (the state moves on).
    pub fn step(&self, st: &mut Dsv4State, token: u32) -> Vec<f32> {
        let c = &self.cfg;
        let e = c.embd;
        let emb = &self.t("token_embd.weight")[token as usize * e..(token as usize + 1) * e];
        let mut hs: Vec<f32> = (0..c.hc).flat_map(|_| emb.iter().copied()).collect();
        let p = st.pos;
        for l in 0..c.ratios.len() {
            let (x, post, comb) = self.hc_pre(&hs, l, "attn");
            let a = rmsnorm_w(&x, self.l(l, "attn_norm.weight"), c.eps_rms);
            let o = self.attention(&a, p, l, &mut st.layers[l]);
            hs = self.hc_post(&o, &hs, &post, &comb);
            let (x, post, comb) = self.hc_pre(&hs, l, "ffn");
            let f = rmsnorm_w(&x, self.l(l, "ffn_norm.weight"), c.eps_rms);
            let y = self.ffn(&f, token, l);
            hs = self.hc_post(&y, &hs, &post, &comb);
        }
        st.pos += 1;
        // §2.4 and the head.
        let n = rmsnorm(&hs, c.eps_rms);
        let mix = matvec(self.t("output_hc_fn.weight"), &n);
        let (base, scale) = (
            self.t("output_hc_base.weight"),
            self.t("output_hc_scale.weight"),
        );
        let mut z = vec![0.0f32; e];
        for h in 0..c.hc {
            let pre = sigmoid(mix[h] * scale[0] + base[h]) + c.eps_hc;
            for (zi, v) in z.iter_mut().zip(&hs[h * e..(h + 1) * e]) {
                *zi += pre * v;
            }
        }
        let z = rmsnorm_w(&z, self.t("output_norm.weight"), c.eps_rms);
        matvec(self.t("output.weight"), &z)
    }

    /// §2.1–2.2: the mixed input, the post gates and the Sinkhorn-normalised combination.
    fn hc_pre(&self, hs: &[f32], l: usize, which: &str) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        let c = &self.cfg;
        let (s, e, eps) = (c.hc, c.embd, c.eps_hc);
        let n = rmsnorm(hs, c.eps_rms);
        let mix = matvec(self.l(l, &format!("hc_{which}_fn.weight")), &n);
        let base = self.l(l, &format!("hc_{which}_base.weight"));
        let scale = self.l(l, &format!("hc_{which}_scale.weight"));
        let pre: Vec<f32> = (0..s)
            .map(|h| sigmoid(mix[h] * scale[0] + base[h]) + eps)
            .collect();
        let post: Vec<f32> = (0..s)
            .map(|h| 2.0 * sigmoid(mix[s + h] * scale[1] + base[s + h]))
            .collect();
        // a[src * s + dst]
        let mut a: Vec<f32> = (0..s * s)
            .map(|i| mix[2 * s + i] * scale[2] + base[2 * s + i])
            .collect();
        for src in 0..s {
            let row = &mut a[src * s..(src + 1) * s];
            let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let z: f32 = row.iter().map(|v| (v - m).exp()).sum();
            for v in row.iter_mut() {
                *v = (*v - m).exp() / z + eps;
            }
        }
        let cols = |a: &mut Vec<f32>| {
            for d in 0..s {
                let sum: f32 = (0..s).map(|src| a[src * s + d]).sum::<f32>() + eps;
                let inv = 1.0 / sum;
                for src in 0..s {
                    a[src * s + d] *= inv;
                }
            }
        };
        let rows = |a: &mut Vec<f32>| {
            for src in 0..s {
                let sum: f32 = a[src * s..(src + 1) * s].iter().sum::<f32>() + eps;
                let inv = 1.0 / sum;
                for v in &mut a[src * s..(src + 1) * s] {
                    *v *= inv;
                }
            }
        };
        cols(&mut a);
        for _ in 1..c.sinkhorn_iters {
            rows(&mut a);
            cols(&mut a);
        }
        let mut x = vec![0.0f32; e];
        for h in 0..s {
            for (xi, v) in x.iter_mut().zip(&hs[h * e..(h + 1) * e]) {
                *xi += pre[h] * v;
            }
        }
        (x, post, a)
    }

    /// §2.3.
    fn hc_post(&self, y: &[f32], res: &[f32], post: &[f32], a: &[f32]) -> Vec<f32> {
        let (s, e) = (self.cfg.hc, self.cfg.embd);
        let mut out = vec![0.0f32; s * e];
        for d in 0..s {
            for i in 0..e {
                let mut v = y[i] * post[d];
                for src in 0..s {
                    v += a[src * s + d] * res[src * e + i];
                }
                out[d * e + i] = v;
            }
        }
        out
    }

    /// §5: a compressor's row for position `p` (value, score with the position embedding).
    fn compressor_row(
        &self,
        l: usize,
        prefix: &str,
        a: &[f32],
        p: usize,
        r: usize,
    ) -> (Vec<f32>, Vec<f32>) {
        let kv = matvec(self.l(l, &format!("{prefix}_kv.weight")), a);
        let mut sc = matvec(self.l(l, &format!("{prefix}_gate.weight")), a);
        let ape = self.l(l, &format!("{prefix}_ape.weight"));
        let w = sc.len();
        for (v, x) in sc.iter_mut().zip(&ape[(p % r) * w..(p % r + 1) * w]) {
            *v += x;
        }
        (kv, sc)
    }

    /// §5.1–5.2: block `b` of ratio `r` from the rows, normalised and rotated to its start.
    fn compress(
        &self,
        l: usize,
        prefix: &str,
        rows: &[(Vec<f32>, Vec<f32>)],
        b: usize,
        r: usize,
        dc: usize,
    ) -> Vec<f32> {
        // (value channel offset, token) pairs that feed the block.
        let mut src: Vec<(usize, usize)> = Vec::new();
        if r == 4 {
            if b > 0 {
                src.extend((4 * b - 4..4 * b).map(|p| (0, p)));
            }
            src.extend((4 * b..4 * b + 4).map(|p| (dc, p)));
        } else {
            src.extend((r * b..r * b + r).map(|p| (0, p)));
        }
        let mut c = vec![0.0f32; dc];
        for (i, ci) in c.iter_mut().enumerate() {
            let m = src
                .iter()
                .map(|&(off, p)| rows[p].1[off + i])
                .fold(f32::NEG_INFINITY, f32::max);
            let z: f32 = src
                .iter()
                .map(|&(off, p)| (rows[p].1[off + i] - m).exp())
                .sum();
            *ci = src
                .iter()
                .map(|&(off, p)| (rows[p].1[off + i] - m).exp() / z * rows[p].0[off + i])
                .sum();
        }
        let mut c = rmsnorm_w(
            &c,
            self.l(l, &format!("{prefix}_norm.weight")),
            self.cfg.eps_rms,
        );
        rope(
            &mut c,
            self.cfg.rope_dims,
            r * b,
            self.cfg.compress_rope_base,
            1.0,
        );
        c
    }

    /// §3–§6: one token's attention in layer `l`.
    fn attention(&self, a: &[f32], p: usize, l: usize, st: &mut LayerState) -> Vec<f32> {
        let c = &self.cfg;
        let (h, d, r) = (c.heads, c.head_dim, c.ratios[l]);
        let base = if r == 0 {
            c.rope_base
        } else {
            c.compress_rope_base
        };
        let qr = rmsnorm_w(
            &matvec(self.l(l, "attn_q_a.weight"), a),
            self.l(l, "attn_q_a_norm.weight"),
            c.eps_rms,
        );
        let mut q = matvec(self.l(l, "attn_q_b.weight"), &qr);
        for qh in q.chunks_exact_mut(d) {
            let n = rmsnorm(qh, c.eps_rms);
            qh.copy_from_slice(&n);
            rope(qh, c.rope_dims, p, base, 1.0);
        }
        let mut kv = rmsnorm_w(
            &matvec(self.l(l, "attn_kv.weight"), a),
            self.l(l, "attn_kv_a_norm.weight"),
            c.eps_rms,
        );
        rope(&mut kv, c.rope_dims, p, base, 1.0);
        st.raw.push(kv);
        if r != 0 {
            self.compress_step(a, p, l, st);
        }
        // The keys: the window, and the compressed blocks in use.
        let lo = (p + 1).saturating_sub(c.window);
        let mut keys: Vec<&[f32]> = st.raw[lo..=p].iter().map(|k| k.as_slice()).collect();
        match r {
            0 => {}
            4 => {
                for b in self.top_k(&qr, a, p, l, st) {
                    keys.push(&st.blocks[b]);
                }
            }
            _ => keys.extend(st.blocks.iter().map(|k| k.as_slice())),
        }
        let sinks = self.l(l, "attn_sinks.weight");
        let kappa = 1.0 / (d as f32).sqrt();
        let mut o = vec![0.0f32; h * d];
        for (hh, oh) in o.chunks_exact_mut(d).enumerate() {
            let qh = &q[hh * d..(hh + 1) * d];
            let logits: Vec<f32> = keys.iter().map(|k| kappa * dot(qh, k)).collect();
            let m = logits.iter().copied().fold(sinks[hh], f32::max);
            let z: f32 = logits.iter().map(|x| (x - m).exp()).sum::<f32>() + (sinks[hh] - m).exp();
            for (k, x) in keys.iter().zip(&logits) {
                let pi = (x - m).exp() / z;
                for (ov, kv) in oh.iter_mut().zip(k.iter()) {
                    *ov += pi * kv;
                }
            }
            rope(oh, c.rope_dims, p, base, -1.0);
        }
        self.grouped_output(&o, l)
    }

    /// §5: the compressor rows of position `p`, and the block it completes (with its indexer
    /// key on ratio-4 layers).
    fn compress_step(&self, a: &[f32], p: usize, l: usize, st: &mut LayerState) {
        let c = &self.cfg;
        let (d, r) = (c.head_dim, c.ratios[l]);
        st.rows
            .push(self.compressor_row(l, "attn_compressor", a, p, r));
        if r == 4 {
            st.index_rows
                .push(self.compressor_row(l, "indexer_compressor", a, p, r));
        }
        if (p + 1).is_multiple_of(r) {
            let b = p / r;
            let k = self.compress(l, "attn_compressor", &st.rows, b, r, d);
            st.blocks.push(k);
            if r == 4 {
                let ik =
                    self.compress(l, "indexer_compressor", &st.index_rows, b, r, c.indexer_dim);
                st.index_keys.push(hadamard(&ik));
            }
        }
    }

    /// §6.3: the heads' outputs through the grouped low-rank projection.
    fn grouped_output(&self, o: &[f32], l: usize) -> Vec<f32> {
        let c = &self.cfg;
        let (g, lo_r) = (c.out_groups, c.out_lora_rank);
        let gw = c.heads * c.head_dim / g;
        let wa = self.l(l, "attn_output_a.weight");
        let mut u = vec![0.0f32; g * lo_r];
        for gi in 0..g {
            let z = &o[gi * gw..(gi + 1) * gw];
            for ri in 0..lo_r {
                let row = gi * lo_r + ri;
                u[row] = dot(&wa[row * gw..(row + 1) * gw], z);
            }
        }
        matvec(self.l(l, "attn_output_b.weight"), &u)
    }

    /// §6.2: the visible compressed blocks the indexer selects (ties as llama.cpp breaks them).
    fn top_k(&self, qr: &[f32], a: &[f32], p: usize, l: usize, st: &LayerState) -> Vec<usize> {
        let c = &self.cfg;
        let (hi, di) = (c.indexer_heads, c.indexer_dim);
        let mut iq = matvec(self.l(l, "indexer.attn_q_b.weight"), qr);
        let mut heads = Vec::with_capacity(hi);
        for qh in iq.chunks_exact_mut(di) {
            rope(qh, c.rope_dims, p, c.compress_rope_base, 1.0);
            heads.push(hadamard(qh));
        }
        let scale = 1.0 / ((di * hi) as f32).sqrt();
        let w: Vec<f32> = matvec(self.l(l, "indexer.proj.weight"), a)
            .iter()
            .map(|v| v * scale)
            .collect();
        let visible = (p + 1) / 4;
        let scores: Vec<f32> = (0..visible)
            .map(|b| {
                heads
                    .iter()
                    .zip(&w)
                    .map(|(qh, wh)| dot(qh, &st.index_keys[b]).max(0.0) * wh)
                    .sum()
            })
            .collect();
        heap_select(&scores, c.indexer_top_k)
    }

    /// §7: routed experts (by score, or by the token on hash layers) and the shared expert.
    fn ffn(&self, f: &[f32], token: u32, l: usize) -> Vec<f32> {
        let c = &self.cfg;
        let (e, ff, n) = (c.embd, c.expert_ffn, c.experts);
        let scores: Vec<f32> = matvec(self.l(l, "ffn_gate_inp.weight"), f)
            .iter()
            .map(|&x| softplus(x).sqrt())
            .collect();
        let chosen: Vec<usize> = if l < c.hash_layers {
            let t = self.l(l, "ffn_gate_tid2eid.weight");
            let k = c.experts_used;
            t[token as usize * k..(token as usize + 1) * k]
                .iter()
                .map(|v| v.to_bits() as usize)
                .collect()
        } else {
            let bias = self.l(l, "exp_probs_b.bias");
            let mut idx: Vec<usize> = (0..n).collect();
            idx.sort_by(|&x, &y| {
                (scores[y] + bias[y])
                    .total_cmp(&(scores[x] + bias[x]))
                    .then(x.cmp(&y))
            });
            idx.truncate(c.experts_used);
            idx
        };
        let mut w: Vec<f32> = chosen.iter().map(|&x| scores[x]).collect();
        let sum: f32 = w.iter().sum();
        for v in w.iter_mut() {
            *v = *v / sum.max(6.103_515_6e-5) * c.expert_weights_scale;
        }
        let clamp = c.swiglu_clamp;
        let swiglu = |g: &[f32], u: &[f32]| -> Vec<f32> {
            g.iter()
                .zip(u)
                .map(|(&g, &u)| {
                    let g = g.min(clamp);
                    g * sigmoid(g) * u.clamp(-clamp, clamp)
                })
                .collect()
        };
        let (wg, wu, wd) = (
            self.l(l, "ffn_gate_exps.weight"),
            self.l(l, "ffn_up_exps.weight"),
            self.l(l, "ffn_down_exps.weight"),
        );
        let mut y = vec![0.0f32; e];
        for (&x, &wx) in chosen.iter().zip(&w) {
            let sl = x * ff * e..(x + 1) * ff * e;
            let hdn = swiglu(&matvec(&wg[sl.clone()], f), &matvec(&wu[sl.clone()], f));
            let out = matvec(&wd[sl], &hdn);
            for (yi, v) in y.iter_mut().zip(&out) {
                *yi += wx * v;
            }
        }
        let hdn = swiglu(
            &matvec(self.l(l, "ffn_gate_shexp.weight"), f),
            &matvec(self.l(l, "ffn_up_shexp.weight"), f),
        );
        let shared = matvec(self.l(l, "ffn_down_shexp.weight"), &hdn);
        y.iter().zip(&shared).map(|(a, b)| a + b).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn heap_select_keeps_libstdcxx_choices_on_ties() {
        // Nothing strictly larger arrives: the first k stay.
        assert_eq!(sorted(heap_select(&[0.0, 0.0, 0.0], 2)), vec![0, 1]);
        // A larger one replaces the heap's top (here index 1, by libstdc++'s layout).
        assert_eq!(sorted(heap_select(&[0.0, 0.0, 0.0, 5.0], 2)), vec![0, 3]);
        assert_eq!(
            sorted(heap_select(&[3.0, 1.0, 2.0, 5.0, 4.0], 3)),
            vec![0, 3, 4]
        );
        // Fewer than k: all of them.
        assert_eq!(sorted(heap_select(&[1.0], 8)), vec![0]);
    }

    fn sorted(mut v: Vec<usize>) -> Vec<usize> {
        v.sort_unstable();
        v
    }

    #[test]
    fn the_hadamard_rotation_is_orthonormal_and_self_inverse() {
        let x: Vec<f32> = (0..64).map(|i| (i as f32 * 0.37).sin()).collect();
        let y = hadamard(&hadamard(&x));
        assert!(x.iter().zip(&y).all(|(a, b)| (a - b).abs() < 1e-5));
        let n = |v: &[f32]| dot(v, v);
        assert!((n(&hadamard(&x)) - n(&x)).abs() < 1e-4);
    }
}
