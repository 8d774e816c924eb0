//! flannel-agent: a flannel-compatible node agent with an eBPF fast path.
//!
//! The crate is a library with a thin `main.rs`; every module has one job:
//!
//! | module | job |
//! |---|---|
//! | [`cli`] | the command line (upstream's flags and `FLANNELD_*` variables) |
//! | [`netconf`] | `net-conf.json` parsing and validation |
//! | [`ip`] | IPv4/IPv6 subnet arithmetic |
//! | [`lease`] | the lease model, its etcd JSON and key names |
//! | [`alloc`] | choosing a free subnet |
//! | [`subnet_env`] | writing and reading `subnet.env` |
//! | [`iface`] | choosing the external interface and public IP |
//! | [`backend`] | backend options, BackendData and MTU |
//! | [`netlink`] | rtnetlink access (links, addresses, routes, neighbours, FDB) |
//! | [`traffic`] | masquerade and forward rules (iptables / nftables) |

pub mod alloc;
pub mod backend;
pub mod bpf;
pub mod cli;
pub mod iface;
pub mod ip;
pub mod lease;
pub mod netconf;
pub mod netlink;
pub mod subnet_env;
pub mod traffic;

/// The eBPF object built by `build.rs` (empty when built with `AYA_BUILD_SKIP=1`).
pub static EBPF_OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/flannel"));
