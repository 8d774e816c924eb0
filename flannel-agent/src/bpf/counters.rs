//! Reading the programs' per-CPU counters: packets and bytes per [`Reason`], summed over CPUs.

use std::fmt;

use aya::{
    Ebpf,
    maps::{MapData, PerCpuArray},
};
use flannel_common::{
    maps as names,
    stats::{Counter, Reason, ReasonKind},
};

use super::BpfError;

/// One program's counters, indexed by [`Reason`].
#[derive(Clone, PartialEq, Eq)]
pub struct ReasonCounters(Vec<Counter>);

/// Lists the non-zero reasons by name: `{fast_vxlan: 12 packets / 8400 bytes, ...}`.
impl fmt::Debug for ReasonCounters {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut map = f.debug_map();
        for (reason, c) in self.nonzero() {
            map.entry(
                &format_args!("{}", reason.name()),
                &format_args!("{} packets / {} bytes", c.packets, c.bytes),
            );
        }
        map.finish()
    }
}

impl ReasonCounters {
    /// The counter of `reason`.
    pub fn get(&self, reason: Reason) -> Counter {
        self.0
            .get(reason.index() as usize)
            .copied()
            .unwrap_or_default()
    }

    /// Every reason with a non-zero packet count, in index order.
    pub fn nonzero(&self) -> impl Iterator<Item = (Reason, Counter)> + '_ {
        Reason::ALL
            .iter()
            .map(|r| (*r, self.get(*r)))
            .filter(|(_, c)| c.packets != 0)
    }

    /// The sum of every reason of `kind`.
    pub fn total(&self, kind: ReasonKind) -> Counter {
        let mut sum = Counter::default();
        for reason in Reason::ALL {
            if reason.kind() == kind {
                sum.add(&self.get(reason));
            }
        }
        sum
    }
}

/// The counters of the fast-path programs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Counters {
    /// `tc_from_bridge`.
    pub from_bridge: ReasonCounters,
    /// `tc_from_netdev`.
    pub from_netdev: ReasonCounters,
    /// `tc_to_netdev` (the fast path's own packets passing through are not counted here).
    pub to_netdev: ReasonCounters,
    /// `xdp_from_netdev` (empty when XDP is not attached).
    pub xdp_from_netdev: ReasonCounters,
}

impl Counters {
    pub(crate) fn read(ebpf: &Ebpf) -> Result<Counters, BpfError> {
        Ok(Counters {
            from_bridge: read_map(ebpf, names::CNT_FROM_BRIDGE)?,
            from_netdev: read_map(ebpf, names::CNT_FROM_NETDEV)?,
            to_netdev: read_map(ebpf, names::CNT_TO_NETDEV)?,
            xdp_from_netdev: read_map(ebpf, names::CNT_XDP_NETDEV)?,
        })
    }
}

fn read_map(ebpf: &Ebpf, name: &'static str) -> Result<ReasonCounters, BpfError> {
    let map = ebpf.map(name).ok_or_else(|| BpfError::BadMap {
        name,
        reason: "not in the eBPF object".into(),
    })?;
    let array: PerCpuArray<&MapData, Counter> =
        PerCpuArray::try_from(map).map_err(|e| BpfError::map(name, e))?;
    let mut out = Vec::with_capacity(Reason::COUNT);
    for reason in Reason::ALL {
        let values = array
            .get(&reason.index(), 0)
            .map_err(|e| BpfError::map(name, e))?;
        let mut sum = Counter::default();
        for v in values.iter() {
            sum.add(v);
        }
        out.push(sum);
    }
    Ok(ReasonCounters(out))
}
