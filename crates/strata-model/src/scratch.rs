//! What a forward call allocates beside the pools and the weights: its activations, the logits
//! it returns and the K/V attention copies out of the pages, as an upper bound the memory plan
//! reserves (`strata plan`, `strata serve`). The bound follows the code of each forward pass
//! (`llama::Model::layer` and `logits`, `deepseek4::Dsv4::token` and `head`);
//! tests/forward_scratch.rs measures every allocation of real calls against it.

use std::path::Path;

use crate::deepseek4::config::Dsv4Config;
use crate::error::ModelError;
use crate::gguf::{Config, Gguf, GgufHeader};

/// The most one forward call may hold at once beside the pools and weights.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ForwardScratch {
    /// Bytes on every rank for the batch limits given.
    pub fixed: u64,
    /// Bytes on every rank for each device-pool token the call reads whole into f32 (llama's
    /// attention copies the K/V of a sequence it computes several rows of; at most every token
    /// the device pool holds).
    pub per_device_token: u64,
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

/// The llama family, the larger of its two phases on every rank: a layer at its peak (the
/// feed-forward's down product: per row the residual, both norms' outputs, Q, K, V,
/// attention's output and projection, gate, up and their product, the product's output and
/// the panel outputs it is assembled from, a mixed batch's copies, the 8-bit activations), or
/// the logits (beside the residual: the rows asked for and their norm, this rank's vocabulary
/// part and a mixed batch's copy of it, the panel outputs it is assembled from (at most 16 MiB
/// a batch of panels)); each thread's dequantized weight panel; attention's f32 K/V per device
/// token. The gathering rank also holds the logits handed back, and with several ranks the
/// gathered rows.
pub fn llama(c: &Config, ranks: u64, limits: CallLimits) -> ForwardScratch {
    let ranks = ranks.max(1);
    let d = |n: usize| (n as u64).div_ceil(ranks);
    let h = c.hidden as u64;
    let (hd, vocab) = (c.head_dim as u64, c.vocab as u64);
    let (qd, kvd, ffn, vr) = (
        d(c.heads).saturating_mul(hd),
        d(c.kv_heads).saturating_mul(hd),
        d(c.ffn),
        d(c.vocab),
    );
    let (n, m) = (limits.tokens, limits.logit_rows());
    // A tensor-parallel rank's all-reduce may hold one more row of the residual.
    let comm = if ranks > 1 { h } else { 0 };
    let row = (8 * h + 2 * qd + 2 * kvd + 4 * ffn + comm) * F32 + (ffn + h) + 64;
    let layer = n.saturating_mul(row);
    let panel_outputs =
        mul3(m, vr, F32).min((16u64 << 20).max(mul3(limits.threads.max(1) * 4, m, PANEL * F32)));
    let logits = mul3(m, 3 * h + 2 * vr, F32)
        .saturating_add(mul3(n, h, F32))
        .saturating_add(panel_outputs);
    let panels = mul3(limits.threads.max(1), h.max(ffn), PANEL * F32);
    let gathered = if ranks > 1 { vocab } else { 0 };
    ForwardScratch {
        fixed: layer.max(logits).saturating_add(panels),
        per_device_token: 2 * kvd * F32,
        gathering: mul3(m, vocab + gathered, F32),
    }
}

/// DeepSeek-V4 (computed token by token, `threads` sequences side by side): per sequence in
/// flight, one token's vectors (the streams, the query and its heads, the experts' products)
/// and what grows with its context (the indexer's scores over every compressed block, the
/// attention's keys and their logits over the window and the blocks it reads), and the logits
/// of every row asked for (held until the call returns, in vectors that may double as they
/// grow). Tensor-parallel ranks go layer by layer over every sequence of the call: each keeps
/// its streams and its half layer's outputs, and the logits pass through this rank's rows, their
/// flat copy and the gathered rows. Nothing per device token: attention reads the pages in
/// place.
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
                2 * hc * e + 2 * e + 2 * hc * (hc + 1),
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
        per_device_token: 0,
        // The rows handed back (alone: vectors that may double as they grow; with ranks: the
        // gathered rows and each sequence's copy).
        gathering: mul3(m, 2 * vocab, F32),
    }
}

impl ForwardScratch {
    /// Bytes over `ranks` ranks with `device_tokens` in each rank's device pool.
    pub fn bytes(&self, ranks: u64, device_tokens: u64) -> u64 {
        self.fixed
            .saturating_add(self.per_device_token.saturating_mul(device_tokens))
            .saturating_mul(ranks.max(1))
            .saturating_add(self.gathering)
    }
}
