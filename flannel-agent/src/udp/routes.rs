//! The udp backend's routing table: remote subnet → the UDP endpoint of the node that holds
//! it (its public IP and *our* configured port, as upstream). Built from the desired
//! dataplane on every reconcile and swapped into the forwarder as a whole.
//!
//! Lookups are longest-prefix matches without allocation: entries are grouped by prefix
//! length (longest first), each group sorted by network address and binary-searched. A
//! cluster normally has one subnet length, so a lookup is one masked binary search.

use std::net::{Ipv4Addr, SocketAddrV4};

use ipnet::Ipv4Net;

/// One remote subnet and where its packets are sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct UdpRoute {
    /// The remote node's subnet (host bits are ignored).
    pub subnet: Ipv4Net,
    /// The remote node's public IP and the UDP port.
    pub endpoint: SocketAddrV4,
}

/// A longest-prefix-match table of [`UdpRoute`]s.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct UdpRoutes {
    /// `(prefix length, sorted (network, endpoint))`, longest prefix first.
    groups: Vec<(u8, Vec<(u32, SocketAddrV4)>)>,
    len: usize,
}

fn mask(prefix_len: u8) -> u32 {
    match prefix_len {
        0 => 0,
        n => u32::MAX << (32 - u32::from(n.min(32))),
    }
}

impl UdpRoutes {
    /// A table of `routes`. When the same subnet appears twice the first one wins (the
    /// desired-state computation already drops overlapping leases, so this does not happen
    /// in practice).
    pub fn new(routes: impl IntoIterator<Item = UdpRoute>) -> Self {
        let mut groups: Vec<(u8, Vec<(u32, SocketAddrV4)>)> = Vec::new();
        for r in routes {
            let len = r.subnet.prefix_len();
            let net = u32::from(r.subnet.network());
            let group = match groups.iter_mut().position(|(l, _)| *l == len) {
                Some(i) => &mut groups[i].1,
                None => {
                    groups.push((len, Vec::new()));
                    let last = groups.len() - 1;
                    &mut groups[last].1
                }
            };
            group.push((net, r.endpoint));
        }
        let mut len = 0;
        for (_, entries) in &mut groups {
            // Stable sort + dedup keeps the first endpoint given for a subnet.
            entries.sort_by_key(|(net, _)| *net);
            entries.dedup_by_key(|(net, _)| *net);
            len += entries.len();
        }
        groups.sort_by_key(|g| std::cmp::Reverse(g.0));
        Self { groups, len }
    }

    /// The endpoint for destination `dst`: the entry with the longest prefix containing it.
    pub fn lookup(&self, dst: Ipv4Addr) -> Option<SocketAddrV4> {
        let ip = u32::from(dst);
        for (len, entries) in &self.groups {
            let key = ip & mask(*len);
            if let Ok(i) = entries.binary_search_by_key(&key, |(net, _)| *net) {
                return Some(entries[i].1);
            }
        }
        None
    }

    /// Number of routes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the table is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Every route, longest prefixes first, then by address.
    pub fn iter(&self) -> impl Iterator<Item = UdpRoute> + '_ {
        self.groups.iter().flat_map(|(len, entries)| {
            entries.iter().map(move |(net, endpoint)| UdpRoute {
                subnet: Ipv4Net::new(Ipv4Addr::from(*net), *len).unwrap_or_default(),
                endpoint: *endpoint,
            })
        })
    }

    /// The route for exactly `subnet`, if present.
    pub fn get(&self, subnet: Ipv4Net) -> Option<SocketAddrV4> {
        let (_, entries) = self
            .groups
            .iter()
            .find(|(len, _)| *len == subnet.prefix_len())?;
        let key = u32::from(subnet.network());
        entries
            .binary_search_by_key(&key, |(net, _)| *net)
            .ok()
            .map(|i| entries[i].1)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests fail loudly by design
mod tests {
    use super::*;

    fn route(subnet: &str, ip: [u8; 4]) -> UdpRoute {
        UdpRoute {
            subnet: subnet.parse().unwrap(),
            endpoint: SocketAddrV4::new(Ipv4Addr::from(ip), 8285),
        }
    }

    fn ep(ip: [u8; 4]) -> Option<SocketAddrV4> {
        Some(SocketAddrV4::new(Ipv4Addr::from(ip), 8285))
    }

    #[test]
    fn finds_the_containing_subnet() {
        let t = UdpRoutes::new([
            route("10.244.3.0/24", [192, 168, 1, 13]),
            route("10.244.2.0/24", [192, 168, 1, 12]),
            route("10.244.200.0/24", [192, 168, 1, 14]),
        ]);
        assert_eq!(t.len(), 3);
        assert_eq!(
            t.lookup("10.244.2.0".parse().unwrap()),
            ep([192, 168, 1, 12])
        );
        assert_eq!(
            t.lookup("10.244.2.255".parse().unwrap()),
            ep([192, 168, 1, 12])
        );
        assert_eq!(
            t.lookup("10.244.3.77".parse().unwrap()),
            ep([192, 168, 1, 13])
        );
        assert_eq!(
            t.lookup("10.244.200.1".parse().unwrap()),
            ep([192, 168, 1, 14])
        );
        assert_eq!(t.lookup("10.244.4.1".parse().unwrap()), None);
        assert_eq!(t.lookup("10.244.1.1".parse().unwrap()), None);
        assert_eq!(t.lookup("0.0.0.0".parse().unwrap()), None);
        assert_eq!(
            t.get("10.244.3.0/24".parse().unwrap()),
            ep([192, 168, 1, 13])
        );
        assert_eq!(t.get("10.244.3.0/25".parse().unwrap()), None);
    }

    #[test]
    fn longest_prefix_wins_and_duplicates_keep_the_first() {
        let t = UdpRoutes::new([
            route("10.0.0.0/8", [1, 1, 1, 1]),
            route("10.244.0.0/16", [2, 2, 2, 2]),
            route("10.244.7.0/24", [3, 3, 3, 3]),
            route("10.244.7.0/24", [4, 4, 4, 4]),
            route("0.0.0.0/0", [5, 5, 5, 5]),
            route("10.244.7.9/32", [6, 6, 6, 6]),
        ]);
        assert_eq!(t.len(), 5);
        assert_eq!(t.lookup("10.244.7.9".parse().unwrap()), ep([6, 6, 6, 6]));
        assert_eq!(t.lookup("10.244.7.8".parse().unwrap()), ep([3, 3, 3, 3]));
        assert_eq!(t.lookup("10.244.8.1".parse().unwrap()), ep([2, 2, 2, 2]));
        assert_eq!(t.lookup("10.1.1.1".parse().unwrap()), ep([1, 1, 1, 1]));
        assert_eq!(t.lookup("8.8.8.8".parse().unwrap()), ep([5, 5, 5, 5]));
        let listed: Vec<String> = t.iter().map(|r| r.subnet.to_string()).collect();
        assert_eq!(
            listed,
            [
                "10.244.7.9/32",
                "10.244.7.0/24",
                "10.244.0.0/16",
                "10.0.0.0/8",
                "0.0.0.0/0"
            ]
        );
    }

    #[test]
    fn host_bits_are_ignored_and_empty_tables_find_nothing() {
        let t = UdpRoutes::new([UdpRoute {
            subnet: Ipv4Net::new(Ipv4Addr::new(10, 244, 5, 77), 24).unwrap(),
            endpoint: SocketAddrV4::new(Ipv4Addr::new(192, 168, 1, 15), 9000),
        }]);
        assert_eq!(
            t.lookup("10.244.5.1".parse().unwrap()),
            Some(SocketAddrV4::new(Ipv4Addr::new(192, 168, 1, 15), 9000))
        );
        let empty = UdpRoutes::default();
        assert!(empty.is_empty());
        assert_eq!(empty.lookup("10.244.5.1".parse().unwrap()), None);
    }
}
