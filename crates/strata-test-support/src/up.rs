//! `strata up` started by a test: stopped with SIGTERM however the test ends (its workers stop
//! with it), every line of its stdout and stderr kept, and the ports of a deployment whose
//! ports are 0 read from its ready summary.

use std::io::{BufRead, BufReader, Read};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// A running `strata up`.
pub struct Up {
    pub child: Child,
    lines: mpsc::Receiver<String>,
    /// Every line read so far, stdout and stderr interleaved as they came.
    pub log: Vec<String>,
}

/// Where a ready deployment listens (from its summary).
#[derive(Debug, Clone)]
pub struct Ready {
    pub router: u16,
    /// Each worker's name (`prefill-0`, `decode-0`), port and pid.
    pub workers: Vec<(String, u16, i32)>,
}

impl Ready {
    /// The port of the worker named `name`.
    pub fn port(&self, name: &str) -> u16 {
        self.worker(name).1
    }

    /// The pid of the worker named `name`.
    pub fn pid(&self, name: &str) -> i32 {
        self.worker(name).2
    }

    fn worker(&self, name: &str) -> &(String, u16, i32) {
        self.workers
            .iter()
            .find(|w| w.0 == name)
            .unwrap_or_else(|| panic!("no worker {name} in {:?}", self.workers))
    }
}

impl Drop for Up {
    fn drop(&mut self) {
        self.terminate();
        let _ = self.child.wait();
    }
}

impl Up {
    /// `EXE up --config CONFIG --model MODEL` (EXE: the test's `strata` binary) with the
    /// deployment's state (its cluster key) under `state` (XDG_STATE_HOME), plus `extra`
    /// arguments.
    pub fn start(exe: &str, config: &Path, model: &Path, state: &Path, extra: &[&str]) -> Up {
        let mut child = Command::new(exe)
            .args(["up", "--startup-timeout", "90", "--config"])
            .arg(config)
            .arg("--model")
            .arg(model)
            .args(extra)
            .env("XDG_STATE_HOME", state)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let (tx, lines) = mpsc::channel();
        for s in [
            Box::new(child.stderr.take().unwrap()) as Box<dyn Read + Send>,
            Box::new(child.stdout.take().unwrap()),
        ] {
            let tx = tx.clone();
            std::thread::spawn(move || {
                for l in BufReader::new(s).lines().map_while(Result::ok) {
                    let _ = tx.send(l);
                }
            });
        }
        Up {
            child,
            lines,
            log: Vec::new(),
        }
    }

    /// SIGTERM: `strata up` stops its workers and exits 0.
    pub fn terminate(&mut self) {
        // SAFETY: kill(2) on the `strata up` this test started (still our child: not reaped).
        unsafe {
            libc::kill(self.child.id() as i32, libc::SIGTERM);
        }
    }

    /// The first line containing `what` (stdout and stderr interleave in any order, so the
    /// lines already read are looked at first), within `secs`.
    pub fn wait_for(&mut self, what: &str, secs: u64) -> String {
        crate::proc::wait_line(&self.lines, &mut self.log, what, secs)
    }

    /// Waits for the ready summary and reads the router's and each worker's port from it.
    pub fn ready(&mut self, secs: u64) -> Ready {
        self.wait_for("strata up: ready", secs);
        let api = self.wait_for("API (OpenAI-compatible): ", 10);
        let router = crate::port_after(api.trim_end_matches("/v1"), "API (OpenAI-compatible): ");
        self.wait_for("cluster key: ", 10);
        let workers = self
            .log
            .iter()
            .filter_map(|l| {
                let (name, rest) = l.trim().split_once(": http://")?;
                let (url, rest) = rest.split_once(" (pid ")?;
                let port = url.rsplit(':').next()?.parse().ok()?;
                let pid = rest.split(')').next()?.parse().ok()?;
                Some((name.to_string(), port, pid))
            })
            .collect();
        Ready { router, workers }
    }

    /// Every line so far (those not read yet are collected first, after `settle_ms`).
    pub fn drain(&mut self, settle_ms: u64) -> String {
        std::thread::sleep(Duration::from_millis(settle_ms));
        while let Ok(l) = self.lines.try_recv() {
            self.log.push(l);
        }
        self.log.join("\n")
    }

    /// The exit status, which must come within `secs`.
    pub fn wait_exit(&mut self, secs: u64) -> std::process::ExitStatus {
        let t = Instant::now();
        loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                return s;
            }
            assert!(
                t.elapsed() < Duration::from_secs(secs),
                "strata up did not exit within {secs} s"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}
