//! `cargo xtask run` is `flannel-lab up` with the README's defaults; `--once` makes it a smoke
//! test: bring the cluster up, print the leases, the pod-to-pod matrix and one status block,
//! remove everything and exit non-zero unless every pod pair connected.
//!
//! Run: `cargo test -p flannel-tests --test agent_lab` (as root; skipped otherwise).

use std::{
    io::Read as _,
    process::{Command, Stdio},
    thread,
    time::{Duration, Instant},
};

use flannel_tests::{lab::bins, netns, require_root};

/// Runs `flannel-lab up --once` with the default cluster (3 nodes, vxlan, L2, 2 pods each,
/// `--dataplane auto`, which here means the eBPF fast path on every node).
#[test]
fn lab_up_once_reaches_every_pod() {
    require_root!();
    let stdout = lab_up_once(&[]);
    assert!(
        stdout.contains("leases in etcd (3 under /coreos.com/network/subnets/)"),
        "no lease table"
    );
    assert_all_reached(&stdout);
}

/// `flannel-lab up --once --kube` (`cargo xtask run -- --kube`): the agents take their leases
/// from the Node objects of the fake API server, dual stack; every node's lease is its Node's
/// pod CIDRs, with the public IP and VTEP its agent annotated, and every pod reaches every
/// other over both families.
#[test]
fn lab_up_once_in_kube_mode_reaches_every_pod() {
    require_root!();
    let stdout = lab_up_once(&["--kube", "--ipv6-network", "fd00:244::/48"]);
    assert!(
        stdout.contains("leases on the Node objects (3 with flannel's annotations)"),
        "no lease table"
    );
    for n in 1..=3 {
        let line = stdout
            .lines()
            .find(|l| l.trim_start().starts_with(&format!("10.244.{n}.0/24 ")))
            .unwrap_or_else(|| panic!("no lease line for node{n}"));
        let words: Vec<&str> = line.split_whitespace().collect();
        assert_eq!(
            words[..5],
            [
                format!("10.244.{n}.0/24").as_str(),
                format!("node{n}").as_str(),
                "public",
                format!("192.168.1.1{n}").as_str(),
                "vxlan"
            ],
            "{line}"
        );
        assert!(line.contains("\"VtepMAC\":"), "{line}");
        assert!(
            stdout.contains(&format!("fd00:244:0:{n}::/64")),
            "node{n}'s IPv6 pod CIDR"
        );
    }
    assert!(
        stdout.contains("pod-to-pod over IPv6 (TCP, across nodes): every pair"),
        "IPv6 pods do not all talk"
    );
    assert_all_reached(&stdout);
}

/// Every pod pair connected; every agent healthy, ready and on the fast path.
fn assert_all_reached(stdout: &str) {
    assert!(
        stdout.contains("30 of 30 pairs reachable"),
        "matrix not all OK"
    );
    assert!(!stdout.contains("FAIL"), "a pair failed");
    assert_eq!(
        stdout.matches("/healthz ok, /readyz ok").count(),
        3,
        "not every agent healthy and ready"
    );
    assert_eq!(
        stdout
            .matches("flannel_dataplane_info{path=\"ebpf\",backend=\"vxlan\"}=1")
            .count(),
        3,
        "not every agent runs the eBPF fast path"
    );
}

/// Runs `flannel-lab up --once` with `args` and the test builds of the agent and the CNI
/// plugin; returns its standard output once it exited successfully and left no namespace of
/// its run behind.
fn lab_up_once(args: &[&str]) -> String {
    let agent = bins::test_agent().unwrap_or_else(|e| panic!("{e:#}"));
    let cni = bins::test_cni_plugin().unwrap_or_else(|e| panic!("{e:#}"));
    let mut child = Command::new(env!("CARGO_BIN_EXE_flannel-lab"))
        .arg("up")
        .arg("--once")
        .arg("--agent")
        .arg(&agent)
        .arg("--cni")
        .arg(&cni)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting flannel-lab");
    let pid = child.id();
    // Drain both pipes on threads so the child never blocks on a full pipe.
    let mut out_pipe = child.stdout.take().expect("stdout");
    let mut err_pipe = child.stderr.take().expect("stderr");
    let out = thread::spawn(move || {
        let mut s = String::new();
        let _ = out_pipe.read_to_string(&mut s);
        s
    });
    let err = thread::spawn(move || {
        let mut s = String::new();
        let _ = err_pipe.read_to_string(&mut s);
        s
    });
    let deadline = Instant::now() + Duration::from_secs(240);
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait") {
            break Some(status);
        }
        if Instant::now() >= deadline {
            // SIGINT first: flannel-lab removes its cluster on it.
            // SAFETY: kill(2) on our own child's pid.
            unsafe { libc::kill(pid as i32, libc::SIGINT) };
            thread::sleep(Duration::from_secs(10));
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        thread::sleep(Duration::from_millis(200));
    };
    let (stdout, stderr) = (
        out.join().unwrap_or_default(),
        err.join().unwrap_or_default(),
    );
    eprintln!("--- flannel-lab stdout:\n{stdout}\n--- stderr:\n{stderr}");
    let status = status.expect("flannel-lab up --once did not finish within 240 s");
    assert!(status.success(), "flannel-lab up --once: {status}");
    // Everything it built is gone: no namespace with its run prefix.
    let prefix = format!("fl{}x", base36(pid));
    let left: Vec<String> = netns::list()
        .into_iter()
        .filter(|n| n.starts_with(&prefix))
        .collect();
    assert!(left.is_empty(), "namespaces left behind: {left:?}");
    stdout
}

fn base36(mut n: u32) -> String {
    const DIGITS: &[u8] = b"0123456789abcdefghijklmnopqrstuvwxyz";
    let mut out = Vec::new();
    loop {
        out.push(DIGITS[(n % 36) as usize]);
        n /= 36;
        if n == 0 {
            break;
        }
    }
    out.reverse();
    String::from_utf8(out).unwrap_or_default()
}
