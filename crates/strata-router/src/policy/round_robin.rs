//! Round robin over the healthy workers.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use super::{candidates, LoadBalancingPolicy};
use crate::worker::Worker;

/// Each request to the next healthy worker of the pool. Each pool (prefill, decode) has its
/// own turn: one shared counter, advanced twice per PD request, would pair the same workers
/// every time.
#[derive(Default)]
pub struct RoundRobin {
    /// Next turn by pool (the pool's address: pools live as long as the router).
    next: Mutex<HashMap<usize, usize>>,
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
        let turn = {
            let mut next = self.next.lock().unwrap_or_else(|p| p.into_inner());
            let t = next.entry(pool.as_ptr() as usize).or_default();
            *t = t.wrapping_add(1);
            *t - 1
        };
        Some(pool[up[turn % up.len()]].clone())
    }
}
