//! What the node cache keeps of a Node: its name, uid and resourceVersion, the annotations
//! under the flannel prefix and its pod CIDRs, all that the leases and the own Node's upkeep
//! read.
//!
//! A Node as the API server sends it is mostly status (the container images the node holds,
//! conditions, addresses, capacity) and `managedFields`, tens of kilobytes each; an informer
//! that keeps whole objects, as upstream's does, holds all of it for every node of the
//! cluster. The watch here reads Nodes as [`LeanNode`], whose deserializer skips everything
//! else without allocating it, and the cache stores them as `Node` objects holding only those
//! fields ([`LeanNode::into_node`]). An update that changes none of them (status: a
//! kubelet's heartbeats) is not announced to the lease set ([`same_content`]).
//! `cargo xtask bench kube-cache` measures the difference.

use std::borrow::Cow;
use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Node, NodeSpec};
use kube::api::ObjectMeta;
use kube::runtime::watcher::Event;
use serde::{Deserialize, Deserializer};

/// A Node as the watch reads it: see the module documentation.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct LeanNode {
    /// Name, uid, resourceVersion and annotations only.
    #[serde(default, deserialize_with = "lean_meta")]
    pub metadata: ObjectMeta,
    /// The pod CIDRs.
    #[serde(default)]
    pub spec: Option<LeanSpec>,
}

/// The part of a Node's spec the leases read.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct LeanSpec {
    /// `spec.podCIDR`.
    #[serde(default, rename = "podCIDR")]
    pub pod_cidr: Option<String>,
    /// `spec.podCIDRs`.
    #[serde(default, rename = "podCIDRs")]
    pub pod_cidrs: Option<Vec<String>>,
}

/// The metadata fields [`LeanNode`] reads.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct LeanMeta {
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    uid: Option<String>,
    #[serde(default)]
    resource_version: Option<String>,
    #[serde(default)]
    annotations: Option<BTreeMap<String, String>>,
}

fn lean_meta<'de, D: Deserializer<'de>>(d: D) -> Result<ObjectMeta, D::Error> {
    let m = LeanMeta::deserialize(d)?;
    Ok(ObjectMeta {
        name: m.name,
        uid: m.uid,
        resource_version: m.resource_version,
        annotations: m.annotations,
        ..ObjectMeta::default()
    })
}

impl kube::Resource for LeanNode {
    type DynamicType = ();
    type Scope = k8s_openapi::ClusterResourceScope;

    fn kind(_: &()) -> Cow<'_, str> {
        "Node".into()
    }

    fn group(_: &()) -> Cow<'_, str> {
        "".into()
    }

    fn version(_: &()) -> Cow<'_, str> {
        "v1".into()
    }

    fn plural(_: &()) -> Cow<'_, str> {
        "nodes".into()
    }

    fn meta(&self) -> &ObjectMeta {
        &self.metadata
    }

    fn meta_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

impl LeanNode {
    /// The `Node` the cache stores: these fields, the annotations cut to those under
    /// `prefix` (the normalised annotation prefix).
    pub fn into_node(self, prefix: &str) -> Node {
        let mut metadata = self.metadata;
        if let Some(all) = metadata.annotations.as_mut() {
            all.retain(|key, _| key.starts_with(prefix));
        }
        Node {
            metadata,
            spec: self.spec.map(|s| NodeSpec {
                pod_cidr: s.pod_cidr,
                pod_cidrs: s.pod_cidrs,
                ..NodeSpec::default()
            }),
            status: None,
        }
    }
}

/// Whether two cached Nodes hold the same, resourceVersion aside: a Node's status changes
/// (a kubelet's heartbeats, every few minutes per node) change nothing the leases read.
pub fn same_content(a: &Node, b: &Node) -> bool {
    a.metadata.name == b.metadata.name
        && a.metadata.uid == b.metadata.uid
        && a.metadata.annotations == b.metadata.annotations
        && a.spec == b.spec
}

/// A watch event over [`LeanNode`] as one over the `Node`s the cache stores.
pub fn event(e: Event<LeanNode>, prefix: &str) -> Event<Node> {
    match e {
        Event::Apply(n) => Event::Apply(n.into_node(prefix)),
        Event::Delete(n) => Event::Delete(n.into_node(prefix)),
        Event::InitApply(n) => Event::InitApply(n.into_node(prefix)),
        Event::Init => Event::Init,
        Event::InitDone => Event::InitDone,
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests fail loudly by design
mod tests {
    use super::*;
    use crate::lease::{Lease, LeaseAttrs};
    use crate::subnet::kube::{AnnotationKeys, node, own};

    /// A Node as a kubelet and flannel leave it, images and managed fields included.
    fn full_node() -> serde_json::Value {
        let images: Vec<_> = (0..40)
            .map(|i| {
                serde_json::json!({
                    "names": [format!("registry.example/team/image-{i}@sha256:{:064x}", i),
                              format!("registry.example/team/image-{i}:v1.{i}.0")],
                    "sizeBytes": 1_000_000 + i
                })
            })
            .collect();
        serde_json::json!({
            "kind": "Node", "apiVersion": "v1",
            "metadata": {
                "name": "worker-7", "uid": "9a1c", "resourceVersion": "4711",
                "labels": {"kubernetes.io/hostname": "worker-7", "flannel-rs/agent": "ours"},
                "annotations": {
                    "flannel.alpha.coreos.com/backend-data": "{\"VNI\":1,\"VtepMAC\":\"96:59:b2:3f:04:07\"}",
                    "flannel.alpha.coreos.com/backend-type": "vxlan",
                    "flannel.alpha.coreos.com/kube-subnet-manager": "true",
                    "flannel.alpha.coreos.com/public-ip": "192.168.1.17",
                    "flannel.alpha.coreos.com/public-ip-overwrite": "203.0.113.7",
                    "kubeadm.alpha.kubernetes.io/cri-socket": "unix:///run/containerd/containerd.sock",
                    "node.alpha.kubernetes.io/ttl": "0"
                },
                "managedFields": [{"manager": "kubelet", "operation": "Update", "apiVersion": "v1",
                                   "fieldsType": "FieldsV1", "fieldsV1": {"f:status": {}}}]
            },
            "spec": {"podCIDR": "10.244.7.0/24", "podCIDRs": ["10.244.7.0/24"],
                     "providerID": "kind://docker/kind/worker-7",
                     "taints": [{"key": "dedicated", "value": "db", "effect": "NoSchedule"}]},
            "status": {
                "addresses": [{"type": "InternalIP", "address": "192.168.1.17"}],
                "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady"}],
                "images": images
            }
        })
    }

    #[test]
    fn the_cache_keeps_what_leases_and_upkeep_read() {
        let keys = AnnotationKeys::new("flannel.alpha.coreos.com").unwrap();
        let full: Node = serde_json::from_value(full_node()).unwrap();
        let wire: LeanNode = serde_json::from_value(full_node()).unwrap();
        let kept = wire.into_node(&keys.prefix);

        // Everything read from the cache reads the same.
        assert_eq!(
            node::node_to_lease(&keys, true, false, &kept).unwrap(),
            node::node_to_lease(&keys, true, false, &full).unwrap()
        );
        assert!(node::is_managed(&keys, &kept));
        assert_eq!(
            node::own_pod_cidrs(&kept).unwrap(),
            node::own_pod_cidrs(&full).unwrap()
        );
        let lease = Lease {
            subnet: Some("10.244.7.0/24".parse().unwrap()),
            ipv6_subnet: None,
            attrs: LeaseAttrs {
                public_ip: "192.168.1.17".parse().unwrap(),
                backend_type: "vxlan".into(),
                ..LeaseAttrs::default()
            },
            expiration: None,
        };
        assert_eq!(
            own::upkeep(&keys, Some(&kept), &lease),
            own::upkeep(&keys, Some(&full), &lease)
        );
        assert_eq!(kept.metadata.name.as_deref(), Some("worker-7"));
        assert_eq!(kept.metadata.resource_version.as_deref(), Some("4711"));
        assert_eq!(kept.metadata.uid.as_deref(), Some("9a1c"));

        // And nothing else.
        let ann = kept.metadata.annotations.as_ref().unwrap();
        assert_eq!(ann.len(), 5);
        assert!(
            ann.keys()
                .all(|k| k.starts_with("flannel.alpha.coreos.com/"))
        );
        assert!(kept.status.is_none() && kept.metadata.managed_fields.is_none());
        assert!(kept.metadata.labels.is_none());
        let spec = kept.spec.as_ref().unwrap();
        assert!(spec.taints.is_none() && spec.provider_id.is_none());
        let size = |n: &Node| serde_json::to_vec(n).unwrap().len();
        assert!(
            size(&kept) * 10 < size(&full),
            "{} of {} bytes kept",
            size(&kept),
            size(&full)
        );

        // A status update (here: a new heartbeat and resourceVersion) changes nothing the
        // cache holds; an annotation or a pod CIDR does.
        let mut beat = full_node();
        beat["metadata"]["resourceVersion"] = "4712".into();
        beat["status"]["conditions"][0]["lastHeartbeatTime"] = "2026-12-07T12:00:00Z".into();
        let read = |v: serde_json::Value| {
            serde_json::from_value::<LeanNode>(v)
                .unwrap()
                .into_node(&keys.prefix)
        };
        assert!(same_content(&kept, &read(beat.clone())));
        let mut moved = beat.clone();
        moved["spec"]["podCIDR"] = "10.244.8.0/24".into();
        assert!(!same_content(&kept, &read(moved)));
        let mut ann = beat;
        ann["metadata"]["annotations"]["flannel.alpha.coreos.com/public-ip"] =
            "192.168.1.18".into();
        assert!(!same_content(&kept, &read(ann)));

        // A Node without metadata or spec reads as empty, not as an error.
        let bare: LeanNode = serde_json::from_str(r#"{"kind":"Node"}"#).unwrap();
        assert!(bare.into_node(&keys.prefix).metadata.name.is_none());
    }
}
