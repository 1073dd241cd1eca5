//! The healthy worker with the fewest requests in flight.

use std::sync::Arc;

use super::{candidates, LoadBalancingPolicy};
use crate::worker::Worker;

/// Each request to the least loaded healthy worker (the first of equals).
pub struct LeastLoad;

impl LoadBalancingPolicy for LeastLoad {
    fn name(&self) -> &'static str {
        "least_load"
    }

    fn pick(
        &self,
        pool: &[Arc<Worker>],
        _prompt: Option<&[u8]>,
        avoid: Option<&Arc<Worker>>,
    ) -> Option<Arc<Worker>> {
        let i = candidates(pool, avoid)
            .into_iter()
            .min_by_key(|&i| pool[i].load())?;
        Some(pool[i].clone())
    }
}
