//! What a forward call allocates beside the pools and the weights: its activations, the logits
//! it returns and the K/V attention copies out of the pages (at most `llama::attend`'s group
//! budget, or one sequence's whole context), as an upper bound the memory plan reserves
//! (`strata plan`, `strata serve`). The bound follows the code of each forward pass
//! (`llama::Model::layer` and `logits`, `deepseek4::Dsv4::token` and `head`);
//! tests/forward_scratch.rs measures every allocation of real calls against it.

use std::path::Path;

use crate::attn::Shape;
use crate::deepseek4::config::Dsv4Config;
use crate::error::ModelError;
use crate::gguf::{Config, Gguf, GgufHeader};
use crate::llama::attend::{gathered_bytes, GATHER_BYTES};
use crate::shard::Part;

/// The most one forward call may hold at once beside the pools and weights.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ForwardScratch {
    /// Bytes on every rank for the batch limits given.
    pub fixed: u64,
    /// Bytes on the one rank that gathers the logits and hands them back (rank 0).
    pub gathering: u64,
}

/// The batch limits a forward call runs under (the engine's scheduling flags).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CallLimits {
    /// Rows (tokens) per call: `--max-batch-tokens`.
    pub tokens: u64,
    /// Sequences per call: `--max-running`.
    pub sequences: u64,
    /// Rows per call whose every logits come back (prompt log probabilities), beside each
    /// sequence's last row.
    pub all_logit_rows: u64,
    /// Threads computing one call's sequences side by side (DeepSeek-V4's pass).
    pub threads: u64,
}

impl CallLimits {
    /// Rows of a call whose logits come back.
    fn logit_rows(&self) -> u64 {
        self.tokens
            .min(self.sequences.saturating_add(self.all_logit_rows))
    }
}

const F32: u64 = 4;
/// Weight rows per dequantized panel (`qmat::PANEL`).
const PANEL: u64 = crate::qmat::PANEL as u64;

/// `a × b × c`, saturating (dimensions come from a file).
fn mul3(a: u64, b: u64, c: u64) -> u64 {
    a.saturating_mul(b).saturating_mul(c)
}

/// The scratch of the model in `path` over `ranks` tensor-parallel ranks.
pub fn forward_scratch(
    path: &Path,
    ranks: u64,
    limits: CallLimits,
) -> Result<ForwardScratch, ModelError> {
    let header = GgufHeader::open(path)?;
    if header.architecture() == Some("deepseek4") {
        let c = crate::deepseek4::load::read_dsv4_config(path)?;
        return Ok(dsv4(&c, ranks, limits));
    }
    Ok(llama(&Gguf::open(path)?.config, ranks, limits))
}

/// The widest rank of `ranks` (query heads, KV heads, feed-forward columns, vocabulary rows),
/// as the model is split (in 256- or 32-column feed-forward runs, whichever its down
/// projection takes).
fn widest(c: &Config, ranks: u64) -> (usize, usize, usize, usize) {
    let parts: Vec<Part> = [256, 32]
        .iter()
        .filter_map(|&b| Part::split(c, ranks as usize, b).ok())
        .flatten()
        .collect();
    let most = |f: &dyn Fn(&Part) -> usize, even: usize| {
        parts
            .iter()
            .map(f)
            .max()
            .unwrap_or(even.div_ceil(ranks as usize))
    };
    (
        most(&|p| p.heads.q.len(), c.heads),
        most(&|p| p.heads.kv.len(), c.kv_heads),
        most(&|p| p.ffn.len(), c.ffn),
        most(&|p| p.vocab.len(), c.vocab),
    )
}

/// The llama family, the larger of its two phases on every rank: a layer at its peak (the
/// feed-forward's down product: per row the residual, both norms' outputs, Q, K, V,
/// attention's output and projection, gate, up and their product, the product's output and
/// the panel outputs it is assembled from, a mixed batch's copies, the 8-bit activations, and
/// attention's f32 K/V copies: a group's budget or one sequence's whole context, and never more
/// than a whole context per sequence), or the
/// logits (beside the residual: the rows asked for and their norm, this rank's vocabulary part
/// and a mixed batch's copy of it, the panel outputs it is assembled from (at most 16 MiB a
/// batch of panels), a rank's last all-reduce); each thread's dequantized weight panel. The
/// gathering rank also holds the logits handed back, and with several ranks the gathered rows.
pub fn llama(c: &Config, ranks: u64, limits: CallLimits) -> ForwardScratch {
    let ranks = ranks.max(1);
    let (heads, kv_heads, ffn, vr) = widest(c, ranks);
    let hd = c.head_dim as u64;
    let (h, vocab) = (c.hidden as u64, c.vocab as u64);
    let (qd, kvd, ffn, vr) = (
        heads as u64 * hd,
        kv_heads as u64 * hd,
        ffn as u64,
        vr as u64,
    );
    let (n, m) = (limits.tokens, limits.logit_rows());
    // A tensor-parallel rank's all-reduce holds one more row of the residual.
    let comm = if ranks > 1 { h } else { 0 };
    let row = (8 * h + 2 * qd + 2 * kvd + 4 * ffn + comm) * F32 + (ffn + h) + 64;
    let shape = Shape {
        heads,
        kv_heads,
        head_dim: c.head_dim,
    };
    // A group's copies stay within the budget, or one sequence's whole context alone; and a
    // call copies at most one context per sequence it computes rows of.
    let one = gathered_bytes(shape, c.context_length) as u64;
    let copies = (GATHER_BYTES as u64)
        .max(one)
        .min(limits.sequences.min(n).saturating_mul(one));
    let layer = n.saturating_mul(row).saturating_add(copies);
    let panel_outputs =
        mul3(m, vr, F32).min((16u64 << 20).max(mul3(limits.threads.max(1) * 4, m, PANEL * F32)));
    let logits = mul3(m, 3 * h + 2 * vr, F32)
        .saturating_add(mul3(n, h + comm, F32))
        .saturating_add(panel_outputs);
    let panels = mul3(limits.threads.max(1), h.max(ffn), PANEL * F32);
    let gathered = if ranks > 1 { vocab } else { 0 };
    ForwardScratch {
        fixed: layer.max(logits).saturating_add(panels),
        gathering: mul3(m, vocab + gathered, F32),
    }
}

/// DeepSeek-V4 (computed token by token, `threads` sequences side by side): per sequence in
/// flight, one token's vectors (the streams, the query and its heads, the experts' products)
/// and what grows with its context (the indexer's scores over every compressed block, the
/// attention's keys and their logits over the window and the blocks it reads), and the logits
/// of every row asked for (held until the call returns, in vectors that may double as they
/// grow). Tensor-parallel ranks go layer by layer over every sequence of the call: each keeps
/// its streams, its half layer's outputs and their sum, and the logits pass through this rank's
/// rows, their flat copy and the gathered rows. Attention reads the pages in place.
pub fn dsv4(c: &Dsv4Config, ranks: u64, limits: CallLimits) -> ForwardScratch {
    let u = |n: usize| n as u64;
    let ctx = u(c.context);
    let token = 16 * (u(c.hc) * u(c.embd) + u(c.heads) * u(c.head_dim))
        + 8 * (u(c.q_lora_rank)
            + u(c.experts)
            + u(c.expert_ffn)
            + u(c.out_groups) * u(c.out_lora_rank))
        + 4 * u(c.indexer_heads) * u(c.indexer_dim);
    // Keys a head reads (a 16-byte reference and a logit each): the window and the blocks of
    // a ratio-4 (the indexer's choice) or ratio-128 layer (all of them).
    let read = u(c.window) + u(c.indexer_top_k).max(ctx / 128) + 1;
    let per_seq = token
        .saturating_add(ctx / 4)
        .saturating_add(read.saturating_mul(5))
        .saturating_add(u(c.vocab))
        .saturating_mul(F32);
    let (m, vocab) = (limits.logit_rows(), u(c.vocab));
    // With several ranks: every sequence's streams and half layer, this rank's logits rows
    // (which may double as they grow) and their flat copy.
    let tp = match ranks.max(1) {
        1 => 0,
        r => {
            let (hc, e) = (u(c.hc), u(c.embd));
            mul3(
                limits.sequences,
                2 * hc * e + 3 * e + 2 * hc * (hc + 1),
                F32,
            )
            .saturating_add(mul3(m, 3 * vocab.div_ceil(r), F32))
        }
    };
    ForwardScratch {
        fixed: limits
            .threads
            .max(1)
            .min(limits.sequences.max(1))
            .saturating_mul(per_seq)
            .saturating_add(tp),
        // The rows handed back (alone: vectors that may double as they grow; with ranks: the
        // gathered rows and each sequence's copy).
        gathering: mul3(m, 2 * vocab, F32),
    }
}
