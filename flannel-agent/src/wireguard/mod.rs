//! The wireguard backend (flannel-upstream.md 2.4): the node key, the devices
//! `flannel-wg` / `flannel-wg-v6`, and one WireGuard peer per remote lease.
//!
//! The kernel device is created through rtnetlink and configured through the `wireguard`
//! generic netlink family; where the kernel has no WireGuard (this machine), a userspace
//! implementation (wireguard-go) runs the device over TUN and is configured through its
//! UAPI socket. Both are behind one [`WgDevice`]; which one serves a device is logged.
//!
//! Daemon wiring: before the lease, [`load_key`] and [`lease_data`] give the BackendData;
//! after it, [`WireguardApplier::ensure_devices`] (fatal on error), then the applier is
//! pushed onto the reconciler, which syncs it with the desired model (`Reach::Wireguard`
//! paths) on every reconcile. On shutdown nothing is deleted (upstream deletes the devices
//! and so interrupts traffic on every restart).
//!
//! | file | job |
//! |---|---|
//! | [`key`] | private key: generate, persist (0400), reuse |
//! | [`config`] | `DeviceConfig` / `DeviceState`: the common language of both control channels |
//! | [`uapi`] | the UAPI text protocol over the unix socket (userspace devices) |
//! | [`genl`] | the generic netlink family (kernel devices) |
//! | [`userspace`] | starting and finding wireguard-go (detached, adopted on restart) |
//! | [`device`] | one device: adopt or create, kernel first, userspace fallback |
//! | [`plan`] | desired vs reported peers → one configuration change |
//! | [`applier`] | the dataplane applier: devices, addresses, route, peers |

pub mod applier;
pub mod config;
pub mod device;
pub mod genl;
pub mod key;
pub mod plan;
pub mod uapi;
pub mod userspace;

use std::path::Path;

pub use applier::{DeviceSetup, WireguardApplier};
pub use config::{DeviceConfig, DeviceState, PeerConfig, PeerState};
pub use device::{DeviceError, Ensured, Implementation, WgDevice, ensure_device};
pub use key::{KeyError, KeyOrigin, PrivateKey, load_or_generate};
pub use uapi::{UapiClient, UapiError};
pub use userspace::{STANDARD_SOCKET_DIR, Userspace, UserspaceError};

use crate::{
    backend::{WireguardLeaseData, WireguardMode, WireguardOptions},
    gojson::RawJson,
    ip::IpStack,
    netlink::{IpFamily, NetlinkError},
};

/// The IPv4 (or only) device.
pub const DEVICE_V4: &str = "flannel-wg";
/// The IPv6 device of `separate` mode.
pub const DEVICE_V6: &str = "flannel-wg-v6";

/// Errors of the wireguard backend.
#[derive(Debug, thiserror::Error)]
pub enum WireguardError {
    /// The key file.
    #[error(transparent)]
    Key(#[from] KeyError),
    /// A device could not be created, found or configured.
    #[error(transparent)]
    Device(#[from] DeviceError),
    /// A link operation on a device failed.
    #[error("{what} {device}: {source}")]
    Link {
        /// What was done.
        what: &'static str,
        /// The device.
        device: String,
        /// The error.
        #[source]
        source: NetlinkError,
    },
    /// The device vanished while it was being set up.
    #[error("{0} disappeared while it was being set up")]
    Gone(String),
    /// A family is enabled but the lease lacks it.
    #[error(
        "failed to configure interface {device}: {family} is enabled but the lease has no {family}"
    )]
    LeaseLacksFamily {
        /// The device.
        device: String,
        /// The family.
        family: IpFamily,
    },
}

impl From<UapiError> for WireguardError {
    fn from(e: UapiError) -> Self {
        WireguardError::Device(DeviceError::Uapi(e))
    }
}

/// The devices of `mode` for the enabled families, with the families each carries:
/// `separate` gives `flannel-wg` (IPv4) and `flannel-wg-v6` (IPv6); the single-device modes
/// give `flannel-wg` for every enabled family.
pub fn device_names(mode: WireguardMode, stack: IpStack) -> Vec<(&'static str, Vec<IpFamily>)> {
    let families: Vec<IpFamily> = [IpFamily::V4, IpFamily::V6]
        .into_iter()
        .filter(|f| match f {
            IpFamily::V4 => stack.has_v4(),
            IpFamily::V6 => stack.has_v6(),
        })
        .collect();
    match mode {
        WireguardMode::Separate => families
            .into_iter()
            .map(|f| match f {
                IpFamily::V4 => (DEVICE_V4, vec![f]),
                IpFamily::V6 => (DEVICE_V6, vec![f]),
            })
            .collect(),
        _ if families.is_empty() => Vec::new(),
        _ => vec![(DEVICE_V4, families)],
    }
}

/// Loads the node key from `path`, generating and saving it on first use; logs which.
pub fn load_key(path: &Path) -> Result<PrivateKey, WireguardError> {
    let (key, origin) = load_or_generate(path)?;
    match origin {
        KeyOrigin::Loaded => tracing::info!(
            file = %path.display(),
            public_key = %key.public_key(),
            "using the WireGuard key from the key file"
        ),
        KeyOrigin::Generated => tracing::info!(
            file = %path.display(),
            public_key = %key.public_key(),
            "generated a WireGuard key and saved it"
        ),
    }
    Ok(key)
}

/// The BackendData (IPv4, IPv6) this node publishes: `{"PublicKey":…,"Port":…}` per enabled
/// family. The IPv6 data carries `ListenPortV6` in `separate` mode; in the single-device
/// modes it carries `ListenPort`, the port the one device really listens on (upstream
/// publishes `ListenPortV6` there too, which only works when both ports are equal).
pub fn lease_data(
    options: &WireguardOptions,
    key: &PrivateKey,
    stack: IpStack,
) -> (Option<RawJson>, Option<RawJson>) {
    let public_key = key.public_key();
    let v4 = stack.has_v4().then(|| {
        WireguardLeaseData {
            public_key,
            port: options.listen_port,
        }
        .to_json()
    });
    let v6_port = match options.mode {
        WireguardMode::Separate => options.listen_port_v6,
        _ => options.listen_port,
    };
    let v6 = stack.has_v6().then(|| {
        WireguardLeaseData {
            public_key,
            port: v6_port,
        }
        .to_json()
    });
    (v4, v6)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests fail loudly by design
mod tests {
    use super::*;

    #[test]
    fn device_layout_per_mode() {
        use IpFamily::{V4, V6};
        assert_eq!(
            device_names(WireguardMode::Separate, IpStack::Dual),
            vec![(DEVICE_V4, vec![V4]), (DEVICE_V6, vec![V6])]
        );
        assert_eq!(
            device_names(WireguardMode::Separate, IpStack::V6),
            vec![(DEVICE_V6, vec![V6])]
        );
        for mode in [
            WireguardMode::Auto,
            WireguardMode::Ipv4,
            WireguardMode::Ipv6,
        ] {
            assert_eq!(
                device_names(mode, IpStack::Dual),
                vec![(DEVICE_V4, vec![V4, V6])]
            );
            assert_eq!(device_names(mode, IpStack::V4), vec![(DEVICE_V4, vec![V4])]);
        }
    }

    #[test]
    fn published_data() {
        let key = PrivateKey::from_bytes([7; 32]);
        let pk = key.public_key().to_string();
        let options = WireguardOptions {
            listen_port: 51830,
            listen_port_v6: 51831,
            ..Default::default()
        };
        let (v4, v6) = lease_data(&options, &key, IpStack::Dual);
        assert_eq!(
            v4.unwrap().as_str(),
            format!(r#"{{"PublicKey":"{pk}","Port":51830}}"#)
        );
        assert_eq!(
            v6.unwrap().as_str(),
            format!(r#"{{"PublicKey":"{pk}","Port":51831}}"#)
        );
        let auto = WireguardOptions {
            mode: WireguardMode::Auto,
            ..options
        };
        let (v4, v6) = lease_data(&auto, &key, IpStack::V6);
        assert!(v4.is_none());
        assert_eq!(
            v6.unwrap().as_str(),
            format!(r#"{{"PublicKey":"{pk}","Port":51830}}"#)
        );
    }
}
