//! `strata up`: router + prefill + decode workers as separate processes of this binary, from
//! an embedded default deployment (or a TOML file). Every port is checked free before anything
//! starts; each process is healthy only once it said it is ready on its own port; the
//! deployment has its own cluster key (in its state directory). Start-up failures stop
//! everything once, with the worker's own message and exit code; later crashes restart with
//! backoff.
//!
//! - [`procs`]: starting, reading, health-checking and stopping the processes.
//! - [`ports`]: the ports checked free before anything starts, the holder of a taken one.
//! - [`key`]: the deployment's state directory and cluster key.
//! - [`supervise`]: restarts with backoff while serving.
//! - [`preflight`]: the deployment file read within a bound; every worker's flags and memory
//!   plan checked, and their sum per NUMA node, before any process starts.

mod key;
mod ports;
mod preflight;
mod procs;
mod supervise;

pub use procs::{healthy, stop_all};
use procs::{terminate, Proc};

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Args;
use serde::Deserialize;
use strata_model::fetch::{cache_dir, ensure_model};

/// The embedded default deployment.
pub const DEFAULT: &str = include_str!("up.toml");

#[derive(Args, Debug)]
pub struct UpArgs {
    /// Deployment file (TOML); default: the embedded one (`strata up --print-config`).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Print the embedded default deployment and exit.
    #[arg(long)]
    pub print_config: bool,
    /// GGUF file for every worker (overrides the file's `model`).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// The deployment's state directory (its cluster key); default: the file's `state_dir`,
    /// else `$XDG_STATE_HOME/strata/up/HOST_ROUTERPORT` (`~/.local/state/...`).
    #[arg(long)]
    pub state_dir: Option<PathBuf>,
    /// Seconds to wait for every process to become healthy.
    #[arg(long, default_value_t = 300.0)]
    pub startup_timeout: f64,
    /// How every worker stores K/V (overrides the file's `kv_cache_dtype`): f16, q8_0 or
    /// fp8_e4m3. One for the deployment: a KV transfer between dtypes is refused.
    #[arg(long, value_parser = crate::sizing::kv_dtype)]
    pub kv_cache_dtype: Option<strata_kv::dtype::Dtype>,
}

#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields)]
struct Deployment {
    #[serde(default = "localhost")]
    host: String,
    #[serde(default)]
    model: String,
    /// How every worker stores K/V (`--kv-cache-dtype`): one dtype for the deployment.
    #[serde(default = "f16")]
    kv_cache_dtype: String,
    #[serde(default = "yes")]
    smoke_test: bool,
    /// The cluster key file every process gets; default: `cluster.key` in the state
    /// directory, made for this deployment on its first run.
    #[serde(default)]
    cluster_key_file: Option<PathBuf>,
    /// The deployment's state directory (see `--state-dir`).
    #[serde(default)]
    state_dir: Option<PathBuf>,
    router: RouterSpec,
    #[serde(default)]
    prefill: Vec<WorkerSpec>,
    decode: Vec<WorkerSpec>,
}

#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields)]
struct RouterSpec {
    port: u16,
    #[serde(default = "round_robin")]
    policy: String,
    #[serde(default)]
    args: Vec<String>,
}

#[derive(Deserialize, Debug, Clone)]
#[serde(deny_unknown_fields)]
struct WorkerSpec {
    port: u16,
    numa_node: Option<u32>,
    /// Tensor-parallel ranks (`--tp-size`); prefill and decode workers may differ.
    tp_size: Option<u32>,
    /// NUMA node of each rank (`--numa-nodes`).
    numa_nodes: Option<Vec<u32>>,
    #[serde(default)]
    args: Vec<String>,
}

fn localhost() -> String {
    "127.0.0.1".into()
}
fn f16() -> String {
    "f16".into()
}
fn yes() -> bool {
    true
}
fn round_robin() -> String {
    "round_robin".into()
}

pub fn run(a: UpArgs) -> Result<()> {
    if a.print_config {
        print!("{DEFAULT}");
        return Ok(());
    }
    crate::http_args::check_seconds("--startup-timeout", a.startup_timeout, 0.0, false)?;
    let d = load_deployment(&a)?;
    let model = match (&a.model, d.model.as_str()) {
        (Some(p), _) => p.clone(),
        (None, "") => ensure_model(&cache_dir(), |m| say!("{m}"))?,
        (None, p) => PathBuf::from(p),
    };
    if !model.exists() {
        bail!("model {} does not exist", model.display());
    }
    ports::check_free(&d.host, &d.ports())?;
    let nodes = strata_mem::Topology::detect()
        .map(|t| t.nodes.len())
        .unwrap_or(1);
    if nodes < 2 {
        say!(
            "strata up: this machine has one NUMA node: prefill and decode workers both use node 0"
        );
    }
    let state = key::state_dir(
        a.state_dir.as_deref().or(d.state_dir.as_deref()),
        &d.host,
        d.router.port,
    )?;
    // Every worker's flags and memory plan, and the deployment's sum against this machine,
    // before any process starts or anything of the deployment is made (its key included).
    let (check_key, stand_in) = key::key_for_checks(d.cluster_key_file.as_deref(), &state)?;
    let mut w = WorkerCtx {
        d: &d,
        model: &model,
        key: check_key.display().to_string(),
        nodes,
    };
    let client_key = preflight::check(&w)?;
    drop(stand_in);
    let key_file = key::cluster_key(d.cluster_key_file.as_deref(), &state)?;
    w.key = key_file.display().to_string();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let client = reqwest::Client::new();
    let deadline = Instant::now() + Duration::from_secs_f64(a.startup_timeout);
    // Prefill workers, then decode workers (told the prefill workers' addresses: when one
    // takes any free port, decode waits until it has said which), then the router in front.
    let mut procs: Vec<Proc> = Vec::new();
    for (i, s) in d.prefill.iter().enumerate() {
        procs.push(w.start("prefill", i, s, &[])?);
    }
    let prefill_first = d.prefill.iter().any(|s| s.port == 0);
    if prefill_first {
        procs::wait_healthy(&rt, &client, &mut procs, 0, deadline)?;
    }
    let prefill_urls: Vec<String> = procs.iter().map(Proc::url).collect();
    let first = if prefill_first { procs.len() } else { 0 };
    for (i, s) in d.decode.iter().enumerate() {
        procs.push(w.start("decode", i, s, &prefill_urls)?);
    }
    procs::wait_healthy(&rt, &client, &mut procs, first, deadline)?;
    let rargs = router_command(&d, &model, &w.key, &targets(&procs));
    say!("strata up: starting router on {}:{}", d.host, d.router.port);
    let n = procs.len();
    procs.push(Proc::start("router".into(), rargs, &d.host, d.router.port)?);
    procs::wait_healthy(&rt, &client, &mut procs, n, deadline)?;
    let router_url = procs[n].url();
    if d.smoke_test {
        if let Err(e) = smoke_test(&rt, &client, &router_url, client_key.as_deref()) {
            terminate(&mut procs);
            return Err(e);
        }
    }
    print_ready(&router_url, &key_file, &procs);
    supervise::supervise(&rt, &client, procs)
}

/// The deployment of `--config`, or the embedded one.
fn load_deployment(a: &UpArgs) -> Result<Deployment> {
    let text = match &a.config {
        Some(p) => preflight::read_config(p)?,
        None => DEFAULT.to_string(),
    };
    let what = a
        .config
        .as_ref()
        .map(|p| p.display().to_string())
        .unwrap_or("the embedded deployment".into());
    let mut d: Deployment = toml::from_str(&text).with_context(|| what.clone())?;
    if d.decode.is_empty() {
        bail!("{what}: at least one [[decode]] worker is needed");
    }
    if let Some(dt) = a.kv_cache_dtype {
        d.kv_cache_dtype = dt.name().into();
    }
    if strata_kv::dtype::Dtype::parse_kv(&d.kv_cache_dtype).is_none() {
        bail!(
            "{what}: kv_cache_dtype `{}`: expected one of f16, q8_0, fp8_e4m3",
            d.kv_cache_dtype
        );
    }
    // Prefill and decode must store K/V alike (a transfer between dtypes is refused at its
    // handshake): the dtype is the deployment's, never one worker's.
    for (who, args) in d.worker_args() {
        let dtype_flag = ["--kv-cache-dtype", "--cache-type-k", "--cache-type-v"]
            .into_iter()
            .find(|f| {
                args.iter()
                    .any(|a| a == f || a.starts_with(&format!("{f}=")))
            });
        if let Some(f) = dtype_flag {
            bail!(
                "{what}: {who}'s args give {f}: set kv_cache_dtype once for the deployment \
                 (prefill and decode workers must store K/V alike)"
            );
        }
    }
    ports::distinct(&what, &d.ports())?;
    Ok(d)
}

impl Deployment {
    /// Every worker's name and its own args.
    fn worker_args(&self) -> Vec<(String, &[String])> {
        let mut v = Vec::new();
        for (role, list) in [("prefill", &self.prefill), ("decode", &self.decode)] {
            for (i, w) in list.iter().enumerate() {
                v.push((format!("{role}-{i}"), w.args.as_slice()));
            }
        }
        v
    }

    /// Every process's name and port (0: any free one).
    fn ports(&self) -> Vec<(String, u16)> {
        let mut v = vec![("router".to_string(), self.router.port)];
        for (role, list) in [("prefill", &self.prefill), ("decode", &self.decode)] {
            v.extend(
                list.iter()
                    .enumerate()
                    .map(|(i, w)| (format!("{role}-{i}"), w.port)),
            );
        }
        v
    }
}

/// What every worker's command line shares.
struct WorkerCtx<'a> {
    d: &'a Deployment,
    model: &'a Path,
    key: String,
    nodes: usize,
}

impl WorkerCtx<'_> {
    /// The command line of `ROLE-I` (`serve ...`), its NUMA node by default prefill 0, decode
    /// 1 on a machine with two or more; a decode worker is told `prefill_urls`.
    fn args(&self, role: &str, w: &WorkerSpec, prefill_urls: &[String]) -> Vec<String> {
        let d = self.d;
        let default_node = if role == "prefill" { 0 } else { 1 };
        let node = w
            .numa_node
            .unwrap_or(if self.nodes >= 2 { default_node } else { 0 });
        let role_flag = if d.prefill.is_empty() { "both" } else { role };
        let mut args: Vec<String> = vec![
            "serve".into(),
            "--role".into(),
            role_flag.into(),
            "--host".into(),
            d.host.clone(),
            "--port".into(),
            w.port.to_string(),
            "--model".into(),
            self.model.display().to_string(),
            "--cluster-key-file".into(),
            self.key.clone(),
            "--kv-cache-dtype".into(),
            d.kv_cache_dtype.clone(),
        ];
        // A worker that receives K/V listens on the deployment's host; every worker of
        // `strata up` is on this machine, so an unspecified address is reached through loopback.
        if role_flag != "prefill" {
            args.extend(["--kv-host".into(), d.host.clone()]);
            match d.host.as_str() {
                "0.0.0.0" => args.extend(["--kv-advertise".into(), "127.0.0.1".into()]),
                "::" | "[::]" => args.extend(["--kv-advertise".into(), "::1".into()]),
                _ => {}
            }
        }
        if let Some(tp) = w.tp_size {
            args.extend(["--tp-size".into(), tp.to_string()]);
        }
        // Each rank's node, or the worker's one node.
        match &w.numa_nodes {
            Some(n) => {
                let list: Vec<String> = n.iter().map(u32::to_string).collect();
                args.extend(["--numa-nodes".into(), list.join(",")]);
            }
            None => args.extend(["--numa-node".into(), node.to_string()]),
        }
        for u in prefill_urls {
            args.extend(["--prefill-worker".into(), u.clone()]);
        }
        args.extend(w.args.iter().cloned());
        args
    }

    /// Starts `ROLE-I` (see [`WorkerCtx::args`]).
    fn start(&self, role: &str, i: usize, w: &WorkerSpec, prefill_urls: &[String]) -> Result<Proc> {
        let args = self.args(role, w, prefill_urls);
        let name = format!("{role}-{i}");
        say!("strata up: starting {name} on {}:{}", self.d.host, w.port);
        Proc::start(name, args, &self.d.host, w.port)
    }
}

/// The started workers as the router is told them: each its flag and URL.
fn targets(procs: &[Proc]) -> Vec<(&'static str, String)> {
    let flag = |p: &Proc| match p.name.starts_with("prefill") {
        true => "--prefill",
        false => "--decode",
    };
    procs.iter().map(|p| (flag(p), p.url())).collect()
}

/// `strata route` arguments for the router in front of `workers` (each its flag, `--prefill`
/// or `--decode`, and its URL).
fn router_command(
    d: &Deployment,
    model: &Path,
    key_arg: &str,
    workers: &[(&str, String)],
) -> Vec<String> {
    let mut rargs: Vec<String> = vec![
        "route".into(),
        "--host".into(),
        d.host.clone(),
        "--port".into(),
        d.router.port.to_string(),
        "--policy".into(),
        d.router.policy.clone(),
        "--model".into(),
        model.display().to_string(),
        "--cluster-key-file".into(),
        key_arg.to_string(),
    ];
    for (flag, url) in workers {
        rargs.push(flag.to_string());
        rargs.push(url.clone());
    }
    rargs.extend(d.router.args.iter().cloned());
    rargs
}

/// One chat request through the router (with a client key of its, if it asks for one); an
/// error says why it failed.
fn smoke_test(
    rt: &tokio::runtime::Runtime,
    client: &reqwest::Client,
    router_url: &str,
    key: Option<&str>,
) -> Result<()> {
    let answer = rt.block_on(async {
        let mut r = client.post(format!("{router_url}/v1/chat/completions"));
        if let Some(k) = key {
            r = r.bearer_auth(k);
        }
        let r = r
            .json(
                &serde_json::json!({"messages": [{"role": "user", "content": "say OK"}],
                                      "max_tokens": 16, "temperature": 0}),
            )
            .timeout(Duration::from_secs(120))
            .send()
            .await?;
        let status = r.status();
        let v: serde_json::Value = r.json().await?;
        anyhow::Ok((status, v))
    });
    match answer {
        Ok((s, v)) if s.is_success() => say!(
            "strata up: smoke test through the router: \"say OK\" → {:?} (cached {} tokens)",
            v["choices"][0]["message"]["content"].as_str().unwrap_or(""),
            v["usage"]["prompt_tokens_details"]["cached_tokens"]
        ),
        Ok((s, v)) => bail!("smoke test failed: {s}: {v}"),
        Err(e) => bail!("smoke test failed: {e}"),
    }
    Ok(())
}

/// Where the API, the dashboard and the metrics are (stdout).
fn print_ready(router_url: &str, key: &Path, procs: &[Proc]) {
    println!("strata up: ready");
    println!("  API (OpenAI-compatible): {router_url}/v1");
    println!("  dashboard: {router_url}/dashboard");
    println!(
        "  metrics (Prometheus): {router_url}/metrics (router), <worker>/metrics (each worker)"
    );
    for p in &procs[..procs.len() - 1] {
        println!(
            "  {}: {} (pid {}), metrics {}/metrics",
            p.name,
            p.url(),
            p.child.id(),
            p.url()
        );
    }
    println!("  cluster key: {}", key.display());
    println!("  Ctrl-C stops everything");
}
