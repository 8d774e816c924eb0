//! The masquerade/forward rule set the node wants, and the one its previous run wanted (from
//! the old subnet.env), in the traffic manager's terms.

use std::path::Path;

use ipnet::{IpNet, Ipv4Net, Ipv6Net};

use crate::{
    cli::Cli,
    lease::Lease,
    netconf::NetConfig,
    subnet_env::{KEY_IPV6_NETWORK, KEY_IPV6_SUBNET, KEY_NETWORK, KEY_SUBNET, read_cidr},
    traffic::{Desired, FamilyRules, Previous, PreviousLease},
};

/// `--ip-masq` and `--iptables-forward-rules` applied to our lease within the cluster networks.
pub fn desired(cli: &Cli, config: &NetConfig, lease: &Lease) -> Desired {
    let family = |network: Option<IpNet>, subnet: Option<IpNet>| match (network, subnet) {
        (Some(network), Some(subnet)) => Some(FamilyRules {
            network,
            subnet,
            masquerade: cli.ip_masq,
            forward: cli.iptables_forward_rules,
        }),
        _ => None,
    };
    Desired {
        ipv4: family(
            config.network.filter(|_| config.enable_ipv4).map(IpNet::V4),
            lease.subnet.map(IpNet::V4),
        ),
        ipv6: family(
            config
                .ipv6_network
                .filter(|_| config.enable_ipv6)
                .map(IpNet::V6),
            lease.ipv6_subnet.map(IpNet::V6),
        ),
        random_fully: !cli.ip_masq_fully_random_disable,
    }
}

/// What the previous run's subnet.env says (before it is overwritten), so rules of an old
/// network or subnet are replaced rather than left behind.
pub fn previous(subnet_file: &Path) -> Previous {
    let v4 = match (
        read_cidr::<Ipv4Net>(subnet_file, KEY_NETWORK),
        read_cidr::<Ipv4Net>(subnet_file, KEY_SUBNET),
    ) {
        (Some(network), Some(subnet)) => Some(PreviousLease {
            network: network.into(),
            subnet: subnet.into(),
        }),
        _ => None,
    };
    let v6 = match (
        read_cidr::<Ipv6Net>(subnet_file, KEY_IPV6_NETWORK),
        read_cidr::<Ipv6Net>(subnet_file, KEY_IPV6_SUBNET),
    ) {
        (Some(network), Some(subnet)) => Some(PreviousLease {
            network: network.into(),
            subnet: subnet.into(),
        }),
        _ => None,
    };
    Previous { ipv4: v4, ipv6: v6 }
}
