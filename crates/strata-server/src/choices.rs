//! `n` > 1: several choices for one prompt at the cost of one prefill (a batch of prompts
//! with one choice each: one request per prompt, [`one_each`]). The prompt is computed
//! once (a one-token request whose whole pages then join the tree: here, or on the prefill
//! worker with its K/V imported here under PD); each choice is a request that finds the prompt
//! cached and computes only its last page, then samples on its own (seed + index when a seed
//! is given: every choice reproducible).
//!
//! `best_of` > `n` (completions): that many candidates, of which the `n` with the highest
//! mean log probability per token (of the distribution each token was drawn from) are
//! returned, likeliest first; not streamed (the best are known only at the end).

use std::convert::Infallible;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use axum::response::sse::{Event as SseEvent, KeepAlive};
use axum::response::{IntoResponse, Response, Sse};
use futures_util::stream::{self, StreamExt};
use serde_json::Value;
use strata_engine::request::CachedTokens;
use strata_engine::{Event, FinishReason, PromptLogprobs, SamplingParams};

use crate::api::Usage;
use crate::error::ApiError;
use crate::respond::{
    choice_json, collect, first_event, usage_event, whole_body, Answer, Job, Streaming,
};
use crate::state::AppState;

/// Most choices one request may ask for.
pub const MAX_CHOICES: usize = 16;

/// Computes the prompt once (here, or on `prefill` with its K/V imported) so that its pages
/// are cached here; how the cache served it, and the prompt's log probabilities when asked.
async fn prefill_once(
    st: &Arc<AppState>,
    ids: &[u32],
    params: &SamplingParams,
    prefill: Option<&str>,
) -> Result<(CachedTokens, Option<Arc<PromptLogprobs>>), ApiError> {
    let p = SamplingParams {
        max_tokens: 1,
        logprobs: None,
        min_tokens: 0,
        // Only the prompt's K/V matter here; the choices follow the constraint.
        constraint: None,
        ..params.clone()
    };
    let mut rs = submit(st, ids.to_vec(), p, prefill).await?;
    let (mut cached, mut prompt) = (CachedTokens::default(), None);
    while let Some(ev) = rs.events.recv().await {
        match ev {
            Event::Admitted { cached: c } => cached = c,
            Event::PromptLogprobs(p) => prompt = Some(p),
            Event::Done { reason, .. } => match reason {
                FinishReason::Stop | FinishReason::Length => return Ok((cached, prompt)),
                FinishReason::QueueTimeout { waited } => {
                    return Err(ApiError::queue_timeout(waited))
                }
                FinishReason::Error(m) => return Err(crate::error::engine_error(&m)),
                FinishReason::Aborted => {
                    return Err(ApiError::from_submit(
                        &strata_engine::SubmitError::ShuttingDown,
                    ))
                }
            },
            _ => {}
        }
    }
    Err(ApiError::from_submit(
        &strata_engine::SubmitError::EngineDead("the engine stopped".into()),
    ))
}

/// A request for `ids`: here, or with the prompt computed on `prefill` and its K/V imported.
async fn submit(
    st: &Arc<AppState>,
    ids: Vec<u32>,
    params: SamplingParams,
    prefill: Option<&str>,
) -> Result<strata_engine::RequestStream, ApiError> {
    match prefill {
        Some(url) => crate::pd::decode_after_remote_prefill(st, url, ids, params).await,
        None => st
            .engine
            .submit(ids, params)
            .map_err(|e| ApiError::from_submit(&e)),
    }
}

/// A batch of prompts with one choice each: one request per prompt, all at once (no prompt
/// is computed twice); their usage's cached tokens are summed as they end.
async fn one_each(
    st: Arc<AppState>,
    prompts: Vec<OnePrompt>,
    params: SamplingParams,
    job: Job,
    prefill: Option<String>,
) -> Result<Response, ApiError> {
    let subs = prompts
        .iter()
        .map(|p| submit(&st, p.ids.clone(), params.clone(), prefill.as_deref()));
    let streams = futures_util::future::join_all(subs).await;
    let (mut answers, mut prompt_tokens) = (Vec::with_capacity(prompts.len()), 0);
    for (pi, (p, rs)) in prompts.into_iter().zip(streams).enumerate() {
        let mut rs = rs?;
        let first = first_event(&mut rs).await?;
        prompt_tokens += p.ids.len();
        let job = Job {
            echo: p.echo,
            ..job.clone()
        };
        answers.push(Candidate {
            answer: Answer::new(st.clone(), rs, &job, first),
            job,
            prompt: pi,
            rendered: None,
        });
    }
    finish(st, job, answers, (1, 1), (prompt_tokens, None)).await
}

/// A batch's prompts are queued together (each computed at once; a prompt's candidates
/// follow, up to half the queue at a time): more prompts than the queue takes (`--max-waiting`), or prompts and
/// candidates at their longest beyond the in-flight bound, could never be accepted together
/// (the last would be refused with 429 while the first run): a 400 before any runs.
fn check_batch(
    st: &AppState,
    prompts: &[OnePrompt],
    max_tokens: usize,
    best_of: usize,
) -> Result<(), ApiError> {
    let i = st.engine.info();
    if prompts.len() > i.max_waiting {
        return Err(ApiError::bad_request(
            format!(
                "{} prompts in one request, more than this server queues at once (--max-waiting {}): send fewer prompts per request",
                prompts.len(),
                i.max_waiting
            ),
            Some("prompt"),
        ));
    }
    let tokens = prompts.iter().fold(0usize, |t, p| {
        t.saturating_add(best_of.saturating_mul(p.ids.len().saturating_add(max_tokens)))
    });
    if prompts.len() > 1 && tokens > i.max_tokens_in_flight {
        return Err(ApiError::bad_request(
            format!(
                "the batch's {} prompts with {best_of} candidates each at max_tokens {max_tokens} take {tokens} tokens, more than this server holds in flight (--max-tokens-in-flight {}): send fewer prompts per request or a smaller max_tokens",
                prompts.len(),
                i.max_tokens_in_flight
            ),
            Some("prompt"),
        ));
    }
    Ok(())
}

/// Completions' `best_of` checked against `n`: the number of candidates to generate.
pub(crate) fn best_of(best_of: Option<usize>, n: usize, stream: bool) -> Result<usize, ApiError> {
    let b = best_of.unwrap_or(n);
    let bad = |m: String| Err(ApiError::bad_request(m, Some("best_of")));
    if b < n || b > MAX_CHOICES {
        return bad(format!(
            "best_of = {b}: from n ({n}) to {MAX_CHOICES} candidates"
        ));
    }
    if b > n && stream {
        return bad("best_of > n cannot be streamed: the best are known only at the end".into());
    }
    Ok(b)
}

/// The mean log probability per token of a candidate (an empty one ranks last).
fn mean_logprob(lps: &[strata_engine::TokenLogprobs]) -> f64 {
    if lps.is_empty() {
        return f64::NEG_INFINITY;
    }
    lps.iter().map(|l| l.logprob as f64).sum::<f64>() / lps.len() as f64
}

/// One prompt of a request: its ids and (completions' `echo`) its text.
pub(crate) struct OnePrompt {
    pub(crate) ids: Vec<u32>,
    pub(crate) echo: Option<String>,
}

/// Each prompt's candidates at their longest fit the pool and the in-flight bound together
/// (the engine's check; its message names best_of where best_of is the count).
fn fits_together(
    st: &AppState,
    prompts: &[OnePrompt],
    max_tokens: usize,
    (n, best_of): (usize, usize),
) -> Result<(), ApiError> {
    for p in prompts {
        st.engine
            .check_choices(p.ids.len(), max_tokens, best_of)
            .map_err(|e| match &e {
                strata_engine::SubmitError::ChoicesTooLarge { .. } if best_of > n => {
                    let m = e.to_string().replacen("n = ", "best_of = ", 1);
                    ApiError::bad_request(m, Some("max_tokens"))
                }
                _ => ApiError::from_submit(&e),
            })?;
    }
    Ok(())
}

/// Answers a request for `n` choices out of `best_of` candidates for each of its prompts
/// (completions take a batch: prompt `p`'s choices are indices `p·n ..`, OpenAI's order).
pub(crate) async fn answer(
    st: Arc<AppState>,
    prompts: Vec<OnePrompt>,
    mut params: SamplingParams,
    job: Job,
    (n, best_of): (usize, usize),
    prefill: Option<String>,
) -> Result<Response, ApiError> {
    if best_of > n {
        // The candidates are ranked by their tokens' log probabilities.
        params.logprobs = Some(params.logprobs.unwrap_or(0));
    }
    // All candidates of a prompt at their longest must fit together, and all of a batch's
    // in the queue at once: refused now, before any is computed.
    check_batch(&st, &prompts, params.max_tokens, best_of)?;
    fits_together(&st, &prompts, params.max_tokens, (n, best_of))?;
    if best_of == 1 {
        return one_each(st, prompts, params, job, prefill).await;
    }
    // Every prompt computed once, all at once.
    let once = prompts
        .iter()
        .map(|p| prefill_once(&st, &p.ids, &params, prefill.as_deref()));
    let computed = futures_util::future::join_all(once).await;
    let (mut prompt_tokens, mut cached_tokens) = (0, 0);
    let mut answers = Vec::with_capacity(prompts.len() * best_of);
    for (pi, (p, c)) in prompts.into_iter().zip(computed).enumerate() {
        let (cached, prompt_lps) = c?;
        prompt_tokens += p.ids.len();
        cached_tokens += cached.total();
        if let Some(l) = crate::request_log::current() {
            l.prompts_found(cached_tokens);
        }
        // The same for every choice of the prompt: rendered once.
        let rendered = prompt_lps
            .as_deref()
            .map(|l| Arc::new(crate::logprobs::render_prompt(&st.tokenizer, l)));
        let job = Job {
            echo: p.echo,
            ..job.clone()
        };
        // A window of candidates is submitted before any is awaited: admitted together, their
        // last pages computed in one batch (awaited one by one, each waited for the step the
        // one before it ran in: 16 choices took 16 steps). At most half the queue at once.
        let window = (st.engine.info().max_waiting / 2).clamp(1, MAX_CHOICES);
        for start in (0..best_of).step_by(window) {
            let mut streams = Vec::with_capacity(window);
            for i in start..(start + window).min(best_of) {
                let sp = SamplingParams {
                    seed: params.seed.map(|s| s.wrapping_add(i as u64)),
                    // Computed once above; each choice finds the prompt cached.
                    prompt_logprobs: None,
                    ..params.clone()
                };
                streams.push(submit(&st, p.ids.clone(), sp, None).await?);
            }
            for mut rs in streams {
                let first = first_event(&mut rs).await?;
                let a =
                    Answer::new(st.clone(), rs, &job, first).with_prompt_logprobs(rendered.clone());
                answers.push(Candidate {
                    answer: a,
                    job: job.clone(),
                    prompt: pi,
                    rendered: rendered.clone(),
                });
            }
        }
    }
    finish(
        st,
        job,
        answers,
        (n, best_of),
        (prompt_tokens, Some(cached_tokens)),
    )
    .await
}

/// The answer of a request's candidates, streamed or whole; usage's cached tokens as counted
/// when the prompts were computed, or (None) summed over the candidates as they end.
async fn finish(
    st: Arc<AppState>,
    job: Job,
    answers: Vec<Candidate>,
    nb: (usize, usize),
    usage: (usize, Option<usize>),
) -> Result<Response, ApiError> {
    if job.stream {
        let streams = answers
            .into_iter()
            .enumerate()
            .map(|(i, c)| (c.answer, c.job, i));
        return Ok(streamed(st, job, streams.collect(), usage).into_response());
    }
    whole(&st, &job, answers, nb, usage).await
}

/// The whole answer of a request's candidates: each prompt's `n` best, in order.
async fn whole(
    st: &Arc<AppState>,
    job: &Job,
    mut answers: Vec<Candidate>,
    (n, best_of): (usize, usize),
    (prompt_tokens, cached_tokens): (usize, Option<usize>),
) -> Result<Response, ApiError> {
    let results =
        futures_util::future::join_all(answers.iter_mut().map(|c| collect(&mut c.answer))).await;
    let mut done: Vec<Vec<_>> = (0..answers.len() / best_of).map(|_| Vec::new()).collect();
    let (mut completion, mut cached) = (0, 0);
    for (r, c) in results.into_iter().zip(&answers) {
        completion += c.answer.completion_tokens();
        cached += c.answer.cached_tokens();
        done[c.prompt].push((r?, c));
    }
    let mut choices = Vec::with_capacity(done.len() * n);
    for mut per in done {
        if best_of > n {
            // Likeliest first (the earlier candidate on a tie); the rest are dropped.
            per.sort_by(|x, y| mean_logprob(&y.0 .2).total_cmp(&mean_logprob(&x.0 .2)));
            per.truncate(n);
        }
        for ((text, reason, lps), c) in per {
            let prompt = c
                .rendered
                .as_deref()
                .or(c.answer.prompt_logprobs())
                .cloned();
            let i = choices.len();
            choices.push(choice_json(st, &c.job, i, &text, reason, &lps, prompt));
        }
    }
    let usage = Usage::new(prompt_tokens, completion, cached_tokens.unwrap_or(cached));
    Ok(whole_body(st, job, choices, usage))
}

/// A candidate answer with what its choice needs.
struct Candidate {
    answer: Answer,
    /// The request's job with its prompt's echo.
    job: Job,
    /// Its prompt's index in the batch.
    prompt: usize,
    rendered: Option<Arc<Value>>,
}

/// The choices' chunks as they come, then one usage chunk (if asked) and `[DONE]`.
fn streamed(
    st: Arc<AppState>,
    job: Job,
    answers: Vec<(Answer, Job, usize)>,
    (prompt, cached): (usize, Option<usize>),
) -> Sse<impl futures_util::Stream<Item = Result<SseEvent, Infallible>>> {
    let completion = Arc::new(AtomicUsize::new(0));
    let summed = Arc::new(AtomicUsize::new(0));
    let choices: Vec<_> = answers
        .into_iter()
        .map(|(a, own, i)| {
            let s = Streaming::new(a, own, i, false);
            let totals = (completion.clone(), summed.clone());
            stream::unfold(Some(s), move |s| {
                let (total, cached) = totals.clone();
                async move {
                    let mut s = s?;
                    match s.next().await {
                        Some(ev) => Some((ev, Some(s))),
                        None => {
                            total.fetch_add(s.completion_tokens(), Ordering::Relaxed);
                            cached.fetch_add(s.cached_tokens(), Ordering::Relaxed);
                            None
                        }
                    }
                }
            })
            .boxed()
        })
        .collect();
    let end = stream::once(async move {
        let mut out = Vec::new();
        if job.include_usage {
            let cached = cached.unwrap_or(summed.load(Ordering::Relaxed));
            let usage = Usage::new(prompt, completion.load(Ordering::Relaxed), cached);
            out.push(usage_event(&st, &job, usage));
        }
        out.push(SseEvent::default().data("[DONE]"));
        out
    });
    let events = stream::select_all(choices)
        .chain(end)
        .flat_map(|v| stream::iter(v.into_iter().map(Ok)));
    Sse::new(events).keep_alive(KeepAlive::default())
}
