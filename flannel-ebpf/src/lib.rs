//! The building blocks of flannel's TC/XDP programs, shared by every entry point in `main.rs`.
//!
//! | module | job |
//! |---|---|
//! | [`parse`] | bounds-checked packet access and the Ethernet → IP → L4 parser/classifier |
//! | [`maps`] | every map of the object |
//! | [`stats`] | counting packets per [`flannel_common::stats::Reason`] |
//!
//! On the bpf target this is `no_std`; on the host it compiles with std so that clippy and the
//! unit tests (`cargo test -p flannel-ebpf --lib`) cover the pure logic.
#![cfg_attr(target_arch = "bpf", no_std)]

pub mod maps;
pub mod parse;
pub mod stats;
