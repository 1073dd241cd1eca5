//! The cache's live miss-ratio curve: every served prompt's whole pages, once, into a SHARDS
//! sampler ([`crate::mrc::Shards`]), read at multiples of each tier's pages.
//!
//! The pages are named by a chain hash under a namespace of this process's own random key (not
//! the deployment's page hashes, which other processes know), so the sampler's choice of pages
//! depends on nothing a client can see. The engine observes each request's prompt once
//! ([`TieredCache::observe`]): when it is admitted, when its K/V arrive whole from a prefill
//! worker, or (PD with decode-side reuse) once it is known not to be handed back, so a
//! request handed back and submitted again with its K/V counts once.
//!
//! The LRU curve comes from the sampler's reuse distances over all traffic seen. Belady's MIN,
//! and the curve of a policy other than LRU, come from miniature simulations over the
//! sampler's recent window ([`crate::mrc::mini`]), run on a thread of their own so that the
//! request path never waits for them, one at a time, each after a pause of 50 times the last
//! one's run (0.5 s to 30 s): about 2 % of a core while runs are under 0.6 s.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::TrySendError;
use std::sync::mpsc::{sync_channel, SyncSender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::TieredCache;
use crate::hash::{HashNamespace, PageHash};
use crate::layout::Class;
use crate::mrc::{mini, Shards};
use crate::policy::EvictionPolicy;

/// Multiples of a tier's pages the curve is read at.
pub const CURVE_SCALES: [f64; 6] = [0.25, 0.5, 1.0, 2.0, 4.0, 8.0];

/// Bounds on the pause between two window simulations: 50 × the last one's time, within.
const PAUSE: (Duration, Duration) = (Duration::from_millis(500), Duration::from_secs(30));

/// The span the prompt page rate is measured over, and how often it is sampled.
const RATE_SPAN: Duration = Duration::from_secs(300);
const RATE_EVERY: Duration = Duration::from_secs(5);

/// The sampler, the namespace its pages are named in, and the window's simulations.
pub(super) struct CurveState {
    shards: Shards,
    ns: HashNamespace,
    policy: EvictionPolicy,
    sims: Sims,
    /// Bytes the answer adds to each tier.
    step_bytes: u64,
    /// (when, prompt pages then: [`Shards::denominator`]), every [`RATE_EVERY`] over the last
    /// [`RATE_SPAN`].
    seen: VecDeque<(Instant, f64)>,
    /// Samples taken into `seen` (the rate moved when this did).
    samples: u64,
}

/// The window's simulations: a thread taking one job at a time, and its last result.
struct Sims {
    tx: SyncSender<Job>,
    /// A job is running (set when one is handed over, cleared when it is done).
    busy: Arc<AtomicBool>,
    /// The thread is gone: no more jobs.
    dead: bool,
    last: Arc<Mutex<Option<Window>>>,
    /// When the last job was sent, the window's position then, and the pause before the next.
    sent: Option<(Instant, u64)>,
    pause: Arc<Mutex<Duration>>,
}

struct Job {
    refs: Vec<u64>,
    /// Whole prompt pages' share of the prompt ([`Shards::page_share`]).
    share: f64,
    wrapped: bool,
    rate: f64,
    /// Cache sizes in pages of the whole stream.
    sizes: Vec<f64>,
    policy: EvictionPolicy,
}

/// What the miniature simulations found over the window, at each of `sizes`.
#[derive(Clone, Debug, PartialEq)]
struct Window {
    sizes: Vec<f64>,
    /// Reuses counted: the hit ratio of a cache that never evicts.
    unbounded: f64,
    belady: Vec<f64>,
    policy: Vec<f64>,
    references: u64,
    /// Results so far (the curve's version moves with it).
    generation: u64,
}

impl CurveState {
    /// The curve of [`super::CacheConfig::curve_pages`] pages (0: none).
    pub(super) fn of(
        pages: usize,
        policy: EvictionPolicy,
        step_bytes: u64,
    ) -> Result<Option<CurveState>, super::CacheError> {
        (pages > 0)
            .then(|| CurveState::new(pages, policy, step_bytes))
            .transpose()
    }

    /// A sampler tracking at most `max_pages` pages, under a fresh random key.
    fn new(
        max_pages: usize,
        policy: EvictionPolicy,
        step_bytes: u64,
    ) -> Result<CurveState, super::CacheError> {
        let random = |e: getrandom::Error| super::CacheError::Random(e.to_string());
        let mut key = [0u8; 32];
        getrandom::fill(&mut key).map_err(random)?;
        // A rendezvous: a job is handed over only to an idle thread.
        let (tx, rx) = sync_channel::<Job>(0);
        let busy = Arc::new(AtomicBool::new(false));
        let running = busy.clone();
        let last: Arc<Mutex<Option<Window>>> = Arc::new(Mutex::new(None));
        let pause = Arc::new(Mutex::new(PAUSE.0));
        let (out, wait) = (last.clone(), pause.clone());
        std::thread::Builder::new()
            .name("strata-curve".into())
            .spawn(move || {
                // Ends when the cache (the sender) is dropped.
                while let Ok(job) = rx.recv() {
                    let t = Instant::now();
                    let mut w = simulate(&job);
                    let mut slot = out.lock().expect("curve lock");
                    w.generation = slot.as_ref().map_or(1, |p| p.generation + 1);
                    *slot = Some(w);
                    *wait.lock().expect("curve lock") = (t.elapsed() * 50).clamp(PAUSE.0, PAUSE.1);
                    running.store(false, Ordering::Release);
                }
            })
            .map_err(|e| super::CacheError::Thread(e.to_string()))?;
        Ok(CurveState {
            shards: Shards::with_random_key(max_pages, 1.0).map_err(random)?,
            ns: HashNamespace::from_key(key),
            policy,
            sims: Sims {
                tx,
                busy,
                dead: false,
                last,
                sent: None,
                pause,
            },
            step_bytes,
            seen: VecDeque::from([(Instant::now(), 0.0)]),
            samples: 0,
        })
    }

    /// Prompt tokens observed per second over the last [`RATE_SPAN`] (since the start when
    /// younger), pages of `page_size`.
    fn tokens_per_second(&self, page_size: usize) -> f64 {
        let (t0, r0) = *self.seen.front().expect("one sample at least");
        let secs = t0.elapsed().as_secs_f64();
        match secs > 0.0 {
            true => (self.shards.denominator() - r0).max(0.0) / secs * page_size as f64,
            false => 0.0,
        }
    }

    /// Samples the reference count for the rate, and forgets samples past the span.
    fn note_rate(&mut self) {
        let now = Instant::now();
        if self.seen.back().is_none_or(|&(t, _)| now - t >= RATE_EVERY) {
            self.seen.push_back((now, self.shards.denominator()));
            self.samples += 1;
        }
        while self.seen.len() > 1 && now - self.seen[1].0 >= RATE_SPAN {
            self.seen.pop_front();
        }
    }
}

/// Runs one job: Belady and the policy at each size, over the window (its second half counted
/// when older references have left it, the first warming the caches), in prompt tokens.
fn simulate(job: &Job) -> Window {
    let keys: Vec<u64> = job.refs.iter().map(|r| r & !1).collect();
    let (ids, n) = mini::dense(&keys);
    let from = if job.wrapped { ids.len() / 2 } else { 0 };
    let counted: Vec<bool> = (job.refs.iter().enumerate())
        .map(|(i, r)| i >= from && r & 1 == 1)
        .collect();
    let refs = counted.iter().filter(|&&c| c).count() as u64;
    // Ratios of prompt tokens: the counted pages' share of them.
    let per = job.share / refs.max(1) as f64;
    let all = mini::reuses(&ids, n, &counted);
    let (mut belady, mut policy) = (Vec::new(), Vec::new());
    for &size in &job.sizes {
        let cap = (size * job.rate).round();
        let cap = if cap.is_finite() { cap as usize } else { 0 };
        let (b, p) = if cap >= n {
            (all, all)
        } else {
            (
                mini::belady(&ids, n, cap, &counted),
                mini::policy(job.policy, &ids, n, cap, &counted),
            )
        };
        belady.push(b as f64 * per);
        policy.push(p as f64 * per);
    }
    Window {
        sizes: job.sizes.clone(),
        unbounded: all as f64 * per,
        belady,
        policy,
        references: refs,
        generation: 0,
    }
}

/// One point of the curve: the hit ratio of whole prompt pages a cache of `pages` pages
/// (`scale` × the tier's, `bytes` with their window state) would have had.
#[derive(Clone, Debug, PartialEq)]
pub struct CurvePoint {
    /// `device`, `host`, or the L3 tier's own name (`disk`, `remote`, `disk+remote`).
    pub tier: &'static str,
    pub scale: f64,
    pub pages: u64,
    /// What the pages cost in the tier: main pages, and window pages in the tier's proportion
    /// of window to main pages (the plan sizes it by the residency rule).
    pub bytes: u64,
    /// Under the worker's policy: LRU over all traffic seen (reuse distances), another policy
    /// over the recent window (a miniature simulation).
    pub hit_ratio: f64,
    /// Belady's MIN over the recent window (None until the first simulation).
    pub belady: Option<f64>,
}

/// The answer: what [`super::CacheConfig::curve_step_bytes`] more in one tier would have
/// bought over the last five minutes, as if that tier were the last (its hits counted whether
/// or not a tier below would have served them).
#[derive(Clone, Debug, PartialEq)]
pub struct Gain {
    pub tier: &'static str,
    pub added_bytes: u64,
    /// The hit ratio at today's size, and with the bytes added.
    pub hit_ratio: f64,
    pub hit_ratio_after: f64,
    /// Prompt tokens per second the added bytes would have served from the cache instead of
    /// computing them (the hit ratio's gain × the prompt tokens per second).
    pub saved_prompt_tokens_per_second: f64,
}

/// The curve and what its sampler holds.
#[derive(Clone, Debug, PartialEq)]
pub struct Curve {
    /// The eviction policy the hit ratios are for.
    pub policy: &'static str,
    /// The sampling rate now (it falls as the working set outgrows the budget).
    pub rate: f64,
    pub tracked_pages: usize,
    pub memory_bytes: usize,
    /// Prompt pages observed.
    pub references: u64,
    /// Sampled references the window's simulations counted.
    pub window_references: u64,
    /// Prompt tokens observed per second over the last five minutes.
    pub prompt_tokens_per_second: f64,
    /// The hit ratio of a cache that never evicts (every reuse hits): the curve's ceiling.
    pub unbounded_hit_ratio: f64,
    /// Moves whenever the curve would read differently ([`TieredCache::curve_tick`]).
    pub version: u64,
    pub points: Vec<CurvePoint>,
    /// One per tier whose points are known.
    pub gains: Vec<Gain>,
}

impl TieredCache {
    /// Counts one request's prompt into the curve (nothing without one): call it once per
    /// request the worker serves. Its whole pages are references; the tokens after them are a
    /// miss at every size. So the curve's hit ratios are of prompt tokens, as
    /// `strata_cache_hit_tokens_total` counts them (which, for a page-aligned prompt found
    /// whole, counts its last token as computed: one token in a page less).
    pub fn observe(&mut self, prompt: &[u32]) {
        let ps = self.page_size();
        let Some(c) = self.curve.as_mut() else {
            return;
        };
        let mut parent = PageHash::ROOT;
        for page in prompt.chunks_exact(ps) {
            parent = c.ns.page_hash(parent, page);
            c.shards.access(&parent);
        }
        c.shards.add_misses((prompt.len() % ps) as f64 / ps as f64);
    }

    /// A sequence of `tokens` (whole pages) joined the cache at a request's end, its prompt of
    /// `prompt_len` tokens: the pages after the prompt's whole pages (with its generated
    /// tokens) enter the curve's cache unasked.
    pub(super) fn observe_commit(&mut self, tokens: &[u32], prompt_len: usize) {
        let ps = self.page_size();
        let Some(c) = self.curve.as_mut() else {
            return;
        };
        let whole = prompt_len / ps;
        let mut parent = PageHash::ROOT;
        for (i, page) in tokens.chunks_exact(ps).enumerate() {
            parent = c.ns.page_hash(parent, page);
            if i >= whole {
                c.shards.touch(&parent);
            }
        }
    }

    /// Starts the window's simulations when they are due (new references, and the pause
    /// after the last one over), without waiting for them; returns the curve's version (None:
    /// no curve): a caller that keeps the last [`TieredCache::curve`] reads it again only when
    /// this moved.
    pub fn curve_tick(&mut self) -> Option<u64> {
        let c = self.curve.as_mut()?;
        c.note_rate();
        let recorded = c.shards.recorded();
        let pause = *c.sims.pause.lock().expect("curve lock");
        let idle = !c.sims.dead && !c.sims.busy.load(Ordering::Acquire);
        let due = idle
            && match c.sims.sent {
                None => recorded > 0,
                Some((at, seen)) => recorded > seen && at.elapsed() >= pause,
            };
        if due {
            // The tiers only when a job goes (an L3 store's statistics are not free).
            let sizes = sizes(&self.curve_tiers());
            let c = self.curve.as_mut().expect("checked above");
            let (refs, wrapped) = c.shards.recent();
            let job = Job {
                refs,
                share: c.shards.page_share(),
                wrapped,
                rate: c.shards.rate(),
                sizes,
                policy: c.policy,
            };
            c.sims.busy.store(true, Ordering::Release);
            match c.sims.tx.try_send(job) {
                Ok(()) => c.sims.sent = Some((Instant::now(), recorded)),
                // Not yet waiting for it: the next tick.
                Err(TrySendError::Full(_)) => c.sims.busy.store(false, Ordering::Release),
                Err(TrySendError::Disconnected(_)) => c.sims.dead = true,
            }
        }
        let c = self.curve.as_ref().expect("checked above");
        let generation = c
            .sims
            .last
            .lock()
            .expect("curve lock")
            .as_ref()
            .map_or(0, |w| w.generation);
        Some(c.shards.references() + generation + c.samples)
    }

    /// The tiers the curve is read for: name, main pages, bytes a main page costs with its
    /// share of window pages. L3 only with a known capacity; each tier counts the tiers above
    /// it in (a tier of N pages: a cache of N pages).
    fn curve_tiers(&self) -> Vec<(&'static str, u64, f64)> {
        let main = self.layout.class_bytes(Class::Main) as f64;
        let win = self.layout.class_bytes(Class::Window) as f64;
        let (dw, hw) = self.window_usage();
        let cost = |pages: u64, wpages: u64| match pages {
            0 => main + win,
            p => main + win * wpages as f64 / p as f64,
        };
        let (d, h) = (
            self.device_usage().pages_total,
            self.host_usage().pages_total,
        );
        let mut tiers = vec![
            ("device", d, cost(d, dw.pages_total)),
            ("host", h, cost(h, hw.pages_total)),
        ];
        if let Some(st) = self.storage() {
            let cap = st.stats().capacity_bytes;
            let per = cost(h, hw.pages_total).max(1.0);
            if cap > 0 && cap < u64::MAX {
                tiers.push((st.tier(), (cap as f64 / per) as u64, per));
            }
        }
        tiers
    }

    /// The curve at [`CURVE_SCALES`] of the device, host and (with a known capacity) L3
    /// tiers' pages; None when the cache keeps none ([`super::CacheConfig::curve_pages`] 0).
    /// Under a policy other than LRU, points come once the window was simulated.
    pub fn curve(&self) -> Option<Curve> {
        let tiers = self.curve_tiers();
        let c = self.curve.as_ref()?;
        let sizes = sizes(&tiers);
        let window = c.sims.last.lock().expect("curve lock").clone();
        let generation = window.as_ref().map_or(0, |w| w.generation);
        // Another tier's size since (an L3 store's capacity): not these points'.
        let window = window.filter(|w| w.sizes == sizes);
        let ratios = match (c.policy, &window) {
            (EvictionPolicy::Lru, _) => c.shards.hit_ratios(&sizes),
            (_, Some(w)) => w.policy.clone(),
            (_, None) => Vec::new(),
        };
        let points: Vec<CurvePoint> = tiers
            .iter()
            .flat_map(|&(tier, pages, cost)| CURVE_SCALES.map(move |s| (tier, s, pages, cost)))
            .zip(ratios)
            .enumerate()
            .map(|(i, ((tier, scale, pages, cost), hit_ratio))| CurvePoint {
                tier,
                scale,
                pages: (scale * pages as f64) as u64,
                bytes: (scale * pages as f64 * cost) as u64,
                hit_ratio,
                belady: window.as_ref().map(|w| w.belady[i]),
            })
            .collect();
        Some(Curve {
            policy: c.policy.name(),
            rate: c.shards.rate(),
            tracked_pages: c.shards.tracked(),
            memory_bytes: c.shards.memory_bytes(),
            references: c.shards.references(),
            window_references: window.as_ref().map_or(0, |w| w.references),
            prompt_tokens_per_second: c.tokens_per_second(self.page_size()),
            unbounded_hit_ratio: match (c.policy, &window) {
                (EvictionPolicy::Lru, _) => c.shards.hit_ratio(f64::INFINITY),
                (_, Some(w)) => w.unbounded,
                (_, None) => 0.0,
            },
            version: c.shards.references() + generation + c.samples,
            gains: gains(c, &tiers, &points, self.page_size()),
            points,
        })
    }
}

/// [`Gain`] of each tier whose points are known: LRU read from the sampler at the size, other
/// policies between their points (past the largest: its value).
fn gains(
    c: &CurveState,
    tiers: &[(&'static str, u64, f64)],
    points: &[CurvePoint],
    page_size: usize,
) -> Vec<Gain> {
    let per_second = c.tokens_per_second(page_size);
    tiers
        .iter()
        .filter(|&&(tier, ..)| points.iter().any(|p| p.tier == tier))
        .map(|&(tier, pages, cost)| {
            let (now, after) = (
                pages as f64,
                pages as f64 + c.step_bytes as f64 / cost.max(1.0),
            );
            let [hit_ratio, hit_ratio_after] = match c.policy {
                EvictionPolicy::Lru => {
                    let h = c.shards.hit_ratios(&[now, after]);
                    [h[0], h[1]]
                }
                _ => {
                    let of = points.iter().filter(|p| p.tier == tier);
                    let xy: Vec<(f64, f64)> = of.map(|p| (p.pages as f64, p.hit_ratio)).collect();
                    [between(&xy, now), between(&xy, after)]
                }
            };
            Gain {
                tier,
                added_bytes: c.step_bytes,
                hit_ratio,
                hit_ratio_after,
                saved_prompt_tokens_per_second: (hit_ratio_after - hit_ratio).max(0.0) * per_second,
            }
        })
        .collect()
}

/// `xy` (ascending x) read at `x` by straight lines; before the first point its value times
/// the fraction of its x, past the last the last value.
fn between(xy: &[(f64, f64)], x: f64) -> f64 {
    let Some(&(x0, y0)) = xy.first() else {
        return 0.0;
    };
    if x <= x0 {
        return if x0 > 0.0 { y0 * (x / x0).max(0.0) } else { y0 };
    }
    for w in xy.windows(2) {
        let ((a, ya), (b, yb)) = (w[0], w[1]);
        if x <= b {
            return if b > a {
                ya + (yb - ya) * (x - a) / (b - a)
            } else {
                yb
            };
        }
    }
    xy.last().map_or(0.0, |p| p.1)
}

/// Cache sizes (pages) of the curve's points, tier by tier.
fn sizes(tiers: &[(&'static str, u64, f64)]) -> Vec<f64> {
    tiers
        .iter()
        .flat_map(|&(_, pages, _)| CURVE_SCALES.map(|s| s * pages as f64))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::CacheConfig;
    use crate::layout::{PageLayout, PoolKind};
    use crate::memory::HeapAllocator;

    fn cache(policy: EvictionPolicy, layout: PageLayout, dev: u32, host: u32) -> TieredCache {
        let mut cfg = CacheConfig::new(layout, dev, host);
        cfg.with_data = false;
        cfg.eviction = policy;
        cfg.curve_pages = 4096;
        cfg.curve_step_bytes = 64 * 4 * 16;
        if cfg.layout.has_window() {
            cfg.device_window_pages = dev / 4;
            cfg.host_window_pages = host / 4;
        }
        TieredCache::new(cfg, &HeapAllocator, None).unwrap()
    }

    /// Prompts of 8 pages of 4 tokens: a few shared documents among one-off ones.
    fn traffic(c: &mut TieredCache, n: u32) {
        for i in 0..n {
            let doc = if i % 3 == 0 { i % 7 } else { 1000 + i };
            let p: Vec<u32> = (0..32).map(|j| doc * 64 + j).collect();
            c.observe(&p);
        }
    }

    /// Ticks until the window's simulations counted `refs` references.
    fn settled(c: &mut TieredCache, refs: u64) -> Curve {
        for _ in 0..2000 {
            c.curve_tick();
            let k = c.curve().unwrap();
            if k.window_references == refs {
                return k;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        panic!("the window's simulations never counted {refs} references");
    }

    fn kv() -> PageLayout {
        PageLayout::new(4, vec![PoolKind::kv("kv", 1, 1, 8, 2)]).unwrap()
    }

    #[test]
    fn belady_bounds_every_policy_and_more_bytes_never_hurt() {
        for policy in EvictionPolicy::ALL {
            let mut c = cache(policy, kv(), 16, 64);
            traffic(&mut c, 300);
            let k = settled(&mut c, 300 * 8);
            assert_eq!(k.policy, policy.name());
            assert_eq!(k.points.len(), 12, "{k:?}");
            for p in &k.points {
                let b = p.belady.expect("simulated");
                // LRU's own curve interpolates its distance buckets: near, not at, MIN.
                assert!(p.hit_ratio <= b + 0.02, "{}: {p:?}", policy.name());
                assert!((0.0..=1.0).contains(&p.hit_ratio), "{p:?}");
            }
            for t in ["device", "host"] {
                let h: Vec<f64> = k
                    .points
                    .iter()
                    .filter(|p| p.tier == t)
                    .map(|p| p.belady.unwrap())
                    .collect();
                assert!(h.windows(2).all(|w| w[0] <= w[1]), "{t}: {h:?}");
            }
            assert_eq!(k.gains.len(), 2);
            for g in &k.gains {
                assert!(g.hit_ratio_after >= g.hit_ratio, "{g:?}");
                assert!(g.saved_prompt_tokens_per_second.is_finite(), "{g:?}");
                assert!(g.saved_prompt_tokens_per_second >= 0.0, "{g:?}");
            }
            assert!(k.prompt_tokens_per_second > 0.0);
        }
    }

    /// Replays prompts through a cache of `dev` device pages (no host tier) as the engine does
    /// (admit, observe, commit); the cache's own hit rate and its curve.
    fn replay(dev: u32, prompts: &[Vec<u32>]) -> (f64, Curve) {
        let mut c = cache(EvictionPolicy::Lru, kv(), dev, 0);
        for p in prompts {
            let wait = crate::policy::PrefetchPolicy::WaitComplete;
            let mut l = c
                .admit(p, 1, true, wait)
                .or_else(|| c.admit(p, 1, false, wait))
                .unwrap();
            while !c.advance(&mut l) {
                c.poll();
            }
            c.observe(p);
            c.commit(l, p, p.len());
        }
        (c.stats().hit_rate(), c.curve().unwrap())
    }

    #[test]
    fn the_curve_at_the_cache_s_own_size_is_its_hit_rate() {
        // 40 documents of 8–20 pages, asked with Zipf-like popularity, each with a short
        // question of its own (1–9 tokens).
        let mut x = 7u64;
        let mut next = |m: u64| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (x >> 33) % m
        };
        let prompts: Vec<Vec<u32>> = (0..800)
            .map(|i| {
                let doc = (next(40) * next(40) / 40) as u32;
                let len = 4 * (8 + (doc as usize * 7) % 13);
                let mut p: Vec<u32> = (0..len as u32).map(|j| doc * 1000 + j).collect();
                p.extend((0..1 + next(9) as u32).map(|j| 900_000 + i * 16 + j));
                p
            })
            .collect();
        for dev in [32u32, 96, 400] {
            let (rate, k) = replay(dev, &prompts);
            let at = |s: f64| {
                k.points
                    .iter()
                    .find(|p| p.tier == "device" && p.scale == s)
                    .unwrap()
                    .hit_ratio
            };
            assert!(
                (at(1.0) - rate).abs() < 0.03,
                "{dev} pages: curve {} cache {rate}",
                at(1.0)
            );
            if dev == 96 {
                let (big, _) = replay(4 * dev, &prompts);
                assert!(
                    (at(4.0) - big).abs() < 0.03,
                    "4x: curve {} cache {big}",
                    at(4.0)
                );
            }
        }
    }

    #[test]
    fn a_window_kind_counts_its_share_of_window_pages_in_the_bytes() {
        let layout = PageLayout::new(
            4,
            vec![
                PoolKind::kv("kv", 1, 1, 8, 2),
                PoolKind::kv("swa", 1, 1, 8, 2).with_window(8),
            ],
        )
        .unwrap();
        let c = cache(EvictionPolicy::Lru, layout, 16, 64);
        let k = c.curve().unwrap();
        // A main page 2 planes × 16 bytes × 4 tokens = 128 bytes, a window page as much, one
        // window page for four main pages.
        let one = |t: &str| {
            k.points
                .iter()
                .find(|p| p.tier == t && p.scale == 1.0)
                .unwrap()
                .clone()
        };
        assert_eq!(one("device").bytes, 16 * 128 + 4 * 128);
        assert_eq!(one("host").bytes, 64 * 128 + 16 * 128);
        assert_eq!(one("host").pages, 64);
    }
}
