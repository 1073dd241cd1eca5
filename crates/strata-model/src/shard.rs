//! A tensor-parallel rank's share of a llama-family model ([`Part`]) and what a rank's
//! forward pass asks of the others ([`Collective`]); [`crate::llama::tp`] runs the ranks.

use std::ops::Range;

use strata_kv::tp::{even_runs, split_heads, RankHeads};

use crate::error::ModelError;
use crate::gguf::Config;
use crate::qmat::QMatrix;

/// One rank's share of the model.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Part {
    /// Index of the rank's pool kind in the page layout (= the rank).
    pub kind: usize,
    pub kind_name: String,
    pub heads: RankHeads,
    /// Feed-forward columns.
    pub ffn: Range<usize>,
    /// Vocabulary rows.
    pub vocab: Range<usize>,
}

impl Part {
    /// The whole model on one rank.
    pub fn whole(c: &Config) -> Part {
        Part {
            kind: 0,
            kind_name: "kv".into(),
            heads: RankHeads {
                q: 0..c.heads,
                kv: 0..c.kv_heads,
            },
            ffn: 0..c.ffn,
            vocab: 0..c.vocab,
        }
    }

    /// The parts of `tp` ranks: heads by [`split_heads`], the feed-forward in runs of the
    /// down projection's block (`ffn_block` columns: 256 for a K-quant super-block, when every
    /// rank gets one; else 32, and a K-quant down projection's slices are requantized to Q8_0),
    /// the vocabulary in even runs.
    pub fn split(c: &Config, tp: usize, ffn_block: usize) -> Result<Vec<Part>, ModelError> {
        let bad = |reason: String| ModelError::Flag(format!("--tp-size {tp}: {reason}"));
        if tp == 1 {
            return Ok(vec![Part::whole(c)]);
        }
        let heads = split_heads(c.heads, c.kv_heads, tp).map_err(bad)?;
        // The products take their inputs in 32-groups: a rank's attention output (the output
        // projection's input) must be whole groups.
        if let Some(h) = heads
            .iter()
            .find(|h| !(h.q.len() * c.head_dim).is_multiple_of(32))
        {
            return Err(bad(format!(
                "a rank with {} heads of {} values is not whole 32-value groups",
                h.q.len(),
                c.head_dim
            )));
        }
        // Whole blocks of the down projection's format where every rank gets one (runs may
        // then differ by a block), else 32-column runs.
        let unit = if ffn_block > 32 && c.ffn.is_multiple_of(ffn_block) && c.ffn / ffn_block >= tp {
            ffn_block
        } else {
            32
        };
        if !c.ffn.is_multiple_of(unit) || c.ffn / unit < tp {
            return Err(bad(format!(
                "the feed-forward size {} has fewer than {tp} runs of {unit}",
                c.ffn
            )));
        }
        if c.vocab < tp {
            return Err(bad(format!("a vocabulary of {} tokens", c.vocab)));
        }
        let ffn = even_runs(c.ffn / unit, tp);
        let vocab = even_runs(c.vocab, tp);
        Ok(heads
            .into_iter()
            .zip(ffn)
            .zip(vocab)
            .enumerate()
            .map(|(r, ((heads, f), vocab))| Part {
                kind: r,
                kind_name: strata_kv::tp::rank_kind_name("kv", r),
                heads,
                ffn: f.start * unit..f.end * unit,
                vocab,
            })
            .collect())
    }

    /// The rank's piece of a weight matrix: `rows` of its outputs or `cols` of its inputs
    /// (the matrix itself when that is all of it).
    pub(crate) fn slice(
        &self,
        m: QMatrix,
        rows: Option<&Range<usize>>,
        cols: Option<&Range<usize>>,
        name: &str,
    ) -> Result<QMatrix, ModelError> {
        let bad = |what: &str, r: &Range<usize>, n: usize| {
            ModelError::Forward(format!(
                "{name}: rank {} needs {what} {r:?} of {n} ({} blocks)",
                self.kind,
                m.format.name()
            ))
        };
        if let Some(r) = rows.filter(|r| **r != (0..m.rows)) {
            if r.end > m.rows || r.is_empty() {
                return Err(bad("rows", r, m.rows));
            }
            return Ok(m.rows_range(r.clone()));
        }
        if let Some(c) = cols.filter(|c| **c != (0..m.cols)) {
            return m
                .cols_range(c.clone())
                .ok_or_else(|| bad("columns", c, m.cols));
        }
        Ok(m)
    }
}

/// Where the ranks meet: what [`Model::forward_part`] asks of the others.
pub(crate) trait Collective: Sync {
    /// Every rank's `x` becomes the sum of all ranks' `x` (in rank order).
    fn all_reduce(&self, x: &mut [f32]);
    /// Each rank's `[rows][its vocabulary rows]` logits → `[rows][vocabulary]` on the
    /// gathering rank (None on the others).
    fn gather_vocab(&self, part: Vec<f32>, rows: usize) -> Option<Vec<f32>>;
}

/// The whole model on one rank: nothing to meet.
pub(crate) struct Solo;

impl Collective for Solo {
    fn all_reduce(&self, _x: &mut [f32]) {}
    fn gather_vocab(&self, part: Vec<f32>, _rows: usize) -> Option<Vec<f32>> {
        Some(part)
    }
}
