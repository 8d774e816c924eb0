//! Walking two sorted, keyed collections side by side ([`join`]): what the appliers' diffs of a
//! wanted state against the one they hold do at every lease event, over every entry, in one
//! pass and without a lookup.

use std::iter::Peekable;

/// Where a key of [`join`] was found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Joined<K, A, B> {
    /// Only in the first collection.
    First(K, A),
    /// In both.
    Both(K, A, B),
    /// Only in the second.
    Second(K, B),
}

/// The keys of `first` and `second`, each once, in ascending order, with the value each side
/// has. Both must yield their keys in strictly ascending order (as `BTreeMap`s and `BTreeSet`s
/// do); the result is unspecified otherwise.
pub fn join<K: Ord, A, B>(
    first: impl IntoIterator<Item = (K, A)>,
    second: impl IntoIterator<Item = (K, B)>,
) -> impl Iterator<Item = Joined<K, A, B>> {
    Join {
        first: first.into_iter().peekable(),
        second: second.into_iter().peekable(),
    }
}

struct Join<I: Iterator, J: Iterator> {
    first: Peekable<I>,
    second: Peekable<J>,
}

impl<K: Ord, A, B, I, J> Iterator for Join<I, J>
where
    I: Iterator<Item = (K, A)>,
    J: Iterator<Item = (K, B)>,
{
    type Item = Joined<K, A, B>;

    fn next(&mut self) -> Option<Self::Item> {
        let order = match (self.first.peek(), self.second.peek()) {
            (None, None) => return None,
            (Some(_), None) => std::cmp::Ordering::Less,
            (None, Some(_)) => std::cmp::Ordering::Greater,
            (Some((a, _)), Some((b, _))) => a.cmp(b),
        };
        match order {
            std::cmp::Ordering::Less => {
                let (k, a) = self.first.next()?;
                Some(Joined::First(k, a))
            }
            std::cmp::Ordering::Greater => {
                let (k, b) = self.second.next()?;
                Some(Joined::Second(k, b))
            }
            std::cmp::Ordering::Equal => {
                let (k, a) = self.first.next()?;
                let (_, b) = self.second.next()?;
                Some(Joined::Both(k, a, b))
            }
        }
    }
}

/// A random small map for tests of diffs: keys and values from small ranges, so that two of
/// them share keys, with equal values or not.
#[cfg(test)]
pub(crate) fn random_map(rng: &mut impl rand::Rng) -> std::collections::BTreeMap<u8, u8> {
    (0..rng.random_range(0..24))
        .map(|_| (rng.random_range(0..32), rng.random_range(0..3)))
        .collect()
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use rand::{SeedableRng as _, rngs::StdRng};

    use super::*;

    #[test]
    fn every_key_once_in_order_with_both_sides() {
        let a: BTreeMap<u8, char> = [(1, 'a'), (3, 'c'), (5, 'e')].into();
        let b: BTreeMap<u8, char> = [(0, 'z'), (3, 'C'), (6, 'F')].into();
        let joined: Vec<_> = join(&a, &b).collect();
        assert_eq!(
            joined,
            [
                Joined::Second(&0, &'z'),
                Joined::First(&1, &'a'),
                Joined::Both(&3, &'c', &'C'),
                Joined::First(&5, &'e'),
                Joined::Second(&6, &'F'),
            ]
        );
        assert_eq!(join(&a, &BTreeMap::<u8, u8>::new()).count(), 3);
        assert_eq!(
            join(&BTreeMap::<u8, u8>::new(), &BTreeMap::<u8, u8>::new()).count(),
            0
        );
    }

    /// Against looking every key up, on random pairs of small maps.
    #[test]
    fn join_equals_lookups() {
        let mut rng = StdRng::seed_from_u64(23);
        for _ in 0..2_000 {
            let (a, b) = (random_map(&mut rng), random_map(&mut rng));
            let mut keys: Vec<u8> = a.keys().chain(b.keys()).copied().collect();
            keys.sort_unstable();
            keys.dedup();
            let want: Vec<Joined<u8, u8, u8>> = keys
                .into_iter()
                .map(|k| match (a.get(&k), b.get(&k)) {
                    (Some(&x), Some(&y)) => Joined::Both(k, x, y),
                    (Some(&x), None) => Joined::First(k, x),
                    (None, Some(&y)) => Joined::Second(k, y),
                    (None, None) => unreachable!("a key of neither"),
                })
                .collect();
            let got: Vec<Joined<u8, u8, u8>> = join(&a, &b)
                .map(|j| match j {
                    Joined::First(k, x) => Joined::First(*k, *x),
                    Joined::Both(k, x, y) => Joined::Both(*k, *x, *y),
                    Joined::Second(k, y) => Joined::Second(*k, *y),
                })
                .collect();
            assert_eq!(got, want, "{a:?} {b:?}");
        }
    }
}
