//! Types shared by the eBPF programs (`flannel-ebpf`) and the agent.
//!
//! Everything here is `#[repr(C)]`, `Copy`, free of implicit padding and of `bool`
//! (use `u32` flags), so the same bytes mean the same thing on both sides of the
//! kernel boundary. With the `user` feature the types implement `aya::Pod`.
#![cfg_attr(not(test), no_std)]

pub mod maps;
pub mod programs;
pub mod stats;
