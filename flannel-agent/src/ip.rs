//! IPv4/IPv6 subnet arithmetic on [`ipnet`] types.
//!
//! The [`Subnet`] trait lets the allocation and validation code be written once for both
//! families; addresses are handled as `u128` bit patterns internally (`u32` values for IPv4).
//! Everything here is pure and total: operations that could leave the address space return
//! `None` instead of wrapping or panicking.

use std::fmt;
use std::hash::Hash;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ipnet::{Ipv4Net, Ipv6Net};

/// Which address families are enabled (upstream `ipmatch.GetIPFamily`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum IpStack {
    /// IPv4 only.
    V4,
    /// IPv6 only.
    V6,
    /// Both families.
    Dual,
}

impl IpStack {
    /// The stack for the `EnableIPv4` / `EnableIPv6` flags; `None` when neither is enabled
    /// (upstream then exits with `none defined stack`).
    pub fn from_flags(ipv4: bool, ipv6: bool) -> Option<Self> {
        match (ipv4, ipv6) {
            (true, false) => Some(IpStack::V4),
            (false, true) => Some(IpStack::V6),
            (true, true) => Some(IpStack::Dual),
            (false, false) => None,
        }
    }

    /// IPv4 is enabled.
    pub fn has_v4(self) -> bool {
        matches!(self, IpStack::V4 | IpStack::Dual)
    }

    /// IPv6 is enabled.
    pub fn has_v6(self) -> bool {
        matches!(self, IpStack::V6 | IpStack::Dual)
    }
}

/// A subnet of one address family (implemented for [`Ipv4Net`] and [`Ipv6Net`]).
///
/// Values may carry host bits (like the `ipnet` types themselves); [`network`] masks them.
pub trait Subnet:
    Copy + Eq + Ord + Hash + fmt::Debug + fmt::Display + Send + Sync + 'static
{
    /// The address type of the family.
    type Addr: Copy + Eq + Ord + Hash + fmt::Debug + fmt::Display + Send + Sync + 'static;
    /// Address width in bits (32 or 128).
    const BITS: u8;
    /// Builds a subnet from an address and a prefix length, keeping the address as given.
    /// `None` if the prefix length exceeds [`Subnet::BITS`].
    fn from_parts(addr: Self::Addr, prefix_len: u8) -> Option<Self>;
    /// The address part (not masked).
    fn addr(&self) -> Self::Addr;
    /// The prefix length.
    fn prefix_len(&self) -> u8;
    /// The address as an unsigned integer (IPv4 values fit in the low 32 bits).
    fn addr_to_bits(addr: Self::Addr) -> u128;
    /// The address for an integer; bits above [`Subnet::BITS`] are ignored.
    fn addr_from_bits(bits: u128) -> Self::Addr;
}

impl Subnet for Ipv4Net {
    type Addr = Ipv4Addr;
    const BITS: u8 = 32;

    fn from_parts(addr: Ipv4Addr, prefix_len: u8) -> Option<Self> {
        Ipv4Net::new(addr, prefix_len).ok()
    }
    fn addr(&self) -> Ipv4Addr {
        Ipv4Net::addr(self)
    }
    fn prefix_len(&self) -> u8 {
        Ipv4Net::prefix_len(self)
    }
    fn addr_to_bits(addr: Ipv4Addr) -> u128 {
        u128::from(u32::from(addr))
    }
    fn addr_from_bits(bits: u128) -> Ipv4Addr {
        // Truncation to the low 32 bits is the documented behaviour.
        Ipv4Addr::from(bits as u32)
    }
}

impl Subnet for Ipv6Net {
    type Addr = Ipv6Addr;
    const BITS: u8 = 128;

    fn from_parts(addr: Ipv6Addr, prefix_len: u8) -> Option<Self> {
        Ipv6Net::new(addr, prefix_len).ok()
    }
    fn addr(&self) -> Ipv6Addr {
        Ipv6Net::addr(self)
    }
    fn prefix_len(&self) -> u8 {
        Ipv6Net::prefix_len(self)
    }
    fn addr_to_bits(addr: Ipv6Addr) -> u128 {
        u128::from(addr)
    }
    fn addr_from_bits(bits: u128) -> Ipv6Addr {
        Ipv6Addr::from(bits)
    }
}

/// The netmask of `prefix_len` for family `N` as bits (`0xffffff00` for IPv4 /24).
pub fn mask_bits<N: Subnet>(prefix_len: u8) -> u128 {
    let width = u32::from(N::BITS);
    let prefix = u32::from(prefix_len).min(width);
    if prefix == 0 {
        return 0;
    }
    // `prefix` ones at the top of a u128 (shift 0..=127), then moved down to the family width.
    (u128::MAX << (128 - prefix)) >> (128 - width)
}

/// Number of addresses in a subnet of `prefix_len` (`2^(BITS - prefix_len)`); `None` for a
/// whole IPv6 space (2^128 does not fit).
pub fn size_bits<N: Subnet>(prefix_len: u8) -> Option<u128> {
    let host_bits = u32::from(N::BITS).saturating_sub(u32::from(prefix_len));
    (host_bits < 128).then(|| 1u128 << host_bits)
}

/// The subnet with host bits cleared (`10.3.1.5/16` → `10.3.0.0/16`).
pub fn network<N: Subnet>(n: N) -> N {
    let bits = N::addr_to_bits(n.addr()) & mask_bits::<N>(n.prefix_len());
    N::from_parts(N::addr_from_bits(bits), n.prefix_len()).unwrap_or(n)
}

/// True when `n` has no host bits set.
pub fn is_canonical<N: Subnet>(n: N) -> bool {
    network(n) == n
}

/// True for the "empty" network of upstream: address zero and prefix zero
/// (`0.0.0.0/0`, `::/0`; `::/64` is not empty).
pub fn is_unset<N: Subnet>(n: N) -> bool {
    N::addr_to_bits(n.addr()) == 0 && n.prefix_len() == 0
}

/// `addr` lies inside `n`.
pub fn contains_addr<N: Subnet>(n: N, addr: N::Addr) -> bool {
    let mask = mask_bits::<N>(n.prefix_len());
    N::addr_to_bits(n.addr()) & mask == N::addr_to_bits(addr) & mask
}

/// `inner` lies entirely inside `outer` (upstream `ContainsCIDR`): `outer` is not longer than
/// `inner` and contains its address.
pub fn contains_subnet<N: Subnet>(outer: N, inner: N) -> bool {
    outer.prefix_len() <= inner.prefix_len() && contains_addr(outer, inner.addr())
}

/// The two subnets share at least one address.
pub fn overlaps<N: Subnet>(a: N, b: N) -> bool {
    let mask = mask_bits::<N>(a.prefix_len().min(b.prefix_len()));
    N::addr_to_bits(a.addr()) & mask == N::addr_to_bits(b.addr()) & mask
}

/// The subnet of the same length right after `n` (`10.3.1.0/24` → `10.3.2.0/24`); `None` past
/// the end of the address space.
pub fn next_subnet<N: Subnet>(n: N) -> Option<N> {
    let base = N::addr_to_bits(network(n).addr());
    let next = base.checked_add(size_bits::<N>(n.prefix_len())?)?;
    if N::BITS < 128 && next >> N::BITS != 0 {
        return None;
    }
    N::from_parts(N::addr_from_bits(next), n.prefix_len())
}

/// The `index`-th subnet of length `prefix_len` inside `within` (0 is the first); `None` when
/// `prefix_len` is shorter than `within` or the index is past its end.
pub fn nth_subnet<N: Subnet>(within: N, prefix_len: u8, index: u128) -> Option<N> {
    if prefix_len < within.prefix_len() || prefix_len > N::BITS {
        return None;
    }
    let count_bits = u32::from(prefix_len - within.prefix_len());
    if count_bits < 128 && index >> count_bits != 0 {
        return None;
    }
    let step = size_bits::<N>(prefix_len).unwrap_or(0);
    let base = N::addr_to_bits(network(within).addr());
    let offset = index.checked_mul(step)?;
    N::from_parts(N::addr_from_bits(base.checked_add(offset)?), prefix_len)
}

/// The first host of `n` with the prefix of `n`: network address + 1
/// (`10.244.1.0/24` → `10.244.1.1/24`, what `FLANNEL_SUBNET` holds). `None` only when the
/// network address is the last address of the family.
pub fn first_host<N: Subnet>(n: N) -> Option<N> {
    let base = N::addr_to_bits(network(n).addr());
    let next = base.checked_add(1)?;
    if N::BITS < 128 && next >> N::BITS != 0 {
        return None;
    }
    N::from_parts(N::addr_from_bits(next), n.prefix_len())
}

/// Adds `delta` to an address; `None` past the end of the family.
pub fn addr_add<N: Subnet>(addr: N::Addr, delta: u128) -> Option<N::Addr> {
    let next = N::addr_to_bits(addr).checked_add(delta)?;
    if N::BITS < 128 && next >> N::BITS != 0 {
        return None;
    }
    Some(N::addr_from_bits(next))
}

/// Subtracts `delta` from an address; `None` below zero.
pub fn addr_sub<N: Subnet>(addr: N::Addr, delta: u128) -> Option<N::Addr> {
    N::addr_to_bits(addr)
        .checked_sub(delta)
        .map(N::addr_from_bits)
}

/// RFC 1918 private IPv4 address (10/8, 172.16/12, 192.168/16).
pub fn is_rfc1918(addr: Ipv4Addr) -> bool {
    let [a, b, ..] = addr.octets();
    a == 10 || (a == 172 && b & 0xf0 == 16) || (a == 192 && b == 168)
}

/// Unique local IPv6 address (fc00::/7).
///
/// Upstream inspects the first byte of a big integer, so addresses starting with zero bytes
/// are misclassified (and `::` panics there); this checks the real first octet.
pub fn is_ula(addr: Ipv6Addr) -> bool {
    addr.octets()[0] & 0xfe == 0xfc
}

/// Go's `IP.IsGlobalUnicast`: not unspecified, loopback, multicast, link-local, or (IPv4) the
/// limited broadcast address. Private addresses count as global.
pub fn is_global_unicast(addr: IpAddr) -> bool {
    match addr {
        IpAddr::V4(a) => {
            !(a.is_unspecified()
                || a.is_loopback()
                || a.is_multicast()
                || a.is_link_local()
                || a.is_broadcast())
        }
        IpAddr::V6(a) => {
            !(a.is_unspecified() || a.is_loopback() || a.is_multicast() || is_v6_link_local(a))
        }
    }
}

/// Go's `IP.IsLinkLocalUnicast`: 169.254.0.0/16 or fe80::/10.
pub fn is_link_local_unicast(addr: IpAddr) -> bool {
    match addr {
        IpAddr::V4(a) => a.is_link_local(),
        IpAddr::V6(a) => is_v6_link_local(a),
    }
}

fn is_v6_link_local(a: Ipv6Addr) -> bool {
    a.segments()[0] & 0xffc0 == 0xfe80
}

/// Why a CIDR string was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CidrError {
    /// Not `address/prefix` with a valid address and prefix length.
    #[error("invalid CIDR address: {0}")]
    Invalid(String),
    /// A valid CIDR of the other family where IPv4 was required.
    #[error("invalid IPv4 CIDR format")]
    NotIpv4,
    /// A valid CIDR of the other family where IPv6 was required.
    #[error("invalid IPv6 CIDR format")]
    NotIpv6,
}

/// Parses `a.b.c.d/n` like Go's `net.ParseCIDR` and masks it (`10.3.1.5/16` → `10.3.0.0/16`).
/// An IPv6 CIDR gives upstream's `invalid IPv4 CIDR format`.
pub fn parse_cidr_v4(s: &str) -> Result<Ipv4Net, CidrError> {
    if let Ok(n) = s.parse::<Ipv4Net>() {
        return Ok(network(n));
    }
    if s.parse::<Ipv6Net>().is_ok() {
        return Err(CidrError::NotIpv4);
    }
    Err(CidrError::Invalid(s.to_owned()))
}

/// Parses an IPv6 CIDR and masks it. An IPv4 CIDR is rejected with `invalid IPv6 CIDR format`
/// (upstream accepts it and silently produces a nonsensical IPv4-mapped network).
pub fn parse_cidr_v6(s: &str) -> Result<Ipv6Net, CidrError> {
    if let Ok(n) = s.parse::<Ipv6Net>() {
        return Ok(network(n));
    }
    if s.parse::<Ipv4Net>().is_ok() {
        return Err(CidrError::NotIpv6);
    }
    Err(CidrError::Invalid(s.to_owned()))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests fail loudly by design
mod tests {
    use super::*;

    fn v4(s: &str) -> Ipv4Net {
        s.parse().unwrap()
    }
    fn v6(s: &str) -> Ipv6Net {
        s.parse().unwrap()
    }

    #[test]
    fn masks() {
        assert_eq!(mask_bits::<Ipv4Net>(24), 0xffff_ff00);
        assert_eq!(mask_bits::<Ipv4Net>(0), 0);
        assert_eq!(mask_bits::<Ipv4Net>(32), 0xffff_ffff);
        assert_eq!(mask_bits::<Ipv6Net>(128), u128::MAX);
        assert_eq!(mask_bits::<Ipv6Net>(1), 1u128 << 127);
        assert_eq!(mask_bits::<Ipv6Net>(64), !0u128 << 64);
        assert_eq!(network(v4("10.3.1.5/16")), v4("10.3.0.0/16"));
        assert_eq!(network(v6("fc00:1::5/64")), v6("fc00:1::/64"));
        assert!(is_canonical(v4("10.3.0.0/16")));
        assert!(!is_canonical(v4("10.3.0.1/16")));
    }

    #[test]
    fn rfc1918_vectors() {
        for a in ["192.168.0.1", "172.16.0.1", "172.31.0.1", "10.1.2.3"] {
            assert!(is_rfc1918(a.parse().unwrap()), "{a}");
        }
        for a in ["8.8.8.8", "172.32.0.1", "192.167.0.1", "192.169.0.1"] {
            assert!(!is_rfc1918(a.parse().unwrap()), "{a}");
        }
    }

    #[test]
    fn ula_vectors() {
        for a in ["fc00::1", "fcff::1", "fd00::1", "fdff::1"] {
            assert!(is_ula(a.parse().unwrap()), "{a}");
        }
        for a in ["2001::", "fe00::", "::", "::fc00:0"] {
            assert!(!is_ula(a.parse().unwrap()), "{a}");
        }
    }

    #[test]
    fn overlap_vectors() {
        let n = v4("1.2.3.0/24");
        assert!(overlaps(n, v4("1.2.0.0/16")));
        assert!(overlaps(v4("1.2.0.0/16"), n));
        assert!(!overlaps(n, v4("1.2.4.0/24")));
        assert!(!overlaps(n, v4("7.2.4.0/22")));
        let m = v6("fc00:1::/64");
        assert!(overlaps(m, v6("fc00::/16")));
        assert!(!overlaps(m, v6("fc00:2::/64")));
    }

    #[test]
    fn empty_networks() {
        assert!(is_unset(v4("0.0.0.0/0")));
        assert!(!is_unset(v4("0.0.0.0/8")));
        assert!(is_unset(v6("::/0")));
        assert!(!is_unset(v6("::/64")));
    }

    #[test]
    fn first_host_vectors() {
        assert_eq!(first_host(v4("1.2.3.0/24")), Some(v4("1.2.3.1/24")));
        assert_eq!(first_host(v6("fc00:1::/64")), Some(v6("fc00:1::1/64")));
        assert_eq!(first_host(v4("255.255.255.255/32")), None);
        assert_eq!(
            first_host(v6("ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff/128")),
            None
        );
        assert_eq!(
            first_host(v4("10.244.1.0/24")).unwrap().to_string(),
            "10.244.1.1/24"
        );
    }

    #[test]
    fn next_and_nth() {
        assert_eq!(next_subnet(v4("10.3.1.0/24")), Some(v4("10.3.2.0/24")));
        assert_eq!(next_subnet(v4("255.255.255.0/24")), None);
        assert_eq!(next_subnet(v4("0.0.0.0/0")), None);
        assert_eq!(next_subnet(v6("fc00::/64")), Some(v6("fc00:0:0:1::/64")));
        assert_eq!(next_subnet(v6("::/0")), None);
        let n = v4("10.3.0.0/16");
        assert_eq!(nth_subnet(n, 24, 0), Some(v4("10.3.0.0/24")));
        assert_eq!(nth_subnet(n, 24, 255), Some(v4("10.3.255.0/24")));
        assert_eq!(nth_subnet(n, 24, 256), None);
        assert_eq!(nth_subnet(n, 8, 0), None);
        assert_eq!(
            nth_subnet(v6("fc00::/48"), 64, 0xffff),
            Some(v6("fc00:0:0:ffff::/64"))
        );
        assert_eq!(
            nth_subnet(v6("::/0"), 128, u128::MAX),
            Some(v6("ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff/128"))
        );
    }

    #[test]
    fn containment_vectors() {
        let n = v4("10.244.0.0/16");
        for s in ["10.244.0.0/16", "10.244.0.0/24", "10.244.255.0/24"] {
            assert!(contains_subnet(n, v4(s)), "{s}");
        }
        for s in ["10.244.0.0/15", "192.168.0.0/24"] {
            assert!(!contains_subnet(n, v4(s)), "{s}");
        }
        let n = v6("2001:db8:1234::/48");
        for s in [
            "2001:db8:1234::/48",
            "2001:db8:1234::/64",
            "2001:db8:1234:ffff::/64",
        ] {
            assert!(contains_subnet(n, v6(s)), "{s}");
        }
        for s in ["2001:db8:1234::/47", "fe02::/32"] {
            assert!(!contains_subnet(n, v6(s)), "{s}");
        }
        assert!(contains_addr(
            v4("10.3.0.0/16"),
            "10.3.255.0".parse().unwrap()
        ));
        assert!(!contains_addr(
            v4("10.3.0.0/16"),
            "10.4.0.0".parse().unwrap()
        ));
    }

    #[test]
    fn address_classes() {
        let g = |s: &str| is_global_unicast(s.parse().unwrap());
        assert!(g("10.0.0.1") && g("1.10.100.1") && g("2001:db8::1") && g("fd00::1"));
        assert!(!g("127.0.0.1") && !g("169.254.1.1") && !g("224.0.0.1") && !g("255.255.255.255"));
        assert!(!g("0.0.0.0") && !g("::1") && !g("fe80::1") && !g("ff02::1"));
        assert!(is_link_local_unicast("fe80::1".parse().unwrap()));
        assert!(is_link_local_unicast("febf::1".parse().unwrap()));
        assert!(!is_link_local_unicast("fec0::1".parse().unwrap()));
    }

    #[test]
    fn cidr_parsing() {
        assert_eq!(parse_cidr_v4("10.3.1.5/16"), Ok(v4("10.3.0.0/16")));
        assert_eq!(parse_cidr_v4("fc00::/64"), Err(CidrError::NotIpv4));
        assert_eq!(
            parse_cidr_v4("10.0.0.0/33").unwrap_err().to_string(),
            "invalid CIDR address: 10.0.0.0/33"
        );
        assert!(parse_cidr_v4("10.0.0.0").is_err());
        assert_eq!(parse_cidr_v6("fc00:1::5/64"), Ok(v6("fc00:1::/64")));
        assert_eq!(parse_cidr_v6("10.0.0.0/8"), Err(CidrError::NotIpv6));
        assert!(parse_cidr_v6("fc00::/129").is_err());
    }

    #[test]
    fn stack_flags() {
        assert_eq!(IpStack::from_flags(true, false), Some(IpStack::V4));
        assert_eq!(IpStack::from_flags(false, true), Some(IpStack::V6));
        assert_eq!(IpStack::from_flags(true, true), Some(IpStack::Dual));
        assert_eq!(IpStack::from_flags(false, false), None);
        assert!(IpStack::Dual.has_v4() && IpStack::Dual.has_v6());
        assert!(!IpStack::V6.has_v4() && !IpStack::V4.has_v6());
    }

    #[test]
    fn address_steps() {
        let a: Ipv4Addr = "10.0.0.255".parse().unwrap();
        assert_eq!(addr_add::<Ipv4Net>(a, 1), Some("10.0.1.0".parse().unwrap()));
        assert_eq!(addr_add::<Ipv4Net>(Ipv4Addr::BROADCAST, 1), None);
        assert_eq!(addr_sub::<Ipv4Net>(Ipv4Addr::UNSPECIFIED, 1), None);
        assert_eq!(
            addr_add::<Ipv6Net>("::ffff:ffff:ffff:ffff".parse().unwrap(), 1),
            Some("0:0:0:1::".parse().unwrap())
        );
        assert_eq!(size_bits::<Ipv4Net>(24), Some(256));
        assert_eq!(size_bits::<Ipv6Net>(0), None);
    }
}
