//! The command line before clap reads it: an option's value that starts with `-` and a digit
//! (`--hicache-size -1GB`, `--hicache-ratio -2`) is the option's, not a short flag. Clap would
//! read `-1` as an unknown flag ("unexpected argument '-1' found"); joined as
//! `--hicache-size=-1GB` it reaches the option's own check, which names what is wrong with it.

use std::collections::HashSet;
use std::ffi::OsString;

/// Long names (without `--`) of every option, in any subcommand, that takes a value.
fn valued_longs(cmd: &clap::Command, out: &mut HashSet<String>) {
    for a in cmd.get_arguments() {
        if let Some(long) = a.get_long() {
            if a.get_action().takes_values() {
                out.insert(long.to_string());
            }
        }
    }
    for s in cmd.get_subcommands() {
        valued_longs(s, out);
    }
}

/// `args` with each `--NAME VALUE` where NAME takes a value and VALUE reads as a negative
/// number (`-` then a digit or a point) written `--NAME=VALUE`. Nothing else changes, and
/// nothing after `--` does.
pub fn join_negative_values(cmd: &clap::Command, args: Vec<OsString>) -> Vec<OsString> {
    let mut valued = HashSet::new();
    valued_longs(cmd, &mut valued);
    let negative = |v: &OsString| {
        let b = v.as_encoded_bytes();
        b.len() > 1 && b[0] == b'-' && (b[1].is_ascii_digit() || b[1] == b'.')
    };
    let mut out: Vec<OsString> = Vec::with_capacity(args.len());
    let mut rest = false;
    for arg in args {
        let joined = match out.last().and_then(|p| p.to_str()) {
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
        match joined {
            Some(j) => *out.last_mut().expect("a previous argument") = j,
            None => {
                rest |= arg == "--";
                out.push(arg);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::{Arg, ArgAction, Command};

    fn cmd() -> Command {
        Command::new("t").subcommand(
            Command::new("plan")
                .arg(Arg::new("size").long("hicache-size"))
                .arg(Arg::new("flag").long("dry-run").action(ArgAction::SetTrue))
                .arg(Arg::new("n").short('n').allow_negative_numbers(true)),
        )
    }

    fn run(args: &[&str]) -> Vec<String> {
        let v = args.iter().map(OsString::from).collect();
        join_negative_values(&cmd(), v)
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
        ] {
            assert_eq!(run(args), args, "{args:?}");
        }
    }

    #[test]
    fn the_real_command_line_reads_a_negative_size_as_the_sizes() {
        use clap::{CommandFactory, Parser};
        let args = ["strata", "plan", "--hicache-size", "-1GB"].map(OsString::from);
        let joined = join_negative_values(&crate::Cli::command(), args.to_vec());
        assert_eq!(joined[2], "--hicache-size=-1GB");
        assert!(crate::Cli::try_parse_from(joined).is_ok());
    }
}
