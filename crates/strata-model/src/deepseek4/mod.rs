//! DeepSeek-V4's forward pass, one token at a time, as docs/DSV4-FORWARD.md specifies it
//! (section numbers below are that document's), checked against llama.cpp's logits on the tiny
//! model (tests/dsv4_reference.rs). Plain loops in f32 (sums of squares in f64, as ggml). The
//! state a sequence keeps is reached only through [`Store`]: held whole ([`Dsv4State`], the
//! reference [`Dsv4::step`]) or in the tiered cache's device pages (`crate::deepseek4::paged`, the
//! forward pass the engine runs), with the same arithmetic either way.

pub(crate) mod config;
pub mod load;
pub(crate) mod math;
pub(crate) mod paged;
pub mod part;
pub(crate) mod store;
pub mod tp;

pub use crate::deepseek4::config::{expected, Dsv4Config, Weights};
use crate::deepseek4::math::{
    dot, hadamard, heap_select, matvec, rmsnorm, rmsnorm_w, rope, sigmoid, softplus,
};
pub use crate::deepseek4::part::Dsv4Part;
pub use crate::deepseek4::store::Dsv4State;
use crate::deepseek4::store::{Rows, Store};
use crate::shard::{Collective, Solo};

/// A half layer's output (a part's share), post gates and combination.
pub(crate) type Half = (Vec<f32>, Vec<f32>, Vec<f32>);

/// The model (or a tensor-parallel rank's part of it): configuration and weights by GGUF name.
pub struct Dsv4 {
    pub cfg: Dsv4Config,
    w: Weights,
    pub(crate) part: Dsv4Part,
    /// The output groups the part's heads touch, with the part's columns of each.
    groups: Vec<(usize, std::ops::Range<usize>)>,
}

impl Dsv4 {
    /// The model, once every tensor the configuration needs is there with its shape, and
    /// every hash layer's expert ids are experts.
    pub fn new(cfg: Dsv4Config, w: Weights) -> Result<Dsv4, String> {
        let part = Dsv4Part::whole(&cfg);
        Dsv4::new_part(cfg, w, part)
    }

    /// A tensor-parallel rank's part of the model ([`Dsv4Part`]), from the whole model's
    /// tensors: checked whole ([`Dsv4::new`]'s checks), then cut.
    pub fn new_part(cfg: Dsv4Config, w: Weights, part: Dsv4Part) -> Result<Dsv4, String> {
        cfg.validate()?;
        part.check(&cfg)?;
        Dsv4::check(&cfg, &w, &Dsv4Part::whole(&cfg))?;
        let w = part.cut(&cfg, w);
        Dsv4::from_cut(cfg, w, part)
    }

    /// A part from tensors already cut ([`Dsv4Part::cut_one`], as the loader does tensor by
    /// tensor): every tensor there with the part's shape.
    pub(crate) fn from_cut(cfg: Dsv4Config, w: Weights, part: Dsv4Part) -> Result<Dsv4, String> {
        cfg.validate()?;
        part.check(&cfg)?;
        Dsv4::check(&cfg, &w, &part)?;
        let groups = part.groups(&cfg);
        Ok(Dsv4 {
            cfg,
            w,
            part,
            groups,
        })
    }

    /// Every tensor the configuration needs is there with `part`'s shape of it, and every
    /// hash layer's expert ids are experts.
    fn check(cfg: &Dsv4Config, w: &Weights, part: &Dsv4Part) -> Result<(), String> {
        for (name, ne) in expected(cfg) {
            let ne = part.cut_shape(cfg, &name, ne);
            match w.get(&name) {
                None => return Err(format!("tensor {name} is missing")),
                Some((got, data)) if *got != ne || data.len() != ne.iter().product::<usize>() => {
                    return Err(format!("tensor {name} has shape {got:?}, expected {ne:?}"))
                }
                Some(_) => {}
            }
        }
        for l in 0..cfg.hash_layers {
            let ids = &w[&format!("blk.{l}.ffn_gate_tid2eid.weight")].1;
            if ids.iter().any(|v| v.to_bits() as usize >= cfg.experts) {
                return Err(format!(
                    "blk.{l}.ffn_gate_tid2eid names an expert past {}",
                    cfg.experts
                ));
            }
        }
        Ok(())
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
        Dsv4State::new(self.cfg.ratios.len())
    }

    /// The logits after `token` at the state's next position (the state moves on).
    pub fn step(&self, st: &mut Dsv4State, token: u32) -> Result<Vec<f32>, String> {
        if token as usize >= self.cfg.vocab {
            return Err(format!(
                "token {token} is outside the vocabulary ({})",
                self.cfg.vocab
            ));
        }
        if !self.part.is_whole(&self.cfg) {
            return Err("the reference pass runs the whole model, not a rank's part".into());
        }
        let p = st.pos;
        let hs = self.token(st, p, token, &Solo);
        st.pos += 1;
        Ok(self.head(&hs))
    }

    /// One token at position `p` through every layer, its state written to `st` (positions
    /// before `p` must be there); returns the hyper-connection streams for [`Dsv4::head`].
    /// `token` must be inside the vocabulary. A rank's part meets the others in `comm` after
    /// each attention and feed-forward.
    pub(crate) fn token<S: Store>(
        &self,
        st: &mut S,
        p: usize,
        token: u32,
        comm: &dyn Collective,
    ) -> Vec<f32> {
        let mut hs = self.embed(token);
        for l in 0..self.cfg.ratios.len() {
            let (mut o, post, comb) = self.attn_half(&hs, p, l, st);
            comm.all_reduce(&mut o);
            hs = self.hc_post(&o, &hs, &post, &comb);
            let (mut y, post, comb) = self.ffn_half(&hs, token, l);
            comm.all_reduce(&mut y);
            hs = self.hc_post(&y, &hs, &post, &comb);
        }
        hs
    }

    /// A token's streams before the first layer: its embedding in every stream.
    pub(crate) fn embed(&self, token: u32) -> Vec<f32> {
        let e = self.cfg.embd;
        let emb = &self.t("token_embd.weight")[token as usize * e..(token as usize + 1) * e];
        (0..self.cfg.hc).flat_map(|_| emb.iter().copied()).collect()
    }

    /// Layer `l`'s attention up to its output (this part's share of it), with the post gates
    /// and combination [`Dsv4::hc_post`] applies once the ranks' shares are summed.
    pub(crate) fn attn_half<S: Store>(&self, hs: &[f32], p: usize, l: usize, st: &mut S) -> Half {
        let (x, post, comb) = self.hc_pre(hs, l, "attn");
        let a = rmsnorm_w(&x, self.l(l, "attn_norm.weight"), self.cfg.eps_rms);
        (self.attention(&a, p, l, st), post, comb)
    }

    /// Layer `l`'s feed-forward (this part's share), as [`Dsv4::attn_half`].
    pub(crate) fn ffn_half(&self, hs: &[f32], token: u32, l: usize) -> Half {
        let (x, post, comb) = self.hc_pre(hs, l, "ffn");
        let f = rmsnorm_w(&x, self.l(l, "ffn_norm.weight"), self.cfg.eps_rms);
        (self.ffn(&f, token, l), post, comb)
    }

    /// §2.4 and the head: the logits from a token's streams.
    pub(crate) fn head(&self, hs: &[f32]) -> Vec<f32> {
        let c = &self.cfg;
        let e = c.embd;
        let n = rmsnorm(hs, c.eps_rms);
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
    pub(crate) fn hc_post(&self, y: &[f32], res: &[f32], post: &[f32], a: &[f32]) -> Vec<f32> {
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
    #[allow(clippy::too_many_arguments)]
    fn compress<S: Store>(
        &self,
        l: usize,
        prefix: &str,
        st: &S,
        which: Rows,
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
        // (offset, value row, score row) of each source token.
        let rows: Vec<(usize, &[f32], &[f32])> = src
            .iter()
            .map(|&(off, p)| {
                let (kv, sc) = st.row(l, which, p);
                (off, kv, sc)
            })
            .collect();
        let mut c = vec![0.0f32; dc];
        for (i, ci) in c.iter_mut().enumerate() {
            let m = rows
                .iter()
                .map(|&(off, _, sc)| sc[off + i])
                .fold(f32::NEG_INFINITY, f32::max);
            let z: f32 = rows
                .iter()
                .map(|&(off, _, sc)| (sc[off + i] - m).exp())
                .sum();
            *ci = rows
                .iter()
                .map(|&(off, kv, sc)| (sc[off + i] - m).exp() / z * kv[off + i])
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
    fn attention<S: Store>(&self, a: &[f32], p: usize, l: usize, st: &mut S) -> Vec<f32> {
        let c = &self.cfg;
        let (h, d, r) = (self.part.heads.len(), c.head_dim, c.ratios[l]);
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
        st.put_raw(l, p, &kv);
        if r != 0 {
            self.compress_step(a, p, l, st);
        }
        let st = &*st;
        // The keys: the window, and the compressed blocks in use.
        let lo = (p + 1).saturating_sub(c.window);
        let mut keys: Vec<&[f32]> = (lo..=p).map(|q| st.raw(l, q)).collect();
        match r {
            0 => {}
            4 => {
                for b in self.top_k(&qr, a, p, l, st) {
                    keys.push(st.block(l, b));
                }
            }
            _ => keys.extend((0..(p + 1) / r).map(|b| st.block(l, b))),
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
    fn compress_step<S: Store>(&self, a: &[f32], p: usize, l: usize, st: &mut S) {
        let c = &self.cfg;
        let (d, r) = (c.head_dim, c.ratios[l]);
        let (kv, sc) = self.compressor_row(l, "attn_compressor", a, p, r);
        st.put_row(l, Rows::Attn, p, &kv, &sc);
        if r == 4 {
            let (kv, sc) = self.compressor_row(l, "indexer_compressor", a, p, r);
            st.put_row(l, Rows::Index, p, &kv, &sc);
        }
        if (p + 1).is_multiple_of(r) {
            let b = p / r;
            let k = self.compress(l, "attn_compressor", st, Rows::Attn, b, r, d);
            st.put_block(l, b, &k);
            if r == 4 {
                let di = c.indexer_dim;
                let ik = self.compress(l, "indexer_compressor", st, Rows::Index, b, r, di);
                st.put_index_key(l, b, &hadamard(&ik));
            }
        }
    }

    /// §6.3: the heads' outputs through the grouped low-rank projection (a part: its heads'
    /// columns of each group they touch, through those groups' columns of `attn_output_b`).
    fn grouped_output(&self, o: &[f32], l: usize) -> Vec<f32> {
        let lo_r = self.cfg.out_lora_rank;
        let wa = self.l(l, "attn_output_a.weight");
        let mut u = vec![0.0f32; self.groups.len() * lo_r];
        let (mut at, mut from) = (0, 0);
        for (k, (_, cols)) in self.groups.iter().enumerate() {
            let z = &o[from..from + cols.len()];
            for ri in 0..lo_r {
                u[k * lo_r + ri] = dot(&wa[at..at + cols.len()], z);
                at += cols.len();
            }
            from += cols.len();
        }
        matvec(self.l(l, "attn_output_b.weight"), &u)
    }

    /// §6.2: the visible compressed blocks the indexer selects (ties as llama.cpp breaks them).
    fn top_k<S: Store>(&self, qr: &[f32], a: &[f32], p: usize, l: usize, st: &S) -> Vec<usize> {
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
                    .map(|(qh, wh)| dot(qh, st.index_key(l, b)).max(0.0) * wh)
                    .sum()
            })
            .collect();
        heap_select(&scores, c.indexer_top_k)
    }

    /// §7: routed experts (by score, or by the token on hash layers) and the shared expert.
    fn ffn(&self, f: &[f32], token: u32, l: usize) -> Vec<f32> {
        let c = &self.cfg;
        let (e, ff, n) = (c.embd, self.part.ffn.len(), c.experts);
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
            if c.expert_weights_norm {
                *v /= sum.max(6.103_515_6e-5);
            }
            *v *= c.expert_weights_scale;
        }
        // llama.cpp clamps only when the limit is above 1e-6 (`Dsv4::new` checked it is a
        // finite number ≥ 0).
        let clamp = c.swiglu_clamp[l];
        let swiglu = |g: &[f32], u: &[f32]| -> Vec<f32> {
            g.iter()
                .zip(u)
                .map(|(&g, &u)| {
                    if clamp > 1e-6 {
                        let g = g.min(clamp);
                        g * sigmoid(g) * u.clamp(-clamp, clamp)
                    } else {
                        g * sigmoid(g) * u
                    }
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
