//! `strata sim`: trace replay and capacity sweeps.

pub(crate) mod advice;
pub(crate) mod windows;

use std::io::BufReader;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args;
use strata_kv::units::{format_bytes, parse_size};
use strata_kv::{EvictionPolicy, PageLayout, PoolKind, WritePolicy};
use strata_sim::belady::PageTrace;
use strata_sim::replay::{replay, SimConfig, SimResult};
use strata_sim::trace::{read_trace_first, Scale, TraceRequest};
use strata_sim::{plot, sweep};

use crate::sim::advice::pct;
use tracing::info;

#[derive(Args, Debug)]
pub struct SimArgs {
    /// Mooncake-format JSONL trace (`timestamp`, `input_length`, `output_length`, `hash_ids`).
    #[arg(long, help_heading = "Trace")]
    trace: PathBuf,
    /// Tokens per trace block (one hash id per block).
    #[arg(long, default_value_t = 512, help_heading = "Trace")]
    block_tokens: usize,
    /// Vocabulary size the synthetic token ids are drawn from.
    #[arg(long, default_value_t = 49152, help_heading = "Trace")]
    vocab: u32,
    /// Replay at block granularity: each hash id is one token (page size 1), as peers' tree
    /// benchmarks do. Prompt lengths become the number of blocks.
    #[arg(long, help_heading = "Trace")]
    ids_as_tokens: bool,
    /// Multiplies every prompt and output length and the block size, as `strata bench
    /// workload --workload trace --length-scale` does (1: the trace's own lengths).
    #[arg(long, default_value_t = 1.0, help_heading = "Trace")]
    length_scale: f64,
    /// Output tokens per request at most (as `strata bench --max-tokens` caps them).
    #[arg(long, help_heading = "Trace")]
    max_tokens: Option<usize>,
    /// Requests from the start of the trace (0: all), as `strata bench --limit`.
    #[arg(long, default_value_t = 0, help_heading = "Trace")]
    limit: usize,

    /// Device (L1) capacity: tokens (`200000`), bytes with a unit (`4GiB`, `4GB`), or a percent of
    /// the trace's distinct tokens (`5%`).
    #[arg(long, default_value = "5%", help_heading = "Capacities")]
    device: String,
    /// Host (L2) capacity, same forms; `0` turns the tier off.
    #[arg(long, default_value = "0", help_heading = "Capacities")]
    host: String,
    /// L3 storage capacity, same forms; `0` turns the tier off.
    #[arg(long, default_value = "0", help_heading = "Capacities")]
    storage: String,
    /// KV bytes per token, to turn byte capacities into tokens (default: SmolLM2-135M, f16:
    /// 30 layers × 2 × 3 KV heads × 64 × 2 bytes = 23040; or --model / --model-preset).
    #[arg(long, help_heading = "Capacities")]
    bytes_per_token: Option<usize>,

    /// Tokens per page.
    #[arg(long, default_value_t = 16, help_heading = "Cache")]
    page_size: usize,
    /// `write_through`, `write_through_selective[:N]` (N: hits, default 2) or `write_back`.
    #[arg(
        long,
        default_value = "write_through",
        value_parser = crate::serve::write_policy,
        help_heading = "Cache"
    )]
    write_policy: WritePolicy,
    /// `auto` (the engine's default), `lru`, `gdsf`, `sieve`, `s3fifo`, a comma-separated list,
    /// or `all` (each, side by side).
    #[arg(long, default_value = "all", help_heading = "Cache")]
    eviction: String,
    /// GDSF's (and S3-FIFO's ghost) memory of evicted nodes, in keys per cached page (1 byte
    /// each, counted in the metadata per token); the default is the engine's.
    #[arg(long, default_value_t = strata_kv::DEFAULT_GDSF_HISTORY as u32, value_parser = clap::value_parser!(u32).range(1..=4096), help_heading = "Cache")]
    gdsf_history: u32,

    /// Cache each request's output tokens as the engine does (generated stand-ins, as many as
    /// the trace's `output_length`); `false` caches prompts only. Sweeps cache prompts only
    /// (Belady's bound is over prompt pages).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set, help_heading = "Cache")]
    cache_outputs: bool,

    /// Replay the trace's `session_id`s as the requests' sessions (the API's
    /// `prompt_cache_key`); `false`: as if no request named one.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set, help_heading = "Cache")]
    sessions: bool,

    /// Sweep the device capacity and print the miss-ratio curve with Belady's bound.
    #[arg(long, help_heading = "Sweep")]
    sweep: bool,
    /// Capacities of the sweep, as fractions of the trace's distinct pages.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "0.01,0.02,0.05,0.1,0.25,0.5,1",
        help_heading = "Sweep"
    )]
    fractions: Vec<f64>,
    /// Where to write the sweep plot (SVG).
    #[arg(long, default_value = "sim-sweep.svg", help_heading = "Sweep")]
    plot: PathBuf,

    /// A model with window kinds (--model-preset deepseek-v4-pro): the requests computing at
    /// once, whose window rings the plan keeps on device and whose sequence ends on host.
    #[arg(long, default_value_t = 32, help_heading = "Window residency")]
    max_running: usize,
    /// A model with window kinds: tokens per model call (a running request's chunk).
    #[arg(long, default_value_t = 512, help_heading = "Window residency")]
    max_batch_tokens: usize,

    #[command(flatten)]
    advice: crate::sim::advice::AdviceArgs,
}

/// The most tokens a replay of `reqs` inserts (every prompt and output whole, in whole pages):
/// a capacity beyond it never evicts.
fn most_tokens(reqs: &[TraceRequest], page: usize) -> u64 {
    let page = page.max(1) as u64;
    reqs.iter()
        .map(|r| {
            let t = (r.input_length as u64).saturating_add(r.output_length as u64);
            t.div_ceil(page).saturating_add(1).saturating_mul(page)
        })
        .fold(0u64, u64::saturating_add)
}

/// Parses a capacity into tokens, in whole pages (what a tier of that size holds, as the
/// engine and `strata plan` count it).
fn capacity(s: &str, distinct_tokens: u64, bpt: usize, page: usize, what: &str) -> Result<u64> {
    let tokens = capacity_tokens(s, distinct_tokens, bpt, what)?;
    if tokens > 0 && tokens < page as u64 {
        bail!("--{what} `{s}`: {what} capacity of {tokens} tokens is smaller than one page ({page} tokens)");
    }
    Ok(tokens / page as u64 * page as u64)
}

fn capacity_tokens(
    s: &str,
    distinct_tokens: u64,
    bytes_per_token: usize,
    what: &str,
) -> Result<u64> {
    let t = s.trim();
    if let Some(p) = t.strip_suffix('%') {
        let v: f64 = p
            .trim()
            .parse()
            .with_context(|| format!("--{what} `{s}`: not a percentage"))?;
        if !(0.0..=100.0).contains(&v) {
            bail!("--{what} `{s}`: a percentage must be between 0 and 100");
        }
        return Ok((distinct_tokens as f64 * v / 100.0).round() as u64);
    }
    let digits = t.trim_end_matches(|c: char| c.is_ascii_alphabetic()).trim();
    let unit = t[digits.len()..].trim().to_ascii_lowercase();
    if unit.is_empty() || unit == "tok" || unit == "tokens" {
        return digits
            .parse()
            .with_context(|| format!("--{what} `{s}`: expected tokens (`200000`), bytes with a unit (`4GiB`) or a percent (`5%`)"));
    }
    let bytes = parse_size(t).with_context(|| format!("--{what}"))?;
    Ok(bytes / bytes_per_token as u64)
}

fn policies(s: &str) -> Result<Vec<EvictionPolicy>> {
    if s == "all" {
        return Ok(EvictionPolicy::ALL.to_vec());
    }
    s.split(',')
        .map(|p| {
            EvictionPolicy::parse(p.trim()).with_context(|| {
                format!("--eviction `{p}`: expected auto, lru, gdsf, sieve, s3fifo or all")
            })
        })
        .collect()
}

/// How `--write-policy` is spelled back in the report.
fn write_policy_name(p: WritePolicy) -> String {
    match p {
        WritePolicy::WriteThrough => "write_through".into(),
        WritePolicy::WriteThroughSelective { threshold } => {
            format!("write_through_selective:{threshold}")
        }
        WritePolicy::WriteBack => "write_back".into(),
    }
}

/// Flags that --advise and --compare would override are refused, not ignored.
fn advice_flags(a: &SimArgs) -> Result<()> {
    if a.sweep {
        bail!("--sweep sweeps the device tier; --advise and --compare the host tier: give one");
    }
    if a.host != "0" {
        bail!(
            "--host {}: --advise and --compare choose the host tier's sizes themselves; drop --host",
            a.host
        );
    }
    Ok(())
}

/// The block size, the sweep's fractions and the plot's path, checked before the trace is
/// read (it may take seconds and gigabytes) and the sweep run.
fn check_numbers(a: &SimArgs) -> Result<()> {
    if a.block_tokens == 0 {
        bail!("--block-tokens must be at least 1");
    }
    for &f in &a.fractions {
        if !(f > 0.0 && f <= 1.0) {
            let f = strata_kv::units::shown_number(f);
            bail!("--fractions: {f} is not in (0, 1]");
        }
    }
    if a.sweep || a.advice.advise {
        crate::outputs::check_writable("--plot", &a.plot)?;
    }
    Ok(())
}

pub fn run(a: SimArgs) -> Result<()> {
    let evictions = policies(&a.eviction)?;
    let (bpt, bpt_label) =
        crate::sim::advice::bytes_per_token(&a.advice, a.bytes_per_token, a.page_size)?;
    check_numbers(&a)?;
    let advising = a.advice.advise || !a.advice.compare.is_empty();
    if advising {
        advice_flags(&a)?;
    }
    let windowed = windowed_model(&a, advising)?;
    // The layout only matters for byte figures; one pool with the given bytes per token.
    let layout = PageLayout::new(a.page_size, vec![PoolKind::aux("kv", 1, bpt)])
        .with_context(|| format!("--page-size {}", a.page_size))?;
    let (reqs, block_tokens, vocab) = load_trace(&a)?;
    let pt = PageTrace::new(&reqs, block_tokens, a.page_size);
    let distinct_tokens = (pt.distinct_pages * a.page_size) as u64;
    log_trace(&reqs, &pt, a.page_size);
    // A tier larger than all the replay inserts holds the same: capacities are cut there, so
    // memory follows the trace, not the flag.
    let most = most_tokens(&reqs, a.page_size);
    let cap = |s: &str, what: &str| -> Result<u64> {
        let t = capacity(s, distinct_tokens, bpt, a.page_size, what)?;
        if t > most {
            println!("{what:>8} capacity `{s}` is more than the replay inserts ({most} tokens): replayed as that");
        }
        Ok(t.min(most))
    };
    let base = SimConfig {
        layout: layout.clone(),
        block_tokens,
        vocab,
        device_tokens: cap(&a.device, "device")?,
        host_tokens: cap(&a.host, "host")?,
        storage_tokens: cap(&a.storage, "storage")?,
        write_policy: a.write_policy,
        eviction: evictions[0],
        gdsf_history: a.gdsf_history as usize,
        cache_outputs: a.cache_outputs,
        windows: None,
    };
    if let Some(spec) = windowed {
        return run_windowed(&a, spec, &reqs, &pt, &base, &evictions);
    }
    if a.sweep {
        return run_sweep(&a, &reqs, &base, &evictions);
    }
    if !a.advice.compare.is_empty() {
        crate::sim::advice::compare(&a.advice, &reqs, &base, bpt, &bpt_label)?;
    }
    if a.advice.advise {
        let bytes = (bpt, bpt_label.as_str());
        crate::sim::advice::advise(&a.advice, &reqs, &base, &a.fractions, &a.plot, bytes)?;
    }
    if advising {
        return Ok(());
    }
    print_header(&a, &reqs, &pt, distinct_tokens, &base, bpt);
    let belady_cap =
        (base.device_tokens + base.host_tokens + base.storage_tokens) / a.page_size as u64;
    for &p in &evictions {
        let cfg = SimConfig {
            eviction: p,
            ..base.clone()
        };
        let r = replay(&reqs, &cfg, |n| tracing::debug!("{n} requests replayed"))?;
        print_row(p, &r);
        print_notes(&r);
    }
    let q = pt.queried_tokens();
    println!(
        "{:<6} {:>44.2}   (offline MIN with room for all tiers' {} pages)",
        "belady",
        pct(pt.belady_hit_tokens(belady_cap as usize), q),
        belady_cap
    );
    println!("{:<6} {:>44.2}", "inf", pct(pt.infinite_hit_tokens(), q));
    Ok(())
}

fn log_trace(reqs: &[TraceRequest], pt: &PageTrace, page_size: usize) {
    info!(
        requests = reqs.len(),
        queried_tokens = pt.queried_tokens(),
        distinct_pages = pt.distinct_pages,
        "trace loaded: {} requests, {} prompt tokens, {} distinct pages of {} tokens",
        reqs.len(),
        pt.queried_tokens(),
        pt.distinct_pages,
        page_size
    );
}

/// The model with window kinds `--model` / `--model-preset` names, if any; refuses the flags
/// its replay does not model, and sizes not in bytes (before the trace is read).
fn windowed_model(a: &SimArgs, advising: bool) -> Result<Option<strata_mem::ModelSpec>> {
    if a.max_running == 0 || a.max_batch_tokens == 0 {
        bail!("--max-running and --max-batch-tokens must be at least 1");
    }
    let windowed =
        crate::sim::advice::model_spec(&a.advice)?.filter(crate::sim::windows::has_window_kinds);
    if windowed.is_some() {
        if a.sweep || advising || a.storage != "0" {
            bail!("a model with window kinds replays its window residency side by side: --sweep, --advise, --compare and --storage are not modelled with it");
        }
        crate::sim::windows::check_sizes(&a.device, &a.host)?;
    }
    Ok(windowed)
}

/// The window residency side by side (`windows.rs`).
fn run_windowed(
    a: &SimArgs,
    spec: strata_mem::ModelSpec,
    reqs: &[TraceRequest],
    pt: &PageTrace,
    base: &SimConfig,
    evictions: &[EvictionPolicy],
) -> Result<()> {
    let w = crate::sim::windows::WindowSim {
        spec,
        tp: a.advice.tp_size,
        page_size: a.page_size,
        device: &a.device,
        host: &a.host,
        max_running: a.max_running,
        max_batch_tokens: a.max_batch_tokens,
    };
    println!(
        "trace: {} ({} requests, {} prompt tokens)",
        a.trace.display(),
        reqs.len(),
        pt.queried_tokens()
    );
    crate::sim::windows::run(&w, reqs, base, evictions)
}

/// Reads the trace (block granularity with `--ids-as-tokens`); with the block size in tokens
/// and the vocabulary the replay uses.
fn load_trace(a: &SimArgs) -> Result<(Vec<TraceRequest>, usize, u32)> {
    // Not waited on if it is a FIFO: a trace is a regular file.
    let f = strata_model::gguf::open_regular(&a.trace)
        .with_context(|| format!("cannot open trace {}", a.trace.display()))?;
    let t = read_trace_first(BufReader::new(f), a.block_tokens, a.limit)
        .with_context(|| format!("in {}", a.trace.display()))?;
    if !t.unread_fields.is_empty() {
        let names: Vec<&str> = t.unread_fields.iter().map(String::as_str).collect();
        eprintln!(
            "strata sim: trace fields not read (only {}): {}",
            strata_sim::trace::FIELDS.join(", "),
            names.join(", ")
        );
    }
    let mut reqs = t.requests;
    if !a.sessions {
        reqs.iter_mut().for_each(|r| r.session = None);
    }
    let scaled_block = scale_like_bench(a, &mut reqs)?;
    let (block_tokens, vocab) = if a.ids_as_tokens {
        if a.page_size != 1 {
            bail!("--ids-as-tokens replays one token per block and needs --page-size 1");
        }
        for (i, r) in reqs.iter_mut().enumerate() {
            if let Some(id) = r.hash_ids.iter().find(|&&id| id > u32::MAX as u64) {
                bail!("trace request {}: hash id {id} does not fit in 32 bits (needed by --ids-as-tokens)", i + 1);
            }
            r.input_length = r.hash_ids.len();
            // Outputs shrink by the same factor (a block's worth of tokens per token).
            r.output_length = r.output_length.div_ceil(a.block_tokens);
        }
        (1, 0)
    } else {
        if a.vocab < 2 {
            bail!("--vocab {}: expected at least 2 token ids", a.vocab);
        }
        (scaled_block, a.vocab)
    };
    if !block_tokens.is_multiple_of(a.page_size) {
        bail!(
            "--page-size {} must divide the block of {block_tokens} tokens (--block-tokens {} × --length-scale {})",
            a.page_size,
            a.block_tokens,
            strata_kv::units::shown_number(a.length_scale)
        );
    }
    let pages = most_tokens(&reqs, a.page_size) / a.page_size.max(1) as u64;
    if pages > MAX_REPLAY_PAGES {
        bail!(
            "the trace's {} requests come to {pages} pages of {} tokens: a replay holds at most {MAX_REPLAY_PAGES} (about 800 MiB of state); replay fewer with --limit, or use a larger --page-size",
            reqs.len(),
            a.page_size
        );
    }
    Ok((reqs, block_tokens, vocab))
}

/// Most pages a replay's requests may come to (prompts and outputs, in whole pages): its
/// state is some 24 bytes a page, and a trace is a file anyone may hand in. The public traces
/// at page 16 are a few million.
const MAX_REPLAY_PAGES: u64 = 1 << 25;

/// Scales lengths and the block size and caps outputs exactly as `strata bench`'s trace
/// replay (`strata_bench::workload::TraceReplay`) does, so both send the same requests (a test
/// runs the two and compares hit rates); returns the scaled block size.
fn scale_like_bench(a: &SimArgs, reqs: &mut [TraceRequest]) -> Result<usize> {
    if !(a.length_scale > 0.0 && a.length_scale <= 1000.0) {
        bail!(
            "--length-scale {}: expected a number in (0, 1000]",
            strata_kv::units::shown_number(a.length_scale)
        );
    }
    if a.max_tokens == Some(0) {
        bail!("--max-tokens must be at least 1");
    }
    if a.ids_as_tokens && (a.length_scale != 1.0 || a.max_tokens.is_some()) {
        bail!("--ids-as-tokens replays one token per block: it takes no --length-scale or --max-tokens");
    }
    if a.ids_as_tokens || (a.length_scale == 1.0 && a.max_tokens.is_none()) {
        return Ok(a.block_tokens);
    }
    let s = Scale::new(a.block_tokens, a.length_scale).map_err(anyhow::Error::msg)?;
    for (i, r) in reqs.iter_mut().enumerate() {
        r.input_length = s.prompt(i, r).map_err(anyhow::Error::msg)?;
        let out = s.output(r);
        let out = a.max_tokens.map_or(out, |m| out.min(m));
        r.output_length = s
            .bounded(&format!("request {}: the output", i + 1), out)
            .map_err(anyhow::Error::msg)?;
    }
    Ok(s.block)
}

/// The trace, the capacities and the cache settings, then the table's header.
fn print_header(
    a: &SimArgs,
    reqs: &[TraceRequest],
    pt: &PageTrace,
    distinct_tokens: u64,
    base: &SimConfig,
    bpt: usize,
) {
    let bpt = bpt as u64;
    println!(
        "trace: {} ({} requests, {} prompt tokens, {} distinct tokens in whole pages)",
        a.trace.display(),
        reqs.len(),
        pt.queried_tokens(),
        distinct_tokens
    );
    let named = reqs.iter().filter(|r| r.session.is_some()).count();
    if named > 0 {
        let sessions: std::collections::HashSet<u64> =
            reqs.iter().filter_map(|r| r.session).collect();
        println!(
            "sessions: {named} requests name one of {} sessions (`session_id`; --sessions false ignores them)",
            sessions.len()
        );
    }
    for (tier, t) in [
        ("device", base.device_tokens),
        ("host", base.host_tokens),
        ("storage", base.storage_tokens),
    ] {
        println!(
            "{tier:>8} capacity: {t} tokens = {} at {bpt} B/token ({:.2}% of distinct)",
            format_bytes(t.saturating_mul(bpt)),
            pct(t, distinct_tokens)
        );
    }
    println!(
        "page size {} tokens, write policy {}, {}",
        a.page_size,
        write_policy_name(a.write_policy),
        if a.cache_outputs {
            "prompts and outputs cached (as the engine does)"
        } else {
            "prompts cached (outputs not)"
        }
    );
    println!();
    println!(
        "{:<6} {:>8} {:>8} {:>8} {:>8} {:>8} {:>12} {:>12} {:>10} {:>10} {:>10}",
        "policy",
        "device%",
        "host%",
        "storage%",
        "total%",
        "miss%",
        "ops/s",
        "requests/s",
        "admit µs",
        "+evict µs",
        "meta B/tok"
    );
}

fn print_row(p: EvictionPolicy, r: &SimResult) {
    let s = &r.stats;
    let q = s.queried_tokens;
    println!(
        "{:<6} {:>8.2} {:>8.2} {:>8.2} {:>8.2} {:>8.2} {:>12.0} {:>12.0} {:>10.2} {:>10.2} {:>10.2}",
        p.name(),
        pct(s.hit_device_tokens, q),
        pct(s.hit_host_tokens, q),
        pct(s.hit_storage_tokens, q),
        pct(s.hit_tokens(), q),
        pct(s.miss_tokens, q),
        r.ops_per_sec(),
        r.requests_per_sec(),
        r.match_nanos as f64 / r.match_calls.max(1) as f64 / 1e3,
        r.evict_nanos as f64 / r.evict_calls.max(1) as f64 / 1e3,
        r.metadata_bytes as f64 / r.tree_tokens as f64,
    );
}

/// The lines under a policy's row: what `auto` learnt, answers sessions retired, requests
/// refused.
fn print_notes(r: &SimResult) {
    if let Some(a) = &r.auto {
        let back = |ret: u64, rem: u64| 100.0 * ret as f64 / rem.max(1) as f64;
        println!(
            "       auto: newcomer credit {:.2} accesses at the end; pages removed on probation {} ({:.1}% came back), used {} ({:.1}% came back)",
            a.newcomer_credit,
            a.probation_removed_pages,
            back(a.probation_returned_pages, a.probation_removed_pages),
            a.used_removed_pages,
            back(a.used_returned_pages, a.used_removed_pages),
        );
    }
    if r.stats.session_retired_nodes > 0 {
        println!(
            "       sessions: {} answers their next turn left were retired ({} tokens, evicted first)",
            r.stats.session_retired_nodes, r.stats.session_retired_tokens
        );
    }
    if r.refused > 0 {
        println!(
            "       {} requests larger than the device tier were refused (as the engine would)",
            r.refused
        );
    }
    if r.empty > 0 {
        println!(
            "       {} requests with an empty prompt were skipped (the engine refuses one)",
            r.empty
        );
    }
    if r.stuck > 0 {
        println!(
            "       {} admitted requests never became ready with nothing in flight (a cache \
             fault: released, not replayed)",
            r.stuck
        );
    }
}

fn run_sweep(
    a: &SimArgs,
    reqs: &[TraceRequest],
    base: &SimConfig,
    ev: &[EvictionPolicy],
) -> Result<()> {
    let pts = sweep::sweep(reqs, base, &a.fractions, ev, |m| info!("{m}"))?;
    println!("miss-ratio curve: {} ({} requests), page size {}, device tier only; hit rates in % of prompt tokens", a.trace.display(), reqs.len(), a.page_size);
    print!("{:>9} {:>12}", "capacity", "tokens");
    for p in ev {
        print!(" {:>8}", p.name());
    }
    println!(
        " {:>8} {:>8}   {}",
        "belady",
        "infinite",
        ev.iter()
            .map(|p| format!("{}/belady", p.name()))
            .collect::<Vec<_>>()
            .join(" ")
    );
    for p in &pts {
        print!("{:>8.1}% {:>12}", p.fraction * 100.0, p.capacity_tokens);
        for &(_, r) in &p.policies {
            print!(" {:>8.2}", r * 100.0);
        }
        print!(" {:>8.2} {:>8.2}  ", p.belady * 100.0, p.infinite * 100.0);
        for &(_, r) in &p.policies {
            print!(
                " {:>10.1}%",
                if p.belady > 0.0 {
                    r / p.belady * 100.0
                } else {
                    0.0
                }
            );
        }
        println!();
    }
    let title = format!(
        "Miss-ratio curve: {} requests, page {} tokens",
        reqs.len(),
        a.page_size
    );
    std::fs::write(&a.plot, plot::sweep_svg(&title, &pts))
        .with_context(|| format!("cannot write {}", a.plot.display()))?;
    println!("plot written to {}", a.plot.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capacities_in_tokens_bytes_and_percent_in_whole_pages() {
        assert_eq!(
            capacity("200000", 1000, 100, 16, "device").unwrap(),
            200_000
        );
        assert_eq!(
            capacity("5000 tokens", 1000, 100, 1, "device").unwrap(),
            5000
        );
        assert_eq!(
            capacity("5000 tokens", 1000, 100, 16, "device").unwrap(),
            4992
        );
        assert_eq!(capacity("1MB", 1000, 100, 16, "device").unwrap(), 10_000);
        assert_eq!(capacity("1MiB", 1000, 1024, 16, "device").unwrap(), 1024);
        // 2 GiB at SmolLM2's 23,040 B per token: 93,206 tokens, 5,825 whole pages of 16.
        assert_eq!(capacity("2GiB", 0, 23_040, 16, "device").unwrap(), 93_200);
        assert_eq!(capacity("5%", 1000, 100, 1, "device").unwrap(), 50);
        assert_eq!(capacity("5%", 1000, 100, 16, "device").unwrap(), 48);
        assert!(capacity("3", 1000, 100, 16, "device")
            .unwrap_err()
            .to_string()
            .contains("device capacity of 3 tokens is smaller than one page (16 tokens)"));
        assert!(capacity("150%", 1000, 100, 16, "host")
            .unwrap_err()
            .to_string()
            .contains("between 0 and 100"));
        assert!(capacity("12XB", 1000, 100, 16, "host").is_err());
        assert!(capacity("lots", 1000, 100, 16, "host").is_err());
    }

    #[test]
    fn write_policies_parse_as_the_cache_does_and_are_spelled_back() {
        for (flag, spelled) in [
            ("write_through", "write_through"),
            ("write_back", "write_back"),
            ("write_through_selective", "write_through_selective:2"),
            ("write_through_selective:5", "write_through_selective:5"),
        ] {
            let p = crate::serve::write_policy(flag).unwrap();
            assert_eq!(Some(p), WritePolicy::parse(flag));
            assert_eq!(write_policy_name(p), spelled);
        }
        for bad in [
            "sometimes",
            "write_through_selective:",
            "write_through_selective:x",
        ] {
            let e = crate::serve::write_policy(bad).unwrap_err();
            assert!(e.contains("write_through_selective[:N]"), "{e}");
        }
    }
}
