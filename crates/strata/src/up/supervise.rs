//! `strata up` while serving: a process that crashes is restarted with backoff; one that exits
//! with a configuration error, or crashes too often, stops everything.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Result;

use super::procs::{reason, spawn, terminate, Proc};

/// Crashes of one process within [`CRASH_WINDOW`] after which `up` gives up.
const MAX_CRASHES: usize = 5;
pub(super) const CRASH_WINDOW: Duration = Duration::from_secs(600);
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
pub(super) fn supervise(rt: &tokio::runtime::Runtime, mut procs: Vec<Proc>) -> Result<()> {
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
                    let why = reason(&p.out);
                    match on_exit(status.code(), &mut p.crashes, Instant::now()) {
                        Crash::Restart { after } => {
                            p.restarts += 1;
                            say!(
                                "strata up: {} crashed ({status}: {why}); restart #{} in {} s",
                                p.name,
                                p.restarts,
                                after.as_secs()
                            );
                            p.next_restart = Some(Instant::now() + after);
                        }
                        Crash::GiveUp(because) => {
                            say!("strata up: {} exited ({status}): {why}", p.name);
                            say!(
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
                let (child, out) = spawn(&p.name, &p.args)?;
                p.child = child;
                p.out = out;
                p.next_restart = None;
                say!("strata up: {} restarted (pid {})", p.name, p.child.id());
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
