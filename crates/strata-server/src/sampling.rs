//! The sampling fields of a request: checked (each refusal names its field) and turned into
//! the engine's [`SamplingParams`], with defaults filled.

use strata_engine::request::MAX_LOGIT_BIAS;
use strata_engine::SamplingParams;

use crate::api::Sampling;
use crate::error::ApiError;
use crate::state::AppState;

/// Longest stop string accepted (matching work per token grows with it).
pub const MAX_STOP_BYTES: usize = 256;

/// Most stop strings one request may give.
pub const MAX_STOP_STRINGS: usize = 16;

/// Checks the sampling fields and fills defaults: the engine's parameters and the stop
/// strings.
pub fn sampling(
    st: &AppState,
    s: &Sampling,
    prompt_len: usize,
) -> Result<(SamplingParams, Vec<String>), ApiError> {
    if let Some(n) = s.n {
        let max = crate::choices::MAX_CHOICES;
        if n == 0 || n > max {
            return Err(ApiError::bad_request(
                format!("n = {n}: from 1 to {max} choices"),
                Some("n"),
            ));
        }
    }
    let (temperature, top_p, top_k) = distribution(s)?;
    let stops = stop_strings(s)?;
    let max_tokens = max_tokens(st, s, prompt_len)?;
    let mut params = SamplingParams {
        max_tokens,
        temperature,
        top_p,
        top_k,
        seed: s.seed,
        stop_token_ids: stop_token_ids(s)?,
        ignore_eos: s.ignore_eos.unwrap_or(false),
        ..SamplingParams::default()
    };
    modifiers(s, &mut params)?;
    params.logprobs = logprobs(s)?;
    params.session = session(s);
    Ok((params, stops))
}

/// The request's session for the prefix cache (`strata_kv` `cache/session.rs`): a hash of
/// `prompt_cache_key`, else of `user`, keyed per process (no hash can be precomputed or
/// collided on purpose; a key is as private as its string), each in its own namespace. An empty string is no session. The cache uses it only
/// to find the session's previous request, and acts only when this prompt continues that
/// one's, so a coarse key (a `user` with several chats) costs nothing.
pub fn session(s: &Sampling) -> Option<u64> {
    use std::hash::BuildHasher;
    static KEY: std::sync::OnceLock<std::collections::hash_map::RandomState> =
        std::sync::OnceLock::new();
    let key = KEY.get_or_init(Default::default);
    fn named(v: &Option<String>) -> Option<&str> {
        v.as_deref().filter(|v| !v.is_empty())
    }
    if let Some(k) = named(&s.prompt_cache_key) {
        Some(key.hash_one(("prompt_cache_key", k)))
    } else {
        named(&s.user).map(|u| key.hash_one(("user", u)))
    }
}

/// `logprobs` (a flag, or a number of alternatives) and `top_logprobs` → how many
/// alternatives per token, if any.
fn logprobs(s: &Sampling) -> Result<Option<usize>, ApiError> {
    use crate::api::LogprobsField::{Count, Flag};
    let k = match (s.logprobs, s.top_logprobs) {
        (None | Some(Flag(false)), None | Some(0)) => None,
        (None | Some(Flag(false)), Some(_)) => {
            return Err(ApiError::bad_request(
                "top_logprobs needs logprobs: true",
                Some("top_logprobs"),
            ))
        }
        (Some(Flag(true)), k) => Some(k.unwrap_or(0)),
        (Some(Count(n)), None) => Some(n),
        (Some(Count(_)), Some(_)) => {
            return Err(ApiError::bad_request(
                "give the number of alternatives in logprobs or in top_logprobs, not both",
                Some("top_logprobs"),
            ))
        }
    };
    let max = strata_engine::request::MAX_TOP_LOGPROBS;
    if let Some(k) = k.filter(|&k| k > max) {
        return Err(ApiError::bad_request(
            format!("{k} alternatives per token: at most {max}"),
            Some("top_logprobs"),
        ));
    }
    Ok(k)
}

/// Penalties, `logit_bias`, `min_p` and `min_tokens`, in their ranges.
fn modifiers(s: &Sampling, p: &mut SamplingParams) -> Result<(), ApiError> {
    let within = |v: Option<f32>, name: &str, lo: f32, hi: f32, lo_open: bool| match v {
        Some(x) if !(x <= hi && (x > lo || (!lo_open && x == lo))) => {
            let range = if lo_open {
                format!("({lo}, {hi}]")
            } else {
                format!("[{lo}, {hi}]")
            };
            Err(ApiError::bad_request(
                format!("{name} {x} is outside {range}"),
                Some(name),
            ))
        }
        _ => Ok(()),
    };
    within(s.frequency_penalty, "frequency_penalty", -2.0, 2.0, false)?;
    within(s.presence_penalty, "presence_penalty", -2.0, 2.0, false)?;
    within(s.repetition_penalty, "repetition_penalty", 0.0, 2.0, true)?;
    within(s.min_p, "min_p", 0.0, 1.0, false)?;
    p.frequency_penalty = s.frequency_penalty.unwrap_or(0.0);
    p.presence_penalty = s.presence_penalty.unwrap_or(0.0);
    p.repetition_penalty = s.repetition_penalty.unwrap_or(1.0);
    p.min_p = s.min_p.unwrap_or(0.0);
    if let Some(m) = s.min_tokens {
        if m > p.max_tokens {
            return Err(ApiError::bad_request(
                format!("min_tokens {m} exceeds max_tokens {}", p.max_tokens),
                Some("min_tokens"),
            ));
        }
        p.min_tokens = m;
    }
    let bias = s.logit_bias.clone().unwrap_or_default();
    if bias.len() > MAX_LOGIT_BIAS {
        return Err(ApiError::bad_request(
            format!(
                "{} logit_bias entries: at most {MAX_LOGIT_BIAS}",
                bias.len()
            ),
            Some("logit_bias"),
        ));
    }
    for (k, v) in bias {
        // A token id as its decimal digits, nothing else: `07042`, `+7042` or ` 7042` would
        // name the same token as `7042`, and their biases would add up past the range.
        let canonical = k.parse::<u32>().ok().filter(|id| id.to_string() == k);
        let Some(id) = canonical else {
            return Err(ApiError::bad_request(
                format!("logit_bias key `{k}` is not a token id (its decimal digits, no sign, space or leading zero)"),
                Some("logit_bias"),
            ));
        };
        if !(-100.0..=100.0).contains(&v) {
            return Err(ApiError::bad_request(
                format!("logit_bias {v} for token {id} is outside [-100, 100]"),
                Some("logit_bias"),
            ));
        }
        p.logit_bias.push((id, v as f32));
    }
    Ok(())
}

/// temperature, top_p and top_k, in range.
fn distribution(s: &Sampling) -> Result<(f32, f32, usize), ApiError> {
    let temperature = s.temperature.unwrap_or(1.0);
    if !(0.0..=2.0).contains(&temperature) {
        return Err(ApiError::bad_request(
            format!("temperature {temperature} is outside [0, 2]"),
            Some("temperature"),
        ));
    }
    let top_p = s.top_p.unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(ApiError::bad_request(
            format!("top_p {top_p} is outside (0, 1]"),
            Some("top_p"),
        ));
    }
    let top_k = match s.top_k {
        None | Some(-1) | Some(0) => 0,
        Some(k) if k > 0 => k as usize,
        Some(k) => {
            return Err(ApiError::bad_request(
                format!("top_k {k}: use a positive number, or -1 / 0 for no limit"),
                Some("top_k"),
            ))
        }
    };
    Ok((temperature, top_p, top_k))
}

/// The stop strings: at most [`MAX_STOP_STRINGS`], each 1 to [`MAX_STOP_BYTES`] bytes.
fn stop_strings(s: &Sampling) -> Result<Vec<String>, ApiError> {
    let stops = s.stop.clone().map(|v| v.into_vec()).unwrap_or_default();
    if stops.len() > MAX_STOP_STRINGS {
        return Err(ApiError::bad_request(
            format!("{} stop strings: at most {MAX_STOP_STRINGS}", stops.len()),
            Some("stop"),
        ));
    }
    if let Some(s) = stops
        .iter()
        .find(|s| s.len() > MAX_STOP_BYTES || s.is_empty())
    {
        return Err(ApiError::bad_request(
            format!(
                "a stop string of {} bytes: each must have 1 to {MAX_STOP_BYTES}",
                s.len()
            ),
            Some("stop"),
        ));
    }
    Ok(stops)
}

/// `max_completion_tokens` or `max_tokens`: at least 1, at most the context; by default the
/// room the context and the device pool leave after the prompt (capped by the server's
/// default).
fn max_tokens(st: &AppState, s: &Sampling, prompt_len: usize) -> Result<usize, ApiError> {
    let info = st.engine.info();
    // The error names the field the request used.
    let field = match s.max_completion_tokens {
        Some(_) => "max_completion_tokens",
        None => "max_tokens",
    };
    match s.max_completion_tokens.or(s.max_tokens) {
        Some(0) => Err(ApiError::bad_request(
            format!("{field} must be at least 1"),
            Some(field),
        )),
        Some(m) if m > info.context_length => Err(ApiError::bad_request(
            format!(
                "{field} {m} exceeds the context length ({} tokens)",
                info.context_length
            ),
            Some(field),
        )
        .with_code("context_length_exceeded")),
        Some(m) => Ok(m),
        None => {
            let room = info
                .context_length
                .min(info.device_tokens)
                .saturating_sub(prompt_len);
            Ok(st.default_max_tokens.min(room).max(1))
        }
    }
}

/// `stop_token_ids`: at most the engine's limit (their range is the engine's check).
fn stop_token_ids(s: &Sampling) -> Result<Vec<u32>, ApiError> {
    let ids = s.stop_token_ids.clone().unwrap_or_default();
    if ids.len() > strata_engine::MAX_STOP_TOKEN_IDS {
        return Err(ApiError::bad_request(
            format!(
                "{} stop_token_ids: at most {}",
                ids.len(),
                strata_engine::MAX_STOP_TOKEN_IDS
            ),
            Some("stop_token_ids"),
        ));
    }
    Ok(ids)
}
