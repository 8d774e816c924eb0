//! Types shared by the eBPF programs (`flannel-ebpf`) and the agent.
//!
//! Everything here is `#[repr(C)]`, `Copy`, free of implicit padding and of `bool`
//! (use `u32` flags), so the same bytes mean the same thing on both sides of the
//! kernel boundary. With the `user` feature the types implement `aya::Pod`.
//!
//! | module | what |
//! |---|---|
//! | [`maps`] | map names, sizes and the pin layout version |
//! | [`programs`] | program names |
//! | [`stats`] | the per-reason counters and [`stats::Reason`] |
//! | [`route`] | remote subnets ([`route::RemoteEntry`]) and tunnel peers ([`route::NodeEntry`]) |
//! | [`config`] | the local node's configuration ([`config::Config`]) |
//! | [`flow`] | keys of the flow-tracking LRU maps |
//! | [`hops`] | remembered route lookups ([`hops::Hop`]) |
//! | [`memo`] | remembered per-flow decisions ([`memo::FlowMemo`]) and their generation |
//! | [`csum`] | checksums and the VXLAN source port, as pure functions |
//! | [`nat`] | masquerade in eBPF: NAT map layouts, configuration, states, decisions |
//! | [`pmtu`] | ICMP "fragmentation needed" about IPIP packets, rewritten for their sender |
//! | [`udp`] | the udp backend's configuration entry and wire format |
//! | [`pods`] | local pods' bridge ports, for delivery into their namespace |
//! | [`v6`] | IPv6: configuration, flow keys, map names |
#![cfg_attr(not(test), no_std)]

pub mod config;
pub mod csum;
pub mod flow;
pub mod hops;
pub mod maps;
pub mod memo;
pub mod nat;
pub mod pmtu;
pub mod pods;
pub mod programs;
pub mod route;
pub mod stats;
pub mod udp;
pub mod v6;
