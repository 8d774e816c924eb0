//! Running the delegate plugin: found in `CNI_PATH`, run with our `CNI_*` environment (only
//! `CNI_COMMAND` changed) and the delegate config on stdin, as the reference library's
//! `invoke.Delegate*` does.

use std::{
    io::{Read, Write},
    path::{Path, PathBuf},
    process::{Command, ExitStatus, Stdio},
    thread,
    time::Duration,
};

use serde::Deserialize;

use crate::cni::{CniEnv, CniError, code, io_text};

/// Finds `plugin` in the colon-separated `cni_path` (a regular file named exactly so).
pub fn find_in_path(plugin: &str, cni_path: &str) -> Result<PathBuf, CniError> {
    let err = |msg: String| CniError::new(code::DELEGATE_NOT_FOUND, msg);
    if plugin.is_empty() {
        return Err(err("no plugin name provided".into()));
    }
    if plugin.contains('/') {
        return Err(err(format!("invalid plugin name: {plugin}")));
    }
    let dirs: Vec<&str> = cni_path.split(':').filter(|d| !d.is_empty()).collect();
    if dirs.is_empty() {
        return Err(err("no paths provided".into()));
    }
    for dir in &dirs {
        let candidate = Path::new(dir).join(plugin);
        if candidate.metadata().is_ok_and(|m| m.is_file()) {
            return Ok(candidate);
        }
    }
    Err(err(format!(
        "failed to find plugin {plugin:?} in path [{}]",
        dirs.join(" ")
    ))
    .with_details(format!(
        "the delegate plugin {plugin:?} (delegate \"type\") must be installed in one of the CNI_PATH directories ({cni_path})"
    )))
}

/// What a delegate run produced.
#[derive(Debug)]
pub struct Output {
    /// Its stdout (the result JSON for ADD).
    pub stdout: Vec<u8>,
    /// Its stderr (informational).
    pub stderr: Vec<u8>,
}

/// Go's `exec.ExitError` text (`exit status 1`, `signal: 9`), used in upstream's messages.
fn status_text(status: ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(c), _) => format!("exit status {c}"),
        (None, Some(s)) => format!("signal: {s}"),
        _ => status.to_string(),
    }
}

/// The error object a failing plugin prints on stdout.
#[derive(Deserialize)]
struct PluginError {
    #[serde(default)]
    code: u32,
    #[serde(default)]
    msg: String,
    #[serde(default)]
    details: String,
}

/// Why a delegate run failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExecError {
    /// The delegate printed a CNI error: handed on unchanged (code, msg, details), as upstream
    /// does.
    Reported(CniError),
    /// The delegate could not be run, or failed without a usable CNI error.
    Failed(String),
}

impl ExecError {
    /// The CNI error to print; our own failures get [`code::DELEGATE_FAILED`] and `context`
    /// (e.g. `failed to delegate add`) in front.
    pub fn into_cni(self, context: &str) -> CniError {
        match self {
            ExecError::Reported(err) => err,
            ExecError::Failed(msg) => {
                CniError::new(code::DELEGATE_FAILED, format!("{context}: {msg}"))
            }
        }
    }
}

/// Runs `plugin` with `CNI_COMMAND=verb`, the other `CNI_*` variables from `env` and `stdin`.
pub fn exec(plugin: &Path, verb: &str, env: &CniEnv, stdin: &[u8]) -> Result<Output, ExecError> {
    let mut cmd = Command::new(plugin);
    cmd.env("CNI_COMMAND", verb)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (name, value) in [
        ("CNI_CONTAINERID", &env.container_id),
        ("CNI_NETNS", &env.netns),
        ("CNI_IFNAME", &env.ifname),
        ("CNI_ARGS", &env.args),
        ("CNI_PATH", &env.path),
        ("CNI_NETNS_OVERRIDE", &env.netns_override),
    ] {
        if value.is_empty() {
            cmd.env_remove(name);
        } else {
            cmd.env(name, value);
        }
    }

    // A plugin binary being replaced right now (ETXTBSY) is retried, as upstream does.
    const ETXTBSY: i32 = 26;
    let mut attempts = 0;
    let mut child = loop {
        match cmd.spawn() {
            Ok(child) => break child,
            Err(e) if e.raw_os_error() == Some(ETXTBSY) && attempts < 5 => {
                attempts += 1;
                thread::sleep(Duration::from_secs(1));
            }
            Err(e) => {
                return Err(ExecError::Failed(format!(
                    "cannot run {}: {}",
                    plugin.display(),
                    io_text(&e)
                )));
            }
        }
    };

    let mut child_stdin = child.stdin.take();
    let mut child_stdout = child.stdout.take();
    let mut child_stderr = child.stderr.take();
    let (stdout, stderr) = thread::scope(|s| {
        s.spawn(move || {
            if let Some(pipe) = child_stdin.as_mut() {
                // A plugin that exits without reading stdin closes the pipe; its exit status
                // tells what happened.
                let _ = pipe.write_all(stdin);
            }
        });
        let err_reader = s.spawn(move || {
            let mut buf = Vec::new();
            if let Some(pipe) = child_stderr.as_mut() {
                let _ = pipe.read_to_end(&mut buf);
            }
            buf
        });
        let mut out = Vec::new();
        if let Some(pipe) = child_stdout.as_mut() {
            let _ = pipe.read_to_end(&mut out);
        }
        (out, err_reader.join().unwrap_or_default())
    });
    let status = child.wait().map_err(|e| {
        ExecError::Failed(format!("waiting for {}: {}", plugin.display(), io_text(&e)))
    })?;

    if status.success() {
        return Ok(Output { stdout, stderr });
    }
    let status = status_text(status);
    if stdout.is_empty() {
        return Err(ExecError::Failed(if stderr.is_empty() {
            format!("netplugin failed with no error message: {status}")
        } else {
            format!(
                "netplugin failed: {:?}: {status}",
                String::from_utf8_lossy(&stderr)
            )
        }));
    }
    match serde_json::from_slice::<PluginError>(&stdout) {
        Ok(e) => Err(ExecError::Reported(CniError {
            code: e.code,
            msg: e.msg,
            details: e.details,
        })),
        Err(perr) => Err(ExecError::Failed(format!(
            "netplugin failed but error parsing its diagnostic message {:?}: {perr}",
            String::from_utf8_lossy(&stdout)
        ))),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::fs;

    use super::*;
    use crate::testutil::script;

    fn env(path: &str) -> CniEnv {
        CniEnv {
            command: "ADD".into(),
            container_id: "c1".into(),
            netns: "/run/netns/x".into(),
            ifname: "eth0".into(),
            args: "K8S_POD_NAME=p".into(),
            path: path.into(),
            netns_override: String::new(),
        }
    }

    #[test]
    fn finds_plugins_in_order() {
        let a = tempfile::tempdir().unwrap();
        let b = tempfile::tempdir().unwrap();
        let in_b = script(b.path(), "bridge", "true");
        fs::create_dir(a.path().join("bridge")).unwrap(); // a directory is skipped
        let path = format!("{}::{}", a.path().display(), b.path().display());
        assert_eq!(find_in_path("bridge", &path).unwrap(), in_b);
        let err = find_in_path("ipvlan", &path).unwrap_err();
        assert_eq!(err.code, code::DELEGATE_NOT_FOUND);
        assert_eq!(
            err.msg,
            format!(
                "failed to find plugin \"ipvlan\" in path [{} {}]",
                a.path().display(),
                b.path().display()
            )
        );
        assert!(err.details.contains(&path), "{}", err.details);
        assert_eq!(
            find_in_path("", &path).unwrap_err().msg,
            "no plugin name provided"
        );
        assert_eq!(
            find_in_path("../bin/sh", &path).unwrap_err().msg,
            "invalid plugin name: ../bin/sh"
        );
        assert_eq!(
            find_in_path("bridge", "").unwrap_err().msg,
            "no paths provided"
        );
    }

    #[test]
    fn passes_environment_and_stdin() {
        let dir = tempfile::tempdir().unwrap();
        let plugin = script(
            dir.path(),
            "echoer",
            "echo \"$CNI_COMMAND|$CNI_CONTAINERID|$CNI_NETNS|$CNI_IFNAME|$CNI_ARGS|$CNI_PATH|${CNI_NETNS_OVERRIDE-unset}\"; cat; echo note >&2",
        );
        let out = exec(&plugin, "DEL", &env("/p"), b"{\"a\":1}").unwrap();
        assert_eq!(
            String::from_utf8(out.stdout).unwrap(),
            "DEL|c1|/run/netns/x|eth0|K8S_POD_NAME=p|/p|unset\n{\"a\":1}"
        );
        assert_eq!(out.stderr, b"note\n");
    }

    #[test]
    fn delegate_errors_pass_through() {
        let dir = tempfile::tempdir().unwrap();
        let plugin = script(
            dir.path(),
            "failer",
            r#"echo '{"cniVersion":"1.0.0","code":11,"msg":"busy","details":"later"}'; exit 1"#,
        );
        let err = exec(&plugin, "ADD", &env("/p"), b"{}").unwrap_err();
        assert_eq!(
            err.into_cni("failed to delegate add"),
            CniError::new(11, "busy").with_details("later")
        );

        let plugin = script(dir.path(), "silent", "exit 3");
        let err = exec(&plugin, "ADD", &env("/p"), b"{}")
            .unwrap_err()
            .into_cni("failed to delegate add");
        assert_eq!(
            (err.code, err.msg.as_str()),
            (
                102,
                "failed to delegate add: netplugin failed with no error message: exit status 3"
            )
        );

        let plugin = script(dir.path(), "stderr", "echo boom >&2; exit 1");
        let err = exec(&plugin, "ADD", &env("/p"), b"{}").unwrap_err();
        assert_eq!(
            err,
            ExecError::Failed("netplugin failed: \"boom\\n\": exit status 1".into())
        );

        let plugin = script(dir.path(), "garbage", "echo not-json; exit 1");
        let err = exec(&plugin, "ADD", &env("/p"), b"{}")
            .unwrap_err()
            .into_cni("x");
        assert_eq!(err.code, 102);
        assert!(
            err.msg.starts_with(
                "x: netplugin failed but error parsing its diagnostic message \"not-json\\n\""
            ),
            "{}",
            err.msg
        );
    }

    #[test]
    fn unrunnable_plugin_is_delegate_failed() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("noexec");
        fs::write(&path, "#!/bin/sh\n").unwrap();
        let err = exec(&path, "ADD", &env("/p"), b"{}")
            .unwrap_err()
            .into_cni("x");
        assert_eq!(err.code, 102);
        assert!(err.msg.contains("permission denied"), "{}", err.msg);
    }
}
