//! `strata sim --compare` and `--advise`: host (L2) cache sizes per rank as operators type them
//! (`--hicache-size`), replayed with the trace through the engine's cache over the given device
//! tier, in the bytes per token of the model that will serve it.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args;
use strata_kv::dtype::Dtype;
use strata_kv::units::{echo_size, parse_size};
use strata_sim::belady::PageTrace;
use strata_sim::replay::{replay, SimConfig, SimResult};
use strata_sim::sweep::SweepPoint;
use strata_sim::trace::TraceRequest;

/// `--model-preset`'s help, from the planner's table.
fn preset_help() -> String {
    format!(
        "Or a preset, as `strata plan --model-preset` takes it: {}",
        crate::sizing::preset_names()
    )
}

#[derive(Args, Debug)]
pub struct AdviceArgs {
    /// Host (L2) sizes per rank to put side by side, as `--hicache-size` takes them (e.g.
    /// `2GB,37.5GB`): hit rates and prefill tokens saved per hour of the trace.
    #[arg(long, value_delimiter = ',', help_heading = "Sizing advice")]
    pub compare: Vec<String>,
    /// Sweep the host tier over the device tier (at --fractions of the trace's distinct
    /// tokens) and print the smallest size per rank that reaches --target, and the curve's knee,
    /// plotted to --plot.
    #[arg(long, help_heading = "Sizing advice")]
    pub advise: bool,
    /// With --advise: the hit rate to reach, as a fraction of what an unbounded host tier gets.
    #[arg(long, default_value_t = 0.9, help_heading = "Sizing advice")]
    pub target: f64,
    /// A GGUF file whose pool kinds give the bytes per token per rank (replaces
    /// --bytes-per-token).
    #[arg(long, help_heading = "Sizing advice")]
    pub model: Option<PathBuf>,
    #[arg(long, help_heading = "Sizing advice", help = preset_help())]
    pub model_preset: Option<String>,
    /// Tensor-parallel ranks per server: sizes are per rank.
    #[arg(long, default_value_t = 1, help_heading = "Sizing advice")]
    pub tp_size: u32,
    /// The model's K/V pools in these dtypes (with --model or --model-preset).
    #[command(flatten)]
    pub kv_dtype: crate::sizing::KvDtypeArgs,
}

/// Bytes per token per rank, and what they come from (for the report).
pub fn bytes_per_token(
    a: &AdviceArgs,
    given: Option<usize>,
    page_size: usize,
) -> Result<(usize, String)> {
    let spec = match model_spec(a)? {
        Some(m) => Some(a.kv_dtype.apply(m)?),
        None if a.kv_dtype.kv() != (Dtype::F16, Dtype::F16) => {
            bail!("--kv-cache-dtype / --cache-type-k / --cache-type-v need --model or --model-preset (with --bytes-per-token give the bytes of the dtype)")
        }
        None => None,
    };
    match (spec, given) {
        (Some(_), Some(_)) => bail!("--bytes-per-token and a model: give one"),
        (Some(spec), None) => {
            if a.tp_size == 0 {
                bail!("--tp-size must be at least 1");
            }
            let mut bpt = 0usize;
            for k in &spec.kinds {
                let pk = k
                    .per_rank(a.tp_size, page_size)
                    .map_err(|why| anyhow::anyhow!("--page-size {page_size}: {why}"))?;
                bpt += pk.bytes_per_token();
            }
            let label = format!(
                "model {} at TP {}: {bpt} bytes per token per rank",
                spec.name, a.tp_size
            );
            Ok((bpt, label))
        }
        (None, b) => {
            if a.tp_size != 1 {
                bail!(
                    "--tp-size {} needs --model or --model-preset (it splits a model's pools); \
                     with --bytes-per-token give the figure per rank",
                    a.tp_size
                );
            }
            let bpt = b.unwrap_or(23_040);
            if bpt == 0 {
                bail!("--bytes-per-token must be at least 1");
            }
            Ok((bpt, format!("{bpt} bytes per token")))
        }
    }
}

/// The model `--model` or `--model-preset` names, if any.
pub fn model_spec(a: &AdviceArgs) -> Result<Option<strata_mem::ModelSpec>> {
    Ok(match (&a.model, &a.model_preset) {
        (Some(_), Some(_)) => bail!("--model and --model-preset: give one"),
        (Some(p), None) => Some(crate::sizing::model_spec_of(p)?),
        (None, Some(n)) => Some(strata_mem::preset(n).with_context(|| {
            format!(
                "--model-preset `{n}`: unknown (known: {})",
                strata_mem::PRESETS.join(", ")
            )
        })?),
        (None, None) => None,
    })
}

/// `x` as a percentage of `of` (0 when `of` is 0).
pub(crate) fn pct(x: u64, of: u64) -> f64 {
    if of == 0 {
        0.0
    } else {
        x as f64 * 100.0 / of as f64
    }
}

/// Hours between the trace's first and last request (None when they share a timestamp).
fn trace_hours(reqs: &[TraceRequest]) -> Option<f64> {
    let lo = reqs.iter().map(|r| r.timestamp_ms).min()?;
    let hi = reqs.iter().map(|r| r.timestamp_ms).max()?;
    (hi > lo).then(|| (hi - lo) as f64 / 3.6e6)
}

fn run_with_host(reqs: &[TraceRequest], base: &SimConfig, host_tokens: u64) -> Result<SimResult> {
    let cfg = SimConfig {
        host_tokens,
        ..base.clone()
    };
    Ok(replay(reqs, &cfg, |_| {})?)
}

/// `--compare`: each host size per rank side by side.
pub fn compare(
    a: &AdviceArgs,
    reqs: &[TraceRequest],
    base: &SimConfig,
    bpt: usize,
    label: &str,
) -> Result<()> {
    let ps = base.layout.page_size() as u64;
    let hours = trace_hours(reqs);
    println!(
        "host tier per rank, side by side: {} requests{}; {label}; device tier {} tokens per rank, page {ps}, {}",
        reqs.len(),
        hours.map_or(String::new(), |h| format!(" over {h:.2} h")),
        base.device_tokens,
        base.eviction.name()
    );
    println!("| host per rank | host tokens | device hit % | host hit % | total hit % | prefill tokens saved per hour |");
    println!("|---|---|---|---|---|---|");
    for s in &a.compare {
        let bytes = parse_size(s.trim()).with_context(|| format!("--compare `{s}`"))?;
        let host_tokens = bytes / bpt as u64 / ps * ps;
        let r = run_with_host(reqs, base, host_tokens)?;
        let st = &r.stats;
        let q = st.queried_tokens;
        let saved = match hours {
            Some(h) => format!("{:.0}", st.hit_tokens() as f64 / h),
            None => "n/a (one timestamp)".into(),
        };
        println!(
            "| {} | {host_tokens} | {:.2} | {:.2} | {:.2} | {saved} |",
            echo_size(bytes, s.trim()),
            pct(st.hit_device_tokens, q),
            pct(st.hit_host_tokens, q),
            pct(st.hit_tokens(), q)
        );
    }
    Ok(())
}

/// The smallest point reaching `goal`, and the knee: the first point after which a doubling
/// of capacity adds less than one percentage point (rates in %).
pub fn target_and_knee(points: &[(u64, f64)], goal: f64) -> (Option<usize>, Option<usize>) {
    let target = points.iter().position(|p| p.1 >= goal);
    let knee = points.windows(2).position(|w| {
        let doublings = (w[1].0 as f64 / w[0].0.max(1) as f64).log2();
        doublings <= 0.0 || (w[1].1 - w[0].1) / doublings < 1.0
    });
    (target, knee)
}

/// A size in decimal GB as operators type it, rounded up to the hundredth.
pub(crate) fn typed_gb(bytes: u64) -> String {
    format!("{:.2}GB", (bytes as f64 / 1e7).ceil() / 100.0)
}

/// `--advise`: the host sweep, the advice and the plot.
pub fn advise(
    a: &AdviceArgs,
    reqs: &[TraceRequest],
    base: &SimConfig,
    fractions: &[f64],
    plot: &std::path::Path,
    (bpt, label): (usize, &str),
) -> Result<()> {
    if !(a.target > 0.0 && a.target <= 1.0) {
        let t = strata_kv::units::shown_number(a.target);
        bail!("--target {t}: a fraction in (0, 1]");
    }
    if let Some(f) = fractions.iter().find(|f| !(**f > 0.0 && **f <= 1.0)) {
        bail!("--fractions: {f} is not in (0, 1]");
    }
    let ps = base.layout.page_size();
    let pt = PageTrace::new(reqs, base.block_tokens, ps);
    let distinct = (pt.distinct_pages * ps) as u64;
    // The ceiling under the same lifecycle: a host tier that holds every token of the trace.
    let all: u64 = reqs
        .iter()
        .map(|r| (r.input_length + r.output_length) as u64)
        .sum::<u64>()
        .div_ceil(ps as u64)
        * ps as u64;
    let ceiling = run_with_host(reqs, base, all)?.stats.hit_rate() * 100.0;
    let mut points = Vec::new();
    let mut sweep = Vec::new();
    println!(
        "host tier sweep over a device tier of {} tokens per rank: {} requests; {label}; hit rates in % of prompt tokens",
        base.device_tokens,
        reqs.len()
    );
    println!("| host per rank | host tokens | hit % | of unbounded |");
    println!("|---|---|---|---|");
    // Smallest first, each size once (a small trace can round two fractions to one size).
    let mut sizes: Vec<(f64, u64)> = fractions
        .iter()
        .map(|&f| {
            (
                f,
                ((distinct as f64 * f / ps as f64).round() as u64).max(1) * ps as u64,
            )
        })
        .collect();
    sizes.sort_by_key(|s| s.1);
    sizes.dedup_by_key(|s| s.1);
    for (f, host) in sizes {
        let r = run_with_host(reqs, base, host)?;
        let rate = r.stats.hit_rate() * 100.0;
        println!(
            "| {} | {host} | {rate:.2} | {:.1}% |",
            typed_gb(host * bpt as u64),
            if ceiling > 0.0 {
                rate / ceiling * 100.0
            } else {
                0.0
            }
        );
        points.push((host, rate));
        let cap_pages = ((base.device_tokens + host) / ps as u64) as usize;
        sweep.push(SweepPoint {
            fraction: f,
            capacity_tokens: host,
            policies: vec![(base.eviction, rate / 100.0)],
            belady: pt.belady_hit_tokens(cap_pages) as f64 / pt.queried_tokens().max(1) as f64,
            infinite: ceiling / 100.0,
        });
    }
    print_advice(a, &points, ceiling, bpt);
    let title = format!("Host tier sweep: {} requests, page {ps} tokens", reqs.len());
    std::fs::write(plot, strata_sim::plot::sweep_svg(&title, &sweep))
        .with_context(|| format!("cannot write {}", plot.display()))?;
    println!("plot written to {}", plot.display());
    Ok(())
}

/// The size that reaches the target, and the knee, as `--hicache-size` values.
fn print_advice(a: &AdviceArgs, points: &[(u64, f64)], ceiling: f64, bpt: usize) {
    if ceiling <= 0.0 {
        println!("advice: this trace has no reuse (no host tier gets a hit): none needed");
        return;
    }
    let (target, knee) = target_and_knee(points, a.target * ceiling);
    match target {
        Some(i) => println!(
            "advice: --hicache-size {} per rank reaches {:.0}% of the unbounded host tier's hit rate ({:.2}% of {ceiling:.2}%)",
            typed_gb(points[i].0 * bpt as u64),
            a.target * 100.0,
            points[i].1
        ),
        None => println!(
            "advice: no size swept reaches {:.0}% of the unbounded hit rate ({ceiling:.2}%); sweep larger --fractions",
            a.target * 100.0
        ),
    }
    match knee {
        Some(i) => println!(
            "knee: {} per rank (each doubling beyond it adds less than one point of hit rate)",
            typed_gb(points[i].0 * bpt as u64)
        ),
        None => {
            println!("knee: none within the sweep (every step adds at least a point per doubling)")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_target_and_the_knee_of_a_curve() {
        // Capacity doubling each step; gains 20, 10, 5, 0.5 points.
        let pts = [
            (100, 10.0),
            (200, 30.0),
            (400, 40.0),
            (800, 45.0),
            (1600, 45.5),
        ];
        assert_eq!(target_and_knee(&pts, 40.0), (Some(2), Some(3)));
        assert_eq!(target_and_knee(&pts, 99.0), (None, Some(3)));
        assert_eq!(typed_gb(37_500_000_000), "37.50GB");
        assert_eq!(typed_gb(1_000_000_001), "1.01GB");
    }
}
