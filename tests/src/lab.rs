//! The simulated cluster's moving parts, used by `flannel-lab`, the benchmarks and the
//! agent's integration tests (the network itself is [`crate::topology`]):
//!
//! | module | job |
//! |---|---|
//! | [`process`] | processes in a namespace, killed when their guard drops |
//! | [`agent`] | `flannel-agent` per node: flags, log, stop/kill/restart, RSS |
//! | [`kv`] | etcd from inside a namespace |
//! | [`kube`] | kube mode: the fake API server in the hub, agents with `--kube-subnet-mgr` |
//! | [`lease`] | the network config, lease records, fake leases |
//! | [`probe`] | TCP echo reachability and the pod-to-pod matrix |
//! | [`status`] | kernel route/neighbour/FDB counts, `/healthz` and `/metrics` |
//! | [`cluster`] | everything together: `flannel-lab up` |
//! | [`bins`] | finding (or building) the workspace's binaries |
//! | [`capture`] | packet capture on an interface of a namespace (`AF_PACKET`) |
//! | [`fastpath`] | a node's eBPF fast path: pinned route map, pin ids, packet counters |
//! | [`wait`] | bounded polling with a message on timeout |

pub mod agent;
pub mod bins;
pub mod capture;
pub mod cluster;
pub mod fastpath;
pub mod kube;
pub mod kv;
pub mod lease;
pub mod probe;
pub mod process;
pub mod status;
pub mod wait;
