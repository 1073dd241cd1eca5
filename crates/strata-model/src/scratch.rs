//! What a forward call allocates beside the pools and the weights, as the upper bound the
//! memory plan reserves (`strata_mem::Scratch`: `strata plan`, `strata serve`): its
//! activations, the logits it returns, each thread's weight panel, and llama's f32 K/V copies
//! in attention (in groups of at most `llama::attend`'s budget, one longer sequence alone).
//! The bound follows the code of each forward pass (`llama::Model::layer` and `logits`,
//! `llama::attend`, `deepseek4::Dsv4::token` and `head`, the ranks' `forward_part`s);
//! tests/forward_scratch.rs measures every allocation of real calls against it.

use std::path::Path;

use candle_core::quantized::gguf_file::Value;
use strata_mem::{Copies, Scratch};

use crate::deepseek4::config::Dsv4Config;
use crate::error::ModelError;
use crate::gguf::{Config, Gguf};
use crate::llama::attend::GATHER_BYTES;
use crate::shard::Part;

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
    /// Threads computing a call (`--threads`).
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

/// A model file's hyper-parameters, by architecture (read from its header once, for the pools
/// and the scratch both).
#[derive(Clone, Debug)]
pub enum ModelShape {
    Llama(Config),
    Dsv4(Dsv4Config),
}

impl ModelShape {
    pub fn read(path: &Path) -> Result<ModelShape, ModelError> {
        let (header, file, len) = crate::gguf::meta::read_with_file(path)?;
        if let Some(Value::String(a)) = header.metadata.get("general.architecture") {
            if a == "deepseek4" {
                let c = crate::deepseek4::load::dsv4_config(path, &header.metadata)?;
                return Ok(ModelShape::Dsv4(c));
            }
        }
        Ok(ModelShape::Llama(
            Gguf::from_header(path, header, file, len)?.config,
        ))
    }

    /// The scratch over `ranks` tensor-parallel ranks.
    pub fn scratch(&self, ranks: u64, limits: CallLimits) -> Scratch {
        match self {
            ModelShape::Llama(c) => llama(c, ranks, limits),
            ModelShape::Dsv4(c) => dsv4(c, ranks, limits),
        }
    }
}

/// The widest rank of `ranks` (query heads, KV heads, feed-forward columns, vocabulary rows),
/// as the model is split (in 256- or 32-column feed-forward runs, whichever its down
/// projection takes).
fn widest(c: &Config, ranks: u64) -> [u64; 4] {
    let parts: Vec<Part> = [256, 32]
        .iter()
        .filter_map(|&b| Part::split(c, ranks as usize, b).ok())
        .flatten()
        .collect();
    let most = |f: &dyn Fn(&Part) -> usize, even: usize| {
        let m = parts.iter().map(f).max();
        m.unwrap_or(even.div_ceil(ranks as usize)) as u64
    };
    [
        most(&|p| p.heads.q.len(), c.heads),
        most(&|p| p.heads.kv.len(), c.kv_heads),
        most(&|p| p.ffn.len(), c.ffn),
        most(&|p| p.vocab.len(), c.vocab),
    ]
}

/// The llama family on every rank: a layer at its peak (per row, the largest of its phases,
/// each vector dropped once read for the last time: Q, K and V's products beside the residual
/// and the norm's output; attention's output projection; gate and up; the down product; each
/// with its products' panel outputs, a mixed batch's copies, the 8-bit activations and a rank's
/// all-reduce; and attention's K/V copies), or
/// the logits (beside the residual: the rows asked for and their norm, this rank's vocabulary
/// part and a mixed batch's copy of it, the panel outputs it is assembled from (at most 16 MiB
/// a batch of panels)); each thread's dequantized weight panel. Rank 0 also holds the logits
/// handed back, and with several ranks the gathered rows.
pub fn llama(c: &Config, ranks: u64, limits: CallLimits) -> Scratch {
    let ranks = ranks.max(1);
    let [heads, kv_heads, ffn, vr] = widest(c, ranks);
    let hd = c.head_dim as u64;
    let (h, vocab) = (c.hidden as u64, c.vocab as u64);
    let (qd, kvd) = (heads.saturating_mul(hd), kv_heads.saturating_mul(hd));
    let (n, m, threads) = (limits.tokens, limits.logit_rows(), limits.threads.max(1));
    // A tensor-parallel rank's all-reduce holds one more row of the residual.
    let comm = if ranks > 1 { h } else { 0 };
    let sum = |v: &[u64]| v.iter().fold(0u64, |a, &b| a.saturating_add(b));
    // Per row at each phase's peak (`llama::Model::layer`; `mm`, whose mixed batch holds the
    // output, a copy of its rows' input and their product with its panels; `mm_shared`):
    let floats = [
        // Q, K, V one after another: the residual, the norm's output and its copy, Q and Q's
        // product with its panels, or Q, K and V's product with its panels.
        sum(&[3 * h, qd, (2 * qd).max(4 * kvd)]),
        // The residual, attention's output and its copy, the projection with its panels.
        sum(&[4 * h, 2 * qd, comm]),
        // The residual, the norm's output and its copy, the gate, up's product and panels.
        sum(&[3 * h, 4 * ffn]),
        // The residual, the activations and their copy, the product with its panels.
        sum(&[4 * h, 2 * ffn, comm]),
    ]
    .into_iter()
    .max()
    .unwrap_or(0);
    // The 8-bit activations of the widest input (3.25 bytes an element: values, scales and
    // their spread copies, `QActs`), and the integer kernels' bookkeeping (`passes_many`: up
    // to 4 jobs a thread for each of 3 matrices, each listing its output segment of every row
    // in 16 bytes, and each thread's tile of 16 outputs a row).
    let acts = (13 * h.max(qd).max(ffn)).div_ceil(4);
    let bookkeeping = threads.saturating_mul(3 * 4 * 16 + 16 * F32);
    let row = floats
        .saturating_mul(F32)
        .saturating_add(acts)
        .saturating_add(bookkeeping)
        .saturating_add(64);
    let panel_outputs = mul3(m, vr, F32).min((16u64 << 20).max(mul3(threads * 4, m, PANEL * F32)));
    let gathered = if ranks > 1 { vocab } else { 0 };
    Scratch {
        layer: n.saturating_mul(row),
        logits: mul3(m, 3 * h + 2 * vr, F32)
            .saturating_add(mul3(n, h + comm, F32))
            .saturating_add(panel_outputs),
        panels: mul3(threads, h.max(ffn), PANEL * F32),
        gathering: mul3(m, vocab.saturating_add(gathered), F32),
        copies: Copies {
            per_position: mul3(2, kvd, F32),
            block: crate::attn::KB as u64,
            budget: GATHER_BYTES as u64,
            context: c.context_length as u64,
            sequences: limits.sequences.min(n),
        },
    }
}

/// DeepSeek-V4 (computed token by token, `threads` sequences side by side): per sequence in
/// flight, one token's vectors (the streams, the query and its heads, the experts' products)
/// and what grows with its context (the indexer's scores over every compressed block, the
/// attention's keys and their logits over the window and the blocks it reads). Rank 0 holds
/// the logits of every row asked for (in vectors that may double as they grow; with ranks, the
/// gathered rows and each sequence's copy). Tensor-parallel ranks go layer by layer over every
/// sequence of the call: each keeps its streams, its half layer's outputs and their sum, and
/// its logits rows (which may double as they grow) and their flat copy. Attention reads the
/// pages in place: no copies.
pub fn dsv4(c: &Dsv4Config, ranks: u64, limits: CallLimits) -> Scratch {
    let u = |n: usize| n as u64;
    let ctx = u(c.context);
    let token = [
        16 * (u(c.hc) * u(c.embd) + u(c.heads) * u(c.head_dim)),
        8 * (u(c.q_lora_rank) + u(c.experts) + u(c.expert_ffn)),
        8 * u(c.out_groups) * u(c.out_lora_rank),
        4 * u(c.indexer_heads) * u(c.indexer_dim),
    ]
    .iter()
    .fold(0u64, |a, &b| a.saturating_add(b));
    // Keys a head reads (a 16-byte reference and a logit each): the window and the blocks of
    // a ratio-4 (the indexer's choice) or ratio-128 layer (all of them).
    let read = u(c.window) + u(c.indexer_top_k).max(ctx / 128) + 1;
    let per_seq = token
        .saturating_add(ctx / 4)
        .saturating_add(read.saturating_mul(5))
        .saturating_add(u(c.vocab))
        .saturating_mul(F32);
    let (m, vocab) = (limits.logit_rows(), u(c.vocab));
    let tp = match ranks.max(1) {
        1 => 0,
        r => {
            let (hc, e) = (u(c.hc), u(c.embd));
            let streams = 2 * hc * e + 3 * e + 2 * hc * (hc + 1);
            mul3(limits.sequences, streams, F32).saturating_add(mul3(m, 3 * vocab.div_ceil(r), F32))
        }
    };
    let in_flight = limits.threads.max(1).min(limits.sequences.max(1));
    Scratch {
        layer: in_flight.saturating_mul(per_seq).saturating_add(tp),
        logits: 0,
        panels: 0,
        gathering: mul3(m, 2 * vocab, F32),
        copies: Copies::default(),
    }
}
