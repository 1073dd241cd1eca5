//! The command line before clap reads it: an option's value that starts with `-` and a digit
//! (`--hicache-size -1GB`, `--max-running -3`) is the option's, not a short flag. Clap would
//! read `-1` as an unknown flag ("unexpected argument '-1' found"); joined as
//! `--hicache-size=-1GB` it reaches the option's own check, which names what is wrong with it.
//! Which options take a value is the (sub)command's own: the words naming subcommands are
//! followed as clap follows them.

use std::collections::HashSet;
use std::ffi::OsString;

/// Long names (without `--`) of the options of `cmd` that take a value.
fn valued_longs(cmd: &clap::Command) -> HashSet<String> {
    cmd.get_arguments()
        .filter(|a| a.get_action().takes_values())
        .filter_map(|a| a.get_long().map(str::to_string))
        .collect()
}

/// Whether `v` reads as a negative number: `-` then a digit or a point.
fn negative(v: &OsString) -> bool {
    let b = v.as_encoded_bytes();
    b.len() > 1 && b[0] == b'-' && (b[1].is_ascii_digit() || b[1] == b'.')
}

/// `args` (the program's name first) with each `--NAME VALUE` where NAME takes a value in the
/// subcommand it is given to and VALUE reads as a negative number written `--NAME=VALUE`.
/// Nothing else changes, and nothing after `--` does.
pub fn join_negative_values(mut cmd: clap::Command, args: Vec<OsString>) -> Vec<OsString> {
    cmd.build();
    let mut at = &cmd;
    let mut valued = valued_longs(at);
    let mut out: Vec<OsString> = Vec::with_capacity(args.len());
    let mut rest = false;
    for arg in args {
        let prev = out
            .last()
            .and_then(|p| p.to_str())
            .filter(|_| out.len() > 1);
        let joined = match prev {
            Some(prev) if !rest && negative(&arg) => prev
                .strip_prefix("--")
                .filter(|name| !name.contains('=') && valued.contains(*name))
                .map(|_| {
                    let mut j = OsString::from(prev);
                    j.push("=");
                    j.push(&arg);
                    j
                }),
            _ => None,
        };
        if let Some(j) = joined {
            *out.last_mut().expect("a previous argument") = j;
            continue;
        }
        rest |= arg == "--";
        // A word naming a subcommand of the one being read: its options from here on.
        let sub = arg
            .to_str()
            .filter(|_| !rest && !out.is_empty())
            .and_then(|w| at.find_subcommand(w));
        if let Some(sub) = sub {
            at = sub;
            valued = valued_longs(at);
        }
        out.push(arg);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::{Arg, ArgAction, Command};

    /// A command named `name` (a clap command, not a program started).
    fn named(name: &'static str) -> Command {
        Command::new(name)
    }

    fn cmd() -> Command {
        named("t")
            .subcommand(
                named("plan")
                    .arg(Arg::new("size").long("hicache-size"))
                    .arg(Arg::new("flag").long("dry-run").action(ArgAction::SetTrue))
                    .arg(Arg::new("n").short('n').allow_negative_numbers(true)),
            )
            .subcommand(named("bench").arg(Arg::new("dry").long("dry-run")))
    }

    fn run(args: &[&str]) -> Vec<String> {
        let v = args.iter().map(OsString::from).collect();
        join_negative_values(cmd(), v)
            .into_iter()
            .map(|s| s.into_string().unwrap())
            .collect()
    }

    #[test]
    fn a_negative_value_joins_its_option() {
        assert_eq!(
            run(&["t", "plan", "--hicache-size", "-1GB"]),
            ["t", "plan", "--hicache-size=-1GB"]
        );
        assert_eq!(
            run(&["t", "bench", "--dry-run", "-1"]),
            ["t", "bench", "--dry-run=-1"]
        );
        assert_eq!(
            run(&["t", "plan", "--hicache-size", "-.5GB"]),
            ["t", "plan", "--hicache-size=-.5GB"]
        );
    }

    #[test]
    fn everything_else_is_left_as_written() {
        for args in [
            &["t", "plan", "--hicache-size", "1GB"][..],
            &["t", "plan", "--hicache-size=1GB", "-1"],
            &["t", "plan", "--dry-run", "-1"],
            &["t", "plan", "--hicache-size", "--dry-run"],
            &["t", "plan", "--hicache-size", "-x"],
            &["t", "plan", "--unknown", "-1"],
            &["t", "plan", "--", "--hicache-size", "-1GB"],
            &["t", "plan", "-n", "-1"],
            // A flag in `plan` that takes a value in another subcommand.
            &["t", "plan", "--dry-run", "-1"],
            // Before any subcommand, nothing takes a value.
            &["t", "--hicache-size", "-1GB"],
        ] {
            assert_eq!(run(args), args, "{args:?}");
        }
    }

    #[test]
    fn the_real_command_line_reads_a_negative_size_as_the_sizes() {
        use clap::{CommandFactory, Parser};
        let args = ["strata", "plan", "--hicache-size", "-1GB"].map(OsString::from);
        let joined = join_negative_values(crate::Cli::command(), args.to_vec());
        assert_eq!(joined[2], "--hicache-size=-1GB");
        assert!(crate::Cli::try_parse_from(joined).is_ok());
    }
}
