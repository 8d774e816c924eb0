//! The deployment files in `deploy/`: the Kubernetes manifest, the kustomization, the
//! Containerfile and the two scripts the image ships.
//!
//! Every YAML document is loaded through the k8s-openapi type of its `kind` and serialized back;
//! the result must equal the document, so a misspelled field (which serde would silently drop)
//! fails the test, as does a value of the wrong type, a wrong `apiVersion` or an unknown kind.
//! On top of that the objects must mean what upstream's kube-flannel.yml means: the same RBAC
//! rules, ConfigMap contents the agent and the CNI plugin accept, agent arguments
//! `flannel_agent::cli::Cli` accepts, probes on the health port those arguments open, and a
//! host mount for every path the agent keeps state in. The scripts are run for real against
//! temporary directories. Nothing here needs root.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::os::unix::fs::{MetadataExt as _, PermissionsExt as _, symlink};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use anyhow::{Context as _, Result, bail, ensure};
use flannel_agent::cli::Cli;
use flannel_agent::netconf::NetConfig;
use flannel_agent::subnet::kube::node::{AGENT_LABEL, UPSTREAM_VALUE};
use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{
    ConfigMap, Container, Namespace, PodSpec, Probe, ServiceAccount, Volume,
};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

const NAMESPACE: &str = "kube-flannel";
const MANIFEST: &str = "kube-flannel.yml";
const KUSTOMIZATION: &str = "kustomization.yaml";
const AGENT_CONTAINER: &str = "kube-flannel";
const INIT_CONTAINER: &str = "install-cni";

fn deploy_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy")
}

fn read_deploy(name: &str) -> String {
    let path = deploy_dir().join(name);
    fs::read_to_string(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
}

// ---------------------------------------------------------------------------------------------
// Loading: YAML documents → typed objects, with the round-trip check.

/// One object of the manifests, typed by its `kind`.
#[derive(Debug, Clone)]
enum Object {
    Namespace(Namespace),
    ServiceAccount(ServiceAccount),
    ClusterRole(ClusterRole),
    ClusterRoleBinding(ClusterRoleBinding),
    ConfigMap(ConfigMap),
    DaemonSet(Box<DaemonSet>),
}

/// The differences between a document and its round trip, one line per JSON path.
fn json_diff(path: &str, doc: &Value, back: &Value, out: &mut Vec<String>) {
    match (doc, back) {
        (Value::Object(a), Value::Object(b)) => {
            for (k, v) in a {
                match b.get(k) {
                    Some(w) => json_diff(&format!("{path}/{k}"), v, w, out),
                    None => out.push(format!(
                        "{path}/{k}: dropped, not a field of the Kubernetes type (misspelled?)"
                    )),
                }
            }
            for k in b.keys().filter(|k| !a.contains_key(*k)) {
                out.push(format!("{path}/{k}: added by the round trip"));
            }
        }
        (Value::Array(a), Value::Array(b)) if a.len() == b.len() => {
            for (i, (v, w)) in a.iter().zip(b).enumerate() {
                json_diff(&format!("{path}/{i}"), v, w, out);
            }
        }
        _ if doc == back => {}
        _ => out.push(format!("{path}: {doc} became {back}")),
    }
}

/// Deserializes `doc` into `T` and requires serializing it back to give `doc` again.
fn typed<T: DeserializeOwned + Serialize>(doc: &Value) -> Result<T> {
    let object: T = serde_json::from_value(doc.clone()).context("not a valid object")?;
    let back = serde_json::to_value(&object)?;
    let mut diffs = Vec::new();
    json_diff("", doc, &back, &mut diffs);
    ensure!(
        diffs.is_empty(),
        "changed by a round trip through k8s-openapi:\n  {}",
        diffs.join("\n  ")
    );
    Ok(object)
}

fn object_from_json(doc: &Value) -> Result<Object> {
    let kind = doc
        .get("kind")
        .and_then(Value::as_str)
        .context("document has no string `kind`")?;
    Ok(match kind {
        "Namespace" => Object::Namespace(typed(doc)?),
        "ServiceAccount" => Object::ServiceAccount(typed(doc)?),
        "ClusterRole" => Object::ClusterRole(typed(doc)?),
        "ClusterRoleBinding" => Object::ClusterRoleBinding(typed(doc)?),
        "ConfigMap" => Object::ConfigMap(typed(doc)?),
        "DaemonSet" => Object::DaemonSet(Box::new(typed(doc)?)),
        other => bail!("unknown kind {other:?} (this test knows the kinds upstream ships)"),
    })
}

/// The non-empty documents of a multi-document YAML text, as JSON.
fn yaml_documents(text: &str) -> Result<Vec<Value>> {
    let mut docs = Vec::new();
    for (i, de) in serde_yaml::Deserializer::from_str(text).enumerate() {
        let yaml = serde_yaml::Value::deserialize(de).with_context(|| format!("document {i}"))?;
        if yaml.is_null() {
            continue; // an empty document (only comments), as kubectl skips it
        }
        docs.push(serde_json::to_value(&yaml).with_context(|| format!("document {i}"))?);
    }
    Ok(docs)
}

/// Every object of one YAML text, typed and round-trip checked.
fn load_text(file: &str, text: &str) -> Result<Vec<Object>> {
    yaml_documents(text)
        .with_context(|| format!("{file}: not YAML"))?
        .iter()
        .enumerate()
        .map(|(i, doc)| {
            let what = format!(
                "{file} document {i} ({} {})",
                doc.get("kind").and_then(Value::as_str).unwrap_or("?"),
                doc.pointer("/metadata/name")
                    .and_then(Value::as_str)
                    .unwrap_or("?")
            );
            object_from_json(doc).context(what)
        })
        .collect()
}

/// The Kubernetes manifests in deploy/: every `*.yml` / `*.yaml` but the kustomization.
fn manifest_files() -> Vec<String> {
    let mut files: Vec<String> = fs::read_dir(deploy_dir())
        .expect("reading deploy/")
        .map(|e| {
            e.expect("deploy/ entry")
                .file_name()
                .to_string_lossy()
                .into_owned()
        })
        .filter(|n| (n.ends_with(".yml") || n.ends_with(".yaml")) && n != KUSTOMIZATION)
        .collect();
    files.sort();
    files
}

/// The objects of deploy/, one of each kind upstream ships.
struct Manifests {
    namespace: Namespace,
    service_account: ServiceAccount,
    cluster_role: ClusterRole,
    binding: ClusterRoleBinding,
    config_map: ConfigMap,
    daemon_set: DaemonSet,
}

fn one<T: Clone>(found: &[T], kind: &str) -> T {
    assert_eq!(found.len(), 1, "expected exactly one {kind} in deploy/");
    found[0].clone()
}

fn manifests() -> Manifests {
    let mut objects = Vec::new();
    for file in manifest_files() {
        let text = read_deploy(&file);
        objects.extend(load_text(&file, &text).unwrap_or_else(|e| panic!("{e:#}")));
    }
    let (mut ns, mut sa, mut cr, mut crb, mut cm, mut ds) =
        (vec![], vec![], vec![], vec![], vec![], vec![]);
    for o in objects {
        match o {
            Object::Namespace(x) => ns.push(x),
            Object::ServiceAccount(x) => sa.push(x),
            Object::ClusterRole(x) => cr.push(x),
            Object::ClusterRoleBinding(x) => crb.push(x),
            Object::ConfigMap(x) => cm.push(x),
            Object::DaemonSet(x) => ds.push(*x),
        }
    }
    Manifests {
        namespace: one(&ns, "Namespace"),
        service_account: one(&sa, "ServiceAccount"),
        cluster_role: one(&cr, "ClusterRole"),
        binding: one(&crb, "ClusterRoleBinding"),
        config_map: one(&cm, "ConfigMap"),
        daemon_set: one(&ds, "DaemonSet"),
    }
}

fn labels(
    meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
) -> BTreeMap<&str, &str> {
    meta.labels
        .iter()
        .flatten()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect()
}

fn pod_spec(ds: &DaemonSet) -> &PodSpec {
    ds.spec
        .as_ref()
        .and_then(|s| s.template.spec.as_ref())
        .expect("DaemonSet has a pod template spec")
}

fn container<'a>(list: &'a [Container], name: &str) -> &'a Container {
    list.iter()
        .find(|c| c.name == name)
        .unwrap_or_else(|| panic!("no container {name}"))
}

fn agent(spec: &PodSpec) -> &Container {
    container(&spec.containers, AGENT_CONTAINER)
}

fn init(spec: &PodSpec) -> &Container {
    container(
        spec.init_containers.as_deref().unwrap_or_default(),
        INIT_CONTAINER,
    )
}

fn volume<'a>(spec: &'a PodSpec, name: &str) -> &'a Volume {
    spec.volumes
        .iter()
        .flatten()
        .find(|v| v.name == name)
        .unwrap_or_else(|| panic!("no volume {name}"))
}

/// The volume mounted at the longest mount path that contains `path`, with that mount path.
fn mount_covering<'a>(
    spec: &'a PodSpec,
    c: &'a Container,
    path: &Path,
) -> Option<(&'a str, &'a Volume)> {
    c.volume_mounts
        .iter()
        .flatten()
        .filter(|m| path.starts_with(&m.mount_path))
        .max_by_key(|m| Path::new(&m.mount_path).components().count())
        .map(|m| (m.mount_path.as_str(), volume(spec, &m.name)))
}

/// The agent's command line as the kubelet runs it, parsed by the agent's own parser, with the
/// container's literal environment (so `FLANNELD_*` variables count too).
fn agent_cli(c: &Container) -> Result<Cli, clap::Error> {
    let env: BTreeMap<String, String> = c
        .env
        .iter()
        .flatten()
        .filter_map(|e| Some((e.name.clone(), e.value.clone()?)))
        .collect();
    let argv: Vec<String> = c
        .command
        .iter()
        .flatten()
        .chain(c.args.iter().flatten())
        .cloned()
        .collect();
    Cli::parse_from(argv, |k| env.get(k).cloned())
}

// ---------------------------------------------------------------------------------------------
// The loader itself.

#[test]
fn every_document_round_trips_through_k8s_openapi() {
    let files = manifest_files();
    assert!(files.iter().any(|f| f == MANIFEST), "{files:?}");
    let mut seen = BTreeSet::new();
    for file in &files {
        let text = read_deploy(file);
        let objects = load_text(file, &text).unwrap_or_else(|e| panic!("{e:#}"));
        for o in objects {
            let (kind, meta) = match &o {
                Object::Namespace(x) => ("Namespace", &x.metadata),
                Object::ServiceAccount(x) => ("ServiceAccount", &x.metadata),
                Object::ClusterRole(x) => ("ClusterRole", &x.metadata),
                Object::ClusterRoleBinding(x) => ("ClusterRoleBinding", &x.metadata),
                Object::ConfigMap(x) => ("ConfigMap", &x.metadata),
                Object::DaemonSet(x) => ("DaemonSet", &x.metadata),
            };
            let namespaced = !matches!(
                o,
                Object::Namespace(_) | Object::ClusterRole(_) | Object::ClusterRoleBinding(_)
            );
            assert_eq!(
                meta.namespace.as_deref(),
                namespaced.then_some(NAMESPACE),
                "{kind} namespace"
            );
            assert!(
                seen.insert((kind, meta.name.clone().unwrap_or_default())),
                "{kind} {:?} defined twice",
                meta.name
            );
        }
    }
    let expected: BTreeSet<(&str, String)> = [
        ("Namespace", "kube-flannel"),
        ("ClusterRole", "flannel"),
        ("ClusterRoleBinding", "flannel"),
        ("ServiceAccount", "flannel"),
        ("ConfigMap", "kube-flannel-cfg"),
        ("DaemonSet", "kube-flannel-ds"),
    ]
    .into_iter()
    .map(|(k, n)| (k, n.to_owned()))
    .collect();
    assert_eq!(seen, expected, "upstream's objects and names");
}

#[test]
fn typos_and_wrong_types_fail_the_load() {
    let text = read_deploy(MANIFEST);
    assert!(load_text(MANIFEST, &text).is_ok());
    for (good, bad, expect) in [
        (
            "hostNetwork: true",
            "hostNetwrok: true",
            "/spec/template/spec/hostNetwrok: dropped",
        ),
        (
            "readinessProbe:",
            "readinesProbe:",
            "readinesProbe: dropped",
        ),
        (
            "mountPropagation: HostToContainer",
            "mountPropagaton: HostToContainer",
            "mountPropagaton: dropped",
        ),
        ("subjects:", "subject:", "/subject: dropped"),
        ("roleRef:", "roleref:", "/roleref: dropped"),
        ("value: \"5000\"", "value: 5000", "not a valid object"),
        (
            "apiVersion: apps/v1",
            "apiVersion: apps/v1beta2",
            "not a valid object",
        ),
        (
            "kind: DaemonSet",
            "kind: Daemonset",
            "unknown kind \"Daemonset\"",
        ),
    ] {
        assert_eq!(
            text.matches(good).count(),
            1,
            "{good:?} occurs once in the manifest"
        );
        let err =
            load_text(MANIFEST, &text.replace(good, bad)).expect_err(&format!("{bad:?} must fail"));
        let msg = format!("{err:#}");
        assert!(msg.contains(expect), "{bad:?}: {msg}");
    }
}

#[test]
fn unknown_or_missing_kinds_fail() {
    let err = load_text("x", "apiVersion: v1\nkind: Service\nmetadata: {name: x}\n").unwrap_err();
    assert!(
        format!("{err:#}").contains("unknown kind \"Service\""),
        "{err:#}"
    );
    let err = load_text("x", "apiVersion: v1\nmetadata: {name: x}\n").unwrap_err();
    assert!(format!("{err:#}").contains("no string `kind`"), "{err:#}");
    // Empty documents are skipped, as kubectl does.
    let objects = load_text(
        "x",
        "# comment\n---\n---\nkind: Namespace\napiVersion: v1\nmetadata: {name: a}\n",
    )
    .unwrap();
    assert_eq!(objects.len(), 1);
}

// ---------------------------------------------------------------------------------------------
// What the objects mean.

#[test]
fn namespace_and_rbac_are_exactly_upstreams() {
    let m = manifests();
    assert_eq!(m.namespace.metadata.name.as_deref(), Some(NAMESPACE));
    assert_eq!(
        labels(&m.namespace.metadata),
        BTreeMap::from([
            ("k8s-app", "flannel"),
            ("pod-security.kubernetes.io/enforce", "privileged")
        ])
    );

    let rules: Vec<Value> = m
        .cluster_role
        .rules
        .iter()
        .flatten()
        .map(|r| serde_json::to_value(r).unwrap())
        .collect();
    assert_eq!(
        rules,
        [
            json!({"apiGroups": [""], "resources": ["pods"], "verbs": ["get"]}),
            json!({"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list", "watch"]}),
            json!({"apiGroups": [""], "resources": ["nodes/status"], "verbs": ["patch"]}),
        ],
        "pods get; nodes get/list/watch; nodes/status patch, and nothing else"
    );
    assert!(m.cluster_role.aggregation_rule.is_none());

    let role_ref = &m.binding.role_ref;
    assert_eq!(
        (
            role_ref.api_group.as_str(),
            role_ref.kind.as_str(),
            role_ref.name.as_str()
        ),
        ("rbac.authorization.k8s.io", "ClusterRole", "flannel")
    );
    assert_eq!(m.cluster_role.metadata.name.as_deref(), Some("flannel"));
    let subjects: Vec<Value> = m
        .binding
        .subjects
        .iter()
        .flatten()
        .map(|s| serde_json::to_value(s).unwrap())
        .collect();
    assert_eq!(
        subjects,
        [json!({"kind": "ServiceAccount", "name": "flannel", "namespace": NAMESPACE})]
    );
    assert_eq!(m.service_account.metadata.name.as_deref(), Some("flannel"));
    for meta in [
        &m.cluster_role.metadata,
        &m.binding.metadata,
        &m.service_account.metadata,
    ] {
        assert_eq!(labels(meta), BTreeMap::from([("k8s-app", "flannel")]));
    }
    let spec = pod_spec(&m.daemon_set);
    assert_eq!(spec.service_account_name.as_deref(), Some("flannel"));
}

#[test]
fn config_map_is_upstreams_and_parses() {
    let m = manifests();
    assert_eq!(
        m.config_map.metadata.name.as_deref(),
        Some("kube-flannel-cfg")
    );
    assert_eq!(
        labels(&m.config_map.metadata),
        BTreeMap::from([("tier", "node"), ("k8s-app", "flannel"), ("app", "flannel")])
    );
    let data = m.config_map.data.as_ref().expect("ConfigMap data");
    assert_eq!(
        data.keys().map(String::as_str).collect::<Vec<_>>(),
        ["cni-conf.json", "net-conf.json"]
    );
    assert!(m.config_map.binary_data.is_none());

    // net-conf.json: what the agent reads in kube mode.
    let net = NetConfig::parse(&data["net-conf.json"]).expect("net-conf.json parses");
    assert_eq!(net.network, Some("10.244.0.0/16".parse().unwrap()));
    assert_eq!(net.backend_type, "vxlan");
    assert!(net.enable_ipv4 && !net.enable_ipv6 && !net.enable_nftables);
    net.check()
        .expect("net-conf.json passes the agent's checks");
    assert_eq!(
        serde_json::from_str::<Value>(&data["net-conf.json"]).unwrap(),
        json!({"Network": "10.244.0.0/16", "EnableNFTables": false, "Backend": {"Type": "vxlan"}}),
        "upstream's default net-conf.json"
    );

    // cni-conf.json: a conflist whose first plugin is flannel with upstream's delegate.
    let cni: Value = serde_json::from_str(&data["cni-conf.json"]).expect("cni-conf.json is JSON");
    assert_eq!(cni["name"], "cbr0");
    assert_eq!(cni["cniVersion"], "0.3.1");
    let plugins = cni["plugins"].as_array().expect("a conflist has `plugins`");
    let flannel = &plugins[0];
    assert_eq!(flannel["type"], "flannel");
    assert_eq!(
        flannel["delegate"],
        json!({"hairpinMode": true, "isDefaultGateway": true})
    );
    // The plugin rejects a delegate with `name` or `ipam`, and a non-string `type`.
    let delegate = flannel["delegate"].as_object().unwrap();
    assert!(!delegate.contains_key("name") && !delegate.contains_key("ipam"));
    assert_eq!(
        cni,
        json!({
            "name": "cbr0",
            "cniVersion": "0.3.1",
            "plugins": [
                {"type": "flannel", "delegate": {"hairpinMode": true, "isDefaultGateway": true}},
                {"type": "portmap", "capabilities": {"portMappings": true}}
            ]
        }),
        "upstream's default cni-conf.json"
    );
}

#[test]
fn daemon_set_shape() {
    let m = manifests();
    let ds = &m.daemon_set;
    assert_eq!(ds.metadata.name.as_deref(), Some("kube-flannel-ds"));
    assert_eq!(
        labels(&ds.metadata),
        BTreeMap::from([("tier", "node"), ("app", "flannel"), ("k8s-app", "flannel")])
    );
    let ds_spec = ds.spec.as_ref().unwrap();
    // Immutable on a live DaemonSet: must be upstream's for an in-place apply.
    assert_eq!(
        serde_json::to_value(&ds_spec.selector).unwrap(),
        json!({"matchLabels": {"app": "flannel"}})
    );
    assert!(
        ds_spec.update_strategy.is_none(),
        "upstream uses the default rolling update"
    );
    let template_labels = labels(ds_spec.template.metadata.as_ref().unwrap());
    assert_eq!(
        template_labels,
        BTreeMap::from([("tier", "node"), ("app", "flannel")])
    );

    let spec = pod_spec(ds);
    assert_eq!(spec.host_network, Some(true));
    assert_eq!(
        spec.priority_class_name.as_deref(),
        Some("system-node-critical")
    );
    let tolerations: Vec<Value> = spec
        .tolerations
        .iter()
        .flatten()
        .map(|t| serde_json::to_value(t).unwrap())
        .collect();
    assert_eq!(
        tolerations,
        [
            json!({"operator": "Exists", "effect": "NoSchedule"}),
            json!({"operator": "Exists", "effect": "NoExecute"}),
        ]
    );
    let affinity = serde_json::to_value(&spec.affinity).unwrap();
    let terms = &affinity["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"];
    assert_eq!(
        terms,
        &json!([{"matchExpressions": [
            {"key": "kubernetes.io/os", "operator": "In", "values": ["linux"]},
            // The label the agent reads when it stops (it then detaches its fast path).
            {"key": AGENT_LABEL, "operator": "NotIn", "values": [UPSTREAM_VALUE]},
        ]}])
    );

    let agent = agent(spec);
    let sc = agent
        .security_context
        .as_ref()
        .expect("agent securityContext");
    assert_eq!(sc.privileged, Some(false));
    let caps = sc.capabilities.as_ref().expect("capabilities");
    assert_eq!(
        caps.add.as_deref().unwrap_or_default(),
        ["NET_ADMIN", "NET_RAW", "BPF", "PERFMON"]
    );
    assert!(caps.drop.is_none());
    assert_eq!(
        serde_json::to_value(&agent.resources).unwrap(),
        json!({"requests": {"cpu": "100m", "memory": "50Mi"}}),
        "upstream's requests, no limits"
    );
    let env: Vec<Value> = agent
        .env
        .iter()
        .flatten()
        .map(|e| serde_json::to_value(e).unwrap())
        .collect();
    assert_eq!(
        env,
        [
            json!({"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}),
            json!({"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}}),
            json!({"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}),
            json!({"name": "EVENT_QUEUE_DEPTH", "value": "5000"}),
            json!({"name": "CONT_WHEN_CACHE_NOT_READY", "value": "false"}),
        ]
    );
    let init = init(spec);
    assert_eq!(
        spec.init_containers.as_ref().unwrap().len(),
        1,
        "one init container"
    );
    assert_eq!(
        init.image, agent.image,
        "one image for the agent and the installer"
    );
    assert_eq!(spec.containers.len(), 1);
}

/// (container, mount path, volume, host path, hostPath type)
const HOST_MOUNTS: [(&str, &str, &str, &str, Option<&str>); 7] = [
    (AGENT_CONTAINER, "/run/flannel", "run", "/run/flannel", None),
    (
        AGENT_CONTAINER,
        "/run/xtables.lock",
        "xtables-lock",
        "/run/xtables.lock",
        Some("FileOrCreate"),
    ),
    (
        AGENT_CONTAINER,
        "/sys/fs/bpf",
        "bpffs",
        "/sys/fs/bpf",
        Some("DirectoryOrCreate"),
    ),
    (
        AGENT_CONTAINER,
        "/var/lib/flannel",
        "flannel-state",
        "/var/lib/flannel",
        Some("DirectoryOrCreate"),
    ),
    (
        INIT_CONTAINER,
        "/opt/cni/bin",
        "cni-plugin",
        "/opt/cni/bin",
        None,
    ),
    (
        INIT_CONTAINER,
        "/etc/cni/net.d",
        "cni",
        "/etc/cni/net.d",
        None,
    ),
    (
        INIT_CONTAINER,
        "/etc/kube-flannel/",
        "flannel-cfg",
        "",
        None,
    ),
];

#[test]
fn every_required_host_path_is_mounted() {
    let m = manifests();
    let spec = pod_spec(&m.daemon_set);
    for (cname, mount_path, vname, host_path, host_type) in HOST_MOUNTS {
        let c = if cname == AGENT_CONTAINER {
            agent(spec)
        } else {
            init(spec)
        };
        let mount = c
            .volume_mounts
            .iter()
            .flatten()
            .find(|vm| vm.mount_path == mount_path)
            .unwrap_or_else(|| panic!("{cname}: nothing mounted at {mount_path}"));
        assert_eq!(mount.name, vname, "{cname} {mount_path}");
        assert_ne!(
            mount.read_only,
            Some(true),
            "{cname} {mount_path} must be writable"
        );
        let vol = volume(spec, vname);
        if host_path.is_empty() {
            assert_eq!(
                vol.config_map.as_ref().map(|c| c.name.as_str()),
                Some("kube-flannel-cfg"),
                "{vname}"
            );
            continue;
        }
        let hp = vol
            .host_path
            .as_ref()
            .unwrap_or_else(|| panic!("{vname} is a hostPath"));
        assert_eq!(
            (hp.path.as_str(), hp.type_.as_deref()),
            (host_path, host_type),
            "{vname}"
        );
    }
    // The agent also reads the ConfigMap; pins must follow host remounts of bpffs.
    let a = agent(spec);
    let mounts: BTreeMap<&str, _> = a
        .volume_mounts
        .iter()
        .flatten()
        .map(|vm| (vm.mount_path.as_str(), vm))
        .collect();
    assert_eq!(mounts["/etc/kube-flannel/"].name, "flannel-cfg");
    assert_eq!(
        mounts["/sys/fs/bpf"].mount_propagation.as_deref(),
        Some("HostToContainer")
    );
    // No dangling or unused volumes.
    let mounted: BTreeSet<&str> = spec
        .containers
        .iter()
        .chain(spec.init_containers.iter().flatten())
        .flat_map(|c| c.volume_mounts.iter().flatten())
        .map(|vm| vm.name.as_str())
        .collect();
    let declared: BTreeSet<&str> = spec
        .volumes
        .iter()
        .flatten()
        .map(|v| v.name.as_str())
        .collect();
    assert_eq!(mounted, declared);
}

#[test]
fn agent_arguments_parse_and_its_paths_are_on_host_mounts() {
    let m = manifests();
    let spec = pod_spec(&m.daemon_set);
    let a = agent(spec);
    assert_eq!(
        a.command.as_deref().unwrap_or_default(),
        ["/opt/bin/flannel-agent"]
    );
    assert_eq!(
        a.args.as_deref().unwrap_or_default(),
        ["--ip-masq", "--kube-subnet-mgr", "--healthz-port=8081"]
    );
    let cli = agent_cli(a).unwrap_or_else(|e| panic!("agent arguments rejected: {e}"));
    assert!(cli.ip_masq && cli.kube_subnet_mgr);
    assert_eq!(cli.healthz_port, 8081);

    // Every file the agent keeps must be on a host mount, or it is lost with the pod.
    for (flag, path) in [
        ("--subnet-file", &cli.subnet_file),
        ("--wireguard-key-file", &cli.wireguard_key_file),
        ("--bpf-pin-path", &cli.bpf_pin_path),
        ("--state-dir", &cli.state_dir),
    ] {
        let (mount_path, vol) = mount_covering(spec, a, path)
            .unwrap_or_else(|| panic!("{flag} {} is not on any volume", path.display()));
        let hp = vol.host_path.as_ref().unwrap_or_else(|| {
            panic!(
                "{flag} {} is on {}, not a hostPath",
                path.display(),
                vol.name
            )
        });
        let host = Path::new(&hp.path).join(path.strip_prefix(mount_path).unwrap());
        assert!(host.is_absolute(), "{flag}: {}", host.display());
    }
    // --net-config-path is a key of the ConfigMap volume.
    let (mount_path, vol) =
        mount_covering(spec, a, &cli.net_config_path).expect("net-conf mounted");
    assert_eq!(
        vol.config_map.as_ref().map(|c| c.name.as_str()),
        Some("kube-flannel-cfg")
    );
    let key = cli.net_config_path.strip_prefix(mount_path).unwrap();
    assert!(
        m.config_map
            .data
            .as_ref()
            .unwrap()
            .contains_key(key.to_str().unwrap()),
        "{} is not a ConfigMap key",
        key.display()
    );
}

#[test]
fn a_flag_typo_in_the_manifest_is_caught() {
    let m = manifests();
    let mut a = agent(pod_spec(&m.daemon_set)).clone();
    assert!(agent_cli(&a).is_ok());
    a.args = Some(vec!["--ip-masq".into(), "--kube-subnet-mngr".into()]);
    let err = agent_cli(&a).unwrap_err().to_string();
    assert!(err.contains("--kube-subnet-mngr"), "{err}");
    a.args = Some(vec!["--healthz-port=80801".into()]);
    assert!(agent_cli(&a).is_err());
    // FLANNELD_* variables in the manifest are parsed too.
    a.args = None;
    a.env = Some(vec![k8s_openapi::api::core::v1::EnvVar {
        name: "FLANNELD_DATAPLANE".into(),
        value: Some("ebfp".into()),
        ..Default::default()
    }]);
    assert!(agent_cli(&a).is_err());
}

fn probe_path_and_port(p: &Probe, c: &Container) -> (String, i32) {
    let get = p.http_get.as_ref().expect("an httpGet probe");
    assert!(get.host.is_none(), "the kubelet probes the pod (= node) IP");
    assert!(matches!(get.scheme.as_deref(), None | Some("HTTP")));
    let port = match &get.port {
        IntOrString::Int(n) => *n,
        IntOrString::String(name) => {
            c.ports
                .iter()
                .flatten()
                .find(|p| p.name.as_deref() == Some(name))
                .unwrap_or_else(|| panic!("probe names port {name}, which the container lacks"))
                .container_port
        }
    };
    (get.path.clone().unwrap_or_default(), port)
}

#[test]
fn probes_hit_the_health_endpoints_on_the_healthz_port() {
    let m = manifests();
    let a = agent(pod_spec(&m.daemon_set));
    let cli = agent_cli(a).unwrap();
    let port = i32::from(cli.healthz_port);
    assert_ne!(port, 0, "--healthz-port=0 disables the health server");
    let live = a.liveness_probe.as_ref().expect("livenessProbe");
    let ready = a.readiness_probe.as_ref().expect("readinessProbe");
    assert_eq!(probe_path_and_port(live, a), ("/healthz".to_owned(), port));
    assert_eq!(probe_path_and_port(ready, a), ("/readyz".to_owned(), port));
    // Upstream's timings.
    assert_eq!(
        (live.initial_delay_seconds, live.period_seconds),
        (Some(10), Some(30))
    );
    assert_eq!(
        (ready.initial_delay_seconds, ready.period_seconds),
        (Some(5), Some(10))
    );
    let ports: Vec<Value> = a
        .ports
        .iter()
        .flatten()
        .map(|p| serde_json::to_value(p).unwrap())
        .collect();
    assert_eq!(
        ports,
        [json!({"name": "healthz", "containerPort": port, "protocol": "TCP"})]
    );
}

#[test]
fn init_container_installs_the_plugin_and_the_conflist() {
    let m = manifests();
    let spec = pod_spec(&m.daemon_set);
    let c = init(spec);
    assert_eq!(
        c.command.as_deref().unwrap_or_default(),
        ["/opt/bin/install-cni"]
    );
    let args = c.args.as_deref().unwrap_or_default();
    assert_eq!(
        args,
        [
            "/opt/bin/flannel",
            "/opt/cni/bin/flannel",
            "/etc/kube-flannel/cni-conf.json",
            "/etc/cni/net.d/10-flannel.conflist"
        ]
    );
    // Destinations land on the host directories kubelet and the runtime read.
    for (dst, host) in [(&args[1], "/opt/cni/bin"), (&args[3], "/etc/cni/net.d")] {
        let (_, vol) = mount_covering(spec, c, Path::new(dst)).expect("destination mounted");
        assert_eq!(
            vol.host_path.as_ref().map(|h| h.path.as_str()),
            Some(host),
            "{dst}"
        );
    }
    // The conflist source is the ConfigMap key.
    let (mount_path, vol) = mount_covering(spec, c, Path::new(&args[2])).expect("source mounted");
    assert_eq!(
        vol.config_map.as_ref().map(|c| c.name.as_str()),
        Some("kube-flannel-cfg")
    );
    let key = Path::new(&args[2])
        .strip_prefix(mount_path)
        .unwrap()
        .to_str()
        .unwrap();
    assert!(m.config_map.data.as_ref().unwrap().contains_key(key));
    // The plugin source is in the image.
    let provided = containerfile_paths(&read_deploy("Containerfile"));
    assert!(
        provided.contains(args[0].as_str()),
        "{} not in the image",
        args[0]
    );
}

// ---------------------------------------------------------------------------------------------
// The image.

/// Paths the Containerfile creates: COPY destinations and `ln -s` link names.
fn containerfile_paths(text: &str) -> BTreeSet<String> {
    let joined = text.replace("\\\n", " ");
    let mut paths = BTreeSet::new();
    for line in joined
        .lines()
        .map(str::trim)
        .filter(|l| !l.starts_with('#'))
    {
        let words: Vec<&str> = line.split_whitespace().collect();
        if words.first() == Some(&"COPY")
            && let Some(dst) = words.last()
        {
            paths.insert((*dst).to_owned());
        }
        for (i, w) in words.iter().enumerate() {
            if *w == "ln" {
                let operands: Vec<&str> = words[i + 1..]
                    .iter()
                    .copied()
                    .skip_while(|o| o.starts_with('-'))
                    .take(2)
                    .collect();
                if let [_target, link] = operands[..] {
                    let link = link.trim_matches(|c| c == '"' || c == ';');
                    if !link.contains('$') {
                        paths.insert(link.to_owned());
                    }
                }
            }
        }
    }
    paths
}

#[test]
fn containerfile_provides_what_the_manifests_run() {
    let text = read_deploy("Containerfile");
    let froms: Vec<&str> = text.lines().filter(|l| l.starts_with("FROM ")).collect();
    assert_eq!(froms, ["FROM docker.io/library/debian:bookworm-slim"]);
    let joined = text.replace("\\\n", " ");
    let install: Vec<&str> = joined
        .lines()
        .find(|l| l.starts_with("RUN ") && l.contains("apt-get install"))
        .expect("an apt-get install step")
        .split_whitespace()
        .collect();
    for pkg in [
        "iproute2",
        "iptables",
        "nftables",
        "wireguard-tools",
        "ca-certificates",
    ] {
        assert!(install.contains(&pkg), "package {pkg} not installed");
    }
    assert!(text.contains("ENTRYPOINT [\"/opt/bin/flannel-agent\"]"));

    let provided = containerfile_paths(&text);
    let m = manifests();
    let spec = pod_spec(&m.daemon_set);
    for c in spec
        .containers
        .iter()
        .chain(spec.init_containers.iter().flatten())
    {
        let cmd = &c.command.as_deref().unwrap_or_default()[0];
        assert!(
            provided.contains(cmd.as_str()),
            "{}: {cmd} is not in the image",
            c.name
        );
    }
    // Upstream's manifest runs these; the image provides them too.
    for compat in ["/opt/bin/flanneld", "/opt/bin/install-conf", "/flannel"] {
        assert!(provided.contains(compat), "{compat} missing: {provided:?}");
    }
    for wrapped in [
        "iptables",
        "iptables-save",
        "iptables-restore",
        "ip6tables",
        "ip6tables-save",
        "ip6tables-restore",
    ] {
        assert!(text.contains(wrapped), "{wrapped}");
    }

    // Every COPY source exists (or is a release binary) and gets through the ignore file.
    let ignore = read_deploy("Containerfile.dockerignore");
    let included: BTreeSet<&str> = ignore.lines().filter_map(|l| l.strip_prefix('!')).collect();
    assert!(
        ignore.lines().any(|l| l == "*"),
        "everything else is excluded"
    );
    let repo = deploy_dir().join("..");
    for line in text.lines().filter(|l| l.starts_with("COPY ")) {
        let words: Vec<&str> = line.split_whitespace().collect();
        for src in &words[1..words.len() - 1] {
            assert!(
                included.contains(src),
                "{src} is excluded from the build context"
            );
            if let Some(bin) = src.strip_prefix("target/release/") {
                assert!(["flannel-agent", "flannel"].contains(&bin), "{src}");
            } else {
                assert!(repo.join(src).is_file(), "{src} does not exist");
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The kustomization.

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct Kustomization {
    api_version: String,
    kind: String,
    resources: Vec<String>,
    images: Vec<KustomizeImage>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct KustomizeImage {
    name: String,
    new_name: Option<String>,
    new_tag: Option<String>,
    digest: Option<String>,
}

#[test]
fn kustomization_references_existing_files_and_the_manifest_image() {
    let k: Kustomization =
        serde_yaml::from_str(&read_deploy(KUSTOMIZATION)).expect("kustomization.yaml");
    assert_eq!(k.api_version, "kustomize.config.k8s.io/v1beta1");
    assert_eq!(k.kind, "Kustomization");
    for r in &k.resources {
        assert!(
            deploy_dir().join(r).is_file(),
            "resource {r} does not exist"
        );
    }
    assert_eq!(
        k.resources,
        manifest_files(),
        "every manifest, and only those"
    );

    let m = manifests();
    let spec = pod_spec(&m.daemon_set);
    let images: BTreeSet<&str> = spec
        .containers
        .iter()
        .chain(spec.init_containers.iter().flatten())
        .map(|c| {
            c.image
                .as_deref()
                .expect("image")
                .rsplit_once(':')
                .expect("tagged image")
                .0
        })
        .collect();
    assert_eq!(images.len(), 1, "one image: {images:?}");
    assert_eq!(k.images.len(), 1);
    let img = &k.images[0];
    assert!(
        images.contains(img.name.as_str()),
        "override {} matches no image in the manifest",
        img.name
    );
    assert!(img.new_name.is_some() || img.new_tag.is_some() || img.digest.is_some());
}

// ---------------------------------------------------------------------------------------------
// The scripts, run for real.

fn run(cmd: &mut Command) -> Output {
    cmd.output()
        .unwrap_or_else(|e| panic!("running {cmd:?}: {e}"))
}

fn text(out: &[u8]) -> String {
    String::from_utf8_lossy(out).into_owned()
}

#[test]
fn install_cni_replaces_files_atomically_with_the_source_mode() {
    let script = deploy_dir().join("install-cni.sh");
    assert_ne!(
        fs::metadata(&script).unwrap().permissions().mode() & 0o111,
        0,
        "executable"
    );
    let tmp = tempfile::tempdir().unwrap();
    let (src, bin, netd) = (
        tmp.path().join("src"),
        tmp.path().join("bin"),
        tmp.path().join("net.d"),
    );
    for d in [&src, &bin, &netd] {
        fs::create_dir(d).unwrap();
    }
    let plugin = src.join("flannel");
    fs::write(&plugin, b"\x7fELF new plugin").unwrap();
    fs::set_permissions(&plugin, fs::Permissions::from_mode(0o755)).unwrap();
    // A ConfigMap key is a symlink into ..data, mode 0644.
    fs::create_dir(src.join("..data")).unwrap();
    fs::write(src.join("..data/cni-conf.json"), b"{\"name\":\"cbr0\"}\n").unwrap();
    fs::set_permissions(
        src.join("..data/cni-conf.json"),
        fs::Permissions::from_mode(0o644),
    )
    .unwrap();
    symlink("..data/cni-conf.json", src.join("cni-conf.json")).unwrap();

    let dst_plugin = bin.join("flannel");
    fs::write(&dst_plugin, b"old plugin").unwrap();
    fs::set_permissions(&dst_plugin, fs::Permissions::from_mode(0o700)).unwrap();
    let old_inode = fs::metadata(&dst_plugin).unwrap().ino();
    // Another name holding the old inode sees the old content afterwards: a rename, not a
    // rewrite in place (what a process executing the old binary relies on).
    fs::hard_link(&dst_plugin, tmp.path().join("old-link")).unwrap();
    // A leftover of an install killed half way is cleaned up.
    fs::write(bin.join(".flannel.tmpABCDEF"), b"partial").unwrap();
    let dst_conf = netd.join("10-flannel.conflist");

    let out = run(Command::new(&script).args([
        &plugin,
        &dst_plugin,
        &src.join("cni-conf.json"),
        &dst_conf,
    ]));
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(fs::read(&dst_plugin).unwrap(), b"\x7fELF new plugin");
    assert_eq!(
        fs::metadata(&dst_plugin).unwrap().permissions().mode() & 0o7777,
        0o755
    );
    assert_ne!(fs::metadata(&dst_plugin).unwrap().ino(), old_inode);
    assert_eq!(
        fs::read(tmp.path().join("old-link")).unwrap(),
        b"old plugin"
    );
    assert_eq!(fs::read(&dst_conf).unwrap(), b"{\"name\":\"cbr0\"}\n");
    assert!(
        !fs::symlink_metadata(&dst_conf)
            .unwrap()
            .file_type()
            .is_symlink()
    );
    assert_eq!(
        fs::metadata(&dst_conf).unwrap().permissions().mode() & 0o7777,
        0o644
    );
    let mut left: Vec<String> = fs::read_dir(&bin)
        .unwrap()
        .chain(fs::read_dir(&netd).unwrap())
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    left.sort();
    assert_eq!(
        left,
        ["10-flannel.conflist", "flannel"],
        "no temporary files left"
    );
    assert!(text(&out.stdout).contains(&format!("as {}", dst_conf.display())));

    // Errors: odd arguments, missing source (destination untouched), missing directory.
    let out = run(Command::new(&script).arg(&plugin));
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out.stderr).contains("usage:"));
    let out = run(Command::new(&script).args([&src.join("nope"), &dst_plugin]));
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("is not a file"),
        "{}",
        text(&out.stderr)
    );
    assert_eq!(fs::read(&dst_plugin).unwrap(), b"\x7fELF new plugin");
    let out = run(Command::new(&script).args([&plugin, &tmp.path().join("missing/flannel")]));
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("does not exist"),
        "{}",
        text(&out.stderr)
    );
}

/// A fake sbin with iptables-{legacy,nft}[-save|-restore] for both families. Each echoes its
/// name and arguments; the save commands then print the file `<name>.<table>` (or
/// `<name>.all` without `-t`) when present.
struct FakeSbin {
    dir: tempfile::TempDir,
    bin: PathBuf,
    cache: PathBuf,
}

impl FakeSbin {
    fn new() -> std::io::Result<Self> {
        let dir = tempfile::tempdir()?;
        let sbin = dir.path().join("sbin");
        let bin = dir.path().join("bin");
        fs::create_dir(&sbin)?;
        fs::create_dir(&bin)?;
        let wrapper = deploy_dir().join("iptables-wrapper.sh").canonicalize()?;
        for family in ["iptables", "ip6tables"] {
            for mode in ["legacy", "nft"] {
                for suffix in ["", "-save", "-restore"] {
                    let name = format!("{family}-{mode}{suffix}");
                    let body = if suffix == "-save" {
                        "#!/bin/sh\necho \"${0##*/} $*\"\nf=\"$0.${2:-all}\"\n[ -f \"$f\" ] && cat \"$f\"\nexit 0\n"
                    } else {
                        "#!/bin/sh\necho \"${0##*/} $*\"\n"
                    };
                    let path = sbin.join(&name);
                    fs::write(&path, body)?;
                    fs::set_permissions(&path, fs::Permissions::from_mode(0o755))?;
                }
            }
            for suffix in ["", "-save", "-restore"] {
                symlink(&wrapper, bin.join(format!("{family}{suffix}")))?;
            }
        }
        symlink(&wrapper, bin.join("iptables-apply"))?;
        let cache = dir.path().join("mode");
        Ok(FakeSbin { dir, bin, cache })
    }

    fn rules(&self, save: &str, table: &str, content: &str) {
        fs::write(
            self.dir.path().join("sbin").join(format!("{save}.{table}")),
            content,
        )
        .expect("writing fake rules");
    }

    fn call(&self, name: &str, args: &[&str], mode_env: Option<&str>) -> Output {
        let mut cmd = Command::new(self.bin.join(name));
        cmd.args(args)
            .env("IPTABLES_WRAPPER_SBIN", self.dir.path().join("sbin"))
            .env("IPTABLES_WRAPPER_CACHE", &self.cache)
            .env_remove("FLANNEL_IPTABLES_MODE");
        if let Some(m) = mode_env {
            cmd.env("FLANNEL_IPTABLES_MODE", m);
        }
        run(&mut cmd)
    }

    /// What `name args` ran, e.g. `iptables-nft -t nat -S`.
    fn ran(&self, name: &str, args: &[&str]) -> String {
        let out = self.call(name, args, None);
        assert!(out.status.success(), "{}", text(&out.stderr));
        text(&out.stdout).trim().to_owned()
    }
}

const HINT: &str = "*mangle\n:PREROUTING ACCEPT [0:0]\n:KUBE-IPTABLES-HINT - [0:0]\nCOMMIT\n";

#[test]
fn iptables_wrapper_follows_the_hosts_variant() {
    // Nothing anywhere: nf_tables, and the choice is cached.
    let f = FakeSbin::new().unwrap();
    assert_eq!(
        f.ran("iptables", &["-t", "nat", "-S"]),
        "iptables-nft -t nat -S"
    );
    assert_eq!(fs::read_to_string(&f.cache).unwrap(), "nft\n");

    // kubelet's hint chain in legacy only.
    let f = FakeSbin::new().unwrap();
    f.rules("iptables-legacy-save", "mangle", HINT);
    assert_eq!(
        f.ran("iptables-save", &["-t", "filter"]),
        "iptables-legacy-save -t filter"
    );
    assert_eq!(
        f.ran("ip6tables-restore", &["--noflush"]),
        "ip6tables-legacy-restore --noflush"
    );
    // Cached: the hint disappearing later does not flip the choice mid-life.
    fs::remove_file(f.dir.path().join("sbin/iptables-legacy-save.mangle")).unwrap();
    assert_eq!(f.ran("iptables", &[]), "iptables-legacy");

    // Hints in both: nf_tables first.
    let f = FakeSbin::new().unwrap();
    f.rules("iptables-legacy-save", "mangle", HINT);
    f.rules(
        "iptables-nft-save",
        "mangle",
        &HINT.replace("IPTABLES-HINT", "KUBELET-CANARY"),
    );
    assert_eq!(f.ran("ip6tables", &["-L"]), "ip6tables-nft -L");

    // No hint: the variant with more kube/flannel rules (IPv4 and IPv6 counted).
    let f = FakeSbin::new().unwrap();
    f.rules(
        "iptables-legacy-save",
        "all",
        "*nat\n:KUBE-SERVICES - [0:0]\n-A PREROUTING -j KUBE-SERVICES\nCOMMIT\n",
    );
    f.rules(
        "ip6tables-legacy-save",
        "all",
        "*nat\n-A FLANNEL-POSTRTG -j RETURN\nCOMMIT\n",
    );
    f.rules(
        "iptables-nft-save",
        "all",
        "*nat\n:KUBE-SERVICES - [0:0]\n-A OTHER -j ACCEPT\nCOMMIT\n",
    );
    assert_eq!(
        f.ran("iptables-restore", &["-w"]),
        "iptables-legacy-restore -w"
    );
    let f2 = FakeSbin::new().unwrap();
    f2.rules(
        "iptables-nft-save",
        "all",
        "*nat\n:KUBE-SERVICES - [0:0]\nCOMMIT\n",
    );
    f2.rules(
        "iptables-legacy-save",
        "all",
        "*nat\n:KUBE-SERVICES - [0:0]\nCOMMIT\n",
    );
    assert_eq!(
        f2.ran("iptables", &[]),
        "iptables-nft",
        "a tie goes to nf_tables"
    );

    // The environment overrides detection and cache; bad values and names are refused.
    let out = f.call("iptables", &["-S"], Some("nft"));
    assert_eq!(text(&out.stdout).trim(), "iptables-nft -S");
    let out = f.call("iptables", &[], Some("xtables"));
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out.stderr).contains("legacy or nft"));
    let out = f.call("iptables-apply", &[], None);
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out.stderr).contains("must be called as"));
}
