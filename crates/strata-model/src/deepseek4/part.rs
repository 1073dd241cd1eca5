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

use crate::deepseek4::config::{Dsv4Config, Weights};
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
            ModelError::Flag(format!(
                "--tp-size {tp}: DeepSeek-V4 splits its {n} {what} over the ranks, and each rank \
                 needs at least one"
            ))
        };
        if tp == 0 {
            return Err(ModelError::Flag(
                "--tp-size 0: a model needs at least one rank".into(),
            ));
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

    /// Why this cannot be a part of a model of `c` (ranges empty or beyond its sizes).
    pub fn check(&self, c: &Dsv4Config) -> Result<(), String> {
        for (what, r, n) in [
            ("heads", &self.heads, c.heads),
            ("expert width", &self.ffn, c.expert_ffn),
            ("vocabulary", &self.vocab, c.vocab),
        ] {
            if r.is_empty() || r.end > n {
                return Err(format!(
                    "rank {}: {what} {r:?} is not a non-empty part of 0..{n}",
                    self.rank
                ));
            }
        }
        Ok(())
    }

    /// The rank's tensors from the whole model's ([`Dsv4Part::cut_one`] each).
    pub(crate) fn cut(&self, c: &Dsv4Config, w: Weights) -> Weights {
        w.into_iter()
            .map(|(name, (ne, v))| {
                let cut = self.cut_one(c, &name, ne, v);
                (name, cut)
            })
            .collect()
    }

    /// Which cut a tensor takes, by its name (`blk.L.` stripped).
    fn split_of(name: &str) -> Option<Split> {
        let base = match name.strip_prefix("blk.") {
            Some(rest) => rest.split_once('.').map_or(rest, |(_, b)| b),
            None => name,
        };
        Some(match base {
            "attn_q_b.weight" => Split::QRows,
            "attn_sinks.weight" => Split::Sinks,
            "attn_output_a.weight" => Split::OutA,
            "attn_output_b.weight" => Split::OutB,
            "ffn_gate_exps.weight" | "ffn_up_exps.weight" => Split::ExpertRows,
            "ffn_down_exps.weight" => Split::ExpertCols,
            "ffn_gate_shexp.weight" | "ffn_up_shexp.weight" => Split::SharedRows,
            "ffn_down_shexp.weight" => Split::SharedCols,
            "output.weight" => Split::Vocab,
            _ => return None,
        })
    }

    /// The rank's shape of a tensor of the whole model's shape `ne` (the module notes).
    pub(crate) fn cut_shape(&self, c: &Dsv4Config, name: &str, ne: Vec<usize>) -> Vec<usize> {
        let (e, d, lo_r, x) = (c.embd, c.head_dim, c.out_lora_rank, c.experts);
        let (hl, fl) = (self.heads.len(), self.ffn.len());
        match Dsv4Part::split_of(name).filter(|_| !self.is_whole(c)) {
            None => ne,
            Some(Split::QRows) => vec![c.q_lora_rank, hl * d],
            Some(Split::Sinks) => vec![hl],
            Some(Split::OutA) => {
                let groups = self.groups(c);
                vec![groups.iter().map(|(_, cols)| lo_r * cols.len()).sum()]
            }
            Some(Split::OutB) => vec![self.groups(c).len() * lo_r, e],
            Some(Split::ExpertRows) => vec![e, fl, x],
            Some(Split::ExpertCols) => vec![fl, e, x],
            Some(Split::SharedRows) => vec![e, fl],
            Some(Split::SharedCols) => vec![fl, e],
            Some(Split::Vocab) => vec![e, self.vocab.len()],
        }
    }

    /// The rank's piece of one tensor of the whole model's shape (checked by the caller: the
    /// expected shape for its name), with its shape ([`Dsv4Part::cut_shape`]).
    pub(crate) fn cut_one(
        &self,
        c: &Dsv4Config,
        name: &str,
        ne: Vec<usize>,
        v: Vec<f32>,
    ) -> (Vec<usize>, Vec<f32>) {
        let Some(split) = Dsv4Part::split_of(name).filter(|_| !self.is_whole(c)) else {
            return (ne, v);
        };
        let (e, d, f) = (c.embd, c.head_dim, c.expert_ffn);
        let (h, fr) = (self.heads.clone(), self.ffn.clone());
        let (qr, lo_r, x) = (c.q_lora_rank, c.out_lora_rank, c.experts);
        let out = match split {
            Split::QRows => v[h.start * d * qr..h.end * d * qr].to_vec(),
            Split::Sinks => v[h].to_vec(),
            // Rows of each touched group, only the rank's columns of each row.
            Split::OutA => {
                let gw = c.heads * d / c.out_groups;
                let mut out = Vec::new();
                for (g, cols) in self.groups(c) {
                    for row in g * lo_r..(g + 1) * lo_r {
                        out.extend_from_slice(&v[row * gw + cols.start..row * gw + cols.end]);
                    }
                }
                out
            }
            Split::OutB => {
                let groups = self.groups(c);
                let (g0, g1) = (groups[0].0, groups[groups.len() - 1].0 + 1);
                columns(&v, c.out_groups * lo_r, &(g0 * lo_r..g1 * lo_r))
            }
            Split::ExpertRows => (0..x)
                .flat_map(|xi| &v[(xi * f + fr.start) * e..(xi * f + fr.end) * e])
                .copied()
                .collect(),
            Split::ExpertCols => (0..x)
                .flat_map(|xi| columns(&v[xi * e * f..(xi + 1) * e * f], f, &fr))
                .collect(),
            Split::SharedRows => v[fr.start * e..fr.end * e].to_vec(),
            Split::SharedCols => columns(&v, f, &fr),
            Split::Vocab => v[self.vocab.start * e..self.vocab.end * e].to_vec(),
        };
        (self.cut_shape(c, name, ne), out)
    }
}

/// How a rank cuts a tensor.
#[derive(Clone, Copy)]
enum Split {
    /// `attn_q_b`: the rows of the rank's heads.
    QRows,
    Sinks,
    /// `attn_output_a`: of each group the heads touch, its rows with the heads' columns.
    OutA,
    /// `attn_output_b`: the columns of those groups.
    OutB,
    /// Every expert's gate / up rows of the rank's width.
    ExpertRows,
    /// Every expert's down columns of the rank's width.
    ExpertCols,
    SharedRows,
    SharedCols,
    /// `output`: the rank's vocabulary rows.
    Vocab,
}

/// Columns `cols` of a row-major matrix with rows of `width`.
fn columns(v: &[f32], width: usize, cols: &Range<usize>) -> Vec<f32> {
    v.chunks_exact(width)
        .flat_map(|row| &row[cols.clone()])
        .copied()
        .collect()
}
