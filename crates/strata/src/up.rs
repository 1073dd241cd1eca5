//! `strata up`: router + prefill + decode workers as separate processes of this binary, from
//! an embedded default deployment (or a TOML file). Start-up failures stop everything once,
//! with the worker's own message and exit code; later crashes restart with backoff.

use std::collections::VecDeque;
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
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
    for c in children.iter() {
        // SAFETY: kill(2) on a child this process spawned (its pid is still ours until waited).
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
    let pd = !d.prefill.is_empty();
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
                "--numa-node".into(),
                node.to_string(),
                "--model".into(),
                model.display().to_string(),
                "--kv-host".into(),
                d.host.clone(),
            ];
            args.extend(w.args.iter().cloned());
            workers.push((
                format!("{role}-{i}"),
                args,
                format!("http://{}:{}", d.host, w.port),
            ));
        }
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let client = reqwest::Client::new();
    let mut procs: Vec<Proc> = Vec::new();
    for (name, args, url) in workers {
        eprintln!("strata up: starting {name} on {url}");
        let (child, tail) = spawn(&name, &args)?;
        procs.push(Proc {
            name,
            args,
            child,
            tail,
            url,
            restarts: 0,
            next_restart: None,
        });
    }
    // Wait for health; a worker that exits now stops everything with its own message and code.
    let deadline = Instant::now() + Duration::from_secs_f64(a.startup_timeout);
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
                let mut rest: Vec<Proc> = procs.into_iter().filter(|q| q.name != name).collect();
                terminate(&mut rest);
                std::process::exit(if code == 0 { 1 } else { code });
            }
            if !ready[i] && rt.block_on(healthy(&client, &p.url)) {
                ready[i] = true;
                eprintln!("strata up: {} is healthy", p.name);
            }
        }
        if Instant::now() > deadline {
            terminate(&mut procs);
            bail!(
                "not every worker became healthy within {} s",
                a.startup_timeout
            );
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    // The router.
    let router_url = format!("http://{}:{}", d.host, d.router.port);
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
    ];
    for p in &procs {
        let flag = if p.name.starts_with("prefill") {
            "--prefill"
        } else {
            "--decode"
        };
        rargs.push(flag.into());
        rargs.push(p.url.clone());
    }
    rargs.extend(d.router.args.iter().cloned());
    eprintln!("strata up: starting router on {router_url}");
    let (child, tail) = spawn("router", &rargs)?;
    procs.push(Proc {
        name: "router".into(),
        args: rargs,
        child,
        tail,
        url: router_url.clone(),
        restarts: 0,
        next_restart: None,
    });
    loop {
        let r = procs.last_mut().expect("router");
        if let Some(status) = r.child.try_wait()? {
            std::thread::sleep(Duration::from_millis(100));
            let why = reason(&r.tail);
            eprintln!(
                "strata up: the router exited during start-up (exit code {:?}): {why}",
                status.code()
            );
            terminate(&mut procs);
            std::process::exit(status.code().filter(|&c| c != 0).unwrap_or(1));
        }
        if rt.block_on(healthy(&client, &router_url)) {
            break;
        }
        if Instant::now() > deadline {
            terminate(&mut procs);
            bail!(
                "the router did not become healthy within {} s",
                a.startup_timeout
            );
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    if d.smoke_test {
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
            Ok((s, v)) => {
                terminate(&mut procs);
                bail!("smoke test failed: {s}: {v}");
            }
            Err(e) => {
                terminate(&mut procs);
                bail!("smoke test failed: {e}");
            }
        }
    }
    println!("strata up: ready");
    println!("  API (OpenAI-compatible): {router_url}/v1");
    for p in &procs[..procs.len() - 1] {
        println!("  {}: {} (pid {})", p.name, p.url, p.child.id());
    }
    println!("  Ctrl-C stops everything");
    supervise(&rt, procs)
}

/// Restarts crashed processes with backoff until Ctrl-C / SIGTERM, then stops them all.
fn supervise(rt: &tokio::runtime::Runtime, mut procs: Vec<Proc>) -> Result<()> {
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let s = stop.clone();
    rt.spawn(async move {
        crate::serve::shutdown_signal().await;
        s.store(true, std::sync::atomic::Ordering::SeqCst);
    });
    while !stop.load(std::sync::atomic::Ordering::SeqCst) {
        for p in procs.iter_mut() {
            if p.next_restart.is_none() {
                if let Some(status) = p.child.try_wait()? {
                    p.restarts += 1;
                    let wait = Duration::from_secs(1u64 << (p.restarts - 1).min(5));
                    eprintln!(
                        "strata up: {} crashed ({status}); restart #{} in {} s",
                        p.name,
                        p.restarts,
                        wait.as_secs()
                    );
                    p.next_restart = Some(Instant::now() + wait);
                }
            } else if p.next_restart.is_some_and(|t| Instant::now() >= t) {
                let (child, tail) = spawn(&p.name, &p.args)?;
                p.child = child;
                p.tail = tail;
                p.next_restart = None;
                eprintln!("strata up: {} restarted (pid {})", p.name, p.child.id());
            }
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    eprintln!("strata up: stopping every process");
    terminate(&mut procs);
    Ok(())
}
