//! Which decode worker stores which `/v1/responses` response (`crate::responses`).

use std::collections::{HashMap, VecDeque};

/// Most response ids whose worker the router remembers (the oldest are forgotten first; a
/// forgotten id's request goes to any worker, which answers 400 if it does not hold it).
pub const MAX_OWNERS: usize = 100_000;

/// Which worker stores which response.
#[derive(Default)]
pub struct Owners {
    map: HashMap<String, String>,
    order: VecDeque<String>,
}

impl Owners {
    pub fn record(&mut self, id: String, worker: &str) {
        if self.map.insert(id.clone(), worker.to_string()).is_none() {
            self.order.push_back(id);
        }
        while self.map.len() > MAX_OWNERS {
            let Some(old) = self.order.pop_front() else {
                break;
            };
            self.map.remove(&old);
        }
    }

    /// The worker storing response `id`, if remembered.
    pub fn get(&self, id: &str) -> Option<String> {
        self.map.get(id).cloned()
    }
}
