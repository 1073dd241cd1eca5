//! The planner's inputs and outputs: what the flags ask for ([`PlanRequest`]), the plan
//! ([`Plan`]) and why a request cannot be planned ([`PlanError`]).

use serde::Serialize;
use strata_kv::units::shown_number;
use thiserror::Error;

use crate::model::ModelSpec;

/// Device pool budget per rank.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum DeviceBudget {
    /// `--device-mem SIZE`: bytes per rank.
    Bytes(u64),
    /// `--device-mem-fraction F`: that fraction of the free device memory per rank.
    FractionOfFree(f64),
}

/// Host (L2) budget: exactly one of the three flags.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum HostBudget {
    /// `--hicache-size SIZE`: bytes per rank.
    PerRank(u64),
    /// `--hicache-total SIZE`: bytes for the whole server, split evenly over its ranks.
    Total(u64),
    /// `--hicache-ratio R`: host tokens = R × device tokens.
    Ratio(f64),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum NumaPolicy {
    Bind,
    Interleave,
    Preferred,
}

impl NumaPolicy {
    pub fn parse(s: &str) -> Option<NumaPolicy> {
        match s {
            "bind" => Some(NumaPolicy::Bind),
            "interleave" => Some(NumaPolicy::Interleave),
            "preferred" => Some(NumaPolicy::Preferred),
            _ => None,
        }
    }

    pub fn name(&self) -> &'static str {
        match self {
            NumaPolicy::Bind => "bind",
            NumaPolicy::Interleave => "interleave",
            NumaPolicy::Preferred => "preferred",
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NumaChoice {
    Node(u32),
    /// The node the process's CPUs belong to, else the one with the most available memory.
    Auto,
    /// Each tensor-parallel rank's node (`--numa-nodes`, one entry per rank): its pools there.
    Ranks(Vec<u32>),
}

/// Everything the planner needs.
#[derive(Clone, Debug)]
pub struct PlanRequest {
    /// `prefill`, `decode` or `server`: a label for reports.
    pub role: String,
    pub model: ModelSpec,
    pub tp: u32,
    pub page_size: usize,
    pub device: DeviceBudget,
    /// None: no host tier.
    pub host: Option<HostBudget>,
    pub numa: NumaChoice,
    pub policy: NumaPolicy,
    /// `--host-mem-reserve`; None: 10 % of the node, at most 10 GiB.
    pub reserve: Option<u64>,
    /// The device pool lives in host memory (this CPU build): it counts against the node too.
    pub device_in_host_memory: bool,
    /// CPUs the process may run on (for `--numa-node auto`).
    pub allowed_cpus: Vec<u32>,
    /// The host and device sizes as the operator typed them (`150GB`), to echo them in that
    /// unit; None: binary units.
    pub host_text: Option<String>,
    pub device_text: Option<String>,
    /// The device budget is the default (no device flag given): said so where it is echoed.
    pub device_default: bool,
    /// `--window-tokens-ratio R`: window pages per page in each tier (models with window
    /// kinds); None: the default residency (`plan/window.rs`).
    pub window_ratio: Option<f64>,
    /// `--window-checkpoint-pages K` (0: every page keeps its window state); None: derived.
    pub window_checkpoint_pages: Option<u64>,
    /// `--max-running` and `--max-batch-tokens`: what running requests' window rings need.
    pub max_running: u64,
    pub max_batch_tokens: u64,
    /// Host memory the server may hold beside its pools and weights, each part named by the
    /// flag that bounds it (`--kv-staging`, `--response-store-size`): reserved as the
    /// weights are.
    pub beside: Vec<(String, u64)>,
    /// What each rank's forward calls allocate (`strata_model::scratch`), reserved beside the
    /// weights when the device pools are in host memory.
    pub scratch: Scratch,
}

/// Host memory the forward calls may hold beside the pools and weights
/// (`strata_model::scratch` fills it in), for the batch limits (`--max-batch-tokens`,
/// `--max-running`, `--threads`): a call is in a layer's phase or in the logits phase, each on
/// every rank, and rank 0 also holds the logits it gathers and hands back.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Scratch {
    /// A layer's phase, beside attention's K/V copies.
    pub layer: u64,
    /// The logits phase.
    pub logits: u64,
    /// Both phases (each thread's dequantized weight panel).
    pub panels: u64,
    /// More on rank 0.
    pub gathering: u64,
    /// Attention's f32 K/V copies in a layer's phase (none where attention reads the pages).
    pub copies: Copies,
}

/// Attention's f32 copies of the K/V of the sequences a call computes several rows of: in
/// groups of at most `budget` bytes, a sequence over it alone, at most one whole sequence a
/// sequence of the call.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Copies {
    /// Bytes a position copies (0: none), counted in blocks of `block` positions.
    pub per_position: u64,
    pub block: u64,
    pub budget: u64,
    /// Most positions a sequence has: the model's context (and at most the device pool's).
    pub context: u64,
    /// Most sequences one call copies.
    pub sequences: u64,
}

impl Copies {
    /// The most bytes copied at once with `device_tokens` in the device pool.
    pub fn bytes(&self, device_tokens: u64) -> u64 {
        if self.per_position == 0 {
            return 0;
        }
        let block = self.block.max(1);
        let positions = self
            .context
            .min(device_tokens)
            .div_ceil(block)
            .saturating_mul(block);
        let one = self.per_position.saturating_mul(positions);
        self.budget.max(one).min(self.sequences.saturating_mul(one))
    }
}

impl Scratch {
    /// What the plan reserves for it: the label its part of the reserve goes under.
    pub const LABEL: &'static str = "--max-batch-tokens/--max-running (the forward pass)";

    /// Bytes of rank `rank` with `device_tokens` in its device pool.
    pub fn rank_bytes(&self, rank: usize, device_tokens: u64) -> u64 {
        let layer = self.layer.saturating_add(self.copies.bytes(device_tokens));
        let each = layer.max(self.logits).saturating_add(self.panels);
        match rank {
            0 => each.saturating_add(self.gathering),
            _ => each,
        }
    }

    /// Bytes of `ranks` ranks with `device_tokens` in each one's device pool.
    pub fn bytes(&self, ranks: u32, device_tokens: u64) -> u64 {
        (0..ranks.max(1) as usize)
            .map(|r| self.rank_bytes(r, device_tokens))
            .fold(0, u64::saturating_add)
    }
}

/// A plan that cannot be carried out; each message is one line naming the fix.
#[derive(Debug, Error, PartialEq)]
pub enum PlanError {
    #[error("--tp-size {0}: expected 1 to {max} ranks", max = crate::plan::MAX_TP)]
    Tp(u32),
    #[error("--page-size must be at least 1 token")]
    PageSize,
    #[error("model `{0}` declares no pool kinds")]
    NoPools(String),
    #[error("--page-size {page_size}: {why}")]
    PageFit { page_size: usize, why: String },
    #[error("--device-mem-fraction {} must be in (0, 1]", shown_number(*.0))]
    Fraction(f64),
    #[error("--hicache-ratio {} must be a finite number in [0, {max}]", shown_number(*.0), max = crate::plan::MAX_RATIO)]
    Ratio(f64),
    #[error("host budget of {budget} per rank holds {tokens} tokens, less than one page of {page_size} tokens: give a larger --hicache-*, or none to turn the host tier off")]
    HostTooSmall {
        budget: String,
        tokens: u64,
        page_size: usize,
    },
    #[error("--window-tokens-ratio {} must be in (0, 1]", shown_number(*.0))]
    WindowRatio(f64),
    #[error("--window-tokens-ratio {}: model `{model}` has no window kinds (every kind is read for the whole prefix)", shown_number(*.ratio))]
    NoWindowKinds { ratio: f64, model: String },
    #[error("--window-checkpoint-pages {k}: model `{model}` has no window kinds (every kind is read for the whole prefix)")]
    CheckpointsWithoutWindowKinds { k: u64, model: String },
    #[error("device budget of {budget} per rank cannot hold one running request's window ring ({ring} window pages, {bytes}) and a page: give a larger --device-mem")]
    NoWindowRing {
        budget: String,
        ring: u64,
        bytes: String,
    },
    #[error("--window-tokens-ratio {} leaves {tokens} window tokens per rank on device, less than one page of {page_size}", shown_number(*.ratio))]
    NoWindowPage {
        ratio: f64,
        tokens: u64,
        page_size: usize,
    },
    #[error("device budget of {budget} per rank holds {tokens} tokens, less than one page of {page_size} tokens at {bpt} bytes per token")]
    DeviceTooSmall {
        budget: String,
        tokens: u64,
        page_size: usize,
        bpt: u64,
    },
    #[error("--numa-node {node}: no such NUMA node (this machine's nodes: {have})")]
    NoSuchNode { node: u32, have: String },
    #[error("--numa-nodes {0}")]
    RankNodes(String),
    #[error("{0}")]
    DoesNotFit(String),
}

/// One pool kind's share, per rank.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct PoolPlan {
    pub kind: String,
    /// What one item belongs to: `token`, `4-token block`, ... (bytes per token amortize it).
    pub per: String,
    /// What a continuation reads of a prefix: `prefix` or `last N tokens`.
    pub needed: String,
    /// How tensor-parallel ranks hold it: `split` (each rank its KV heads) or `replicated`
    /// (every rank all of it: one K = V head, an MLA latent, indexer keys).
    pub tp: String,
    /// Of the largest rank.
    pub bytes_per_token: u64,
    /// Of each rank (what each rank's pool of this kind is built with; `strata serve` checks).
    pub rank_bytes_per_token: Vec<u64>,
    pub device_tokens: u64,
    pub device_pages: u64,
    pub device_bytes: u64,
    pub host_tokens: u64,
    pub host_pages: u64,
    pub host_bytes: u64,
}

/// Which flag decided a number.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Decision {
    pub what: String,
    pub by: String,
}

/// Where the host pools go and how much room that leaves.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct NumaPlan {
    pub policy: NumaPolicy,
    pub nodes: Vec<u32>,
    pub available_bytes: u64,
    pub source: String,
    /// Kept out of the pools' reach: the default or `--host-mem-reserve` headroom, plus the
    /// model's weights.
    pub reserve_bytes: u64,
    /// The model's weights, part of the reserve (in host memory beside the pools).
    pub weights_bytes: u64,
    /// The other parts of the reserve the server itself holds (`PlanRequest::beside`, then
    /// the forward pass's scratch on every rank, under [`Scratch::LABEL`]).
    pub beside: Vec<(String, u64)>,
    /// Bytes this server places there (host pools, plus device pools when in host memory).
    pub needed_bytes: u64,
    pub headroom_bytes: u64,
}

/// The validated plan. Every rank of the server gets the same pools.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Plan {
    pub role: String,
    pub model: String,
    pub tp: u32,
    pub page_size: usize,
    /// Bytes per token of the largest rank (what each rank's pools are sized for).
    pub bytes_per_token: u64,
    /// Each rank's: less on ranks holding fewer KV heads (SmolLM2's 3 over 2 ranks: 2 and 1).
    pub rank_bytes_per_token: Vec<u64>,
    pub pools: Vec<PoolPlan>,
    pub device_tokens_per_rank: u64,
    pub host_tokens_per_rank: u64,
    /// Tokens whose window state each tier keeps (= the tokens above without window kinds,
    /// or with the ratio 1).
    pub device_window_tokens_per_rank: u64,
    pub host_window_tokens_per_rank: u64,
    /// Committed prefixes keep their window state at their end, their branch point and every
    /// this many pages (0: every page, or no window kinds).
    pub window_checkpoint_pages: u64,
    pub device_bytes_per_rank: u64,
    pub host_bytes_per_rank: u64,
    pub server_device_bytes: u64,
    pub server_host_bytes: u64,
    pub numa: NumaPlan,
    pub decided_by: Vec<Decision>,
    pub warnings: Vec<String>,
}
