//! A fake Kubernetes API server for the kube subnet manager tests: real HTTP on 127.0.0.1,
//! so the production client stack (`kube::Config` → `kube::Client` → hyper) is exercised
//! end to end, only the server is fake.
//!
//! It is stateful rather than scripted: Nodes (and Pods) live in a map, every Node change
//! gets the next resourceVersion and goes into an event log, and watches replay the log
//! from the requested resourceVersion before following live changes. That is what the
//! watch scenarios need (resume after a closed watch, 410 Gone after compaction, bookmarks);
//! exact-request assertions are made on the recorded requests instead ([`RecordedRequest`]:
//! method, path, query, content type and the raw body).
//!
//! Served:
//! * `GET /api/v1/nodes` — list (`metadata.resourceVersion` set; in pages with `limit` and
//!   `continue`, except for `resourceVersion=0`, as the real one); with `watch=true` and
//!   `sendInitialEvents=true` a streaming list (every Node as `ADDED`, then a `BOOKMARK`
//!   marked `k8s.io/initial-events-end`, then live changes; 422 Invalid when turned off
//!   with [`MockApiServer::set_watch_list`]); or, with `watch=true`, a
//!   chunked stream of `ADDED`/`MODIFIED`/`DELETED` events (plus `BOOKMARK`s when
//!   `allowWatchBookmarks=true`). A watch from a compacted resourceVersion gets 410 Gone,
//!   as an `ERROR` event (what the real apiserver sends) or as the HTTP status
//!   ([`GoneMode`]).
//! * `GET /api/v1/nodes/<name>`, `GET /api/v1/namespaces/<ns>/pods/<name>`.
//! * `PATCH /api/v1/nodes/<name>/status` and `PATCH /api/v1/nodes/<name>` with a strategic
//!   merge (objects merged, `null` deletes, `status.conditions` merged by `type`, other
//!   arrays replaced) or JSON merge patch; other content types get 415.

use std::collections::{BTreeMap, VecDeque};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use anyhow::{Context as _, Result};
use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Request, State as AxumState};
use axum::http::{Method, StatusCode, header};
use axum::response::Response;
use futures::StreamExt as _;
use serde_json::{Value, json};
use tokio::sync::{broadcast, watch};
use tokio_util::task::AbortOnDropHandle;

/// How an expired watch resourceVersion is answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GoneMode {
    /// HTTP 200 with one `ERROR` event carrying a 410 Status (the real apiserver's way).
    ErrorEvent,
    /// HTTP 410 with a Status body.
    HttpStatus,
}

/// One request as the server saw it.
#[derive(Debug, Clone)]
pub struct RecordedRequest {
    /// `GET`, `PATCH`, …
    pub method: String,
    /// The path, e.g. `/api/v1/nodes/n1/status`.
    pub path: String,
    /// The decoded query parameters.
    pub query: BTreeMap<String, String>,
    /// The `Content-Type` header.
    pub content_type: Option<String>,
    /// The raw body.
    pub body: Vec<u8>,
}

impl RecordedRequest {
    /// The body as text (lossy).
    pub fn body_text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// A `watch=true` request.
    pub fn is_watch(&self) -> bool {
        matches!(
            self.query.get("watch").map(String::as_str),
            Some("true" | "1")
        )
    }

    /// A list of all Nodes: a plain one, or a streaming one (a watch that starts with
    /// every Node, [`RecordedRequest::is_streaming_list`]), which is also a watch.
    pub fn is_node_list(&self) -> bool {
        self.method == "GET"
            && self.path == "/api/v1/nodes"
            && (!self.is_watch() || self.is_streaming_list())
    }

    /// A watch of all Nodes (streaming lists included).
    pub fn is_node_watch(&self) -> bool {
        self.method == "GET" && self.path == "/api/v1/nodes" && self.is_watch()
    }

    /// A streaming list: a watch with `sendInitialEvents=true`.
    pub fn is_streaming_list(&self) -> bool {
        self.is_watch() && self.query.get("sendInitialEvents").map(String::as_str) == Some("true")
    }
}

#[derive(Clone)]
enum WatchMsg {
    Event(Bytes),
    Bookmark(u64),
    Close,
}

struct State {
    rv: u64,
    nodes: BTreeMap<String, Value>,
    pods: BTreeMap<(String, String), Value>,
    log: Vec<(u64, Bytes)>,
    /// Watches from a resourceVersion below this get 410 Gone.
    oldest: u64,
    gone_mode: GoneMode,
    /// Streaming lists are served (the `WatchList` feature: on by default in Kubernetes
    /// 1.34, off in 1.33).
    watch_list: bool,
    /// Incremented by every "close all watches", so a watch request still being set up
    /// when the close happens is closed too.
    close_epoch: u64,
    status_patch_failures: VecDeque<u16>,
    requests: Vec<RecordedRequest>,
}

struct Shared {
    state: Mutex<State>,
    events: broadcast::Sender<WatchMsg>,
    paused: watch::Sender<bool>,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A panicking test thread must not hide the state from the others.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The fake API server; stops when dropped.
pub struct MockApiServer {
    shared: Arc<Shared>,
    addr: SocketAddr,
    _task: AbortOnDropHandle<()>,
}

impl MockApiServer {
    /// Starts the server on a free port of 127.0.0.1.
    pub async fn start() -> Result<Self> {
        let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
        Self::serve(listener).await
    }

    /// Starts the server on `listener`, e.g. one bound inside a lab namespace (a socket
    /// stays in the namespace it was created in) so that agents in other namespaces reach it.
    pub async fn serve(listener: std::net::TcpListener) -> Result<Self> {
        listener.set_nonblocking(true)?;
        let listener = tokio::net::TcpListener::from_std(listener)?;
        let (events, _) = broadcast::channel(4096);
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                rv: 100,
                nodes: BTreeMap::new(),
                pods: BTreeMap::new(),
                log: Vec::new(),
                oldest: 0,
                gone_mode: GoneMode::ErrorEvent,
                watch_list: true,
                close_epoch: 0,
                status_patch_failures: VecDeque::new(),
                requests: Vec::new(),
            }),
            events,
            paused: watch::channel(false).0,
        });
        let addr = listener.local_addr()?;
        let app = Router::new().fallback(handle).with_state(shared.clone());
        let task = tokio::spawn(async move {
            if let Err(e) = axum::serve(listener, app).await {
                eprintln!("mock apiserver stopped: {e}");
            }
        });
        Ok(MockApiServer {
            shared,
            addr,
            _task: AbortOnDropHandle::new(task),
        })
    }

    /// `http://<address>:<port>` (127.0.0.1 unless started with [`MockApiServer::serve`]).
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// A client for this server, built the way production builds one from a URL.
    pub fn client(&self) -> Result<kube::Client> {
        let config = kube::Config::new(self.url().parse().context("server URL")?);
        Ok(kube::Client::try_from(config)?)
    }

    /// The current resourceVersion.
    pub fn resource_version(&self) -> u64 {
        self.shared.lock().rv
    }

    fn emit(&self, st: &mut State, kind: &str, object: &Value) {
        let mut line =
            serde_json::to_vec(&json!({"type": kind, "object": object})).unwrap_or_default();
        line.push(b'\n');
        let line = Bytes::from(line);
        st.log.push((st.rv, line.clone()));
        let _ = self.shared.events.send(WatchMsg::Event(line));
    }

    /// Creates or replaces a Node (an `ADDED` or `MODIFIED` event); returns its new
    /// resourceVersion.
    pub fn apply_node(&self, mut node: Value) -> u64 {
        let mut st = self.shared.lock();
        st.rv += 1;
        let rv = st.rv;
        let name = node["metadata"]["name"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        node["kind"] = json!("Node");
        node["apiVersion"] = json!("v1");
        node["metadata"]["resourceVersion"] = json!(rv.to_string());
        let kind = if st.nodes.contains_key(&name) {
            "MODIFIED"
        } else {
            node["metadata"]["uid"] = json!(format!("uid-{name}-{rv}"));
            "ADDED"
        };
        st.nodes.insert(name, node.clone());
        self.emit(&mut st, kind, &node);
        rv
    }

    /// Changes a Node in place (a `MODIFIED` event); `None` if it does not exist.
    pub fn modify_node(&self, name: &str, f: impl FnOnce(&mut Value)) -> Option<u64> {
        let mut node = self.node(name)?;
        f(&mut node);
        Some(self.apply_node(node))
    }

    /// Deletes a Node (a `DELETED` event); `None` if it does not exist.
    pub fn delete_node(&self, name: &str) -> Option<u64> {
        let mut st = self.shared.lock();
        let mut node = st.nodes.remove(name)?;
        st.rv += 1;
        let rv = st.rv;
        node["metadata"]["resourceVersion"] = json!(rv.to_string());
        self.emit(&mut st, "DELETED", &node);
        Some(rv)
    }

    /// The names of the stored Nodes.
    pub fn node_names(&self) -> Vec<String> {
        self.shared.lock().nodes.keys().cloned().collect()
    }

    /// The stored Node.
    pub fn node(&self, name: &str) -> Option<Value> {
        self.shared.lock().nodes.get(name).cloned()
    }

    /// Creates a Pod (which also advances the resourceVersion, as any write in a real
    /// cluster does, without a Node event).
    pub fn add_pod(&self, namespace: &str, name: &str, node_name: Option<&str>) {
        let mut st = self.shared.lock();
        st.rv += 1;
        let mut spec = json!({"containers": [{"name": "kube-flannel"}]});
        if let Some(n) = node_name {
            spec["nodeName"] = json!(n);
        }
        let pod = json!({
            "kind": "Pod", "apiVersion": "v1",
            "metadata": {"name": name, "namespace": namespace,
                         "resourceVersion": st.rv.to_string()},
            "spec": spec,
        });
        st.pods.insert((namespace.to_owned(), name.to_owned()), pod);
    }

    /// Sends a `BOOKMARK` with the current resourceVersion to every open watch that asked
    /// for bookmarks; returns that version.
    pub fn send_bookmark(&self) -> u64 {
        let rv = self.shared.lock().rv;
        let _ = self.shared.events.send(WatchMsg::Bookmark(rv));
        rv
    }

    /// Ends every open watch (the client sees the stream close).
    pub fn close_watches(&self) {
        let mut st = self.shared.lock();
        st.close_epoch += 1;
        let _ = self.shared.events.send(WatchMsg::Close);
    }

    /// Closes the open watches and holds new watch requests until
    /// [`MockApiServer::resume_watches`], so changes can be made "while disconnected".
    pub fn pause_watches(&self) {
        self.shared.paused.send_replace(true);
        self.close_watches();
    }

    /// Lets held and new watch requests proceed.
    pub fn resume_watches(&self) {
        self.shared.paused.send_replace(false);
    }

    /// Forgets the event history: a watch from any older resourceVersion gets 410 Gone.
    pub fn compact(&self) {
        let mut st = self.shared.lock();
        st.oldest = st.rv;
        st.log.clear();
    }

    /// How 410 Gone is delivered.
    pub fn set_gone_mode(&self, mode: GoneMode) {
        self.shared.lock().gone_mode = mode;
    }

    /// Whether streaming lists (`sendInitialEvents=true`) are served; when not, they get 422
    /// Invalid, as from an API server without the `WatchList` feature.
    pub fn set_watch_list(&self, on: bool) {
        self.shared.lock().watch_list = on;
    }

    /// The next status patches fail with these HTTP codes, in order.
    pub fn fail_status_patches(&self, codes: &[u16]) {
        self.shared
            .lock()
            .status_patch_failures
            .extend(codes.iter().copied());
    }

    /// Every request so far.
    pub fn requests(&self) -> Vec<RecordedRequest> {
        self.shared.lock().requests.clone()
    }

    /// Every PATCH request so far.
    pub fn patches(&self) -> Vec<RecordedRequest> {
        self.requests()
            .into_iter()
            .filter(|r| r.method == "PATCH")
            .collect()
    }

    /// Number of watches currently streaming.
    pub fn open_watches(&self) -> usize {
        self.shared.events.receiver_count()
    }

    /// Waits until `cond` holds for the recorded requests (up to 10 s).
    pub async fn wait_for_requests(
        &self,
        what: &str,
        cond: impl Fn(&[RecordedRequest]) -> bool,
    ) -> Result<()> {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            if cond(&self.shared.lock().requests) {
                return Ok(());
            }
            if tokio::time::Instant::now() > deadline {
                anyhow::bail!(
                    "timed out waiting for {what}; requests: {:#?}",
                    self.requests()
                );
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Waits until `n` watches are streaming (up to 10 s).
    pub async fn wait_for_open_watches(&self, n: usize) -> Result<()> {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while self.open_watches() != n {
            if tokio::time::Instant::now() > deadline {
                anyhow::bail!("timed out waiting for {n} open watches");
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        Ok(())
    }
}

/// A Node object: `spec.podCIDR` is the first of `pod_cidrs`, `spec.podCIDRs` all of them
/// (both absent when empty); `annotations` as given.
pub fn node(name: &str, pod_cidrs: &[&str], annotations: &[(&str, &str)]) -> Value {
    let ann: serde_json::Map<String, Value> = annotations
        .iter()
        .map(|(k, v)| ((*k).to_owned(), json!(v)))
        .collect();
    let mut spec = json!({});
    if let Some(first) = pod_cidrs.first() {
        spec["podCIDR"] = json!(first);
        spec["podCIDRs"] = json!(pod_cidrs);
    }
    json!({
        "kind": "Node",
        "apiVersion": "v1",
        "metadata": {"name": name, "annotations": ann, "labels": {"kubernetes.io/hostname": name}},
        "spec": spec,
        "status": {"conditions": [
            {"type": "Ready", "status": "True", "reason": "KubeletReady"}
        ]},
    })
}

/// A Node as a kubelet and flannel leave it in a real cluster: the flannel annotations
/// (vxlan, `public_ip`, a VTEP MAC from `index`), the kubelet's labels and annotations,
/// `managedFields`, and a status with addresses, capacity, conditions, node info and the
/// 40 container images a busy node holds (about 14 KB of JSON in all).
pub fn realistic_node(name: &str, index: u32, pod_cidr: &str, public_ip: &str) -> Value {
    let [.., hi, lo] = index.to_be_bytes();
    let images: Vec<Value> = (0..40)
        .map(|i| {
            json!({
                "names": [
                    format!("registry.example.com/platform/service-{i}@sha256:{:064x}", u64::from(index) * 97 + i),
                    format!("registry.example.com/platform/service-{i}:v1.{i}.{index}"),
                ],
                "sizeBytes": 20_000_000 + i * 1_234_567,
            })
        })
        .collect();
    let condition = |kind: &str, status: &str, reason: &str, message: &str| {
        json!({"type": kind, "status": status, "reason": reason, "message": message,
               "lastHeartbeatTime": "2026-12-07T10:00:00Z",
               "lastTransitionTime": "2026-12-01T08:00:00Z"})
    };
    let mut node = node(
        name,
        &[pod_cidr],
        &[
            (
                "flannel.alpha.coreos.com/backend-data",
                &format!(r#"{{"VNI":1,"VtepMAC":"96:59:b2:3f:{hi:02x}:{lo:02x}"}}"#),
            ),
            ("flannel.alpha.coreos.com/backend-type", "vxlan"),
            ("flannel.alpha.coreos.com/kube-subnet-manager", "true"),
            ("flannel.alpha.coreos.com/public-ip", public_ip),
            (
                "kubeadm.alpha.kubernetes.io/cri-socket",
                "unix:///var/run/containerd/containerd.sock",
            ),
            ("node.alpha.kubernetes.io/ttl", "0"),
            (
                "volumes.kubernetes.io/controller-managed-attach-detach",
                "true",
            ),
        ],
    );
    node["metadata"]["labels"] = json!({
        "beta.kubernetes.io/arch": "amd64", "beta.kubernetes.io/os": "linux",
        "kubernetes.io/arch": "amd64", "kubernetes.io/hostname": name,
        "kubernetes.io/os": "linux", "node.kubernetes.io/instance-type": "m5.xlarge",
        "topology.kubernetes.io/region": "eu-west-1", "topology.kubernetes.io/zone": "eu-west-1b",
    });
    node["metadata"]["managedFields"] = json!([
        {"manager": "kubeadm", "operation": "Update", "apiVersion": "v1",
         "time": "2026-12-01T08:00:00Z", "fieldsType": "FieldsV1",
         "fieldsV1": {"f:metadata": {"f:annotations": {"f:kubeadm.alpha.kubernetes.io/cri-socket": {}}}}},
        {"manager": "flanneld", "operation": "Update", "apiVersion": "v1", "subresource": "status",
         "time": "2026-12-01T08:00:05Z", "fieldsType": "FieldsV1",
         "fieldsV1": {"f:metadata": {"f:annotations": {
             "f:flannel.alpha.coreos.com/backend-data": {}, "f:flannel.alpha.coreos.com/backend-type": {},
             "f:flannel.alpha.coreos.com/kube-subnet-manager": {}, "f:flannel.alpha.coreos.com/public-ip": {}}},
             "f:status": {"f:conditions": {"k:{\"type\":\"NetworkUnavailable\"}": {".": {}, "f:status": {}}}}}},
        {"manager": "kubelet", "operation": "Update", "apiVersion": "v1", "subresource": "status",
         "time": "2026-12-07T10:00:00Z", "fieldsType": "FieldsV1",
         "fieldsV1": {"f:status": {"f:allocatable": {}, "f:capacity": {}, "f:conditions": {},
                                   "f:images": {}, "f:nodeInfo": {}}}},
    ]);
    node["spec"]["providerID"] = json!(format!("aws:///eu-west-1b/i-0{index:016x}"));
    let resources = json!({"cpu": "4", "ephemeral-storage": "101430960Ki", "hugepages-1Gi": "0",
                           "hugepages-2Mi": "0", "memory": "16110948Ki", "pods": "110"});
    node["status"] = json!({
        "addresses": [
            {"type": "InternalIP", "address": public_ip},
            {"type": "Hostname", "address": name},
            {"type": "InternalDNS", "address": format!("{name}.eu-west-1.compute.internal")},
        ],
        "allocatable": resources,
        "capacity": resources,
        "conditions": [
            condition("NetworkUnavailable", "False", "FlannelIsUp", "Flannel is running on this node"),
            condition("MemoryPressure", "False", "KubeletHasSufficientMemory", "kubelet has sufficient memory available"),
            condition("DiskPressure", "False", "KubeletHasNoDiskPressure", "kubelet has no disk pressure"),
            condition("PIDPressure", "False", "KubeletHasSufficientPID", "kubelet has sufficient PID available"),
            condition("Ready", "True", "KubeletReady", "kubelet is posting ready status"),
        ],
        "daemonEndpoints": {"kubeletEndpoint": {"Port": 10250}},
        "images": images,
        "nodeInfo": {
            "architecture": "amd64", "bootID": format!("{index:08x}-0000-4000-8000-000000000000"),
            "containerRuntimeVersion": "containerd://1.7.24", "kernelVersion": "6.18.0",
            "kubeProxyVersion": "v1.32.6", "kubeletVersion": "v1.32.6",
            "machineID": format!("{index:032x}"), "operatingSystem": "linux",
            "osImage": "Debian GNU/Linux 13 (trixie)", "systemUUID": format!("ec2{index:029x}"),
        },
    });
    node
}

fn status(code: u16, reason: &str, message: &str) -> Value {
    json!({
        "kind": "Status", "apiVersion": "v1", "metadata": {},
        "status": "Failure", "message": message, "reason": reason, "code": code,
    })
}

fn json_response(code: u16, body: &Value) -> Response {
    Response::builder()
        .status(StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR))
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(serde_json::to_vec(body).unwrap_or_default()))
        .unwrap_or_default()
}

fn error_response(code: u16, reason: &str, message: &str) -> Response {
    json_response(code, &status(code, reason, message))
}

fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let hex = |b: u8| (b as char).to_digit(16);
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' if i + 2 < bytes.len() => match (hex(bytes[i + 1]), hex(bytes[i + 2])) {
                (Some(h), Some(l)) => {
                    out.push(u8::try_from(h * 16 + l).unwrap_or(b'?'));
                    i += 3;
                    continue;
                }
                _ => out.push(b'%'),
            },
            b'+' => out.push(b' '),
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn parse_query(q: Option<&str>) -> BTreeMap<String, String> {
    q.unwrap_or("")
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|p| match p.split_once('=') {
            Some((k, v)) => (percent_decode(k), percent_decode(v)),
            None => (percent_decode(p), String::new()),
        })
        .collect()
}

async fn handle(AxumState(shared): AxumState<Arc<Shared>>, req: Request) -> Response {
    let (parts, body) = req.into_parts();
    let body = axum::body::to_bytes(body, 16 << 20)
        .await
        .map(|b| b.to_vec())
        .unwrap_or_default();
    let rec = RecordedRequest {
        method: parts.method.to_string(),
        path: parts.uri.path().to_owned(),
        query: parse_query(parts.uri.query()),
        content_type: parts
            .headers
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned),
        body,
    };
    let epoch = {
        let mut st = shared.lock();
        st.requests.push(rec.clone());
        st.close_epoch
    };
    let segments: Vec<&str> = rec.path.trim_matches('/').split('/').collect();
    match (&parts.method, segments.as_slice()) {
        (&Method::GET, ["api", "v1", "nodes"]) if rec.is_watch() => {
            watch_nodes(&shared, &rec, epoch).await
        }
        (&Method::GET, ["api", "v1", "nodes"]) => list_nodes(&shared, &rec),
        (&Method::GET, ["api", "v1", "nodes", name] | ["api", "v1", "nodes", name, "status"]) => {
            match shared.lock().nodes.get(*name) {
                Some(n) => json_response(200, n),
                None => error_response(404, "NotFound", &format!("nodes \"{name}\" not found")),
            }
        }
        (&Method::PATCH, ["api", "v1", "nodes", name, rest @ ..]) if rest.len() <= 1 => {
            let is_status = rest == ["status"];
            patch_node(&shared, name, is_status, &rec)
        }
        (&Method::GET, ["api", "v1", "namespaces", ns, "pods", name]) => {
            match shared
                .lock()
                .pods
                .get(&((*ns).to_owned(), (*name).to_owned()))
            {
                Some(p) => json_response(200, p),
                None => error_response(404, "NotFound", &format!("pods \"{name}\" not found")),
            }
        }
        _ => error_response(
            404,
            "NotFound",
            "the server could not find the requested resource",
        ),
    }
}

/// A Node list as the real API server serves one. `resourceVersion=0` is served whole from
/// its cache, `limit` or not. Otherwise (a consistent read) a `limit` cuts the list into
/// pages in name order (etcd's key order), each but the last with a continue token (the
/// list's resourceVersion and the page's last name: opaque to clients) and the count of
/// Nodes left; every page carries the first page's resourceVersion. The mock has no
/// snapshots: a later page holds the Nodes as they are now, and the watch from the list's
/// resourceVersion replays what changed. A token from before a compaction gets 410 Gone,
/// as a real one does once etcd compacted its revision.
fn list_nodes(shared: &Shared, rec: &RecordedRequest) -> Response {
    use std::ops::Bound::{Excluded, Unbounded};
    let st = shared.lock();
    let cached = rec.query.get("resourceVersion").map(String::as_str) == Some("0");
    let limit = rec
        .query
        .get("limit")
        .and_then(|l| l.parse::<usize>().ok())
        .filter(|&l| l > 0 && !cached);
    let (rv, after) = match rec.query.get("continue").filter(|c| !c.is_empty()) {
        None => (st.rv, None),
        Some(token) => match token
            .split_once('-')
            .and_then(|(rv, last)| Some((rv.parse::<u64>().ok()?, last)))
        {
            Some((rv, _)) if rv < st.oldest => {
                let message = format!(
                    "the continue token's resourceVersion {rv} was compacted ({}): list again",
                    st.oldest
                );
                return json_response(410, &status(410, "Expired", &message));
            }
            Some((rv, last)) => (rv, Some(last.to_owned())),
            None => return error_response(400, "BadRequest", "invalid continue token"),
        },
    };
    let mut rest = match &after {
        Some(last) => st
            .nodes
            .range::<str, _>((Excluded(last.as_str()), Unbounded)),
        None => st.nodes.range::<str, _>(..),
    };
    let page: Vec<(&String, &Value)> = rest.by_ref().take(limit.unwrap_or(usize::MAX)).collect();
    let remaining = rest.count();
    let mut metadata = json!({"resourceVersion": rv.to_string()});
    if let Some((last, _)) = page.last().filter(|_| remaining > 0) {
        metadata["continue"] = json!(format!("{rv}-{last}"));
        metadata["remainingItemCount"] = json!(remaining);
    }
    let items: Vec<&Value> = page.into_iter().map(|(_, node)| node).collect();
    json_response(
        200,
        &json!({"kind": "NodeList", "apiVersion": "v1", "metadata": metadata, "items": items}),
    )
}

fn patch_node(shared: &Shared, name: &str, is_status: bool, rec: &RecordedRequest) -> Response {
    let ct = rec.content_type.as_deref().unwrap_or("");
    if ct != "application/strategic-merge-patch+json" && ct != "application/merge-patch+json" {
        return error_response(415, "UnsupportedMediaType", &format!("unsupported {ct}"));
    }
    let patch: Value = match serde_json::from_slice(&rec.body) {
        Ok(p) => p,
        Err(e) => return error_response(400, "BadRequest", &e.to_string()),
    };
    let mut st = shared.lock();
    if is_status && let Some(code) = st.status_patch_failures.pop_front() {
        return error_response(code, "InternalError", "injected failure");
    }
    let Some(current) = st.nodes.get(name).cloned() else {
        return error_response(404, "NotFound", &format!("nodes \"{name}\" not found"));
    };
    let mut updated = current.clone();
    merge(&mut updated, &patch, "");
    if updated == current {
        return json_response(200, &current);
    }
    st.rv += 1;
    let rv = st.rv;
    updated["metadata"]["resourceVersion"] = json!(rv.to_string());
    st.nodes.insert(name.to_owned(), updated.clone());
    let mut line =
        serde_json::to_vec(&json!({"type": "MODIFIED", "object": updated})).unwrap_or_default();
    line.push(b'\n');
    let line = Bytes::from(line);
    st.log.push((rv, line.clone()));
    let _ = shared.events.send(WatchMsg::Event(line));
    json_response(200, &updated)
}

/// Strategic merge as far as Nodes need it: objects merge, `null` deletes, lists of
/// conditions merge by `type`, other lists are replaced.
fn merge(target: &mut Value, patch: &Value, path: &str) {
    let Some(patch_obj) = patch.as_object() else {
        *target = patch.clone();
        return;
    };
    if !target.is_object() {
        *target = json!({});
    }
    let Some(target_obj) = target.as_object_mut() else {
        return;
    };
    for (k, v) in patch_obj {
        let child = format!("{path}.{k}");
        match v {
            Value::Null => {
                target_obj.remove(k);
            }
            Value::Object(_) => merge(
                target_obj.entry(k.clone()).or_insert(Value::Null),
                v,
                &child,
            ),
            Value::Array(items) if child == ".status.conditions" => {
                let list = target_obj.entry(k.clone()).or_insert_with(|| json!([]));
                if !list.is_array() {
                    *list = json!([]);
                }
                if let Some(list) = list.as_array_mut() {
                    for item in items {
                        match list.iter_mut().find(|c| c["type"] == item["type"]) {
                            Some(existing) => merge(existing, item, &child),
                            None => list.push(item.clone()),
                        }
                    }
                }
            }
            _ => {
                target_obj.insert(k.clone(), v.clone());
            }
        }
    }
}

async fn watch_nodes(shared: &Arc<Shared>, rec: &RecordedRequest, epoch: u64) -> Response {
    let mut paused = shared.paused.subscribe();
    while *paused.borrow_and_update() {
        if paused.changed().await.is_err() {
            break;
        }
    }
    let bookmarks = rec.query.get("allowWatchBookmarks").map(String::as_str) == Some("true");
    let streaming = rec.is_streaming_list();
    let from = rec
        .query
        .get("resourceVersion")
        .map(String::as_str)
        .unwrap_or("");
    let (backlog, rx) = {
        let st = shared.lock();
        if st.close_epoch != epoch {
            // Closed while being set up: end at once, the client comes back.
            return Response::builder()
                .header(header::CONTENT_TYPE, "application/json")
                .body(Body::empty())
                .unwrap_or_default();
        }
        if streaming {
            // What the real API server checks of a streaming list.
            let refused = if !st.watch_list {
                Some("sendInitialEvents: streaming lists (WatchList) are off on this server")
            } else if rec.query.get("resourceVersionMatch").map(String::as_str)
                != Some("NotOlderThan")
            {
                Some("sendInitialEvents requires resourceVersionMatch=NotOlderThan")
            } else if !bookmarks {
                Some("sendInitialEvents requires allowWatchBookmarks=true")
            } else {
                None
            };
            if let Some(message) = refused {
                return json_response(422, &status(422, "Invalid", message));
            }
        }
        let mut backlog: Vec<Bytes> = match from.parse::<u64>() {
            // No version (or "0"): the current state as ADDED events, then live changes.
            Err(_) | Ok(0) => st
                .nodes
                .values()
                .map(|n| {
                    let mut l = serde_json::to_vec(&json!({"type": "ADDED", "object": n}))
                        .unwrap_or_default();
                    l.push(b'\n');
                    Bytes::from(l)
                })
                .collect(),
            Ok(rv) if rv < st.oldest => {
                let message = format!("too old resource version: {rv} ({})", st.oldest);
                let gone = status(410, "Expired", &message);
                return match st.gone_mode {
                    GoneMode::HttpStatus => json_response(410, &gone),
                    GoneMode::ErrorEvent => {
                        let mut l = serde_json::to_vec(&json!({"type": "ERROR", "object": gone}))
                            .unwrap_or_default();
                        l.push(b'\n');
                        Response::builder()
                            .header(header::CONTENT_TYPE, "application/json")
                            .body(Body::from(l))
                            .unwrap_or_default()
                    }
                };
            }
            Ok(rv) => st
                .log
                .iter()
                .filter(|(v, _)| *v > rv)
                .map(|(_, l)| l.clone())
                .collect(),
        };
        if streaming {
            // The end of the initial events: a bookmark at the state they showed.
            let mut l = serde_json::to_vec(&json!({"type": "BOOKMARK", "object": {
                "kind": "Node", "apiVersion": "v1",
                "metadata": {"resourceVersion": st.rv.to_string(),
                             "annotations": {"k8s.io/initial-events-end": "true"}}}}))
            .unwrap_or_default();
            l.push(b'\n');
            backlog.push(Bytes::from(l));
        }
        (backlog, shared.events.subscribe())
    };
    let live = futures::stream::unfold(rx, move |mut rx| async move {
        loop {
            match rx.recv().await {
                Ok(WatchMsg::Event(line)) => return Some((line, rx)),
                Ok(WatchMsg::Bookmark(rv)) if bookmarks => {
                    let mut l = serde_json::to_vec(&json!({"type": "BOOKMARK", "object": {
                        "kind": "Node", "apiVersion": "v1",
                        "metadata": {"resourceVersion": rv.to_string()}}}))
                    .unwrap_or_default();
                    l.push(b'\n');
                    return Some((Bytes::from(l), rx));
                }
                Ok(WatchMsg::Bookmark(_)) => continue,
                Ok(WatchMsg::Close) | Err(_) => return None,
            }
        }
    });
    let stream = futures::stream::iter(backlog)
        .chain(live)
        .map(Ok::<Bytes, Infallible>);
    Response::builder()
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from_stream(stream))
        .unwrap_or_default()
}
