//! A namespace that looks like a node to the fast-path programs run with `BPF_PROG_TEST_RUN`
//! (the `bpf_*` tests and `bench programs`): an external veth `ext0` (192.168.77.1/24,
//! [`EXT_MAC`]) and, where a pod bridge is needed, `br0` (10.244.1.1/24, [`BR_MAC`]) with one
//! veth port `pod0`, IPv4 forwarding on; the `__sk_buff` context of a run ([`Skb`]); and the
//! removal of a fast path's pins from inside such a namespace ([`cleanup_in`]).
//!
//! `bpf_fib_lookup` and `bpf_check_mtu` run in the caller's network namespace, hence the
//! namespace. Callers add their own neighbours, routes and addresses.

use std::path::Path;

use anyhow::Result;

use crate::netns::NetNs;

/// TC verdicts a test run returns.
pub const TC_ACT_OK: u32 = 0;
pub const TC_ACT_SHOT: u32 = 2;
pub const TC_ACT_REDIRECT: u32 = 7;

/// A MAC address.
pub type Mac = [u8; 6];
/// `ext0`'s MAC.
pub const EXT_MAC: Mac = [0x02, 0xee, 0, 0, 0, 0x01];
/// `br0`'s MAC.
pub const BR_MAC: Mac = [0x02, 0xbb, 0, 0, 0, 0x01];
/// The local pod's MAC (behind `pod0`, as the tests address it).
pub const POD_MAC: Mac = [0x02, 0xaa, 0, 0, 0, 0x05];

/// `aa:bb:…`.
pub fn mac_str(mac: &Mac) -> String {
    flannel_agent::netlink::format_mac(mac)
}

/// Adds `ext0` (and its peer `ext0p`, left in the namespace) and turns forwarding on; with
/// `bridge`, also `br0` with its port `pod0`.
pub fn build(ns: &NetNs, bridge: bool) -> Result<()> {
    let mut cmds = vec![
        "ip link add ext0 type veth peer name ext0p".to_owned(),
        format!("ip link set ext0 address {}", mac_str(&EXT_MAC)),
        "ip addr add 192.168.77.1/24 dev ext0".to_owned(),
        "ip link set ext0 up".to_owned(),
        "ip link set ext0p up".to_owned(),
    ];
    if bridge {
        cmds.extend([
            "ip link add br0 type bridge".to_owned(),
            format!("ip link set br0 address {}", mac_str(&BR_MAC)),
            "ip addr add 10.244.1.1/24 dev br0".to_owned(),
            "ip link add pod0 type veth peer name pod0p".to_owned(),
            "ip link set pod0 master br0".to_owned(),
            "ip link set pod0 up".to_owned(),
            "ip link set pod0p up".to_owned(),
            "ip link set br0 up".to_owned(),
        ]);
    }
    cmds.push("sysctl -qw net.ipv4.ip_forward=1".to_owned());
    for cmd in cmds {
        sh(ns, &cmd)?;
    }
    Ok(())
}

/// Runs `cmd` (split at whitespace) in `ns`.
pub fn sh(ns: &NetNs, cmd: &str) -> Result<()> {
    let argv: Vec<&str> = cmd.split_whitespace().collect();
    ns.run(&argv)?;
    Ok(())
}

/// `flannel_agent::bpf::cleanup` of the pins under `pin`, run inside `ns`: the cleanup also
/// sweeps clsact filters of the programs' names from every interface of the namespace it runs
/// in, and the host's are not ours.
pub fn cleanup_in(ns: &NetNs, pin: &Path) -> Result<usize> {
    Ok(ns.enter(|| flannel_agent::bpf::cleanup(pin))??)
}

/// The `__sk_buff` test_run takes as context: the interfaces, the mark and GSO fields.
#[derive(Clone, Copy, Debug, Default)]
pub struct Skb {
    /// `ingress_ifindex`.
    pub ingress_ifindex: u32,
    /// `ifindex`.
    pub ifindex: u32,
    /// `mark`.
    pub mark: u32,
    /// `gso_segs`.
    pub gso_segs: u32,
    /// `gso_size`.
    pub gso_size: u32,
}

impl Skb {
    /// Received on `ifindex`.
    pub fn on(ifindex: u32) -> Skb {
        Skb {
            ingress_ifindex: ifindex,
            ifindex,
            ..Skb::default()
        }
    }

    /// Leaving through `ifindex`.
    pub fn egress(ifindex: u32) -> Skb {
        Skb {
            ifindex,
            ..Skb::default()
        }
    }

    /// This context for a GSO packet of `segs` segments of `size` bytes of payload.
    pub fn gso(self, size: u32, segs: u32) -> Skb {
        Skb {
            gso_size: size,
            gso_segs: segs,
            ..self
        }
    }

    /// The context's bytes (`struct __sk_buff`, the fields test_run accepts).
    pub fn bytes(&self) -> [u8; 192] {
        let mut b = [0u8; 192];
        b[8..12].copy_from_slice(&self.mark.to_ne_bytes());
        b[36..40].copy_from_slice(&self.ingress_ifindex.to_ne_bytes());
        b[40..44].copy_from_slice(&self.ifindex.to_ne_bytes());
        b[164..168].copy_from_slice(&self.gso_segs.to_ne_bytes());
        b[176..180].copy_from_slice(&self.gso_size.to_ne_bytes());
        b
    }
}
