//! `strata`: the command-line entry point.

mod sim;

use clap::{Parser, Subcommand};

/// Strata: LLM serving with a hierarchical KV cache (device → host → disk/remote).
#[derive(Parser)]
#[command(name = "strata", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Replay a request trace through the tiered cache and report per-tier hit rates;
    /// `--sweep` draws the miss-ratio curve next to Belady's optimum.
    Sim(sim::SimArgs),
}

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("STRATA_LOG")
                .unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let res = match cli.command {
        Command::Sim(a) => sim::run(a),
    };
    if let Err(e) = res {
        eprintln!("error: {e:#}");
        std::process::exit(2);
    }
}
