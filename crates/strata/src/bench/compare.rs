//! `strata bench compare`: starts each configuration itself (no prefix cache, device tier only,
//! device and host, device, host and disk, PD through the router), runs the same seeded workload against each at every
//! concurrency level, and writes the table, a JSON record and SVG plots (TTFT CDF per
//! configuration, hit rate by tier over time, throughput against concurrency).
//!
//! Every configuration gets the same device pool (`--device-mem`, per worker), a fresh cache
//! and fresh ports; the workload is built and checked once, before anything starts.

use std::io::Write;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Args;
use serde_json::{json, Value};
use strata_bench::stats::{quantile, summarize};
use strata_model::fetch::{cache_dir, ensure_model};

use crate::bench::load::{client, drive, prepare, Prepared, WorkloadOpts};
use crate::bench::report::{level, plots, ratio_lines, records_from_json, Config, Record};
use crate::bench::workload::{
    counts, outcomes_json, print_table, sampler, summary_json, tiers_json, Row, TierCounts,
};

#[derive(Args, Debug)]
pub struct CompareArgs {
    /// Configurations to start, in this order: no-cache, device, host, disk, pd (prefill +
    /// decode workers behind the router, each with the host tier).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "no-cache,device,host,disk,pd",
        help_heading = "Configurations"
    )]
    pub configs: Vec<String>,
    /// Concurrency levels (closed loop); the first one is the one plotted over time and as CDF.
    /// Open-loop workloads (a trace, --rate) run once per configuration at their arrival times.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "4",
        help_heading = "Configurations"
    )]
    pub concurrency: Vec<usize>,
    /// GGUF file (default: the reference model, fetched if missing).
    #[arg(long, help_heading = "Configurations")]
    pub model: Option<PathBuf>,
    /// Device KV pool of every worker, with a unit (the same in every configuration).
    #[arg(long, default_value = "256MiB", help_heading = "Configurations")]
    pub device_mem: String,
    /// Host (L2) cache per worker in host, disk and pd, with a unit.
    #[arg(long, default_value = "4GiB", help_heading = "Configurations")]
    pub hicache_size: String,
    /// Bytes the L3 disk tier may use in the disk configuration, with a unit.
    #[arg(long, default_value = "8GiB", help_heading = "Configurations")]
    pub l3_size: String,
    /// How every worker stores K/V (`--kv-cache-dtype`; under pd the deployment's one):
    /// f16, q8_0 or fp8_e4m3.
    #[arg(long, default_value = "f16", value_parser = crate::sizing::kv_dtype, help_heading = "Configurations")]
    pub kv_cache_dtype: strata_kv::dtype::Dtype,
    /// A flag for every worker (repeat), e.g. `--serve-arg=--threads=2`.
    #[arg(long, allow_hyphen_values = true, help_heading = "Configurations")]
    pub serve_arg: Vec<String>,
    /// First port; run k uses base-port + 10·k (router/worker, +1 prefill, +2 decode).
    #[arg(long, default_value_t = 18300, help_heading = "Configurations")]
    pub base_port: u16,
    /// Seconds a configuration may take to become healthy.
    #[arg(long, default_value_t = 300.0, help_heading = "Configurations")]
    pub startup_timeout: f64,
    /// Folder for results.json, the plots, the table and the workers' logs.
    #[arg(long, default_value = "bench-results", help_heading = "Output")]
    pub out: PathBuf,
    /// Redraw the plots of an earlier run from its results.json into --out; nothing starts.
    #[arg(long, help_heading = "Output")]
    pub replot: Option<PathBuf>,
    /// Seconds between reads of the workers' /metrics (hit rate by tier over time).
    #[arg(long, default_value_t = 0.5, help_heading = "Output")]
    pub sample_interval: f64,
    #[command(flatten)]
    pub w: WorkloadOpts,
}

/// A started configuration; dropping it stops every process.
struct Deployment {
    child: Child,
    url: String,
    /// Workers whose cache counters are the deployment's (the prefill worker under PD).
    metrics: Vec<String>,
    health: Vec<String>,
    log: PathBuf,
}

impl Drop for Deployment {
    fn drop(&mut self) {
        // SIGTERM lets `strata up` stop its workers.
        crate::up::stop_all([&mut self.child], Duration::from_secs(10));
    }
}

fn port_free(p: u16) -> Result<()> {
    TcpListener::bind(("127.0.0.1", p))
        .map(drop)
        .with_context(|| format!("port {p} is in use: pass another --base-port"))
}

/// The flags every worker of configuration `cfg` (run `k`) gets.
fn worker_args(a: &CompareArgs, cfg: Config, k: usize) -> Vec<String> {
    let mut worker: Vec<String> = vec!["--device-mem".into(), a.device_mem.clone()];
    match cfg {
        Config::NoCache => worker.push("--disable-prefix-cache".into()),
        Config::Device => {}
        Config::Host | Config::Pd => {
            worker.extend(["--hicache-size".into(), a.hicache_size.clone()]);
        }
        Config::Disk => {
            let dir = a.out.join(format!("l3-{k:02}"));
            let _ = std::fs::remove_dir_all(&dir);
            worker.extend([
                "--hicache-size".into(),
                a.hicache_size.clone(),
                "--l3".into(),
                format!("disk:{}", dir.display()),
                "--l3-size".into(),
                a.l3_size.clone(),
            ]);
        }
    }
    worker.extend(a.serve_arg.iter().cloned());
    worker
}

fn start(a: &CompareArgs, cfg: Config, k: usize, model: &Path) -> Result<Deployment> {
    let port = a.base_port + 10 * k as u16;
    let exe = std::env::current_exe().context("path of this binary")?;
    let logs = a.out.join("logs");
    std::fs::create_dir_all(&logs).with_context(|| format!("--out {}", logs.display()))?;
    let log = logs.join(format!("{k:02}-{}.log", cfg.name()));
    let worker = worker_args(a, cfg, k);
    let logf = std::fs::File::create(&log).with_context(|| format!("{}", log.display()))?;
    let url = format!("http://127.0.0.1:{port}");
    let mut cmd = Command::new(&exe);
    let (metrics, health) = if cfg == Config::Pd {
        for p in [port, port + 1, port + 2] {
            port_free(p)?;
        }
        let toml = logs.join(format!("{k:02}-pd.toml"));
        let q = |v: &[String]| serde_json::to_string(v).expect("strings");
        std::fs::write(
            &toml,
            format!(
                "host = \"127.0.0.1\"\nsmoke_test = false\nkv_cache_dtype = \"{}\"\n\n[router]\nport = {port}\npolicy = \"cache_aware\"\n\n[[prefill]]\nport = {}\nargs = {}\n\n[[decode]]\nport = {}\nargs = {}\n",
                a.kv_cache_dtype,
                port + 1,
                q(&worker),
                port + 2,
                q(&worker)
            ),
        )?;
        cmd.arg("up")
            .arg("--config")
            .arg(&toml)
            .arg("--model")
            .arg(model);
        let w = |p: u16| format!("http://127.0.0.1:{p}");
        // Both workers' caches serve prompts: the decode worker's what it holds (the prefill
        // worker sends only the rest, or nothing when it computes the rest itself).
        (
            vec![w(port + 1), w(port + 2)],
            vec![url.clone(), w(port + 1), w(port + 2)],
        )
    } else {
        port_free(port)?;
        cmd.args(["serve", "--port", &port.to_string()])
            .arg("--model")
            .arg(model)
            .args(["--kv-cache-dtype", a.kv_cache_dtype.name()])
            .args(&worker);
        (vec![url.clone()], vec![url.clone()])
    };
    let child = cmd
        .stdin(Stdio::null())
        .stdout(logf.try_clone()?)
        .stderr(logf)
        .spawn()
        .with_context(|| format!("starting {}", exe.display()))?;
    Ok(Deployment {
        child,
        url,
        metrics,
        health,
        log,
    })
}

fn log_tail(p: &Path) -> String {
    let s = std::fs::read_to_string(p).unwrap_or_default();
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(15)..].join("\n")
}

async fn wait_healthy(c: &reqwest::Client, d: &mut Deployment, timeout: f64) -> Result<()> {
    let t = Instant::now();
    loop {
        if let Some(st) = d.child.try_wait()? {
            bail!(
                "the deployment exited ({st}) before it was healthy; its log {}:\n{}",
                d.log.display(),
                log_tail(&d.log)
            );
        }
        let mut ok = true;
        for h in &d.health {
            ok &= crate::up::healthy(c, h).await;
        }
        if ok {
            return Ok(());
        }
        if t.elapsed().as_secs_f64() > timeout {
            bail!(
                "not healthy after {timeout} s; its log {}:\n{}",
                d.log.display(),
                log_tail(&d.log)
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// One short request unrelated to the workload: weights paged in, code paths warm.
async fn warm_up(c: &reqwest::Client, url: &str) -> Result<()> {
    let r = c
        .post(format!("{url}/v1/completions"))
        .json(
            &json!({"prompt": [11, 12, 13, 14, 15, 16, 17, 18], "max_tokens": 2,
                      "temperature": 0, "ignore_eos": true}),
        )
        .send()
        .await?;
    if !r.status().is_success() {
        bail!("warm-up request: {} {}", r.status(), r.text().await?);
    }
    Ok(())
}

pub async fn run(a: CompareArgs) -> Result<()> {
    if let Some(p) = &a.replot {
        return replot(&a, p);
    }
    let cfgs = check(&a)?;
    let p = Arc::new(prepare(&a.w)?);
    let levels: Vec<usize> = if p.open_loop {
        vec![0]
    } else {
        a.concurrency.clone()
    };
    let runs = cfgs.len() * levels.len();
    if a.base_port as usize + 10 * runs + 2 > u16::MAX as usize {
        bail!(
            "--base-port {}: {runs} runs need 10 ports each",
            a.base_port
        );
    }
    std::fs::create_dir_all(&a.out).with_context(|| format!("--out {}", a.out.display()))?;
    let model = match &a.model {
        Some(m) => m.clone(),
        None => ensure_model(&cache_dir(), |m| eprintln!("{m}"))?,
    };
    let title = format!("{} ({})", p.name, p.scaling);
    eprintln!(
        "strata bench compare: {title}, seed {}, max_tokens {}; every worker: device pool {}, host {} (host/disk/pd), model {}",
        a.w.seed,
        a.w.max_tokens,
        a.device_mem,
        a.hicache_size,
        model.display()
    );
    let c = client()?;
    let mut recs = Vec::new();
    let mut k = 0;
    for &conc in &levels {
        for &cfg in &cfgs {
            recs.push(run_one(&a, &c, &p, cfg, conc, k, &model).await?);
            k += 1;
        }
    }
    let ratios = print_results(&a, &title, &cfgs, &recs);
    let files = plots(&a.out, a.sample_interval, &levels, &recs, &title)?;
    write_json(&a, &p, &model, &ratios, &recs, files)
}

/// `--replot`: the plots of an earlier results.json, redrawn into --out.
fn replot(a: &CompareArgs, p: &Path) -> Result<()> {
    let text = std::fs::read_to_string(p).with_context(|| format!("--replot {}", p.display()))?;
    let v: Value =
        serde_json::from_str(&text).with_context(|| format!("--replot {}", p.display()))?;
    let (levels, recs, title) =
        records_from_json(&v).with_context(|| format!("--replot {}", p.display()))?;
    std::fs::create_dir_all(&a.out).with_context(|| format!("--out {}", a.out.display()))?;
    for f in plots(&a.out, a.sample_interval, &levels, &recs, &title)? {
        eprintln!("wrote {}", f.display());
    }
    Ok(())
}

/// Checks the flags of the comparison (the workload is checked by `prepare`); the
/// configurations to start, in order.
fn check(a: &CompareArgs) -> Result<Vec<Config>> {
    let cfgs: Vec<Config> = a
        .configs
        .iter()
        .map(|s| Config::parse(s))
        .collect::<Result<_>>()?;
    if cfgs.is_empty() {
        bail!("--configs: name at least one configuration");
    }
    if a.concurrency.is_empty() || a.concurrency.contains(&0) {
        bail!("--concurrency: every level must be at least 1");
    }
    for &c in &a.concurrency {
        super::limits::count("--concurrency", c, super::limits::MAX_CONCURRENCY)?;
    }
    let dtype_flags = ["--kv-cache-dtype", "--cache-type-k", "--cache-type-v"];
    if let Some(f) = a.serve_arg.iter().find(|s| {
        dtype_flags
            .iter()
            .any(|f| s == f || s.starts_with(&format!("{f}=")))
    }) {
        bail!("--serve-arg {f}: give the K/V dtype as --kv-cache-dtype (every configuration gets it; pd's deployment once)");
    }
    // Unchecked, a NaN startup timeout waited for ever on a deployment that never came up.
    crate::http_args::check_seconds("--startup-timeout", a.startup_timeout, 0.0, false)?;
    crate::http_args::check_seconds("--sample-interval", a.sample_interval, 0.0, false)?;
    for (flag, v) in [
        ("--device-mem", &a.device_mem),
        ("--hicache-size", &a.hicache_size),
        ("--l3-size", &a.l3_size),
    ] {
        strata_kv::units::parse_size(v).with_context(|| flag.to_string())?;
    }
    Ok(cfgs)
}

/// Run `k`: starts `cfg`, drives the workload against it at `conc` (0: open loop) while
/// sampling its counters, stops it; the record.
async fn run_one(
    a: &CompareArgs,
    c: &reqwest::Client,
    p: &Arc<Prepared>,
    cfg: Config,
    conc: usize,
    k: usize,
    model: &Path,
) -> Result<Record> {
    let mut d = start(a, cfg, k, model)?;
    wait_healthy(c, &mut d, a.startup_timeout).await?;
    warm_up(c, &d.url).await?;
    let before = counts(c, &d.metrics, 0.0).await?;
    let stop = Arc::new(AtomicBool::new(false));
    let h = sampler(
        c.clone(),
        d.metrics.clone(),
        Duration::from_secs_f64(a.sample_interval),
        stop.clone(),
    );
    let label = format!("{} {}", cfg.name(), level(conc));
    let r = drive(c, &d.url, p, conc.max(1), &label).await?;
    stop.store(true, Ordering::Relaxed);
    let samples: Vec<TierCounts> = h
        .await?
        .iter()
        .map(|s| {
            let mut x = s.minus(&before);
            x.t = s.t;
            x
        })
        .collect();
    let after = counts(c, &d.metrics, r.wall).await?;
    drop(d);
    let summary = summarize(&r.outcomes, r.wall);
    Ok(Record {
        cfg,
        concurrency: conc,
        tiers: after.minus(&before),
        samples,
        ttft: r.outcomes.iter().filter(|o| o.ok).map(|o| o.ttft).collect(),
        outcomes: outcomes_json(&r.outcomes),
        summary,
        wall: r.wall,
    })
}

/// The workload, the configurations, the table and the ratios against device only (stdout);
/// the ratio lines.
fn print_results(a: &CompareArgs, title: &str, cfgs: &[Config], recs: &[Record]) -> Vec<String> {
    println!(
        "workload {title}, seed {}, max_tokens {}; device pool {} per worker, host {} per worker",
        a.w.seed, a.w.max_tokens, a.device_mem, a.hicache_size
    );
    for cfg in cfgs {
        println!("  {}: {}", cfg.name(), cfg.describe());
    }
    let rows: Vec<Row> = recs
        .iter()
        .map(|r| Row {
            label: r.label(),
            s: r.summary.clone(),
            tiers: Some(r.tiers),
        })
        .collect();
    print_table(&rows);
    let ratios = ratio_lines(recs);
    for l in &ratios {
        println!("{l}");
    }
    ratios
}

/// Writes results.json into --out and says which files were written (stderr).
fn write_json(
    a: &CompareArgs,
    p: &Prepared,
    model: &Path,
    ratios: &[String],
    recs: &[Record],
    files: Vec<PathBuf>,
) -> Result<()> {
    let v = json!({
        "workload": p.name, "scaling": p.scaling, "seed": a.w.seed, "open_loop": p.open_loop,
        "max_tokens": a.w.max_tokens, "device_mem": a.device_mem,
        "hicache_size": a.hicache_size, "model": model.display().to_string(),
        "serve_args": a.serve_arg,
        "kv_cache_dtype": a.kv_cache_dtype.name(),
        "ratios": ratios,
        "runs": recs.iter().map(|r| json!({
            "configuration": r.cfg.name(), "description": r.cfg.describe(),
            "concurrency": r.concurrency, "wall_seconds": r.wall,
            "summary": summary_json(&r.summary),
            "ttft_p50_from_cdf": quantile(&r.ttft, 0.5),
            "tiers": tiers_json(&r.tiers),
            "samples": r.samples.iter().map(tiers_json).collect::<Vec<_>>(),
            "requests": r.outcomes,
        })).collect::<Vec<_>>(),
    });
    let jp = a.out.join("results.json");
    std::fs::write(&jp, serde_json::to_string_pretty(&v)?)?;
    let mut f = std::io::stderr();
    writeln!(f, "wrote {}", jp.display())?;
    for p in files {
        writeln!(f, "wrote {}", p.display())?;
    }
    Ok(())
}
