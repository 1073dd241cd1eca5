//! Round robin over the healthy workers.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use super::{candidates, LoadBalancingPolicy};
use crate::worker::Worker;

/// Each request to the next healthy worker.
#[derive(Default)]
pub struct RoundRobin {
    next: AtomicUsize,
}

impl LoadBalancingPolicy for RoundRobin {
    fn name(&self) -> &'static str {
        "round_robin"
    }

    fn pick(
        &self,
        pool: &[Arc<Worker>],
        _prompt: Option<&[u8]>,
        avoid: Option<&Arc<Worker>>,
    ) -> Option<Arc<Worker>> {
        let up = candidates(pool, avoid);
        if up.is_empty() {
            return None;
        }
        let i = up[self.next.fetch_add(1, Ordering::Relaxed) % up.len()];
        Some(pool[i].clone())
    }
}
