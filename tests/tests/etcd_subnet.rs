//! The etcd subnet manager against a real etcd (Debian's etcd 3.4, started per test on
//! loopback): config, lease acquisition with its compare-and-swap and race retries, renewal,
//! revocation, and the lease watch through restarts and compaction.

use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::net::Ipv4Addr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, SystemTime};

use anyhow::{Context as _, Result, bail, ensure};
use etcd_client::{Client, CompactionOptions, GetOptions, PutOptions};
use flannel_agent::alloc::PreviousSubnets;
use flannel_agent::lease::{Lease, LeaseAttrs};
use flannel_agent::subnet::etcd::{EtcdError, EtcdOptions, EtcdSubnetManager, EtcdTuning};
use flannel_agent::subnet::{LeaseSnapshot, lease_channel};
use flannel_tests::etcd::Etcd;
use ipnet::Ipv4Net;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

const VXLAN_VALUE: &str = r#"{"PublicIP":"192.168.64.3","PublicIPv6":null,"BackendType":"vxlan","BackendData":{"VNI":1,"VtepMAC":"c6:d2:32:6f:8f:44"}}"#;
const MOCK_CONFIG: &str =
    r#"{ "Network": "10.3.0.0/16", "SubnetMin": "10.3.1.0", "SubnetMax": "10.3.25.0" }"#;
const DEFAULT_SUBNETS: &str = "/coreos.com/network/subnets/";

// ---------------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------------

/// Starts etcd, or `None` (test skipped) when it is not installed.
fn start_etcd() -> Option<Etcd> {
    if std::process::Command::new("etcd")
        .arg("--version")
        .output()
        .is_err()
    {
        eprintln!("skipped: etcd not installed (run `cargo xtask setup`)");
        return None;
    }
    match tokio::task::block_in_place(Etcd::start) {
        Ok(etcd) => Some(etcd),
        Err(e) => panic!("starting etcd: {e:#}"),
    }
}

/// Runs a test body with an overall deadline so that nothing can hang forever.
async fn deadline<T>(secs: u64, body: impl Future<Output = Result<T>>) -> T {
    match tokio::time::timeout(Duration::from_secs(secs), body).await {
        Ok(Ok(v)) => v,
        Ok(Err(e)) => panic!("{e:#}"),
        Err(_) => panic!("test did not finish within {secs} s"),
    }
}

fn options(etcd: &Etcd) -> EtcdOptions {
    EtcdOptions {
        endpoints: vec![etcd.endpoint()],
        ..EtcdOptions::default()
    }
}

fn options_with(etcd: &Etcd, prefix: &str, tuning: EtcdTuning) -> EtcdOptions {
    EtcdOptions {
        endpoints: vec![etcd.endpoint()],
        prefix: prefix.to_owned(),
        tuning,
        ..EtcdOptions::default()
    }
}

async fn manager(etcd: &Etcd) -> Result<EtcdSubnetManager> {
    Ok(EtcdSubnetManager::connect(&options(etcd)).await?)
}

async fn client(etcd: &Etcd) -> Result<Client> {
    Ok(Client::connect([etcd.endpoint()], None).await?)
}

fn attrs(ip: [u8; 4]) -> LeaseAttrs {
    LeaseAttrs {
        public_ip: Ipv4Addr::from(ip),
        ..LeaseAttrs::default()
    }
}

fn value(ip: [u8; 4]) -> String {
    attrs(ip).to_json()
}

fn net(s: &str) -> Ipv4Net {
    s.parse()
        .unwrap_or_else(|e| panic!("bad test subnet {s}: {e}"))
}

fn no_previous() -> PreviousSubnets {
    PreviousSubnets::default()
}

/// Writes the network config (`<prefix>/config` under the default prefix).
async fn put_config(c: &mut Client, json: &str) -> Result<()> {
    c.put("/coreos.com/network/config", json, None).await?;
    Ok(())
}

/// Writes `value` at `key`, attached to a new etcd lease of `ttl` seconds (none if 0).
async fn put(c: &mut Client, key: &str, value: &str, ttl: i64) -> Result<()> {
    let opts = if ttl > 0 {
        Some(PutOptions::new().with_lease(c.lease_grant(ttl, None).await?.id()))
    } else {
        None
    };
    c.put(key, value, opts).await?;
    Ok(())
}

/// `(value, etcd lease id, remaining TTL, mod revision)` of a key, `None` if absent.
async fn read(c: &mut Client, key: &str) -> Result<Option<(String, i64, i64, i64)>> {
    let resp = c.get(key, None).await?;
    let Some(kv) = resp.kvs().first() else {
        return Ok(None);
    };
    let ttl = if kv.lease() == 0 {
        -1
    } else {
        c.lease_time_to_live(kv.lease(), None).await?.ttl()
    };
    Ok(Some((
        kv.value_str()?.to_owned(),
        kv.lease(),
        ttl,
        kv.mod_revision(),
    )))
}

/// The keys under a prefix.
async fn keys(c: &mut Client, prefix: &str) -> Result<Vec<String>> {
    let resp = c.get(prefix, Some(GetOptions::new().with_prefix())).await?;
    resp.kvs()
        .iter()
        .map(|kv| Ok(kv.key_str()?.to_owned()))
        .collect()
}

/// Waits until the snapshot satisfies `cond`.
async fn wait_for(
    rx: &mut watch::Receiver<LeaseSnapshot>,
    what: &str,
    within: Duration,
    cond: impl Fn(&LeaseSnapshot) -> bool,
) -> Result<LeaseSnapshot> {
    let until = tokio::time::Instant::now() + within;
    loop {
        {
            let snap = rx.borrow_and_update();
            if cond(&snap) {
                return Ok(snap.clone());
            }
        }
        match tokio::time::timeout_at(until, rx.changed()).await {
            Ok(Ok(())) => {}
            Ok(Err(_)) => bail!("{what}: the publisher went away"),
            Err(_) => bail!(
                "{what}: not reached within {within:?}; last snapshot: {:?}",
                ids(&rx.borrow())
            ),
        }
    }
}

fn ids(snap: &LeaseSnapshot) -> Vec<String> {
    snap.leases.keys().cloned().collect()
}

fn has_ids(snap: &LeaseSnapshot, want: &[&str]) -> bool {
    snap.synced && ids(snap) == want
}

/// Stops etcd for a moment (the watches break), then starts it again.
fn bounce(etcd: &mut Etcd, down: Duration) {
    tokio::task::block_in_place(|| {
        etcd.stop();
        std::thread::sleep(down);
        if let Err(e) = etcd.resume() {
            panic!("restarting etcd: {e:#}");
        }
    });
}

/// Writes `n` revisions elsewhere and compacts the store at the newest revision.
async fn churn_and_compact(c: &mut Client, n: usize) -> Result<i64> {
    let mut rev = 0;
    for i in 0..n {
        let resp = c.put("/churn", i.to_string(), None).await?;
        rev = resp.header().map(|h| h.revision()).unwrap_or_default();
    }
    c.compact(rev, Some(CompactionOptions::new().with_physical()))
        .await?;
    Ok(rev)
}

/// Log lines captured from the agent (a global subscriber for this test binary).
fn logs() -> &'static Capture {
    static CAPTURE: OnceLock<&'static Capture> = OnceLock::new();
    CAPTURE.get_or_init(|| {
        let capture: &'static Capture = Box::leak(Box::new(Capture(Mutex::new(Vec::new()))));
        let _ = tracing::subscriber::set_global_default(CaptureRef(capture));
        capture
    })
}

struct Capture(Mutex<Vec<String>>);

impl Capture {
    fn count(&self, needle: &str) -> usize {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .filter(|l| l.contains(needle))
            .count()
    }
}

struct CaptureRef(&'static Capture);

struct MessageVisitor(String);

impl tracing::field::Visit for MessageVisitor {
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        let _ = write!(self.0, "{}={value:?} ", field.name());
    }
}

impl tracing::Subscriber for CaptureRef {
    fn enabled(&self, _: &tracing::Metadata<'_>) -> bool {
        true
    }
    fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        tracing::span::Id::from_u64(1)
    }
    fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}
    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
    fn event(&self, event: &tracing::Event<'_>) {
        let mut v = MessageVisitor(String::new());
        event.record(&mut v);
        self.0.0.lock().unwrap_or_else(|p| p.into_inner()).push(v.0);
    }
    fn enter(&self, _: &tracing::span::Id) {}
    fn exit(&self, _: &tracing::span::Id) {}
}

// ---------------------------------------------------------------------------------------------
// Network config
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn network_config_missing_invalid_and_valid() {
    let Some(etcd) = start_etcd() else { return };
    deadline(60, async {
        let m = manager(&etcd).await?;
        let mut c = client(&etcd).await?;

        let e = m.network_config().await.unwrap_err();
        assert!(matches!(e, EtcdError::ConfigNotFound), "{e:?}");
        assert_eq!(
            e.to_string(),
            "flannel config not found in etcd store. Did you create your config using etcdv3 \
             API?"
        );

        put_config(&mut c, r#"{"Network": "10.3.0.0/33"}"#).await?;
        let e = m.network_config().await.unwrap_err().to_string();
        assert!(
            e.starts_with("invalid network config in etcd key /coreos.com/network/config: ")
                && e.contains("Network")
                && e.contains("10.3.0.0/33"),
            "{e}"
        );
        put_config(&mut c, r#"{"Network": "10.3.0.0/16", "SubnetLen": "24"}"#).await?;
        let e = m.network_config().await.unwrap_err().to_string();
        assert!(e.contains("SubnetLen"), "{e}");
        put_config(&mut c, "{").await?;
        assert!(m.network_config().await.is_err());

        put_config(
            &mut c,
            r#"{"Network": "10.3.0.0/16", "Backend": {"Type": "vxlan"}}"#,
        )
        .await?;
        let cfg = m.network_config().await?;
        let pool = cfg.ipv4.context("ipv4 pool")?;
        assert_eq!(pool.network, net("10.3.0.0/16"));
        assert_eq!(pool.subnet_len, 24);
        assert_eq!(pool.subnet_min, Ipv4Addr::new(10, 3, 1, 0));
        assert_eq!(pool.subnet_max, Ipv4Addr::new(10, 3, 255, 0));
        assert_eq!(cfg.ipv6, None);
        assert_eq!(cfg.config.backend_type, "vxlan");
        assert_eq!(cfg.config.subnet_len, 24);

        // Another prefix (with upstream's path cleaning) reads another key.
        let other = EtcdSubnetManager::connect(&EtcdOptions {
            prefix: "/custom//net/".into(),
            ..options(&etcd)
        })
        .await?;
        assert_eq!(other.config_key(), "/custom/net/config");
        assert!(matches!(
            other.network_config().await,
            Err(EtcdError::ConfigNotFound)
        ));
        c.put("/custom/net/config", r#"{"Network": "10.9.0.0/16"}"#, None)
            .await?;
        assert_eq!(
            other.network_config().await?.ipv4.map(|p| p.network),
            Some(net("10.9.0.0/16"))
        );
        Ok(())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_etcd_gives_a_prompt_error_naming_the_endpoint() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let endpoint = format!("http://127.0.0.1:{port}");
    deadline(30, async {
        let m = EtcdSubnetManager::connect(&EtcdOptions {
            endpoints: vec![endpoint.clone()],
            tuning: EtcdTuning {
                connect_timeout: Duration::from_secs(1),
                request_timeout: Duration::from_secs(2),
                ..EtcdTuning::default()
            },
            ..EtcdOptions::default()
        })
        .await?;
        let started = std::time::Instant::now();
        let e = m.network_config().await.unwrap_err().to_string();
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "{:?}",
            started.elapsed()
        );
        assert!(
            e.starts_with(&format!(
                "etcd get /coreos.com/network/config at {endpoint} "
            )),
            "{e}"
        );

        let e = EtcdSubnetManager::connect(&EtcdOptions {
            endpoints: vec![],
            ..EtcdOptions::default()
        })
        .await
        .unwrap_err();
        assert_eq!(
            e.to_string(),
            "no etcd endpoints given (--etcd-endpoints is empty)"
        );
        let e = EtcdSubnetManager::connect(&EtcdOptions {
            endpoints: vec!["http://[::1".into()],
            ..EtcdOptions::default()
        })
        .await
        .unwrap_err()
        .to_string();
        assert!(
            e.starts_with("cannot connect to etcd at http://[::1: "),
            "{e}"
        );
        Ok(())
    })
    .await;
}

// ---------------------------------------------------------------------------------------------
// AcquireLease
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acquire_writes_upstream_json_with_a_24h_ttl_and_reuses_it() {
    let Some(etcd) = start_etcd() else { return };
    deadline(60, async {
        let m = manager(&etcd).await?;
        let mut c = client(&etcd).await?;
        put_config(&mut c, r#"{"Network": "10.5.0.0/16"}"#).await?;
        let a = LeaseAttrs::from_json(VXLAN_VALUE)?;

        let lease = m.acquire_lease(&a, &no_previous()).await?;
        let sn = lease.subnet.context("no subnet")?;
        assert!(
            net("10.5.0.0/16").contains(&sn) && sn.prefix_len() == 24,
            "{sn}"
        );
        assert_ne!(sn, net("10.5.0.0/24"));
        assert_eq!(lease.ipv6_subnet, None);
        assert_eq!(lease.attrs, a);
        let exp = lease.expiration.context("no expiration")?;
        let left = exp.duration_since(SystemTime::now())?.as_secs();
        assert!((86390..=86400).contains(&left), "{left}");

        let key = format!("{DEFAULT_SUBNETS}{}-24", sn.addr());
        assert_eq!(m.lease_key(&lease).as_deref(), Some(key.as_str()));
        assert_eq!(
            keys(&mut c, DEFAULT_SUBNETS).await?,
            std::slice::from_ref(&key)
        );
        let (v, id, ttl, rev) = read(&mut c, &key).await?.context("key missing")?;
        assert_eq!(v, VXLAN_VALUE);
        assert!((86390..=86400).contains(&ttl), "{ttl}");
        let granted = c.lease_time_to_live(id, None).await?.granted_ttl();
        assert_eq!(granted, 86400);

        // Same PublicIP again: same subnet, fresh etcd lease with a full TTL.
        tokio::time::sleep(Duration::from_millis(1100)).await;
        let again = m.acquire_lease(&a, &no_previous()).await?;
        assert_eq!(again.subnet, Some(sn));
        let (v2, id2, ttl2, rev2) = read(&mut c, &key).await?.context("key missing")?;
        assert_eq!(v2, VXLAN_VALUE);
        assert_ne!(id2, id);
        assert!(rev2 > rev);
        assert!((86395..=86400).contains(&ttl2), "{ttl2}");
        assert_eq!(keys(&mut c, DEFAULT_SUBNETS).await?, [key]);
        Ok(())
    })
    .await;
}

/// The allocation listing reads the TTL of this node's own lease only: joining a cluster, or
/// reusing a lease in it, costs one TimeToLive request, not one per node (upstream reads every
/// key's); the others' subnets still count as taken.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acquiring_reads_the_ttl_of_the_own_lease_only() {
    let Some(etcd) = start_etcd() else { return };
    deadline(60, async {
        let m = manager(&etcd).await?;
        let mut c = client(&etcd).await?;
        put_config(
            &mut c,
            r#"{"Network": "10.6.0.0/16", "SubnetMin": "10.6.1.0", "SubnetMax": "10.6.40.0"}"#,
        )
        .await?;
        // 39 of the 40 subnets held by other nodes, each key on an etcd lease of its own.
        for i in 1..40u8 {
            let key = format!("{DEFAULT_SUBNETS}10.6.{i}.0-24");
            put(&mut c, &key, &value([192, 168, 7, i]), 3600).await?;
        }
        let ttl_requests = || etcd.requests_started("LeaseTimeToLive");

        let before = ttl_requests()?;
        let lease = m
            .acquire_lease(&attrs([192, 168, 7, 200]), &no_previous())
            .await?;
        assert_eq!(
            lease.subnet,
            Some(net("10.6.40.0/24")),
            "the one free subnet"
        );
        assert_eq!(
            ttl_requests()?,
            before,
            "no TTL read for other nodes' leases"
        );

        // Our own lease again (a restart): its TTL is read, once.
        let before = ttl_requests()?;
        let again = m
            .acquire_lease(&attrs([192, 168, 7, 200]), &no_previous())
            .await?;
        assert_eq!(again.subnet, Some(net("10.6.40.0/24")));
        assert!(again.expiration.is_some());
        assert_eq!(ttl_requests()?, before + 1);

        // A third node finds the pool full: every other key still holds its subnet.
        let full = m
            .acquire_lease(&attrs([192, 168, 7, 201]), &no_previous())
            .await;
        assert!(
            matches!(&full, Err(e) if e.to_string().contains("out of subnets")),
            "{full:?}"
        );
        Ok(())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_allocation_vectors() {
    let Some(etcd) = start_etcd() else { return };
    deadline(60, async {
        let m = manager(&etcd).await?;
        let mut c = client(&etcd).await?;
        put_config(&mut c, MOCK_CONFIG).await?;
        for sn in ["10.3.1.0", "10.3.2.0", "10.3.4.0", "10.3.5.0", "10.3.31.0"] {
            let key = format!("{DEFAULT_SUBNETS}{sn}-24");
            put(&mut c, &key, &value([1, 1, 1, 1]), 86400).await?;
        }

        // A previous subnet that is free and in range is taken exactly.
        let prev = PreviousSubnets {
            ipv4: Some(net("10.3.6.0/24")),
            ipv6: None,
        };
        let l = m.acquire_lease(&attrs([5, 5, 5, 5]), &prev).await?;
        assert_eq!(l.subnet, Some(net("10.3.6.0/24")));

        // A new node gets a free subnet inside [SubnetMin, SubnetMax].
        let mut free: BTreeSet<Ipv4Net> =
            (7..=25).map(|i| net(&format!("10.3.{i}.0/24"))).collect();
        free.insert(net("10.3.3.0/24"));
        let mine = m
            .acquire_lease(&attrs([1, 2, 3, 4]), &no_previous())
            .await?;
        let sn = mine.subnet.context("no subnet")?;
        assert!(free.contains(&sn), "{sn}");
        let again = m
            .acquire_lease(&attrs([1, 2, 3, 4]), &no_previous())
            .await?;
        assert_eq!(again.subnet, Some(sn));

        // A previous subnet outside the network is not handed out.
        let prev = PreviousSubnets {
            ipv4: Some(net("10.4.1.0/24")),
            ipv6: None,
        };
        let other = m.acquire_lease(&attrs([6, 6, 6, 6]), &prev).await?;
        let osn = other.subnet.context("no subnet")?;
        assert!(free.contains(&osn) && osn != sn, "{osn}");

        // Config changed: the old lease no longer fits; it is deleted, a new one allocated.
        put_config(&mut c, r#"{ "Network": "10.4.0.0/16" }"#).await?;
        let moved = m
            .acquire_lease(&attrs([1, 2, 3, 4]), &no_previous())
            .await?;
        let msn = moved.subnet.context("no subnet")?;
        assert!(
            net("10.4.0.0/16").contains(&msn) && msn.prefix_len() == 24,
            "{msn}"
        );
        let all = keys(&mut c, DEFAULT_SUBNETS).await?;
        assert!(
            !all.contains(&format!("{DEFAULT_SUBNETS}{}-24", sn.addr())),
            "{all:?}"
        );
        assert!(
            all.contains(&format!("{DEFAULT_SUBNETS}{}-24", msn.addr())),
            "{all:?}"
        );
        assert_eq!(all.len(), 8, "{all:?}");
        Ok(())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn previous_subnet_from_subnet_env_is_honoured() {
    let Some(etcd) = start_etcd() else { return };
    deadline(60, async {
        let m = manager(&etcd).await?;
        let mut c = client(&etcd).await?;
        put_config(&mut c, MOCK_CONFIG).await?;
        let dir = tempfile::tempdir()?;
        let env = dir.path().join("subnet.env");
        std::fs::write(
            &env,
            "FLANNEL_NETWORK=10.3.0.0/16\nFLANNEL_SUBNET=10.3.17.1/24\nFLANNEL_MTU=1450\n\
             FLANNEL_IPMASQ=false\n",
        )?;
        let prev = flannel_agent::subnet_env::previous_subnets(&env);
        assert_eq!(prev.ipv4, Some(net("10.3.17.0/24")));
        let l = m.acquire_lease(&attrs([7, 7, 7, 7]), &prev).await?;
        assert_eq!(l.subnet, Some(net("10.3.17.0/24")));
        let (v, _, ttl, _) = read(&mut c, &format!("{DEFAULT_SUBNETS}10.3.17.0-24"))
            .await?
            .context("key missing")?;
        assert_eq!(v, r#"{"PublicIP":"7.7.7.7","PublicIPv6":null}"#);
        assert!(ttl > 86000, "{ttl}");
        Ok(())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reservation_without_ttl_stays_permanent() {
    let Some(etcd) = start_etcd() else { return };
    deadline(60, async {
        let m = manager(&etcd).await?;
        let mut c = client(&etcd).await?;
        put_config(&mut c, MOCK_CONFIG).await?;
        let key = format!("{DEFAULT_SUBNETS}10.3.9.0-24");
        put(&mut c, &key, &value([1, 2, 3, 4]), 0).await?;
        let mut a = attrs([1, 2, 3, 4]);
        a.backend_type = "host-gw".into();
        let l = m.acquire_lease(&a, &no_previous()).await?;
        assert_eq!(l.subnet, Some(net("10.3.9.0/24")));
        assert_eq!(l.expiration, None);
        let (v, id, _, _) = read(&mut c, &key).await?.context("key missing")?;
        assert_eq!(
            v,
            r#"{"PublicIP":"1.2.3.4","PublicIPv6":null,"BackendType":"host-gw"}"#
        );
        assert_eq!(id, 0, "the reservation got a TTL");
        Ok(())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn undecodable_values_keep_their_subnet_and_a_full_pool_is_out_of_subnets() {
    let Some(etcd) = start_etcd() else { return };
    deadline(60, async {
        let m = manager(&etcd).await?;
        let mut c = client(&etcd).await?;
        // /28 in /30s: 10.0.0.4, 10.0.0.8 and 10.0.0.12 can be handed out.
        put_config(&mut c, r#"{"Network": "10.0.0.0/28", "SubnetLen": 30}"#).await?;
        put(
            &mut c,
            &format!("{DEFAULT_SUBNETS}10.0.0.4-30"),
            "garbage",
            0,
        )
        .await?;
        put(
            &mut c,
            &format!("{DEFAULT_SUBNETS}10.0.0.8-30"),
            r#"{"PublicIP":"not an address"}"#,
            60,
        )
        .await?;
        put(&mut c, &format!("{DEFAULT_SUBNETS}not-a-subnet"), "{}", 0).await?;
        for _ in 0..3 {
            let l = m
                .acquire_lease(&attrs([1, 1, 1, 1]), &no_previous())
                .await?;
            assert_eq!(l.subnet, Some(net("10.0.0.12/30")));
        }
        let e = m
            .acquire_lease(&attrs([2, 2, 2, 2]), &no_previous())
            .await
            .unwrap_err();
        assert_eq!(e.to_string(), "out of subnets");
        // The bad entries are untouched.
        let (v, ..) = read(&mut c, &format!("{DEFAULT_SUBNETS}10.0.0.4-30"))
            .await?
            .context("key missing")?;
        assert_eq!(v, "garbage");
        Ok(())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_agents_at_once_get_ten_distinct_subnets() {
    let Some(etcd) = start_etcd() else { return };
    deadline(120, async {
        let mut c = client(&etcd).await?;
        // Twelve subnets for ten nodes: random picks collide and must be retried.
        put_config(
            &mut c,
            r#"{"Network": "10.6.0.0/16", "SubnetMin": "10.6.1.0", "SubnetMax": "10.6.12.0"}"#,
        )
        .await?;
        let mut managers = Vec::new();
        for _ in 0..10 {
            managers.push(manager(&etcd).await?);
        }
        let barrier = Arc::new(tokio::sync::Barrier::new(10));
        let tasks: Vec<_> = managers
            .into_iter()
            .enumerate()
            .map(|(i, m)| {
                let barrier = barrier.clone();
                tokio::spawn(async move {
                    barrier.wait().await;
                    m.acquire_lease(&attrs([10, 0, 0, i as u8 + 1]), &no_previous())
                        .await
                })
            })
            .collect();
        let mut subnets = BTreeSet::new();
        for (i, t) in tasks.into_iter().enumerate() {
            let lease = t.await??;
            assert_eq!(lease.attrs.public_ip, Ipv4Addr::new(10, 0, 0, i as u8 + 1));
            subnets.insert(lease.subnet.context("no subnet")?);
        }
        assert_eq!(subnets.len(), 10, "{subnets:?}");
        // etcd agrees: ten keys, each with its node's value, and no leaked etcd leases
        // (the losers of a race revoke what they granted).
        let resp = c
            .get(DEFAULT_SUBNETS, Some(GetOptions::new().with_prefix()))
            .await?;
        assert_eq!(resp.kvs().len(), 10);
        let ips: BTreeSet<String> = resp
            .kvs()
            .iter()
            .map(|kv| {
                LeaseAttrs::from_json(kv.value_str().unwrap())
                    .unwrap()
                    .public_ip
                    .to_string()
            })
            .collect();
        assert_eq!(ips.len(), 10);
        assert_eq!(c.leases().await?.leases().len(), 10);
        Ok(())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_race_is_retried_and_exhausted_retries_are_reported() {
    let Some(etcd) = start_etcd() else { return };
    deadline(60, async {
        let mut c = client(&etcd).await?;
        put_config(&mut c, MOCK_CONFIG).await?;

        // Another node writes the chosen key between our listing and our transaction.
        let mut m = manager(&etcd).await?;
        let calls = Arc::new(AtomicUsize::new(0));
        let stolen = Arc::new(Mutex::new(Vec::<String>::new()));
        let (hc, hcalls, hstolen) = (c.clone(), calls.clone(), stolen.clone());
        m.set_before_write_hook(Arc::new(move |key: String| {
            let mut hc = hc.clone();
            let first = hcalls.fetch_add(1, Ordering::SeqCst) == 0;
            let hstolen = hstolen.clone();
            Box::pin(async move {
                if first {
                    hc.put(key.as_str(), value([9, 9, 9, 9]), None)
                        .await
                        .unwrap();
                    hstolen.lock().unwrap().push(key);
                }
            })
        }));
        let l = m
            .acquire_lease(&attrs([1, 2, 3, 4]), &no_previous())
            .await?;
        assert_eq!(calls.load(Ordering::SeqCst), 2);
        let stolen_key = stolen.lock().unwrap()[0].clone();
        let mine = m.lease_key(&l).context("no key")?;
        assert_ne!(mine, stolen_key);
        let (v, ..) = read(&mut c, &stolen_key).await?.context("stolen key")?;
        assert_eq!(
            v,
            value([9, 9, 9, 9]),
            "the other node's lease was overwritten"
        );
        let (v, ..) = read(&mut c, &mine).await?.context("own key")?;
        assert_eq!(v, value([1, 2, 3, 4]));
        // The etcd lease granted for the lost attempt was revoked.
        assert_eq!(c.leases().await?.leases().len(), 1);

        // Always losing: a clear error after the configured number of attempts.
        let mut m = EtcdSubnetManager::connect(&EtcdOptions {
            tuning: EtcdTuning {
                race_attempts: 3,
                ..EtcdTuning::default()
            },
            ..options(&etcd)
        })
        .await?;
        let hc = c.clone();
        m.set_before_write_hook(Arc::new(move |key: String| {
            let mut hc = hc.clone();
            Box::pin(async move {
                hc.put(key.as_str(), value([8, 8, 8, 8]), None)
                    .await
                    .unwrap();
            })
        }));
        let e = m
            .acquire_lease(&attrs([4, 4, 4, 4]), &no_previous())
            .await
            .unwrap_err();
        assert!(
            matches!(e, EtcdError::RaceRetriesExhausted { attempts: 3 }),
            "{e:?}"
        );
        assert!(
            e.to_string()
                .starts_with("max retries reached trying to acquire a subnet")
        );
        assert_eq!(c.leases().await?.leases().len(), 1);
        Ok(())
    })
    .await;
}

// ---------------------------------------------------------------------------------------------
// keep_lease
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renewal_keeps_the_value_and_restores_the_full_ttl() {
    let Some(etcd) = start_etcd() else { return };
    deadline(60, async {
        let mut c = client(&etcd).await?;
        put_config(&mut c, MOCK_CONFIG).await?;
        // Renew 2 s after acquisition: a margin of TTL - 2 s.
        let m = EtcdSubnetManager::connect(&EtcdOptions {
            tuning: EtcdTuning {
                renew_margin: Duration::from_secs(86400 - 2),
                ..EtcdTuning::default()
            },
            ..options(&etcd)
        })
        .await?;
        let a = LeaseAttrs::from_json(
            r#"{"PublicIP":"1.2.3.4","BackendType":"vxlan","BackendData":{"Dummy":"test string"}}"#,
        )?;
        let lease = m.acquire_lease(&a, &no_previous()).await?;
        let key = m.lease_key(&lease).context("no key")?;
        let (v0, id0, ..) = read(&mut c, &key).await?.context("key missing")?;

        let cancel = CancellationToken::new();
        let keeper = tokio::spawn({
            let (m, cancel) = (m.clone(), cancel.clone());
            async move { m.keep_lease(lease, cancel).await }
        });
        tokio::time::sleep(Duration::from_secs(4)).await;
        let (v1, id1, ttl1, _) = read(&mut c, &key).await?.context("key missing")?;
        assert_ne!(id1, id0, "not renewed");
        assert_eq!(v1, v0);
        let decoded = LeaseAttrs::from_json(&v1)?;
        assert_eq!(decoded.public_ip, Ipv4Addr::new(1, 2, 3, 4));
        assert_eq!(decoded.backend_type, "vxlan");
        assert_eq!(
            decoded
                .backend_data
                .map(|d| d.as_str().to_owned())
                .as_deref(),
            Some(r#"{"Dummy":"test string"}"#)
        );
        assert!((86390..=86400).contains(&ttl1), "{ttl1}");

        cancel.cancel();
        let r = tokio::time::timeout(Duration::from_secs(2), keeper).await??;
        assert!(r.is_ok(), "{r:?}");
        Ok(())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn short_ttl_lease_outlives_its_ttl_through_renewals() {
    let Some(etcd) = start_etcd() else { return };
    deadline(60, async {
        let mut c = client(&etcd).await?;
        put_config(&mut c, MOCK_CONFIG).await?;
        let m = EtcdSubnetManager::connect(&EtcdOptions {
            tuning: EtcdTuning {
                lease_ttl: Duration::from_secs(4),
                renew_margin: Duration::from_secs(2),
                ..EtcdTuning::default()
            },
            ..options(&etcd)
        })
        .await?;
        let lease = m
            .acquire_lease(&attrs([1, 2, 3, 4]), &no_previous())
            .await?;
        let key = m.lease_key(&lease).context("no key")?;
        let value0 = read(&mut c, &key).await?.context("key missing")?.0;
        let cancel = CancellationToken::new();
        let keeper = tokio::spawn({
            let (m, cancel) = (m.clone(), cancel.clone());
            async move { m.keep_lease(lease, cancel).await }
        });
        let mut ids = BTreeSet::new();
        for _ in 0..9 {
            tokio::time::sleep(Duration::from_secs(1)).await;
            let (v, id, ttl, _) = read(&mut c, &key).await?.context("lease expired")?;
            assert_eq!(v, value0);
            assert!((0..=4).contains(&ttl), "{ttl}");
            ids.insert(id);
        }
        assert!(ids.len() >= 3, "renewed {} times", ids.len() - 1);
        // Replaced etcd leases were revoked, not left to expire.
        assert!(c.leases().await?.leases().len() <= 2);
        assert!(!keeper.is_finished());
        cancel.cancel();
        tokio::time::timeout(Duration::from_secs(2), keeper).await???;
        Ok(())
    })
    .await;
}

/// Acquires a lease for `ip` and keeps it in a task until the task ends: its key and the task.
async fn kept_lease(
    m: &EtcdSubnetManager,
    ip: [u8; 4],
) -> Result<(String, tokio::task::JoinHandle<Result<(), EtcdError>>)> {
    let lease = m.acquire_lease(&attrs(ip), &no_previous()).await?;
    let key = m.lease_key(&lease).context("no key")?;
    let keeper = tokio::spawn({
        let m = m.clone();
        async move { m.keep_lease(lease, CancellationToken::new()).await }
    });
    Ok((key, keeper))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleting_or_revoking_the_own_key_revokes_the_lease() {
    let Some(etcd) = start_etcd() else { return };
    deadline(60, async {
        let m = manager(&etcd).await?;
        let mut c = client(&etcd).await?;
        put_config(&mut c, MOCK_CONFIG).await?;

        // Deleted by hand.
        let (key, keeper) = kept_lease(&m, [1, 2, 3, 4]).await?;
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert!(!keeper.is_finished());
        c.delete(key.as_str(), None).await?;
        let r = tokio::time::timeout(Duration::from_secs(3), keeper).await??;
        let e = r.unwrap_err();
        assert!(matches!(e, EtcdError::LeaseRevoked), "{e:?}");
        assert_eq!(e.to_string(), "Lease has been revoked");

        // Its etcd lease revoked (what expiry looks like).
        let (key, keeper) = kept_lease(&m, [1, 2, 3, 5]).await?;
        tokio::time::sleep(Duration::from_millis(500)).await;
        let (_, id, ..) = read(&mut c, &key).await?.context("key missing")?;
        c.lease_revoke(id).await?;
        let r = tokio::time::timeout(Duration::from_secs(3), keeper).await??;
        assert!(matches!(r, Err(EtcdError::LeaseRevoked)), "{r:?}");

        // A lease whose key is already gone is revoked at once.
        let lease = m
            .acquire_lease(&attrs([1, 2, 3, 6]), &no_previous())
            .await?;
        c.delete(m.lease_key(&lease).context("no key")?.as_str(), None)
            .await?;
        let r = tokio::time::timeout(
            Duration::from_secs(3),
            m.keep_lease(lease, CancellationToken::new()),
        )
        .await?;
        assert!(matches!(r, Err(EtcdError::LeaseRevoked)), "{r:?}");
        Ok(())
    })
    .await;
}

/// Someone changes the own lease's value (a hand edit, a tool): it is written back within a
/// second, on the same etcd lease, where upstream puts it back at its next renewal, up to a
/// day later; a reservation (the key put without an etcd lease) is its maker's and kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changed_own_lease_value_is_written_back() {
    let Some(etcd) = start_etcd() else { return };
    deadline(60, async {
        let m = manager(&etcd).await?;
        let mut c = client(&etcd).await?;
        put_config(&mut c, MOCK_CONFIG).await?;
        let (key, keeper) = kept_lease(&m, [1, 2, 3, 4]).await?;
        let (ours, id, ..) = read(&mut c, &key).await?.context("key missing")?;
        tokio::time::sleep(Duration::from_millis(500)).await;

        for ip in [[9, 9, 9, 9], [8, 8, 8, 8]] {
            c.put(
                key.as_str(),
                value(ip),
                Some(etcd_client::PutOptions::new().with_lease(id)),
            )
            .await?;
            let back = async {
                loop {
                    let (v, now_id, ttl, _) = read(&mut c, &key).await?.context("key gone")?;
                    if v == ours {
                        return Ok::<_, anyhow::Error>((now_id, ttl));
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            };
            let (now_id, ttl) = tokio::time::timeout(Duration::from_secs(5), back)
                .await
                .context("the value was not written back")??;
            assert_eq!(now_id, id, "moved off its etcd lease");
            assert!(ttl > 86000, "{ttl}");
        }

        // A reservation with another address stays as its maker wrote it.
        c.put(key.as_str(), value([7, 7, 7, 7]), None).await?;
        tokio::time::sleep(Duration::from_secs(2)).await;
        let (v, now_id, ..) = read(&mut c, &key).await?.context("key gone")?;
        assert_eq!((v, now_id), (value([7, 7, 7, 7]), 0));
        assert!(!keeper.is_finished());
        keeper.abort();
        Ok(())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deletion_while_disconnected_is_noticed_even_past_compaction() {
    let Some(mut etcd) = start_etcd() else { return };
    deadline(90, async {
        let mut c = client(&etcd).await?;
        put_config(&mut c, MOCK_CONFIG).await?;
        // A long back-off keeps the keeper away while the store changes underneath.
        let m = EtcdSubnetManager::connect(&EtcdOptions {
            tuning: EtcdTuning {
                backoff_min: Duration::from_secs(8),
                backoff_max: Duration::from_secs(8),
                ..EtcdTuning::default()
            },
            ..options(&etcd)
        })
        .await?;
        let (key, keeper) = kept_lease(&m, [1, 2, 3, 4]).await?;
        tokio::time::sleep(Duration::from_millis(500)).await;
        bounce(&mut etcd, Duration::from_millis(200));
        let mut c = client(&etcd).await?;
        c.delete(key.as_str(), None).await?;
        churn_and_compact(&mut c, 20).await?;
        assert!(
            !keeper.is_finished(),
            "the keeper should still be backing off"
        );
        let r = tokio::time::timeout(Duration::from_secs(20), keeper).await??;
        assert!(matches!(r, Err(EtcdError::LeaseRevoked)), "{r:?}");
        Ok(())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keep_lease_survives_an_etcd_restart_without_hot_looping() {
    let Some(mut etcd) = start_etcd() else { return };
    let logs = logs();
    deadline(60, async {
        let prefix = "/keep-restart/network";
        let m =
            EtcdSubnetManager::connect(&options_with(&etcd, prefix, EtcdTuning::default())).await?;
        let mut c = client(&etcd).await?;
        c.put(format!("{prefix}/config"), MOCK_CONFIG, None).await?;
        let (key, keeper) = kept_lease(&m, [1, 2, 3, 4]).await?;
        tokio::time::sleep(Duration::from_millis(500)).await;
        bounce(&mut etcd, Duration::from_secs(3));
        // Let the keeper reconnect, then make sure it still watches.
        tokio::time::sleep(Duration::from_secs(6)).await;
        assert!(!keeper.is_finished());
        let failures = logs.count(&format!("watch of own lease {key} failed"));
        assert!(
            (1..=10).contains(&failures),
            "{failures} failed watch attempts"
        );
        let mut c = client(&etcd).await?;
        c.delete(key.as_str(), None).await?;
        let r = tokio::time::timeout(Duration::from_secs(3), keeper).await??;
        assert!(matches!(r, Err(EtcdError::LeaseRevoked)), "{r:?}");
        Ok(())
    })
    .await;
}

// ---------------------------------------------------------------------------------------------
// watch_leases
// ---------------------------------------------------------------------------------------------

/// Acquires `10.5.1.0/24` for 10.0.0.1 under `prefix` and starts watching all leases.
async fn start_watch(
    m: &EtcdSubnetManager,
    c: &mut Client,
    prefix: &str,
) -> Result<(watch::Receiver<LeaseSnapshot>, CancellationToken, Lease)> {
    c.put(
        format!("{prefix}/config"),
        r#"{"Network": "10.5.0.0/16"}"#,
        None,
    )
    .await?;
    let prev = PreviousSubnets {
        ipv4: Some(net("10.5.1.0/24")),
        ipv6: None,
    };
    let own = m.acquire_lease(&attrs([10, 0, 0, 1]), &prev).await?;
    ensure!(own.subnet == Some(net("10.5.1.0/24")));
    let (publisher, rx) = lease_channel();
    let cancel = CancellationToken::new();
    tokio::spawn({
        let (m, own, cancel) = (m.clone(), own.clone(), cancel.clone());
        async move { m.watch_leases(&own, publisher, cancel).await }
    });
    Ok((rx, cancel, own))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_publishes_remote_leases_and_follows_puts_and_deletes() {
    let Some(etcd) = start_etcd() else { return };
    deadline(60, async {
        let prefix = "/watch-basic/network";
        let subnets = format!("{prefix}/subnets/");
        let m =
            EtcdSubnetManager::connect(&options_with(&etcd, prefix, EtcdTuning::default())).await?;
        let mut c = client(&etcd).await?;
        c.put(
            format!("{prefix}/config"),
            r#"{"Network": "10.5.0.0/16"}"#,
            None,
        )
        .await?;
        put(
            &mut c,
            &format!("{subnets}10.5.2.0-24"),
            &value([10, 0, 0, 2]),
            600,
        )
        .await?;
        put(&mut c, &format!("{subnets}10.5.3.0-24"), VXLAN_VALUE, 0).await?;
        let (mut rx, cancel, _own) = start_watch(&m, &mut c, prefix).await?;

        let snap = wait_for(&mut rx, "initial listing", Duration::from_secs(10), |s| {
            has_ids(s, &["10.5.2.0-24", "10.5.3.0-24"])
        })
        .await?;
        let l2 = &snap.leases["10.5.2.0-24"];
        assert_eq!(l2.subnet, Some(net("10.5.2.0/24")));
        assert_eq!(l2.attrs, attrs([10, 0, 0, 2]));
        assert_eq!(snap.leases["10.5.3.0-24"].attrs.to_json(), VXLAN_VALUE);

        put(
            &mut c,
            &format!("{subnets}10.5.4.0-24"),
            &value([10, 0, 0, 4]),
            0,
        )
        .await?;
        wait_for(&mut rx, "put", Duration::from_secs(5), |s| {
            has_ids(s, &["10.5.2.0-24", "10.5.3.0-24", "10.5.4.0-24"])
        })
        .await?;
        c.delete(format!("{subnets}10.5.2.0-24"), None).await?;
        wait_for(&mut rx, "delete", Duration::from_secs(5), |s| {
            has_ids(s, &["10.5.3.0-24", "10.5.4.0-24"])
        })
        .await?;
        put(
            &mut c,
            &format!("{subnets}10.5.4.0-24"),
            &value([10, 0, 0, 44]),
            0,
        )
        .await?;
        wait_for(&mut rx, "update", Duration::from_secs(5), |s| {
            s.leases
                .get("10.5.4.0-24")
                .is_some_and(|l| l.attrs.public_ip == Ipv4Addr::new(10, 0, 0, 44))
        })
        .await?;
        // A lease with a short TTL disappears when it expires.
        put(
            &mut c,
            &format!("{subnets}10.5.7.0-24"),
            &value([10, 0, 0, 7]),
            2,
        )
        .await?;
        wait_for(&mut rx, "short lease", Duration::from_secs(5), |s| {
            s.leases.contains_key("10.5.7.0-24")
        })
        .await?;
        wait_for(&mut rx, "expiry", Duration::from_secs(10), |s| {
            has_ids(s, &["10.5.3.0-24", "10.5.4.0-24"])
        })
        .await?;
        cancel.cancel();
        Ok(())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_lease_is_skipped_and_logged_once() {
    let Some(etcd) = start_etcd() else { return };
    let logs = logs();
    deadline(60, async {
        let prefix = "/watch-malformed/network";
        let subnets = format!("{prefix}/subnets/");
        let m =
            EtcdSubnetManager::connect(&options_with(&etcd, prefix, EtcdTuning::default())).await?;
        let mut c = client(&etcd).await?;
        c.put(
            format!("{prefix}/config"),
            r#"{"Network": "10.5.0.0/16"}"#,
            None,
        )
        .await?;
        let bad = format!("{subnets}10.5.5.0-24");
        put(&mut c, &bad, r#"{"PublicIP":"nope"}"#, 0).await?;
        put(&mut c, &format!("{subnets}10.5.1000.0-24"), "{}", 0).await?;
        put(
            &mut c,
            &format!("{subnets}10.5.6.0-24"),
            &value([10, 0, 0, 6]),
            0,
        )
        .await?;
        let (mut rx, cancel, _own) = start_watch(&m, &mut c, prefix).await?;
        wait_for(&mut rx, "listing", Duration::from_secs(10), |s| {
            has_ids(s, &["10.5.6.0-24"])
        })
        .await?;
        // Other traffic does not repeat the warning.
        put(
            &mut c,
            &format!("{subnets}10.5.8.0-24"),
            &value([10, 0, 0, 8]),
            0,
        )
        .await?;
        wait_for(&mut rx, "other put", Duration::from_secs(5), |s| {
            has_ids(s, &["10.5.6.0-24", "10.5.8.0-24"])
        })
        .await?;
        assert_eq!(logs.count(&format!("ignoring lease {bad} ")), 1);
        // A valid lease turning bad leaves the set; fixed, it comes back.
        put(&mut c, &format!("{subnets}10.5.8.0-24"), "[]", 0).await?;
        wait_for(&mut rx, "turned bad", Duration::from_secs(5), |s| {
            has_ids(s, &["10.5.6.0-24"])
        })
        .await?;
        put(&mut c, &bad, &value([10, 0, 0, 5]), 0).await?;
        wait_for(&mut rx, "fixed", Duration::from_secs(5), |s| {
            has_ids(s, &["10.5.5.0-24", "10.5.6.0-24"])
        })
        .await?;
        assert_eq!(logs.count(&format!("ignoring lease {bad} ")), 1);
        cancel.cancel();
        Ok(())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_resumes_after_an_etcd_restart_without_hot_looping() {
    let Some(mut etcd) = start_etcd() else { return };
    let logs = logs();
    deadline(90, async {
        let prefix = "/watch-restart/network";
        let subnets = format!("{prefix}/subnets/");
        let m =
            EtcdSubnetManager::connect(&options_with(&etcd, prefix, EtcdTuning::default())).await?;
        let mut c = client(&etcd).await?;
        put(
            &mut c,
            &format!("{subnets}10.5.2.0-24"),
            &value([10, 0, 0, 2]),
            0,
        )
        .await?;
        put(
            &mut c,
            &format!("{subnets}10.5.3.0-24"),
            &value([10, 0, 0, 3]),
            0,
        )
        .await?;
        let (mut rx, cancel, _own) = start_watch(&m, &mut c, prefix).await?;
        wait_for(&mut rx, "listing", Duration::from_secs(10), |s| {
            has_ids(s, &["10.5.2.0-24", "10.5.3.0-24"])
        })
        .await?;

        bounce(&mut etcd, Duration::from_secs(3));
        let mut c = client(&etcd).await?;
        c.delete(format!("{subnets}10.5.2.0-24"), None).await?;
        put(
            &mut c,
            &format!("{subnets}10.5.9.0-24"),
            &value([10, 0, 0, 9]),
            0,
        )
        .await?;
        wait_for(&mut rx, "after restart", Duration::from_secs(20), |s| {
            has_ids(s, &["10.5.3.0-24", "10.5.9.0-24"])
        })
        .await?;
        // And it keeps following.
        put(
            &mut c,
            &format!("{subnets}10.5.10.0-24"),
            &value([10, 0, 0, 10]),
            0,
        )
        .await?;
        wait_for(&mut rx, "later put", Duration::from_secs(10), |s| {
            has_ids(s, &["10.5.10.0-24", "10.5.3.0-24", "10.5.9.0-24"])
        })
        .await?;
        // The outage was noticed, and retried with back-off (100 ms, 200 ms, … while etcd
        // was down for 3 s and starting again), not in a tight loop.
        let failures = logs.count(&format!("lease watch under {subnets} failed"));
        assert!(
            (1..=10).contains(&failures),
            "{failures} failed watch attempts"
        );
        cancel.cancel();
        Ok(())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_relists_when_its_revision_was_compacted() {
    let Some(mut etcd) = start_etcd() else { return };
    let logs = logs();
    deadline(90, async {
        let prefix = "/watch-compacted/network";
        let subnets = format!("{prefix}/subnets/");
        // A long back-off keeps the watcher away while the store changes underneath.
        let tuning = EtcdTuning {
            backoff_min: Duration::from_secs(8),
            backoff_max: Duration::from_secs(8),
            ..EtcdTuning::default()
        };
        let m = EtcdSubnetManager::connect(&options_with(&etcd, prefix, tuning)).await?;
        let mut c = client(&etcd).await?;
        c.put(
            format!("{prefix}/config"),
            r#"{"Network": "10.5.0.0/16"}"#,
            None,
        )
        .await?;
        put(
            &mut c,
            &format!("{subnets}10.5.2.0-24"),
            &value([10, 0, 0, 2]),
            0,
        )
        .await?;
        put(
            &mut c,
            &format!("{subnets}10.5.3.0-24"),
            &value([10, 0, 0, 3]),
            0,
        )
        .await?;
        let bad = format!("{subnets}10.5.4.0-24");
        put(&mut c, &bad, "not json", 0).await?;
        let (mut rx, cancel, _own) = start_watch(&m, &mut c, prefix).await?;
        wait_for(&mut rx, "listing", Duration::from_secs(10), |s| {
            has_ids(s, &["10.5.2.0-24", "10.5.3.0-24"])
        })
        .await?;
        let generation = rx.borrow().generation;

        bounce(&mut etcd, Duration::from_millis(200));
        let mut c = client(&etcd).await?;
        c.delete(format!("{subnets}10.5.2.0-24"), None).await?;
        put(
            &mut c,
            &format!("{subnets}10.5.11.0-24"),
            &value([10, 0, 0, 11]),
            0,
        )
        .await?;
        churn_and_compact(&mut c, 20).await?;
        assert_eq!(
            rx.borrow().generation,
            generation,
            "the watcher should be backing off"
        );

        let snap = wait_for(&mut rx, "after compaction", Duration::from_secs(20), |s| {
            has_ids(s, &["10.5.11.0-24", "10.5.3.0-24"])
        })
        .await?;
        // One replace_all: the deletion and the addition arrive together.
        assert_eq!(snap.generation, generation + 1);
        assert_eq!(
            logs.count(&format!(
                "lease watch under {subnets} fell behind the compaction"
            )),
            1
        );
        // The bad value was listed twice but logged once.
        assert_eq!(logs.count(&format!("ignoring lease {bad} ")), 1);
        put(
            &mut c,
            &format!("{subnets}10.5.12.0-24"),
            &value([10, 0, 0, 12]),
            0,
        )
        .await?;
        wait_for(&mut rx, "later put", Duration::from_secs(10), |s| {
            has_ids(s, &["10.5.11.0-24", "10.5.12.0-24", "10.5.3.0-24"])
        })
        .await?;
        cancel.cancel();
        Ok(())
    })
    .await;
}

// ---------------------------------------------------------------------------------------------
// Credentials and TLS
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn username_and_password_authenticate() {
    let Some(etcd) = start_etcd() else { return };
    deadline(60, async {
        let mut c = client(&etcd).await?;
        c.user_add("root", "rootpw", None).await?;
        c.user_grant_role("root", "root").await?;
        c.auth_enable().await?;

        let with = |user: Option<&str>, password: &str| EtcdOptions {
            username: user.map(str::to_owned),
            password: Some(flannel_agent::backend::Secret::new(password.to_owned())),
            ..options(&etcd)
        };
        let m = EtcdSubnetManager::connect(&with(Some("root"), "rootpw")).await?;
        assert!(matches!(
            m.network_config().await,
            Err(EtcdError::ConfigNotFound)
        ));
        let e = EtcdSubnetManager::connect(&with(Some("root"), "wrong"))
            .await
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with(&format!("cannot connect to etcd at {}: ", etcd.endpoint())),
            "{e}"
        );
        let anonymous = EtcdSubnetManager::connect(&with(None, "")).await?;
        let e = anonymous.network_config().await.unwrap_err();
        assert!(matches!(e, EtcdError::Request { .. }), "{e:?}");
        Ok(())
    })
    .await;
}

/// An etcd serving TLS on loopback that requires client certificates, with its own CA.
struct TlsEtcd {
    dir: tempfile::TempDir,
    port: u16,
    child: std::process::Child,
}

impl TlsEtcd {
    fn start() -> Result<Self> {
        let dir = tempfile::Builder::new()
            .prefix("flannel-etcd-tls")
            .tempdir()?;
        let d = dir.path();
        let openssl = |args: &[&str]| -> Result<()> {
            let out = std::process::Command::new("openssl")
                .args(args)
                .current_dir(d)
                .output()
                .context("running openssl")?;
            ensure!(
                out.status.success(),
                "openssl {args:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            Ok(())
        };
        let ec = [
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
        ];
        openssl(
            &[
                &["req", "-x509"][..],
                &ec,
                &[
                    "-keyout",
                    "ca.key",
                    "-out",
                    "ca.pem",
                    "-days",
                    "2",
                    "-subj",
                    "/CN=flannel test CA",
                ],
                &["-addext", "basicConstraints=critical,CA:TRUE"],
                &["-addext", "keyUsage=critical,keyCertSign,cRLSign"],
            ]
            .concat(),
        )?;
        for (name, usage) in [("server", "serverAuth"), ("client", "clientAuth")] {
            openssl(
                &[
                    &["req"][..],
                    &ec,
                    &[
                        "-keyout",
                        &format!("{name}.key"),
                        "-out",
                        &format!("{name}.csr"),
                    ],
                    &["-subj", &format!("/CN={name}")],
                ]
                .concat(),
            )?;
            std::fs::write(
                d.join(format!("{name}.ext")),
                format!(
                    "subjectAltName=IP:127.0.0.1\nextendedKeyUsage={usage}\n\
                     basicConstraints=CA:FALSE\nkeyUsage=digitalSignature\n"
                ),
            )?;
            openssl(&[
                "x509",
                "-req",
                "-in",
                &format!("{name}.csr"),
                "-CA",
                "ca.pem",
                "-CAkey",
                "ca.key",
                "-CAcreateserial",
                "-days",
                "2",
                "-out",
                &format!("{name}.pem"),
                "-extfile",
                &format!("{name}.ext"),
            ])?;
        }
        let free = || -> Result<u16> {
            Ok(std::net::TcpListener::bind("127.0.0.1:0")?
                .local_addr()?
                .port())
        };
        let (port, peer) = (free()?, free()?);
        let client_url = format!("https://127.0.0.1:{port}");
        let peer_url = format!("http://127.0.0.1:{peer}");
        let log = std::fs::File::create(d.join("etcd.log"))?;
        let child = std::process::Command::new("etcd")
            .args(["--name", "default", "--data-dir"])
            .arg(d.join("data"))
            .args([
                "--listen-client-urls",
                &client_url,
                "--advertise-client-urls",
                &client_url,
            ])
            .args([
                "--listen-peer-urls",
                &peer_url,
                "--initial-advertise-peer-urls",
                &peer_url,
            ])
            .args(["--initial-cluster", &format!("default={peer_url}")])
            .arg("--cert-file")
            .arg(d.join("server.pem"))
            .arg("--key-file")
            .arg(d.join("server.key"))
            .arg("--trusted-ca-file")
            .arg(d.join("ca.pem"))
            .args(["--client-cert-auth", "--log-level", "error"])
            .stdin(std::process::Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()?;
        let etcd = TlsEtcd { dir, port, child };
        // Ready once the port accepts connections.
        let until = std::time::Instant::now() + Duration::from_secs(20);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            ensure!(std::time::Instant::now() < until, "TLS etcd did not start");
            std::thread::sleep(Duration::from_millis(100));
        }
        Ok(etcd)
    }

    fn file(&self, name: &str) -> std::path::PathBuf {
        self.dir.path().join(name)
    }
}

impl Drop for TlsEtcd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_with_client_certificate() {
    if start_etcd().is_none() {
        return;
    }
    let etcd = tokio::task::block_in_place(TlsEtcd::start).unwrap();
    deadline(60, async {
        let endpoint = format!("https://127.0.0.1:{}", etcd.port);
        let tuning = EtcdTuning {
            request_timeout: Duration::from_secs(3),
            ..EtcdTuning::default()
        };
        let full = EtcdOptions {
            endpoints: vec![endpoint.clone()],
            cafile: Some(etcd.file("ca.pem")),
            certfile: Some(etcd.file("client.pem")),
            keyfile: Some(etcd.file("client.key")),
            tuning,
            ..EtcdOptions::default()
        };
        // A full round trip: the server answers "no config".
        let m = EtcdSubnetManager::connect(&full).await?;
        let mut answered = false;
        for _ in 0..50 {
            match m.network_config().await {
                Err(EtcdError::ConfigNotFound) => {
                    answered = true;
                    break;
                }
                Err(e) => eprintln!("waiting for TLS etcd: {e}"),
                Ok(c) => bail!("unexpected config {c:?}"),
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        ensure!(answered, "no answer over TLS");

        // The same endpoint without a client certificate is refused by the server.
        let m = EtcdSubnetManager::connect(&EtcdOptions {
            certfile: None,
            keyfile: None,
            ..full.clone()
        })
        .await?;
        let e = m.network_config().await.unwrap_err().to_string();
        assert!(e.contains(&endpoint), "{e}");
        // Without the CA the server certificate is not trusted.
        let m = EtcdSubnetManager::connect(&EtcdOptions {
            cafile: None,
            ..full.clone()
        })
        .await;
        if let Ok(m) = m {
            assert!(m.network_config().await.is_err());
        }
        Ok(())
    })
    .await;
}
