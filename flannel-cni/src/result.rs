//! The delegate's ADD result, handed on to the runtime.
//!
//! The delegate gets our `cniVersion` and answers in it (the bridge plugin converts its
//! result itself), so the result normally passes through byte for byte. Only when it reports
//! another version of the 0.3.0+ result format (same layout, apart from `ips[].version`,
//! which 0.3.x/0.4.0 have and 1.x dropped) is it converted; results of the 0.1/0.2 format
//! are passed through unchanged.

use serde_json::Value;

use crate::{
    cni::{CniError, code, parse_version},
    config::Object,
};

/// The first version of the current result format (`interfaces`, `ips`, `routes`, `dns`).
const MODERN: (u64, u64, u64) = (0, 3, 0);
/// From here `ips[].version` is gone.
const NO_IP_VERSION: (u64, u64, u64) = (1, 0, 0);

/// Checks the delegate's stdout is a JSON object and returns what to print for a config of
/// `wanted` version (empty: whatever the delegate chose).
pub fn adapt(stdout: Vec<u8>, wanted: &str) -> Result<Vec<u8>, CniError> {
    let mut result: Value = serde_json::from_slice(&stdout).map_err(|e| {
        CniError::new(
            code::DELEGATE_FAILED,
            format!("failed to delegate add: the delegate printed an invalid result: {e}"),
        )
    })?;
    let Some(obj) = result.as_object_mut() else {
        return Err(CniError::new(
            code::DELEGATE_FAILED,
            "failed to delegate add: the delegate printed a result that is not a JSON object",
        ));
    };
    let got = obj
        .get("cniVersion")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_owned();
    if wanted.is_empty() || got == wanted {
        return Ok(stdout);
    }
    let (Some(from), Some(to)) = (parse_version(&got), parse_version(wanted)) else {
        return Ok(stdout);
    };
    if from < MODERN || to < MODERN {
        return Ok(stdout);
    }
    obj.insert("cniVersion".into(), Value::from(wanted));
    if let Some(Value::Array(ips)) = obj.get_mut("ips") {
        for ip in ips.iter_mut().filter_map(Value::as_object_mut) {
            if to >= NO_IP_VERSION {
                ip.remove("version");
            } else if !ip.contains_key("version") {
                let v6 = ip
                    .get("address")
                    .and_then(Value::as_str)
                    .is_some_and(|a| a.contains(':'));
                ip.insert("version".into(), Value::from(if v6 { "6" } else { "4" }));
            }
        }
    }
    Ok(crate::cni::pretty(&result))
}

/// For CHECK: gives each route of a result that has no `gw` the gateway of the first IP of
/// the same family that has one, which is the gateway the delegate installed it through
/// (`ipam.ConfigureIface` in containernetworking/plugins). flannel's routes have no `gw`, and
/// the delegates of containernetworking/plugins before v1.3.0 compare a missing gateway
/// literally and fail CHECK (`Expected Route {..GW:<nil>} not found in routing table`,
/// fixed by containernetworking/plugins#887); newer ones accept either form.
pub fn with_implied_gateways(result: &mut Object) {
    let family_is_v6 = |cidr: &str| cidr.contains(':');
    let gateway = |v6: bool| -> Option<Value> {
        result.get("ips")?.as_array()?.iter().find_map(|ip| {
            let address = ip.get("address")?.as_str()?;
            let gw = ip.get("gateway")?.as_str()?;
            (family_is_v6(address) == v6 && !gw.is_empty()).then(|| Value::from(gw))
        })
    };
    let (v4, v6) = (gateway(false), gateway(true));
    let Some(Value::Array(routes)) = result.get_mut("routes") else {
        return;
    };
    for route in routes.iter_mut().filter_map(Value::as_object_mut) {
        let has_gw = route
            .get("gw")
            .and_then(Value::as_str)
            .is_some_and(|gw| !gw.is_empty());
        let Some(dst) = route.get("dst").and_then(Value::as_str) else {
            continue;
        };
        let implied = if family_is_v6(dst) { &v6 } else { &v4 };
        if let (false, Some(gw)) = (has_gw, implied) {
            route.insert("gw".into(), gw.clone());
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn same_version_passes_through_unchanged() {
        let raw = b"{\"cniVersion\":\"0.3.1\",\"ips\":[{\"version\":\"4\",\"address\":\"10.1.17.2/24\"}]}\n".to_vec();
        assert_eq!(adapt(raw.clone(), "0.3.1").unwrap(), raw);
        assert_eq!(adapt(raw.clone(), "").unwrap(), raw);
    }

    #[test]
    fn converts_within_the_modern_format() {
        let raw = json!({"cniVersion":"1.0.0","ips":[{"address":"10.1.17.2/24","gateway":"10.1.17.1"},{"address":"fc00::2/64"}]});
        let out: Value =
            serde_json::from_slice(&adapt(raw.to_string().into_bytes(), "0.3.1").unwrap()).unwrap();
        assert_eq!(
            out,
            json!({"cniVersion":"0.3.1","ips":[{"address":"10.1.17.2/24","gateway":"10.1.17.1","version":"4"},{"address":"fc00::2/64","version":"6"}]})
        );
        let back: Value =
            serde_json::from_slice(&adapt(serde_json::to_vec(&out).unwrap(), "1.1.0").unwrap())
                .unwrap();
        assert_eq!(back["cniVersion"], "1.1.0");
        assert!(back["ips"][0].get("version").is_none());
    }

    #[test]
    fn legacy_results_pass_through() {
        let raw = br#"{"cniVersion":"0.2.0","ip4":{"ip":"10.1.17.2/24"}}"#.to_vec();
        assert_eq!(adapt(raw.clone(), "0.3.1").unwrap(), raw);
    }

    #[test]
    fn invalid_results_are_errors() {
        assert_eq!(adapt(b"nope".to_vec(), "1.0.0").unwrap_err().code, 102);
        assert_eq!(adapt(b"[1]".to_vec(), "1.0.0").unwrap_err().code, 102);
    }

    #[test]
    fn implied_gateways_fill_routes_without_gw() {
        let mut result = json!({
            "cniVersion": "1.0.0",
            "ips": [
                {"address": "fc00::5/64", "gateway": "fc00::1"},
                {"address": "10.244.5.7/24", "gateway": "10.244.5.1"}
            ],
            "routes": [
                {"dst": "10.244.0.0/16"},
                {"dst": "fc00::/48"},
                {"dst": "0.0.0.0/0", "gw": "10.244.5.254"},
                {"dst": "10.96.0.0/12", "gw": ""}
            ]
        });
        with_implied_gateways(result.as_object_mut().unwrap());
        assert_eq!(
            result["routes"],
            json!([
                {"dst": "10.244.0.0/16", "gw": "10.244.5.1"},
                {"dst": "fc00::/48", "gw": "fc00::1"},
                {"dst": "0.0.0.0/0", "gw": "10.244.5.254"},
                {"dst": "10.96.0.0/12", "gw": "10.244.5.1"}
            ])
        );
        // No gateway of that family: left alone.
        let mut result =
            json!({"ips": [{"address": "10.1.1.2/24"}], "routes": [{"dst": "10.0.0.0/8"}]});
        with_implied_gateways(result.as_object_mut().unwrap());
        assert_eq!(result["routes"], json!([{"dst": "10.0.0.0/8"}]));
    }

    /// Random edits of a delegate's result, adapted to random versions: an adapted result
    /// or an error, never a panic; what is adapted is a JSON object.
    #[test]
    fn never_panics_on_random_results() {
        use rand::{Rng, SeedableRng, rngs::StdRng};
        let seed = r#"{"cniVersion":"1.0.0","interfaces":[{"name":"cni0"}],"ips":[{"interface":0,"address":"10.1.17.2/24","gateway":"10.1.17.1"},{"address":"fc00::2/64"}],"routes":[{"dst":"0.0.0.0/0"}],"dns":{}}"#;
        let alphabet: Vec<char> = "{}[]\":,0123456789./-abcdefipsversion ".chars().collect();
        let versions = [
            "", "0.1.0", "0.2.0", "0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0", "2", "x.y",
        ];
        let mut rng = StdRng::seed_from_u64(0x7e5);
        let mut adapted = 0u32;
        for _ in 0..6000 {
            let text = crate::testutil::mutate(&mut rng, seed, &alphabet, 4);
            let wanted = versions[rng.random_range(0..versions.len())];
            if let Ok(out) = adapt(text.into_bytes(), wanted) {
                adapted += 1;
                let v: Value = serde_json::from_slice(&out).unwrap();
                assert!(v.is_object(), "{v}");
            }
        }
        assert!(adapted >= 300, "only {adapted} results adapted");
    }
}
