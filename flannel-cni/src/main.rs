//! `flannel`: the flannel CNI plugin, a drop-in replacement for `flannel-io/cni-plugin`.
//!
//! A meta-plugin: it reads its network config from stdin and flanneld's `subnet.env`, builds
//! the config of a delegate plugin (`bridge` with `host-local` ipam by default) and runs that
//! plugin from `CNI_PATH`. Synchronous and small: kubelet runs it for every pod.

mod cni;
mod config;
mod delegate;
mod invoke;
mod plugin;
mod result;
mod store;
mod subnet_env;
#[cfg(test)]
mod testutil;

use std::io;

fn main() {
    let env = cni::CniEnv::from_getenv(|name| std::env::var(name).ok());
    let code = plugin::run(
        &env,
        &mut io::stdin().lock(),
        &mut io::stdout().lock(),
        &mut io::stderr().lock(),
    );
    std::process::exit(code);
}
