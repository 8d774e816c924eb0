//! A scripted [`CommandRunner`] for unit tests: answers by command line, records every call.

use std::{
    collections::HashMap,
    io,
    sync::{Mutex, MutexGuard},
};

use super::runner::{CommandOutput, CommandRunner, command_line};

/// One recorded call: the command line and its stdin.
pub type Call = (String, Option<String>);

#[derive(Debug, Default)]
struct State {
    answers: HashMap<String, Vec<CommandOutput>>,
    files: HashMap<String, String>,
    calls: Vec<Call>,
}

/// Answers commands from a script; unknown programs are "not found".
#[derive(Debug, Default)]
pub struct FakeRunner {
    state: Mutex<State>,
}

fn ok(stdout: &str) -> CommandOutput {
    CommandOutput {
        success: true,
        status: "exit status: 0".to_owned(),
        stdout: stdout.to_owned(),
        stderr: String::new(),
    }
}

impl FakeRunner {
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// `cmdline` always succeeds with `stdout`.
    pub fn expect(&self, cmdline: &str, stdout: &str) {
        self.lock()
            .answers
            .insert(cmdline.to_owned(), vec![ok(stdout)]);
    }

    /// `cmdline` answers `outputs` in turn, repeating the last one.
    pub fn expect_seq(&self, cmdline: &str, outputs: &[&str]) {
        self.lock()
            .answers
            .insert(cmdline.to_owned(), outputs.iter().map(|s| ok(s)).collect());
    }

    /// `cmdline` fails with exit status 1 and `stderr`.
    pub fn expect_fail(&self, cmdline: &str, stderr: &str) {
        self.lock().answers.insert(
            cmdline.to_owned(),
            vec![CommandOutput {
                success: false,
                status: "exit status: 1".to_owned(),
                stdout: String::new(),
                stderr: stderr.to_owned(),
            }],
        );
    }

    /// A file visible through [`CommandRunner::read_file`].
    pub fn file(&self, path: &str, content: &str) {
        self.lock()
            .files
            .insert(path.to_owned(), content.to_owned());
    }

    /// Calls whose command line starts with `prefix`, in order.
    pub fn calls_of(&self, prefix: &str) -> Vec<Call> {
        self.lock()
            .calls
            .iter()
            .filter(|(c, _)| c.starts_with(prefix))
            .cloned()
            .collect()
    }
}

impl CommandRunner for FakeRunner {
    fn run(&self, program: &str, args: &[&str], stdin: Option<&[u8]>) -> io::Result<CommandOutput> {
        let line = command_line(program, args);
        let mut state = self.lock();
        state.calls.push((
            line.clone(),
            stdin.map(|s| String::from_utf8_lossy(s).into_owned()),
        ));
        match state.answers.get_mut(&line) {
            Some(outputs) if outputs.len() > 1 => Ok(outputs.remove(0)),
            Some(outputs) => outputs
                .first()
                .cloned()
                .ok_or_else(|| io::Error::other("empty script")),
            None => Err(io::Error::new(
                io::ErrorKind::NotFound,
                format!("{line}: not scripted"),
            )),
        }
    }

    fn read_file(&self, path: &str) -> io::Result<Option<String>> {
        Ok(self.lock().files.get(path).cloned())
    }
}
