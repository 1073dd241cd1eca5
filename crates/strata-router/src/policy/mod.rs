//! How the router picks a worker: the [`LoadBalancingPolicy`] trait, one module per policy.
//!
//! A policy picks in one pool (the decode workers, or the prefill workers under PD) among
//! the healthy workers, avoiding the one a failed first attempt went to when another exists.
//! Under PD the prefill worker is picked with the request's prompt (its cache computes what
//! is missing) and so is the decode worker (`pick_pd`: its cache holds a prefix the prefill
//! worker then does not send), by the policies that read prompts — the prompt read once.

use std::sync::Arc;

use crate::worker::Worker;

mod cache_aware;
mod least_load;
mod round_robin;

pub use cache_aware::{CacheAware, CacheAwareStats};
pub use least_load::LeastLoad;
pub use round_robin::RoundRobin;

/// A worker-selection policy.
pub trait LoadBalancingPolicy: Send + Sync {
    /// The name operators type (`--policy`) and metrics show.
    fn name(&self) -> &'static str;

    /// Whether `pick` reads the prompt (CPU work: the caller runs it off the async workers).
    fn reads_prompt(&self) -> bool {
        false
    }

    /// A worker of `pool` for a request (`prompt`: its JSON body, when this pool's caches
    /// serve prompts); None when no worker is healthy.
    fn pick(
        &self,
        pool: &[Arc<Worker>],
        prompt: Option<&[u8]>,
        avoid: Option<&Arc<Worker>>,
    ) -> Option<Arc<Worker>>;

    /// A PD request's prefill and decode workers (`prompt`: its JSON body, read once by the
    /// policies that read prompts), avoiding `avoid` = (prefill, decode): by default
    /// [`LoadBalancingPolicy::pick`] in `prefill` with the prompt and in `decode` without it.
    fn pick_pd(
        &self,
        prefill: &[Arc<Worker>],
        decode: &[Arc<Worker>],
        prompt: Option<&[u8]>,
        avoid: (Option<&Arc<Worker>>, Option<&Arc<Worker>>),
    ) -> Option<(Arc<Worker>, Arc<Worker>)> {
        let p = self.pick(prefill, prompt, avoid.0)?;
        Some((p, self.pick(decode, None, avoid.1)?))
    }

    /// The cache-aware decisions made so far (None for policies that do not look at caches).
    fn cache_stats(&self) -> Option<CacheAwareStats> {
        None
    }
}

/// The policies by name (the values of `--policy`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Policy {
    RoundRobin,
    LeastLoad,
    /// Most cached prefix (device pages weigh more than host pages) minus load, from the
    /// workers' cache events.
    CacheAware,
}

impl Policy {
    pub fn parse(s: &str) -> Option<Policy> {
        match s {
            "round_robin" => Some(Policy::RoundRobin),
            "least_load" => Some(Policy::LeastLoad),
            "cache_aware" => Some(Policy::CacheAware),
            _ => None,
        }
    }

    pub fn name(&self) -> &'static str {
        match self {
            Policy::RoundRobin => "round_robin",
            Policy::LeastLoad => "least_load",
            Policy::CacheAware => "cache_aware",
        }
    }
}

/// Index in `pool` of the workers a request may go to: healthy, and not `avoid` unless it is
/// the only worker.
pub(crate) fn candidates(pool: &[Arc<Worker>], avoid: Option<&Arc<Worker>>) -> Vec<usize> {
    (0..pool.len())
        .filter(|&i| pool[i].is_healthy())
        .filter(|&i| avoid.is_none_or(|a| !Arc::ptr_eq(a, &pool[i])) || pool.len() == 1)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::Ordering;

    fn pool(n: usize) -> Vec<Arc<Worker>> {
        (0..n)
            .map(|i| Worker::new(&format!("http://w{i}")))
            .collect()
    }

    #[test]
    fn unhealthy_and_avoided_workers_are_skipped_unless_alone() {
        let p = pool(3);
        p[1].healthy.store(false, Ordering::Relaxed);
        assert_eq!(candidates(&p, None), vec![0, 2]);
        assert_eq!(candidates(&p, Some(&p[0])), vec![2]);
        let one = pool(1);
        assert_eq!(candidates(&one, Some(&one[0])), vec![0]);
    }

    #[test]
    fn round_robin_cycles_and_least_load_prefers_the_idle() {
        let p = pool(3);
        let rr = RoundRobin::default();
        let picks: Vec<String> = (0..3)
            .map(|_| rr.pick(&p, None, None).unwrap().url.clone())
            .collect();
        assert_eq!(picks, ["http://w0", "http://w1", "http://w2"]);
        // Another pool has its own turn: picking in one does not skip workers of the other
        // (under PD each request picks in both).
        let q = pool(2);
        let pairs: Vec<(String, String)> = (0..4)
            .map(|_| {
                let a = rr.pick(&q, None, None).unwrap().url.clone();
                let b = rr.pick(&p, None, None).unwrap().url.clone();
                (a, b)
            })
            .collect();
        let firsts: Vec<&str> = pairs.iter().map(|x| x.0.as_str()).collect();
        assert_eq!(firsts, ["http://w0", "http://w1", "http://w0", "http://w1"]);
        let seconds: Vec<&str> = pairs.iter().map(|x| x.1.as_str()).collect();
        assert_eq!(
            seconds,
            ["http://w0", "http://w1", "http://w2", "http://w0"]
        );
        p[0].in_flight.store(2, Ordering::Relaxed);
        p[2].in_flight.store(1, Ordering::Relaxed);
        assert_eq!(LeastLoad.pick(&p, None, None).unwrap().url, "http://w1");
        for w in &p {
            w.healthy.store(false, Ordering::Relaxed);
        }
        assert!(LeastLoad.pick(&p, None, None).is_none());
        assert!(rr.pick(&p, None, None).is_none());
    }
}
