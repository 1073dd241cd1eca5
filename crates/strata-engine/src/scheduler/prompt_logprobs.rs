//! Prompt log probabilities: a request that asks for them is computed whole (no prefix match:
//! the logits of cached positions were never kept), in chunks of at most [`ROWS`] tokens whose
//! every row's logits come back; each row gives the log probabilities of the prompt token
//! after it, gathered until the prompt ends and then sent once, before the first token.

use std::sync::Arc;

use rayon::prelude::*;

use crate::request::{Event, PromptLogprobs};
use crate::sampler::logprobs;

use super::Req;

/// Most prompt tokens per step, over all requests that want their log probabilities: the
/// logits of every such row are kept for the step (ROWS × vocabulary floats: 48 MiB at a
/// 49 152-token vocabulary).
pub(super) const ROWS: usize = crate::config::PROMPT_LOGPROB_ROWS;

/// Sends `r`'s prompt log probabilities (positions 1..), gathered here or imported.
pub(super) fn send(r: &Req, tokens: Vec<crate::request::TokenLogprobs>) {
    let p = PromptLogprobs {
        first_token: r.tokens[0],
        tokens,
    };
    let _ = r.tx.send(Event::PromptLogprobs(Arc::new(p)));
}

/// Whether the chunk starting at `at` needs the logits of every row.
pub(super) fn wants_rows(r: &Req, at: usize) -> bool {
    r.params.prompt_logprobs.is_some() && at < r.prompt_len
}

/// Takes the chunk `at..at + n` of `r`'s prompt and its logits (`n` rows of `vocab`): keeps
/// the log probabilities of the prompt tokens its rows predict, sends them all when the chunk
/// ends the prompt, and returns the last row (the logits the next token is chosen from).
pub(super) fn gather<'a>(r: &mut Req, at: usize, n: usize, logits: &'a [f32]) -> &'a [f32] {
    let vocab = logits.len() / n.max(1);
    let k = r.params.prompt_logprobs.unwrap_or(0);
    // Row j predicts position at + j + 1; the last prompt row predicts the first output token.
    let predicted = (r.prompt_len - at).saturating_sub(1).min(n);
    let tokens = &r.tokens[at + 1..at + 1 + predicted];
    let rows: Vec<_> = logits[..predicted * vocab]
        .par_chunks_exact(vocab)
        .zip(tokens.par_iter())
        .map(|(row, &t)| logprobs(row, 0.0, t, k))
        .collect();
    r.prompt_lps.extend(rows);
    if at + n >= r.prompt_len {
        let tokens = std::mem::take(&mut r.prompt_lps);
        send(r, tokens);
    }
    &logits[(n - 1) * vocab..n * vocab]
}
