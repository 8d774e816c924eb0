//! What the agent writes to its own Node: the lease annotations (upstream `AcquireLease`,
//! step 3) and the `NetworkUnavailable=False` condition (upstream `CompleteLease`). Both go
//! to the `nodes/<name>/status` subresource as strategic-merge patches; the bodies are built
//! here as text, byte-compatible with what upstream's Go code sends.

use std::collections::BTreeMap;
use std::time::{SystemTime, UNIX_EPOCH};

use k8s_openapi::jiff::Timestamp;

use super::AnnotationKeys;
use super::node::go_ipv6_string;
use crate::gojson;
use crate::lease::LeaseAttrs;

/// The annotations `acquire_lease` sets on the own node, given its current annotations and
/// the lease attributes; only the entries whose value changes are returned (so an empty map
/// means "nothing to patch").
///
/// Upstream's decision, step by step:
/// * Nothing is written unless one of the managed IPv4 annotations (`backend-data`,
///   `backend-type`, `public-ip`, `kube-subnet-manager`) differs from what it would write, or
///   `public-ip-overwrite` is set and differs from the detected address — or the same for
///   IPv6 when the attributes carry an IPv6 public address.
/// * Then `backend-type` is set; `backend-data` and `public-ip` too, except for vxlan with
///   `null` IPv4 data (an IPv6-only node). `public-ip` takes `public-ip-overwrite` when that
///   is set (logged when it changes the annotation).
/// * `backend-v6-data` and `public-ipv6` (or `public-ipv6-overwrite`) are set for vxlan with
///   non-null IPv6 data, wireguard with non-null IPv6 data and an IPv6 address, host-gw or
///   extension with an IPv6 address.
/// * `kube-subnet-manager` becomes `"true"`.
pub fn annotation_changes(
    keys: &AnnotationKeys,
    current: &BTreeMap<String, String>,
    attrs: &LeaseAttrs,
) -> BTreeMap<String, String> {
    let get = |k: &str| current.get(k).map(String::as_str).unwrap_or("");
    let bd = attrs
        .backend_data
        .as_ref()
        .map_or("null", |d| d.as_str())
        .to_owned();
    let v6bd = attrs
        .backend_v6_data
        .as_ref()
        .map_or("null", |d| d.as_str())
        .to_owned();
    let bt = attrs.backend_type.as_str();
    let public_ip = attrs.public_ip.to_string();
    let public_ipv6 = attrs.public_ipv6.map(go_ipv6_string);

    let v4_differs = get(&keys.backend_data) != bd
        || get(&keys.backend_type) != bt
        || get(&keys.public_ip) != public_ip
        || get(&keys.subnet_kube_managed) != "true"
        || (!get(&keys.public_ip_overwrite).is_empty()
            && get(&keys.public_ip_overwrite) != public_ip);
    let v6_differs = public_ipv6.as_deref().is_some_and(|v6| {
        get(&keys.backend_v6_data) != v6bd
            || get(&keys.backend_type) != bt
            || get(&keys.public_ipv6) != v6
            || get(&keys.subnet_kube_managed) != "true"
            || (!get(&keys.public_ipv6_overwrite).is_empty()
                && get(&keys.public_ipv6_overwrite) != v6)
    });
    if !v4_differs && !v6_differs {
        return BTreeMap::new();
    }

    let mut want: BTreeMap<String, String> = BTreeMap::new();
    want.insert(keys.backend_type.clone(), bt.to_owned());
    if !(bt == "vxlan" && bd == "null") {
        want.insert(keys.backend_data.clone(), bd);
        let overwrite = get(&keys.public_ip_overwrite);
        if overwrite.is_empty() {
            want.insert(keys.public_ip.clone(), public_ip);
        } else if get(&keys.public_ip) != overwrite {
            tracing::info!(
                "Overriding public ip with '{overwrite}' from node annotation '{}'",
                keys.public_ip_overwrite
            );
            want.insert(keys.public_ip.clone(), overwrite.to_owned());
        }
    }
    let v6_wanted = match bt {
        "vxlan" => v6bd != "null",
        "wireguard" => v6bd != "null" && public_ipv6.is_some(),
        "host-gw" | "extension" => public_ipv6.is_some(),
        _ => false,
    };
    if v6_wanted {
        want.insert(keys.backend_v6_data.clone(), v6bd);
        let overwrite = get(&keys.public_ipv6_overwrite);
        if overwrite.is_empty() {
            if let Some(v6) = public_ipv6 {
                want.insert(keys.public_ipv6.clone(), v6);
            }
        } else if get(&keys.public_ipv6) != overwrite {
            tracing::info!(
                "Overriding public ipv6 with '{overwrite}' from node annotation '{}'",
                keys.public_ipv6_overwrite
            );
            want.insert(keys.public_ipv6.clone(), overwrite.to_owned());
        }
    }
    want.insert(keys.subnet_kube_managed.clone(), "true".to_owned());
    want.retain(|k, v| current.get(k) != Some(v));
    want
}

/// The strategic-merge patch that sets `changes` (what upstream's two-way merge patch of
/// old and new node yields when only annotations were set): keys sorted, strings escaped
/// the way Go's `encoding/json` does.
pub fn annotations_patch(changes: &BTreeMap<String, String>) -> String {
    let mut out = String::from("{\"metadata\":{\"annotations\":{");
    for (i, (k, v)) in changes.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        gojson::write_string(&mut out, k);
        out.push(':');
        gojson::write_string(&mut out, v);
    }
    out.push_str("}}}");
    out
}

/// The `NetworkUnavailable=False` condition patch (upstream `CompleteLease`), with both
/// times set to `now` (RFC 3339, seconds, UTC, as `metav1.Time` marshals).
pub fn network_unavailable_patch(now: SystemTime) -> String {
    let secs = now
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX));
    let ts = Timestamp::from_second(secs).unwrap_or(Timestamp::UNIX_EPOCH);
    format!(
        "{{\"status\":{{\"conditions\":[{{\"type\":\"NetworkUnavailable\",\"status\":\"False\",\
         \"lastHeartbeatTime\":\"{ts}\",\"lastTransitionTime\":\"{ts}\",\"reason\":\"FlannelIsUp\",\
         \"message\":\"Flannel is running on this node\"}}]}}}}"
    )
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests fail loudly by design
mod tests {
    use std::net::Ipv4Addr;
    use std::time::Duration;

    use super::*;
    use crate::gojson::RawJson;

    fn keys() -> AnnotationKeys {
        AnnotationKeys::new("flannel.alpha.coreos.com").unwrap()
    }

    fn current(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (format!("flannel.alpha.coreos.com/{k}"), v.to_string()))
            .collect()
    }

    fn vxlan_attrs() -> LeaseAttrs {
        LeaseAttrs {
            public_ip: Ipv4Addr::new(192, 168, 77, 17),
            backend_type: "vxlan".into(),
            backend_data: Some(
                RawJson::from_json(r#"{"VNI":1,"VtepMAC":"96:59:b2:3f:04:ee"}"#).unwrap(),
            ),
            ..LeaseAttrs::default()
        }
    }

    #[test]
    fn first_acquire_writes_everything() {
        let changes = annotation_changes(&keys(), &BTreeMap::new(), &vxlan_attrs());
        assert_eq!(
            annotations_patch(&changes),
            r#"{"metadata":{"annotations":{"flannel.alpha.coreos.com/backend-data":"{\"VNI\":1,\"VtepMAC\":\"96:59:b2:3f:04:ee\"}","flannel.alpha.coreos.com/backend-type":"vxlan","flannel.alpha.coreos.com/kube-subnet-manager":"true","flannel.alpha.coreos.com/public-ip":"192.168.77.17"}}}"#
        );
    }

    #[test]
    fn up_to_date_node_is_not_patched_and_changes_are_minimal() {
        let cur = current(&[
            ("backend-data", r#"{"VNI":1,"VtepMAC":"96:59:b2:3f:04:ee"}"#),
            ("backend-type", "vxlan"),
            ("kube-subnet-manager", "true"),
            ("public-ip", "192.168.77.17"),
        ]);
        assert!(annotation_changes(&keys(), &cur, &vxlan_attrs()).is_empty());
        let mut attrs = vxlan_attrs();
        attrs.public_ip = Ipv4Addr::new(192, 168, 77, 18);
        let changes = annotation_changes(&keys(), &cur, &attrs);
        assert_eq!(
            annotations_patch(&changes),
            r#"{"metadata":{"annotations":{"flannel.alpha.coreos.com/public-ip":"192.168.77.18"}}}"#
        );
    }

    #[test]
    fn public_ip_overwrite_wins() {
        let cur = current(&[("public-ip-overwrite", "203.0.113.9")]);
        let changes = annotation_changes(&keys(), &cur, &vxlan_attrs());
        assert_eq!(
            changes
                .get("flannel.alpha.coreos.com/public-ip")
                .map(String::as_str),
            Some("203.0.113.9")
        );
        // Once applied, the overwrite still differs from the detected address, so upstream
        // re-evaluates every start; the result holds no change any more.
        let mut applied = cur.clone();
        applied.extend(changes);
        assert!(annotation_changes(&keys(), &applied, &vxlan_attrs()).is_empty());
    }

    #[test]
    fn vxlan_v6_only_skips_v4_keys() {
        let attrs = LeaseAttrs {
            public_ip: Ipv4Addr::UNSPECIFIED,
            public_ipv6: Some("2001:db8::17".parse().unwrap()),
            backend_type: "vxlan".into(),
            backend_data: None,
            backend_v6_data: Some(
                RawJson::from_json(r#"{"VNI":1,"VtepMAC":"aa:bb:cc:dd:ee:ff"}"#).unwrap(),
            ),
        };
        let changes = annotation_changes(&keys(), &BTreeMap::new(), &attrs);
        let names: Vec<&str> = changes.keys().map(String::as_str).collect();
        assert_eq!(
            names,
            [
                "flannel.alpha.coreos.com/backend-type",
                "flannel.alpha.coreos.com/backend-v6-data",
                "flannel.alpha.coreos.com/kube-subnet-manager",
                "flannel.alpha.coreos.com/public-ipv6",
            ]
        );
    }

    #[test]
    fn host_gw_dual_stack_and_v6_overwrite() {
        let attrs = LeaseAttrs {
            public_ip: Ipv4Addr::new(10, 0, 0, 1),
            public_ipv6: Some("2001:db8::1".parse().unwrap()),
            backend_type: "host-gw".into(),
            ..LeaseAttrs::default()
        };
        let cur = current(&[("public-ipv6-overwrite", "2001:db8::99")]);
        let changes = annotation_changes(&keys(), &cur, &attrs);
        assert_eq!(
            annotations_patch(&changes),
            r#"{"metadata":{"annotations":{"flannel.alpha.coreos.com/backend-data":"null","flannel.alpha.coreos.com/backend-type":"host-gw","flannel.alpha.coreos.com/backend-v6-data":"null","flannel.alpha.coreos.com/kube-subnet-manager":"true","flannel.alpha.coreos.com/public-ip":"10.0.0.1","flannel.alpha.coreos.com/public-ipv6":"2001:db8::99"}}}"#
        );
        // udp: no v6 keys even with an IPv6 address.
        let udp = LeaseAttrs {
            backend_type: String::new(),
            ..attrs
        };
        let changes = annotation_changes(&keys(), &BTreeMap::new(), &udp);
        assert!(!changes.contains_key("flannel.alpha.coreos.com/backend-v6-data"));
    }

    #[test]
    fn extension_publishes_its_json_string_and_v6_address() {
        let attrs = LeaseAttrs {
            public_ip: Ipv4Addr::new(10, 0, 0, 1),
            public_ipv6: Some("2001:db8::1".parse().unwrap()),
            backend_type: "extension".into(),
            backend_data: Some(
                crate::gojson::RawJson::from_json(r#""0e:2a \u003cx\u003e""#).unwrap(),
            ),
            ..LeaseAttrs::default()
        };
        let changes = annotation_changes(&keys(), &BTreeMap::new(), &attrs);
        assert_eq!(
            annotations_patch(&changes),
            r#"{"metadata":{"annotations":{"flannel.alpha.coreos.com/backend-data":"\"0e:2a \\u003cx\\u003e\"","flannel.alpha.coreos.com/backend-type":"extension","flannel.alpha.coreos.com/backend-v6-data":"null","flannel.alpha.coreos.com/kube-subnet-manager":"true","flannel.alpha.coreos.com/public-ip":"10.0.0.1","flannel.alpha.coreos.com/public-ipv6":"2001:db8::1"}}}"#
        );
    }

    #[test]
    fn go_escaping_in_patch() {
        let mut m = BTreeMap::new();
        m.insert("a/b".to_owned(), "<&>".to_owned());
        assert_eq!(
            annotations_patch(&m),
            r#"{"metadata":{"annotations":{"a/b":"\u003c\u0026\u003e"}}}"#
        );
    }

    #[test]
    fn network_unavailable_body() {
        let t = UNIX_EPOCH + Duration::from_secs(1_700_000_000) + Duration::from_millis(250);
        assert_eq!(
            network_unavailable_patch(t),
            r#"{"status":{"conditions":[{"type":"NetworkUnavailable","status":"False","lastHeartbeatTime":"2023-11-14T22:13:20Z","lastTransitionTime":"2023-11-14T22:13:20Z","reason":"FlannelIsUp","message":"Flannel is running on this node"}]}}"#
        );
    }
}
