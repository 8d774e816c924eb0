//! Building the delegate plugin's configuration for ADD (upstream's Linux `doCmdAdd`).
//!
//! Starting from the config's `delegate` object (plus `runtimeConfig`):
//! 1. `name` = our name;
//! 2. `type` = `bridge` if absent;
//! 3. `ipMasq` = NOT `FLANNEL_IPMASQ` if absent;
//! 4. `mtu` = `FLANNEL_MTU` if absent;
//! 5. for `bridge`: `isGateway` = true if absent;
//! 6. `cniVersion` = ours if we have one;
//! 7. `ipam` = our `ipam` (or `{}`), `type` defaulting to `host-local`, `ranges` = one range
//!    set per family present (`[[{"subnet": v4}], [{"subnet": v6}]]`), `routes` = the input
//!    routes followed by `{"dst": net}` for each v4 then v6 network; other keys kept.
//!
//! Step 8 (store, then invoke) is in [`crate::plugin`]. The bytes are those upstream's Go
//! `json.Marshal` produces: compact, object keys sorted, routes in the CNI route field order.

use std::net::IpAddr;

use ipnet::IpNet;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::{
    config::{ConfigError, NetConf, Object},
    subnet_env::SubnetEnv,
};

/// The delegate plugin used when `delegate.type` is absent.
pub const DEFAULT_TYPE: &str = "bridge";
/// The ipam plugin used when `ipam.type` is absent.
pub const DEFAULT_IPAM_TYPE: &str = "host-local";

/// One CNI route as the reference library (de)serialises `types.Route`: unknown keys are
/// dropped and the output keeps this field order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Route {
    /// Destination; the address is kept as written (not masked).
    pub dst: IpNet,
    /// Gateway; an empty string counts as absent.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "gw_from_str"
    )]
    pub gw: Option<IpAddr>,
    /// Route MTU (0 = unset).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub mtu: i64,
    /// Advertised MSS (0 = unset).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub advmss: i64,
    /// Metric (0 = unset).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub priority: i64,
    /// Routing table.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub table: Option<i64>,
    /// Route scope.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scope: Option<i64>,
}

fn is_zero(v: &i64) -> bool {
    *v == 0
}

fn gw_from_str<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<IpAddr>, D::Error> {
    let s: Option<String> = Option::deserialize(d)?;
    match s.as_deref() {
        None | Some("") => Ok(None),
        Some(s) => s
            .parse()
            .map(Some)
            .map_err(|_| serde::de::Error::custom(format!("invalid IP address: {s}"))),
    }
}

impl Route {
    fn to(dst: IpNet) -> Self {
        Route {
            dst,
            gw: None,
            mtu: 0,
            advmss: 0,
            priority: 0,
            table: None,
            scope: None,
        }
    }
}

/// A delegate configuration ready to store and send.
#[derive(Debug, Clone, PartialEq)]
pub struct Delegate {
    /// The plugin to run (`type`).
    pub plugin: String,
    /// The configuration, as it will be serialised.
    pub config: Object,
}

impl Delegate {
    /// Compact JSON, as stored in `<dataDir>/<containerID>` and sent on the delegate's stdin.
    pub fn to_bytes(&self) -> Vec<u8> {
        Value::Object(self.config.clone()).to_string().into_bytes()
    }
}

/// Builds the delegate for ADD (steps 1–7 above). `conf.delegate` must have passed
/// [`NetConf::validate_delegate`].
pub fn build(conf: &NetConf, env: &SubnetEnv) -> Result<Delegate, ConfigError> {
    let mut d = conf.delegate.clone().unwrap_or_default();
    if let Some(rc) = &conf.runtime_config {
        d.insert("runtimeConfig".into(), Value::Object(rc.clone()));
    }
    d.insert("name".into(), Value::from(conf.name.as_str()));
    if !d.contains_key("type") {
        d.insert("type".into(), Value::from(DEFAULT_TYPE));
    }
    if !d.contains_key("ipMasq") {
        d.insert("ipMasq".into(), Value::Bool(!env.ipmasq));
    }
    if !d.contains_key("mtu") {
        d.insert("mtu".into(), Value::from(env.mtu));
    }
    let plugin = match d.get("type") {
        Some(Value::String(t)) => t.clone(),
        _ => return Err(ConfigError::DelegateType),
    };
    if plugin == DEFAULT_TYPE && !d.contains_key("isGateway") {
        d.insert("isGateway".into(), Value::Bool(true));
    }
    if !conf.cni_version.is_empty() {
        d.insert("cniVersion".into(), Value::from(conf.cni_version.as_str()));
    }
    let (ipam, routes) = ipam(conf, env)?;
    d.insert("ipam".into(), Value::Object(ipam));

    // Go marshals maps with sorted keys; routes are structs and keep their field order.
    let mut config = Value::Object(d);
    config.sort_all_objects();
    let routes =
        serde_json::to_value(routes).map_err(|e| ConfigError::IpamRoutes(e.to_string()))?;
    if let Some(Value::Object(ipam)) = config.get_mut("ipam") {
        ipam.insert("routes".into(), routes);
    }
    let Value::Object(config) = config else {
        return Err(ConfigError::DelegateType);
    };
    Ok(Delegate { plugin, config })
}

/// Step 7: the ipam section (without routes) and the routes.
fn ipam(conf: &NetConf, env: &SubnetEnv) -> Result<(Object, Vec<Route>), ConfigError> {
    let mut ipam = conf.ipam.clone().unwrap_or_default();
    if !ipam.contains_key("type") {
        ipam.insert("type".into(), Value::from(DEFAULT_IPAM_TYPE));
    }
    let ranges: Vec<Value> = [env.subnet, env.ipv6_subnet]
        .into_iter()
        .flatten()
        .map(|subnet| serde_json::json!([{ "subnet": subnet.to_string() }]))
        .collect();
    ipam.insert("ranges".into(), Value::Array(ranges));

    let mut routes: Vec<Route> = match ipam.get("routes") {
        Some(value) => Option::<Vec<Route>>::deserialize(value)
            .map_err(|e| ConfigError::IpamRoutes(e.to_string()))?
            .unwrap_or_default(),
        None => Vec::new(),
    };
    routes.extend(
        env.networks
            .iter()
            .chain(&env.ipv6_networks)
            .map(|net| Route::to(*net)),
    );
    // Placeholder keeps the key in place for sorting; the real value is set after sorting.
    ipam.insert("routes".into(), Value::Null);
    Ok((ipam, routes))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::subnet_env;

    const IPV4: &str = "FLANNEL_NETWORK=10.1.0.0/16\nFLANNEL_SUBNET=10.1.17.1/24\nFLANNEL_MTU=1472\nFLANNEL_IPMASQ=true\n";
    const IPV6: &str = "FLANNEL_IPV6_NETWORK=fc00::/48\nFLANNEL_IPV6_SUBNET=fc00::1/64\nFLANNEL_MTU=1472\nFLANNEL_IPMASQ=true\n";
    const DUAL: &str = "FLANNEL_NETWORK=10.1.0.0/16\nFLANNEL_SUBNET=10.1.17.1/24\nFLANNEL_IPV6_NETWORK=fc00::/48\nFLANNEL_IPV6_SUBNET=fc00::1/64\nFLANNEL_MTU=1472\nFLANNEL_IPMASQ=true\n";
    const TWO_NETWORKS: &str = "FLANNEL_NETWORK=10.1.0.0/16,192.168.0.0/16\nFLANNEL_SUBNET=10.1.17.1/24\nFLANNEL_MTU=1472\nFLANNEL_IPMASQ=true\n";

    /// The upstream test input with an optional ipam section.
    fn input(ipam: Option<Value>) -> NetConf {
        let mut v = json!({
            "name": "cni-flannel",
            "type": "flannel",
            "subnetFile": "/x/subnet.env",
            "dataDir": "/x/data",
        });
        if let Some(ipam) = ipam {
            v["ipam"] = ipam;
        }
        NetConf::parse(v.to_string().as_bytes()).unwrap()
    }

    fn delegate(conf: &NetConf, env: &str) -> Delegate {
        let env = subnet_env::parse("s", env).unwrap();
        conf.validate_delegate().unwrap();
        build(conf, &env).unwrap()
    }

    fn as_value(d: &Delegate) -> Value {
        serde_json::from_slice(&d.to_bytes()).unwrap()
    }

    #[test]
    fn golden_ipv4() {
        let d = delegate(&input(None), IPV4);
        assert_eq!(d.plugin, "bridge");
        assert_eq!(
            as_value(&d),
            json!({"ipMasq":false,"ipam":{"routes":[{"dst":"10.1.0.0/16"}],"ranges":[[{"subnet":"10.1.17.0/24"}]],"type":"host-local"},"isGateway":true,"mtu":1472,"name":"cni-flannel","type":"bridge"})
        );
        // Byte-exact with Go's json.Marshal of the same map (sorted keys, compact).
        assert_eq!(
            String::from_utf8(d.to_bytes()).unwrap(),
            r#"{"ipMasq":false,"ipam":{"ranges":[[{"subnet":"10.1.17.0/24"}]],"routes":[{"dst":"10.1.0.0/16"}],"type":"host-local"},"isGateway":true,"mtu":1472,"name":"cni-flannel","type":"bridge"}"#
        );
    }

    #[test]
    fn golden_two_networks() {
        let d = delegate(&input(None), TWO_NETWORKS);
        assert_eq!(
            as_value(&d),
            json!({"ipMasq":false,"ipam":{"routes":[{"dst":"10.1.0.0/16"},{"dst":"192.168.0.0/16"}],"ranges":[[{"subnet":"10.1.17.0/24"}]],"type":"host-local"},"isGateway":true,"mtu":1472,"name":"cni-flannel","type":"bridge"})
        );
    }

    #[test]
    fn golden_ipv6_only() {
        let d = delegate(&input(None), IPV6);
        assert_eq!(
            as_value(&d),
            json!({"ipMasq":false,"ipam":{"routes":[{"dst":"fc00::/48"}],"ranges":[[{"subnet":"fc00::/64"}]],"type":"host-local"},"isGateway":true,"mtu":1472,"name":"cni-flannel","type":"bridge"})
        );
    }

    #[test]
    fn golden_dual_stack() {
        let d = delegate(&input(None), DUAL);
        assert_eq!(
            as_value(&d),
            json!({"ipMasq":false,"ipam":{"routes":[{"dst":"10.1.0.0/16"},{"dst":"fc00::/48"}],"ranges":[[{"subnet":"10.1.17.0/24"}],[{"subnet":"fc00::/64"}]],"type":"host-local"},"isGateway":true,"mtu":1472,"name":"cni-flannel","type":"bridge"})
        );
        assert_eq!(
            String::from_utf8(d.to_bytes()).unwrap(),
            r#"{"ipMasq":false,"ipam":{"ranges":[[{"subnet":"10.1.17.0/24"}],[{"subnet":"fc00::/64"}]],"routes":[{"dst":"10.1.0.0/16"},{"dst":"fc00::/48"}],"type":"host-local"},"isGateway":true,"mtu":1472,"name":"cni-flannel","type":"bridge"}"#
        );
    }

    fn custom_ipam(with_type: bool) -> Value {
        let mut ipam = json!({
            "unknown-param": "unknown-value",
            "routes": [
                { "dst": "10.96.0.0/12" },
                { "dst": "192.168.244.0/24", "gw": "10.1.17.20" }
            ]
        });
        if with_type {
            ipam["type"] = json!("my-ipam");
        }
        ipam
    }

    #[test]
    fn golden_custom_ipam_passthrough() {
        let d = delegate(&input(Some(custom_ipam(true))), IPV4);
        assert_eq!(
            as_value(&d),
            json!({"ipMasq":false,"ipam":{"routes":[{"dst":"10.96.0.0/12"},{"dst":"192.168.244.0/24","gw":"10.1.17.20"},{"dst":"10.1.0.0/16"}],"ranges":[[{"subnet":"10.1.17.0/24"}]],"type":"my-ipam","unknown-param":"unknown-value"},"isGateway":true,"mtu":1472,"name":"cni-flannel","type":"bridge"})
        );
        // Without an ipam type, host-local is filled in and the rest still passes through.
        let d = delegate(&input(Some(custom_ipam(false))), DUAL);
        assert_eq!(
            as_value(&d),
            json!({"ipMasq":false,"ipam":{"routes":[{"dst":"10.96.0.0/12"},{"dst":"192.168.244.0/24","gw":"10.1.17.20"},{"dst":"10.1.0.0/16"},{"dst":"fc00::/48"}],"ranges":[[{"subnet":"10.1.17.0/24"}],[{"subnet":"fc00::/64"}]],"type":"host-local","unknown-param":"unknown-value"},"isGateway":true,"mtu":1472,"name":"cni-flannel","type":"bridge"})
        );
    }

    #[test]
    fn manifest_config() {
        let conf = NetConf::parse(
            br#"{"name":"cbr0","cniVersion":"0.3.1","type":"flannel",
                 "delegate":{"hairpinMode":true,"isDefaultGateway":true}}"#,
        )
        .unwrap();
        let d = delegate(
            &conf,
            "FLANNEL_NETWORK=10.244.0.0/16\nFLANNEL_SUBNET=10.244.5.1/24\nFLANNEL_MTU=1450\nFLANNEL_IPMASQ=false\n",
        );
        assert_eq!(
            String::from_utf8(d.to_bytes()).unwrap(),
            r#"{"cniVersion":"0.3.1","hairpinMode":true,"ipMasq":true,"ipam":{"ranges":[[{"subnet":"10.244.5.0/24"}]],"routes":[{"dst":"10.244.0.0/16"}],"type":"host-local"},"isDefaultGateway":true,"isGateway":true,"mtu":1450,"name":"cbr0","type":"bridge"}"#
        );
    }

    #[test]
    fn delegate_values_win_and_non_bridge_gets_no_is_gateway() {
        let conf = NetConf::parse(
            br#"{"name":"n","cniVersion":"1.0.0","type":"flannel",
                 "delegate":{"type":"ipvlan","ipMasq":true,"mtu":9000,"cniVersion":"0.4.0","master":"eth0"},
                 "runtimeConfig":{"z":{"b":1,"a":2}}}"#,
        )
        .unwrap();
        let d = delegate(&conf, IPV4);
        assert_eq!(d.plugin, "ipvlan");
        assert_eq!(
            String::from_utf8(d.to_bytes()).unwrap(),
            r#"{"cniVersion":"1.0.0","ipMasq":true,"ipam":{"ranges":[[{"subnet":"10.1.17.0/24"}]],"routes":[{"dst":"10.1.0.0/16"}],"type":"host-local"},"master":"eth0","mtu":9000,"name":"n","runtimeConfig":{"z":{"a":2,"b":1}},"type":"ipvlan"}"#
        );
    }

    #[test]
    fn bridge_keeps_explicit_is_gateway() {
        let conf = NetConf::parse(
            br#"{"name":"n","delegate":{"isGateway":false,"runtimeConfig":{"old":1}},"runtimeConfig":{"new":2}}"#,
        )
        .unwrap();
        let v = as_value(&delegate(&conf, IPV4));
        assert_eq!(v["isGateway"], json!(false));
        // Our runtimeConfig replaces the delegate's.
        assert_eq!(v["runtimeConfig"], json!({"new": 2}));
        assert!(v.get("cniVersion").is_none());
    }

    #[test]
    fn route_fields_keep_cni_order_and_drop_unknown_keys() {
        let ipam = json!({"routes":[{"table":0,"scope":253,"priority":5,"advmss":1400,"mtu":1300,"gw":"10.1.17.20","dst":"10.96.0.1/12","foo":"bar"},{"dst":"10.97.0.0/16","gw":""}]});
        let d = delegate(&input(Some(ipam)), IPV4);
        let text = String::from_utf8(d.to_bytes()).unwrap();
        assert!(
            text.contains(r#""routes":[{"dst":"10.96.0.1/12","gw":"10.1.17.20","mtu":1300,"advmss":1400,"priority":5,"table":0,"scope":253},{"dst":"10.97.0.0/16"},{"dst":"10.1.0.0/16"}]"#),
            "{text}"
        );
    }

    #[test]
    fn null_routes_are_empty() {
        let d = delegate(&input(Some(json!({"routes": null}))), IPV4);
        assert_eq!(
            as_value(&d)["ipam"]["routes"],
            json!([{"dst":"10.1.0.0/16"}])
        );
    }

    #[test]
    fn bad_routes_are_invalid_config() {
        let env = subnet_env::parse("s", IPV4).unwrap();
        for routes in [
            json!({"dst": "10.0.0.0/8"}),
            json!([{"dst": "not-a-cidr"}]),
            json!([{"dst": "10.0.0.0/8", "gw": "nope"}]),
            json!([{"gw": "10.0.0.1"}]),
        ] {
            let err = build(&input(Some(json!({ "routes": routes }))), &env).unwrap_err();
            assert_eq!(err.code(), 7);
            assert!(
                err.to_string().starts_with(
                    "failed to assemble Delegate IPAM: failed to read IPAM routes: failed to parse ipam.routes: "
                ),
                "{err}"
            );
        }
    }

    /// Random edits of a valid configuration and subnet.env: each is parsed, checked and
    /// built into a delegate config or refused with an error, never a panic; a delegate config
    /// that is built is a JSON object naming its plugin.
    #[test]
    fn never_panics_on_random_input() {
        use rand::{SeedableRng, rngs::StdRng};
        let conf_seed = r#"{"cniVersion":"1.0.0","name":"cbr0","type":"flannel","delegate":{"hairpinMode":true,"isDefaultGateway":true},"ipam":{"type":"host-local"},"runtimeConfig":{"ips":["10.1.17.5/24"]}}"#;
        let alphabet: Vec<char> = "{}[]\":,0123456789abcdef./-=_ \ntypenameipamdelegatetruenull"
            .chars()
            .collect();
        let mut rng = StdRng::seed_from_u64(0xc41);
        let mut built = 0u32;
        for i in 0..6000 {
            let conf = crate::testutil::mutate(&mut rng, conf_seed, &alphabet, 4);
            let env = [IPV4, IPV6, DUAL, TWO_NETWORKS][i % 4];
            let env = crate::testutil::mutate(&mut rng, env, &alphabet, 4);
            let (Ok(conf), Ok(env)) = (
                NetConf::parse(conf.as_bytes()),
                subnet_env::parse("s", &env),
            ) else {
                continue;
            };
            if conf.validate_delegate().is_err() {
                continue;
            }
            if let Ok(d) = build(&conf, &env) {
                built += 1;
                let v = as_value(&d);
                assert_eq!(v["type"].as_str(), Some(d.plugin.as_str()), "{v}");
            }
        }
        // The edits must reach the building too, not only the errors.
        assert!(built >= 300, "only {built} delegate configs built");
    }
}
