//! Chat templates rendered in child processes. A template comes from the model file (a hostile
//! boundary), and the instruction budget of [`crate::jinja`] counts template instructions, not
//! the work of one built-in filter (`range(100000)|sum` is a few instructions) nor the memory
//! of a value (a string doubled 40 times is a terabyte). A child renders under an
//! address-space limit ([`MEMORY`]) and within a deadline ([`DEADLINE`]); one that runs past
//! either is killed and the render is an error naming the limit, and the server goes on.
//! Children are kept for the next render (one is started when none is idle).
//!
//! `strata` turns this on for every template it opens ([`enable`]) and answers [`CHILD_ARG`]
//! before it reads its command line ([`child_main`]); a library user that never calls
//! [`enable`] renders in its own process.

use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::error::ModelError;
use crate::jinja::{Message, RAN_PAST};

/// A child's address space (`RLIMIT_AS`): the program, and a conversation as large as a body
/// may be (4 MiB by default) rendered many times over.
pub const MEMORY: u64 = 1 << 30;
/// How long one render may take (real templates take microseconds to milliseconds,
/// docs/BENCHMARKS.md "Chat templates on a budget").
pub const DEADLINE: Duration = Duration::from_secs(5);
/// The most bytes a rendered prompt may have (far beyond any context).
const MAX_ANSWER: usize = 64 << 20;
/// The argument a child is started with.
pub const CHILD_ARG: &str = "__render-chat-template";
/// A child's exit code when a render ran past [`DEADLINE`] (it ends itself: a child whose
/// parent is gone never renders on for longer).
const PAST_DEADLINE: i32 = 4;

static PROGRAM: OnceLock<PathBuf> = OnceLock::new();

/// Renders every chat template opened after this in children started as `program
/// CHILD_ARG` (a program whose `main` calls [`child_main`] on that argument).
pub fn enable(program: PathBuf) {
    let _ = PROGRAM.set(program);
}

/// One render asked of a child.
#[derive(Serialize, Deserialize)]
struct Ask {
    messages: Vec<Message>,
    open: bool,
}

/// The children of one template: idle ones wait here.
pub(crate) struct Sandbox {
    source: String,
    program: PathBuf,
    idle: Mutex<Vec<Renderer>>,
}

/// A child and its pipes; killed when dropped.
struct Renderer {
    child: Child,
    stdin: ChildStdin,
    stdout: ChildStdout,
}

impl Drop for Renderer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Sandbox {
    /// The sandbox of `source`, when [`enable`] was called.
    pub(crate) fn new(source: &str) -> Option<Sandbox> {
        Some(Sandbox {
            source: source.to_string(),
            program: PROGRAM.get()?.clone(),
            idle: Mutex::new(Vec::new()),
        })
    }

    pub(crate) fn render(&self, messages: &[Message], open: bool) -> Result<String, ModelError> {
        let idle = self.idle.lock().unwrap_or_else(|p| p.into_inner()).pop();
        let mut r = match idle {
            Some(r) => r,
            None => self.start()?,
        };
        let ask = Ask {
            messages: messages.to_vec(),
            open,
        };
        // A child that failed is dropped (killed); one that answered waits for the next.
        let answer = r.ask(&ask).map_err(ModelError::Template)?;
        self.idle.lock().unwrap_or_else(|p| p.into_inner()).push(r);
        answer.map_err(ModelError::Template)
    }

    fn start(&self) -> Result<Renderer, ModelError> {
        let failed = |e: std::io::Error| {
            ModelError::Template(format!(
                "cannot start a renderer for the chat template: {e}"
            ))
        };
        let mut child = Command::new(&self.program)
            .arg(CHILD_ARG)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .map_err(failed)?;
        let (stdin, stdout) = (child.stdin.take(), child.stdout.take());
        let (Some(stdin), Some(stdout)) = (stdin, stdout) else {
            return Err(failed(std::io::Error::other("no pipes")));
        };
        let mut r = Renderer {
            child,
            stdin,
            stdout,
        };
        write_frame(&mut r.stdin, self.source.as_bytes()).map_err(failed)?;
        Ok(r)
    }
}

impl Renderer {
    /// The child's answer (Err inside: the template's own error), or why the child failed.
    fn ask(&mut self, a: &Ask) -> Result<Result<String, String>, String> {
        // The child ends itself at the deadline; this side waits a second more.
        let deadline = Instant::now() + DEADLINE + Duration::from_secs(1);
        let ask = serde_json::to_vec(a).map_err(|e| e.to_string())?;
        write_frame(&mut self.stdin, &ask).map_err(|_| self.ended())?;
        let len = self.read_by(4, deadline)?;
        let n = u32::from_le_bytes(len.try_into().expect("4 bytes")) as usize;
        if n > MAX_ANSWER {
            return Err(format!(
                "{RAN_PAST} its output limit: it wrote more than {} MiB",
                MAX_ANSWER >> 20
            ));
        }
        let body = self.read_by(n, deadline)?;
        serde_json::from_slice(&body).map_err(|e| format!("a renderer's answer: {e}"))
    }

    /// Why the child's pipe closed: its memory limit (an allocation that failed aborts it),
    /// or another end.
    fn ended(&mut self) -> String {
        let _ = self.child.kill();
        match self.child.wait() {
            Ok(s) if s.code() == Some(PAST_DEADLINE) => past_time(),
            Ok(s) if s.code().is_none() => format!(
                "{RAN_PAST} its memory of {} GiB (its renderer was stopped: {s})",
                MEMORY >> 30
            ),
            Ok(s) => format!("the chat template's renderer ended ({s})"),
            Err(e) => format!("the chat template's renderer: {e}"),
        }
    }

    /// `n` bytes of the child's answer, by `deadline`.
    fn read_by(&mut self, n: usize, deadline: Instant) -> Result<Vec<u8>, String> {
        let mut buf = vec![0u8; n];
        let mut got = 0;
        while got < n {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(past_time());
            }
            let mut pfd = libc::pollfd {
                fd: self.stdout.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            let ms = left.as_millis().clamp(1, i32::MAX as u128) as i32;
            // SAFETY: poll(2) on one pollfd that lives across the call, for a descriptor this
            // renderer owns.
            if unsafe { libc::poll(&mut pfd, 1, ms) } <= 0 {
                continue; // the deadline, or a signal: checked again above
            }
            match self.stdout.read(&mut buf[got..]) {
                Ok(0) => return Err(self.ended()),
                Ok(k) => got += k,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(_) => return Err(self.ended()),
            }
        }
        Ok(buf)
    }
}

fn past_time() -> String {
    format!("{RAN_PAST} its time of {} s", DEADLINE.as_secs())
}

fn write_frame(w: &mut impl Write, b: &[u8]) -> std::io::Result<()> {
    let n = u32::try_from(b.len()).map_err(|_| std::io::Error::other("a frame over 4 GiB"))?;
    w.write_all(&n.to_le_bytes())?;
    w.write_all(b)?;
    w.flush()
}

fn read_frame(r: &mut impl Read) -> Option<Vec<u8>> {
    let mut n = [0u8; 4];
    r.read_exact(&mut n).ok()?;
    let mut b = vec![0u8; u32::from_le_bytes(n) as usize];
    r.read_exact(&mut b).ok()?;
    Some(b)
}

/// A child's life: its address space limited to [`MEMORY`], the template's source first, then
/// one answer per [`Ask`] until its parent closes the pipe. Renders run on a thread of their
/// own; one that takes longer than [`DEADLINE`] ends the process.
pub fn child_main() -> ! {
    let limit = libc::rlimit {
        rlim_cur: MEMORY,
        rlim_max: MEMORY,
    };
    // SAFETY: setrlimit(2) with a valid struct; it only lowers this process's own limit.
    if unsafe { libc::setrlimit(libc::RLIMIT_AS, &limit) } != 0 {
        std::process::exit(3); // never render without the limit
    }
    let (mut input, mut output) = (std::io::stdin().lock(), std::io::stdout().lock());
    let Some(source) = read_frame(&mut input) else {
        std::process::exit(0);
    };
    let env = String::from_utf8(source)
        .map_err(|e| ModelError::Template(e.to_string()))
        .and_then(|s| crate::jinja::compile(&s));
    let (ask_tx, ask_rx) = std::sync::mpsc::channel::<Vec<u8>>();
    let (answer_tx, answer_rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for frame in ask_rx {
            let _ = answer_tx.send(answer(&env, &frame));
        }
    });
    while let Some(frame) = read_frame(&mut input) {
        let _ = ask_tx.send(frame);
        let Ok(answer) = answer_rx.recv_timeout(DEADLINE) else {
            std::process::exit(PAST_DEADLINE);
        };
        let out = serde_json::to_vec(&answer).expect("strings serialize");
        if write_frame(&mut output, &out).is_err() {
            break;
        }
    }
    std::process::exit(0)
}

/// The answer to one request `frame` with the compiled template `env`.
fn answer(
    env: &Result<minijinja::Environment<'static>, ModelError>,
    frame: &[u8],
) -> Result<String, String> {
    match (env, serde_json::from_slice::<Ask>(frame)) {
        (Ok(env), Ok(a)) => {
            crate::jinja::render_fueled(env, &a.messages, a.open).map_err(|e| match e {
                ModelError::Template(s) => s,
                other => other.to_string(),
            })
        }
        (Err(e), _) => Err(e.to_string()),
        (_, Err(e)) => Err(format!("a render's request: {e}")),
    }
}
