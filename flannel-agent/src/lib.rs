//! flannel-agent: a flannel-compatible node agent with an eBPF fast path.
//!
//! The crate is a library with a thin `main.rs`; every module has one job:
//!
//! | module | job |
//! |---|---|
//! | [`daemon`] | start-up order and the long-running tasks |
//! | [`child_mount`] | a helper process's own mount (charon's `/run`, wireguard-go's sockets) |
//! | [`cli`] | the command line (upstream's flags and `FLANNELD_*` variables) |
//! | [`health`] | `/healthz`, `/readyz` and `/metrics` |
//! | [`metrics`] | Prometheus metrics, including the fast path's counters |
//! | [`netconf`] | `net-conf.json` parsing and validation |
//! | [`gojson`] | JSON with Go `encoding/json` semantics (case-insensitive keys, raw values) |
//! | [`ip`] | IPv4/IPv6 subnet arithmetic |
//! | [`lease`] | the lease model, its etcd JSON and key names |
//! | [`alloc`] | choosing a free subnet |
//! | [`subnet`] | subnet managers (etcd, kube) publishing the current set of leases |
//! | [`subnet_env`] | writing and reading `subnet.env` |
//! | [`iface`] | choosing the external interface and public IP |
//! | [`hostnet`] | reading the interface snapshot for [`iface`] from the kernel |
//! | [`backend`] | backend options, BackendData and MTU |
//! | [`netlink`] | rtnetlink access (links, addresses, routes, neighbours, FDB) |
//! | [`telemetry`] | logging (`-v` levels, `RUST_LOG`) |
//! | [`traffic`] | masquerade and forward rules (iptables / nftables) |
//! | [`dataplane`] | devices, routes, neighbours, FDB: desired state, appliers, reconciler |
//! | [`wireguard`] | the wireguard backend: key, kernel/userspace devices, peers applier |
//! | [`ipsec`] | the ipsec backend: strongSwan over VICI, XFRM policies, ESP detection |
//! | [`udp`] | the udp backend's TUN path: `flannel0`, the UDP socket, the forwarding loops |
//! | [`ipip_rx`] | the eBPF IPIP backend's receive of IPIP packets reassembled by the kernel |
//! | [`node_lock`] | one agent per node (`<--state-dir>/agent.lock`) |
//! | [`pace`] | spacing the rewrites of what something else keeps changing |
//! | [`sorted`] | walking two sorted maps side by side (the appliers' diffs) |

pub mod alloc;
pub mod backend;
pub mod bpf;
pub mod child_mount;
pub mod cli;
pub mod daemon;
pub mod dataplane;
pub mod extension;
pub mod gojson;
pub mod health;
pub mod hostnet;
pub mod iface;
pub mod ip;
pub mod ipip_rx;
pub mod ipsec;
pub mod lease;
pub mod metrics;
pub mod netconf;
pub mod netlink;
pub mod node_lock;
pub mod pace;
pub mod sorted;
pub mod subnet;
pub mod subnet_env;
pub mod telemetry;
#[cfg(test)]
mod test_fuzz;
pub mod traffic;
pub mod udp;
pub mod wireguard;

/// The eBPF object built by `build.rs` (empty when built with `AYA_BUILD_SKIP=1`).
pub static EBPF_OBJECT: &[u8] =
    aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/flannel-ebpf"));
