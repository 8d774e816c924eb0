//! The subcommands, as sequences of steps.

use std::{os::unix::process::CommandExt as _, time::Instant};

use anyhow::{Context as _, Result, bail};

use crate::{
    setup::{self, Plan},
    steps::{Steps, human},
    system::{self, Env, RealProbe},
};

/// `cargo xtask setup`: check every requirement, install what is missing (unless `check_only`),
/// and verify.
pub fn setup(env: &Env, check_only: bool) -> Result<()> {
    let start = Instant::now();
    let plan = setup::plan(&RealProbe::new(env));
    for w in &plan.warnings {
        eprintln!(
            "setup: warning: {} ({}): {}\n      -> {}",
            w.name, w.purpose, w.problem, w.fix
        );
    }
    if plan.actions.is_empty() && plan.blocked.is_empty() {
        eprintln!(
            "setup: all {} requirements present ({})",
            plan.present.len(),
            human(start.elapsed())
        );
        return Ok(());
    }
    report(&plan);
    if !plan.blocked.is_empty() {
        bail!(
            "{} requirement(s) cannot be installed by setup; run the commands above, then rerun \
             `cargo xtask setup`",
            plan.blocked.len()
        );
    }
    if check_only {
        bail!(
            "{} install step(s) needed; run `cargo xtask setup`",
            plan.actions.len()
        );
    }
    for action in &plan.actions {
        system::apply(env, action)?;
    }
    let after = setup::plan(&RealProbe::new(env));
    if !after.actions.is_empty() || !after.blocked.is_empty() {
        report(&after);
        bail!("setup ran but requirements are still missing");
    }
    eprintln!(
        "setup: all {} requirements present after installing ({})",
        after.present.len(),
        human(start.elapsed())
    );
    Ok(())
}

fn report(plan: &Plan) {
    if !plan.blocked.is_empty() {
        eprintln!("setup: missing, and setup cannot install it here:");
        for b in &plan.blocked {
            eprintln!(
                "  {} ({}): {}\n      -> {}",
                b.name, b.purpose, b.problem, b.fix
            );
        }
    }
    if !plan.actions.is_empty() {
        eprintln!("setup: will install:");
        for a in &plan.actions {
            eprintln!("  {a}");
        }
    }
}

/// `cargo xtask build [--release]`.
pub fn build(env: &Env, steps: &mut Steps, release: bool) -> Result<()> {
    steps.run("setup", || setup(env, false))?;
    let mut args = vec!["build"];
    if release {
        args.push("--release");
    }
    steps.run("build", || system::run(&mut env.cargo(&args)))
}

/// `cargo xtask test`.
pub fn test(
    env: &Env,
    steps: &mut Steps,
    no_lint: bool,
    filter: Option<&str>,
    test_args: &[String],
) -> Result<()> {
    steps.run("setup", || setup(env, false))?;
    if !no_lint {
        steps.run("fmt", || {
            system::run(&mut env.cargo(&["fmt", "--all", "--check"]))
                .context("formatting differs; run `cargo fmt --all`")
        })?;
        steps.run("clippy", || {
            system::run(&mut env.cargo(&[
                "clippy",
                "--workspace",
                "--all-targets",
                "--",
                "-D",
                "warnings",
            ]))
        })?;
        steps.run("doc", || {
            let mut cmd = env.cargo(&["doc", "--workspace", "--no-deps"]);
            cmd.env("RUSTDOCFLAGS", "-D warnings");
            system::run(&mut cmd).context("rustdoc warnings (broken or private links, HTML)")
        })?;
    }
    // --workspace also runs flannel-ebpf's host unit tests (the parser), which are not a
    // default member because its binary only builds for the bpf target. --no-fail-fast: one
    // run reports every failing test binary, not only the first.
    let test = |kind: &[&str]| {
        let mut cmd = env.cargo(&["test", "--workspace", "--no-fail-fast"]);
        cmd.args(kind);
        if let Some(f) = filter {
            cmd.arg(f);
        }
        if !test_args.is_empty() {
            cmd.arg("--").args(test_args);
        }
        system::run(&mut cmd)
    };
    steps.run("test", || test(&["--all-targets"]))?;
    steps.run("doctest", || test(&["--doc"]))
}

/// `cargo xtask run|bench`: release build, then `flannel-lab <verb> <args>` (replaces xtask).
pub fn lab(env: &Env, steps: &mut Steps, verb: &str, args: &[String]) -> Result<()> {
    steps.run("setup", || setup(env, false))?;
    steps.run("build", || {
        system::run(&mut env.cargo(&[
            "build",
            "--release",
            "-p",
            "flannel-agent",
            "-p",
            "flannel-cni",
            "-p",
            "flannel-tests",
        ]))
    })?;
    let lab = env.target_dir().join("release").join("flannel-lab");
    eprint!("{}", steps.summary());
    let mut cmd = env.command(&lab);
    cmd.arg(verb).args(args);
    eprintln!("==> {}", system::show(&cmd));
    let err = cmd.exec();
    Err(err).with_context(|| format!("could not run {}", lab.display()))
}
