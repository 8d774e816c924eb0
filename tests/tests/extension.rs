//! The extension backend in a three-node cluster of real agents (etcd in the hub, pods made
//! by the flannel CNI plugin): its commands are the data path. The network config is
//! upstream's host-gw example made of commands (`ip route replace $SUBNET via $PUBLIC_IP`,
//! `ip route del ...`), a pre-startup command whose output every lease publishes as its
//! BackendData, and a post-startup command that records what it was told. Checked: the
//! leases, the post-startup record of each node, the routes the add commands made, pods
//! reaching each other across nodes through them, and a node that leaves: its lease deleted,
//! the others' remove commands take its route away.
//!
//! Run: `cargo test -p flannel-tests --test extension` (as root; skipped otherwise).

mod agent_support;

use std::{os::unix::fs::PermissionsExt as _, path::Path};

use agent_support::{CONVERGE, PROBE, leases_by_node, spec, with_cluster};
use anyhow::{Context as _, Result, ensure};
use flannel_tests::{
    lab::{cluster::Cluster, wait},
    require_root,
    topology::Underlay,
};
use serde_json::{Value, json};

fn script(dir: &Path, name: &str, body: &str) -> Result<String> {
    let path = dir.join(name);
    std::fs::write(&path, format!("#!/bin/sh\n{body}\n"))?;
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755))?;
    Ok(path.display().to_string())
}

#[test]
fn extension_commands_route_pods_and_follow_leases() {
    require_root!();
    let dir = tempfile::tempdir().expect("temporary directory");
    let d = dir.path();
    let pre = script(d, "pre", "echo '<pre> \"data\"'; echo from-stderr >&2").expect("pre");
    let post = script(
        d,
        "post",
        &format!("echo \"$2 $3\" > {}/post-$1", d.display()),
    )
    .expect("post");
    let mut spec = spec(3, Underlay::L2, "extension", 1);
    spec.backend_options = json!({
        "PreStartupCommand": pre,
        "PostStartupCommand": format!("{post} $PUBLIC_IP $SUBNET ${{NETWORK}}"),
        "SubnetAddCommand": "ip route replace $SUBNET via $PUBLIC_IP",
        "SubnetRemoveCommand": "ip route del $SUBNET via $PUBLIC_IP",
    });
    with_cluster("extension/l2", spec, |c| {
        let leases = leases_by_node(c)?;
        for (n, lease) in &leases {
            ensure!(
                lease.backend_type.as_deref() == Some("extension"),
                "node{n}'s lease: {lease:?}"
            );
            ensure!(
                lease.backend_data == Some(Value::String("<pre> \"data\"\nfrom-stderr".into())),
                "node{n}'s BackendData: {:?}",
                lease.backend_data
            );
            let ip = lease.public_ip.context("public IP")?;
            let told = std::fs::read_to_string(d.join(format!("post-{ip}")))
                .with_context(|| format!("node{n}'s post-startup record"))?;
            ensure!(
                told.trim() == format!("{} 10.244.0.0/16", lease.subnet),
                "node{n}'s post-startup command was told {told:?}"
            );
        }
        let route_of = |c: &Cluster, n: usize, m: usize| -> Result<String> {
            let subnet = leases[&m].subnet.to_string();
            c.topology().node(n).run(&["ip", "route", "show", &subnet])
        };
        wait::until_ok(CONVERGE, "every node's route to every other node", || {
            for n in leases.keys().copied() {
                for m in leases.keys().copied().filter(|&m| m != n) {
                    let via = leases[&m].public_ip.context("public IP")?;
                    let got = route_of(c, n, m)?;
                    ensure!(
                        got.contains(&format!("via {via}")),
                        "node{n} to node{m}: {got:?}"
                    );
                }
            }
            Ok(())
        })?;
        let matrix = c.matrix(PROBE)?;
        eprintln!("{matrix}");
        ensure!(matrix.all_ok(), "pods cannot reach each other:\n{matrix}");

        // Node 3 leaves: the others' remove commands take its route away.
        let key = c.lease_key(3).context("node3's lease key")?;
        ensure!(c.kv().delete(&key)?, "{key} existed");
        let agent = c.agent_mut(3).context("agent")?;
        wait::until(
            CONVERGE,
            "node3's agent to exit",
            || Ok(agent.exit_status()),
        )?;
        let c = &*c;
        wait::until_ok(CONVERGE, "nodes 1 and 2 to drop node3's route", || {
            for n in [1, 2] {
                let got = route_of(c, n, 3)?;
                ensure!(got.trim().is_empty(), "node{n} still routes it: {got:?}");
            }
            Ok(())
        })?;
        for n in [1, 2] {
            let log = std::fs::read_to_string(c.topology().node(n).agent_log())?;
            ensure!(
                log.contains("Ran remove command"),
                "node{n}'s log does not show the remove command"
            );
        }
        Ok(())
    });
}
