//! The Kubernetes subnet manager against a fake API server speaking real HTTP
//! (`flannel_tests::kube_mock`): lease watch (add, update, podCIDR change, delete, marker
//! removal, malformed nodes, watch restart, 410 Gone, bookmarks), the own-node status
//! patches byte for byte, node-name resolution and client construction. No root needed.

// Helpers outside `#[test]` functions fail loudly too.
#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, Ipv6Addr};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use anyhow::{Context as _, Result, bail, ensure};
use flannel_agent::backend::MacAddr;
use flannel_agent::gojson::RawJson;
use flannel_agent::lease::{Lease, LeaseAttrs};
use flannel_agent::subnet::kube::{
    AddressFamily, AnnotationKeys, KubeError, KubeSubnetManager, KubeTimings, NodeNameSource,
    StoredPublicIps, build_client, resolve_node_name,
};
use flannel_agent::subnet::{LeaseSnapshot, lease_channel};
use flannel_tests::kube_mock::{GoneMode, MockApiServer, RecordedRequest, node};
use serde_json::{Value, json};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

const PREFIX: &str = "flannel.alpha.coreos.com";
const VXLAN_CONF: &str = r#"{"Network": "10.244.0.0/16", "Backend": {"Type": "vxlan"}}"#;
const DUAL_CONF: &str = r#"{"Network": "10.244.0.0/16", "EnableIPv6": true,
    "IPv6Network": "fd00:10:244::/56", "Backend": {"Type": "vxlan"}}"#;

fn key(name: &str) -> String {
    format!("{PREFIX}/{name}")
}

fn mac_data(last: u8) -> String {
    format!(r#"{{"VNI":1,"VtepMAC":"96:59:b2:3f:04:{last:02x}"}}"#)
}

/// A node as upstream flannel leaves it after acquiring its lease.
fn managed(name: &str, cidrs: &[&str], public_ip: &str, mac_last: u8) -> Value {
    let data = mac_data(mac_last);
    node(
        name,
        cidrs,
        &[
            (&key("kube-subnet-manager"), "true"),
            (&key("backend-type"), "vxlan"),
            (&key("backend-data"), &data),
            (&key("public-ip"), public_ip),
        ],
    )
}

fn fast() -> KubeTimings {
    KubeTimings {
        node_poll_interval: Duration::from_millis(50),
        node_wait_timeout: Duration::from_millis(600),
        patch_retry_interval: Duration::from_millis(50),
        patch_retry_timeout: Duration::from_millis(600),
    }
}

struct Env {
    server: MockApiServer,
    dir: tempfile::TempDir,
}

impl Env {
    async fn new(nodes: Vec<Value>) -> Result<Self> {
        let server = MockApiServer::start().await?;
        for n in nodes {
            server.apply_node(n);
        }
        let dir = tempfile::tempdir()?;
        std::fs::write(dir.path().join("net-conf.json"), VXLAN_CONF)?;
        Ok(Env { server, dir })
    }

    fn conf_path(&self) -> PathBuf {
        self.dir.path().join("net-conf.json")
    }

    fn set_conf(&self, text: &str) -> Result<()> {
        Ok(std::fs::write(self.conf_path(), text)?)
    }

    fn manager(&self, own: &str) -> Result<KubeSubnetManager> {
        Ok(
            KubeSubnetManager::new(self.server.client()?, own, PREFIX, self.conf_path())?
                .with_timings(fast()),
        )
    }

    fn requests(&self, pred: impl Fn(&RecordedRequest) -> bool) -> Vec<RecordedRequest> {
        self.server
            .requests()
            .into_iter()
            .filter(|r| pred(r))
            .collect()
    }
}

/// Runs `watch_leases` in the background; stops it on drop.
struct Watch {
    rx: watch::Receiver<LeaseSnapshot>,
    seen: Arc<Mutex<Vec<LeaseSnapshot>>>,
    cancel: CancellationToken,
    task: tokio::task::JoinHandle<Result<(), KubeError>>,
}

impl Watch {
    fn start(mgr: KubeSubnetManager) -> Self {
        let (publisher, rx) = lease_channel();
        let cancel = CancellationToken::new();
        let mgr = Arc::new(mgr);
        let task = {
            let cancel = cancel.clone();
            tokio::spawn(async move { mgr.watch_leases(publisher, cancel).await })
        };
        // Every snapshot the consumer gets to see, to check invariants over time.
        let seen = Arc::new(Mutex::new(Vec::new()));
        {
            let mut rx = rx.clone();
            let seen = seen.clone();
            tokio::spawn(async move {
                while rx.changed().await.is_ok() {
                    let s = rx.borrow_and_update().clone();
                    seen.lock().unwrap().push(s);
                }
            });
        }
        Watch {
            rx,
            seen,
            cancel,
            task,
        }
    }

    async fn until(
        &mut self,
        what: &str,
        pred: impl Fn(&LeaseSnapshot) -> bool,
    ) -> Result<LeaseSnapshot> {
        let wait = async {
            loop {
                {
                    let s = self.rx.borrow_and_update();
                    if pred(&s) {
                        return Ok(s.clone());
                    }
                }
                self.rx.changed().await?;
            }
        };
        match tokio::time::timeout(Duration::from_secs(10), wait).await {
            Ok(r) => r,
            Err(_) => bail!(
                "timed out waiting for {what}; last: {:#?}",
                *self.rx.borrow()
            ),
        }
    }

    async fn stop(mut self) -> Result<()> {
        self.cancel.cancel();
        (&mut self.task).await??;
        Ok(())
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

fn ids(s: &LeaseSnapshot) -> Vec<&str> {
    s.leases.keys().map(String::as_str).collect()
}

fn has_ids(want: &'static [&'static str]) -> impl Fn(&LeaseSnapshot) -> bool {
    move |s| s.synced && ids(s) == want
}

fn expected_lease(cidr: &str, public_ip: [u8; 4], mac_last: u8) -> Lease {
    Lease {
        subnet: Some(cidr.parse().unwrap()),
        ipv6_subnet: None,
        attrs: LeaseAttrs {
            public_ip: Ipv4Addr::from(public_ip),
            public_ipv6: None,
            backend_type: "vxlan".into(),
            backend_data: Some(RawJson::from_json(&mac_data(mac_last)).unwrap()),
            backend_v6_data: None,
        },
        expiration: None,
    }
}

fn set_annotation(n: &mut Value, name: &str, value: Option<&str>) {
    match value {
        Some(v) => n["metadata"]["annotations"][key(name)] = json!(v),
        None => {
            n["metadata"]["annotations"]
                .as_object_mut()
                .unwrap()
                .remove(&key(name));
        }
    }
}

// ---------------------------------------------------------------------------------------
// Lease watch

#[tokio::test]
async fn watch_follows_adds_updates_and_deletes() -> Result<()> {
    let env = Env::new(vec![
        managed("n0", &["10.244.0.0/24"], "192.168.1.10", 0),
        managed("n1", &["10.244.1.0/24"], "192.168.1.11", 1),
        node("n2", &["10.244.2.0/24"], &[]), // not managed by flannel
    ])
    .await?;
    let mut w = Watch::start(env.manager("n0")?);

    let s = w.until("initial set", |s| s.synced).await?;
    assert_eq!(ids(&s), ["node/n1"], "own node and unmanaged node excluded");
    assert_eq!(
        s.leases["node/n1"],
        expected_lease("10.244.1.0/24", [192, 168, 1, 11], 1)
    );

    // Add.
    env.server
        .apply_node(managed("n3", &["10.244.3.0/24"], "192.168.1.13", 3));
    let s = w
        .until("n3 added", has_ids(&["node/n1", "node/n3"]))
        .await?;
    assert_eq!(
        s.leases["node/n3"],
        expected_lease("10.244.3.0/24", [192, 168, 1, 13], 3)
    );

    // Annotation update.
    env.server.modify_node("n3", |n| {
        set_annotation(n, "public-ip", Some("192.168.1.33"))
    });
    w.until("n3 new public ip", |s| {
        s.leases.get("node/n3").map(|l| l.attrs.public_ip) == Some(Ipv4Addr::new(192, 168, 1, 33))
    })
    .await?;

    // podCIDR change (upstream misses this one).
    env.server.modify_node("n3", |n| {
        n["spec"]["podCIDR"] = json!("10.244.30.0/24");
        n["spec"]["podCIDRs"] = json!(["10.244.30.0/24"]);
    });
    let s = w
        .until("n3 new podCIDR", |s| {
            s.leases.get("node/n3").and_then(|l| l.subnet)
                == Some("10.244.30.0/24".parse().unwrap())
        })
        .await?;
    assert_eq!(
        s.leases["node/n3"].attrs.public_ip,
        Ipv4Addr::new(192, 168, 1, 33)
    );

    // The unmanaged node becomes managed.
    env.server.modify_node("n2", |n| {
        set_annotation(n, "kube-subnet-manager", Some("true"));
        set_annotation(n, "public-ip", Some("192.168.1.12"));
    });
    let s = w
        .until("n2 managed", has_ids(&["node/n1", "node/n2", "node/n3"]))
        .await?;
    assert_eq!(s.leases["node/n2"].attrs.backend_type, "");
    assert_eq!(s.leases["node/n2"].attrs.backend_data, None);

    // Delete.
    env.server.delete_node("n3");
    w.until("n3 deleted", has_ids(&["node/n1", "node/n2"]))
        .await?;

    // Marker removed.
    env.server
        .modify_node("n1", |n| set_annotation(n, "kube-subnet-manager", None));
    w.until("n1 unmarked", has_ids(&["node/n2"])).await?;
    // Marker set to something other than "true".
    env.server.modify_node("n2", |n| {
        set_annotation(n, "kube-subnet-manager", Some("false"))
    });
    w.until("n2 unmarked", has_ids(&[])).await?;

    // Own node changes never show up.
    env.server.modify_node("n0", |n| {
        set_annotation(n, "public-ip", Some("192.168.1.99"))
    });
    env.server
        .apply_node(managed("n4", &["10.244.4.0/24"], "192.168.1.14", 4));
    w.until("n4 added", has_ids(&["node/n4"])).await?;

    // Exactly one initial list and one long-lived watch: nothing relisted.
    assert_eq!(env.requests(RecordedRequest::is_node_list).len(), 1);
    assert_eq!(env.requests(RecordedRequest::is_node_watch).len(), 1);
    let first_watch = &env.requests(RecordedRequest::is_node_watch)[0];
    assert_eq!(
        first_watch
            .query
            .get("allowWatchBookmarks")
            .map(String::as_str),
        Some("true")
    );
    w.stop().await
}

#[tokio::test]
async fn snapshot_is_unsynced_until_the_first_listing() -> Result<()> {
    let env = Env::new(vec![]).await?;
    let w = Watch::start(env.manager("n0")?);
    // Empty cluster: the first publication is an empty but synced set.
    let mut w = w;
    let s = w.until("synced", |s| s.synced).await?;
    assert!(s.leases.is_empty());
    assert_eq!(s.generation, 1);
    let first = w.seen.lock().unwrap()[0].clone();
    assert!(first.synced, "no unsynced snapshot was published");
    w.stop().await
}

#[tokio::test]
async fn closed_watch_resumes_from_last_version_without_relist() -> Result<()> {
    let env = Env::new(vec![managed("n1", &["10.244.1.0/24"], "192.168.1.11", 1)]).await?;
    let mut w = Watch::start(env.manager("n0")?);
    w.until("n1", has_ids(&["node/n1"])).await?;
    let seen_rv = env
        .server
        .apply_node(managed("n2", &["10.244.2.0/24"], "192.168.1.12", 2));
    w.until("n2", has_ids(&["node/n1", "node/n2"])).await?;
    env.server.wait_for_open_watches(1).await?;

    // The server ends the watch; changes happen before the client is back.
    env.server.pause_watches();
    env.server
        .wait_for_requests("second watch", |r| {
            r.iter().filter(|r| r.is_node_watch()).count() == 2
        })
        .await?;
    env.server
        .apply_node(managed("n3", &["10.244.3.0/24"], "192.168.1.13", 3));
    env.server.modify_node("n1", |n| {
        set_annotation(n, "public-ip", Some("192.168.1.111"))
    });
    env.server.delete_node("n2");
    env.server.resume_watches();

    let s = w
        .until("changes made while disconnected", |s| {
            ids(s) == ["node/n1", "node/n3"]
                && s.leases["node/n1"].attrs.public_ip == Ipv4Addr::new(192, 168, 1, 111)
        })
        .await?;
    assert_eq!(
        s.leases["node/n3"],
        expected_lease("10.244.3.0/24", [192, 168, 1, 13], 3)
    );

    // Resumed exactly after the last event seen: no event replayed twice, none skipped,
    // and no relist.
    let watches = env.requests(RecordedRequest::is_node_watch);
    assert_eq!(
        watches[1].query.get("resourceVersion"),
        Some(&seen_rv.to_string())
    );
    assert_eq!(env.requests(RecordedRequest::is_node_list).len(), 1);
    w.stop().await
}

async fn gone_relists(mode: GoneMode) -> Result<()> {
    let env = Env::new(vec![
        managed("n1", &["10.244.1.0/24"], "192.168.1.11", 1),
        managed("n2", &["10.244.2.0/24"], "192.168.1.12", 2),
        managed("n3", &["10.244.3.0/24"], "192.168.1.13", 3),
    ])
    .await?;
    env.server.set_gone_mode(mode);
    let mut w = Watch::start(env.manager("n0")?);
    w.until("initial", has_ids(&["node/n1", "node/n2", "node/n3"]))
        .await?;
    env.server.wait_for_open_watches(1).await?;

    env.server.pause_watches();
    env.server
        .wait_for_requests("second watch", |r| {
            r.iter().filter(|r| r.is_node_watch()).count() == 2
        })
        .await?;
    env.server.delete_node("n2");
    env.server.modify_node("n3", |n| {
        n["spec"]["podCIDR"] = json!("10.244.33.0/24");
        n["spec"]["podCIDRs"] = json!(["10.244.33.0/24"]);
    });
    env.server
        .apply_node(managed("n4", &["10.244.4.0/24"], "192.168.1.14", 4));
    // The history of those changes is gone: the client must relist.
    env.server.compact();
    env.server.resume_watches();

    let s = w
        .until("state after relist", |s| {
            ids(s) == ["node/n1", "node/n3", "node/n4"]
                && s.leases["node/n3"].subnet == Some("10.244.33.0/24".parse().unwrap())
        })
        .await?;
    assert_eq!(
        s.leases["node/n1"],
        expected_lease("10.244.1.0/24", [192, 168, 1, 11], 1)
    );
    assert_eq!(
        s.leases["node/n4"],
        expected_lease("10.244.4.0/24", [192, 168, 1, 14], 4)
    );
    assert_eq!(
        env.requests(RecordedRequest::is_node_list).len(),
        2,
        "relisted once"
    );

    // Live changes keep flowing after the relist.
    env.server.delete_node("n4");
    w.until("n4 deleted", has_ids(&["node/n1", "node/n3"]))
        .await?;

    // The relist never showed the consumer a partial set: n1 was in every synced snapshot.
    for s in w.seen.lock().unwrap().iter() {
        assert!(s.synced && s.leases.contains_key("node/n1"), "{s:#?}");
    }
    w.stop().await
}

#[tokio::test]
async fn gone_error_event_relists() -> Result<()> {
    gone_relists(GoneMode::ErrorEvent).await
}

#[tokio::test]
async fn gone_http_status_relists() -> Result<()> {
    gone_relists(GoneMode::HttpStatus).await
}

#[tokio::test]
async fn bookmarks_advance_the_resume_version() -> Result<()> {
    let env = Env::new(vec![managed("n1", &["10.244.1.0/24"], "192.168.1.11", 1)]).await?;
    let mut w = Watch::start(env.manager("n0")?);
    w.until("n1", has_ids(&["node/n1"])).await?;
    env.server.wait_for_open_watches(1).await?;

    // Other writes advance the version without Node events; a bookmark tells the client.
    env.server.add_pod("default", "p1", None);
    env.server.add_pod("default", "p2", None);
    let bookmark = env.server.send_bookmark();
    env.server.close_watches();
    env.server
        .wait_for_requests("second watch", |r| {
            r.iter().filter(|r| r.is_node_watch()).count() == 2
        })
        .await?;
    let watches = env.requests(RecordedRequest::is_node_watch);
    assert_eq!(
        watches[1].query.get("resourceVersion"),
        Some(&bookmark.to_string())
    );
    assert!(bookmark > watches[0].query["resourceVersion"].parse::<u64>()?);

    env.server
        .apply_node(managed("n2", &["10.244.2.0/24"], "192.168.1.12", 2));
    w.until("n2 after resume", has_ids(&["node/n1", "node/n2"]))
        .await?;
    assert_eq!(env.requests(RecordedRequest::is_node_list).len(), 1);
    w.stop().await
}

/// The fake API server pages a list as the real one does: `limit` Nodes at a time in name
/// order, each page but the last with a continue token and the count left, all with the
/// first page's resourceVersion; `resourceVersion=0` (its cache) whole; a continue token from
/// before a compaction 410 Gone.
#[tokio::test]
async fn the_fake_api_server_pages_lists() -> Result<()> {
    use k8s_openapi::api::core::v1::Node;
    use kube::api::{Api, ListParams};
    let names = ["a", "b", "c", "d", "e"];
    let env = Env::new(
        names
            .iter()
            .enumerate()
            .map(|(i, name)| managed(name, &[&format!("10.244.{i}.0/24")], "192.168.1.1", 1))
            .collect(),
    )
    .await?;
    let api: Api<Node> = Api::all(env.server.client()?);
    let rv = env.server.resource_version().to_string();
    let mut params = ListParams::default().limit(2);
    let mut pages = Vec::new();
    loop {
        let page = api.list(&params).await?;
        assert_eq!(page.metadata.resource_version.as_deref(), Some(rv.as_str()));
        let listed: Vec<String> = page
            .items
            .iter()
            .filter_map(|n| n.metadata.name.clone())
            .collect();
        let left = page.metadata.remaining_item_count;
        pages.push((listed, left));
        match page.metadata.continue_ {
            Some(token) if !token.is_empty() => params = params.continue_token(&token),
            _ => break,
        }
    }
    let want = |names: &[&str], left: Option<i64>| {
        (
            names.iter().map(|n| (*n).to_owned()).collect::<Vec<_>>(),
            left,
        )
    };
    assert_eq!(
        pages,
        [
            want(&["a", "b"], Some(3)),
            want(&["c", "d"], Some(1)),
            want(&["e"], None)
        ]
    );
    let cached = api.list(&ListParams::default().match_any()).await?;
    assert_eq!(cached.items.len(), 5, "resourceVersion=0 is served whole");
    let asked = env.requests(RecordedRequest::is_node_list);
    assert_eq!(
        asked.last().and_then(|r| r.query.get("resourceVersion")),
        Some(&"0".to_owned())
    );
    // A token from before a compaction.
    let first = api.list(&ListParams::default().limit(2)).await?;
    let token = first.metadata.continue_.context("a continue token")?;
    env.server
        .apply_node(managed("f", &["10.244.9.0/24"], "192.168.1.1", 1));
    env.server.compact();
    match api
        .list(&ListParams::default().limit(2).continue_token(&token))
        .await
    {
        Err(kube::Error::Api(status)) => assert_eq!(status.code, 410),
        other => bail!("a compacted continue token got {other:?}"),
    }
    Ok(())
}

/// 1,201 Nodes, each with its own /24 under `10.0.0.0/8`, and the config for it.
async fn large_cluster() -> Result<Env> {
    let nodes: Vec<Value> = (0..1201u32)
        .map(|i| {
            managed(
                &format!("n{i:04}"),
                &[&format!("10.{}.{}.0/24", 1 + i / 256, i % 256)],
                "192.168.1.11",
                1,
            )
        })
        .collect();
    let env = Env::new(nodes).await?;
    env.set_conf(r#"{"Network": "10.0.0.0/8", "Backend": {"Type": "vxlan"}}"#)?;
    Ok(env)
}

/// Waits for the first complete set of [`large_cluster`], checks it, and that no snapshot
/// published complete held part of it.
async fn all_of_the_large_cluster(w: &mut Watch) -> Result<()> {
    let s = w.until("synced", |s| s.synced).await?;
    assert_eq!(s.leases.len(), 1201);
    assert_eq!(
        s.leases["node/n1200"].subnet,
        Some("10.5.176.0/24".parse()?)
    );
    assert!(
        w.seen
            .lock()
            .unwrap()
            .iter()
            .all(|s| !s.synced || s.leases.len() >= 1201)
    );
    Ok(())
}

/// What a Node list request asked for.
#[derive(Debug, Clone, PartialEq)]
struct ListQuery {
    /// `limit`.
    limit: Option<&'static str>,
    /// A `continue` token given.
    continued: bool,
    /// `resourceVersion`.
    rv: Option<&'static str>,
    /// `sendInitialEvents=true`.
    streaming: bool,
}

/// A streaming list from the API server's cache.
const STREAMING: ListQuery = ListQuery {
    limit: None,
    continued: false,
    rv: Some("0"),
    streaming: true,
};
/// The first page of a consistent read.
const FIRST_PAGE: ListQuery = ListQuery {
    limit: Some("500"),
    continued: false,
    rv: None,
    streaming: false,
};
/// A further page.
const NEXT_PAGE: ListQuery = ListQuery {
    limit: Some("500"),
    continued: true,
    rv: None,
    streaming: false,
};

/// Each Node list request, as one of [`STREAMING`], [`FIRST_PAGE`] or [`NEXT_PAGE`] where it
/// is one.
fn list_queries(env: &Env) -> Vec<ListQuery> {
    let known = |value: Option<&String>| -> Option<&'static str> {
        match value.map(String::as_str) {
            Some("0") => Some("0"),
            Some("500") => Some("500"),
            Some(_) => Some("other"),
            None => None,
        }
    };
    env.requests(RecordedRequest::is_node_list)
        .iter()
        .map(|r| ListQuery {
            limit: known(r.query.get("limit")),
            continued: r.query.contains_key("continue"),
            rv: known(r.query.get("resourceVersion")),
            streaming: r.is_streaming_list(),
        })
        .collect()
}

/// A cluster of 1,201 Nodes from an API server that streams lists (`WatchList`, on by
/// default in Kubernetes 1.34): one streaming list (from its cache, `resourceVersion=0`,
/// `sendInitialEvents=true`), no plain list, every node in the first complete set, and the
/// same watch then carries live changes.
#[tokio::test]
async fn a_large_cluster_arrives_in_one_streaming_list() -> Result<()> {
    let env = large_cluster().await?;
    let mut w = Watch::start(env.manager("n9999")?);
    all_of_the_large_cluster(&mut w).await?;
    assert_eq!(list_queries(&env), [STREAMING]);
    let lists = env.requests(RecordedRequest::is_node_list);
    assert_eq!(
        lists[0]
            .query
            .get("resourceVersionMatch")
            .map(String::as_str),
        Some("NotOlderThan")
    );
    env.server
        .apply_node(managed("n9000", &["10.9.0.0/24"], "192.168.1.12", 2));
    w.until("a node added", |s| s.leases.contains_key("node/n9000"))
        .await?;
    assert_eq!(env.requests(RecordedRequest::is_node_watch).len(), 1);
    w.stop().await
}

/// The same cluster from an API server that refuses streaming lists (422, as 1.33 does by
/// default): the agent lists it in three pages of 500 instead, each a consistent read
/// continuing the last (never `resourceVersion=0`, which the real API server answers whole
/// from its cache, 70 MB at 5,000 realistic Nodes), and keeps to pages when it lists again
/// after a compaction, without asking for a streaming list a second time.
#[tokio::test]
async fn an_api_server_without_streaming_lists_is_listed_in_pages() -> Result<()> {
    let env = large_cluster().await?;
    env.server.set_watch_list(false);
    let mut w = Watch::start(env.manager("n9999")?);
    all_of_the_large_cluster(&mut w).await?;
    assert_eq!(
        list_queries(&env),
        [STREAMING, FIRST_PAGE, NEXT_PAGE, NEXT_PAGE]
    );
    // Its history compacted while the watch is away: listed again, in pages.
    env.server.wait_for_open_watches(1).await?;
    env.server.pause_watches();
    env.server.delete_node("n0000");
    env.server.compact();
    env.server.resume_watches();
    w.until("n0000 gone", |s| {
        s.synced && s.leases.len() == 1200 && !s.leases.contains_key("node/n0000")
    })
    .await?;
    assert_eq!(
        list_queries(&env),
        [
            STREAMING, FIRST_PAGE, NEXT_PAGE, NEXT_PAGE, FIRST_PAGE, NEXT_PAGE, NEXT_PAGE
        ]
    );
    w.stop().await
}

#[tokio::test]
async fn malformed_nodes_are_skipped_alone() -> Result<()> {
    let mut bad_json = managed("bad-json", &["10.244.5.0/24"], "192.168.1.15", 5);
    set_annotation(
        &mut bad_json,
        "backend-data",
        Some(r#"{"VNI":1,"VtepMAC":"#),
    );
    let mut bad_ip = managed("bad-ip", &["10.244.6.0/24"], "192.168.1.16", 6);
    set_annotation(&mut bad_ip, "public-ip", Some("192.168.1"));
    let three = managed(
        "three-cidrs",
        &["10.244.7.0/24", "fd00::/64", "10.244.8.0/24"],
        "192.168.1.17",
        7,
    );
    let env = Env::new(vec![
        managed("n1", &["10.244.1.0/24"], "192.168.1.11", 1),
        bad_json,
        bad_ip,
        three,
    ])
    .await?;
    let mut w = Watch::start(env.manager("n0")?);
    let s = w.until("synced", |s| s.synced).await?;
    assert_eq!(ids(&s), ["node/n1"]);

    // Other nodes keep working while the bad ones stay bad.
    env.server
        .apply_node(managed("n2", &["10.244.2.0/24"], "192.168.1.12", 2));
    w.until("n2", has_ids(&["node/n1", "node/n2"])).await?;

    // A malformed node that gets fixed appears; one that breaks disappears.
    env.server.modify_node("bad-ip", |n| {
        set_annotation(n, "public-ip", Some("192.168.1.16"))
    });
    w.until(
        "bad-ip fixed",
        has_ids(&["node/bad-ip", "node/n1", "node/n2"]),
    )
    .await?;
    env.server.modify_node("n2", |n| {
        set_annotation(n, "backend-data", Some("not json"));
    });
    w.until("n2 broken", has_ids(&["node/bad-ip", "node/n1"]))
        .await?;
    w.stop().await
}

// ---------------------------------------------------------------------------------------
// acquire_lease / complete_lease

fn vxlan_attrs(ip: [u8; 4]) -> LeaseAttrs {
    LeaseAttrs {
        public_ip: Ipv4Addr::from(ip),
        public_ipv6: None,
        backend_type: "vxlan".into(),
        backend_data: Some(RawJson::from_json(&mac_data(0xee)).unwrap()),
        backend_v6_data: None,
    }
}

fn own_node(cidrs: &[&str], extra: &[(&str, &str)]) -> Value {
    let mut ann = vec![("node.alpha.kubernetes.io/ttl", "0")];
    ann.extend_from_slice(extra);
    node("n0", cidrs, &ann)
}

#[tokio::test]
async fn acquire_patches_status_with_exact_bytes_once() -> Result<()> {
    let env = Env::new(vec![own_node(&["10.244.0.0/24"], &[])]).await?;
    let mgr = env.manager("n0")?;
    let lease = mgr.acquire_lease(&vxlan_attrs([192, 168, 1, 10])).await?;

    assert_eq!(lease.subnet, Some("10.244.0.0/24".parse()?));
    assert_eq!(lease.ipv6_subnet, None);
    assert_eq!(lease.attrs, vxlan_attrs([192, 168, 1, 10]));
    let ttl = lease
        .expiration
        .context("expiry")?
        .duration_since(SystemTime::now())?;
    assert!(ttl > Duration::from_secs(23 * 3600) && ttl <= Duration::from_secs(24 * 3600));

    let patches = env.server.patches();
    assert_eq!(patches.len(), 1);
    let p = &patches[0];
    assert_eq!(p.path, "/api/v1/nodes/n0/status");
    assert!(p.query.is_empty(), "{:?}", p.query);
    assert_eq!(
        p.content_type.as_deref(),
        Some("application/strategic-merge-patch+json")
    );
    assert_eq!(
        p.body_text(),
        concat!(
            r#"{"metadata":{"annotations":{"#,
            r#""flannel.alpha.coreos.com/backend-data":"{\"VNI\":1,\"VtepMAC\":\"96:59:b2:3f:04:ee\"}","#,
            r#""flannel.alpha.coreos.com/backend-type":"vxlan","#,
            r#""flannel.alpha.coreos.com/kube-subnet-manager":"true","#,
            r#""flannel.alpha.coreos.com/public-ip":"192.168.1.10"}}}"#
        )
    );
    // Applied on the server; unrelated annotations kept.
    let stored = env.server.node("n0").context("n0")?;
    assert_eq!(
        stored["metadata"]["annotations"]["node.alpha.kubernetes.io/ttl"],
        "0"
    );
    assert_eq!(
        stored["metadata"]["annotations"][key("public-ip")],
        "192.168.1.10"
    );

    // A restart with the same attributes patches nothing.
    let again = env.manager("n0")?;
    again.wait_for_cache(Duration::from_secs(5)).await?;
    again.acquire_lease(&vxlan_attrs([192, 168, 1, 10])).await?;
    assert_eq!(env.server.patches().len(), 1);

    // A new public IP patches only that annotation.
    let third = env.manager("n0")?;
    third.acquire_lease(&vxlan_attrs([192, 168, 1, 20])).await?;
    let patches = env.server.patches();
    assert_eq!(patches.len(), 2);
    assert_eq!(
        patches[1].body_text(),
        r#"{"metadata":{"annotations":{"flannel.alpha.coreos.com/public-ip":"192.168.1.20"}}}"#
    );
    Ok(())
}

#[tokio::test]
async fn public_ip_overwrite_is_published() -> Result<()> {
    let env = Env::new(vec![
        own_node(
            &["10.244.0.0/24"],
            &[(&key("public-ip-overwrite"), "203.0.113.5")],
        ),
        managed("n1", &["10.244.1.0/24"], "192.168.1.11", 1),
    ])
    .await?;
    let lease = env
        .manager("n0")?
        .acquire_lease(&vxlan_attrs([192, 168, 1, 10]))
        .await?;
    // The returned lease keeps the detected address, as upstream's does.
    assert_eq!(lease.attrs.public_ip, Ipv4Addr::new(192, 168, 1, 10));
    let patches = env.server.patches();
    assert_eq!(patches.len(), 1);
    assert!(
        patches[0]
            .body_text()
            .contains(r#""flannel.alpha.coreos.com/public-ip":"203.0.113.5""#),
        "{}",
        patches[0].body_text()
    );
    // What the other nodes see.
    let mut w = Watch::start(env.manager("n1")?);
    let s = w.until("n0 seen from n1", has_ids(&["node/n0"])).await?;
    assert_eq!(
        s.leases["node/n0"].attrs.public_ip,
        Ipv4Addr::new(203, 0, 113, 5)
    );
    w.stop().await
}

#[tokio::test]
async fn dual_stack_acquire_and_ipv4_only_backends() -> Result<()> {
    let env = Env::new(vec![own_node(&["10.244.0.0/24", "fd00:10:244::/64"], &[])]).await?;
    env.set_conf(DUAL_CONF)?;
    let attrs = LeaseAttrs {
        public_ip: Ipv4Addr::new(192, 168, 1, 10),
        public_ipv6: Some("2001:db8::10".parse()?),
        backend_type: "vxlan".into(),
        backend_data: Some(RawJson::from_json(&mac_data(0xee))?),
        backend_v6_data: Some(RawJson::from_json(&mac_data(0xef))?),
    };
    let lease = env.manager("n0")?.acquire_lease(&attrs).await?;
    assert_eq!(lease.subnet, Some("10.244.0.0/24".parse()?));
    assert_eq!(lease.ipv6_subnet, Some("fd00:10:244::/64".parse()?));
    let body = env.server.patches()[0].body_text();
    let patch: Value = serde_json::from_str(&body)?;
    let ann = &patch["metadata"]["annotations"];
    assert_eq!(ann[key("public-ipv6")], "2001:db8::10");
    assert_eq!(ann[key("backend-v6-data")], mac_data(0xef));

    // ipip carries no IPv6: the lease is IPv4-only.
    let ipip = LeaseAttrs {
        backend_type: "ipip".into(),
        backend_data: None,
        backend_v6_data: None,
        ..attrs
    };
    let lease = env.manager("n0")?.acquire_lease(&ipip).await?;
    assert_eq!(lease.ipv6_subnet, None);
    assert_eq!(lease.subnet, Some("10.244.0.0/24".parse()?));
    Ok(())
}

#[tokio::test]
async fn acquire_errors_follow_upstream() -> Result<()> {
    let env = Env::new(vec![
        own_node(&[], &[]),
        node("outside", &["192.168.0.0/24"], &[]),
        node("wide", &["10.244.0.0/15"], &[]),
        node("v6out", &["10.244.9.0/24", "fe02::/64"], &[]),
    ])
    .await?;
    let attrs = vxlan_attrs([192, 168, 1, 10]);

    // Upstream exits with `node "n0" pod cidr not assigned`; the agent waits for it.
    let mgr = Arc::new(env.manager("n0")?);
    let mut waiting = tokio::spawn({
        let (mgr, attrs) = (mgr.clone(), attrs.clone());
        async move { mgr.acquire_lease(&attrs).await }
    });
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert!(!waiting.is_finished(), "{:?}", (&mut waiting).await);
    assert!(env.server.patches().is_empty());
    env.server
        .modify_node("n0", |n| {
            n["spec"] = json!({"podCIDR": "10.244.3.0/24", "podCIDRs": ["10.244.3.0/24"]});
        })
        .context("n0")?;
    let lease = tokio::time::timeout(Duration::from_secs(10), waiting).await???;
    assert_eq!(lease.subnet, Some("10.244.3.0/24".parse()?));

    let e = env
        .manager("outside")?
        .acquire_lease(&attrs)
        .await
        .unwrap_err();
    assert_eq!(
        e.to_string(),
        r#"subnet "10.244.0.0/16" specified in the flannel net config doesn't contain "192.168.0.0/24" PodCIDR of the "outside" node"#
    );
    let e = env
        .manager("wide")?
        .acquire_lease(&attrs)
        .await
        .unwrap_err();
    assert_eq!(
        e.to_string(),
        r#"subnet "10.244.0.0/16" specified in the flannel net config doesn't contain "10.244.0.0/15" PodCIDR of the "wide" node"#
    );
    env.set_conf(DUAL_CONF)?;
    let e = env
        .manager("v6out")?
        .acquire_lease(&attrs)
        .await
        .unwrap_err();
    assert_eq!(
        e.to_string(),
        r#"subnet "fd00:10:244::/56" specified in the flannel net config doesn't contain "fe02::/64" IPv6 PodCIDR of the "v6out" node"#
    );
    // Nodes that fail the checks are not annotated (n0, which passed them, is).
    let patched: Vec<String> = env
        .server
        .patches()
        .iter()
        .map(|p| p.path.clone())
        .collect();
    assert_eq!(patched, ["/api/v1/nodes/n0/status"]);

    // A node that never shows up.
    let e = env
        .manager("ghost")?
        .acquire_lease(&attrs)
        .await
        .unwrap_err();
    assert_eq!(
        e.to_string(),
        r#"timeout contacting kube-api, failed to patch node "ghost". Error: context deadline exceeded"#
    );
    Ok(())
}

#[tokio::test]
async fn status_patch_is_retried_then_times_out() -> Result<()> {
    let env = Env::new(vec![own_node(&["10.244.0.0/24"], &[])]).await?;
    env.server.fail_status_patches(&[500, 503]);
    env.manager("n0")?
        .acquire_lease(&vxlan_attrs([192, 168, 1, 10]))
        .await?;
    let patches = env.server.patches();
    assert_eq!(patches.len(), 3);
    assert!(patches.iter().all(|p| p.body == patches[0].body));
    assert_eq!(
        env.server.node("n0").context("n0")?["metadata"]["annotations"][key("backend-type")],
        "vxlan"
    );

    env.server.fail_status_patches(&[500; 100]);
    let e = env
        .manager("n0")?
        .acquire_lease(&vxlan_attrs([192, 168, 1, 11]))
        .await
        .unwrap_err();
    let text = e.to_string();
    assert!(
        text.starts_with(
            r#"timeout contacting kube-api, failed to patch node "n0". Error: context deadline exceeded (last error: "#
        ),
        "{text}"
    );
    Ok(())
}

#[tokio::test]
async fn alloc_backend_reads_the_node_directly() -> Result<()> {
    let env = Env::new(vec![own_node(&["10.244.0.0/24"], &[])]).await?;
    env.set_conf(r#"{"Network": "10.244.0.0/16", "Backend": {"Type": "alloc"}}"#)?;
    let attrs = LeaseAttrs {
        public_ip: Ipv4Addr::new(192, 168, 1, 10),
        ..LeaseAttrs::default()
    };
    let lease = env.manager("n0")?.acquire_lease(&attrs).await?;
    assert_eq!(lease.subnet, Some("10.244.0.0/24".parse()?));
    let gets = env.requests(|r| r.method == "GET");
    assert_eq!(gets.len(), 1, "{gets:#?}");
    assert_eq!(gets[0].path, "/api/v1/nodes/n0");
    assert_eq!(
        gets[0].query.get("resourceVersion").map(String::as_str),
        Some("0")
    );
    Ok(())
}

#[tokio::test]
async fn complete_lease_sets_network_unavailable_false() -> Result<()> {
    let env = Env::new(vec![own_node(&["10.244.0.0/24"], &[])]).await?;
    let before = SystemTime::now();
    env.manager("n0")?.complete_lease().await?;
    let patches = env.server.patches();
    assert_eq!(patches.len(), 1);
    let p = &patches[0];
    assert_eq!(p.path, "/api/v1/nodes/n0/status");
    assert_eq!(
        p.content_type.as_deref(),
        Some("application/strategic-merge-patch+json")
    );
    // Byte for byte, times aside (both the same RFC 3339 second, UTC).
    let body = p.body_text();
    let v: Value = serde_json::from_str(&body)?;
    let t = v["status"]["conditions"][0]["lastHeartbeatTime"]
        .as_str()
        .context("time")?
        .to_owned();
    assert_eq!(
        v["status"]["conditions"][0]["lastTransitionTime"],
        t.as_str()
    );
    assert_eq!(
        body.replace(&t, "T"),
        r#"{"status":{"conditions":[{"type":"NetworkUnavailable","status":"False","lastHeartbeatTime":"T","lastTransitionTime":"T","reason":"FlannelIsUp","message":"Flannel is running on this node"}]}}"#
    );
    let ts: k8s_openapi::jiff::Timestamp = t.parse()?;
    assert!(t.ends_with('Z') && !t.contains('.'), "{t}");
    let secs = before.duration_since(SystemTime::UNIX_EPOCH)?.as_secs() as i64;
    assert!((ts.as_second() - secs).abs() <= 2);

    // Merged by type: Ready stays.
    let conds = env.server.node("n0").context("n0")?["status"]["conditions"].clone();
    let types: Vec<&str> = conds
        .as_array()
        .context("conditions")?
        .iter()
        .filter_map(|c| c["type"].as_str())
        .collect();
    assert_eq!(types, ["Ready", "NetworkUnavailable"]);

    // Disabled: nothing is sent.
    env.manager("n0")?
        .with_set_node_network_unavailable(false)
        .complete_lease()
        .await?;
    assert_eq!(env.server.patches().len(), 1);
    Ok(())
}

/// The patches the server has taken, once there are `n` (10 s at most).
async fn patches_once(env: &Env, n: usize) -> Result<Vec<RecordedRequest>> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let patches = env.server.patches();
        if patches.len() >= n {
            return Ok(patches);
        }
        if tokio::time::Instant::now() > deadline {
            bail!("{} patches, not {n}: {patches:#?}", patches.len());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Upstream writes its Node's annotations once; the agent keeps them
/// (`keep_own_node`): a removed or changed annotation is written back (that one alone), a
/// deleted Node gets nothing while it is gone and every annotation plus
/// `NetworkUnavailable=False` once it is registered again, and a Node registered again with
/// another pod CIDR ends the agent with an error that says why.
#[tokio::test]
async fn the_own_node_keeps_its_annotations() -> Result<()> {
    let env = Env::new(vec![own_node(&["10.244.0.0/24"], &[])]).await?;
    let mgr = Arc::new(env.manager("n0")?);
    let lease = mgr.acquire_lease(&vxlan_attrs([192, 168, 1, 10])).await?;
    mgr.complete_lease().await?;
    let published = env.server.patches()[0].body_text();
    let cancel = CancellationToken::new();
    let _stop = cancel.clone().drop_guard();
    let mut keep = {
        let mgr = mgr.clone();
        tokio::spawn(async move { mgr.keep_own_node(&lease, cancel).await })
    };
    let env = &env;
    let quiet = |n: usize| async move {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let patches = env.server.patches();
        ensure!(patches.len() == n, "{patches:#?}");
        Ok::<_, anyhow::Error>(())
    };
    quiet(2).await?;

    // One annotation removed, then one changed: each is written back alone.
    env.server
        .modify_node("n0", |n| set_annotation(n, "public-ip", None))
        .context("n0")?;
    let p = patches_once(env, 3).await?;
    assert_eq!(
        p[2].body_text(),
        r#"{"metadata":{"annotations":{"flannel.alpha.coreos.com/public-ip":"192.168.1.10"}}}"#
    );
    assert_eq!(p[2].path, "/api/v1/nodes/n0/status");
    env.server
        .modify_node("n0", |n| set_annotation(n, "backend-type", Some("host-gw")))
        .context("n0")?;
    let p = patches_once(env, 4).await?;
    assert_eq!(
        p[3].body_text(),
        r#"{"metadata":{"annotations":{"flannel.alpha.coreos.com/backend-type":"vxlan"}}}"#
    );
    quiet(4).await?;

    // Deleted: nothing while it is gone. Registered again, before the controller manager
    // gives it a pod CIDR: every annotation as at start, and the network available again.
    env.server.delete_node("n0").context("n0")?;
    quiet(4).await?;
    env.server.apply_node(own_node(&[], &[]));
    let p = patches_once(env, 6).await?;
    assert_eq!(p[4].body_text(), published);
    assert!(
        p[5].body_text()
            .contains(r#""type":"NetworkUnavailable","status":"False""#),
        "{}",
        p[5].body_text()
    );
    let stored = env.server.node("n0").context("n0")?;
    assert_eq!(
        stored["metadata"]["annotations"][key("public-ip")],
        "192.168.1.10"
    );
    // The same pod CIDR again: nothing more to do.
    env.server
        .modify_node("n0", |n| {
            n["spec"] = json!({"podCIDR": "10.244.0.0/24", "podCIDRs": ["10.244.0.0/24"]});
        })
        .context("n0")?;
    quiet(6).await?;
    ensure!(!keep.is_finished(), "keep_own_node ended early");

    // Registered again with another pod CIDR: the lease cannot be kept.
    env.server.delete_node("n0").context("n0")?;
    env.server.apply_node(own_node(&["10.244.5.0/24"], &[]));
    let ended = tokio::time::timeout(Duration::from_secs(10), &mut keep)
        .await
        .context("keep_own_node did not end")??;
    let e = ended.expect_err("a moved pod CIDR ends it");
    assert!(matches!(e, KubeError::PodCidrChanged { .. }), "{e:?}");
    assert_eq!(
        e.to_string(),
        "node \"n0\" now has pod CIDR 10.244.5.0/24, not 10.244.0.0/24 as leased (was the \
         Node deleted and registered again?); exiting so that the restart takes the new one: \
         pods with addresses in 10.244.0.0/24 must be re-created"
    );
    // Nothing written for a Node the agent no longer matches.
    assert_eq!(env.server.patches().len(), 6);
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Startup helpers

#[tokio::test]
async fn node_name_from_env_or_pod() -> Result<()> {
    let env = Env::new(vec![]).await?;
    env.server
        .add_pod("kube-flannel", "kube-flannel-ds-abcde", Some("worker-1"));
    env.server.add_pod("kube-flannel", "pending", None);
    let client = env.server.client()?;
    let src = |node: Option<&str>, pod: Option<&str>, ns: Option<&str>| NodeNameSource {
        node_name: node.map(str::to_owned),
        pod_name: pod.map(str::to_owned),
        pod_namespace: ns.map(str::to_owned),
    };

    let name = resolve_node_name(
        &client,
        &src(
            Some("from-env"),
            Some("kube-flannel-ds-abcde"),
            Some("kube-flannel"),
        ),
    )
    .await?;
    assert_eq!(name, "from-env");
    assert!(
        env.server.requests().is_empty(),
        "NODE_NAME needs no API call"
    );

    let name = resolve_node_name(
        &client,
        &src(
            Some(""),
            Some("kube-flannel-ds-abcde"),
            Some("kube-flannel"),
        ),
    )
    .await?;
    assert_eq!(name, "worker-1");
    let reqs = env.server.requests();
    assert_eq!(reqs.len(), 1);
    assert_eq!(
        reqs[0].path,
        "/api/v1/namespaces/kube-flannel/pods/kube-flannel-ds-abcde"
    );

    for s in [
        src(None, Some("p"), None),
        src(None, None, Some("ns")),
        src(None, Some(""), Some("ns")),
    ] {
        let e = resolve_node_name(&client, &s).await.unwrap_err();
        assert_eq!(
            e.to_string(),
            "env variables POD_NAME and POD_NAMESPACE must be set"
        );
    }
    let e = resolve_node_name(&client, &src(None, Some("pending"), Some("kube-flannel")))
        .await
        .unwrap_err();
    assert_eq!(
        e.to_string(),
        "node name not present in pod spec 'kube-flannel/pending'"
    );
    let e = resolve_node_name(&client, &src(None, Some("nope"), Some("kube-flannel")))
        .await
        .unwrap_err();
    assert!(
        e.to_string()
            .starts_with("error retrieving pod spec for 'kube-flannel/nope': "),
        "{e}"
    );
    Ok(())
}

#[tokio::test]
async fn client_from_url_and_kubeconfig() -> Result<()> {
    let env = Env::new(vec![own_node(&["10.244.0.0/24"], &[])]).await?;
    let get_n0 = |client: kube::Client| async move {
        let api: kube::Api<k8s_openapi::api::core::v1::Node> = kube::Api::all(client);
        api.get("n0").await.map(|n| n.metadata.name)
    };
    let by_url = build_client(Some(&env.server.url()), None).await?;
    assert_eq!(get_n0(by_url).await?, Some("n0".to_owned()));

    let kubeconfig = env.dir.path().join("kubeconfig");
    let write = |server: &str| {
        std::fs::write(
            &kubeconfig,
            format!(
                "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster:\n    server: {server}\n\
                 contexts:\n- name: x\n  context:\n    cluster: c\n    user: u\ncurrent-context: x\n\
                 users:\n- name: u\n  user:\n    token: abc\n"
            ),
        )
    };
    write(&env.server.url())?;
    let by_file = build_client(None, Some(&kubeconfig)).await?;
    assert_eq!(get_n0(by_file).await?, Some("n0".to_owned()));

    // --kube-api-url overrides the kubeconfig's server.
    write("http://127.0.0.1:1")?;
    let both = build_client(Some(&env.server.url()), Some(&kubeconfig)).await?;
    assert_eq!(get_n0(both).await?, Some("n0".to_owned()));

    let Err(e) = build_client(None, Some(&env.dir.path().join("missing"))).await else {
        bail!("a missing kubeconfig must fail");
    };
    assert!(
        e.to_string()
            .starts_with("fail to create kubernetes config: "),
        "{e}"
    );
    Ok(())
}

#[tokio::test]
async fn stored_public_ips_and_vtep_macs() -> Result<()> {
    let env = Env::new(vec![
        managed("n0", &["10.244.0.0/24"], "192.168.1.10", 0x42),
        node("fresh", &["10.244.1.0/24"], &[]),
        node(
            "pinned",
            &["10.244.2.0/24"],
            &[
                (&key("node-public-ip"), "198.51.100.7"),
                (&key("node-public-ipv6"), "2001:db8::7"),
                (&key("backend-v6-data"), &mac_data(0x43)),
            ],
        ),
        node(
            "broken",
            &["10.244.3.0/24"],
            &[(&key("node-public-ip"), "198.51")],
        ),
    ])
    .await?;
    assert_eq!(
        env.manager("n0")?.stored_vtep_mac(AddressFamily::V4).await,
        Some("96:59:b2:3f:04:42".parse::<MacAddr>()?)
    );
    assert_eq!(
        env.manager("n0")?.stored_vtep_mac(AddressFamily::V6).await,
        None
    );
    assert_eq!(
        env.manager("pinned")?
            .stored_vtep_mac(AddressFamily::V6)
            .await,
        Some("96:59:b2:3f:04:43".parse::<MacAddr>()?)
    );
    assert_eq!(
        env.manager("fresh")?
            .stored_vtep_mac(AddressFamily::V4)
            .await,
        None
    );

    assert_eq!(
        env.manager("n0")?.stored_public_ips().await?,
        StoredPublicIps::default()
    );
    assert_eq!(
        env.manager("pinned")?.stored_public_ips().await?,
        StoredPublicIps {
            ipv4: Some(Ipv4Addr::new(198, 51, 100, 7)),
            ipv6: Some("2001:db8::7".parse::<Ipv6Addr>()?),
        }
    );
    let e = env
        .manager("broken")?
        .stored_public_ips()
        .await
        .unwrap_err();
    assert_eq!(
        e.to_string(),
        "invalid flannel.alpha.coreos.com/node-public-ip annotation: invalid public IP address: 198.51"
    );
    // A node the API does not know: nothing stored (logged, as upstream).
    assert_eq!(
        env.manager("ghost")?.stored_public_ips().await?,
        StoredPublicIps::default()
    );
    Ok(())
}

#[tokio::test]
async fn network_config_errors() -> Result<()> {
    let env = Env::new(vec![]).await?;
    let cfg = env.manager("n0")?.network_config().await?;
    assert_eq!(cfg.network, Some("10.244.0.0/16".parse()?));
    assert_eq!(cfg.backend_type, "vxlan");

    env.set_conf("{\"Network\": 5")?;
    let e = env.manager("n0")?.network_config().await.unwrap_err();
    assert!(
        e.to_string().starts_with("error parsing subnet config: "),
        "{e}"
    );

    let missing = KubeSubnetManager::new(
        env.server.client()?,
        "n0",
        PREFIX,
        env.dir.path().join("nope.json"),
    )?;
    let e = missing.network_config().await.unwrap_err();
    assert!(
        e.to_string().starts_with("failed to read net conf: "),
        "{e}"
    );
    assert!(e.to_string().contains("nope.json"), "{e}");
    Ok(())
}

#[tokio::test]
async fn annotation_prefix_vectors_and_custom_prefix() -> Result<()> {
    let vectors = [
        (
            "flannel.alpha.coreos.com",
            "flannel.alpha.coreos.com/backend-type",
        ),
        (
            "flannel.alpha.coreos.com/",
            "flannel.alpha.coreos.com/backend-type",
        ),
        (
            "flannel.alpha.coreos.com/prefix",
            "flannel.alpha.coreos.com/prefix-backend-type",
        ),
        (
            "flannel.alpha.coreos.com/prefix-",
            "flannel.alpha.coreos.com/prefix-backend-type",
        ),
        ("org.com", "org.com/backend-type"),
        ("org9.com", "org9.com/backend-type"),
        ("org.com/9", "org.com/9-backend-type"),
    ];
    for (prefix, want) in vectors {
        assert_eq!(AnnotationKeys::new(prefix)?.backend_type, want);
    }
    for bad in ["org", "org/", "org/prefix", "org.COM", "org.com/PREFIX"] {
        assert_eq!(
            AnnotationKeys::new(bad).unwrap_err().to_string(),
            "subnet/kube: prefix must be in a format: fqdn/[0-9a-z-_]*"
        );
    }
    assert_eq!(
        AnnotationKeys::new("a.b/c/d").unwrap_err().to_string(),
        "subnet/kube: prefix can contain at most single slash"
    );
    let env = Env::new(vec![]).await?;
    assert!(KubeSubnetManager::new(env.server.client()?, "n0", "org", env.conf_path()).is_err());

    // A custom prefix end to end: written and read with the same keys.
    env.server.apply_node(own_node(&["10.244.0.0/24"], &[]));
    env.server.apply_node(node(
        "n1",
        &["10.244.1.0/24"],
        &[
            ("example.com/net-kube-subnet-manager", "true"),
            ("example.com/net-public-ip", "192.168.1.11"),
        ],
    ));
    let mgr = KubeSubnetManager::new(
        env.server.client()?,
        "n0",
        "example.com/net",
        env.conf_path(),
    )?
    .with_timings(fast());
    mgr.acquire_lease(&vxlan_attrs([192, 168, 1, 10])).await?;
    let patch: Value = serde_json::from_str(&env.server.patches()[0].body_text())?;
    let keys: BTreeMap<String, Value> =
        serde_json::from_value(patch["metadata"]["annotations"].clone())?;
    assert!(
        keys.keys().all(|k| k.starts_with("example.com/net-")),
        "{keys:?}"
    );
    let mut w = Watch::start(mgr);
    w.until("n1 with custom prefix", has_ids(&["node/n1"]))
        .await?;
    w.stop().await
}
