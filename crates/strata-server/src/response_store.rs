//! The conversations `previous_response_id` continues: each stored response's messages (its
//! input and its answer, without its instructions), in memory, bounded in count, bytes and
//! age (`strata serve --response-store-{max,size,ttl}`). Past a bound the oldest go first; an id that is gone is a 400 naming the field (the
//! client sends the conversation again). Ids are random (96 bits), so one client cannot
//! reach another's conversation by guessing. A conversation is kept as its JSON text (parsed
//! again when it is continued), so the bytes counted are the bytes held: parsed, a message of
//! a few bytes of JSON takes hundreds (the bound let a 64 MiB store hold 1.3 GB).

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde_json::Value;

/// Most responses kept by default.
pub const MAX_ENTRIES: usize = 10_000;
/// Most bytes of kept conversations (their JSON) by default.
pub const MAX_BYTES: usize = 64 << 20;
/// How long a response is kept by default.
pub const TTL: Duration = Duration::from_secs(3600);

struct Kept {
    at: Instant,
    /// What the entry holds: its JSON, its id (twice: the map and the order) and the rest.
    bytes: usize,
    json: std::sync::Arc<str>,
}

/// Bytes an entry holds beside its JSON and its id: the map's slot, the order's, `Kept`.
const ENTRY: usize = 128;

#[derive(Default)]
struct Inner {
    map: HashMap<String, Kept>,
    order: VecDeque<String>,
    bytes: usize,
    /// Responses dropped before their time to stay within the bounds.
    evicted: u64,
}

/// The store (see the module notes).
pub struct ResponseStore {
    inner: Mutex<Inner>,
    max_entries: usize,
    max_bytes: usize,
    ttl: Duration,
}

impl Default for ResponseStore {
    fn default() -> Self {
        ResponseStore::new(MAX_ENTRIES, MAX_BYTES, TTL)
    }
}

impl ResponseStore {
    pub fn new(max_entries: usize, max_bytes: usize, ttl: Duration) -> ResponseStore {
        ResponseStore {
            inner: Mutex::new(Inner::default()),
            max_entries,
            max_bytes,
            ttl,
        }
    }

    /// The conversation kept under `id`, unless it expired.
    pub fn get(&self, id: &str) -> Option<Vec<Value>> {
        let mut g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let k = g.map.get(id)?;
        if k.at.elapsed() > self.ttl {
            let b = k.bytes;
            g.map.remove(id);
            g.bytes -= b;
            return None;
        }
        let json = k.json.clone();
        drop(g);
        // Written by `put` from values: it parses.
        serde_json::from_str(&json).ok()
    }

    /// Keeps `messages` under `id`; the oldest (and the expired) go past the bounds. A
    /// conversation larger than a quarter of the byte bound is not kept.
    pub fn put(&self, id: &str, messages: Vec<Value>) {
        let Ok(json) = serde_json::to_string(&messages) else {
            return;
        };
        drop(messages);
        let bytes = json.len() + 2 * id.len() + ENTRY;
        if bytes > self.max_bytes / 4 {
            return;
        }
        let mut g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let kept = Kept {
            at: Instant::now(),
            bytes,
            json: json.into(),
        };
        if let Some(old) = g.map.insert(id.to_string(), kept) {
            g.bytes -= old.bytes;
        } else {
            g.order.push_back(id.to_string());
        }
        g.bytes += bytes;
        // The oldest go first: expired ones, then any past the bounds.
        while let Some(oldest) = g.order.front().cloned() {
            let expired = g.map.get(&oldest).is_none_or(|k| k.at.elapsed() > self.ttl);
            let over = g.bytes > self.max_bytes || g.map.len() > self.max_entries;
            if !(expired || over) {
                break;
            }
            g.order.pop_front();
            if let Some(k) = g.map.remove(&oldest) {
                g.bytes -= k.bytes;
                g.evicted += u64::from(!expired);
            }
        }
        // Ids whose entries were read expired or were replaced leave the order list as it is
        // read.
        while g.order.len() > 2 * g.map.len() + 16 {
            let Some(id) = g.order.pop_front() else { break };
            if g.map.contains_key(&id) {
                g.order.push_back(id);
                break;
            }
        }
    }

    /// Drops the expired responses at the front (the oldest); the rest leave as they are read
    /// or reached.
    fn purge_expired(&self, g: &mut Inner) {
        while let Some(oldest) = g.order.front() {
            match g.map.get(oldest) {
                Some(k) if k.at.elapsed() <= self.ttl => break,
                Some(k) => g.bytes -= k.bytes,
                None => {}
            }
            let id = g.order.pop_front().expect("a front");
            g.map.remove(&id);
        }
    }

    /// Its gauges and counter, into `t` (after the expired at the front left).
    pub fn render(&self, t: &mut crate::metrics::Text) {
        let mut g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        self.purge_expired(&mut g);
        t.sample("strata_response_store_responses", &[], g.map.len() as f64);
        t.sample("strata_response_store_bytes", &[], g.bytes as f64);
        t.sample(
            "strata_response_store_evictions_total",
            &[],
            g.evicted as f64,
        );
    }

    /// Responses kept now, and their bytes.
    pub fn size(&self) -> (usize, usize) {
        let g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        (g.map.len(), g.bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_oldest_go_past_the_bounds_and_old_ones_expire() {
        let s = ResponseStore::new(3, 1 << 20, Duration::from_secs(3600));
        for i in 0..5 {
            s.put(
                &format!("r{i}"),
                vec![json!({"role": "user", "content": i})],
            );
        }
        assert_eq!(s.size().0, 3);
        assert_eq!(s.inner.lock().unwrap().evicted, 2);
        assert!(s.get("r0").is_none() && s.get("r1").is_none() && s.get("r4").is_some());
        let s = ResponseStore::new(100, 2000, Duration::from_secs(3600));
        s.put("big", vec![json!({"content": "x".repeat(600)})]);
        assert!(
            s.get("big").is_none(),
            "over a quarter of the bytes: not kept"
        );
        for i in 0..20 {
            s.put(&format!("r{i}"), vec![json!({"c": i})]);
        }
        assert!(s.size().1 <= 2000, "{:?}", s.size());
        assert!(s.size().0 > 5, "{:?}", s.size());
        let s = ResponseStore::new(10, 1 << 20, Duration::from_millis(1));
        s.put("a", vec![json!(1)]);
        std::thread::sleep(Duration::from_millis(5));
        assert!(s.get("a").is_none());
        assert_eq!(s.size(), (0, 0));
        // Expired ones nobody reads leave as others come (not counted as evictions).
        s.put("b", vec![json!(1)]);
        std::thread::sleep(Duration::from_millis(5));
        s.put("c", vec![json!(2)]);
        assert_eq!(s.size().0, 1);
        assert_eq!(s.inner.lock().unwrap().evicted, 0);
        // The gauges count only what has not expired.
        std::thread::sleep(Duration::from_millis(5));
        s.render(&mut crate::metrics::Text::new());
        assert_eq!(s.size(), (0, 0));
    }

    /// What is counted is what is held: the conversation's JSON text (1,200 empty messages
    /// are 28 bytes of JSON each; parsed, hundreds), its id and an entry's fixed part; it
    /// comes back as it went in.
    #[test]
    fn a_conversation_is_held_as_its_json() {
        let s = ResponseStore::default();
        let msgs = vec![json!({"role": "user", "content": ""}); 1200];
        let json = serde_json::to_string(&msgs).unwrap();
        s.put("resp_1", msgs.clone());
        assert_eq!(s.size(), (1, json.len() + 2 * "resp_1".len() + ENTRY));
        let g = s.inner.lock().unwrap();
        assert_eq!(&*g.map["resp_1"].json, json.as_str());
        drop(g);
        assert_eq!(s.get("resp_1").unwrap(), msgs);
    }
}
