//! `strata plan --advise-from URL`: the host cache size per rank a live deployment needs, read
//! from a worker's or a router's `GET /cache/curve` (the live miss-ratio curve), and under PD
//! how a total (`--pd-total 300GB`) is best split between the prefill and the decode servers,
//! with every figure it used.
//!
//! The host tier's points (0.25× … 8× today's size) are read between points along log size
//! (below the smallest: towards 0 at 0 bytes; past the largest: its value, which never
//! overstates). The target is a fraction of the unbounded hit ratio (a cache that never
//! evicts), as `strata sim --advise --target` takes it.

use std::time::Duration;

use anyhow::{bail, Context, Result};
use strata_kv::units::{format_bytes, parse_size};
use strata_protocol::{CurveReport, FleetCurve};

/// Largest answer read from the URL.
const MAX_BYTES: usize = 1 << 20;

/// The flags of the mode.
pub struct AdviseFrom<'a> {
    pub url: &'a str,
    pub target: f64,
    pub pd_total: Option<&'a str>,
}

pub fn run(a: &AdviseFrom) -> Result<()> {
    if !(a.target > 0.0 && a.target <= 1.0) {
        let t = strata_kv::units::shown_number(a.target);
        bail!("--target {t}: a fraction in (0, 1]");
    }
    let total = a
        .pd_total
        .map(|t| parse_size(t).with_context(|| format!("--pd-total `{t}`")))
        .transpose()?;
    let body = fetch(a.url)?;
    let curves = curves_of(&body).with_context(|| format!("{}/cache/curve", a.url))?;
    for c in &curves {
        role(c, a.target);
    }
    if let Some(total) = total {
        let of = |r: &str| curves.iter().find(|c| c.role == r);
        match (of("prefill"), of("decode")) {
            (Some(p), Some(d)) => split(p, d, total, a.pd_total.unwrap_or("")),
            _ => bail!(
                "--pd-total: {} has no prefill and decode curves (give a router over both)",
                a.url
            ),
        }
    }
    Ok(())
}

/// `GET URL/cache/curve`, within [`MAX_BYTES`] and ten seconds.
fn fetch(url: &str) -> Result<Vec<u8>> {
    let url = url.trim_end_matches('/');
    if !(url.starts_with("http://") || url.starts_with("https://")) {
        bail!(
            "--advise-from `{}`: expected http://HOST:PORT (a worker or a router)",
            strata_kv::units::shown_url(url)
        );
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        let client = reqwest::Client::builder()
            .timeout(Duration::from_secs(10))
            .build()?;
        let mut r = client
            .get(format!("{url}/cache/curve"))
            .send()
            .await
            .with_context(|| format!("--advise-from {url}: no answer"))?;
        if !r.status().is_success() {
            let status = r.status();
            let text = r.text().await.unwrap_or_default();
            bail!(
                "{url}/cache/curve: {status}: {}",
                text.chars().take(300).collect::<String>()
            );
        }
        let mut body = Vec::new();
        while let Some(chunk) = r.chunk().await? {
            if body.len() + chunk.len() > MAX_BYTES {
                bail!("{url}/cache/curve: an answer over {MAX_BYTES} bytes");
            }
            body.extend_from_slice(&chunk);
        }
        Ok(body)
    })
}

/// A router's fleet curves per role, or one worker's curve; each checked.
pub fn curves_of(body: &[u8]) -> Result<Vec<CurveReport>> {
    let v: serde_json::Value = serde_json::from_slice(body).context("not JSON")?;
    let curves = if v.get("roles").is_some() {
        serde_json::from_value::<FleetCurve>(v)
            .context("not a fleet curve")?
            .roles
    } else {
        vec![serde_json::from_value::<CurveReport>(v).context("not a curve")?]
    };
    for c in &curves {
        strata_router::curve::check(c).map_err(|e| anyhow::anyhow!("a curve refused: {e}"))?;
    }
    if curves.is_empty() {
        bail!("no worker answered with a curve");
    }
    Ok(curves)
}

/// The tier the advice reads: the host tier, or the device tier where a worker has no host
/// tier (a cache of N pages hits the same whichever tier holds them).
fn advised_tier(c: &CurveReport) -> &'static str {
    match c.points.iter().any(|p| p.tier == "host" && p.bytes > 0) {
        true => "host",
        false => "device",
    }
}

/// The advised tier's points: (bytes per rank, hit ratio), smallest first.
pub fn host_points(c: &CurveReport) -> Vec<(f64, f64)> {
    let ranks = c.ranks.max(1) as f64;
    let tier = advised_tier(c);
    let mut v: Vec<(f64, f64)> = c
        .points
        .iter()
        .filter(|p| p.tier == tier && p.bytes > 0)
        .map(|p| (p.bytes as f64 / ranks, p.hit_ratio))
        .collect();
    v.sort_by(|a, b| a.0.total_cmp(&b.0));
    v
}

/// The hit ratio at `bytes` per rank, between points along log size.
pub fn hit_at(points: &[(f64, f64)], bytes: f64) -> f64 {
    let Some(&(b0, h0)) = points.first() else {
        return 0.0;
    };
    if bytes <= b0 {
        return h0 * (bytes / b0).max(0.0);
    }
    for w in points.windows(2) {
        let ((a, ha), (b, hb)) = (w[0], w[1]);
        if bytes <= b {
            let t = (bytes / a).ln() / (b / a).ln().max(f64::MIN_POSITIVE);
            return ha + (hb - ha) * t.clamp(0.0, 1.0);
        }
    }
    points.last().map_or(0.0, |p| p.1)
}

/// The smallest bytes per rank whose hit ratio reaches `goal` (None: not within the points).
pub fn size_for(points: &[(f64, f64)], goal: f64) -> Option<f64> {
    let &(b0, h0) = points.first()?;
    if h0 >= goal {
        return Some(if h0 > 0.0 { b0 * goal / h0 } else { 0.0 });
    }
    points.windows(2).find_map(|w| {
        let ((a, ha), (b, hb)) = (w[0], w[1]);
        (hb >= goal && hb > ha).then(|| a * (b / a).powf((goal - ha) / (hb - ha)))
    })
}

/// One role's (or worker's) curve, its advice and its answer.
fn role(c: &CurveReport, target: f64) {
    let pts = host_points(c);
    let tier = advised_tier(c);
    if tier == "device" {
        println!(
            "{}: no host tier: the curve is read at multiples of the device tier (a host tier of that size hits as much)",
            c.role
        );
    }
    let today = c
        .points
        .iter()
        .find(|p| p.tier == tier && p.scale == 1.0)
        .map_or(0.0, |p| p.bytes as f64 / c.ranks.max(1) as f64);
    println!(
        "{}: {} prompt pages seen ({:.1}/s over the last 5 min, page {} tokens, {} rank{}, policy {}, sample rate {:.4}); host cache today {} per rank; unbounded hit ratio {:.2}%",
        c.role,
        c.references,
        c.prompt_tokens_per_second,
        c.page_size,
        c.ranks,
        if c.ranks == 1 { "" } else { "s" },
        c.policy,
        c.sample_rate,
        format_bytes(today as u64),
        c.unbounded_hit_ratio * 100.0
    );
    println!("| host per rank | hit % | Belady % |");
    println!("|---|---|---|");
    for p in c.points.iter().filter(|p| p.tier == tier) {
        println!(
            "| {} | {:.2} | {} |",
            format_bytes(p.bytes / c.ranks.max(1) as u64),
            p.hit_ratio * 100.0,
            p.belady.map_or("-".into(), |b| format!("{:.2}", b * 100.0))
        );
    }
    let goal = target * c.unbounded_hit_ratio;
    match (c.unbounded_hit_ratio > 0.0, size_for(&pts, goal)) {
        (false, _) => println!("advice: no reuse seen yet (no cache size gets a hit): none needed"),
        (true, Some(b)) => println!(
            "advice: --hicache-size {} per rank reaches {:.0}% of the unbounded hit ratio ({:.2}% of {:.2}%)",
            typed_gb(b),
            target * 100.0,
            goal * 100.0,
            c.unbounded_hit_ratio * 100.0
        ),
        (true, None) => println!(
            "advice: more than {} per rank (8× today's) to reach {:.0}% of the unbounded hit ratio ({:.2}%)",
            typed_gb(pts.last().map_or(0.0, |p| p.0)),
            target * 100.0,
            c.unbounded_hit_ratio * 100.0
        ),
    }
    if let Some(g) = c.gains.iter().find(|g| g.tier == "host") {
        println!(
            "answer: +{} per rank of host cache: {:+.2} points of hits, {:.0} prompt tokens/s not prefilled (last 5 min)",
            format_bytes(g.added_bytes / c.ranks.max(1) as u64),
            (g.hit_ratio_after - g.hit_ratio) * 100.0,
            g.saved_prompt_tokens_per_second
        );
    }
}

/// Splits `total` bytes (every rank of both roles) in tenths between the roles' host caches;
/// prints each split's hit ratios and tokens/s served from cache, and the best.
fn split(p: &CurveReport, d: &CurveReport, total: u64, typed: &str) {
    let (pp, dp) = (host_points(p), host_points(d));
    let tokens = |c: &CurveReport, h: f64| h * c.prompt_tokens_per_second * c.page_size as f64;
    println!(
        "PD split of {typed} ({total} bytes) over {} prefill and {} decode ranks: prefill hits are prompt tokens not computed, decode hits prompt tokens not transferred",
        p.ranks, d.ranks
    );
    println!("| prefill share | prefill per rank | decode per rank | prefill hit % | decode hit % | tokens/s from cache |");
    println!("|---|---|---|---|---|---|");
    let mut best = (0.0, 0);
    for tenth in 0..=10u64 {
        let to_p = total as f64 * tenth as f64 / 10.0;
        let (bp, bd) = (
            to_p / p.ranks.max(1) as f64,
            (total as f64 - to_p) / d.ranks.max(1) as f64,
        );
        let (hp, hd) = (hit_at(&pp, bp), hit_at(&dp, bd));
        let saved = tokens(p, hp) + tokens(d, hd);
        if saved > best.0 || tenth == 0 {
            best = (saved, tenth);
        }
        println!(
            "| {}% | {} | {} | {:.2} | {:.2} | {saved:.0} |",
            tenth * 10,
            format_bytes(bp as u64),
            format_bytes(bd as u64),
            hp * 100.0,
            hd * 100.0
        );
    }
    let to_p = total as f64 * best.1 as f64 / 10.0;
    println!(
        "split: {}% of {typed} to the prefill servers (--hicache-size {} per rank), {}% to the decode servers (--hicache-size {} per rank)",
        best.1 * 10,
        typed_gb(to_p / p.ranks.max(1) as f64),
        (10 - best.1) * 10,
        typed_gb((total as f64 - to_p) / d.ranks.max(1) as f64)
    );
}

/// A size in decimal GB as operators type it, rounded up to the hundredth (as `strata sim
/// --advise` says it).
fn typed_gb(bytes: f64) -> String {
    crate::sim::advice::typed_gb(bytes.max(0.0).ceil() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_are_read_between_points_along_log_size() {
        let pts = [(1e9, 0.1), (2e9, 0.3), (4e9, 0.4), (8e9, 0.4)];
        assert!((hit_at(&pts, 1e9) - 0.1).abs() < 1e-12);
        assert!((hit_at(&pts, 2f64.sqrt() * 1e9) - 0.2).abs() < 1e-9);
        assert!((hit_at(&pts, 5e8) - 0.05).abs() < 1e-12);
        assert_eq!(hit_at(&pts, 1e12), 0.4);
        let s = size_for(&pts, 0.2).unwrap();
        assert!((s - 2f64.sqrt() * 1e9).abs() < 1.0, "{s}");
        assert_eq!(size_for(&pts, 0.5), None);
        assert!((size_for(&pts, 0.05).unwrap() - 5e8).abs() < 1.0);
        assert_eq!(typed_gb(37_500_000_000.0), "37.50GB");
    }
}
