//! One log line per finished request, at info under the target `strata::request`: its id,
//! method, route, status, prompt / cached / output tokens, time to first token, duration and
//! how it finished. The line is written when the request is over: for a whole answer when the
//! response is out, for a stream when its body ends (or the client goes away: `cancelled`).
//!
//! The middleware makes a [`RequestLog`] for every logged route and runs the handler with it
//! as the task's current one; an answer takes it ([`current`]) and reports tokens into it.
//! Each holder keeps it alive: the line is written when the last one lets go.

use std::sync::atomic::{AtomicU16, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

tokio::task_local! {
    static CURRENT: Arc<RequestLog>;
}

/// What one request did, logged when the last holder drops it.
pub struct RequestLog {
    id: String,
    method: String,
    route: String,
    started: Instant,
    status: AtomicU16,
    prompt: AtomicUsize,
    cached: AtomicUsize,
    /// `cached` was counted when the prompts were computed, once for all choices (`n` > 1):
    /// the choices, which find the prompt the request itself computed, do not count.
    cached_once: std::sync::atomic::AtomicBool,
    output: AtomicUsize,
    /// Microseconds from the start to the first token, plus one (0: none yet).
    first_token_us: AtomicU64,
    finish: Mutex<Option<&'static str>>,
}

impl RequestLog {
    pub fn new(id: &str, method: &str, route: &str) -> Arc<RequestLog> {
        Arc::new(RequestLog {
            id: id.to_string(),
            method: method.to_string(),
            route: route.to_string(),
            started: Instant::now(),
            status: AtomicU16::new(0),
            prompt: AtomicUsize::new(0),
            cached: AtomicUsize::new(0),
            cached_once: std::sync::atomic::AtomicBool::new(false),
            output: AtomicUsize::new(0),
            first_token_us: AtomicU64::new(0),
            finish: Mutex::new(None),
        })
    }

    /// Runs `f` with this log as the task's current one.
    pub async fn scope<F: std::future::Future>(self: &Arc<Self>, f: F) -> F::Output {
        CURRENT.scope(self.clone(), f).await
    }

    pub fn set_status(&self, status: u16) {
        self.status.store(status, Ordering::Relaxed);
    }

    /// A token came (the first one's time is kept).
    pub fn token(&self) {
        if self.first_token_us.load(Ordering::Relaxed) == 0 {
            let us = self.started.elapsed().as_micros() as u64 + 1;
            let _ =
                self.first_token_us
                    .compare_exchange(0, us, Ordering::Relaxed, Ordering::Relaxed);
        }
    }

    /// The request's prompts were computed once for all its choices and found `cached`
    /// tokens cached (what its usage says); its choices' own counts are not the request's.
    pub fn prompts_found(&self, cached: usize) {
        self.cached.store(cached, Ordering::Relaxed);
        self.cached_once.store(true, Ordering::Relaxed);
    }

    /// One answer ended (`n` > 1: each of them): its prompt and cached tokens (the largest
    /// counts, unless [`Self::prompts_found`] said), its output tokens (added), how it ended
    /// (the first end says).
    pub fn ended(&self, prompt: usize, cached: usize, output: usize, finish: &'static str) {
        self.prompt.fetch_max(prompt, Ordering::Relaxed);
        if !self.cached_once.load(Ordering::Relaxed) {
            self.cached.fetch_max(cached, Ordering::Relaxed);
        }
        self.output.fetch_add(output, Ordering::Relaxed);
        let mut f = self.finish.lock().unwrap_or_else(|p| p.into_inner());
        f.get_or_insert(finish);
    }
}

impl Drop for RequestLog {
    fn drop(&mut self) {
        let ttft = match self.first_token_us.load(Ordering::Relaxed) {
            0 => None,
            us => Some((us - 1) as f64 / 1e3),
        };
        let finish = self
            .finish
            .get_mut()
            .map(|f| f.unwrap_or("-"))
            .unwrap_or("-");
        tracing::info!(
            target: "strata::request",
            request_id = %self.id,
            method = %self.method,
            route = %self.route,
            status = self.status.load(Ordering::Relaxed),
            prompt_tokens = self.prompt.load(Ordering::Relaxed),
            cached_tokens = self.cached.load(Ordering::Relaxed),
            output_tokens = self.output.load(Ordering::Relaxed),
            ttft_ms = %ttft.map(|t| format!("{t:.1}")).unwrap_or_else(|| "-".into()),
            duration_ms = %format!("{:.1}", self.started.elapsed().as_secs_f64() * 1e3),
            finish = %finish,
            "request"
        );
    }
}

/// The request log of the task's current request (None outside one, or when logging is off).
pub fn current() -> Option<Arc<RequestLog>> {
    CURRENT.try_with(|l| l.clone()).ok()
}

/// Whether a request to `path` gets a line: every API call, not the probes and scrapes that
/// come every few seconds (`/health`, `/health_generate`, `/metrics`, `/version`, `/cache/*`).
pub fn logged(path: &str) -> bool {
    !(matches!(
        path,
        "/health" | "/health_generate" | "/metrics" | "/version"
    ) || path.starts_with("/cache/"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_current_log_is_the_scopes_and_counts_add_up() {
        assert!(current().is_none());
        let l = RequestLog::new("r1", "POST", "/v1/chat/completions");
        l.scope(async {
            let c = current().expect("in scope");
            c.token();
            c.token();
            c.ended(10, 4, 3, "stop");
            c.ended(10, 4, 2, "length");
        })
        .await;
        assert_eq!(l.output.load(Ordering::Relaxed), 5);
        assert_eq!(l.cached.load(Ordering::Relaxed), 4);
        // Choices of a prompt computed once: the request's count is the computation's.
        let once = RequestLog::new("r2", "POST", "/v1/completions");
        once.prompts_found(0);
        once.ended(10, 8, 1, "stop");
        assert_eq!(once.cached.load(Ordering::Relaxed), 0);
        assert_eq!(l.prompt.load(Ordering::Relaxed), 10);
        assert_eq!(*l.finish.lock().unwrap(), Some("stop"));
        assert!(l.first_token_us.load(Ordering::Relaxed) > 0);
        assert!(logged("/v1/completions") && !logged("/metrics") && !logged("/cache/info"));
    }
}
