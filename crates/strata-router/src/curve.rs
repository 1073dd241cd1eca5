//! `GET /cache/curve` on the router: each healthy worker's live miss-ratio curve, and per role
//! (prefill, decode; `both` when there are no prefill workers) the fleet's: every worker at the
//! same multiple of its own tiers, hit ratios weighted by the prompt pages each observed,
//! pages, bytes and saved tokens summed.
//!
//! A worker's answer is read within a size bound and checked (finite figures, ratios in
//! [0, 1], at most [`MAX_POINTS`] points): one that fails is left out, never trusted.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::Json;
use futures_util::future::join_all;
use strata_protocol::{CurveGain, CurvePointReport, CurveReport, FleetCurve, WorkerCurve};

use crate::state::RouterState;

/// Most points a worker's curve may have (3 tiers × 6 scales today).
pub const MAX_POINTS: usize = 64;
/// Largest worker answer read.
const MAX_BYTES: usize = 256 << 10;

/// The fleet's curves: one answer a second at most (later calls within it share it), each
/// worker read at once.
pub async fn curve(
    State(st): State<Arc<RouterState>>,
    uri: axum::http::Uri,
) -> Result<Json<FleetCurve>, strata_server::ApiError> {
    strata_server::error::query::<strata_server::error::NoQuery>(&uri)?;
    let mut last = st.curve.lock().await;
    if let Some((at, f)) = last.as_ref() {
        if at.elapsed() < Duration::from_secs(1) {
            return Ok(Json(f.clone()));
        }
    }
    let f = read_fleet(&st).await;
    *last = Some((Instant::now(), f.clone()));
    Ok(Json(f))
}

async fn read_fleet(st: &RouterState) -> FleetCurve {
    let decode_role = if st.prefill.is_empty() {
        "both"
    } else {
        "decode"
    };
    let mut workers = Vec::new();
    let mut roles = Vec::new();
    for (role, pool) in [("prefill", &st.prefill), (decode_role, &st.decode)] {
        let healthy: Vec<_> = pool.iter().filter(|w| w.is_healthy()).collect();
        let answers = join_all(healthy.iter().map(|w| fetch(&st.client, &w.url))).await;
        let mut of_role = Vec::new();
        for (w, a) in healthy.iter().zip(answers) {
            match a {
                Ok(c) => of_role.push(WorkerCurve {
                    url: w.url.clone(),
                    curve: c,
                }),
                Err(e) => tracing::debug!(worker = %w.url, error = %e, "no curve"),
            }
        }
        let curves: Vec<&CurveReport> = of_role.iter().map(|w| &w.curve).collect();
        if let Some(f) = fleet(role, &curves) {
            roles.push(f);
        }
        workers.extend(of_role);
    }
    FleetCurve { roles, workers }
}

async fn fetch(client: &reqwest::Client, url: &str) -> Result<CurveReport, String> {
    let mut r = client
        .get(format!("{url}/cache/curve"))
        .timeout(Duration::from_secs(5))
        .send()
        .await
        .map_err(|e| e.to_string())?
        .error_for_status()
        .map_err(|e| e.to_string())?;
    let mut body = Vec::new();
    while let Some(chunk) = r.chunk().await.map_err(|e| e.to_string())? {
        if body.len() + chunk.len() > MAX_BYTES {
            return Err(format!("a curve over {MAX_BYTES} bytes"));
        }
        body.extend_from_slice(&chunk);
    }
    let c: CurveReport = serde_json::from_slice(&body).map_err(|e| e.to_string())?;
    check(&c)?;
    Ok(c)
}

/// Most of any count a worker may report (pages, bytes, references): far above any real
/// one, far below where sums of 4,096 workers overflow.
const MAX_COUNT: u64 = 1 << 48;
/// Most tokens per second a worker may report.
const MAX_RATE: f64 = 1e12;

/// Refuses a curve the fleet could not use: non-finite, negative or absurd figures, ratios
/// outside [0, 1], too many points.
pub fn check(c: &CurveReport) -> Result<(), String> {
    let ratio = |x: f64| (0.0..=1.0).contains(&x);
    let rate = |x: f64| (0.0..=MAX_RATE).contains(&x);
    let count = |x: u64| x <= MAX_COUNT;
    if c.points.len() > MAX_POINTS || c.gains.len() > MAX_POINTS {
        return Err("too many points".into());
    }
    if !(1..=4096).contains(&c.ranks) || !(1..=1 << 20).contains(&c.page_size) {
        return Err(format!(
            "ranks {} or page size {} out of range",
            c.ranks, c.page_size
        ));
    }
    if !ratio(c.sample_rate) || !ratio(c.unbounded_hit_ratio) || !rate(c.prompt_tokens_per_second) {
        return Err("a rate out of range".into());
    }
    if ![
        c.references,
        c.window_references,
        c.tracked_pages,
        c.memory_bytes,
    ]
    .into_iter()
    .all(count)
    {
        return Err("a count out of range".into());
    }
    for p in &c.points {
        let fine = ratio(p.hit_ratio) && p.belady.is_none_or(ratio);
        if !fine || !(0.0..=1e6).contains(&p.scale) || !count(p.pages) || !count(p.bytes) {
            return Err(format!("a point out of range: {p:?}"));
        }
    }
    for g in &c.gains {
        let fine = ratio(g.hit_ratio) && ratio(g.hit_ratio_after);
        if !fine || !rate(g.saved_prompt_tokens_per_second) || !count(g.added_bytes) {
            return Err(format!("a gain out of range: {g:?}"));
        }
    }
    Ok(())
}

/// One count of every worker's, summed.
fn sum(curves: &[&CurveReport], f: impl Fn(&CurveReport) -> u64) -> u64 {
    curves.iter().map(|c| f(c)).sum()
}

/// The fleet's curve of `curves` (None without any): the points every worker has (by tier
/// and scale), hit ratios weighted by references (equal weights before any), the rest summed.
/// Only workers of the first one's page size and policy count (their points are alike).
pub fn fleet(role: &str, curves: &[&CurveReport]) -> Option<CurveReport> {
    let first = *curves.first()?;
    let alike = |c: &&CurveReport| c.page_size == first.page_size && c.policy == first.policy;
    let curves: Vec<&CurveReport> = curves.iter().copied().filter(alike).collect();
    let curves = &curves[..];
    let refs: f64 = curves.iter().map(|c| c.references as f64).sum();
    let weight = |c: &CurveReport| match refs > 0.0 {
        true => c.references as f64 / refs,
        false => 1.0 / curves.len() as f64,
    };
    let avg = |f: &dyn Fn(&CurveReport) -> Option<f64>| -> Option<f64> {
        curves
            .iter()
            .map(|c| f(c).map(|x| x * weight(c)))
            .sum::<Option<f64>>()
    };
    let point = |c: &CurveReport, tier: &str, scale: f64| {
        c.points
            .iter()
            .find(|p| p.tier == tier && p.scale == scale)
            .cloned()
    };
    let points = first
        .points
        .iter()
        .filter_map(|p0| {
            let all: Option<Vec<CurvePointReport>> = curves
                .iter()
                .map(|c| point(c, &p0.tier, p0.scale))
                .collect();
            let all = all?;
            let at = |c: &CurveReport| point(c, &p0.tier, p0.scale);
            Some(CurvePointReport {
                tier: p0.tier.clone(),
                scale: p0.scale,
                pages: all.iter().map(|p| p.pages).sum(),
                bytes: all.iter().map(|p| p.bytes).sum(),
                hit_ratio: avg(&|c| at(c).map(|p| p.hit_ratio))?.clamp(0.0, 1.0),
                belady: avg(&|c| at(c).and_then(|p| p.belady)).map(|b| b.clamp(0.0, 1.0)),
            })
        })
        .collect();
    let gain = |c: &CurveReport, tier: &str| c.gains.iter().find(|g| g.tier == tier).cloned();
    let gains = first
        .gains
        .iter()
        .filter_map(|g0| {
            let all: Vec<CurveGain> = curves
                .iter()
                .map(|c| gain(c, &g0.tier))
                .collect::<Option<_>>()?;
            Some(CurveGain {
                tier: g0.tier.clone(),
                added_bytes: all.iter().map(|g| g.added_bytes).sum(),
                hit_ratio: avg(&|c| gain(c, &g0.tier).map(|g| g.hit_ratio))?,
                hit_ratio_after: avg(&|c| gain(c, &g0.tier).map(|g| g.hit_ratio_after))?,
                saved_prompt_tokens_per_second: all
                    .iter()
                    .map(|g| g.saved_prompt_tokens_per_second)
                    .sum(),
            })
        })
        .collect();
    Some(CurveReport {
        role: role.to_string(),
        policy: first.policy.clone(),
        page_size: first.page_size,
        ranks: curves.iter().map(|c| c.ranks).sum(),
        sample_rate: avg(&|c| Some(c.sample_rate)).unwrap_or(0.0),
        references: sum(curves, |c| c.references),
        window_references: sum(curves, |c| c.window_references),
        tracked_pages: sum(curves, |c| c.tracked_pages),
        memory_bytes: sum(curves, |c| c.memory_bytes),
        prompt_tokens_per_second: curves.iter().map(|c| c.prompt_tokens_per_second).sum(),
        unbounded_hit_ratio: avg(&|c| Some(c.unbounded_hit_ratio)).unwrap_or(0.0),
        points,
        gains,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(refs: u64, h: f64, pps: f64) -> CurveReport {
        CurveReport {
            role: "decode".into(),
            policy: "lru".into(),
            page_size: 16,
            ranks: 1,
            sample_rate: 1.0,
            references: refs,
            window_references: refs,
            tracked_pages: refs,
            memory_bytes: 1 << 20,
            prompt_tokens_per_second: pps,
            unbounded_hit_ratio: h + 0.2,
            points: vec![CurvePointReport {
                tier: "host".into(),
                scale: 1.0,
                pages: 100,
                bytes: 1000,
                hit_ratio: h,
                belady: Some(h + 0.1),
            }],
            gains: vec![CurveGain {
                tier: "host".into(),
                added_bytes: 1 << 30,
                hit_ratio: h,
                hit_ratio_after: h + 0.05,
                saved_prompt_tokens_per_second: pps * 0.05 * 16.0,
            }],
        }
    }

    #[test]
    fn the_fleet_weighs_hit_ratios_by_traffic_and_sums_the_rest() {
        let (a, b) = (report(300, 0.2, 10.0), report(100, 0.6, 2.0));
        let f = fleet("decode", &[&a, &b]).unwrap();
        let p = &f.points[0];
        assert!((p.hit_ratio - 0.3).abs() < 1e-12, "{p:?}");
        assert!((p.belady.unwrap() - 0.4).abs() < 1e-12, "{p:?}");
        assert_eq!((p.pages, p.bytes), (200, 2000));
        let g = &f.gains[0];
        assert_eq!(g.added_bytes, 2 << 30);
        assert!((g.saved_prompt_tokens_per_second - 12.0 * 0.8).abs() < 1e-9);
        assert_eq!(f.references, 400);
        assert!(fleet("decode", &[]).is_none());
        // A worker of another page size does not join the first one's fleet.
        let mut other = report(1000, 0.9, 5.0);
        other.page_size = 32;
        assert_eq!(fleet("decode", &[&a, &b, &other]).unwrap(), f);
    }

    #[test]
    fn a_worker_curve_out_of_range_is_refused() {
        assert!(check(&report(1, 0.5, 1.0)).is_ok());
        let mut bad = report(1, 0.5, 1.0);
        bad.points[0].hit_ratio = f64::NAN;
        assert!(check(&bad).is_err());
        let mut bad = report(1, 0.5, 1.0);
        bad.points[0].belady = Some(1.5);
        assert!(check(&bad).is_err());
        let mut bad = report(1, 0.5, f64::INFINITY);
        bad.gains.clear();
        assert!(check(&bad).is_err());
        let mut bad = report(1, 0.5, 1.0);
        bad.points = vec![bad.points[0].clone(); MAX_POINTS + 1];
        assert!(check(&bad).is_err());
        for absurd in [
            |c: &mut CurveReport| c.references = u64::MAX,
            |c: &mut CurveReport| c.points[0].bytes = u64::MAX,
            |c: &mut CurveReport| c.gains[0].saved_prompt_tokens_per_second = 1e300,
            |c: &mut CurveReport| c.ranks = 0,
        ] {
            let mut bad = report(1, 0.5, 1.0);
            absurd(&mut bad);
            assert!(check(&bad).is_err(), "{bad:?}");
        }
    }
}
