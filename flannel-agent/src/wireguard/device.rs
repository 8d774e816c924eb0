//! One WireGuard device, kernel or userspace, behind one interface: [`WgDevice::get`] and
//! [`WgDevice::set`] speak [`DeviceState`]/[`DeviceConfig`] whichever implementation runs.
//!
//! [`ensure_device`] finds or creates the device named `name`:
//! * an existing link of kind `wireguard` is the kernel device: adopted;
//! * an existing link served by a userspace implementation whose UAPI socket answers from
//!   this network namespace: adopted (with its peers; nothing is interrupted);
//! * anything else under that name (a TUN left without its process, another kind) is
//!   deleted;
//! * then the kernel device is created through rtnetlink; when the kernel lacks the link
//!   type ([`NetlinkError::Unsupported`]), the userspace implementation is started instead.
//!
//! Which implementation serves the device is logged once per creation or adoption.

use crate::netlink::{Link, Netlink, NetlinkError};

use super::{
    config::{DeviceConfig, DeviceState},
    genl::{GenlError, KernelControl},
    uapi::{UapiClient, UapiError},
    userspace::{Userspace, UserspaceError},
};

/// Errors of one device.
#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    /// A link operation failed.
    #[error("{what} {device}: {source}")]
    Netlink {
        /// What was done.
        what: &'static str,
        /// The device.
        device: String,
        /// The error.
        #[source]
        source: NetlinkError,
    },
    /// The kernel control channel failed.
    #[error(transparent)]
    Genl(#[from] GenlError),
    /// The UAPI exchange failed.
    #[error(transparent)]
    Uapi(#[from] UapiError),
    /// The userspace implementation could not be started or found.
    #[error(transparent)]
    Userspace(#[from] UserspaceError),
    /// The userspace implementation said it started, but no device appeared.
    #[error("{program} started but {device} did not appear")]
    Missing {
        /// The program.
        program: String,
        /// The device.
        device: String,
    },
}

/// Which implementation serves a device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Implementation {
    /// The kernel module (generic netlink).
    Kernel,
    /// A userspace program over TUN (UAPI socket).
    Userspace,
}

impl std::fmt::Display for Implementation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Implementation::Kernel => "kernel",
            Implementation::Userspace => "userspace",
        })
    }
}

#[derive(Debug, Clone)]
enum Control {
    Kernel(KernelControl),
    Userspace(UapiClient),
}

/// A WireGuard device in place.
#[derive(Debug, Clone)]
pub struct WgDevice {
    /// Its name.
    pub name: String,
    /// Its interface index.
    pub index: u32,
    control: Control,
}

impl WgDevice {
    /// Which implementation serves it.
    pub fn implementation(&self) -> Implementation {
        match self.control {
            Control::Kernel(_) => Implementation::Kernel,
            Control::Userspace(_) => Implementation::Userspace,
        }
    }

    /// Reads its configuration and peers.
    pub async fn get(&self) -> Result<DeviceState, DeviceError> {
        Ok(match &self.control {
            Control::Kernel(k) => k.get().await?,
            Control::Userspace(u) => u.get().await?,
        })
    }

    /// Applies a change.
    pub async fn set(&self, config: &DeviceConfig) -> Result<(), DeviceError> {
        match &self.control {
            Control::Kernel(k) => k.set(config).await?,
            Control::Userspace(u) => u.set(config).await?,
        }
        Ok(())
    }
}

/// What [`ensure_device`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ensured {
    /// The device was there and is kept.
    Adopted,
    /// The device was created.
    Created,
}

fn nl_err(what: &'static str, device: &str) -> impl FnOnce(NetlinkError) -> DeviceError {
    let device = device.to_owned();
    move |source| DeviceError::Netlink {
        what,
        device,
        source,
    }
}

/// Finds, adopts or creates device `name` (see the module documentation). `mtu` is given to
/// a kernel device at creation; the caller sets it on every device afterwards.
pub async fn ensure_device(
    nl: &Netlink,
    userspace: &Userspace,
    name: &str,
    mtu: Option<u32>,
) -> Result<(WgDevice, Ensured), DeviceError> {
    if let Some(link) = nl
        .link_by_name(name)
        .await
        .map_err(nl_err("look up", name))?
    {
        if link.is_kind("wireguard") {
            return Ok((kernel(name, &link)?, Ensured::Adopted));
        }
        if let Some(running) = userspace.find(name).await? {
            tracing::info!(
                device = name,
                pid = ?running.pid,
                socket = %userspace.socket_path(name).display(),
                "adopted the running userspace WireGuard device"
            );
            return Ok((user(userspace, name, &link), Ensured::Adopted));
        }
        tracing::warn!(
            device = name,
            kind = ?link.kind,
            "{name} exists but is neither a kernel WireGuard device nor served by a running \
             userspace implementation; recreating it"
        );
        match nl.delete_link(link.index).await {
            Ok(()) => {}
            Err(e) if e.is_not_found() => {}
            Err(e) => return Err(nl_err("delete stale", name)(e)),
        }
    } else {
        // A socket that still answers from our namespace without its link belongs to a
        // process on its way out (its device was deleted); a new one can only bind the
        // socket once it is gone. wireguard-go replaces sockets nobody answers on.
        for _ in 0..30 {
            match userspace.find(name).await? {
                Some(running) => {
                    tracing::debug!(device = name, pid = ?running.pid, "waiting for the old process");
                    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                }
                None => break,
            }
        }
    }

    match nl.create_wireguard(name, mtu).await {
        Ok(link) => {
            tracing::info!(
                device = name,
                index = link.index,
                "created WireGuard device {name} (kernel module)"
            );
            Ok((kernel(name, &link)?, Ensured::Created))
        }
        Err(e) if e.is_unsupported() => {
            userspace.launch(name).await?;
            let link = nl
                .link_by_name(name)
                .await
                .map_err(nl_err("look up", name))?
                .ok_or_else(|| DeviceError::Missing {
                    program: userspace.program(),
                    device: name.to_owned(),
                })?;
            let pid = userspace.find(name).await?.and_then(|r| r.pid);
            tracing::info!(
                device = name,
                index = link.index,
                ?pid,
                socket = %userspace.socket_path(name).display(),
                "created WireGuard device {name} with userspace {} (this kernel has no \
                 WireGuard: {e})",
                userspace.program()
            );
            Ok((user(userspace, name, &link), Ensured::Created))
        }
        Err(e) => Err(nl_err("create", name)(e)),
    }
}

fn kernel(name: &str, link: &Link) -> Result<WgDevice, DeviceError> {
    Ok(WgDevice {
        name: name.to_owned(),
        index: link.index,
        control: Control::Kernel(KernelControl::open(name)?),
    })
}

fn user(userspace: &Userspace, name: &str, link: &Link) -> WgDevice {
    WgDevice {
        name: name.to_owned(),
        index: link.index,
        control: Control::Userspace(userspace.client(name)),
    }
}
