//! Following the external interface: when it is deleted and created again under a new index
//! (a network manager re-creating a bond, VLAN or veth), the configuration entries point the
//! programs at the new one and they are attached to it, as the kernel path's routes and
//! devices follow it.

use flannel_common::{
    config::{CFG_IPIP_USER_RX, Config},
    maps::CONFIG,
    v6::Config6,
};

use super::{BpfError, FastPath, Hook, config::check_interface};

impl FastPath {
    /// The external interface the configuration points the programs at: the IPv4 entry's, or
    /// the IPv6 entry's on an IPv6-only node; `None` while neither is enabled.
    pub fn configured_netdev(&self) -> Result<Option<u32>, BpfError> {
        let v4 = self.config_entry()?;
        if v4.enabled() {
            return Ok(Some(v4.ext_ifindex));
        }
        let v6 = self.config6_entry()?;
        Ok(v6.enabled().then_some(v6.ext_ifindex))
    }

    /// Puts the fast path on external interface `ifindex` when it is not there: the enabled
    /// configuration entries are pointed at it (the programs redirect and check MTUs through
    /// it), then its TC programs are attached to it and their links on the interface it was
    /// on are removed ([`FastPath::attach_netdev`]; XDP moves too if it was attached).
    /// Returns the interface it was configured for when anything changed; `None` when it was
    /// in place already, or nothing is configured yet. A failed attach is retried by the next
    /// call (the programs are not on `ifindex` yet).
    pub fn follow_netdev(&mut self, ifindex: u32) -> Result<Option<u32>, BpfError> {
        let Some(configured) = self.configured_netdev()? else {
            return Ok(None);
        };
        let attachments = self.attachments();
        let attached = [Hook::FromNetdev, Hook::ToNetdev]
            .iter()
            .all(|hook| attachments.contains(&(*hook, ifindex)));
        if configured == ifindex && attached {
            return Ok(None);
        }
        check_interface(ifindex)?;
        if configured != ifindex {
            self.update_config(|c| c.ext_ifindex = ifindex)?;
            self.update_config6(|c| c.ext_ifindex = ifindex)?;
            self.retire_memos()?;
        }
        let xdp = self.xdp_attachment().is_some();
        self.attach_netdev(ifindex, xdp)?;
        Ok(Some(configured))
    }

    /// Sets or clears `CFG_IPIP_USER_RX` in the IPv4 entry as it is (see
    /// `daemon::fastpath::run_ipip_receiver`); nothing while the IPv4 side is disabled.
    pub fn set_ipip_user_rx(&mut self, on: bool) -> Result<(), BpfError> {
        self.update_config(|c| {
            if on {
                c.flags |= CFG_IPIP_USER_RX;
            } else {
                c.flags &= !CFG_IPIP_USER_RX;
            }
        })?;
        self.retire_memos()
    }

    /// Rewrites the IPv4 entry with `change` applied, when it is enabled.
    fn update_config(&mut self, change: impl FnOnce(&mut Config)) -> Result<(), BpfError> {
        let mut entry = self.config_entry()?;
        if !entry.enabled() {
            return Ok(());
        }
        change(&mut entry);
        let mut array = self.array_mut()?;
        array.set(0, entry, 0).map_err(|e| BpfError::map(CONFIG, e))
    }

    /// Rewrites the IPv6 entry with `change` applied, when it is enabled.
    fn update_config6(&mut self, change: impl FnOnce(&mut Config6)) -> Result<(), BpfError> {
        let mut entry = self.config6_entry()?;
        if !entry.enabled() {
            return Ok(());
        }
        change(&mut entry);
        self.write_config6(entry)
    }
}
