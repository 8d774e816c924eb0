//! `cargo xtask`: the project's tasks. Deliberately light (clap + anyhow) so that it builds
//! before `setup` has installed protoc, bpf-linker and the rest.
//!
//! | command | does |
//! |---|---|
//! | `setup` | installs what is missing (see [`setup::REQUIREMENTS`]); quick when nothing is |
//! | `build [--release]` | setup, then `cargo build` |
//! | `test [--no-lint] [FILTER] [-- ARGS]` | setup, fmt, clippy, rustdoc, every test |
//! | `run [ARGS]` | setup, release build, `flannel-lab up ARGS` |
//! | `bench [ARGS]` | setup, release build, `flannel-lab bench ARGS` |

mod llvm;
mod setup;
mod steps;
mod system;
mod tasks;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

use crate::{steps::Steps, system::Env};

#[derive(Parser)]
#[command(name = "cargo xtask", about = "flannel project tasks", version)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Install what is missing: Debian packages, nightly rust-src, bpf-linker, bpffs.
    Setup {
        /// Only report what is missing; install nothing.
        #[arg(long)]
        check: bool,
    },
    /// Setup, then build the workspace (the eBPF object included).
    Build {
        /// Build with the release profile.
        #[arg(long)]
        release: bool,
    },
    /// Setup, then `cargo fmt --check`, `cargo clippy -D warnings` and every test.
    Test {
        /// Skip fmt and clippy.
        #[arg(long)]
        no_lint: bool,
        /// Only run tests whose name contains this.
        filter: Option<String>,
        /// Arguments for the test binaries (after `--`), e.g. `--nocapture`.
        #[arg(last = true)]
        test_args: Vec<String>,
    },
    /// Setup, release build, then `flannel-lab up ARGS`: a simulated cluster.
    Run {
        /// Arguments for `flannel-lab up`.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Setup, release build, then `flannel-lab bench ARGS`.
    Bench {
        /// Arguments for `flannel-lab bench`.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let env = match Env::detect() {
        Ok(env) => env,
        Err(e) => {
            eprintln!("error: {e:#}");
            return ExitCode::FAILURE;
        }
    };
    let mut steps = Steps::default();
    let result = match cli.command {
        Cmd::Setup { check } => tasks::setup(&env, check),
        Cmd::Build { release } => tasks::build(&env, &mut steps, release),
        Cmd::Test {
            no_lint,
            filter,
            test_args,
        } => tasks::test(&env, &mut steps, no_lint, filter.as_deref(), &test_args),
        Cmd::Run { args } => tasks::lab(&env, &mut steps, "up", &args),
        Cmd::Bench { args } => tasks::lab(&env, &mut steps, "bench", &args),
    };
    if !steps.is_empty() {
        eprint!("{}", steps.summary());
    }
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory as _;

    use super::*;

    fn parse(args: &[&str]) -> Cmd {
        let mut argv = vec!["cargo xtask"];
        argv.extend_from_slice(args);
        match Cli::try_parse_from(argv) {
            Ok(cli) => cli.command,
            Err(e) => panic!("{args:?}: {e}"),
        }
    }

    #[test]
    fn cli_is_well_formed() {
        Cli::command().debug_assert();
    }

    #[test]
    fn test_takes_a_filter_and_harness_args() {
        match parse(&["test", "--no-lint", "bpf_classify", "--", "--nocapture"]) {
            Cmd::Test {
                no_lint,
                filter,
                test_args,
            } => {
                assert!(no_lint);
                assert_eq!(filter.as_deref(), Some("bpf_classify"));
                assert_eq!(test_args, ["--nocapture"]);
            }
            _ => panic!("not test"),
        }
        assert!(matches!(
            parse(&["test"]),
            Cmd::Test { no_lint: false, filter: None, ref test_args } if test_args.is_empty()
        ));
    }

    #[test]
    fn run_and_bench_pass_everything_through() {
        match parse(&["run", "--nodes", "3", "-v", "vxlan"]) {
            Cmd::Run { args } => assert_eq!(args, ["--nodes", "3", "-v", "vxlan"]),
            _ => panic!("not run"),
        }
        match parse(&["bench", "--help-me"]) {
            Cmd::Bench { args } => assert_eq!(args, ["--help-me"]),
            _ => panic!("not bench"),
        }
    }
}
