//! Reading the programs' per-CPU counters: packets and bytes per [`Reason`], summed over CPUs.

use std::{borrow::Borrow, fmt, path::Path};

use aya::{
    Ebpf,
    maps::{Map, MapData, PerCpuArray},
};
use flannel_common::{
    maps as names, programs,
    stats::{Counter, Reason, ReasonKind},
};

use super::{BpfError, PinLayout};

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
        Counters::read_each(|name| sum_by_reason(&counter_map(ebpf, name)?, name))
    }

    /// The counters in the maps pinned under `pin_path` (`--bpf-pin-path`): readable by
    /// anyone, also while no agent runs (the programs go on counting meanwhile).
    pub fn read_pinned(pin_path: &Path) -> Result<Counters, BpfError> {
        let layout = PinLayout::new(pin_path);
        Counters::read_each(|name| {
            let data = MapData::from_pin(layout.map(name)).map_err(|e| BpfError::map(name, e))?;
            let array: PerCpuArray<MapData, Counter> =
                PerCpuArray::try_from(Map::PerCpuArray(data))
                    .map_err(|e| BpfError::map(name, e))?;
            sum_by_reason(&array, name)
        })
    }

    /// Each program's name ([`flannel_common::programs`]) and counters.
    pub fn by_program(&self) -> [(&'static str, &ReasonCounters); 4] {
        [
            (programs::TC_FROM_BRIDGE, &self.from_bridge),
            (programs::TC_FROM_NETDEV, &self.from_netdev),
            (programs::TC_TO_NETDEV, &self.to_netdev),
            (programs::XDP_FROM_NETDEV, &self.xdp_from_netdev),
        ]
    }

    fn read_each(
        read: impl Fn(&'static str) -> Result<ReasonCounters, BpfError>,
    ) -> Result<Counters, BpfError> {
        let [from_bridge, from_netdev, to_netdev, xdp_from_netdev] = COUNTER_MAPS;
        Ok(Counters {
            from_bridge: read(from_bridge)?,
            from_netdev: read(from_netdev)?,
            to_netdev: read(to_netdev)?,
            xdp_from_netdev: read(xdp_from_netdev)?,
        })
    }
}

/// The programs' counter maps: `tc_from_bridge`, `tc_from_netdev`, `tc_to_netdev`,
/// `xdp_from_netdev`.
const COUNTER_MAPS: [&str; 4] = [
    names::CNT_FROM_BRIDGE,
    names::CNT_FROM_NETDEV,
    names::CNT_TO_NETDEV,
    names::CNT_XDP_NETDEV,
];

/// The loaded counter map `name`.
fn counter_map<'a>(
    ebpf: &'a Ebpf,
    name: &'static str,
) -> Result<PerCpuArray<&'a MapData, Counter>, BpfError> {
    let map = ebpf.map(name).ok_or_else(|| BpfError::BadMap {
        name,
        reason: "not in the eBPF object".into(),
    })?;
    PerCpuArray::try_from(map).map_err(|e| BpfError::map(name, e))
}

/// Flow-table entries the programs have learnt since they were loaded (both families, every
/// program), as their counters say.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Learnt {
    /// New kernel-flow entries ([`Reason::LearnKernelFlow`]).
    pub kernel_flows: u64,
    /// New NAT-guard entries ([`Reason::LearnNatGuard`]).
    pub nat_guards: u64,
}

impl Learnt {
    /// What was learnt since `before`.
    pub fn since(self, before: Learnt) -> Learnt {
        Learnt {
            kernel_flows: self.kernel_flows.saturating_sub(before.kernel_flows),
            nat_guards: self.nat_guards.saturating_sub(before.nat_guards),
        }
    }

    /// Reads the two reasons from every program's counter map: eight lookups, cheap enough to
    /// poll.
    pub(crate) fn read(ebpf: &Ebpf) -> Result<Learnt, BpfError> {
        let mut out = Learnt::default();
        for name in COUNTER_MAPS {
            let array = counter_map(ebpf, name)?;
            for (reason, total) in [
                (Reason::LearnKernelFlow, &mut out.kernel_flows),
                (Reason::LearnNatGuard, &mut out.nat_guards),
            ] {
                let values = array
                    .get(&reason.index(), 0)
                    .map_err(|e| BpfError::map(name, e))?;
                *total += values.iter().map(|c| c.packets).sum::<u64>();
            }
        }
        Ok(out)
    }
}

/// Every reason's counter of the counter map `array` (named `name`), summed over the CPUs.
fn sum_by_reason<T: Borrow<MapData>>(
    array: &PerCpuArray<T, Counter>,
    name: &'static str,
) -> Result<ReasonCounters, BpfError> {
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
