//! `strata`: the command-line entry point. It parses arguments and wires the libraries; each
//! subcommand lives in its own module or folder:
//!
//! * `serve/`: `strata serve`, one worker; `route`: `strata route`, the router; `up/`:
//!   `strata up`, a whole deployment as supervised processes.
//! * `plan`: `strata plan`; `sizing`: the sizing flags every allocating command shares;
//!   `advise_from`: `strata plan --advise-from URL`, sizes from a live miss-ratio curve.
//! * `sim/`: `strata sim` (replay, sweeps, sizing advice, window residency).
//! * `bench/`: `strata bench`, one file per subcommand and the pieces they share.
//! * `generate`: `strata model fetch|tiny|bench` and `strata generate`.
//! * `http_args`: the HTTP listener's bounds, shared by `serve` and `route`; `argv`: the
//!   command line before clap reads it (a negative value joined to its option); `outputs`: a
//!   file written when the work is done, checked before it starts.

/// `eprintln!` for processes that keep serving: a stderr nobody reads any more (a closed pipe)
/// loses the line instead of panicking the thread that said it.
macro_rules! say {
    ($($t:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), $($t)*);
    }};
}

mod advise_from;
mod argv;
mod bench;
mod generate;
mod http_args;
mod outputs;
mod plan;
mod route;
mod serve;
mod sim;
mod sizing;
mod up;

use clap::{CommandFactory, Parser, Subcommand};

/// Strata: LLM serving with a hierarchical KV cache (device → host → disk/remote).
#[derive(Parser)]
#[command(name = "strata", version, about, long_about = None)]
struct Cli {
    /// Log lines as plain text (colours only on a terminal) or as JSON objects, one a line.
    /// Also $STRATA_LOG_FORMAT; the level is $STRATA_LOG (default info).
    #[arg(
        long,
        global = true,
        value_enum,
        ignore_case = true,
        default_value_t = LogFormat::Text,
        env = "STRATA_LOG_FORMAT"
    )]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

/// Logs to stderr; ANSI colours only when stderr is a terminal (a log file gets plain text).
fn init_logs(format: LogFormat) {
    use std::io::IsTerminal;
    // A $STRATA_LOG that does not parse is said (after the logger starts), not dropped unseen.
    let (filter, bad) = match std::env::var("STRATA_LOG") {
        Err(_) => (tracing_subscriber::EnvFilter::new("info"), None),
        Ok(v) => match tracing_subscriber::EnvFilter::try_new(&v) {
            Ok(f) => (f, None),
            Err(e) => (tracing_subscriber::EnvFilter::new("info"), Some((v, e))),
        },
    };
    // A log line that cannot be written (stderr closed: a supervisor gone, a pipe nobody
    // reads) is dropped: the default would report it with eprintln!, which panics, and take
    // the request being logged down with it.
    let b = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .log_internal_errors(false);
    match format {
        LogFormat::Text => b.with_ansi(std::io::stderr().is_terminal()).init(),
        LogFormat::Json => b.json().init(),
    }
    if let Some((v, e)) = bad {
        tracing::warn!(value = %v, error = %e, "$STRATA_LOG does not parse (e.g. `info`, `strata=debug,warn`): logging at info");
    }
}

#[derive(Subcommand)]
enum Command {
    /// Replay a request trace through the tiered cache and report per-tier hit rates;
    /// `--sweep` draws the miss-ratio curve next to Belady's optimum.
    Sim(sim::SimArgs),
    /// Size every pool (per rank, per pool kind, per NUMA node) from the flags, check it fits,
    /// and print which flag decided each number. Exit code 2 when it does not fit.
    Plan(plan::PlanArgs),
    /// Model files: `strata model fetch`.
    #[command(subcommand)]
    Model(generate::ModelCommand),
    /// Generate text from a prompt with the model, printing tokens as they come.
    Generate(generate::GenerateArgs),
    /// Serve the OpenAI-compatible API from one worker (model, tiered cache, engine). The
    /// memory plan is printed before anything is allocated.
    Serve(Box<serve::ServeArgs>),
    /// Router + prefill + decode workers on this machine, the model fetched if missing,
    /// health-checked, smoke-tested; Ctrl-C stops them all.
    Up(up::UpArgs),
    /// The router: an OpenAI-compatible front door over prefill and decode workers.
    Route(route::RouteArgs),
    /// Measure a running server: TTFT per cache tier, decode throughput per concurrency.
    #[command(subcommand)]
    Bench(bench::BenchCommand),
}

fn main() {
    // A chat template renderer (this program, started by itself): nothing else of it runs.
    let sandbox = strata_model::template_sandbox::CHILD_ARG;
    if std::env::args_os().nth(1).is_some_and(|a| a == sandbox) {
        strata_model::template_sandbox::child_main();
    }
    // Chat templates render in children of this program under a memory limit and a deadline
    // (`/proc/self/exe`: still this program after its file is replaced by an upgrade).
    strata_model::template_sandbox::enable("/proc/self/exe".into());
    let args = argv::join_negative_values(Cli::command(), std::env::args_os().collect());
    let cli = match Cli::try_parse_from(args) {
        Ok(c) => c,
        Err(e) if !e.use_stderr() => e.exit(),
        Err(e) => {
            // One line: clap's error without the usage block (with the possible values, when
            // clap lists them).
            let text = e.render().to_string();
            let first = text.lines().next().unwrap_or("error: invalid arguments");
            match text.lines().find(|l| l.contains("[possible values:")) {
                Some(v) => eprintln!("{} {}", cut(first), v.trim()),
                None => eprintln!("{}", cut(first)),
            }
            std::process::exit(2);
        }
    };
    init_logs(cli.log_format);
    // Processes this one starts (`strata up`'s workers) log the same way.
    std::env::set_var(
        "STRATA_LOG_FORMAT",
        match cli.log_format {
            LogFormat::Text => "text",
            LogFormat::Json => "json",
        },
    );
    let res = match cli.command {
        Command::Sim(a) => sim::run(a),
        Command::Plan(a) => plan::run(a),
        Command::Model(c) => generate::run_model(c),
        Command::Generate(a) => generate::run_generate(a),
        Command::Serve(a) => serve::run(*a),
        Command::Bench(c) => bench::run(c),
        Command::Route(a) => route::run(a),
        Command::Up(a) => up::run(a),
    };
    if let Err(e) = res {
        eprintln!("error: {}", cut(&format!("{e:#}")));
        std::process::exit(2);
    }
}

/// Most bytes of one line of an error shown: what a flag, a file or a trace held is echoed in
/// it, and a 200 KB line (a TOML value, its column marker) would bury the reason.
const LINE_SHOWN: usize = 4096;

/// `text` with every line over [`LINE_SHOWN`] bytes cut in its middle (its start and its end
/// kept, where a parser's marker and reason are), the cut said.
fn cut(text: &str) -> String {
    let half = LINE_SHOWN / 2;
    let line = |l: &str| -> String {
        if l.len() <= LINE_SHOWN {
            return l.to_string();
        }
        let mut a = half;
        while !l.is_char_boundary(a) {
            a -= 1;
        }
        let mut b = l.len() - half;
        while !l.is_char_boundary(b) {
            b += 1;
        }
        format!("{} … ({} bytes cut) … {}", &l[..a], b - a, &l[b..])
    };
    text.split('\n').map(line).collect::<Vec<_>>().join("\n")
}
