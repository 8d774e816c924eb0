//! The `flannel` CNI plugin end to end, with the real `bridge`, `host-local` and `loopback`
//! plugins from Debian (`/usr/lib/cni`).
//!
//! A "node" namespace runs the plugin (so `cni0` and the host side of the veths live there
//! and go away with it) and "pod" namespaces are the containers (`CNI_NETNS`). host-local
//! keeps its state in a temp dir (`ipam.dataDir`), flannel its stored delegate configs too;
//! nothing is written under /var/lib/cni.
//!
//! The tests that only exercise the binary's error paths need no root; the ones that build
//! pod networking skip without it.

use std::{
    fs,
    io::{Read as _, Write as _},
    net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream},
    os::unix::fs::PermissionsExt,
    path::{Path, PathBuf},
    process::{Command, Output, Stdio},
    sync::OnceLock,
    time::Duration,
};

use anyhow::{Context as _, Result, bail};
use flannel_tests::{netns::NetNs, require_root};
use ipnet::Ipv4Net;
use serde_json::{Value, json};

const CNI_BIN_DIR: &str = "/usr/lib/cni";

/// The `flannel` binary of this workspace, freshly built.
///
/// `env!("CARGO_BIN_EXE_flannel")` only exists for tests of the crate that owns the binary
/// (flannel-cni), and `cargo test -p flannel-tests` does not build other packages' binaries,
/// so a `target/<profile>/flannel` lying around may be stale or missing. Instead the test
/// asks cargo to build it (a no-op when it is up to date) into the same target directory and
/// profile as this test executable, and takes the path from cargo's JSON artifact messages.
/// `FLANNEL_CNI_BIN=<path>` skips the build (e.g. to test an installed binary).
fn flannel_bin() -> PathBuf {
    static BIN: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    let bin = BIN.get_or_init(|| {
        if let Some(path) = std::env::var_os("FLANNEL_CNI_BIN") {
            return Ok(PathBuf::from(path));
        }
        build_flannel().map_err(|e| format!("{e:#}"))
    });
    match bin {
        Ok(path) => path.clone(),
        Err(e) => panic!("cannot build the flannel CNI binary: {e}"),
    }
}

fn build_flannel() -> Result<PathBuf> {
    // <target dir>/[<triple>/]<profile>/deps/<this test>
    let exe = std::env::current_exe().context("current_exe")?;
    let deps = exe.parent().context("test executable has no directory")?;
    let profile_dir = deps.parent().context("no profile directory")?;
    let target_dir = profile_dir
        .ancestors()
        .find(|dir| dir.join("CACHEDIR.TAG").exists())
        .context("no cargo target directory (CACHEDIR.TAG) above the test executable")?;
    let profile = match profile_dir.file_name().and_then(|n| n.to_str()) {
        Some("debug") | None => "dev".to_owned(),
        Some(name) => name.to_owned(),
    };
    let cargo = std::env::var_os("CARGO")
        .map(PathBuf::from)
        .or_else(|| option_env!("CARGO").map(PathBuf::from))
        .unwrap_or_else(|| PathBuf::from("cargo"));
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR")).join("../Cargo.toml");
    let out = Command::new(&cargo)
        .args([
            "build",
            "--quiet",
            "--message-format=json",
            "-p",
            "flannel-cni",
        ])
        .args(["--bin", "flannel", "--profile", &profile])
        .arg("--manifest-path")
        .arg(&manifest)
        .arg("--target-dir")
        .arg(target_dir)
        .stdin(Stdio::null())
        .stderr(Stdio::inherit())
        .output()
        .with_context(|| format!("running {}", cargo.display()))?;
    if !out.status.success() {
        bail!("cargo build -p flannel-cni failed ({})", out.status);
    }
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let Ok(msg) = serde_json::from_str::<Value>(line) else {
            continue;
        };
        if msg["reason"] == "compiler-artifact"
            && msg["target"]["name"] == "flannel"
            && let Some(path) = msg["executable"].as_str()
        {
            return Ok(PathBuf::from(path));
        }
    }
    bail!("cargo reported no executable for the flannel binary")
}

/// One plugin invocation.
struct Call<'a> {
    command: &'a str,
    container: &'a str,
    netns: Option<&'a NetNs>,
    cni_path: String,
    config: &'a Value,
}

impl<'a> Call<'a> {
    fn new(command: &'a str, container: &'a str, config: &'a Value) -> Self {
        Call {
            command,
            container,
            netns: None,
            cni_path: CNI_BIN_DIR.to_owned(),
            config,
        }
    }

    fn netns(mut self, ns: &'a NetNs) -> Self {
        self.netns = Some(ns);
        self
    }

    fn cni_path(mut self, path: &Path) -> Self {
        self.cni_path = path.display().to_string();
        self
    }

    /// Runs the plugin in `node` (or in the test's namespace when `None`).
    fn run(&self, node: Option<&NetNs>) -> Result<Output> {
        let bin = flannel_bin();
        let mut cmd = match node {
            Some(node) => node.command(&bin.display().to_string()),
            None => Command::new(&bin),
        };
        cmd.env("CNI_COMMAND", self.command)
            .env("CNI_CONTAINERID", self.container)
            .env("CNI_IFNAME", "eth0")
            .env("CNI_PATH", &self.cni_path)
            .env("CNI_ARGS", "IgnoreUnknown=1;K8S_POD_NAME=test")
            .env_remove("CNI_NETNS_OVERRIDE")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        match self.netns {
            Some(ns) => cmd.env("CNI_NETNS", ns.path()),
            None => cmd.env("CNI_NETNS", "/run/netns/flannel-test-does-not-exist"),
        };
        let mut child = cmd.spawn().context("spawning flannel")?;
        child
            .stdin
            .take()
            .context("no stdin")?
            .write_all(self.config.to_string().as_bytes())?;
        Ok(child.wait_with_output()?)
    }

    /// Runs the plugin and requires success; returns stdout parsed as JSON (or Null if empty).
    fn ok(&self, node: Option<&NetNs>) -> Value {
        let out = self.run(node).expect("run flannel");
        assert!(
            out.status.success(),
            "{} {} failed ({}): stdout {} stderr {}",
            self.command,
            self.container,
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        if out.stdout.is_empty() {
            Value::Null
        } else {
            serde_json::from_slice(&out.stdout).expect("result is JSON")
        }
    }

    /// Runs the plugin and requires a CNI error; returns the error object.
    fn err(&self, node: Option<&NetNs>) -> Value {
        let out = self.run(node).expect("run flannel");
        assert!(
            !out.status.success(),
            "{} {} unexpectedly succeeded: {}",
            self.command,
            self.container,
            String::from_utf8_lossy(&out.stdout)
        );
        serde_json::from_slice(&out.stdout).expect("error is JSON")
    }
}

/// A temp dir with `subnet.env`, flannel's `dataDir` and host-local's `dataDir`.
struct Dirs {
    tmp: tempfile::TempDir,
}

impl Dirs {
    fn new() -> Self {
        let tmp = tempfile::Builder::new()
            .prefix("flannel-cni-test")
            .tempdir()
            .expect("tempdir");
        fs::write(
            tmp.path().join("subnet.env"),
            "FLANNEL_NETWORK=10.244.0.0/16\nFLANNEL_SUBNET=10.244.5.1/24\nFLANNEL_MTU=1450\nFLANNEL_IPMASQ=true\n",
        )
        .expect("write subnet.env");
        Dirs { tmp }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.tmp.path().join(name)
    }

    /// flannel's dataDir (created by the plugin).
    fn data_dir(&self) -> PathBuf {
        self.path("flannel")
    }

    /// host-local's dataDir; allocations live in `<it>/<network name>/<ip>`.
    fn ipam_dir(&self) -> PathBuf {
        self.path("ipam")
    }

    /// The network config, with `delegate` if given.
    fn config(&self, delegate: Option<Value>) -> Value {
        let mut conf = json!({
            "cniVersion": "1.0.0",
            "name": "cbr0",
            "type": "flannel",
            "subnetFile": self.path("subnet.env"),
            "dataDir": self.data_dir(),
            "ipam": { "dataDir": self.ipam_dir() },
        });
        if let Some(delegate) = delegate {
            conf["delegate"] = delegate;
        }
        conf
    }
}

fn run_in(ns: &NetNs, argv: &[&str]) -> String {
    ns.run(argv)
        .unwrap_or_else(|e| panic!("{argv:?} in {}: {e:#}", ns.name()))
}

/// The pod's IPv4 address from an ADD result (also checks the gateway).
fn pod_address(result: &Value) -> Ipv4Net {
    assert_eq!(result["cniVersion"], "1.0.0", "{result}");
    let ips = result["ips"].as_array().expect("ips");
    assert_eq!(ips.len(), 1, "{result}");
    assert_eq!(ips[0]["gateway"], "10.244.5.1", "{result}");
    let addr: Ipv4Net = ips[0]["address"]
        .as_str()
        .expect("address")
        .parse()
        .expect("address is a CIDR");
    let subnet: Ipv4Net = "10.244.5.0/24".parse().expect("cidr");
    assert!(subnet.contains(&addr.addr()), "{addr} not in {subnet}");
    assert_eq!(addr.prefix_len(), 24);
    assert_ne!(addr.addr(), Ipv4Addr::new(10, 244, 5, 1));
    addr
}

/// Opens a TCP connection from `from` to a listener bound to `addr` in `to` and echoes a
/// payload across: proves the path works (this host has no `ping`).
fn tcp_reaches(from: &NetNs, to: &NetNs, addr: Ipv4Addr) {
    let listener = to
        .enter(move || TcpListener::bind(SocketAddr::from((addr, 0))))
        .expect("enter")
        .unwrap_or_else(|e| panic!("bind {addr} in {}: {e}", to.name()));
    let target = listener.local_addr().expect("local_addr");
    let client = from
        .enter(move || -> std::io::Result<()> {
            let mut stream = TcpStream::connect_timeout(&target, Duration::from_secs(5))?;
            stream.write_all(b"hello flannel")?;
            Ok(())
        })
        .expect("enter");
    client.unwrap_or_else(|e| panic!("connect {target} from {}: {e}", from.name()));
    let (mut conn, _) = listener.accept().expect("accept");
    let mut got = String::new();
    conn.read_to_string(&mut got).expect("read");
    assert_eq!(got, "hello flannel");
}

#[test]
fn version_lists_all_spec_versions() {
    let bin = flannel_bin();
    let out = Command::new(&bin)
        .env("CNI_COMMAND", "VERSION")
        .stdin(Stdio::null())
        .output()
        .expect("run flannel");
    assert!(out.status.success());
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "{\"cniVersion\":\"1.1.0\",\"supportedVersions\":[\"0.1.0\",\"0.2.0\",\"0.3.0\",\"0.3.1\",\"0.4.0\",\"1.0.0\",\"1.1.0\"]}\n"
    );
}

#[test]
fn missing_subnet_env_is_try_again_later() {
    let dirs = Dirs::new();
    fs::remove_file(dirs.path("subnet.env")).expect("rm");
    let conf = dirs.config(None);
    let err = Call::new("ADD", "c-nosubnet", &conf).err(None);
    assert_eq!(err["code"], 11, "{err}");
    assert_eq!(err["cniVersion"], "1.0.0");
    assert_eq!(
        err["msg"],
        format!(
            "failed to load flannel 'subnet.env' file: open {}: no such file or directory. Check the flannel pod log for this node.",
            dirs.path("subnet.env").display()
        )
    );
    assert!(!dirs.data_dir().exists(), "nothing stored");
}

#[test]
fn malformed_config_is_a_decoding_failure() {
    let dirs = Dirs::new();
    // Not JSON at all: 6, with the reference skeleton's message.
    let bin = flannel_bin();
    let mut child = Command::new(&bin)
        .env("CNI_COMMAND", "ADD")
        .env("CNI_CONTAINERID", "c-bad")
        .env("CNI_NETNS", "/run/netns/none")
        .env("CNI_IFNAME", "eth0")
        .env("CNI_PATH", CNI_BIN_DIR)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(b"{\"name\": \"cbr0\", ")
        .expect("write");
    let out = child.wait_with_output().expect("wait");
    assert_eq!(out.status.code(), Some(1));
    let err: Value = serde_json::from_slice(&out.stdout).expect("error JSON");
    assert_eq!(err["code"], 6, "{err}");
    assert!(
        err["msg"]
            .as_str()
            .is_some_and(|m| m.starts_with("error unmarshall network config: ")),
        "{err}"
    );

    // JSON with a field of the wrong type: also 6.
    let mut conf = dirs.config(None);
    conf["subnetFile"] = json!(42);
    let err = Call::new("ADD", "c-bad", &conf).err(None);
    assert_eq!(err["code"], 6, "{err}");
    assert!(
        err["msg"].as_str().is_some_and(|m| m.starts_with(
            "failed to load flannel netconf file: failed to load netconf: invalid type: integer `42`"
        )),
        "{err}"
    );

    // Valid JSON that flannel rejects: 7 with upstream's text.
    let conf = dirs.config(Some(json!({"ipam": {"type": "host-local"}})));
    let err = Call::new("ADD", "c-bad", &conf).err(None);
    assert_eq!(err["code"], 7, "{err}");
    assert_eq!(
        err["msg"],
        "'delegate' dictionary must not have 'ipam' field, it'll be set by flannel"
    );
    let mut conf = dirs.config(None);
    conf.as_object_mut().expect("object").remove("name");
    let err = Call::new("ADD", "c-bad", &conf).err(None);
    assert_eq!(
        (err["code"].clone(), err["msg"].clone()),
        (json!(7), json!("missing network name"))
    );
}

#[test]
fn missing_delegate_plugin_is_named_with_the_path() {
    let dirs = Dirs::new();
    let bin_dir = dirs.path("bin");
    fs::create_dir(&bin_dir).expect("mkdir");
    for plugin in ["host-local", "loopback"] {
        std::os::unix::fs::symlink(Path::new(CNI_BIN_DIR).join(plugin), bin_dir.join(plugin))
            .expect("symlink");
    }
    let conf = dirs.config(None);
    let err = Call::new("ADD", "c-nobridge", &conf)
        .cni_path(&bin_dir)
        .err(None);
    assert_eq!(err["code"], 101, "{err}");
    assert_eq!(
        err["msg"],
        format!(
            "failed to delegate add: failed to find plugin \"bridge\" in path [{}]",
            bin_dir.display()
        )
    );
    assert!(
        err["details"]
            .as_str()
            .is_some_and(|d| d.contains(&bin_dir.display().to_string())),
        "{err}"
    );
    assert!(!dirs.data_dir().join("c-nobridge").exists());
}

#[test]
fn pods_on_the_bridge_lifecycle() {
    require_root!();
    for plugin in ["bridge", "host-local", "loopback"] {
        assert!(
            Path::new(CNI_BIN_DIR).join(plugin).exists(),
            "{CNI_BIN_DIR}/{plugin} missing (Debian package containernetworking-plugins)"
        );
    }
    let node = NetNs::new("cninode").expect("node netns");
    let pod1 = NetNs::new("cnipod1").expect("pod netns");
    let pod2 = NetNs::new("cnipod2").expect("pod netns");
    let dirs = Dirs::new();

    // Pod 1 with the shipped manifest's delegate: default route via the bridge.
    let manifest = dirs.config(Some(json!({"hairpinMode": true, "isDefaultGateway": true})));
    let result1 = Call::new("ADD", "pod1-ctr", &manifest)
        .netns(&pod1)
        .ok(Some(&node));
    let addr1 = pod_address(&result1);
    let sandbox = result1["interfaces"]
        .as_array()
        .expect("interfaces")
        .iter()
        .find(|i| i["name"] == "eth0")
        .map(|i| i["sandbox"].clone());
    assert_eq!(sandbox, Some(json!(pod1.path())), "{result1}");

    // The pod: its address on eth0, MTU from subnet.env, routes from the delegate config.
    let addrs = run_in(&pod1, &["ip", "-o", "-4", "addr", "show", "dev", "eth0"]);
    assert!(addrs.contains(&format!("inet {addr1} ")), "{addrs}");
    let link = run_in(&pod1, &["ip", "-o", "link", "show", "eth0"]);
    assert!(link.contains("mtu 1450 "), "{link}");
    let routes = run_in(&pod1, &["ip", "-4", "route", "show"]);
    assert!(
        routes.contains("default via 10.244.5.1 dev eth0"),
        "{routes}"
    );
    assert!(
        routes.contains("10.244.0.0/16 via 10.244.5.1 dev eth0"),
        "{routes}"
    );

    // The node: cni0 with the gateway address (FLANNEL_SUBNET).
    let bridge = run_in(&node, &["ip", "-o", "-4", "addr", "show", "dev", "cni0"]);
    assert!(bridge.contains("inet 10.244.5.1/24 "), "{bridge}");

    // The stored delegate config: dir 0700, file 0600, exactly what was sent to bridge.
    let data_dir = dirs.data_dir();
    assert_eq!(
        fs::metadata(&data_dir)
            .expect("dataDir")
            .permissions()
            .mode()
            & 0o777,
        0o700
    );
    let stored_path = data_dir.join("pod1-ctr");
    assert_eq!(
        fs::metadata(&stored_path)
            .expect("stored file")
            .permissions()
            .mode()
            & 0o777,
        0o600
    );
    let stored: Value =
        serde_json::from_slice(&fs::read(&stored_path).expect("read stored")).expect("JSON");
    assert_eq!(
        stored,
        json!({
            "cniVersion": "1.0.0",
            "hairpinMode": true,
            "ipMasq": false,
            "ipam": {
                "dataDir": dirs.ipam_dir(),
                "ranges": [[{"subnet": "10.244.5.0/24"}]],
                "routes": [{"dst": "10.244.0.0/16"}],
                "type": "host-local"
            },
            "isDefaultGateway": true,
            "isGateway": true,
            "mtu": 1450,
            "name": "cbr0",
            "type": "bridge"
        })
    );
    // host-local recorded the allocation in our temp dir.
    let lease1 = dirs.ipam_dir().join("cbr0").join(addr1.addr().to_string());
    assert!(
        fs::read_to_string(&lease1)
            .expect("host-local lease file")
            .starts_with("pod1-ctr"),
        "{}",
        lease1.display()
    );

    // Pod 2 with the default delegate: only the cluster route, no default route.
    let plain = dirs.config(None);
    let result2 = Call::new("ADD", "pod2-ctr", &plain)
        .netns(&pod2)
        .ok(Some(&node));
    let addr2 = pod_address(&result2);
    assert_ne!(addr1.addr(), addr2.addr(), "two pods got the same address");
    let routes = run_in(&pod2, &["ip", "-4", "route", "show"]);
    assert!(
        routes.contains("10.244.0.0/16 via 10.244.5.1 dev eth0"),
        "{routes}"
    );
    assert!(!routes.contains("default"), "{routes}");

    // Traffic: pod -> gateway on the node, pod -> pod across the bridge.
    tcp_reaches(&pod1, &node, Ipv4Addr::new(10, 244, 5, 1));
    tcp_reaches(&pod2, &node, Ipv4Addr::new(10, 244, 5, 1));
    tcp_reaches(&pod1, &pod2, addr2.addr());

    // CHECK re-runs bridge's CHECK with the stored config and the runtime's prevResult.
    let mut check = manifest.clone();
    check["prevResult"] = result1.clone();
    let out = Call::new("CHECK", "pod1-ctr", &check)
        .netns(&pod1)
        .ok(Some(&node));
    assert_eq!(out, Value::Null);
    // ... and so notices when the pod's address is gone (upstream's CHECK never fails).
    run_in(&pod1, &["ip", "addr", "flush", "dev", "eth0"]);
    let err = Call::new("CHECK", "pod1-ctr", &check)
        .netns(&pod1)
        .err(Some(&node));
    // The bridge plugin's own error, handed on unchanged.
    assert!(
        err["msg"]
            .as_str()
            .is_some_and(|m| m.contains(&addr1.to_string())),
        "{err}"
    );
    // Without a stored config there is nothing to check against: success, as upstream.
    Call::new("CHECK", "never-added", &check)
        .netns(&pod1)
        .ok(Some(&node));

    // DEL: the veth, the address allocation and the stored file go; a second DEL succeeds.
    assert_eq!(
        Call::new("DEL", "pod1-ctr", &manifest)
            .netns(&pod1)
            .ok(Some(&node)),
        Value::Null
    );
    assert!(!stored_path.exists(), "stored delegate config not removed");
    assert!(!lease1.exists(), "host-local allocation not released");
    let links = run_in(&pod1, &["ip", "-o", "link", "show"]);
    assert!(!links.contains("eth0"), "{links}");
    Call::new("DEL", "pod1-ctr", &manifest)
        .netns(&pod1)
        .ok(Some(&node));

    // DEL after the runtime removed the pod's namespace (CNI_NETNS no longer exists) still
    // releases the address through the delegate.
    let lease2 = dirs.ipam_dir().join("cbr0").join(addr2.addr().to_string());
    assert!(lease2.exists());
    Call::new("DEL", "pod2-ctr", &plain).ok(Some(&node));
    assert!(!lease2.exists(), "host-local allocation not released");
    assert!(!data_dir.join("pod2-ctr").exists());

    // The pool still works after the releases.
    let pod3 = NetNs::new("cnipod3").expect("pod netns");
    let result3 = Call::new("ADD", "pod3-ctr", &plain)
        .netns(&pod3)
        .ok(Some(&node));
    pod_address(&result3);
    Call::new("DEL", "pod3-ctr", &plain)
        .netns(&pod3)
        .ok(Some(&node));
    assert!(fs::read_dir(&data_dir).expect("dataDir").next().is_none());
}
