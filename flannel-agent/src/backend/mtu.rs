//! MTU arithmetic per backend (§2.0 MTU table): the MTU of each tunnel device and the value
//! written as `FLANNEL_MTU` (the pods' MTU).
//!
//! One deliberate fix: VXLAN over an IPv6 underlay needs 70 bytes of overhead (40 IPv6, 8 UDP,
//! 8 VXLAN and 14 inner Ethernet), not the 50 upstream uses for both families. So the IPv6
//! device `flannel-v6.<VNI>` gets `MTU - 70`, and with IPv6 enabled `FLANNEL_MTU` is the
//! smaller value so that pod packets fit either tunnel. WireGuard's 80 already covers an IPv6
//! underlay and is used for both families, as upstream does.

use super::BackendType;
use super::options::BackendOptions;
use crate::ip::IpStack;

/// VXLAN over IPv4: 20 IPv4 + 8 UDP + 8 VXLAN + 14 Ethernet.
pub const VXLAN_OVERHEAD_V4: u32 = 50;
/// VXLAN over IPv6: 40 IPv6 + 8 UDP + 8 VXLAN + 14 Ethernet.
pub const VXLAN_OVERHEAD_V6: u32 = 70;
/// WireGuard (sized for an IPv6 underlay, used for both).
pub const WIREGUARD_OVERHEAD: u32 = 80;
/// IP-in-IP: one IPv4 header.
pub const IPIP_OVERHEAD: u32 = 20;
/// The UDP backend: IPv4 + UDP headers.
pub const UDP_OVERHEAD: u32 = 28;
/// IPsec ESP tunnel mode, as upstream budgets it.
pub const IPSEC_OVERHEAD: u32 = 77;
/// Extra for IPsec with UDP encapsulation.
pub const IPSEC_UDP_ENCAP_OVERHEAD: u32 = 8;
/// The smallest MTU IPv4 allows.
pub const MIN_MTU_V4: u32 = 68;
/// The smallest MTU IPv6 allows (the kernel disables IPv6 on devices below it).
pub const MIN_MTU_V6: u32 = 1280;

/// The MTUs a backend uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MtuPlan {
    /// MTU of the device carrying IPv4 pod traffic (`flannel.<VNI>`, `flannel-wg`,
    /// `flannel.ipip` (set only if that lowers it), `flannel0`); `None` when there is none.
    pub device_v4: Option<u32>,
    /// MTU of the device carrying IPv6 pod traffic (`flannel-v6.<VNI>`, `flannel-wg-v6` or,
    /// in single-device WireGuard modes, `flannel-wg`).
    pub device_v6: Option<u32>,
    /// `FLANNEL_MTU`.
    pub flannel_mtu: u32,
}

/// The MTU left is too small to be usable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "MTU {mtu} is too small for the {backend} backend: {overhead} bytes of overhead leave less than {minimum}"
)]
pub struct MtuError {
    /// The backend.
    pub backend: BackendType,
    /// The underlay MTU used (the `MTU` option or the external interface's).
    pub mtu: u32,
    /// The overhead subtracted.
    pub overhead: u32,
    /// The minimum that was not met.
    pub minimum: u32,
}

impl BackendOptions {
    /// The MTUs for an external interface MTU of `ext_mtu` with families `stack` enabled.
    pub fn mtu(&self, ext_mtu: u32, stack: IpStack) -> Result<MtuPlan, MtuError> {
        let backend = self.backend_type();
        let minimum = if stack.has_v6() {
            MIN_MTU_V6
        } else {
            MIN_MTU_V4
        };
        let sub = |mtu: u32, overhead: u32| -> Result<u32, MtuError> {
            mtu.checked_sub(overhead)
                .filter(|m| *m >= minimum)
                .ok_or(MtuError {
                    backend,
                    mtu,
                    overhead,
                    minimum,
                })
        };
        let plan = match self {
            BackendOptions::Vxlan(o) => {
                let base = o.mtu.unwrap_or(ext_mtu);
                let v4 = stack
                    .has_v4()
                    .then(|| sub(base, VXLAN_OVERHEAD_V4))
                    .transpose()?;
                let v6 = stack
                    .has_v6()
                    .then(|| sub(base, VXLAN_OVERHEAD_V6))
                    .transpose()?;
                let flannel_mtu = v4.into_iter().chain(v6).min().unwrap_or(base);
                MtuPlan {
                    device_v4: v4,
                    device_v6: v6,
                    flannel_mtu,
                }
            }
            BackendOptions::Wireguard(o) => {
                let m = sub(o.mtu.unwrap_or(ext_mtu), WIREGUARD_OVERHEAD)?;
                MtuPlan {
                    device_v4: stack.has_v4().then_some(m),
                    device_v6: stack.has_v6().then_some(m),
                    flannel_mtu: m,
                }
            }
            BackendOptions::Ipip(_) => device_v4_only(sub(ext_mtu, IPIP_OVERHEAD)?),
            BackendOptions::Udp(_) => device_v4_only(sub(ext_mtu, UDP_OVERHEAD)?),
            BackendOptions::Ipsec(o) => {
                let overhead = IPSEC_OVERHEAD
                    + if o.udp_encap {
                        IPSEC_UDP_ENCAP_OVERHEAD
                    } else {
                        0
                    };
                no_device(sub(ext_mtu, overhead)?)
            }
            BackendOptions::HostGw | BackendOptions::Alloc | BackendOptions::Extension(_) => {
                no_device(sub(ext_mtu, 0)?)
            }
        };
        Ok(plan)
    }
}

fn device_v4_only(m: u32) -> MtuPlan {
    MtuPlan {
        device_v4: Some(m),
        device_v6: None,
        flannel_mtu: m,
    }
}

fn no_device(m: u32) -> MtuPlan {
    MtuPlan {
        device_v4: None,
        device_v6: None,
        flannel_mtu: m,
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests fail loudly by design
mod tests {
    use super::*;
    use crate::backend::options::{
        IpipOptions, IpsecOptions, Secret, UdpOptions, VxlanOptions, WireguardOptions,
    };

    fn flannel_mtu(o: &BackendOptions, ext: u32) -> u32 {
        o.mtu(ext, IpStack::V4).unwrap().flannel_mtu
    }

    fn ipsec(udp_encap: bool) -> BackendOptions {
        BackendOptions::Ipsec(IpsecOptions {
            psk: Secret::new("x".repeat(96)),
            udp_encap,
            esp_proposal: String::new(),
        })
    }

    #[test]
    fn upstream_table_for_1500() {
        let vx = BackendOptions::Vxlan(VxlanOptions::default());
        let wg = BackendOptions::Wireguard(WireguardOptions::default());
        let ipip = BackendOptions::Ipip(IpipOptions::default());
        let udp = BackendOptions::Udp(UdpOptions::default());
        assert_eq!(flannel_mtu(&vx, 1500), 1450);
        assert_eq!(flannel_mtu(&wg, 1500), 1420);
        assert_eq!(flannel_mtu(&ipip, 1500), 1480);
        assert_eq!(flannel_mtu(&udp, 1500), 1472);
        assert_eq!(flannel_mtu(&ipsec(false), 1500), 1423);
        assert_eq!(flannel_mtu(&ipsec(true), 1500), 1415);
        assert_eq!(flannel_mtu(&BackendOptions::HostGw, 1500), 1500);
        assert_eq!(flannel_mtu(&BackendOptions::Alloc, 9000), 9000);
        assert_eq!(
            vx.mtu(1500, IpStack::V4).unwrap(),
            MtuPlan {
                device_v4: Some(1450),
                device_v6: None,
                flannel_mtu: 1450
            }
        );
        assert_eq!(ipip.mtu(1500, IpStack::V4).unwrap().device_v4, Some(1480));
        assert_eq!(ipsec(false).mtu(1500, IpStack::V4).unwrap().device_v4, None);
    }

    #[test]
    fn vxlan_ipv6_underlay_needs_70_bytes() {
        let vx = BackendOptions::Vxlan(VxlanOptions::default());
        assert_eq!(
            vx.mtu(1500, IpStack::Dual).unwrap(),
            MtuPlan {
                device_v4: Some(1450),
                device_v6: Some(1430),
                flannel_mtu: 1430
            }
        );
        assert_eq!(
            vx.mtu(1500, IpStack::V6).unwrap(),
            MtuPlan {
                device_v4: None,
                device_v6: Some(1430),
                flannel_mtu: 1430
            }
        );
    }

    #[test]
    fn mtu_option_overrides_the_interface() {
        let vx = BackendOptions::Vxlan(VxlanOptions {
            mtu: Some(9000),
            ..Default::default()
        });
        assert_eq!(flannel_mtu(&vx, 1500), 8950);
        let wg = BackendOptions::Wireguard(WireguardOptions {
            mtu: Some(1400),
            ..Default::default()
        });
        assert_eq!(
            wg.mtu(1500, IpStack::Dual).unwrap(),
            MtuPlan {
                device_v4: Some(1320),
                device_v6: Some(1320),
                flannel_mtu: 1320
            }
        );
        // The option does not apply to backends without it.
        assert_eq!(flannel_mtu(&BackendOptions::HostGw, 1500), 1500);
    }

    #[test]
    fn too_small_is_an_error() {
        let ipip = BackendOptions::Ipip(IpipOptions::default());
        assert_eq!(
            ipip.mtu(20, IpStack::V4).unwrap_err().to_string(),
            "MTU 20 is too small for the ipip backend: 20 bytes of overhead leave less than 68"
        );
        assert!(ipip.mtu(88, IpStack::V4).is_ok());
        let vx = BackendOptions::Vxlan(VxlanOptions::default());
        assert_eq!(
            vx.mtu(1340, IpStack::Dual).unwrap_err(),
            MtuError {
                backend: BackendType::Vxlan,
                mtu: 1340,
                overhead: 70,
                minimum: 1280
            }
        );
        assert!(BackendOptions::HostGw.mtu(0, IpStack::V4).is_err());
    }
}
