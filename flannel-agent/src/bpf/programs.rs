//! Loading the fast path's programs into the kernel: all four at once, one thread each (the
//! verifier runs in the loading thread, and `tc_to_netdev` alone takes most of a start's
//! load time), and what the verifier reported for each.

use std::time::{Duration, Instant};

use aya::{
    Ebpf,
    programs::{Program, ProgramError},
};
use flannel_common::programs as names;

use super::BpfError;

/// The programs the agent loads (the object's measurement programs are never loaded).
pub const LOADED: [&str; 4] = [
    names::TC_FROM_BRIDGE,
    names::TC_FROM_NETDEV,
    names::TC_TO_NETDEV,
    names::XDP_FROM_NETDEV,
];

/// The kernel's limit on instructions the verifier may process per program
/// (`BPF_COMPLEXITY_LIMIT_INSNS`); a program that needs more is refused.
pub const VERIFIER_LIMIT: u32 = 1_000_000;

/// One program as loaded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Loaded {
    /// The program's name.
    pub name: &'static str,
    /// The instructions the verifier processed (`verified_insns`, Linux 5.16 and later; `None`
    /// on older kernels).
    pub verified_insns: Option<u32>,
    /// How long its load took, verification included.
    pub took: Duration,
}

impl std::fmt::Display for Loaded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {} ms", self.name, self.took.as_millis())?;
        match self.verified_insns {
            Some(n) => write!(f, " ({n} insns verified)"),
            None => Ok(()),
        }
    }
}

/// Loads [`LOADED`] into the kernel, in parallel; the first refusal (in [`LOADED`]'s order) is
/// returned once every load has finished (a loaded program is released with the object).
pub fn load_all(ebpf: &mut Ebpf) -> Result<Vec<Loaded>, BpfError> {
    let mut wanted: Vec<(&'static str, &mut Program)> = ebpf
        .programs_mut()
        .filter_map(|(name, program)| LOADED.iter().find(|n| **n == name).map(|n| (*n, program)))
        .collect();
    if let Some(name) = LOADED.iter().find(|n| !wanted.iter().any(|(w, _)| w == *n)) {
        return Err(BpfError::MissingProgram(name));
    }
    wanted.sort_by_key(|(name, _)| LOADED.iter().position(|n| n == name));
    std::thread::scope(|scope| {
        let loads: Vec<_> = wanted
            .into_iter()
            .map(|(name, program)| (name, scope.spawn(move || load_one(name, program))))
            .collect();
        // Every thread joined before the first error is returned: a panic left unjoined
        // would be re-raised when the scope ends.
        let results: Vec<Result<Loaded, BpfError>> = loads
            .into_iter()
            .map(|(name, load)| {
                load.join().unwrap_or_else(|_| {
                    Err(BpfError::Verifier {
                        program: name,
                        error: "the loading thread panicked".into(),
                        log: String::new(),
                    })
                })
            })
            .collect();
        results.into_iter().collect()
    })
}

fn load_one(name: &'static str, program: &mut Program) -> Result<Loaded, BpfError> {
    let start = Instant::now();
    let info = match program {
        Program::SchedClassifier(p) => {
            load_retrying(|| p.load()).map_err(|e| verifier_error(name, e))?;
            p.info()
        }
        Program::Xdp(p) => {
            load_retrying(|| p.load()).map_err(|e| verifier_error(name, e))?;
            p.info()
        }
        _ => return Err(BpfError::MissingProgram(name)),
    };
    Ok(Loaded {
        name,
        verified_insns: info.ok().and_then(|i| i.verified_instruction_count()),
        took: start.elapsed(),
    })
}

/// How often a program load interrupted by a signal is tried again.
const LOAD_ATTEMPTS: usize = 5;

/// Runs `load` again while the kernel answers `EAGAIN`: the verifier gives up with `EAGAIN`
/// when a signal is pending for the loading thread (libbpf retries the same way). A failed
/// load leaves the program unloaded, so calling it again is safe.
fn load_retrying(load: impl FnMut() -> Result<(), ProgramError>) -> Result<(), ProgramError> {
    retry_while(LOAD_ATTEMPTS, load, |e| {
        matches!(e, ProgramError::LoadError { io_error, .. }
            if io_error.raw_os_error() == Some(libc::EAGAIN))
    })
}

/// Calls `op` up to `attempts` times while it fails with an error `transient` accepts.
fn retry_while<E>(
    attempts: usize,
    mut op: impl FnMut() -> Result<(), E>,
    transient: impl Fn(&E) -> bool,
) -> Result<(), E> {
    let mut attempt = 1;
    loop {
        match op() {
            Err(e) if transient(&e) && attempt < attempts => {
                tracing::debug!(attempt, "program load interrupted (EAGAIN); trying again");
                attempt += 1;
            }
            other => return other,
        }
    }
}

fn verifier_error(program: &'static str, e: ProgramError) -> BpfError {
    match e {
        ProgramError::LoadError {
            io_error,
            verifier_log,
        } => BpfError::Verifier {
            program,
            error: io_error.to_string(),
            log: verifier_log.to_string(),
        },
        other => BpfError::Verifier {
            program,
            error: other.to_string(),
            log: String::new(),
        },
    }
}

#[cfg(test)]
mod retry_tests {
    use super::retry_while;

    fn eagain(e: &std::io::Error) -> bool {
        e.raw_os_error() == Some(libc::EAGAIN)
    }

    /// `retry_while(5, ..)` over an operation that fails with `errors` in turn, then succeeds:
    /// its result (the error's errno) and how often the operation ran.
    fn run(errors: &[i32]) -> (Result<(), Option<i32>>, usize) {
        let mut calls = 0;
        let result = retry_while(
            5,
            || {
                calls += 1;
                match errors.get(calls - 1) {
                    Some(&errno) => Err(std::io::Error::from_raw_os_error(errno)),
                    None => Ok(()),
                }
            },
            eagain,
        );
        (result.map_err(|e| e.raw_os_error()), calls)
    }

    #[test]
    fn transient_failures_are_retried_and_others_returned_at_once() {
        let (ok, calls) = run(&[libc::EAGAIN, libc::EAGAIN]);
        assert!(ok.is_ok());
        assert_eq!(calls, 3);

        let (denied, calls) = run(&[libc::EACCES, libc::EAGAIN]);
        assert_eq!(denied, Err(Some(libc::EACCES)));
        assert_eq!(calls, 1);

        let (gave_up, calls) = run(&[libc::EAGAIN; 6]);
        assert!(gave_up.is_err());
        assert_eq!(calls, 5);
    }
}
