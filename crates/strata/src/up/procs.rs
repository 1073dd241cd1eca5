//! The processes of `strata up`: started with their stderr read (its tail kept for error
//! messages, its ready line for the port the process itself bound), waited on until each is
//! healthy, stopped together.

use std::collections::VecDeque;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

/// What a process said on stderr: the last lines, and the address of its ready line.
#[derive(Default)]
pub(super) struct Output {
    pub tail: VecDeque<String>,
    /// The port of the process's own `ready on http://HOST:PORT` line, once it came.
    pub ready_port: Option<u16>,
}

/// The deployment's `host` without the brackets an IPv6 address may be written in (`[::1]`).
fn bare_host(host: &str) -> &str {
    host.strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host)
}

/// `http://HOST:PORT` for the deployment's `host`, an IPv6 address in brackets whether or not
/// the configuration wrote them (`::1` and `[::1]` alike).
pub(super) fn http_url(host: &str, port: u16) -> String {
    let h = bare_host(host);
    match h.parse::<std::net::Ipv6Addr>() {
        Ok(_) => format!("http://[{h}]:{port}"),
        Err(_) => format!("http://{h}:{port}"),
    }
}

/// One supervised process.
pub(super) struct Proc {
    pub name: String,
    pub args: Vec<String>,
    pub child: Child,
    pub out: Arc<Mutex<Output>>,
    /// The host it listens on, and its port: as configured, or (port 0) as it reported.
    pub host: String,
    pub port: u16,
    pub restarts: u32,
    pub next_restart: Option<Instant>,
    /// When it crashed, within the last [`super::supervise::CRASH_WINDOW`].
    pub crashes: VecDeque<Instant>,
    /// What its `/health` last said.
    pub health: Health,
}

/// What `up` last heard from a serving process's `/health`: when it asked, and since when
/// no healthy answer came.
#[derive(Default)]
pub(super) struct Health {
    pub asked: Option<Instant>,
    pub silent_since: Option<Instant>,
}

impl Proc {
    /// Starts `strata ARGS` as `name`, to listen on `host:port`.
    pub fn start(name: String, args: Vec<String>, host: &str, port: u16) -> Result<Proc> {
        let (child, out) = spawn(&name, &args)?;
        Ok(Proc {
            name,
            args,
            child,
            out,
            host: host.to_string(),
            port,
            restarts: 0,
            next_restart: None,
            crashes: VecDeque::new(),
            health: Default::default(),
        })
    }

    pub fn url(&self) -> String {
        http_url(&self.host, self.port)
    }

    /// The port its ready line named, once it came. A process given port 0 adopts it (and is
    /// restarted on it, so that the router's address for it stays true); one given a port
    /// that reports another is a fault.
    fn reported_port(&mut self) -> Result<Option<u16>> {
        let Some(p) = self.out.lock().expect("output lock").ready_port else {
            return Ok(None);
        };
        if self.port == 0 {
            self.port = p;
            if let Some(i) = self.args.iter().position(|a| a == "--port") {
                self.args[i + 1] = p.to_string();
            }
        } else if p != self.port {
            bail!(
                "{} reported port {p}, not its port {}",
                self.name,
                self.port
            );
        }
        Ok(Some(p))
    }
}

/// `strata ARGS` with its stderr forwarded line by line (prefixed with `name`) and read.
pub(super) fn spawn(name: &str, args: &[String]) -> Result<(Child, Arc<Mutex<Output>>)> {
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
    let out = Arc::new(Mutex::new(Output::default()));
    let err = child.stderr.take().expect("piped stderr");
    let (o, n) = (out.clone(), name.to_string());
    std::thread::spawn(move || {
        for line in BufReader::new(err).lines().map_while(Result::ok) {
            say!("[{n}] {line}");
            let mut q = o.lock().expect("output lock");
            if q.ready_port.is_none() {
                q.ready_port = ready_port(&line);
            }
            if q.tail.len() == 20 {
                q.tail.pop_front();
            }
            q.tail.push_back(line);
        }
    });
    Ok((child, out))
}

/// The port of a worker's or the router's ready line (`strata serve: ready on
/// http://HOST:PORT (...)`); only a line the process itself starts so counts.
fn ready_port(line: &str) -> Option<u16> {
    let rest = [
        "strata serve: ready on http://",
        "strata route: ready on http://",
    ]
    .iter()
    .find_map(|m| line.strip_prefix(m))?;
    let addr = rest.split_whitespace().next()?;
    addr.rsplit(':').next()?.parse().ok().filter(|&p| p != 0)
}

pub(super) fn terminate(procs: &mut [Proc]) {
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
    health_status(client, url)
        .await
        .is_some_and(|s| (200..300).contains(&s))
}

/// The status of `GET URL/health`, or None without an answer within 2 s.
pub(super) async fn health_status(client: &reqwest::Client, url: &str) -> Option<u16> {
    client
        .get(format!("{url}/health"))
        .timeout(Duration::from_secs(2))
        .send()
        .await
        .map(|r| r.status().as_u16())
        .ok()
}

/// What a process that exited said went wrong, as `: LINE`. One that exited with a code
/// (`coded`): its last stderr line that begins with `error` or tells of a panic, else its last
/// line. One a signal ended: its last line only if that is such a line (a panic aborting it),
/// else nothing (what it logged before, a request served, a panic it caught and survived, is
/// not why it died).
pub(super) fn reason(out: &Mutex<Output>, coded: bool) -> String {
    let q = out.lock().expect("output lock");
    let why = |l: &&String| l.starts_with("error") || l.contains("panicked at");
    let said = match coded {
        true => q.tail.iter().rev().find(why).or(q.tail.back()),
        false => q.tail.back().filter(why),
    };
    match said {
        Some(l) => format!(": {l}"),
        None if coded => ": (no output)".into(),
        None => String::new(),
    }
}

/// Waits until every process from `procs[first..]` has said it is ready on its own port and
/// answers `/health` there: a process is never taken for healthy because another answered
/// on its port. Any process that exits now stops everything with its own message and code.
pub(super) fn wait_healthy(
    rt: &tokio::runtime::Runtime,
    client: &reqwest::Client,
    procs: &mut Vec<Proc>,
    first: usize,
    deadline: Instant,
) -> Result<()> {
    let mut ready = vec![false; procs.len() - first];
    while ready.iter().any(|r| !r) {
        for i in 0..procs.len() {
            if let Some(status) = procs[i].child.try_wait()? {
                startup_exit(procs, i, status.code());
            }
            if i < first || ready[i - first] {
                continue;
            }
            let p = &mut procs[i];
            if p.reported_port()?.is_some() && rt.block_on(healthy(client, &p.url())) {
                ready[i - first] = true;
                say!("strata up: {} is healthy on {}", p.name, p.url());
            }
        }
        if Instant::now() > deadline {
            let late: Vec<&str> = (first..procs.len())
                .filter(|&i| !ready[i - first])
                .map(|i| procs[i].name.as_str())
                .collect();
            let late = late.join(", ");
            terminate(procs);
            bail!("{late} did not become healthy in time (--startup-timeout)");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    Ok(())
}

/// `procs[i]` exited during start-up: say why (naming the holder of a port it could not
/// take), stop the rest, exit with its code (1 if it exited 0).
fn startup_exit(procs: &mut Vec<Proc>, i: usize, code: Option<i32>) -> ! {
    std::thread::sleep(Duration::from_millis(100)); // let its last lines arrive
    let p = &procs[i];
    let mut why = reason(&p.out, code.is_some());
    if why.contains("in use") && p.port != 0 {
        if let Some((pid, cmd)) = super::ports::holder(p.port) {
            why = format!("{why} (port {} is held by pid {pid}: {cmd})", p.port);
        }
    }
    let code = code.filter(|&c| c != 0).unwrap_or(1);
    say!(
        "strata up: {} exited during start-up (exit code {code}){why}",
        p.name
    );
    say!("strata up: stopping everything; nothing is restarted after a start-up failure");
    let mut rest: Vec<Proc> = std::mem::take(procs);
    rest.remove(i);
    terminate(&mut rest);
    std::process::exit(code);
}

#[cfg(test)]
mod tests {
    /// An IPv6 host is bracketed in URLs (`host = "::1"` gave `http://::1:1`, refused) and
    /// bare where a socket is opened.
    #[test]
    fn ipv6_hosts_are_bracketed_in_urls() {
        assert_eq!(super::http_url("::1", 8), "http://[::1]:8");
        assert_eq!(super::http_url("[::1]", 8), "http://[::1]:8");
        assert_eq!(super::http_url("10.0.0.1", 8), "http://10.0.0.1:8");
        assert_eq!(super::bare_host("[::]"), "::");
    }

    use super::ready_port;

    #[test]
    fn only_a_processs_own_ready_line_gives_its_port() {
        assert_eq!(
            ready_port("strata serve: ready on http://127.0.0.1:8100 (model `m`, role decode)"),
            Some(8100)
        );
        assert_eq!(
            ready_port("strata route: ready on http://[::1]:9 (1 prefill, 1 decode workers)"),
            Some(9)
        );
        for no in [
            "[x] strata serve: ready on http://127.0.0.1:8100",
            "strata serve: ready on http://127.0.0.1:0",
            "strata serve: KV-transfer listener on 127.0.0.1:5",
        ] {
            assert_eq!(ready_port(no), None, "{no}");
        }
    }
}
