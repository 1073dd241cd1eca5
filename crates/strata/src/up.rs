//! `strata up`: router + prefill + decode workers as separate processes of this binary, from
//! an embedded default deployment (or a TOML file). Start-up failures stop everything once,
//! with the worker's own message and exit code; later crashes restart with backoff.

use std::collections::VecDeque;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
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
    /// Seconds to wait for every process to become healthy.
    #[arg(long, default_value_t = 300.0)]
    pub startup_timeout: f64,
}

#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields)]
struct Deployment {
    #[serde(default = "localhost")]
    host: String,
    #[serde(default)]
    model: String,
    #[serde(default = "yes")]
    smoke_test: bool,
    /// The cluster key file every process gets; default: a new key for this deployment.
    #[serde(default)]
    cluster_key_file: Option<PathBuf>,
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
fn yes() -> bool {
    true
}
fn round_robin() -> String {
    "round_robin".into()
}

/// One supervised process.
struct Proc {
    name: String,
    args: Vec<String>,
    child: Child,
    tail: Arc<Mutex<VecDeque<String>>>,
    url: String,
    restarts: u32,
    next_restart: Option<Instant>,
    /// When it crashed, within the last [`CRASH_WINDOW`].
    crashes: VecDeque<Instant>,
}

impl Proc {
    /// Starts `strata ARGS` as `name`, reachable at `url`.
    fn start(name: String, args: Vec<String>, url: String) -> Result<Proc> {
        let (child, tail) = spawn(&name, &args)?;
        Ok(Proc {
            name,
            args,
            child,
            tail,
            url,
            restarts: 0,
            next_restart: None,
            crashes: VecDeque::new(),
        })
    }
}

fn spawn(name: &str, args: &[String]) -> Result<(Child, Arc<Mutex<VecDeque<String>>>)> {
    let exe = std::env::current_exe().context("cannot find this executable")?;
    let mut cmd = Command::new(exe);
    // SAFETY: the closure runs in the forked child before exec and only calls prctl(2), which
    // is async-signal-safe: the worker gets SIGTERM if `strata up` itself dies (even killed),
    // so no orphan keeps serving.
    unsafe {
        use std::os::unix::process::CommandExt;
        cmd.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut child = cmd
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::inherit())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("cannot start {name}"))?;
    let tail = Arc::new(Mutex::new(VecDeque::new()));
    let err = child.stderr.take().expect("piped stderr");
    let (t, n) = (tail.clone(), name.to_string());
    std::thread::spawn(move || {
        for line in BufReader::new(err).lines().map_while(Result::ok) {
            eprintln!("[{n}] {line}");
            let mut q = t.lock().expect("tail lock");
            if q.len() == 20 {
                q.pop_front();
            }
            q.push_back(line);
        }
    });
    Ok((child, tail))
}

fn terminate(procs: &mut [Proc]) {
    stop_all(
        procs.iter_mut().map(|p| &mut p.child),
        Duration::from_secs(40),
    );
}

/// SIGTERM to every child, then waits up to `grace` in all for them to exit; kills the rest.
pub fn stop_all<'a>(children: impl IntoIterator<Item = &'a mut Child>, grace: Duration) {
    let mut children: Vec<&mut Child> = children.into_iter().collect();
    for c in children.iter_mut() {
        if c.try_wait().ok().flatten().is_some() {
            continue; // reaped already: its pid may belong to another process now
        }
        // SAFETY: kill(2) on a child this process spawned and has not reaped (its pid is
        // still ours until waited).
        unsafe {
            libc::kill(c.id() as i32, libc::SIGTERM);
        }
    }
    let t = Instant::now();
    for c in children.iter_mut() {
        while c.try_wait().ok().flatten().is_none() {
            if t.elapsed() > grace {
                let _ = c.kill();
                let _ = c.wait();
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

pub async fn healthy(client: &reqwest::Client, url: &str) -> bool {
    client
        .get(format!("{url}/health"))
        .timeout(Duration::from_secs(2))
        .send()
        .await
        .map(|r| r.status().is_success())
        .unwrap_or(false)
}

/// The last stderr line that says what went wrong.
fn reason(tail: &Mutex<VecDeque<String>>) -> String {
    let q = tail.lock().expect("tail lock");
    q.iter()
        .rev()
        .find(|l| l.starts_with("error"))
        .or(q.back())
        .cloned()
        .unwrap_or_else(|| "(no output)".into())
}

pub fn run(a: UpArgs) -> Result<()> {
    if a.print_config {
        print!("{DEFAULT}");
        return Ok(());
    }
    let d = load_deployment(&a)?;
    let model = match (&a.model, d.model.as_str()) {
        (Some(p), _) => p.clone(),
        (None, "") => ensure_model(&cache_dir(), |m| eprintln!("{m}"))?,
        (None, p) => PathBuf::from(p),
    };
    if !model.exists() {
        bail!("model {} does not exist", model.display());
    }
    let nodes = strata_mem::Topology::detect()
        .map(|t| t.nodes.len())
        .unwrap_or(1);
    if nodes < 2 {
        eprintln!(
            "strata up: this machine has one NUMA node: prefill and decode workers both use node 0"
        );
    }
    let key_file = cluster_key(&d)?;
    let key_arg = key_file.display().to_string();
    let workers = worker_commands(&d, &model, &key_arg, nodes);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let client = reqwest::Client::new();
    // The workers, then the router in front of them, each healthy before the next step.
    let mut procs: Vec<Proc> = Vec::new();
    for (name, args, url) in workers {
        eprintln!("strata up: starting {name} on {url}");
        procs.push(Proc::start(name, args, url)?);
    }
    let deadline = Instant::now() + Duration::from_secs_f64(a.startup_timeout);
    wait_for_workers(&rt, &client, &mut procs, deadline, a.startup_timeout)?;
    let router_url = format!("http://{}:{}", d.host, d.router.port);
    let rargs = router_command(&d, &model, &key_arg, &procs);
    eprintln!("strata up: starting router on {router_url}");
    procs.push(Proc::start("router".into(), rargs, router_url.clone())?);
    wait_for_router(&rt, &client, &mut procs, deadline, a.startup_timeout)?;
    if d.smoke_test {
        if let Err(e) = smoke_test(&rt, &client, &router_url) {
            terminate(&mut procs);
            return Err(e);
        }
    }
    print_ready(&router_url, &procs);
    supervise(&rt, procs)
}

/// The deployment of `--config`, or the embedded one.
fn load_deployment(a: &UpArgs) -> Result<Deployment> {
    let text = match &a.config {
        Some(p) => {
            std::fs::read_to_string(p).with_context(|| format!("--config {}", p.display()))?
        }
        None => DEFAULT.to_string(),
    };
    let what = a
        .config
        .as_ref()
        .map(|p| p.display().to_string())
        .unwrap_or("the embedded deployment".into());
    let d: Deployment = toml::from_str(&text).with_context(|| what.clone())?;
    if d.decode.is_empty() {
        bail!("{what}: at least one [[decode]] worker is needed");
    }
    Ok(d)
}

/// (name, `strata serve` arguments, URL) of every worker: prefill workers first, each on its
/// NUMA node (prefill 0, decode 1 by default on a machine with two or more).
fn worker_commands(
    d: &Deployment,
    model: &Path,
    key_arg: &str,
    nodes: usize,
) -> Vec<(String, Vec<String>, String)> {
    let pd = !d.prefill.is_empty();
    let prefill_urls: Vec<String> = d
        .prefill
        .iter()
        .map(|w| format!("http://{}:{}", d.host, w.port))
        .collect();
    let mut workers = Vec::new();
    for (role, list, default_node) in [("prefill", &d.prefill, 0u32), ("decode", &d.decode, 1u32)] {
        for (i, w) in list.iter().enumerate() {
            let node = w
                .numa_node
                .unwrap_or(if nodes >= 2 { default_node } else { 0 });
            let role_flag = if pd { role } else { "both" };
            let mut args: Vec<String> = vec![
                "serve".into(),
                "--role".into(),
                role_flag.into(),
                "--host".into(),
                d.host.clone(),
                "--port".into(),
                w.port.to_string(),
                "--model".into(),
                model.display().to_string(),
                "--kv-host".into(),
                d.host.clone(),
                "--cluster-key-file".into(),
                key_arg.to_string(),
            ];
            // Every worker of `strata up` is on this machine: an unspecified listen address
            // is reached through loopback.
            match d.host.as_str() {
                "0.0.0.0" => args.extend(["--kv-advertise".into(), "127.0.0.1".into()]),
                "::" | "[::]" => args.extend(["--kv-advertise".into(), "::1".into()]),
                _ => {}
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
            if role == "decode" {
                for u in &prefill_urls {
                    args.push("--prefill-worker".into());
                    args.push(u.clone());
                }
            }
            args.extend(w.args.iter().cloned());
            workers.push((
                format!("{role}-{i}"),
                args,
                format!("http://{}:{}", d.host, w.port),
            ));
        }
    }
    workers
}

/// `strata route` arguments for the router in front of the started workers.
fn router_command(d: &Deployment, model: &Path, key_arg: &str, workers: &[Proc]) -> Vec<String> {
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
    for p in workers {
        let flag = if p.name.starts_with("prefill") {
            "--prefill"
        } else {
            "--decode"
        };
        rargs.push(flag.into());
        rargs.push(p.url.clone());
    }
    rargs.extend(d.router.args.iter().cloned());
    rargs
}

/// Waits until every worker is healthy; a worker that exits now stops everything with its own
/// message and code.
fn wait_for_workers(
    rt: &tokio::runtime::Runtime,
    client: &reqwest::Client,
    procs: &mut Vec<Proc>,
    deadline: Instant,
    timeout: f64,
) -> Result<()> {
    let mut ready = vec![false; procs.len()];
    while ready.iter().any(|r| !r) {
        for (i, p) in procs.iter_mut().enumerate() {
            if let Some(status) = p.child.try_wait()? {
                std::thread::sleep(Duration::from_millis(100)); // let its last lines arrive
                let why = reason(&p.tail);
                let code = status.code().unwrap_or(1);
                eprintln!(
                    "strata up: {} exited during start-up (exit code {code}): {why}",
                    p.name
                );
                eprintln!(
                    "strata up: stopping everything; nothing is restarted after a start-up failure"
                );
                let name = p.name.clone();
                let mut rest: Vec<Proc> = std::mem::take(procs)
                    .into_iter()
                    .filter(|q| q.name != name)
                    .collect();
                terminate(&mut rest);
                std::process::exit(if code == 0 { 1 } else { code });
            }
            if !ready[i] && rt.block_on(healthy(client, &p.url)) {
                ready[i] = true;
                eprintln!("strata up: {} is healthy", p.name);
            }
        }
        if Instant::now() > deadline {
            terminate(procs);
            bail!("not every worker became healthy within {timeout} s");
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    Ok(())
}

/// Waits until the router (the last process) is healthy; if it exits now, stops everything.
fn wait_for_router(
    rt: &tokio::runtime::Runtime,
    client: &reqwest::Client,
    procs: &mut [Proc],
    deadline: Instant,
    timeout: f64,
) -> Result<()> {
    loop {
        let r = procs.last_mut().expect("router");
        if let Some(status) = r.child.try_wait()? {
            std::thread::sleep(Duration::from_millis(100));
            let why = reason(&r.tail);
            eprintln!(
                "strata up: the router exited during start-up (exit code {:?}): {why}",
                status.code()
            );
            terminate(procs);
            std::process::exit(status.code().filter(|&c| c != 0).unwrap_or(1));
        }
        if rt.block_on(healthy(client, &r.url)) {
            return Ok(());
        }
        if Instant::now() > deadline {
            terminate(procs);
            bail!("the router did not become healthy within {timeout} s");
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// One chat request through the router; an error says why it failed.
fn smoke_test(
    rt: &tokio::runtime::Runtime,
    client: &reqwest::Client,
    router_url: &str,
) -> Result<()> {
    let answer = rt.block_on(async {
        let r = client
            .post(format!("{router_url}/v1/chat/completions"))
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
        Ok((s, v)) if s.is_success() => eprintln!(
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
fn print_ready(router_url: &str, procs: &[Proc]) {
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
            p.url,
            p.child.id(),
            p.url
        );
    }
    println!("  Ctrl-C stops everything");
}

/// The deployment's cluster key file: the one the deployment names, or this user's own
/// (`$XDG_CONFIG_HOME/strata/cluster.key`, else `~/.config/strata/cluster.key`), made on first
/// use (64 random hex digits, mode 600, in a directory of mode 700). It outlives each run on
/// purpose: L3 pages written under it (disk, Redis) stay valid across restarts.
fn cluster_key(d: &Deployment) -> Result<PathBuf> {
    if let Some(f) = &d.cluster_key_file {
        strata_kv::auth::ClusterKey::from_file(f).context("cluster_key_file")?;
        return Ok(f.clone());
    }
    let base = std::env::var_os("XDG_CONFIG_HOME")
        .map(PathBuf::from)
        .filter(|p| p.is_absolute())
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".config")))
        .context(
            "no $HOME or $XDG_CONFIG_HOME for the cluster key; name one with cluster_key_file",
        )?;
    let dir = base.join("strata");
    let f = dir.join("cluster.key");
    let mut b = std::fs::DirBuilder::new();
    b.recursive(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::DirBuilderExt;
        b.mode(0o700);
    }
    b.create(&dir)
        .with_context(|| format!("cannot create {}", dir.display()))?;
    let (_, made) = strata_kv::auth::ClusterKey::load_or_create(&f).context("the cluster key")?;
    eprintln!(
        "strata up: {} cluster key {} (mode 600; router and workers authenticate each other with it)",
        if made { "made the" } else { "using the" },
        f.display()
    );
    Ok(f)
}

/// Crashes of one process within [`CRASH_WINDOW`] after which `up` gives up.
const MAX_CRASHES: usize = 5;
const CRASH_WINDOW: Duration = Duration::from_secs(600);
/// A worker's exit code for a configuration error (bad flag, port taken, plan does not fit):
/// restarting cannot help.
const CONFIG_EXIT: i32 = 2;

/// What to do about a process that exited while serving.
#[derive(Debug, PartialEq, Eq)]
enum Crash {
    Restart { after: Duration },
    GiveUp(String),
}

/// Exit code 2 is a configuration error: never restarted. Other crashes restart with
/// exponential backoff (1, 2, 4 … 32 s) until [`MAX_CRASHES`] within [`CRASH_WINDOW`].
fn on_exit(code: Option<i32>, crashes: &mut VecDeque<Instant>, now: Instant) -> Crash {
    if code == Some(CONFIG_EXIT) {
        return Crash::GiveUp(format!(
            "it exited with code {CONFIG_EXIT} (a configuration error): restarting cannot help"
        ));
    }
    while crashes
        .front()
        .is_some_and(|t| now.duration_since(*t) > CRASH_WINDOW)
    {
        crashes.pop_front();
    }
    crashes.push_back(now);
    if crashes.len() >= MAX_CRASHES {
        return Crash::GiveUp(format!(
            "it crashed {} times within {} s",
            crashes.len(),
            CRASH_WINDOW.as_secs()
        ));
    }
    Crash::Restart {
        after: Duration::from_secs(1u64 << (crashes.len() - 1).min(5)),
    }
}

/// Restarts crashed processes with backoff until Ctrl-C / SIGTERM, then stops them all. A
/// process that exits with a configuration error, or crashes too often, stops everything
/// with the reason (exit code 2, or 1).
fn supervise(rt: &tokio::runtime::Runtime, mut procs: Vec<Proc>) -> Result<()> {
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let s = stop.clone();
    rt.spawn(async move {
        crate::serve::shutdown_signal().await;
        s.store(true, std::sync::atomic::Ordering::SeqCst);
    });
    while !stop.load(std::sync::atomic::Ordering::SeqCst) {
        let mut give_up = None;
        for p in procs.iter_mut() {
            if p.next_restart.is_none() {
                if let Some(status) = p.child.try_wait()? {
                    std::thread::sleep(Duration::from_millis(100)); // its last lines
                    let why = reason(&p.tail);
                    match on_exit(status.code(), &mut p.crashes, Instant::now()) {
                        Crash::Restart { after } => {
                            p.restarts += 1;
                            eprintln!(
                                "strata up: {} crashed ({status}: {why}); restart #{} in {} s",
                                p.name,
                                p.restarts,
                                after.as_secs()
                            );
                            p.next_restart = Some(Instant::now() + after);
                        }
                        Crash::GiveUp(because) => {
                            eprintln!("strata up: {} exited ({status}): {why}", p.name);
                            eprintln!(
                                "strata up: not restarting {}: {because}; stopping everything",
                                p.name
                            );
                            let code = if status.code() == Some(CONFIG_EXIT) {
                                CONFIG_EXIT
                            } else {
                                1
                            };
                            give_up = Some(code);
                            break;
                        }
                    }
                }
            } else if p.next_restart.is_some_and(|t| Instant::now() >= t) {
                let (child, tail) = spawn(&p.name, &p.args)?;
                p.child = child;
                p.tail = tail;
                p.next_restart = None;
                eprintln!("strata up: {} restarted (pid {})", p.name, p.child.id());
            }
        }
        if let Some(code) = give_up {
            // The one that exited is reaped already; this stops the rest.
            terminate(&mut procs);
            std::process::exit(code);
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    eprintln!("strata up: stopping every process");
    terminate(&mut procs);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_configuration_error_is_never_restarted() {
        let mut c = VecDeque::new();
        assert!(matches!(
            on_exit(Some(2), &mut c, Instant::now()),
            Crash::GiveUp(m) if m.contains("configuration error")
        ));
    }

    #[test]
    fn crashes_back_off_then_give_up_within_the_window() {
        let mut c = VecDeque::new();
        let t0 = Instant::now();
        let mut waits = Vec::new();
        for i in 0..MAX_CRASHES - 1 {
            match on_exit(Some(70), &mut c, t0 + Duration::from_secs(i as u64)) {
                Crash::Restart { after } => waits.push(after.as_secs()),
                g => panic!("{g:?}"),
            }
        }
        assert_eq!(waits, vec![1, 2, 4, 8]);
        assert!(matches!(
            on_exit(None, &mut c, t0 + Duration::from_secs(10)),
            Crash::GiveUp(m) if m.contains("5 times")
        ));
        // Crashes spread beyond the window restart again.
        let mut c = VecDeque::new();
        for i in 0..10u64 {
            let at = t0 + CRASH_WINDOW * i as u32 + Duration::from_secs(i);
            assert!(matches!(
                on_exit(Some(1), &mut c, at),
                Crash::Restart { .. }
            ));
        }
    }
}
