//! Test support for the parsers' never-panic tests: seeded random edits of valid inputs.

use rand::{Rng, rngs::StdRng};

/// `input` with fewer than `max_edits` random edits, each replacing or inserting one
/// character of `alphabet` at a random position.
pub(crate) fn mutate(rng: &mut StdRng, input: &str, alphabet: &[char], max_edits: usize) -> String {
    let mut s: Vec<char> = input.chars().collect();
    for _ in 0..rng.random_range(0..max_edits) {
        let pos = rng.random_range(0..=s.len());
        let c = alphabet[rng.random_range(0..alphabet.len())];
        if pos < s.len() && rng.random_bool(0.5) {
            s[pos] = c;
        } else {
            s.insert(pos, c);
        }
    }
    s.into_iter().collect()
}
