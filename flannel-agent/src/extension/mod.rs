//! The extension backend (flannel-upstream.md 2.8): the operator's commands are the data path.
//!
//! - [`pre_startup`], before the lease: `PreStartupCommand`'s output becomes the lease's
//!   BackendData, a JSON string (failure stops the agent);
//! - [`post_startup`], once the lease is held: `PostStartupCommand` with `NETWORK`, `SUBNET`,
//!   `IPV6SUBNET`, `PUBLIC_IP`, `PUBLIC_IPV6` of this node (failure stops the agent);
//! - [`ExtensionApplier`], every reconcile: `SubnetAddCommand` for each remote `extension`
//!   lease that appeared or changed, `SubnetRemoveCommand` for each that went away or changed,
//!   with `SUBNET`, `PUBLIC_IP` (and, as upstream's documentation lists them, `IPV6SUBNET`,
//!   `PUBLIC_IPV6` when the lease has them) and the lease's BackendData string on stdin.
//!
//! Commands run as [`command`] describes (upstream's rules: no shell). Where upstream differs:
//! it runs the add command again for every event of a lease, renewals included, and never
//! retries; here a lease's commands run when it appears, changes (remove for the old values,
//! then add) or goes away, and a command that failed is run again at the reconciler's next
//! attempt (so commands should be idempotent, e.g. `ip route replace`). A command that has not
//! ended after a minute is killed.

pub mod command;

use std::collections::BTreeMap;

use futures::future::BoxFuture;
use ipnet::{Ipv4Net, Ipv6Net};
use tracing::{info, warn};

pub use command::{Command, CommandError, Failed};

use crate::{
    backend::ExtensionOptions,
    dataplane::{Applier, ApplyReport, Desired, ExtensionPeer, Local, SyncMode},
    gojson::{self, RawJson},
    subnet::LeaseId,
};

/// Runs `PreStartupCommand`, if configured: its output as the lease's BackendData (a JSON
/// string, written as Go's encoder writes it); `None` without the command.
pub async fn pre_startup(options: &ExtensionOptions) -> Result<Option<RawJson>, Failed> {
    let Some(text) = &options.pre_startup_command else {
        info!("No pre startup command configured - skipping");
        return Ok(None);
    };
    let output = run(Command::new(text.clone()), Vec::new(), String::new()).await?;
    info!(command = %text, %output, "Ran pre-startup command");
    let mut json = String::new();
    gojson::write_string(&mut json, &output);
    // A JSON string literal is valid JSON.
    Ok(RawJson::from_json(&json).ok())
}

/// This node's values for `PostStartupCommand`.
#[derive(Debug, Clone, Default)]
pub struct NodeVars {
    /// The cluster's IPv4 `Network`.
    pub network: Option<Ipv4Net>,
    /// The node's IPv4 subnet.
    pub subnet: Option<Ipv4Net>,
    /// The node's IPv6 subnet.
    pub ipv6_subnet: Option<Ipv6Net>,
    /// The node's public IP.
    pub public_ip: Option<std::net::Ipv4Addr>,
    /// The node's public IPv6 address.
    pub public_ipv6: Option<std::net::Ipv6Addr>,
}

/// Runs `PostStartupCommand`, if configured, with this node's values (empty where it has
/// none).
pub async fn post_startup(options: &ExtensionOptions, node: &NodeVars) -> Result<(), Failed> {
    let Some(text) = &options.post_startup_command else {
        info!("No post startup command configured - skipping");
        return Ok(());
    };
    let shown = |v: Option<String>| v.unwrap_or_default();
    let vars = vec![
        ("NETWORK", shown(node.network.map(|n| n.to_string()))),
        ("SUBNET", shown(node.subnet.map(|n| n.to_string()))),
        ("IPV6SUBNET", shown(node.ipv6_subnet.map(|n| n.to_string()))),
        ("PUBLIC_IP", shown(node.public_ip.map(|a| a.to_string()))),
        (
            "PUBLIC_IPV6",
            shown(node.public_ipv6.map(|a| a.to_string())),
        ),
    ];
    let output = run(Command::new(text.clone()), vars, String::new()).await?;
    info!(command = %text, %output, "Ran post-startup command");
    Ok(())
}

/// Runs `command` on a blocking thread.
async fn run(
    command: Command,
    vars: Vec<(&'static str, String)>,
    stdin: String,
) -> Result<String, Failed> {
    let text = command.text.clone();
    tokio::task::spawn_blocking(move || command.run(&vars, &stdin))
        .await
        .unwrap_or_else(|e| {
            Err(Failed {
                command: text,
                error: CommandError::Wait(std::io::Error::other(e.to_string())),
                output: String::new(),
            })
        })
}

/// A remote lease's variables for the add and remove commands.
fn lease_vars(peer: &ExtensionPeer) -> Vec<(&'static str, String)> {
    let mut vars = vec![("PUBLIC_IP", peer.public_ip.to_string())];
    if let Some(subnet) = peer.subnet {
        vars.push(("SUBNET", subnet.to_string()));
    }
    if let Some(subnet) = peer.ipv6_subnet {
        vars.push(("IPV6SUBNET", subnet.to_string()));
    }
    if let Some(ip) = peer.public_ipv6 {
        vars.push(("PUBLIC_IPV6", ip.to_string()));
    }
    vars
}

/// Runs the add and remove commands for the remote leases (see the module documentation).
#[derive(Debug)]
pub struct ExtensionApplier {
    add: Option<Command>,
    remove: Option<Command>,
    /// The leases whose add command succeeded (or that needed none), as they were then.
    applied: BTreeMap<LeaseId, ExtensionPeer>,
}

impl ExtensionApplier {
    /// An applier for these options, nothing applied yet (after a restart every lease's add
    /// command runs again, as upstream's does).
    pub fn new(options: &ExtensionOptions) -> Self {
        ExtensionApplier {
            add: options.subnet_add_command.clone().map(Command::new),
            remove: options.subnet_remove_command.clone().map(Command::new),
            applied: BTreeMap::new(),
        }
    }

    /// Sets how long each command may run.
    pub fn with_timeout(mut self, timeout: std::time::Duration) -> Self {
        for cmd in [&mut self.add, &mut self.remove].into_iter().flatten() {
            cmd.timeout = timeout;
        }
        self
    }

    /// Runs `command` (if configured) for `peer`; `kind` names it in the report.
    async fn one(
        command: Option<&Command>,
        kind: &str,
        peer: &ExtensionPeer,
        report: &mut ApplyReport,
    ) -> bool {
        let Some(command) = command else {
            return true;
        };
        report.stats.ops += 1;
        let subnet = peer.subnet.map(|s| s.to_string()).unwrap_or_default();
        match run(command.clone(), lease_vars(peer), peer.data.clone()).await {
            Ok(output) => {
                info!(lease = %peer.id, %subnet, public_ip = %peer.public_ip, %output, "Ran {kind} command");
                true
            }
            Err(failed) => {
                warn!(lease = %peer.id, %subnet, "{failed}");
                report.fail(format!("extension:{kind}"), failed.to_string());
                false
            }
        }
    }

    async fn sync_inner(&mut self, desired: &Desired, mode: SyncMode) -> ApplyReport {
        let mut report = ApplyReport::default();
        for peer in &desired.extension {
            match self.applied.get(&peer.id) {
                Some(old) if old == peer => {
                    report.stats.unchanged += 1;
                    continue;
                }
                Some(old) => {
                    let old = old.clone();
                    info!(lease = %peer.id, "Subnet changed: {:?} via {}", peer.subnet, peer.public_ip);
                    // The old values' removal failing does not hold back the new ones.
                    Self::one(self.remove.as_ref(), "remove", &old, &mut report).await;
                    if Self::one(self.add.as_ref(), "add", peer, &mut report).await {
                        report.stats.replaced += 1;
                        self.applied.insert(peer.id.clone(), peer.clone());
                    } else {
                        self.applied.remove(&peer.id);
                    }
                }
                None => {
                    info!(lease = %peer.id, "Subnet added: {:?} via {}", peer.subnet, peer.public_ip);
                    if Self::one(self.add.as_ref(), "add", peer, &mut report).await {
                        report.stats.added += 1;
                        self.applied.insert(peer.id.clone(), peer.clone());
                    }
                }
            }
        }
        if mode == SyncMode::Full {
            let wanted: std::collections::BTreeSet<&LeaseId> =
                desired.extension.iter().map(|p| &p.id).collect();
            let gone: Vec<ExtensionPeer> = self
                .applied
                .values()
                .filter(|p| !wanted.contains(&p.id))
                .cloned()
                .collect();
            for peer in gone {
                info!(lease = %peer.id, "Subnet removed: {:?}", peer.subnet);
                if Self::one(self.remove.as_ref(), "remove", &peer, &mut report).await {
                    report.stats.deleted += 1;
                    self.applied.remove(&peer.id);
                }
            }
        }
        report
    }

    /// The leases whose add command has succeeded, by id.
    pub fn applied(&self) -> impl Iterator<Item = &LeaseId> {
        self.applied.keys()
    }
}

impl Applier for ExtensionApplier {
    fn name(&self) -> &'static str {
        "extension"
    }

    fn sync<'a>(
        &'a mut self,
        _local: &'a Local,
        desired: &'a Desired,
        mode: SyncMode,
    ) -> BoxFuture<'a, ApplyReport> {
        Box::pin(self.sync_inner(desired, mode))
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests fail loudly by design
mod tests {
    use std::{net::Ipv4Addr, os::unix::fs::PermissionsExt as _, path::Path, time::Duration};

    use super::*;
    use crate::{backend::BackendOptions, dataplane::desired::tests::local, ip::IpStack};

    /// A command that appends `<name> <SUBNET> <PUBLIC_IP> <stdin>` to `log`, and fails while
    /// `fail` exists.
    fn recorder(dir: &Path, name: &str) -> String {
        let path = dir.join(name);
        let body = format!(
            "#!/bin/sh\nread data\n[ -e {dir}/fail ] && {{ echo refused; exit 1; }}\n\
             echo \"$1 $SUBNET $PUBLIC_IP $data\" >> {dir}/log\n",
            dir = dir.display()
        );
        std::fs::write(&path, body).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
        path.display().to_string()
    }

    fn peer(id: &str, subnet: &str, ip: [u8; 4], data: &str) -> ExtensionPeer {
        ExtensionPeer {
            id: id.into(),
            subnet: Some(subnet.parse().unwrap()),
            ipv6_subnet: None,
            public_ip: Ipv4Addr::from(ip),
            public_ipv6: None,
            data: data.into(),
        }
    }

    fn log(dir: &Path) -> Vec<String> {
        let text = std::fs::read_to_string(dir.join("log")).unwrap_or_default();
        std::fs::remove_file(dir.join("log")).ok();
        text.lines().map(str::to_owned).collect()
    }

    #[tokio::test]
    async fn leases_are_added_changed_and_removed_by_diff() {
        let dir = tempfile::tempdir().unwrap();
        let prog = recorder(dir.path(), "cmd");
        let options = ExtensionOptions {
            subnet_add_command: Some(format!("{prog} add")),
            subnet_remove_command: Some(format!("{prog} remove")),
            ..ExtensionOptions::default()
        };
        let local = local(BackendOptions::Extension(options.clone()), IpStack::V4);
        let mut applier = ExtensionApplier::new(&options).with_timeout(Duration::from_secs(20));
        let a = peer("a", "10.244.2.0/24", [192, 168, 10, 2], "mac-a");
        let b = peer("b", "10.244.3.0/24", [192, 168, 10, 3], "");
        let mut desired = Desired {
            extension: vec![a.clone(), b.clone()],
            ..Desired::default()
        };

        let report = applier.sync(&local, &desired, SyncMode::Full).await;
        assert_eq!(
            (report.stats.added, report.stats.errors),
            (2, 0),
            "{report:?}"
        );
        assert_eq!(
            log(dir.path()),
            [
                "add 10.244.2.0/24 192.168.10.2 mac-a",
                "add 10.244.3.0/24 192.168.10.3 "
            ]
        );

        // Nothing changed: nothing runs (upstream runs the add command on every renewal).
        let report = applier.sync(&local, &desired, SyncMode::Full).await;
        assert_eq!((report.stats.unchanged, report.stats.ops), (2, 0));
        assert!(log(dir.path()).is_empty());

        // b moved: the old values removed, the new ones added.
        desired.extension[1].public_ip = Ipv4Addr::new(192, 168, 10, 9);
        let report = applier.sync(&local, &desired, SyncMode::Full).await;
        assert_eq!(report.stats.replaced, 1);
        assert_eq!(
            log(dir.path()),
            [
                "remove 10.244.3.0/24 192.168.10.3 ",
                "add 10.244.3.0/24 192.168.10.9 "
            ]
        );

        // a went away: kept until the lease set is complete.
        desired.extension.remove(0);
        let report = applier.sync(&local, &desired, SyncMode::AddOnly).await;
        assert_eq!(report.stats.deleted, 0);
        assert!(log(dir.path()).is_empty());
        let report = applier.sync(&local, &desired, SyncMode::Full).await;
        assert_eq!(report.stats.deleted, 1);
        assert_eq!(log(dir.path()), ["remove 10.244.2.0/24 192.168.10.2 mac-a"]);
        assert_eq!(applier.applied().collect::<Vec<_>>(), ["b"]);
    }

    #[tokio::test]
    async fn a_failed_command_is_reported_and_run_again() {
        let dir = tempfile::tempdir().unwrap();
        let prog = recorder(dir.path(), "cmd");
        let options = ExtensionOptions {
            subnet_add_command: Some(format!("{prog} add")),
            ..ExtensionOptions::default()
        };
        let local = local(BackendOptions::Extension(options.clone()), IpStack::V4);
        let mut applier = ExtensionApplier::new(&options);
        let desired = Desired {
            extension: vec![peer("a", "10.244.2.0/24", [192, 168, 10, 2], "x")],
            ..Desired::default()
        };
        std::fs::write(dir.path().join("fail"), "").unwrap();
        let report = applier.sync(&local, &desired, SyncMode::Full).await;
        assert_eq!((report.stats.added, report.stats.errors), (0, 1));
        assert_eq!(report.errors[0].kind, "extension:add");
        assert!(
            report.errors[0]
                .message
                .ends_with("Err: exit status: 1 Output: refused"),
            "{}",
            report.errors[0].message
        );
        assert!(applier.applied().next().is_none());

        std::fs::remove_file(dir.path().join("fail")).unwrap();
        let report = applier.sync(&local, &desired, SyncMode::Full).await;
        assert_eq!((report.stats.added, report.stats.errors), (1, 0));
        assert_eq!(log(dir.path()), ["add 10.244.2.0/24 192.168.10.2 x"]);
    }

    #[tokio::test]
    async fn startup_commands_publish_output_and_see_the_node() {
        let dir = tempfile::tempdir().unwrap();
        let pre = dir.path().join("pre");
        std::fs::write(&pre, "#!/bin/sh\necho ' 0e:2a:<1> \"q\"'\necho note >&2\n").unwrap();
        std::fs::set_permissions(&pre, std::fs::Permissions::from_mode(0o755)).unwrap();
        let options = ExtensionOptions {
            pre_startup_command: Some(pre.display().to_string()),
            post_startup_command: Some(format!(
                "{} ${{NETWORK}}|$SUBNET|$IPV6SUBNET|$PUBLIC_IP|$PUBLIC_IPV6",
                recorder(dir.path(), "post")
            )),
            ..ExtensionOptions::default()
        };
        let data = pre_startup(&options).await.unwrap().unwrap();
        assert_eq!(data.as_str(), r#""0e:2a:\u003c1\u003e \"q\"\nnote""#);
        assert_eq!(
            pre_startup(&ExtensionOptions::default()).await.unwrap(),
            None
        );

        let node = NodeVars {
            network: Some("10.244.0.0/16".parse().unwrap()),
            subnet: Some("10.244.7.0/24".parse().unwrap()),
            public_ip: Some(Ipv4Addr::new(192, 168, 10, 7)),
            ..NodeVars::default()
        };
        post_startup(&options, &node).await.unwrap();
        assert_eq!(
            log(dir.path()),
            ["10.244.0.0/16|10.244.7.0/24||192.168.10.7| 10.244.7.0/24 192.168.10.7 "]
        );

        std::fs::write(dir.path().join("fail"), "").unwrap();
        let err = post_startup(&options, &node).await.unwrap_err();
        assert!(
            err.to_string().starts_with("failed to run command: "),
            "{err}"
        );
    }
}
