//! A tensor-parallel rank's share of DeepSeek-V4 ([`Dsv4Part`]), split the way SGLang and
//! DeepSeek's reference inference split it:
//!
//! * **attention heads**: each rank holds the query rows of its heads (`attn_q_b`), their
//!   sinks, and the columns of the grouped output projection over them (`attn_output_a`'s
//!   columns inside each output group the rank's heads touch, `attn_output_b`'s columns of
//!   those groups). A group split between ranks (more ranks than groups) still adds up: the
//!   low-rank output is linear in the heads' values, so each rank's part of a group's low-rank
//!   vector goes through `attn_output_b` and the ranks' results are summed (all-reduce).
//! * **experts' and the shared expert's width**: each rank holds rows `ffn` of every expert's
//!   gate and up matrices and those columns of its down matrix; routing is computed whole on
//!   every rank (the same bits), the ranks' partial outputs are summed.
//! * **vocabulary**: rows `vocab` of the output head; the logits are gathered.
//! * **replicated**: everything else — embeddings, hyper-connections, norms, the single K = V
//!   head (`attn_kv`), the compressors and the indexer. So every state kind (raw window,
//!   compressed blocks, indexer keys, compressor rows) is the same on every rank, bit for bit
//!   (the ranks add their partial sums in rank order), and each rank keeps its own copy in its
//!   own pool kinds, as the plan sizes them (`split_across_tp: false`).

use std::ops::Range;

use strata_kv::tp::even_runs;

use crate::dsv4_config::{Dsv4Config, Weights};
use crate::error::ModelError;

/// One rank's share of the model (the whole model: [`Dsv4Part::whole`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Dsv4Part {
    pub rank: usize,
    /// Attention heads.
    pub heads: Range<usize>,
    /// Columns of every expert's (and the shared expert's) hidden layer.
    pub ffn: Range<usize>,
    /// Rows of the output head.
    pub vocab: Range<usize>,
}

impl Dsv4Part {
    pub fn whole(c: &Dsv4Config) -> Dsv4Part {
        Dsv4Part {
            rank: 0,
            heads: 0..c.heads,
            ffn: 0..c.expert_ffn,
            vocab: 0..c.vocab,
        }
    }

    /// The parts of `tp` ranks: heads, expert width and vocabulary in even runs.
    pub fn split(c: &Dsv4Config, tp: usize) -> Result<Vec<Dsv4Part>, ModelError> {
        let bad = |what: &str, n: usize| {
            ModelError::Forward(format!(
                "--tp-size {tp}: DeepSeek-V4 splits its {n} {what} over the ranks, and each rank \
                 needs at least one"
            ))
        };
        if tp == 0 {
            return Err(ModelError::Forward("--tp-size 0".into()));
        }
        if tp > c.heads {
            return Err(bad("attention heads", c.heads));
        }
        if tp > c.expert_ffn {
            return Err(bad("expert hidden columns", c.expert_ffn));
        }
        if tp > c.vocab {
            return Err(bad("vocabulary rows", c.vocab));
        }
        let (h, f, v) = (
            even_runs(c.heads, tp),
            even_runs(c.expert_ffn, tp),
            even_runs(c.vocab, tp),
        );
        Ok((0..tp)
            .map(|r| Dsv4Part {
                rank: r,
                heads: h[r].clone(),
                ffn: f[r].clone(),
                vocab: v[r].clone(),
            })
            .collect())
    }

    pub fn is_whole(&self, c: &Dsv4Config) -> bool {
        *self == Dsv4Part::whole(c)
    }

    /// The output groups the rank's heads touch, each as (the group, its columns the rank
    /// holds: a range of the group's `heads·head_dim / groups` inputs).
    pub fn groups(&self, c: &Dsv4Config) -> Vec<(usize, Range<usize>)> {
        let gw = c.heads * c.head_dim / c.out_groups;
        let (lo, hi) = (self.heads.start * c.head_dim, self.heads.end * c.head_dim);
        (0..c.out_groups)
            .filter_map(|g| {
                let (s, e) = (lo.max(g * gw), hi.min((g + 1) * gw));
                (s < e).then(|| (g, s - g * gw..e - g * gw))
            })
            .collect()
    }

    /// The rank's tensors from the whole model's (checked against the configuration first):
    /// the split ones cut as the module notes say, the rest kept whole.
    pub(crate) fn cut(&self, c: &Dsv4Config, mut w: Weights) -> Weights {
        if self.is_whole(c) {
            return w;
        }
        let put = |w: &mut Weights, name: String, f: &Cut<'_>| {
            if let Some((_, data)) = w.get(&name) {
                let cut = f(data);
                w.insert(name, cut);
            }
        };
        let (e, d, f) = (c.embd, c.head_dim, c.expert_ffn);
        let (h, fr) = (self.heads.clone(), self.ffn.clone());
        let (qr, lo_r, x) = (c.q_lora_rank, c.out_lora_rank, c.experts);
        let gw = c.heads * d / c.out_groups;
        let groups = self.groups(c);
        for l in 0..c.ratios.len() {
            let n = |s: &str| format!("blk.{l}.{s}");
            put(&mut w, n("attn_q_b.weight"), &|v| {
                (
                    vec![qr, h.len() * d],
                    v[h.start * d * qr..h.end * d * qr].to_vec(),
                )
            });
            put(&mut w, n("attn_sinks.weight"), &|v| {
                (vec![h.len()], v[h.clone()].to_vec())
            });
            // Rows of each touched group, only the rank's columns of each row.
            put(&mut w, n("attn_output_a.weight"), &|v| {
                let mut out = Vec::new();
                for (g, cols) in &groups {
                    for row in g * lo_r..(g + 1) * lo_r {
                        out.extend_from_slice(&v[row * gw + cols.start..row * gw + cols.end]);
                    }
                }
                (vec![out.len()], out)
            });
            let (g0, g1) = (groups[0].0, groups[groups.len() - 1].0 + 1);
            let all = c.out_groups * lo_r;
            put(&mut w, n("attn_output_b.weight"), &|v| {
                let cols = g0 * lo_r..g1 * lo_r;
                (vec![cols.len(), e], columns(v, all, &cols))
            });
            for name in ["ffn_gate_exps.weight", "ffn_up_exps.weight"] {
                put(&mut w, n(name), &|v| {
                    let rows =
                        (0..x).flat_map(|xi| &v[(xi * f + fr.start) * e..(xi * f + fr.end) * e]);
                    (vec![e, fr.len(), x], rows.copied().collect())
                });
            }
            put(&mut w, n("ffn_down_exps.weight"), &|v| {
                let per = (0..x).flat_map(|xi| columns(&v[xi * e * f..(xi + 1) * e * f], f, &fr));
                (vec![fr.len(), e, x], per.collect())
            });
            for name in ["ffn_gate_shexp.weight", "ffn_up_shexp.weight"] {
                put(&mut w, n(name), &|v| {
                    (vec![e, fr.len()], v[fr.start * e..fr.end * e].to_vec())
                });
            }
            put(&mut w, n("ffn_down_shexp.weight"), &|v| {
                (vec![fr.len(), e], columns(v, f, &fr))
            });
        }
        let vr = self.vocab.clone();
        put(&mut w, "output.weight".into(), &|v| {
            (vec![e, vr.len()], v[vr.start * e..vr.end * e].to_vec())
        });
        w
    }
}

/// How a tensor's values become the rank's (shape, values).
type Cut<'a> = dyn Fn(&[f32]) -> (Vec<usize>, Vec<f32>) + 'a;

/// Columns `cols` of a row-major matrix with rows of `width`.
fn columns(v: &[f32], width: usize, cols: &Range<usize>) -> Vec<f32> {
    v.chunks_exact(width)
        .flat_map(|row| &row[cols.clone()])
        .copied()
        .collect()
}
