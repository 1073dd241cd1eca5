//! A child process for tests against real servers: killed however the test ends, its stderr
//! lines kept (to wait for a line, or to count them); sockets from a chosen loopback address;
//! the test's own open-file limit raised.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// A child process killed however the test ends, with its stderr lines on a channel.
pub struct Proc {
    pub child: Child,
    lines: mpsc::Receiver<String>,
    pub log: Vec<String>,
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Proc {
    /// Starts `program` with `args`, stdout discarded, stderr read line by line.
    pub fn start(program: &str, args: &[String]) -> Proc {
        let mut child = Command::new(program)
            .args(args)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let (tx, lines) = mpsc::channel();
        let err = child.stderr.take().unwrap();
        std::thread::spawn(move || {
            for l in BufReader::new(err).lines().map_while(Result::ok) {
                let _ = tx.send(l);
            }
        });
        Proc {
            child,
            lines,
            log: Vec::new(),
        }
    }

    /// The first line containing `what` (waiting up to `secs`).
    pub fn wait_for(&mut self, what: &str, secs: u64) -> String {
        wait_line(&self.lines, &mut self.log, what, secs)
    }

    /// Every line so far (those not read yet are collected first).
    pub fn drain(&mut self) -> &[String] {
        while let Ok(l) = self.lines.try_recv() {
            self.log.push(l);
        }
        &self.log
    }

    /// The exit code, waiting up to `secs`; then every line the process wrote is in `log`
    /// (its stderr read to the end: the reader may lag behind the exit).
    pub fn exit_code(&mut self, secs: u64) -> Option<i32> {
        let t = Instant::now();
        loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                let end = Instant::now() + Duration::from_secs(5);
                while let Ok(l) = self
                    .lines
                    .recv_timeout(end.saturating_duration_since(Instant::now()))
                {
                    self.log.push(l);
                }
                return s.code();
            }
            assert!(t.elapsed() < Duration::from_secs(secs), "no exit");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// The first line containing `what` among those read into `log` (looked at first: lines of
/// two streams arrive in any order) or arriving on `lines` within `secs` (kept in `log`).
pub(crate) fn wait_line(
    lines: &mpsc::Receiver<String>,
    log: &mut Vec<String>,
    what: &str,
    secs: u64,
) -> String {
    if let Some(l) = log.iter().find(|l| l.contains(what)) {
        return l.clone();
    }
    let t = Instant::now();
    loop {
        let left = Duration::from_secs(secs).saturating_sub(t.elapsed());
        match lines.recv_timeout(left) {
            Ok(l) => {
                log.push(l.clone());
                if l.contains(what) {
                    return l;
                }
            }
            Err(_) => panic!("no `{what}` within {secs} s:\n{}", log.join("\n")),
        }
    }
}

/// The port in a line like `... ready on http://127.0.0.1:PORT ...` after `marker`.
pub fn port_after(line: &str, marker: &str) -> u16 {
    let rest = &line[line.find(marker).unwrap() + marker.len()..];
    let hostport: String = rest
        .chars()
        .take_while(|c| !c.is_whitespace() && *c != ')')
        .collect();
    hostport.rsplit(':').next().unwrap().parse().unwrap()
}

/// A TCP connection to `to` from the local address `from` (e.g. 127.0.0.2: one of several
/// loopback "hosts").
pub fn connect_from(from: IpAddr, to: SocketAddr) -> std::io::Result<TcpStream> {
    let s = socket2::Socket::new(
        socket2::Domain::for_address(to),
        socket2::Type::STREAM,
        Some(socket2::Protocol::TCP),
    )?;
    s.bind(&SocketAddr::new(from, 0).into())?;
    s.connect_timeout(&to.into(), Duration::from_secs(5))?;
    Ok(s.into())
}

/// Raises this process's open-file limit to `want` (the hard limit too, where allowed:
/// root); returns the soft limit in force.
pub fn raise_fd_limit(want: u64) -> u64 {
    use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};
    let r = getrlimit(Resource::Nofile);
    let hard = r.maximum.unwrap_or(u64::MAX);
    if hard < want {
        let _ = setrlimit(
            Resource::Nofile,
            Rlimit {
                current: Some(want),
                maximum: Some(want),
            },
        );
    }
    let r = getrlimit(Resource::Nofile);
    let hard = r.maximum.unwrap_or(u64::MAX);
    let _ = setrlimit(
        Resource::Nofile,
        Rlimit {
            current: Some(want.min(hard)),
            maximum: r.maximum,
        },
    );
    getrlimit(Resource::Nofile).current.unwrap_or(u64::MAX)
}

/// One HTTP/1.1 request to 127.0.0.1:`port` with extra header lines (each ending in CRLF),
/// the connection closed after it; (status, headers + body as text).
pub fn http1(port: u16, method: &str, path: &str, headers: &str, body: &str) -> (u16, String) {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\n{headers}content-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    let status = out.get(9..12).and_then(|x| x.parse().ok()).unwrap_or(0);
    (status, out)
}

/// `body` POSTed as JSON to `http://127.0.0.1:PORT{path}` (curl); the answer as JSON (panics
/// with its text when it is not).
pub fn post_json(port: u16, path: &str, body: &serde_json::Value) -> serde_json::Value {
    let o = std::process::Command::new("curl")
        .args(["-s", "-H", "content-type: application/json", "-d"])
        .arg(body.to_string())
        .arg(format!("http://127.0.0.1:{port}{path}"))
        .output()
        .expect("curl is missing: install the Debian package curl (scripts/test.sh does)");
    serde_json::from_slice(&o.stdout)
        .unwrap_or_else(|_| panic!("not JSON: {}", String::from_utf8_lossy(&o.stdout)))
}

/// `GET http://127.0.0.1:PORT{path}` (curl), the answer as JSON (panics with its text when
/// it is not).
pub fn get_json(port: u16, path: &str) -> serde_json::Value {
    let o = std::process::Command::new("curl")
        .args(["-s", &format!("http://127.0.0.1:{port}{path}")])
        .output()
        .expect("curl is missing: install the Debian package curl (scripts/test.sh does)");
    serde_json::from_slice(&o.stdout)
        .unwrap_or_else(|_| panic!("not JSON: {}", String::from_utf8_lossy(&o.stdout)))
}

/// `GET /metrics` of the worker or router on 127.0.0.1:`port` (curl), as text.
pub fn metrics_text(port: u16) -> String {
    let o = std::process::Command::new("curl")
        .args(["-s", &format!("http://127.0.0.1:{port}/metrics")])
        .output()
        .expect("curl is missing: install the Debian package curl (scripts/test.sh does)");
    String::from_utf8_lossy(&o.stdout).into_owned()
}
