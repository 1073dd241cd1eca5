//! `strata-protocol`: every JSON type that crosses between Strata processes, in one place,
//! used by both ends (Architecture invariant: wire types live only here).
//!
//! * worker → router: [`CacheInfo`] (`GET /cache/info`), [`CacheEvents`] (`GET /cache/events`),
//!   [`CacheSnapshot`] (`GET /cache/snapshot`), their [`WireEvent`]s by [`Tier`];
//! * decode worker → prefill worker: [`PrefillRequest`] / [`PrefillResponse`]
//!   (`POST /pd/prefill`).
//!
//! Hashes travel as lowercase hex ([`Hex`]); a malformed one fails deserialization (the
//! receiver refuses the document) rather than being skipped.

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// `N` bytes as `2N` lowercase hex digits on the wire.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Hex<const N: usize>(pub [u8; N]);

/// A page's chained hash.
pub type PageHashHex = Hex<16>;
/// A page-hash namespace key.
pub type KeyHex = Hex<32>;

impl<const N: usize> Hex<N> {
    pub fn to_hex(&self) -> String {
        strata_kv::auth::hex(&self.0)
    }

    pub fn parse(s: &str) -> Option<Hex<N>> {
        strata_kv::auth::unhex(s)?.try_into().ok().map(Hex)
    }
}

impl<const N: usize> Serialize for Hex<N> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_hex())
    }
}

impl<'de, const N: usize> Deserialize<'de> for Hex<N> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = <std::borrow::Cow<'de, str>>::deserialize(d)?;
        Hex::parse(&s).ok_or_else(|| {
            serde::de::Error::custom(format!("expected {} hex digits, got `{s}`", 2 * N))
        })
    }
}

/// Where a page is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Tier {
    Device,
    Host,
    /// A shared remote L3: reachable by every worker on it.
    Remote,
}

/// What a worker does in a deployment, as the router and its answers name it.
#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[serde(rename_all = "lowercase")]
pub enum WorkerRole {
    /// Computes prompts and ships their K/V (PD).
    Prefill,
    /// Receives K/V and generates (PD).
    Decode,
    /// Does both (no PD).
    Both,
}

impl WorkerRole {
    pub fn as_str(&self) -> &'static str {
        match self {
            WorkerRole::Prefill => "prefill",
            WorkerRole::Decode => "decode",
            WorkerRole::Both => "both",
        }
    }
}

/// What a router needs to hash prompts as a worker does (`GET /cache/info`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CacheInfo {
    pub model_id: String,
    pub page_size: usize,
    /// Key of the page-hash namespace (None: the worker computes no hashes).
    pub hash_key: Option<KeyHex>,
    /// Differs on every start of the worker.
    pub epoch: u64,
    /// Sequence number of the next event.
    pub next: u64,
}

/// Pages that entered (`stored`) or left a tier.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WireEvent {
    /// Its sequence number (None in snapshots).
    pub seq: Option<u64>,
    pub stored: bool,
    pub tier: Tier,
    pub hashes: Vec<PageHashHex>,
}

/// `GET /cache/events?since=N`: events from `since`; `resync` when they fell out of the log
/// (then read a [`CacheSnapshot`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CacheEvents {
    pub epoch: u64,
    /// Oldest sequence number held.
    pub first: u64,
    /// Where to continue from.
    pub next: u64,
    pub resync: bool,
    pub events: Vec<WireEvent>,
}

/// `GET /cache/snapshot`: every page in the device and host tiers now, and the sequence
/// number events continue from.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CacheSnapshot {
    pub epoch: u64,
    pub next: u64,
    pub tiers: Vec<WireEvent>,
}

/// `GET /cache/curve` on a worker: its live miss-ratio curve (what each tier's hit ratio
/// would be at other sizes) and the answer to "what would more memory buy".
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CurveReport {
    /// The worker's role (`prefill`, `decode`, `both`).
    pub role: String,
    /// The eviction policy the hit ratios are for.
    pub policy: String,
    pub page_size: usize,
    /// Tensor-parallel ranks: a tier's bytes are every rank's together.
    pub ranks: usize,
    /// The sampler's rate, the prompt pages observed, those the window simulations counted.
    pub sample_rate: f64,
    pub references: u64,
    pub window_references: u64,
    /// Pages the sampler tracks now, and the memory it holds (fixed when it starts, whatever
    /// the traffic; a fleet's: every worker's together).
    #[serde(default)]
    pub tracked_pages: u64,
    #[serde(default)]
    pub memory_bytes: u64,
    pub prompt_tokens_per_second: f64,
    /// The hit ratio of a cache that never evicts: the curve's ceiling.
    pub unbounded_hit_ratio: f64,
    pub points: Vec<CurvePointReport>,
    pub gains: Vec<CurveGain>,
}

/// One point of a [`CurveReport`]: a cache of `scale` × the tier's pages.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CurvePointReport {
    pub tier: String,
    pub scale: f64,
    pub pages: u64,
    pub bytes: u64,
    pub hit_ratio: f64,
    /// Belady's MIN over the recent window (None until simulated).
    pub belady: Option<f64>,
}

/// What `added_bytes` more in one tier would have bought over the last five minutes.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CurveGain {
    pub tier: String,
    pub added_bytes: u64,
    pub hit_ratio: f64,
    pub hit_ratio_after: f64,
    pub saved_prompt_tokens_per_second: f64,
}

/// `GET /cache/curve` on a router: its workers' curves, and per role the fleet's (each
/// worker at the same multiple of its own tiers; hit ratios weighted by the prompt pages each
/// observed, bytes and saved tokens summed).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FleetCurve {
    pub roles: Vec<CurveReport>,
    pub workers: Vec<WorkerCurve>,
}

/// One worker's curve in a [`FleetCurve`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct WorkerCurve {
    pub url: String,
    pub curve: CurveReport,
}

/// `POST /pd/prefill`: compute a prompt, ship its K/V to `kv_target`, answer the first token.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct PrefillRequest {
    /// The transfer id the decode worker expects (32 hex digits).
    pub transfer_id: String,
    pub tokens: Vec<u32>,
    /// The decode worker's KV listener, `IP:PORT`.
    pub kv_target: String,
    /// How to sample the first token (the decode worker samples the rest the same way);
    /// greedy when absent.
    #[serde(default)]
    pub sampling: FirstTokenSampling,
    /// The first this many of `tokens` are a prefix other prompts are expected to share and
    /// leave (a chat's system part); the prefill worker's cache keeps the window state there.
    /// At most `tokens.len()`.
    #[serde(default)]
    pub shared_prefix: usize,
    /// The first this many of `tokens` (whole pages) the decode worker's cache holds: only
    /// the pages after them are sent. Less than `tokens.len()`.
    #[serde(default)]
    pub held_tokens: usize,
    /// A digest of the held tokens in the transfer format (32 hex digits; empty when none are
    /// held; `strata_server::pd::held_digest`): the prefill worker checks it before computing.
    #[serde(default)]
    pub held_hash: String,
    /// The request's session (the decode worker's keyed hash of the client's
    /// `prompt_cache_key` or `user`, opaque here): the prefill worker's cache retires the
    /// session's previous answer the same way (`strata_kv` `cache/session.rs`). Absent
    /// when none (a worker of the version before sessions refuses unknown fields).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session: Option<u64>,
}

/// The client's sampling as it travels to the prefill worker: the engine's parameters less
/// `max_tokens` (a prefill computes one token).
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct FirstTokenSampling {
    #[serde(default)]
    pub temperature: f32,
    #[serde(default = "one")]
    pub top_p: f32,
    #[serde(default)]
    pub top_k: usize,
    pub seed: Option<u64>,
    #[serde(default)]
    pub stop_token_ids: Vec<u32>,
    #[serde(default)]
    pub ignore_eos: bool,
    #[serde(default)]
    pub frequency_penalty: f32,
    #[serde(default)]
    pub presence_penalty: f32,
    #[serde(default = "one")]
    pub repetition_penalty: f32,
    /// (token id, bias) pairs.
    #[serde(default)]
    pub logit_bias: Vec<(u32, f32)>,
    #[serde(default)]
    pub min_p: f32,
    #[serde(default)]
    pub min_tokens: usize,
    /// Log probabilities of the first token and this many alternatives (None: not asked).
    #[serde(default)]
    pub logprobs: Option<usize>,
    /// Log probabilities of the prompt's tokens and this many alternatives (None: not asked).
    #[serde(default)]
    pub prompt_logprobs: Option<usize>,
    /// The output's constraint: the first token is chosen under it too.
    #[serde(default)]
    pub constraint: Option<OutputConstraint>,
}

/// A constraint on a request's output (structured output, tool calls), as the HTTP layer
/// parsed it from the request and as it travels to a prefill worker; `strata-grammar`
/// compiles it.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
#[serde(
    tag = "type",
    content = "value",
    rename_all = "snake_case",
    deny_unknown_fields
)]
pub enum OutputConstraint {
    /// Any JSON object.
    JsonObject,
    /// JSON valid against this JSON schema (the schema's JSON text).
    JsonSchema(String),
    /// Text matching this regular expression (whole).
    Regex(String),
    /// Text of this Lark grammar (llguidance's dialect).
    Lark(String),
    /// Exactly one of these texts.
    Choice(Vec<String>),
}

impl Default for FirstTokenSampling {
    fn default() -> Self {
        FirstTokenSampling {
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            seed: None,
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
            repetition_penalty: 1.0,
            logit_bias: Vec::new(),
            min_p: 0.0,
            min_tokens: 0,
            logprobs: None,
            prompt_logprobs: None,
            constraint: None,
        }
    }
}

fn one() -> f32 {
    1.0
}

/// The prefill worker's answer: the first token and how the prompt was served.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct PrefillResponse {
    pub first_token: u32,
    pub prompt_tokens: usize,
    pub cached_device: usize,
    pub cached_host: usize,
    pub cached_storage: usize,
    pub transfer_pages: u64,
    pub transfer_bytes: u64,
    pub transfer_seconds: f64,
    /// The first token's log probabilities, when the request asked for them.
    #[serde(default)]
    pub first_logprobs: Option<WireLogprobs>,
    /// The log probabilities of prompt positions 1.., when the request asked for them.
    #[serde(default)]
    pub prompt_logprobs: Option<Vec<WireLogprobs>>,
}

/// A token's log probability and its likeliest alternatives (token id, log probability).
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct WireLogprobs {
    pub token: u32,
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_round_trip_and_bad_hashes_are_refused() {
        let e = CacheEvents {
            epoch: 7,
            first: 0,
            next: 1,
            resync: false,
            events: vec![WireEvent {
                seq: Some(0),
                stored: true,
                tier: Tier::Remote,
                hashes: vec![Hex([0xab; 16])],
            }],
        };
        let text = serde_json::to_string(&e).unwrap();
        assert!(text.contains("\"tier\":\"remote\""), "{text}");
        assert!(text.contains(&"ab".repeat(16)), "{text}");
        assert_eq!(serde_json::from_str::<CacheEvents>(&text).unwrap(), e);
        let bad = text.replace(&"ab".repeat(16), "zz");
        assert!(serde_json::from_str::<CacheEvents>(&bad).is_err());
        let bad = text.replace("remote", "elsewhere");
        assert!(serde_json::from_str::<CacheEvents>(&bad).is_err());
    }

    /// A prefill request carries its session only when it has one (so one without reads as
    /// before), and round-trips with it.
    #[test]
    fn a_prefill_request_names_its_session_only_when_it_has_one() {
        let mut r = PrefillRequest {
            transfer_id: "00".repeat(16),
            tokens: vec![1, 2, 3],
            kv_target: "127.0.0.1:1".into(),
            sampling: FirstTokenSampling::default(),
            shared_prefix: 0,
            held_tokens: 0,
            held_hash: String::new(),
            session: None,
        };
        assert!(!serde_json::to_string(&r).unwrap().contains("session"));
        r.session = Some(u64::MAX);
        let text = serde_json::to_string(&r).unwrap();
        assert_eq!(serde_json::from_str::<PrefillRequest>(&text).unwrap(), r);
    }
}
