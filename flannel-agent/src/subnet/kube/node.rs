//! Reading leases out of Node objects: pod CIDRs, the `podCIDR`-in-`Network` check and the
//! conversion of a remote node's annotations into a [`Lease`] (upstream `nodeToLease`).

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ipnet::{IpNet, Ipv4Net, Ipv6Net};
use k8s_openapi::api::core::v1::Node;

use super::{AnnotationKeys, KubeError};
use crate::gojson::RawJson;
use crate::ip;
use crate::lease::{Lease, LeaseAttrs};

/// The pod CIDRs of a node, one per family.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PodCidrs {
    /// The IPv4 pod CIDR.
    pub v4: Option<Ipv4Net>,
    /// The IPv6 pod CIDR.
    pub v6: Option<Ipv6Net>,
}

/// Go `net.ParseCIDR` followed by masking: `10.244.1.7/24` → `10.244.1.0/24`.
fn parse_cidr(s: &str) -> Result<IpNet, KubeError> {
    let net: IpNet = s
        .parse()
        .map_err(|_| KubeError::InvalidCidr(s.to_owned()))?;
    Ok(match net {
        IpNet::V4(n) => IpNet::V4(ip::network(n)),
        IpNet::V6(n) => IpNet::V6(ip::network(n)),
    })
}

fn spec_cidrs(node: &Node) -> (&str, &[String]) {
    let spec = node.spec.as_ref();
    let single = spec.and_then(|s| s.pod_cidr.as_deref()).unwrap_or("");
    let list = spec.and_then(|s| s.pod_cidrs.as_deref()).unwrap_or(&[]);
    (single, list)
}

/// The node's name (empty when unset).
pub(crate) fn node_name(node: &Node) -> &str {
    node.metadata.name.as_deref().unwrap_or("")
}

/// The node's annotations (an empty map when there are none).
pub(crate) fn annotations(node: &Node) -> &BTreeMap<String, String> {
    static EMPTY: BTreeMap<String, String> = BTreeMap::new();
    node.metadata.annotations.as_ref().unwrap_or(&EMPTY)
}

/// The label that hands a node back to upstream flanneld (deploy/README.md, "Rolling back to
/// upstream flannel"): our DaemonSet stays off nodes that carry it with [`UPSTREAM_VALUE`].
pub const AGENT_LABEL: &str = "flannel-rs/agent";

/// The value of [`AGENT_LABEL`] on a node handed to upstream flanneld.
pub const UPSTREAM_VALUE: &str = "upstream";

/// Whether `node` is labelled [`AGENT_LABEL`]=[`UPSTREAM_VALUE`].
pub fn labelled_for_upstream(node: &Node) -> bool {
    node.metadata
        .labels
        .as_ref()
        .and_then(|labels| labels.get(AGENT_LABEL))
        .is_some_and(|value| value == UPSTREAM_VALUE)
}

/// The own node's pod CIDRs, as upstream's `AcquireLease` reads them: `spec.podCIDR` must be
/// set; `spec.podCIDRs` with one or two entries is scanned (the last entry of each family
/// wins), an empty list falls back to `spec.podCIDR`, three or more are an error.
pub fn own_pod_cidrs(node: &Node) -> Result<PodCidrs, KubeError> {
    let name = node_name(node);
    let (single, list) = spec_cidrs(node);
    if single.is_empty() {
        return Err(KubeError::PodCidrNotAssigned(name.to_owned()));
    }
    let entries: Vec<&str> = match list.len() {
        0 => vec![single],
        1 | 2 => list.iter().map(String::as_str).collect(),
        _ => return Err(KubeError::TooManyPodCidrs(name.to_owned())),
    };
    let mut out = PodCidrs::default();
    for entry in entries {
        match parse_cidr(entry)? {
            IpNet::V4(n) => out.v4 = Some(n),
            IpNet::V6(n) => out.v6 = Some(n),
        }
    }
    Ok(out)
}

/// A remote node's pod CIDRs, as upstream's `nodeToLease` reads them: `spec.podCIDRs` with
/// one or two entries (the first entry of each family), an empty list falls back to
/// `spec.podCIDR`, three or more are an error.
pub fn remote_pod_cidrs(node: &Node) -> Result<PodCidrs, KubeError> {
    let (single, list) = spec_cidrs(node);
    let entries: Vec<&str> = match list.len() {
        0 => vec![single],
        1 | 2 => list.iter().map(String::as_str).collect(),
        _ => return Err(KubeError::TooManyPodCidrs(node_name(node).to_owned())),
    };
    let mut out = PodCidrs::default();
    for entry in entries {
        match parse_cidr(entry)? {
            IpNet::V4(n) => {
                out.v4.get_or_insert(n);
            }
            IpNet::V6(n) => {
                out.v6.get_or_insert(n);
            }
        }
    }
    Ok(out)
}

/// The own node's IPv4 pod CIDR must lie inside `Network` (an unset or `0.0.0.0/0` network
/// contains nothing).
pub fn check_v4_in_network(
    network: Option<Ipv4Net>,
    cidr: Ipv4Net,
    node: &str,
) -> Result<Ipv4Net, KubeError> {
    match network.filter(|n| !ip::is_unset(*n)) {
        Some(net) if ip::contains_subnet(net, cidr) => Ok(cidr),
        other => Err(KubeError::PodCidrOutsideNetwork {
            network: other.map_or_else(|| "0.0.0.0/0".to_owned(), |n| n.to_string()),
            cidr: cidr.to_string(),
            node: node.to_owned(),
        }),
    }
}

/// The own node's IPv6 pod CIDR must lie inside `IPv6Network`.
pub fn check_v6_in_network(
    network: Option<Ipv6Net>,
    cidr: Ipv6Net,
    node: &str,
) -> Result<Ipv6Net, KubeError> {
    match network.filter(|n| !ip::is_unset(*n)) {
        Some(net) if ip::contains_subnet(net, cidr) => Ok(cidr),
        other => Err(KubeError::PodCidrOutsideIpv6Network {
            network: other.map_or_else(|| "::/0".to_owned(), |n| n.to_string()),
            cidr: cidr.to_string(),
            node: node.to_owned(),
        }),
    }
}

/// Go `ip.ParseIP4`: an IPv4 address (IPv4-mapped IPv6 accepted).
pub(crate) fn parse_ip4(s: &str) -> Result<Ipv4Addr, &'static str> {
    match s.parse::<IpAddr>() {
        Ok(IpAddr::V4(a)) => Ok(a),
        Ok(IpAddr::V6(a)) => a.to_ipv4_mapped().ok_or("invalid IPv4 address format"),
        Err(_) => Err("invalid IP address format"),
    }
}

/// Go `ip.ParseIP6`: any address; an IPv4 one becomes its IPv4-mapped form.
pub(crate) fn parse_ip6(s: &str) -> Result<Ipv6Addr, &'static str> {
    match s.parse::<IpAddr>() {
        Ok(IpAddr::V6(a)) => Ok(a),
        Ok(IpAddr::V4(a)) => Ok(a.to_ipv6_mapped()),
        Err(_) => Err("invalid IP address format"),
    }
}

/// Go's `net.IP.String()` for an IPv6 address: IPv4-mapped addresses print dotted.
pub(crate) fn go_ipv6_string(a: Ipv6Addr) -> String {
    match a.to_ipv4_mapped() {
        Some(v4) => v4.to_string(),
        None => a.to_string(),
    }
}

/// The node carries `<prefix>kube-subnet-manager: "true"`.
pub fn is_managed(keys: &AnnotationKeys, node: &Node) -> bool {
    annotations(node)
        .get(&keys.subnet_kube_managed)
        .is_some_and(|v| v == "true")
}

fn backend_data(
    annotations: &BTreeMap<String, String>,
    key: &str,
) -> Result<Option<RawJson>, KubeError> {
    match annotations.get(key).map(String::as_str) {
        None | Some("") => Ok(None),
        Some(text) => {
            RawJson::from_json(text)
                .map(Some)
                .map_err(|e| KubeError::InvalidAnnotation {
                    key: key.to_owned(),
                    value: text.to_owned(),
                    reason: e.to_string(),
                })
        }
    }
}

/// Converts a remote node into its lease for the enabled families (upstream `nodeToLease`):
/// the public IP(s) from `public-ip` / `public-ipv6` (must parse), BackendData from
/// `backend-data` / `backend-v6-data` (must be valid JSON when present; upstream passes any
/// text on), the subnets from the pod CIDRs, BackendType from `backend-type`. The marker is
/// not checked here (see [`is_managed`]). The lease has no expiry.
pub fn node_to_lease(
    keys: &AnnotationKeys,
    enable_ipv4: bool,
    enable_ipv6: bool,
    node: &Node,
) -> Result<Lease, KubeError> {
    let ann = annotations(node);
    let get = |k: &str| ann.get(k).map(String::as_str).unwrap_or("");
    let invalid_ip = |key: &str, reason: &str| KubeError::InvalidAnnotation {
        key: key.to_owned(),
        value: get(key).to_owned(),
        reason: reason.to_owned(),
    };
    let mut attrs = LeaseAttrs::default();
    let mut lease_v4 = None;
    let mut lease_v6 = None;
    if enable_ipv4 {
        attrs.public_ip =
            parse_ip4(get(&keys.public_ip)).map_err(|r| invalid_ip(&keys.public_ip, r))?;
        attrs.backend_data = backend_data(ann, &keys.backend_data)?;
        lease_v4 = Some(
            remote_pod_cidrs(node)?
                .v4
                .ok_or(KubeError::MissingV4PodCidr)?,
        );
    }
    if enable_ipv6 {
        attrs.public_ipv6 =
            Some(parse_ip6(get(&keys.public_ipv6)).map_err(|r| invalid_ip(&keys.public_ipv6, r))?);
        attrs.backend_v6_data = backend_data(ann, &keys.backend_v6_data)?;
        lease_v6 = Some(
            remote_pod_cidrs(node)?
                .v6
                .ok_or(KubeError::MissingV6PodCidr)?,
        );
    }
    attrs.backend_type = get(&keys.backend_type).to_owned();
    Ok(Lease {
        subnet: lease_v4,
        ipv6_subnet: lease_v6,
        attrs,
        expiration: None,
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests fail loudly by design
mod tests {
    use k8s_openapi::api::core::v1::NodeSpec;
    use kube::api::ObjectMeta;

    use super::*;

    fn keys() -> AnnotationKeys {
        AnnotationKeys::new("flannel.alpha.coreos.com").unwrap()
    }

    #[test]
    fn only_the_upstream_value_of_the_agent_label_hands_a_node_over() {
        let labelled = |labels: Option<&[(&str, &str)]>| {
            let mut n = node("n1", "10.244.1.0/24", &[], &[]);
            n.metadata.labels = labels.map(|l| {
                l.iter()
                    .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                    .collect()
            });
            labelled_for_upstream(&n)
        };
        assert!(labelled(Some(&[("flannel-rs/agent", "upstream")])));
        assert!(!labelled(None));
        assert!(!labelled(Some(&[])));
        assert!(!labelled(Some(&[("flannel-rs/agent", "rust")])));
        assert!(!labelled(Some(&[("flannel-rs/agent", "Upstream")])));
        assert!(!labelled(Some(&[("agent", "upstream")])));
    }

    fn node(name: &str, pod_cidr: &str, pod_cidrs: &[&str], ann: &[(&str, &str)]) -> Node {
        Node {
            metadata: ObjectMeta {
                name: Some(name.into()),
                annotations: Some(
                    ann.iter()
                        .map(|(k, v)| (format!("flannel.alpha.coreos.com/{k}"), v.to_string()))
                        .collect(),
                ),
                ..ObjectMeta::default()
            },
            spec: Some(NodeSpec {
                pod_cidr: (!pod_cidr.is_empty()).then(|| pod_cidr.into()),
                pod_cidrs: (!pod_cidrs.is_empty())
                    .then(|| pod_cidrs.iter().map(|s| s.to_string()).collect()),
                ..NodeSpec::default()
            }),
            status: None,
        }
    }

    #[test]
    fn containment_vectors() {
        let net4: Ipv4Net = "10.244.0.0/16".parse().unwrap();
        for ok in ["10.244.0.0/16", "10.244.0.0/24", "10.244.255.0/24"] {
            check_v4_in_network(Some(net4), ok.parse().unwrap(), "n").unwrap();
        }
        for bad in ["10.244.0.0/15", "192.168.0.0/24"] {
            let e = check_v4_in_network(Some(net4), bad.parse().unwrap(), "n").unwrap_err();
            assert_eq!(
                e.to_string(),
                format!(
                    "subnet \"10.244.0.0/16\" specified in the flannel net config doesn't \
                     contain \"{bad}\" PodCIDR of the \"n\" node"
                )
            );
        }
        let net6: Ipv6Net = "2001:db8:1234::/48".parse().unwrap();
        for ok in [
            "2001:db8:1234::/48",
            "2001:db8:1234::/64",
            "2001:db8:1234:ffff::/64",
        ] {
            check_v6_in_network(Some(net6), ok.parse().unwrap(), "n").unwrap();
        }
        for bad in ["2001:db8:1234::/47", "fe02::/32"] {
            let e = check_v6_in_network(Some(net6), bad.parse().unwrap(), "n").unwrap_err();
            assert_eq!(
                e.to_string(),
                format!(
                    "subnet \"2001:db8:1234::/48\" specified in the flannel net config doesn't \
                     contain \"{bad}\" IPv6 PodCIDR of the \"n\" node"
                )
            );
        }
        // No Network at all contains nothing.
        assert!(check_v4_in_network(None, "10.0.0.0/24".parse().unwrap(), "n").is_err());
    }

    #[test]
    fn own_cidrs_follow_upstream() {
        let e = own_pod_cidrs(&node("n1", "", &[], &[])).unwrap_err();
        assert_eq!(e.to_string(), "node \"n1\" pod cidr not assigned");
        let c = own_pod_cidrs(&node("n1", "10.244.1.7/24", &[], &[])).unwrap();
        assert_eq!(c.v4, Some("10.244.1.0/24".parse().unwrap()));
        let c = own_pod_cidrs(&node(
            "n1",
            "10.244.1.0/24",
            &["10.244.1.0/24", "fd00:1::/64"],
            &[],
        ))
        .unwrap();
        assert_eq!(c.v6, Some("fd00:1::/64".parse().unwrap()));
        let e = own_pod_cidrs(&node(
            "n1",
            "10.0.0.0/24",
            &["10.0.0.0/24", "fd00::/64", "10.1.0.0/24"],
            &[],
        ))
        .unwrap_err();
        assert_eq!(
            e.to_string(),
            "node \"n1\" pod cidrs should be IPv4/IPv6 only or dualstack"
        );
        let e = own_pod_cidrs(&node("n1", "bogus", &[], &[])).unwrap_err();
        assert_eq!(e.to_string(), "invalid CIDR address: bogus");
    }

    #[test]
    fn remote_lease_from_annotations() {
        let n = node(
            "n2",
            "10.244.7.0/24",
            &[],
            &[
                ("kube-subnet-manager", "true"),
                ("backend-type", "vxlan"),
                ("backend-data", "{\"VtepMAC\": \"96:59:b2:3f:04:ee\"}"),
                ("public-ip", "192.168.77.17"),
            ],
        );
        assert!(is_managed(&keys(), &n));
        let l = node_to_lease(&keys(), true, false, &n).unwrap();
        assert_eq!(l.subnet, Some("10.244.7.0/24".parse().unwrap()));
        assert_eq!(l.ipv6_subnet, None);
        assert_eq!(l.attrs.public_ip, Ipv4Addr::new(192, 168, 77, 17));
        assert_eq!(l.attrs.backend_type, "vxlan");
        assert_eq!(
            l.attrs.backend_data.as_ref().map(RawJson::as_str),
            Some("{\"VtepMAC\":\"96:59:b2:3f:04:ee\"}")
        );
        assert_eq!(l.expiration, None);

        // Dual stack: first entry of each family.
        let n = node(
            "n3",
            "10.244.8.0/24",
            &["10.244.8.0/24", "fd00:8::/64"],
            &[
                ("kube-subnet-manager", "true"),
                ("public-ip", "192.168.77.18"),
                ("public-ipv6", "2001:db8::18"),
                ("backend-v6-data", "null"),
            ],
        );
        let l = node_to_lease(&keys(), true, true, &n).unwrap();
        assert_eq!(l.ipv6_subnet, Some("fd00:8::/64".parse().unwrap()));
        assert_eq!(l.attrs.public_ipv6, Some("2001:db8::18".parse().unwrap()));
        assert_eq!(l.attrs.backend_v6_data, Some(RawJson::null()));
        assert_eq!(l.attrs.backend_data, None);
    }

    #[test]
    fn malformed_remote_nodes_are_errors() {
        let base = [
            ("kube-subnet-manager", "true"),
            ("public-ip", "192.168.77.17"),
        ];
        let bad_ip = node("n", "10.244.7.0/24", &[], &[("public-ip", "192.168.77")]);
        assert_eq!(
            node_to_lease(&keys(), true, false, &bad_ip)
                .unwrap_err()
                .to_string(),
            "invalid flannel.alpha.coreos.com/public-ip annotation \"192.168.77\": invalid IP address format"
        );
        let v6_ip = node("n", "10.244.7.0/24", &[], &[("public-ip", "fd00::1")]);
        assert!(
            node_to_lease(&keys(), true, false, &v6_ip)
                .unwrap_err()
                .to_string()
                .ends_with("invalid IPv4 address format")
        );
        let mut ann = base.to_vec();
        ann.push(("backend-data", "{\"VtepMAC\":"));
        let bad_json = node("n", "10.244.7.0/24", &[], &ann);
        assert!(
            node_to_lease(&keys(), true, false, &bad_json)
                .unwrap_err()
                .to_string()
                .starts_with("invalid flannel.alpha.coreos.com/backend-data annotation")
        );
        let three = node(
            "n",
            "10.0.0.0/24",
            &["10.0.0.0/24", "fd00::/64", "10.1.0.0/24"],
            &base,
        );
        assert_eq!(
            node_to_lease(&keys(), true, false, &three)
                .unwrap_err()
                .to_string(),
            "node \"n\" pod cidrs should be IPv4/IPv6 only or dualstack"
        );
        let v6_only = node("n", "fd00::/64", &[], &base);
        assert_eq!(
            node_to_lease(&keys(), true, false, &v6_only)
                .unwrap_err()
                .to_string(),
            "missing IPv4 address on n.Spec.PodCIDRs"
        );
        let v4_only = node("n", "10.0.0.0/24", &[], &[("public-ipv6", "fd00::1")]);
        assert_eq!(
            node_to_lease(&keys(), false, true, &v4_only)
                .unwrap_err()
                .to_string(),
            "missing IPv6 address on n.Spec.PodCIDRs"
        );
        let no_cidr = node("n", "", &[], &base);
        assert_eq!(
            node_to_lease(&keys(), true, false, &no_cidr)
                .unwrap_err()
                .to_string(),
            "invalid CIDR address: "
        );
    }

    #[test]
    fn go_ip_text() {
        assert_eq!(parse_ip4("::ffff:10.1.2.3"), Ok(Ipv4Addr::new(10, 1, 2, 3)));
        assert_eq!(
            go_ipv6_string("::ffff:10.1.2.3".parse().unwrap()),
            "10.1.2.3"
        );
        assert_eq!(
            go_ipv6_string("2001:db8::1".parse().unwrap()),
            "2001:db8::1"
        );
        assert_eq!(
            parse_ip6("10.1.2.3"),
            Ok("::ffff:10.1.2.3".parse().unwrap())
        );
    }

    /// A Node whose pod CIDRs and annotations are random edits of valid ones gives a lease or
    /// an error, never a panic; a lease it gives has the subnets and public addresses of the
    /// families asked for, and its BackendData is valid JSON.
    #[test]
    fn never_panics_on_random_nodes() {
        use rand::{Rng, SeedableRng, rngs::StdRng};
        let alphabet: Vec<char> = "0123456789abcdef.:/{}\"[],nul VtepMAC\\é -"
            .chars()
            .collect();
        let mut rng = StdRng::seed_from_u64(0x0de5);
        let edit = |seed: &str, rng: &mut StdRng| crate::test_fuzz::mutate(rng, seed, &alphabet, 3);
        let mut accepted = 0u32;
        for i in 0..8000 {
            let pod_cidr = edit("10.244.7.0/24", &mut rng);
            let pod_cidrs = [
                edit("10.244.7.0/24", &mut rng),
                edit("fd00:7::/64", &mut rng),
            ];
            let data = edit("{\"VtepMAC\": \"96:59:b2:3f:04:ee\"}", &mut rng);
            let public_ip = edit("192.168.77.17", &mut rng);
            let public_ipv6 = edit("2001:db8::17", &mut rng);
            let n = node(
                "n",
                &pod_cidr,
                &[pod_cidrs[0].as_str(), pod_cidrs[1].as_str()][..rng.random_range(0..=2)],
                &[
                    ("backend-data", &data),
                    ("backend-v6-data", &data),
                    ("public-ip", &public_ip),
                    ("public-ipv6", &public_ipv6),
                ],
            );
            let (v4, v6) = [(true, false), (false, true), (true, true)][i % 3];
            if let Ok(lease) = node_to_lease(&keys(), v4, v6, &n) {
                accepted += 1;
                assert_eq!(lease.subnet.is_some(), v4, "{n:?}");
                assert_eq!(lease.ipv6_subnet.is_some(), v6, "{n:?}");
                assert_eq!(lease.attrs.public_ipv6.is_some(), v6, "{n:?}");
                for raw in [&lease.attrs.backend_data, &lease.attrs.backend_v6_data]
                    .into_iter()
                    .flatten()
                {
                    RawJson::from_json(raw.as_str()).unwrap();
                }
            }
        }
        // The edits must reach the accepting path too, not only the errors.
        assert!(accepted >= 200, "only {accepted} nodes accepted");
    }
}
