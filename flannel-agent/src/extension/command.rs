//! One extension command as upstream (v0.28.2 and later) runs it: the string split on
//! whitespace, `$VAR` and `${VAR}` expanded in each word against the agent's environment plus
//! the command's own variables, the program executed directly (no shell: a variable's value
//! stays one literal argument, quotes stay quotes), the variables added to its environment,
//! stdin the given text and a newline, stdout and stderr captured together and trimmed.
//!
//! Unlike upstream a command that does not end is killed after [`Command::timeout`] (upstream
//! waits forever and its lease watch with it).

use std::{
    collections::HashMap,
    io::{Read as _, Write as _},
    process::Stdio,
    time::{Duration, Instant},
};

/// How long a command may run by default.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

/// How long the output is waited for once the command has ended.
const OUTPUT_GRACE: Duration = Duration::from_secs(2);

/// At most this much output is kept (the rest is read and dropped).
const MAX_OUTPUT: usize = 1 << 20;

/// Why a command failed.
#[derive(Debug, thiserror::Error)]
pub enum CommandError {
    /// It could not be started (no such program, not executable).
    #[error("{0}")]
    Spawn(std::io::Error),
    /// It exited unsuccessfully or was killed by a signal.
    #[error("{status}")]
    Status {
        /// How it ended.
        status: std::process::ExitStatus,
    },
    /// It ran longer than its timeout and was killed.
    #[error("still running after {0:?}, killed")]
    Timeout(Duration),
    /// Waiting for it failed.
    #[error("waiting for it: {0}")]
    Wait(std::io::Error),
}

/// A failed run: the error and whatever the command printed.
#[derive(Debug, thiserror::Error)]
#[error("failed to run command: {command} Err: {error} Output: {output}")]
pub struct Failed {
    /// The command as configured.
    pub command: String,
    /// What went wrong.
    pub error: CommandError,
    /// Its stdout and stderr, trimmed.
    pub output: String,
}

/// A configured command.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Command {
    /// The text as configured.
    pub text: String,
    /// How long it may run.
    pub timeout: Duration,
}

impl Command {
    /// The command `text` (configured non-blank, see `ExtensionOptions`).
    pub fn new(text: impl Into<String>) -> Self {
        Command {
            text: text.into(),
            timeout: DEFAULT_TIMEOUT,
        }
    }

    /// The words to execute, each expanded against the process environment and `vars` (which
    /// win), as upstream does.
    pub fn argv(&self, vars: &[(&str, String)]) -> Vec<String> {
        let mut env: HashMap<String, String> = std::env::vars_os()
            .filter_map(|(k, v)| Some((k.into_string().ok()?, v.into_string().ok()?)))
            .collect();
        for (k, v) in vars {
            env.insert((*k).to_owned(), v.clone());
        }
        self.text
            .split_whitespace()
            .map(|word| expand(word, |name| env.get(name).cloned().unwrap_or_default()))
            .collect()
    }

    /// Runs the command with `vars` in its environment and `stdin` (plus a newline) as its
    /// input; its trimmed output on success. Blocking: call it from a blocking task.
    pub fn run(&self, vars: &[(&str, String)], stdin: &str) -> Result<String, Failed> {
        let failed = |error, output: String| Failed {
            command: self.text.clone(),
            error,
            output,
        };
        let argv = self.argv(vars);
        let Some((program, args)) = argv.split_first() else {
            let none = std::io::Error::new(std::io::ErrorKind::InvalidInput, "empty command");
            return Err(failed(CommandError::Spawn(none), String::new()));
        };
        let (mut reader, writer) =
            std::io::pipe().map_err(|e| failed(CommandError::Spawn(e), String::new()))?;
        let child = {
            let mut cmd = std::process::Command::new(program);
            cmd.args(args)
                .envs(vars.iter().map(|(k, v)| (*k, v.as_str())))
                .stdin(Stdio::piped());
            let err = writer
                .try_clone()
                .map_err(|e| failed(CommandError::Spawn(e), String::new()))?;
            cmd.stdout(writer).stderr(err);
            // `cmd` (holding our copies of the pipe's write end) is dropped here, so that the
            // read below ends when the command's copies close.
            cmd.spawn()
        };
        let mut child = child.map_err(|e| failed(CommandError::Spawn(e), String::new()))?;
        let input = format!("{stdin}\n");
        let mut pipe = child.stdin.take();
        // Written from its own thread: a command that does not read its input must not block us.
        let feeder = std::thread::spawn(move || {
            if let Some(pipe) = pipe.as_mut() {
                let _ = pipe.write_all(input.as_bytes());
            }
        });
        let (sender, output) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut out = Vec::new();
            let mut buf = [0u8; 8192];
            while let Ok(n) = reader.read(&mut buf) {
                if n == 0 {
                    break;
                }
                let room = MAX_OUTPUT.saturating_sub(out.len());
                out.extend_from_slice(&buf[..n.min(room)]);
            }
            let _ = sender.send(out);
        });
        let deadline = Instant::now() + self.timeout;
        let status = loop {
            match child.try_wait() {
                Ok(Some(status)) => break Ok(status),
                Ok(None) if Instant::now() >= deadline => {
                    let _ = child.kill();
                    let _ = child.wait();
                    break Err(CommandError::Timeout(self.timeout));
                }
                Ok(None) => std::thread::sleep(Duration::from_millis(5)),
                Err(e) => break Err(CommandError::Wait(e)),
            }
        };
        let _ = feeder.join();
        // The output ends when every copy of the pipe is closed; a process the command left
        // running may hold one: then what it printed is not waited for.
        let output = output.recv_timeout(OUTPUT_GRACE).unwrap_or_default();
        let output = go_string(&output).trim().to_owned();
        match status {
            Ok(status) if status.success() => Ok(output),
            Ok(status) => Err(failed(CommandError::Status { status }, output)),
            Err(error) => Err(failed(error, output)),
        }
    }
}

/// Bytes as Go's JSON encoder sees a string: every byte of an invalid UTF-8 sequence becomes
/// one U+FFFD.
fn go_string(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len());
    for chunk in bytes.utf8_chunks() {
        out.push_str(chunk.valid());
        for _ in chunk.invalid() {
            out.push(char::REPLACEMENT_CHARACTER);
        }
    }
    out
}

/// Replaces `$NAME` and `${NAME}` in `s` with `lookup(NAME)`, with the rules of Go's
/// `os.Expand`: a name is a run of ASCII letters, digits and `_`, or one of the shell's special
/// characters (`*#$@!?-` and a digit) alone; `${}` and an unclosed `${` are dropped; a `$` with
/// no name after it (or at the end) stays.
pub fn expand(s: &str, lookup: impl Fn(&str) -> String) -> String {
    let b = s.as_bytes();
    let mut out = String::with_capacity(s.len());
    let mut copied = 0;
    let mut j = 0;
    while j < b.len() {
        if b[j] == b'$' && j + 1 < b.len() {
            out.push_str(&s[copied..j]);
            let (name, width) = shell_name(&s[j + 1..]);
            match name {
                Some(name) => out.push_str(&lookup(name)),
                // Bad syntax: the characters are eaten.
                None if width > 0 => {}
                None => out.push('$'),
            }
            j += width;
            copied = j + 1;
        }
        j += 1;
    }
    out.push_str(&s[copied.min(s.len())..]);
    out
}

fn is_special(c: u8) -> bool {
    matches!(c, b'*' | b'#' | b'$' | b'@' | b'!' | b'?' | b'-') || c.is_ascii_digit()
}

fn is_name(c: u8) -> bool {
    c == b'_' || c.is_ascii_alphanumeric()
}

/// The name after a `$` in `s` (non-empty) and how many bytes it takes.
fn shell_name(s: &str) -> (Option<&str>, usize) {
    let b = s.as_bytes();
    if b[0] == b'{' {
        if b.len() > 2 && is_special(b[1]) && b[2] == b'}' {
            return (Some(&s[1..2]), 3);
        }
        return match b.iter().skip(1).position(|&c| c == b'}') {
            Some(0) => (None, 2),
            Some(i) => (Some(&s[1..=i]), i + 2),
            None => (None, 1),
        };
    }
    if is_special(b[0]) {
        return (Some(&s[..1]), 1);
    }
    let n = b.iter().take_while(|&&c| is_name(c)).count();
    if n == 0 {
        (None, 0)
    } else {
        (Some(&s[..n]), n)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests fail loudly by design
mod tests {
    use super::*;

    fn vars(name: &str) -> String {
        match name {
            "SUBNET" => "10.244.3.0/24".into(),
            "A" => "a".into(),
            "1" => "one".into(),
            "$" => "pid".into(),
            "X_Y" => "xy".into(),
            _ => String::new(),
        }
    }

    #[test]
    fn expands_as_go_os_expand() {
        for (input, want) in [
            ("$SUBNET", "10.244.3.0/24"),
            ("${SUBNET}", "10.244.3.0/24"),
            ("\"$SUBNET\"", "\"10.244.3.0/24\""),
            ("via=$A,", "via=a,"),
            ("$X_Y.z", "xy.z"),
            ("$1x", "onex"),
            ("${1}", "one"),
            ("$$", "pid"),
            ("${$}", "pid"),
            ("$UNSET-", "-"),
            ("${A.b}", ""),
            ("cost$", "cost$"),
            ("a$/b", "a$/b"),
            ("a${}b", "ab"),
            ("a${b", "ab"),
            ("${", ""),
            ("$ ", "$ "),
            ("plain", "plain"),
            ("é$Aé", "éaé"),
        ] {
            assert_eq!(expand(input, vars), want, "{input}");
        }
    }

    #[test]
    fn words_are_split_and_expanded_one_by_one() {
        let cmd = Command::new("ip  route\treplace \"$SUBNET\" via ${PUBLIC_IP}");
        assert_eq!(
            cmd.argv(&[
                ("SUBNET", "10.0.1.0/24 x".into()),
                ("PUBLIC_IP", "192.0.2.7".into())
            ]),
            [
                "ip",
                "route",
                "replace",
                "\"10.0.1.0/24 x\"",
                "via",
                "192.0.2.7"
            ]
        );
    }

    fn script(dir: &tempfile::TempDir, name: &str, body: &str) -> String {
        use std::os::unix::fs::PermissionsExt as _;
        let path = dir.path().join(name);
        std::fs::write(&path, format!("#!/bin/sh\n{body}\n")).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
        path.display().to_string()
    }

    #[test]
    fn runs_with_variables_input_and_combined_output() {
        let dir = tempfile::tempdir().unwrap();
        let prog = script(
            &dir,
            "show",
            r#"read line; echo "arg=$1 env=$SUBNET in=$line"; echo warn >&2; printf '  '"#,
        );
        let cmd = Command::new(format!("{prog} ${{SUBNET}}"));
        let out = cmd
            .run(&[("SUBNET", "10.244.3.0/24".into())], "\"data\"")
            .unwrap();
        assert_eq!(out, "arg=10.244.3.0/24 env=10.244.3.0/24 in=\"data\"\nwarn");
    }

    #[test]
    fn failures_carry_status_and_output() {
        let dir = tempfile::tempdir().unwrap();
        let prog = script(&dir, "fail", "echo nope; exit 3");
        let err = Command::new(prog.clone()).run(&[], "").unwrap_err();
        assert!(matches!(err.error, CommandError::Status { .. }), "{err}");
        assert_eq!(
            err.to_string(),
            format!("failed to run command: {prog} Err: exit status: 3 Output: nope")
        );
        let missing = format!("{}/absent", dir.path().display());
        let err = Command::new(missing).run(&[], "").unwrap_err();
        assert!(matches!(err.error, CommandError::Spawn(_)), "{err}");
    }

    #[test]
    fn a_command_that_hangs_is_killed() {
        let dir = tempfile::tempdir().unwrap();
        let prog = script(&dir, "hang", "exec sleep 30");
        let mut cmd = Command::new(prog);
        cmd.timeout = Duration::from_millis(200);
        let started = Instant::now();
        let err = cmd.run(&[], "").unwrap_err();
        assert!(matches!(err.error, CommandError::Timeout(_)), "{err}");
        assert!(started.elapsed() < Duration::from_secs(10));
    }

    #[test]
    fn invalid_utf8_becomes_one_replacement_per_byte() {
        assert_eq!(
            go_string(b"a\xf0\x90\x80b\xff"),
            "a\u{fffd}\u{fffd}\u{fffd}b\u{fffd}"
        );
    }
}
