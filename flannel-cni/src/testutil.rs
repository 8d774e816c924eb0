//! Helpers for unit tests.

use std::{
    fs,
    os::unix::fs::PermissionsExt,
    path::{Path, PathBuf},
};

/// Writes an executable shell script `name` into `dir` and returns its path.
#[allow(clippy::unwrap_used)]
pub fn script(dir: &Path, name: &str, body: &str) -> PathBuf {
    let path = dir.join(name);
    fs::write(&path, format!("#!/bin/sh\n{body}\n")).unwrap();
    fs::set_permissions(&path, fs::Permissions::from_mode(0o755)).unwrap();
    path
}

/// `input` with fewer than `max_edits` random edits, each replacing, removing or inserting one
/// character of `alphabet` at a random position (the never-panic tests' inputs).
pub fn mutate(
    rng: &mut rand::rngs::StdRng,
    input: &str,
    alphabet: &[char],
    max_edits: usize,
) -> String {
    use rand::Rng;
    let mut s: Vec<char> = input.chars().collect();
    for _ in 0..rng.random_range(0..max_edits) {
        let at = rng.random_range(0..=s.len());
        let c = alphabet[rng.random_range(0..alphabet.len())];
        if at < s.len() && rng.random_bool(0.5) {
            s[at] = c;
        } else if at < s.len() && rng.random_bool(0.3) {
            s.remove(at);
        } else {
            s.insert(at, c);
        }
    }
    s.into_iter().collect()
}
