//! What `strata bench compare` reports: the per-run record, ratios against device only, the
//! plots (TTFT CDF, hit rate by tier over time, throughput against concurrency) and reading an
//! earlier results.json back for `--replot`.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use serde_json::Value;
use strata_bench::stats::Summary;
use strata_sim::plot::{Chart, Series};

use crate::bench::workload::TierCounts;

/// A configuration `strata bench compare` starts (`--configs`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Config {
    NoCache,
    Device,
    Host,
    Disk,
    Pd,
}

impl Config {
    pub fn parse(s: &str) -> Result<Config> {
        Ok(match s {
            "no-cache" => Config::NoCache,
            "device" => Config::Device,
            "host" => Config::Host,
            "disk" => Config::Disk,
            "pd" => Config::Pd,
            x => bail!("--configs: `{x}` is not one of no-cache, device, host, disk, pd"),
        })
    }
    pub fn name(self) -> &'static str {
        match self {
            Config::NoCache => "no-cache",
            Config::Device => "device",
            Config::Host => "host",
            Config::Disk => "disk",
            Config::Pd => "pd",
        }
    }
    pub fn describe(self) -> &'static str {
        match self {
            Config::NoCache => "one worker, --disable-prefix-cache",
            Config::Device => "one worker, device tier only",
            Config::Host => "one worker, device + host",
            Config::Disk => "one worker, device + host + L3 disk",
            Config::Pd => "router + prefill + decode workers, each device + host",
        }
    }
}

/// `c=N`, or `open` for an open-loop run (concurrency 0).
pub fn level(c: usize) -> String {
    if c == 0 {
        "open".into()
    } else {
        format!("c={c}")
    }
}

/// One configuration at one concurrency (0: open loop).
pub struct Record {
    pub cfg: Config,
    pub concurrency: usize,
    pub summary: Summary,
    pub tiers: TierCounts,
    /// Counters relative to the start of the run.
    pub samples: Vec<TierCounts>,
    pub ttft: Vec<f64>,
    pub outcomes: Value,
    pub wall: f64,
}

impl Record {
    pub fn label(&self) -> String {
        format!("{} {}", self.cfg.name(), level(self.concurrency))
    }
}

/// Fraction of prompt tokens served by each tier (%) per window of `bucket` seconds (a window
/// ends at the first sample at or past its end), skipping windows in which no prompt was
/// admitted. Points are at the window's end.
pub fn windowed_rates(samples: &[TierCounts], bucket: f64) -> Vec<(f64, [f64; 3])> {
    let mut out = Vec::new();
    let Some(mut start) = samples.first() else {
        return out;
    };
    for (i, s) in samples.iter().enumerate().skip(1) {
        if s.t - start.t + 1e-9 < bucket && i + 1 < samples.len() {
            continue;
        }
        let d = s.minus(start);
        let p = d.prompt();
        if p > 0.0 {
            out.push((
                s.t,
                [100.0 * d.device / p, 100.0 * d.host / p, 100.0 * d.l3 / p],
            ));
        }
        start = s;
    }
    out
}

/// (TTFT in ms, % of requests at or below it), one point per request.
pub fn cdf(ttft: &[f64]) -> Vec<(f64, f64)> {
    let mut v = ttft.to_vec();
    v.sort_by(f64::total_cmp);
    let n = v.len() as f64;
    v.iter()
        .enumerate()
        .map(|(i, t)| (t * 1e3, 100.0 * (i + 1) as f64 / n))
        .collect()
}

/// Writes the plots into `out_dir`: the TTFT CDF and hit rate by tier over time of the first
/// level's runs, and throughput against concurrency (closed loop only); the files written.
pub fn plots(
    out_dir: &Path,
    sample_interval: f64,
    levels: &[usize],
    recs: &[Record],
    title: &str,
) -> Result<Vec<PathBuf>> {
    let primary = levels[0];
    let first: Vec<&Record> = recs.iter().filter(|r| r.concurrency == primary).collect();
    let mut out = Vec::new();
    let p = out_dir.join("ttft_cdf.svg");
    std::fs::write(&p, cdf_chart(primary, &first, title).svg())?;
    out.push(p);
    for r in &first {
        let p = out_dir.join(format!("hit_rate_by_tier_{}.svg", r.cfg.name()));
        std::fs::write(&p, hit_rate_chart(r, sample_interval, title).svg())?;
        out.push(p);
    }
    if primary == 0 {
        return Ok(out);
    }
    let p = out_dir.join("throughput_vs_concurrency.svg");
    std::fs::write(&p, throughput_chart(levels, recs, title).svg())?;
    out.push(p);
    Ok(out)
}

/// TTFT CDF, one series per configuration, of the runs at one level.
fn cdf_chart(primary: usize, first: &[&Record], title: &str) -> Chart {
    Chart {
        title: format!("TTFT CDF by configuration, {}", level(primary)),
        subtitle: title.to_string(),
        x_label: "time to first token (ms, log scale)".into(),
        y_label: "requests (%)".into(),
        log_x: true,
        y_range: Some((0.0, 100.0)),
        y_unit: "%".into(),
        series: first
            .iter()
            .map(|r| Series {
                name: r.cfg.name().into(),
                points: cdf(&r.ttft),
                dashed: false,
            })
            .collect(),
        ..Chart::default()
    }
}

/// Hit rate by tier over one run's time.
fn hit_rate_chart(r: &Record, sample_interval: f64, title: &str) -> Chart {
    // About 30 windows over the run, at least one sample interval each.
    let bucket = (r.wall / 30.0).max(sample_interval);
    let rates = windowed_rates(&r.samples, bucket);
    let names = ["device", "host", "L3"];
    Chart {
        title: format!("Hit rate by tier over time: {}", r.label()),
        subtitle: title.to_string(),
        x_label: "time since the run started (s)".into(),
        y_label: format!("prompt tokens per tier, {bucket:.1} s windows (%)"),
        y_range: Some((0.0, 100.0)),
        y_unit: "%".into(),
        series: (0..3)
            .map(|i| Series {
                name: names[i].into(),
                points: rates.iter().map(|(t, v)| (*t, v[i])).collect(),
                dashed: false,
            })
            .collect(),
        ..Chart::default()
    }
}

/// Output throughput against concurrency, one series per configuration (in run order).
fn throughput_chart(levels: &[usize], recs: &[Record], title: &str) -> Chart {
    let mut cfgs: Vec<Config> = Vec::new();
    for r in recs {
        if !cfgs.contains(&r.cfg) {
            cfgs.push(r.cfg);
        }
    }
    let mut levels = levels.to_vec();
    levels.sort_unstable();
    levels.dedup();
    Chart {
        title: "Throughput against concurrency".into(),
        subtitle: title.to_string(),
        x_label: "requests in flight (closed loop)".into(),
        y_label: "output tokens per second".into(),
        x_ticks: Some(levels.iter().map(|&c| c as f64).collect()),
        series: cfgs
            .iter()
            .map(|&c| {
                let mut pts: Vec<(f64, f64)> = recs
                    .iter()
                    .filter(|r| r.cfg == c)
                    .map(|r| (r.concurrency as f64, r.summary.output_tokens_per_s))
                    .collect();
                pts.sort_by(|a, b| a.0.total_cmp(&b.0));
                Series {
                    name: c.name().into(),
                    points: pts,
                    dashed: false,
                }
            })
            .collect(),
        ..Chart::default()
    }
}

/// Ratios against the device-only configuration at the same concurrency.
pub fn ratio_lines(recs: &[Record]) -> Vec<String> {
    let mut v = Vec::new();
    for r in recs {
        let Some(base) = recs
            .iter()
            .find(|b| b.cfg == Config::Device && b.concurrency == r.concurrency)
        else {
            continue;
        };
        if r.cfg == Config::Device {
            continue;
        }
        v.push(format!(
            "{} vs device {}: throughput {:.2}× (output tok/s), TTFT p50 {:.2}× lower, p99 {:.2}× lower",
            r.cfg.name(),
            level(r.concurrency),
            r.summary.output_tokens_per_s / base.summary.output_tokens_per_s,
            base.summary.ttft_p50 / r.summary.ttft_p50,
            base.summary.ttft_p99 / r.summary.ttft_p99,
        ));
    }
    v
}

/// The records of an earlier results.json (what the plots need).
pub fn records_from_json(v: &Value) -> Result<(Vec<usize>, Vec<Record>, String)> {
    let title = format!(
        "{} ({})",
        v["workload"].as_str().unwrap_or("?"),
        v["scaling"].as_str().unwrap_or("?")
    );
    let mut levels = Vec::new();
    let mut recs = Vec::new();
    let f = |x: &Value| x.as_f64().unwrap_or(f64::NAN);
    for r in v["runs"].as_array().context("no `runs` array")? {
        let cfg = Config::parse(
            r["configuration"]
                .as_str()
                .context("a run without configuration")?,
        )?;
        let concurrency = r["concurrency"]
            .as_u64()
            .context("a run without concurrency")? as usize;
        if !levels.contains(&concurrency) {
            levels.push(concurrency);
        }
        let t = |x: &Value| TierCounts {
            t: f(&x["t"]),
            device: f(&x["device"]),
            host: f(&x["host"]),
            l3: f(&x["l3"]),
            miss: f(&x["miss"]),
            kv_received: f(&x["kv_received"]),
        };
        let reqs = r["requests"].as_array().cloned().unwrap_or_default();
        recs.push(Record {
            cfg,
            concurrency,
            summary: Summary {
                output_tokens_per_s: f(&r["summary"]["output_tokens_per_s"]),
                ..Summary::default()
            },
            tiers: t(&r["tiers"]),
            samples: r["samples"]
                .as_array()
                .map(|s| s.iter().map(t).collect())
                .unwrap_or_default(),
            ttft: reqs
                .iter()
                .filter(|q| q["ok"].as_bool() == Some(true))
                .map(|q| f(&q["ttft"]))
                .collect(),
            outcomes: Value::Null,
            wall: f(&r["wall_seconds"]),
        });
    }
    if recs.is_empty() {
        bail!("no runs recorded");
    }
    Ok((levels, recs, title))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn configurations_parse_by_name_and_refuse_others() {
        for n in ["no-cache", "device", "host", "disk", "pd"] {
            assert_eq!(Config::parse(n).unwrap().name(), n);
        }
        let e = Config::parse("gpu").unwrap_err().to_string();
        assert!(e.contains("`gpu`"), "{e}");
    }

    #[test]
    fn cdf_is_sorted_and_ends_at_100() {
        let c = cdf(&[0.3, 0.1, 0.2, 0.4]);
        assert_eq!(
            c,
            vec![(100.0, 25.0), (200.0, 50.0), (300.0, 75.0), (400.0, 100.0)]
        );
    }

    #[test]
    fn windowed_rates_split_each_window_by_tier() {
        let s = |t, device, host, l3, miss| TierCounts {
            t,
            device,
            host,
            l3,
            miss,
            kv_received: 0.0,
        };
        let v = [
            s(0.0, 0.0, 0.0, 0.0, 0.0),
            s(1.0, 0.0, 0.0, 0.0, 100.0),
            s(2.0, 0.0, 0.0, 0.0, 100.0),
            s(3.0, 50.0, 25.0, 25.0, 100.0),
        ];
        // The idle window (1 → 2) is skipped.
        let r = windowed_rates(&v, 1.0);
        assert_eq!(r, vec![(1.0, [0.0, 0.0, 0.0]), (3.0, [50.0, 25.0, 25.0])]);
        // Two-second windows: 0 → 2 all misses; the last window ends at the last sample.
        let r = windowed_rates(&v, 2.0);
        assert_eq!(r, vec![(2.0, [0.0, 0.0, 0.0]), (3.0, [50.0, 25.0, 25.0])]);
    }
}
