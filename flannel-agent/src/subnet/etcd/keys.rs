//! The etcd key layout: `<prefix>/config` and `<prefix>/subnets/<subnet key>`.
//!
//! Upstream builds keys with Go's `path.Join`, which cleans the result (duplicate and trailing
//! slashes, `.` and `..` elements); [`Keys::new`] does the same, so `--etcd-prefix
//! /coreos.com/network/` addresses the same keys as upstream.

use crate::lease::SubnetKey;

/// The keys of one flannel network in etcd.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Keys {
    /// `<prefix>/config`.
    pub(crate) config: String,
    /// `<prefix>/subnets/`, with the trailing slash (the listing and watch prefix).
    pub(crate) subnets: String,
}

impl Keys {
    /// The keys under `prefix`.
    pub(crate) fn new(prefix: &str) -> Self {
        let mut subnets = join(prefix, "subnets");
        if !subnets.ends_with('/') {
            subnets.push('/');
        }
        Keys {
            config: join(prefix, "config"),
            subnets,
        }
    }

    /// The key of a lease: `<prefix>/subnets/10.5.52.0-24`.
    pub(crate) fn lease(&self, key: &SubnetKey) -> String {
        format!("{}{key}", self.subnets)
    }

    /// The part of a key under `<prefix>/subnets/` (the snapshot's lease id).
    pub(crate) fn lease_id<'a>(&self, key: &'a str) -> Option<&'a str> {
        key.strip_prefix(self.subnets.as_str())
            .filter(|id| !id.is_empty())
    }
}

/// Go's `path.Join(prefix, leaf)` for a non-empty `leaf`.
fn join(prefix: &str, leaf: &str) -> String {
    if prefix.is_empty() {
        clean(leaf)
    } else {
        clean(&format!("{prefix}/{leaf}"))
    }
}

/// Go's `path.Clean`.
fn clean(path: &str) -> String {
    let rooted = path.starts_with('/');
    let mut parts: Vec<&str> = Vec::new();
    for part in path.split('/') {
        match part {
            "" | "." => {}
            ".." => match parts.last() {
                Some(&last) if last != ".." => {
                    parts.pop();
                }
                _ if rooted => {}
                _ => parts.push(".."),
            },
            p => parts.push(p),
        }
    }
    let body = parts.join("/");
    match (rooted, body.is_empty()) {
        (true, _) => format!("/{body}"),
        (false, true) => ".".to_owned(),
        (false, false) => body,
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests fail loudly by design
mod tests {
    use super::*;

    #[test]
    fn clean_matches_go() {
        for (input, want) in [
            ("", "."),
            ("/", "/"),
            ("abc", "abc"),
            ("abc/def/", "abc/def"),
            ("a//b", "a/b"),
            ("/../a", "/a"),
            ("../../a", "../../a"),
            ("a/../..", ".."),
            ("a/./b/../c", "a/c"),
            ("//coreos.com//network/", "/coreos.com/network"),
        ] {
            assert_eq!(clean(input), want, "{input:?}");
        }
    }

    #[test]
    fn keys_follow_upstream_path_join() {
        let k = Keys::new("/coreos.com/network");
        assert_eq!(k.config, "/coreos.com/network/config");
        assert_eq!(k.subnets, "/coreos.com/network/subnets/");
        assert_eq!(Keys::new("/coreos.com/network/"), k);
        assert_eq!(Keys::new("/coreos.com//network"), k);
        let root = Keys::new("/");
        assert_eq!(root.config, "/config");
        assert_eq!(root.subnets, "/subnets/");
        let empty = Keys::new("");
        assert_eq!(empty.config, "config");
        assert_eq!(empty.subnets, "subnets/");

        let sk: SubnetKey = "10.5.52.0-24&fd00:1::-64".parse().unwrap();
        assert_eq!(
            k.lease(&sk),
            "/coreos.com/network/subnets/10.5.52.0-24&fd00:1::-64"
        );
        assert_eq!(
            k.lease_id("/coreos.com/network/subnets/10.5.52.0-24"),
            Some("10.5.52.0-24")
        );
        assert_eq!(k.lease_id("/coreos.com/network/subnets/"), None);
        assert_eq!(k.lease_id("/coreos.com/network/config"), None);
    }
}
