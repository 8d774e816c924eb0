//! What the own Node needs after start-up (kube mode): the lease annotations as a restart
//! would write them, on the pod CIDRs the lease was taken for.
//!
//! Upstream writes the annotations once, at start. Whatever removes them afterwards (a
//! `kubectl annotate ... -`, a Node deleted and registered again by the kubelet, a backup
//! restored over it) takes the node out of every other node's routes until flanneld is
//! restarted by hand. [`upkeep`] says what to write again; a re-registered Node whose
//! controller manager handed it another pod CIDR cannot be kept, since the node's pods,
//! bridge and subnet.env hold the old one.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Node;

use super::node::{self, PodCidrs};
use super::{AnnotationKeys, patch};
use crate::lease::Lease;

/// The own Node, measured against the lease the agent runs on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Upkeep {
    /// Not in the API (deleted; the kubelet registers it again).
    Gone,
    /// In the API: its object id, and the annotations to write again (empty: none).
    Present {
        uid: Option<String>,
        rewrite: BTreeMap<String, String>,
    },
    /// Its pod CIDRs are not the leased ones any more (a Node registered again and given
    /// other CIDRs): `leased` and `now`, each as `v4[,v6]`.
    PodCidrChanged { leased: String, now: String },
}

/// What `own` needs so that it carries `lease` as the agent published it. A Node without a
/// pod CIDR yet (just registered again) is annotated anyway: the other nodes take it up
/// when the controller manager assigns the CIDR.
pub fn upkeep(keys: &AnnotationKeys, own: Option<&Node>, lease: &Lease) -> Upkeep {
    let Some(own) = own else {
        return Upkeep::Gone;
    };
    if let Ok(cidrs) = node::own_pod_cidrs(own) {
        let v4_moved = lease.subnet.is_some() && cidrs.v4 != lease.subnet;
        let v6_moved = lease.ipv6_subnet.is_some() && cidrs.v6 != lease.ipv6_subnet;
        if v4_moved || v6_moved {
            let leased = PodCidrs {
                v4: lease.subnet,
                v6: lease.ipv6_subnet,
            };
            return Upkeep::PodCidrChanged {
                leased: cidr_list(&leased),
                now: cidr_list(&cidrs),
            };
        }
    }
    Upkeep::Present {
        uid: own.metadata.uid.clone(),
        rewrite: patch::annotation_changes(keys, node::annotations(own), &lease.attrs),
    }
}

/// `v4`, `v6` or `v4,v6`; `none` when there is neither.
fn cidr_list(c: &PodCidrs) -> String {
    let list: Vec<String> =
        c.v4.map(|n| n.to_string())
            .into_iter()
            .chain(c.v6.map(|n| n.to_string()))
            .collect();
    if list.is_empty() {
        "none".into()
    } else {
        list.join(",")
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests fail loudly by design
mod tests {
    use std::net::Ipv4Addr;

    use k8s_openapi::api::core::v1::NodeSpec;
    use kube::api::ObjectMeta;

    use super::*;
    use crate::gojson::RawJson;
    use crate::lease::LeaseAttrs;
    use crate::subnet::kube::KubeError;

    const P: &str = "flannel.alpha.coreos.com";

    fn lease(v4: Option<&str>, v6: Option<&str>) -> Lease {
        Lease {
            subnet: v4.map(|s| s.parse().unwrap()),
            ipv6_subnet: v6.map(|s| s.parse().unwrap()),
            attrs: LeaseAttrs {
                public_ip: Ipv4Addr::new(192, 168, 1, 10),
                public_ipv6: None,
                backend_type: "host-gw".into(),
                backend_data: Some(RawJson::from_json("null").unwrap()),
                backend_v6_data: None,
            },
            expiration: None,
        }
    }

    fn published() -> Vec<(&'static str, &'static str)> {
        vec![
            ("backend-data", "null"),
            ("backend-type", "host-gw"),
            ("kube-subnet-manager", "true"),
            ("public-ip", "192.168.1.10"),
        ]
    }

    fn node(cidrs: &[&str], ann: &[(&str, &str)]) -> Node {
        Node {
            metadata: ObjectMeta {
                name: Some("n0".into()),
                uid: Some("uid-1".into()),
                annotations: Some(
                    ann.iter()
                        .map(|(k, v)| (format!("{P}/{k}"), v.to_string()))
                        .collect(),
                ),
                ..ObjectMeta::default()
            },
            spec: Some(NodeSpec {
                pod_cidr: cidrs.first().map(|c| c.to_string()),
                pod_cidrs: (!cidrs.is_empty())
                    .then(|| cidrs.iter().map(|c| c.to_string()).collect()),
                ..NodeSpec::default()
            }),
            status: None,
        }
    }

    fn present(rewrite: &[(&str, &str)]) -> Upkeep {
        Upkeep::Present {
            uid: Some("uid-1".into()),
            rewrite: rewrite
                .iter()
                .map(|(k, v)| (format!("{P}/{k}"), v.to_string()))
                .collect(),
        }
    }

    #[test]
    fn what_the_own_node_needs() {
        let keys = AnnotationKeys::new(P).unwrap();
        let l = lease(Some("10.244.1.0/24"), None);
        let up = |n: Option<&Node>| upkeep(&keys, n, &l);

        assert_eq!(up(None), Upkeep::Gone);
        // As published: nothing to do.
        assert_eq!(
            up(Some(&node(&["10.244.1.0/24"], &published()))),
            present(&[])
        );
        // One annotation removed: that one is written again.
        let mut ann = published();
        ann.retain(|(k, _)| *k != "public-ip");
        assert_eq!(
            up(Some(&node(&["10.244.1.0/24"], &ann))),
            present(&[("public-ip", "192.168.1.10")])
        );
        // Registered again, not yet given its CIDR: every annotation, at once.
        assert_eq!(up(Some(&node(&[], &[]))), present(&published()));
        // Given another CIDR: the lease cannot be kept.
        let moved = up(Some(&node(&["10.244.7.0/24"], &[])));
        assert_eq!(
            moved,
            Upkeep::PodCidrChanged {
                leased: "10.244.1.0/24".into(),
                now: "10.244.7.0/24".into()
            }
        );
        let Upkeep::PodCidrChanged { leased, now } = moved else {
            unreachable!()
        };
        let e = KubeError::PodCidrChanged {
            node: "n0".into(),
            leased,
            now,
        };
        assert_eq!(
            e.to_string(),
            "node \"n0\" now has pod CIDR 10.244.7.0/24, not 10.244.1.0/24 as leased \
             (was the Node deleted and registered again?); exiting so that the restart \
             takes the new one: pods with addresses in 10.244.1.0/24 must be re-created"
        );

        // Dual stack: either family moving counts; an IPv6 CIDR the lease does not carry
        // (IPv6 off) does not.
        let dual = lease(Some("10.244.1.0/24"), Some("fd00:10:244:1::/64"));
        let n = node(&["10.244.1.0/24", "fd00:10:244:9::/64"], &published());
        assert_eq!(
            upkeep(&keys, Some(&n), &dual),
            Upkeep::PodCidrChanged {
                leased: "10.244.1.0/24,fd00:10:244:1::/64".into(),
                now: "10.244.1.0/24,fd00:10:244:9::/64".into()
            }
        );
        assert_eq!(up(Some(&n)), present(&[]));
        // An IPv4 CIDR gone from a node that still has one for IPv6.
        let v6only = node(&["fd00:10:244:1::/64"], &published());
        assert_eq!(
            upkeep(&keys, Some(&v6only), &dual),
            Upkeep::PodCidrChanged {
                leased: "10.244.1.0/24,fd00:10:244:1::/64".into(),
                now: "fd00:10:244:1::/64".into()
            }
        );
    }
}
