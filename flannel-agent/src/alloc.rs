//! The etcd-mode subnet decision of `AcquireLease` (§5.3) as a pure function.
//!
//! [`plan`] looks at the validated config, the leases currently in the registry, the node's
//! IPv4 public address and the subnets recorded in the previous `subnet.env`, and says which
//! subnet to take ([`Choice`]) and which stale lease of ours to delete first. The caller (the
//! etcd subnet manager) then writes it: rewrite the reused key, or create the new key with a
//! compare-and-swap.
//!
//! Differences from upstream, all deliberate:
//! * the previous subnet is rejected when *any* lease overlaps it in either family (upstream
//!   only checks for a lease with an equal IPv4 subnet, so it could hand out an IPv6 subnet in
//!   use, or an IPv4 subnet overlapping a lease of another length);
//! * the lease deleted because it no longer fits the config no longer blocks its subnet;
//! * IPv6-only etcd mode is refused with a clear error (upstream silently degenerates to a
//!   single `0.0.0.0/0` lease).

use std::net::Ipv4Addr;

use ipnet::{Ipv4Net, Ipv6Net};
use rand::Rng;

use crate::ip::{self, Subnet};
use crate::lease::{Lease, SubnetKey};
use crate::netconf::{CheckedConfig, Pool};

/// How many free candidates the random pick chooses among (upstream's constant).
pub const MAX_CANDIDATES: usize = 100;

/// The subnets recorded by a previous run (`FLANNEL_SUBNET`, `FLANNEL_IPV6_SUBNET`, masked).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PreviousSubnets {
    /// The previous IPv4 subnet.
    pub ipv4: Option<Ipv4Net>,
    /// The previous IPv6 subnet.
    pub ipv6: Option<Ipv6Net>,
}

/// Which subnet to take.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Choice {
    /// An existing lease carries our public IP and fits the config: rewrite it with our
    /// attributes and a fresh TTL (upstream `Found lease (…) for current IP (…), reusing`).
    /// The lease is given as found, so the caller can see whether it had an expiry.
    Reuse(Lease),
    /// The subnet of the previous run is free and fits the config: create it
    /// (`Found previously leased subnet (…), reusing`).
    Previous(SubnetKey),
    /// A freshly picked free subnet: create it.
    Allocated(SubnetKey),
}

impl Choice {
    /// The key of the chosen subnet(s).
    pub fn key(&self) -> Option<SubnetKey> {
        match self {
            Choice::Reuse(lease) => lease.key(),
            Choice::Previous(k) | Choice::Allocated(k) => Some(*k),
        }
    }
}

/// The outcome of [`plan`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// Our old lease (found by public IP) that no longer fits the config: delete it first.
    pub delete: Option<Lease>,
    /// The subnet to write.
    pub choice: Choice,
}

/// Why no subnet could be chosen.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AllocError {
    /// No free subnet in the pool (either family).
    #[error("out of subnets")]
    OutOfSubnets,
    /// The config disables IPv4; etcd keys and upstream allocation require an IPv4 subnet.
    #[error(
        "IPv6-only networks are not supported in etcd mode (EnableIPv4 is false): etcd lease \
         keys need an IPv4 subnet; use the Kubernetes subnet manager (--kube-subnet-mgr)"
    )]
    Ipv6OnlyUnsupported,
}

/// Decides which subnet this node gets (upstream `tryAcquireLease` minus the registry writes).
///
/// `leases` is everything under `<prefix>/subnets`; `public_ip` is our `PublicIP`;
/// `rng` drives the uniform pick among the first [`MAX_CANDIDATES`] free subnets.
pub fn plan<R: Rng + ?Sized>(
    config: &CheckedConfig,
    leases: &[Lease],
    public_ip: Ipv4Addr,
    previous: &PreviousSubnets,
    rng: &mut R,
) -> Result<Plan, AllocError> {
    let pool4 = config
        .ipv4
        .as_ref()
        .ok_or(AllocError::Ipv6OnlyUnsupported)?;
    let pool6 = config.ipv6.as_ref();
    let compatible = |v4: Option<Ipv4Net>, v6: Option<Ipv6Net>| {
        v4.is_some_and(|sn| pool4.is_compatible(sn))
            && match pool6 {
                None => v6.is_none(),
                Some(p) => v6.is_some_and(|sn| p.is_compatible(sn)),
            }
    };

    let mut delete = None;
    if let Some(own) = leases.iter().find(|l| l.attrs.public_ip == public_ip) {
        if compatible(own.subnet, own.ipv6_subnet) {
            return Ok(Plan {
                delete: None,
                choice: Choice::Reuse(own.clone()),
            });
        }
        delete = Some(own.clone());
    }
    // Leases that keep their subnets (the one being deleted frees its subnets).
    let others: Vec<&Lease> = leases
        .iter()
        .filter(|l| delete.as_ref() != Some(*l))
        .collect();

    if let Some(v4) = previous.ipv4.filter(|n| !ip::is_unset(*n)) {
        let v6 = previous.ipv6.filter(|n| !ip::is_unset(*n));
        let taken = others.iter().any(|l| {
            l.subnet.is_some_and(|sn| ip::overlaps(sn, v4))
                || matches!((l.ipv6_subnet, v6), (Some(a), Some(b)) if ip::overlaps(a, b))
        });
        if !taken && compatible(Some(v4), v6) {
            return Ok(Plan {
                delete,
                choice: Choice::Previous(SubnetKey { ipv4: v4, ipv6: v6 }),
            });
        }
    }

    let ipv4 = pick(pool4, others.iter().filter_map(|l| l.subnet), rng);
    let ipv6 = match pool6 {
        None => None,
        Some(p) => Some(
            pick(p, others.iter().filter_map(|l| l.ipv6_subnet), rng)
                .ok_or(AllocError::OutOfSubnets)?,
        ),
    };
    let ipv4 = ipv4.ok_or(AllocError::OutOfSubnets)?;
    Ok(Plan {
        delete,
        choice: Choice::Allocated(SubnetKey { ipv4, ipv6 }),
    })
}

/// The first [`MAX_CANDIDATES`] subnets of `pool` that overlap none of `taken`.
pub fn free_candidates<N: Subnet>(pool: &Pool<N>, taken: impl Iterator<Item = N>) -> Vec<N> {
    let taken: Vec<N> = taken.collect();
    pool.candidates()
        .filter(|c| !taken.iter().any(|t| ip::overlaps(*c, *t)))
        .take(MAX_CANDIDATES)
        .collect()
}

/// A uniformly random free candidate, `None` when there is none.
fn pick<N: Subnet, R: Rng + ?Sized>(
    pool: &Pool<N>,
    taken: impl Iterator<Item = N>,
    rng: &mut R,
) -> Option<N> {
    let free = free_candidates(pool, taken);
    if free.is_empty() {
        return None;
    }
    free.get(rng.random_range(0..free.len())).copied()
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests fail loudly by design
mod tests {
    use std::collections::BTreeSet;
    use std::time::{Duration, SystemTime};

    use rand::SeedableRng;
    use rand::rngs::StdRng;

    use super::*;
    use crate::lease::LeaseAttrs;
    use crate::netconf::NetConfig;

    const MOCK_CONFIG: &str =
        r#"{ "Network": "10.3.0.0/16", "SubnetMin": "10.3.1.0", "SubnetMax": "10.3.25.0" }"#;

    fn config(json: &str) -> CheckedConfig {
        NetConfig::parse(json).unwrap().check().unwrap()
    }

    fn lease(key: &str, ip: [u8; 4]) -> Lease {
        Lease::new(
            key.parse().unwrap(),
            LeaseAttrs {
                public_ip: Ipv4Addr::from(ip),
                ..Default::default()
            },
            Some(SystemTime::UNIX_EPOCH + Duration::from_secs(86400)),
        )
    }

    /// The leases of upstream's mock registry.
    fn mock_leases() -> Vec<Lease> {
        [
            "10.3.1.0-24",
            "10.3.2.0-24",
            "10.3.4.0-24",
            "10.3.5.0-24",
            "10.3.31.0-24",
        ]
        .into_iter()
        .map(|k| lease(k, [1, 1, 1, 1]))
        .collect()
    }

    const ME: Ipv4Addr = Ipv4Addr::new(1, 2, 3, 4);

    fn net(s: &str) -> Ipv4Net {
        s.parse().unwrap()
    }

    #[test]
    fn allocates_a_free_subnet_in_range() {
        let cfg = config(MOCK_CONFIG);
        let leases = mock_leases();
        let mut expected: BTreeSet<Ipv4Net> =
            (6..=25).map(|i| net(&format!("10.3.{i}.0/24"))).collect();
        expected.insert(net("10.3.3.0/24"));
        let mut seen = BTreeSet::new();
        for seed in 0..200 {
            let plan = plan(
                &cfg,
                &leases,
                ME,
                &PreviousSubnets::default(),
                &mut StdRng::seed_from_u64(seed),
            )
            .unwrap();
            assert_eq!(plan.delete, None);
            let Choice::Allocated(key) = plan.choice else {
                panic!("{plan:?}")
            };
            assert_eq!(key.ipv6, None);
            assert!(expected.contains(&key.ipv4), "{key}");
            seen.insert(key.ipv4);
        }
        // Uniform pick: 200 draws over 21 candidates hit most of them.
        assert!(seen.len() > 15, "{seen:?}");
    }

    #[test]
    fn acquiring_again_with_the_same_ip_returns_the_same_subnet() {
        let cfg = config(MOCK_CONFIG);
        let mut leases = mock_leases();
        let mut rng = StdRng::seed_from_u64(7);
        let first = plan(&cfg, &leases, ME, &PreviousSubnets::default(), &mut rng).unwrap();
        let key = first.choice.key().unwrap();
        let mut mine = lease(&key.to_string(), ME.octets());
        mine.attrs.backend_type = "vxlan".into();
        leases.push(mine.clone());
        let again = plan(&cfg, &leases, ME, &PreviousSubnets::default(), &mut rng).unwrap();
        assert_eq!(
            again,
            Plan {
                delete: None,
                choice: Choice::Reuse(mine)
            }
        );
        assert_eq!(again.choice.key(), Some(key));
    }

    #[test]
    fn previous_subnet_is_reused() {
        let cfg = config(MOCK_CONFIG);
        let prev = PreviousSubnets {
            ipv4: Some(net("10.3.6.0/24")),
            ipv6: None,
        };
        let p = plan(
            &cfg,
            &mock_leases(),
            ME,
            &prev,
            &mut StdRng::seed_from_u64(1),
        )
        .unwrap();
        assert_eq!(p.choice, Choice::Previous("10.3.6.0-24".parse().unwrap()));
    }

    #[test]
    fn previous_subnet_outside_the_network_is_ignored() {
        let cfg = config(MOCK_CONFIG);
        let prev = PreviousSubnets {
            ipv4: Some(net("10.4.1.0/24")),
            ipv6: None,
        };
        for seed in 0..20 {
            let p = plan(
                &cfg,
                &mock_leases(),
                ME,
                &prev,
                &mut StdRng::seed_from_u64(seed),
            )
            .unwrap();
            let Choice::Allocated(k) = p.choice else {
                panic!("{p:?}")
            };
            assert_ne!(k.ipv4, net("10.4.1.0/24"));
        }
    }

    #[test]
    fn previous_subnet_in_use_is_ignored() {
        let cfg = config(MOCK_CONFIG);
        for taken in ["10.3.5.0/24", "10.3.4.0/23"] {
            let leases = vec![lease(&taken.replace('/', "-"), [5, 5, 5, 5])];
            let prev = PreviousSubnets {
                ipv4: Some(net("10.3.5.0/24")),
                ipv6: None,
            };
            let p = plan(&cfg, &leases, ME, &prev, &mut StdRng::seed_from_u64(3)).unwrap();
            assert!(matches!(p.choice, Choice::Allocated(_)), "{taken}: {p:?}");
        }
    }

    #[test]
    fn config_change_deletes_the_incompatible_lease() {
        let mut leases = mock_leases();
        let old = lease("10.3.7.0-24", ME.octets());
        leases.push(old.clone());
        let cfg = config(r#"{ "Network": "10.4.0.0/16" }"#);
        let p = plan(
            &cfg,
            &leases,
            ME,
            &PreviousSubnets::default(),
            &mut StdRng::seed_from_u64(9),
        )
        .unwrap();
        assert_eq!(p.delete, Some(old));
        let Choice::Allocated(k) = p.choice else {
            panic!("{p:?}")
        };
        let pool = cfg.ipv4.unwrap();
        assert!(pool.is_compatible(k.ipv4), "{k}");
        assert!(ip::contains_subnet(net("10.4.0.0/16"), k.ipv4));
    }

    #[test]
    fn reuse_requires_matching_families() {
        // Our lease has no IPv6 part but IPv6 is now enabled: delete and allocate both.
        let mut leases = mock_leases();
        let old = lease("10.3.7.0-24", ME.octets());
        leases.push(old.clone());
        let cfg = config(
            r#"{ "Network": "10.3.0.0/16", "EnableIPv6": true, "IPv6Network": "fd00:1::/56" }"#,
        );
        let p = plan(
            &cfg,
            &leases,
            ME,
            &PreviousSubnets::default(),
            &mut StdRng::seed_from_u64(2),
        )
        .unwrap();
        assert_eq!(p.delete, Some(old));
        let k = p.choice.key().unwrap();
        let v6 = k.ipv6.unwrap();
        assert!(cfg.ipv6.unwrap().is_compatible(v6), "{k}");

        // And the reverse: a dual lease is not reused once IPv6 is disabled.
        let dual = lease("10.3.7.0-24&fd00:1:0:5::-64", ME.octets());
        let p = plan(
            &config(MOCK_CONFIG),
            std::slice::from_ref(&dual),
            ME,
            &PreviousSubnets::default(),
            &mut StdRng::seed_from_u64(2),
        )
        .unwrap();
        assert_eq!(p.delete, Some(dual.clone()));
        let cfg6 = config(
            r#"{ "Network": "10.3.0.0/16", "EnableIPv6": true, "IPv6Network": "fd00:1::/56" }"#,
        );
        let p = plan(
            &cfg6,
            std::slice::from_ref(&dual),
            ME,
            &PreviousSubnets::default(),
            &mut StdRng::seed_from_u64(2),
        )
        .unwrap();
        assert_eq!(p.choice, Choice::Reuse(dual));
    }

    #[test]
    fn dual_stack_allocation_skips_used_v6_subnets() {
        let cfg = config(
            r#"{ "Network": "10.3.0.0/16", "EnableIPv6": true, "IPv6Network": "fd00:1::/62" }"#,
        );
        // /62 → /64 subnets: min fd00:1:0:1::, max fd00:1:0:3:: ; two of three taken.
        let leases = vec![
            lease("10.3.1.0-24&fd00:1:0:1::-64", [1, 1, 1, 1]),
            lease("10.3.2.0-24&fd00:1:0:3::-64", [2, 2, 2, 2]),
        ];
        for seed in 0..20 {
            let p = plan(
                &cfg,
                &leases,
                ME,
                &PreviousSubnets::default(),
                &mut StdRng::seed_from_u64(seed),
            )
            .unwrap();
            let k = p.choice.key().unwrap();
            assert_eq!(k.ipv6, Some("fd00:1:0:2::/64".parse().unwrap()));
            assert!(k.ipv4 != net("10.3.1.0/24") && k.ipv4 != net("10.3.2.0/24"));
        }
        let leases_full = vec![
            lease("10.3.1.0-24&fd00:1:0:1::-64", [1, 1, 1, 1]),
            lease("10.3.2.0-24&fd00:1:0:2::-64", [2, 2, 2, 2]),
            lease("10.3.3.0-24&fd00:1:0:3::-64", [3, 3, 3, 3]),
        ];
        let e = plan(
            &cfg,
            &leases_full,
            ME,
            &PreviousSubnets::default(),
            &mut StdRng::seed_from_u64(0),
        )
        .unwrap_err();
        assert_eq!(e.to_string(), "out of subnets");
        // A previous dual subnet whose v6 part is in use is not reused.
        let prev = PreviousSubnets {
            ipv4: Some(net("10.3.9.0/24")),
            ipv6: Some("fd00:1:0:1::/64".parse().unwrap()),
        };
        let p = plan(&cfg, &leases, ME, &prev, &mut StdRng::seed_from_u64(0)).unwrap();
        assert!(matches!(p.choice, Choice::Allocated(_)), "{p:?}");
        let prev = PreviousSubnets {
            ipv4: Some(net("10.3.9.0/24")),
            ipv6: Some("fd00:1:0:2::/64".parse().unwrap()),
        };
        let p = plan(&cfg, &leases, ME, &prev, &mut StdRng::seed_from_u64(0)).unwrap();
        assert_eq!(
            p.choice,
            Choice::Previous("10.3.9.0-24&fd00:1:0:2::-64".parse().unwrap())
        );
    }

    #[test]
    fn out_of_subnets() {
        let cfg = config(r#"{ "Network": "10.0.0.0/28" }"#);
        let leases: Vec<Lease> = ["10.0.0.4-30", "10.0.0.8-30", "10.0.0.12-30"]
            .iter()
            .map(|k| lease(k, [1, 1, 1, 1]))
            .collect();
        let e = plan(
            &cfg,
            &leases,
            ME,
            &PreviousSubnets::default(),
            &mut StdRng::seed_from_u64(0),
        )
        .unwrap_err();
        assert_eq!(e, AllocError::OutOfSubnets);
        // A covering lease of another length blocks everything it overlaps.
        let big = vec![lease("10.0.0.0-28", [1, 1, 1, 1])];
        assert!(
            plan(
                &cfg,
                &big,
                ME,
                &PreviousSubnets::default(),
                &mut StdRng::seed_from_u64(0)
            )
            .is_err()
        );
    }

    #[test]
    fn picks_only_among_the_first_hundred_free_candidates() {
        let cfg = config(r#"{ "Network": "10.0.0.0/8" }"#);
        let leases = vec![lease("10.0.5.0-24", [1, 1, 1, 1])];
        let pool = cfg.ipv4.unwrap();
        let free = free_candidates(&pool, leases.iter().filter_map(|l| l.subnet));
        assert_eq!(free.len(), MAX_CANDIDATES);
        assert_eq!(free[0], net("10.0.1.0/24"));
        assert_eq!(free[99], net("10.0.101.0/24"));
        assert!(!free.contains(&net("10.0.5.0/24")));
        let mut rng = StdRng::seed_from_u64(42);
        let mut seen = BTreeSet::new();
        for _ in 0..500 {
            let k = plan(&cfg, &leases, ME, &PreviousSubnets::default(), &mut rng)
                .unwrap()
                .choice
                .key()
                .unwrap();
            assert!(free.contains(&k.ipv4), "{k}");
            seen.insert(k.ipv4);
        }
        assert!(seen.len() > 90, "{}", seen.len());
    }

    #[test]
    fn ipv6_only_is_refused() {
        let cfg =
            config(r#"{ "EnableIPv4": false, "EnableIPv6": true, "IPv6Network": "fd00::/48" }"#);
        let e = plan(
            &cfg,
            &[],
            ME,
            &PreviousSubnets::default(),
            &mut StdRng::seed_from_u64(0),
        )
        .unwrap_err();
        assert_eq!(e, AllocError::Ipv6OnlyUnsupported);
    }
}
