//! `strata up` while serving: a process that crashes is restarted with backoff; one that exits
//! with a configuration error, or crashes too often, stops everything. A process that stops
//! answering `/health` (hung, stopped; a worker whose engine stalled) for [`HUNG_AFTER`] is
//! killed, and restarted as a crash.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Result;

use super::procs::{health_status, reason, spawn, terminate, Health, Proc};

/// Crashes of one process within [`CRASH_WINDOW`] after which `up` gives up.
const MAX_CRASHES: usize = 5;
pub(super) const CRASH_WINDOW: Duration = Duration::from_secs(600);
/// A worker's exit code for a configuration error (bad flag, port taken, plan does not fit):
/// restarting cannot help.
const CONFIG_EXIT: i32 = 2;

/// How often a serving process's `/health` is asked (it may take 2 s to answer).
const PROBE_EVERY: Duration = Duration::from_secs(5);
/// How long a process may go without a healthy answer before it is killed (a worker's own
/// `/health` turns 503 after its scheduler stalled 60 s).
const HUNG_AFTER: Duration = Duration::from_secs(30);

/// What to do about a process that exited while serving.
#[derive(Debug, PartialEq, Eq)]
enum Crash {
    Restart { after: Duration },
    GiveUp(String),
}

/// Exit code 2 is a configuration error: never restarted, unless the process served before
/// with the same flags (`restarted`: a restart that found its port taken meanwhile is a
/// crash, not the configuration's fault). Other crashes restart with exponential backoff (1,
/// 2, 4 … 32 s) until [`MAX_CRASHES`] within [`CRASH_WINDOW`].
fn on_exit(
    code: Option<i32>,
    restarted: bool,
    crashes: &mut VecDeque<Instant>,
    now: Instant,
) -> Crash {
    if code == Some(CONFIG_EXIT) && !restarted {
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
pub(super) fn supervise(
    rt: &tokio::runtime::Runtime,
    client: &reqwest::Client,
    mut procs: Vec<Proc>,
) -> Result<()> {
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
                    let why = reason(&p.out, status.code().is_some());
                    let restarted = p.restarts > 0;
                    match on_exit(status.code(), restarted, &mut p.crashes, Instant::now()) {
                        Crash::Restart { after } => {
                            p.restarts += 1;
                            say!(
                                "strata up: {} crashed ({status}{why}); restart #{} in {} s",
                                p.name,
                                p.restarts,
                                after.as_secs()
                            );
                            p.next_restart = Some(Instant::now() + after);
                        }
                        Crash::GiveUp(because) => {
                            say!("strata up: {} exited ({status}){why}", p.name);
                            say!(
                                "strata up: not restarting {}: {because}; stopping everything",
                                p.name
                            );
                            let code = if status.code() == Some(CONFIG_EXIT) && !restarted {
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
                let (child, out) = spawn(&p.name, &p.args)?;
                p.child = child;
                p.out = out;
                p.next_restart = None;
                p.health = Health::default();
                say!("strata up: {} restarted (pid {})", p.name, p.child.id());
            }
            if p.next_restart.is_none() {
                watch_health(rt, client, p);
            }
        }
        if let Some(code) = give_up {
            // The one that exited is reaped already; this stops the rest.
            terminate(&mut procs);
            std::process::exit(code);
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    say!("strata up: stopping every process");
    terminate(&mut procs);
    Ok(())
}

/// Asks a serving process's `/health` every [`PROBE_EVERY`] (once its ready line came: a
/// process loading its model answers nothing); one without a healthy answer for
/// [`HUNG_AFTER`] is killed (the loop then restarts it as a crash). A router's 503 (no
/// healthy worker pair) is an answer: only a worker's own 503 is unhealthy.
fn watch_health(rt: &tokio::runtime::Runtime, client: &reqwest::Client, p: &mut Proc) {
    let now = Instant::now();
    let ready = p
        .out
        .lock()
        .map(|o| o.ready_port.is_some())
        .unwrap_or(false);
    if !ready
        || p.health
            .asked
            .is_some_and(|t| now.duration_since(t) < PROBE_EVERY)
    {
        return;
    }
    p.health.asked = Some(now);
    let healthy = match rt.block_on(health_status(client, &p.url())) {
        Some(code) => code < 500 || p.name == "router",
        None => false,
    };
    if healthy {
        p.health.silent_since = None;
        return;
    }
    let since = *p.health.silent_since.get_or_insert(now);
    if now.duration_since(since) >= HUNG_AFTER {
        say!(
            "strata up: {} has not answered /health healthily for {} s: killing it",
            p.name,
            HUNG_AFTER.as_secs()
        );
        let _ = p.child.kill();
        p.health = Health::default();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_configuration_error_is_never_restarted() {
        let mut c = VecDeque::new();
        assert!(matches!(
            on_exit(Some(2), false, &mut c, Instant::now()),
            Crash::GiveUp(m) if m.contains("configuration error")
        ));
        // A restart that finds its port taken meanwhile: a crash, tried again.
        assert!(matches!(
            on_exit(Some(2), true, &mut c, Instant::now()),
            Crash::Restart { .. }
        ));
    }

    #[test]
    fn crashes_back_off_then_give_up_within_the_window() {
        let mut c = VecDeque::new();
        let t0 = Instant::now();
        let mut waits = Vec::new();
        for i in 0..MAX_CRASHES - 1 {
            match on_exit(Some(70), false, &mut c, t0 + Duration::from_secs(i as u64)) {
                Crash::Restart { after } => waits.push(after.as_secs()),
                g => panic!("{g:?}"),
            }
        }
        assert_eq!(waits, vec![1, 2, 4, 8]);
        assert!(matches!(
            on_exit(None, false, &mut c, t0 + Duration::from_secs(10)),
            Crash::GiveUp(m) if m.contains("5 times")
        ));
        // Crashes spread beyond the window restart again.
        let mut c = VecDeque::new();
        for i in 0..10u64 {
            let at = t0 + CRASH_WINDOW * i as u32 + Duration::from_secs(i);
            assert!(matches!(
                on_exit(Some(1), false, &mut c, at),
                Crash::Restart { .. }
            ));
        }
    }
}
