//! Masquerade in eBPF, run with `BPF_PROG_TEST_RUN` on crafted packets through the agent's
//! `flannel_agent::bpf` API: `tc_to_netdev` source-NATs, `tc_from_netdev` translates the
//! replies back. Every output is compared byte for byte with a packet the builder made with
//! the translated addresses (so the incremental checksums equal recomputed ones) and checked
//! with the independent parser; counters are checked exactly.
//!
//! Covered: TCP, UDP (with and without checksum) and ICMP echo both ways; port collisions
//! (another port, per destination); the node's own flows (registered, moved on collision);
//! exhaustion (dropped, counted) and ports freed by closed or expired flows; what is not
//! masqueraded (cluster destinations, multicast, excluded prefixes, kube-proxy's mark, other
//! sources, NAT off); replies to unknown tuples; a lost reply entry made again when its flow
//! is refreshed; ICMP errors with their quoted headers in both directions; fragments; the
//! agent's read-out, sweep and resize; `bpftool` output. Steps of a scenario whose input,
//! output and counters are all known beforehand are written as [`Step`] tables.
//!
//! Needs root; skips otherwise, and when the agent was built without the eBPF object.

use std::{
    collections::BTreeMap, net::Ipv4Addr, path::Path, process::Command, thread, time::Duration,
};

use flannel_agent::bpf::{
    FastPath, Hook, LoadOptions, LocalConfig, NatSettings, PinLayout, Remote, Via, VxlanLocal,
};
use flannel_common::{
    maps as names,
    nat::{self, NatEntry, NatKey, NatRevEntry},
    stats::Reason,
};
use flannel_tests::packet::{
    self, Checksum, Ethernet, Icmp, Ipv4, ParsedL3, ParsedL4, Tcp, Transport, Udp, tcp_flags,
};
use ipnet::Ipv4Net;

mod bpf_support;

use bpf_support::{
    EXT_MAC, Mac, Rig, Skb, TC_ACT_OK, TC_ACT_SHOT, assert_bytes, assert_counted,
    mutate::{self, Tunnel},
    net, run,
};

const GW_MAC: Mac = [0x02, 0xee, 0, 0, 0, 0xfe];

/// The node: public and masquerade address.
const NODE: Ipv4Addr = Ipv4Addr::new(192, 168, 77, 1);
const POD: Ipv4Addr = Ipv4Addr::new(10, 244, 1, 5);
const POD2: Ipv4Addr = Ipv4Addr::new(10, 244, 1, 6);
const POD3: Ipv4Addr = Ipv4Addr::new(10, 244, 1, 7);
const REMOTE_POD: Ipv4Addr = Ipv4Addr::new(10, 244, 2, 7);
/// Destinations outside the cluster network.
const OUT: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 10);
const OUT2: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 20);
/// In the excluded prefix 100.64.0.0/10.
const EXCLUDED: Ipv4Addr = Ipv4Addr::new(100, 64, 3, 3);
/// A router on the path that reports errors.
const ROUTER: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 1);

impl Rig {
    /// A node namespace (ext0 192.168.77.1/24, a host-gw route to 10.244.2.0/24) and a pin
    /// directory. `None` (test skipped) when not root or without the eBPF object.
    fn new(name: &str) -> Option<Rig> {
        let rig = Rig::ext_only(name)?;
        rig.sh("ip route add 10.244.2.0/24 via 192.168.77.2 dev ext0");
        Some(rig)
    }

    /// Runs `f` in the namespace with a fast path loaded (NAT maps of `nat_entries` flows),
    /// configured, synced, and masquerading with `settings`.
    fn with_nat<R: Send>(
        &self,
        settings: NatSettings,
        f: impl FnOnce(&mut FastPath, u32) -> R + Send,
    ) -> R {
        self.with_nat_sized(4096, settings, f)
    }

    fn with_nat_sized<R: Send>(
        &self,
        nat_entries: u32,
        settings: NatSettings,
        f: impl FnOnce(&mut FastPath, u32) -> R + Send,
    ) -> R {
        let pin = self.pin.clone();
        self.ns
            .enter(move || {
                let ext = ext0();
                let mut fp = loaded(&pin, nat_entries, &settings);
                f(&mut fp, ext)
            })
            .expect("entering the namespace")
    }
}

/// `ext0`'s index (in the rig's namespace).
fn ext0() -> u32 {
    nix::net::if_::if_nametoindex("ext0").expect("ext0")
}

/// A fast path loaded with its maps pinned under `pin` (NAT maps of `nat_entries` flows),
/// configured, synced, and masquerading with `settings` (in the rig's namespace).
fn loaded(pin: &Path, nat_entries: u32, settings: &NatSettings) -> FastPath {
    let options = LoadOptions {
        nat_max_entries: nat_entries,
        ..LoadOptions::default()
    };
    let mut fp = FastPath::load_with(pin, &options).expect("loading");
    fp.set_config(&config(ext0())).expect("config");
    fp.sync(&remotes()).expect("sync");
    fp.set_nat(Some(settings)).expect("nat settings");
    fp
}

fn config(ext: u32) -> LocalConfig {
    LocalConfig {
        vxlan: Some(VxlanLocal {
            vni: 1,
            port: 8472,
            vtep_mac: [0x0e, 0, 0, 0, 0, 1],
        }),
        source_ports: (32768, 60999),
        outer_ttl: 64,
        ..LocalConfig::new(NODE, ext, net("10.244.1.0/24"), net("10.244.0.0/16"))
    }
}

fn remotes() -> BTreeMap<Ipv4Net, Remote> {
    [(
        net("10.244.2.0/24"),
        Remote {
            public_ip: Ipv4Addr::new(192, 168, 77, 2),
            via: Via::HostGw,
        },
    )]
    .into()
}

/// Masquerade to the node's address, ports 32768-60999, 100.64.0.0/10 excluded.
fn settings() -> NatSettings {
    NatSettings {
        ports: (32768, 60999),
        no_masq: vec![net("100.64.0.0/10")],
        ..NatSettings::new(NODE)
    }
}

/// A frame leaving through ext0 (the node's MAC to the gateway's).
fn egress_frame(ip: &Ipv4) -> Vec<u8> {
    Ethernet::new(EXT_MAC, GW_MAC, ip.clone()).encode()
}

/// A frame arriving on ext0.
fn ingress_frame(ip: &Ipv4) -> Vec<u8> {
    Ethernet::new(GW_MAC, EXT_MAC, ip.clone()).encode()
}

/// The packet with source `src`, or `src_port` (TCP/UDP) / identifier (ICMP) changed.
fn with_source(ip: &Ipv4, src: Ipv4Addr, port: Option<u16>) -> Ipv4 {
    let mut out = Ipv4 { src, ..ip.clone() };
    if let Some(port) = port {
        set_port(&mut out.payload, port, true);
    }
    out
}

/// The packet with destination `dst`, and its destination port / identifier changed.
fn with_destination(ip: &Ipv4, dst: Ipv4Addr, port: Option<u16>) -> Ipv4 {
    let mut out = Ipv4 { dst, ..ip.clone() };
    if let Some(port) = port {
        set_port(&mut out.payload, port, false);
    }
    out
}

fn set_port(l4: &mut Transport, port: u16, source: bool) {
    match l4 {
        Transport::Tcp(t) if source => t.src_port = port,
        Transport::Tcp(t) => t.dst_port = port,
        Transport::Udp(u) if source => u.src_port = port,
        Transport::Udp(u) => u.dst_port = port,
        Transport::Icmp(i) => i.rest[..2].copy_from_slice(&port.to_be_bytes()),
        _ => panic!("no port to set"),
    }
}

/// The L4 source port (ICMP: identifier) of an output frame, checking every checksum.
fn source_port(frame: &[u8]) -> u16 {
    let parsed = packet::verify(frame).expect("valid output");
    let ParsedL3::Ipv4(ip) = parsed.l3 else {
        panic!("not IPv4")
    };
    match ip.l4 {
        ParsedL4::Tcp { src_port, .. } | ParsedL4::Udp { src_port, .. } => src_port,
        ParsedL4::Icmp { rest, .. } => u16::from_be_bytes([rest[0], rest[1]]),
        ParsedL4::Raw(_) => panic!("no L4 header"),
    }
}

/// One packet through one program and what must come of it: passed (`TC_ACT_OK`), the frame
/// that comes out byte for byte, and exactly these counters (one packet each).
struct Step<'a> {
    what: &'a str,
    hook: Hook,
    frame: Vec<u8>,
    out: Vec<u8>,
    counted: &'a [Reason],
}

impl<'a> Step<'a> {
    /// `ip` leaving through ext0 (`tc_to_netdev`), coming out as `out`.
    fn out(what: &'a str, ip: &Ipv4, out: &Ipv4, counted: &'a [Reason]) -> Self {
        Step {
            what,
            hook: Hook::ToNetdev,
            frame: egress_frame(ip),
            out: egress_frame(out),
            counted,
        }
    }

    /// `ip` arriving on ext0 (`tc_from_netdev`), coming out as `out`.
    fn back(what: &'a str, ip: &Ipv4, out: &Ipv4, counted: &'a [Reason]) -> Self {
        Step {
            what,
            hook: Hook::FromNetdev,
            frame: ingress_frame(ip),
            out: ingress_frame(out),
            counted,
        }
    }

    /// Runs the step and checks its outcome.
    fn check(&self, fp: &mut FastPath, ext: u32) -> bpf_support::Run {
        let r = run(fp, self.hook, &self.frame, Skb::on(ext));
        assert_eq!(r.verdict, TC_ACT_OK, "{}", self.what);
        assert_bytes(&r.out, &self.out, self.what);
        assert_counted(&r, self.counted, self.what);
        r
    }
}

fn tcp(sport: u16, dport: u16, flags: u8) -> Tcp {
    Tcp {
        seq: 1000,
        ack: if flags & tcp_flags::ACK != 0 { 2000 } else { 0 },
        ..Tcp::new(sport, dport).flags(flags).payload(b"masquerade")
    }
}

// ---------------------------------------------------------------------------------------------

#[test]
fn each_protocol_is_translated_both_ways_with_valid_checksums() {
    let Some(rig) = Rig::new("ntprot") else {
        return;
    };
    rig.with_nat(settings(), |fp, ext| {
        let cases: Vec<(&str, Transport, Transport, Reason)> = vec![
            (
                "tcp",
                tcp(40000, 443, tcp_flags::SYN).into(),
                tcp(443, 40000, tcp_flags::SYN | tcp_flags::ACK).into(),
                Reason::Ipv4Tcp,
            ),
            (
                "udp",
                Udp::new(40001, 53).payload(b"query").into(),
                Udp::new(53, 40001).payload(b"answer").into(),
                Reason::Ipv4Udp,
            ),
            (
                "udp without checksum",
                Udp {
                    checksum: Checksum::Value(0),
                    ..Udp::new(40002, 5000).payload(b"nocsum")
                }
                .into(),
                Udp {
                    checksum: Checksum::Value(0),
                    ..Udp::new(5000, 40002).payload(b"nocsum back")
                }
                .into(),
                Reason::Ipv4Udp,
            ),
            (
                "icmp echo",
                Icmp::echo_request(0x4242, 1).into(),
                Icmp::echo_reply(0x4242, 1).into(),
                Reason::Ipv4Icmp,
            ),
        ];
        for (what, out_l4, back_l4, class) in cases {
            let ip = Ipv4::new(POD, OUT, out_l4);
            let frame = egress_frame(&ip);
            let r = run(fp, Hook::ToNetdev, &frame, Skb::on(ext));
            assert_eq!(r.verdict, TC_ACT_OK, "{what}");
            // The original port is in the range and free: kept; only the address changes.
            assert_bytes(&r.out, &egress_frame(&with_source(&ip, NODE, None)), what);
            packet::verify(&r.out).unwrap_or_else(|e| panic!("{what}: {e:#}"));
            assert_counted(&r, &[class, Reason::FastSnat, Reason::LearnSnatFlow], what);

            let reply = Ipv4::new(OUT, NODE, back_l4);
            let frame = ingress_frame(&reply);
            let r = run(fp, Hook::FromNetdev, &frame, Skb::on(ext));
            assert_eq!(r.verdict, TC_ACT_OK, "{what} reply");
            assert_bytes(
                &r.out,
                &ingress_frame(&with_destination(&reply, POD, None)),
                &format!("{what} reply"),
            );
            packet::verify(&r.out).unwrap_or_else(|e| panic!("{what} reply: {e:#}"));
            assert_counted(
                &r,
                &[class, Reason::FastSnatReply],
                &format!("{what} reply"),
            );

            // The next packet of the flow reuses the mapping: no new flow.
            let r = run(fp, Hook::ToNetdev, &egress_frame(&ip), Skb::on(ext));
            assert_counted(&r, &[class, Reason::FastSnat], &format!("{what} again"));
        }
        // A UDP checksum stays absent (0) both ways.
        let flows = fp.nat_flows().expect("flows");
        // Compared as a set: flows made within one tick of the coarse clock tie on age.
        let mut summary: Vec<String> = flows
            .iter()
            .map(|f| format!("{} {} {} {}", f.orig, f.remote, f.nat, f.reverse_ok))
            .collect();
        summary.sort();
        assert_eq!(
            summary,
            [
                "10.244.1.5:16962 203.0.113.10:0 192.168.77.1:16962 true",
                "10.244.1.5:40000 203.0.113.10:443 192.168.77.1:40000 true",
                "10.244.1.5:40001 203.0.113.10:53 192.168.77.1:40001 true",
                "10.244.1.5:40002 203.0.113.10:5000 192.168.77.1:40002 true",
            ],
            "{flows:#?}"
        );
        assert!(flows.iter().all(|f| !f.host && !f.expired));
        assert!(
            flows.iter().all(|f| f.to_string().contains("established")),
            "every flow saw a reply: {flows:#?}"
        );
    });
}

/// A live flow whose reply entry is gone (the LRU evicted it) gets it back when a packet going
/// out refreshes the flow (its FIN here: a state change), and its replies are translated again.
#[test]
fn a_lost_reply_entry_is_made_again_when_the_flow_is_refreshed() {
    let Some(rig) = Rig::new("ntrev") else {
        return;
    };
    let pin = rig.pin.clone();
    rig.with_nat(settings(), move |fp, ext| {
        let syn = Ipv4::new(POD, OUT, tcp(48000, 443, tcp_flags::SYN));
        let syn_ack = Ipv4::new(OUT, NODE, tcp(443, 48000, tcp_flags::SYN | tcp_flags::ACK));
        let ack = Ipv4::new(OUT, NODE, tcp(443, 48000, tcp_flags::ACK));
        let fin = Ipv4::new(POD, OUT, tcp(48000, 443, tcp_flags::FIN | tcp_flags::ACK));
        Step::out(
            "syn",
            &syn,
            &with_source(&syn, NODE, None),
            &[Reason::Ipv4Tcp, Reason::FastSnat, Reason::LearnSnatFlow],
        )
        .check(fp, ext);
        Step::back(
            "syn-ack",
            &syn_ack,
            &with_destination(&syn_ack, POD, None),
            &[Reason::Ipv4Tcp, Reason::FastSnatReply],
        )
        .check(fp, ext);

        // The reply entry (203.0.113.10:443 -> 192.168.77.1:48000, TCP) disappears.
        let rkey = NatKey::new(OUT.octets(), NODE.octets(), 443, 48000, nat::proto::TCP);
        remove_pinned::<NatRevEntry>(&pin, names::NAT_REV4, &rkey);
        let flows = fp.nat_flows().expect("flows");
        assert_eq!(flows.len(), 1, "{flows:#?}");
        assert!(!flows[0].reverse_ok, "{flows:#?}");

        for step in [
            Step::back(
                "reply without its entry",
                &ack,
                &ack,
                &[Reason::Ipv4Tcp, Reason::PassSnatNoEntry],
            ),
            Step::out(
                "fin: the flow's state changes",
                &fin,
                &with_source(&fin, NODE, None),
                &[Reason::Ipv4Tcp, Reason::FastSnat],
            ),
            Step::back(
                "reply after the refresh",
                &ack,
                &with_destination(&ack, POD, None),
                &[Reason::Ipv4Tcp, Reason::FastSnatReply],
            ),
        ] {
            step.check(fp, ext);
        }
        let flows = fp.nat_flows().expect("flows");
        assert!(flows.len() == 1 && flows[0].reverse_ok, "{flows:#?}");
        assert_eq!(flows[0].nat.port(), 48000, "{flows:#?}");
    });
}

/// A reply that changes nothing within half a second of its flow's last check is translated
/// from the reverse entry alone; one that changes the flow's state (a FIN from the outside)
/// updates the outgoing entry even inside that window; after it, the outgoing entry is read
/// again (here it is gone, so the reply is passed untranslated).
#[test]
fn replies_skip_the_flow_entry_only_within_half_a_second_of_a_check() {
    let Some(rig) = Rig::new("ntvouch") else {
        return;
    };
    let pin = rig.pin.clone();
    rig.with_nat(settings(), move |fp, ext| {
        // The deletion below must land inside the half second; on a stalled machine, the
        // scenario is tried again on another port.
        for (attempt, port) in [47000u16, 47001, 47002].into_iter().enumerate() {
            let syn = Ipv4::new(POD, OUT, tcp(port, 443, tcp_flags::SYN));
            let syn_ack = Ipv4::new(OUT, NODE, tcp(443, port, tcp_flags::SYN | tcp_flags::ACK));
            let fin = Ipv4::new(OUT, NODE, tcp(443, port, tcp_flags::FIN | tcp_flags::ACK));
            let ack = Ipv4::new(OUT, NODE, tcp(443, port, tcp_flags::ACK));
            Step::out(
                "syn",
                &syn,
                &with_source(&syn, NODE, None),
                &[Reason::Ipv4Tcp, Reason::FastSnat, Reason::LearnSnatFlow],
            )
            .check(fp, ext);
            let checked = std::time::Instant::now();
            for step in [
                Step::back(
                    "syn-ack",
                    &syn_ack,
                    &with_destination(&syn_ack, POD, None),
                    &[Reason::Ipv4Tcp, Reason::FastSnatReply],
                ),
                Step::back(
                    "fin from the outside",
                    &fin,
                    &with_destination(&fin, POD, None),
                    &[Reason::Ipv4Tcp, Reason::FastSnatReply],
                ),
            ] {
                step.check(fp, ext);
            }
            let flows = fp.nat_flows().expect("flows");
            let flow = flows
                .iter()
                .find(|f| f.orig.port() == port)
                .unwrap_or_else(|| panic!("no flow for {port}: {flows:#?}"));
            assert_eq!(
                flow.state,
                nat::ST_REPLIED | nat::ST_FIN_IN,
                "the FIN reached the flow's entry inside the window: {flow}"
            );

            // The flow's own entry disappears; its reverse entry stays.
            let key = NatKey::new(POD.octets(), OUT.octets(), port, 443, nat::proto::TCP);
            remove_pinned::<NatEntry>(&pin, names::NAT4, &key);
            let r = run(fp, Hook::FromNetdev, &ingress_frame(&ack), Skb::on(ext));
            if checked.elapsed() > Duration::from_millis(400) && attempt < 2 {
                continue;
            }
            assert_bytes(
                &r.out,
                &ingress_frame(&with_destination(&ack, POD, None)),
                "ack inside the window",
            );
            assert_counted(&r, &[Reason::Ipv4Tcp, Reason::FastSnatReply], "ack inside");

            thread::sleep(Duration::from_millis(600));
            Step::back(
                "ack after the window: the flow's entry is read, and is gone",
                &ack,
                &ack,
                &[Reason::Ipv4Tcp, Reason::PassSnatNoEntry],
            )
            .check(fp, ext);
            return;
        }
        panic!("three attempts each took more than 400 ms between the check and the ack");
    });
}

#[test]
fn port_collisions_get_another_port_per_destination() {
    let Some(rig) = Rig::new("ntcoll") else {
        return;
    };
    rig.with_nat(settings(), |fp, ext| {
        let first = Ipv4::new(POD, OUT, tcp(41000, 443, tcp_flags::SYN));
        let r = run(fp, Hook::ToNetdev, &egress_frame(&first), Skb::on(ext));
        assert_eq!(source_port(&r.out), 41000);

        // Another pod, same source port, same destination: the port is taken.
        let second = Ipv4::new(POD2, OUT, tcp(41000, 443, tcp_flags::SYN));
        let r = run(fp, Hook::ToNetdev, &egress_frame(&second), Skb::on(ext));
        assert_eq!(r.verdict, TC_ACT_OK);
        let moved = source_port(&r.out);
        assert_ne!(moved, 41000);
        assert!((32768..=60999).contains(&moved), "{moved}");
        assert_bytes(
            &r.out,
            &egress_frame(&with_source(&second, NODE, Some(moved))),
            "moved",
        );
        assert_counted(
            &r,
            &[
                Reason::Ipv4Tcp,
                Reason::FastSnat,
                Reason::LearnSnatFlow,
                Reason::LearnSnatRemap,
            ],
            "moved",
        );

        // A source port outside the range is never kept.
        let low = Ipv4::new(POD3, OUT, Udp::new(53, 53).payload(b"q"));
        let r = run(fp, Hook::ToNetdev, &egress_frame(&low), Skb::on(ext));
        let port = source_port(&r.out);
        assert!((32768..=60999).contains(&port), "{port}");

        // Another destination: the same port is free there.
        let elsewhere = Ipv4::new(POD2, OUT2, tcp(41000, 443, tcp_flags::SYN));
        let r = run(fp, Hook::ToNetdev, &egress_frame(&elsewhere), Skb::on(ext));
        assert_eq!(source_port(&r.out), 41000);
        let same_ip_other_port = Ipv4::new(POD2, OUT, tcp(41000, 8443, tcp_flags::SYN));
        let r = run(
            fp,
            Hook::ToNetdev,
            &egress_frame(&same_ip_other_port),
            Skb::on(ext),
        );
        assert_eq!(source_port(&r.out), 41000);

        // Each reply goes to its own pod.
        for (port, pod, pod_port) in [(41000, POD, 41000), (moved, POD2, 41000)] {
            let reply = Ipv4::new(OUT, NODE, tcp(443, port, tcp_flags::SYN | tcp_flags::ACK));
            let r = run(fp, Hook::FromNetdev, &ingress_frame(&reply), Skb::on(ext));
            assert_bytes(
                &r.out,
                &ingress_frame(&with_destination(&reply, pod, Some(pod_port))),
                &format!("reply to {port}"),
            );
        }
    });
}

#[test]
fn node_flows_are_registered_and_moved_on_collision() {
    let Some(rig) = Rig::new("nthost") else {
        return;
    };
    rig.with_nat(settings(), |fp, ext| {
        // The node's own connection from a port in the range: registered, untouched; its
        // replies are left alone too.
        let node_syn = Ipv4::new(NODE, OUT, tcp(42000, 443, tcp_flags::SYN));
        let reply = Ipv4::new(OUT, NODE, tcp(443, 42000, tcp_flags::SYN | tcp_flags::ACK));
        for step in [
            Step::out(
                "node flow",
                &node_syn,
                &node_syn,
                &[Reason::Ipv4Tcp, Reason::PassSnatHost, Reason::LearnSnatFlow],
            ),
            Step::back(
                "node reply",
                &reply,
                &reply,
                &[Reason::Ipv4Tcp, Reason::PassSnatHost],
            ),
        ] {
            step.check(fp, ext);
        }

        // A pod flow with that port to that destination does not get it.
        let pod = Ipv4::new(POD, OUT, tcp(42000, 443, tcp_flags::SYN));
        let r = run(fp, Hook::ToNetdev, &egress_frame(&pod), Skb::on(ext));
        let pod_port = source_port(&r.out);
        assert_ne!(pod_port, 42000);

        // The other way round: a pod holds a port (43000, unless the flow above was moved
        // there at random); the node's new connection from that port to the same destination
        // is moved (the kernel picked the port without knowing).
        let held: u16 = if pod_port == 43000 { 43001 } else { 43000 };
        let pod = Ipv4::new(POD, OUT, tcp(held, 443, tcp_flags::SYN));
        let r = run(fp, Hook::ToNetdev, &egress_frame(&pod), Skb::on(ext));
        assert_eq!(source_port(&r.out), held);
        let node_syn = Ipv4::new(NODE, OUT, tcp(held, 443, tcp_flags::SYN));
        let r = run(fp, Hook::ToNetdev, &egress_frame(&node_syn), Skb::on(ext));
        let node_port = source_port(&r.out);
        assert_ne!(node_port, held);
        assert_bytes(
            &r.out,
            &egress_frame(&with_source(&node_syn, NODE, Some(node_port))),
            "node flow moved",
        );
        assert_counted(
            &r,
            &[
                Reason::Ipv4Tcp,
                Reason::FastSnat,
                Reason::LearnSnatFlow,
                Reason::LearnSnatRemap,
            ],
            "node flow moved",
        );
        let reply = Ipv4::new(
            OUT,
            NODE,
            tcp(443, node_port, tcp_flags::SYN | tcp_flags::ACK),
        );
        Step::back(
            "moved node flow's reply",
            &reply,
            &with_destination(&reply, NODE, Some(held)),
            &[Reason::Ipv4Tcp, Reason::FastSnatReply],
        )
        .check(fp, ext);

        // A node *reply* (not a SYN: an inbound connection to a listening port) cannot move.
        let pod = Ipv4::new(POD2, OUT2, tcp(44000, 5432, tcp_flags::SYN));
        let _ = run(fp, Hook::ToNetdev, &egress_frame(&pod), Skb::on(ext));
        let node_reply = Ipv4::new(
            NODE,
            OUT2,
            tcp(44000, 5432, tcp_flags::SYN | tcp_flags::ACK),
        );
        // Ports outside the range and VXLAN are not the NAT's business.
        let ssh = Ipv4::new(NODE, OUT, tcp(22, 50000, tcp_flags::ACK));
        for step in [
            Step::out(
                "node reply kept",
                &node_reply,
                &node_reply,
                &[Reason::Ipv4Tcp, Reason::PassSnatUnhandled],
            ),
            Step::out(
                "port 22",
                &ssh,
                &ssh,
                &[Reason::Ipv4Tcp, Reason::PassNoRoute],
            ),
        ] {
            step.check(fp, ext);
        }
        let flows = fp.nat_flows().expect("flows");
        assert_eq!(flows.iter().filter(|f| f.host).count(), 2, "{flows:#?}");
    });
}

#[test]
fn a_handover_keeps_live_flows_and_maps_no_new_ones() {
    let Some(rig) = Rig::new("nthand") else {
        return;
    };
    rig.with_nat(settings(), |fp, ext| {
        // A pod flow masqueraded before the handover.
        let syn = Ipv4::new(POD, OUT, tcp(45000, 443, tcp_flags::SYN));
        let r = run(fp, Hook::ToNetdev, &egress_frame(&syn), Skb::on(ext));
        assert_eq!(source_port(&r.out), 45000);
        assert!(fp.begin_nat_handover().expect("handover"));
        assert!(fp.nat_config().expect("config").handover());

        let data = Ipv4::new(POD, OUT, tcp(45000, 443, tcp_flags::ACK));
        let reply = Ipv4::new(OUT, NODE, tcp(443, 45000, tcp_flags::ACK));
        let new = Ipv4::new(POD2, OUT, tcp(46000, 443, tcp_flags::SYN));
        let kernel = Ipv4::new(NODE, OUT, tcp(47000, 443, tcp_flags::SYN));
        let clash = Ipv4::new(NODE, OUT, tcp(45000, 443, tcp_flags::SYN));
        for step in [
            // The live flow goes on being translated both ways.
            Step::out(
                "live flow",
                &data,
                &with_source(&data, NODE, None),
                &[Reason::Ipv4Tcp, Reason::FastSnat],
            ),
            Step::back(
                "live flow's reply",
                &reply,
                &with_destination(&reply, POD, None),
                &[Reason::Ipv4Tcp, Reason::FastSnatReply],
            ),
            // A new pod flow is the kernel's: unchanged, nothing mapped.
            Step::out(
                "new pod flow",
                &new,
                &new,
                &[Reason::Ipv4Tcp, Reason::PassSnatNoEntry],
            ),
            // The kernel's masqueraded flows are registered, never moved: not even a new one
            // whose port a live pod flow holds (it is passed as it is).
            Step::out(
                "kernel flow",
                &kernel,
                &kernel,
                &[Reason::Ipv4Tcp, Reason::PassSnatHost, Reason::LearnSnatFlow],
            ),
            Step::out(
                "kernel flow on a held port",
                &clash,
                &clash,
                &[Reason::Ipv4Tcp, Reason::PassSnatUnhandled],
            ),
        ] {
            step.check(fp, ext);
        }

        let flows = fp.nat_flows().expect("flows");
        assert_eq!(flows.len(), 2, "{flows:#?}");
        assert_eq!(
            flannel_agent::bpf::nat::handover_pending(&flows),
            1,
            "{flows:#?}"
        );

        // Turning eBPF SNAT on again ends the handover.
        fp.set_nat(Some(&settings())).expect("nat settings");
        assert!(!fp.nat_config().expect("config").handover());
        let r = run(fp, Hook::ToNetdev, &egress_frame(&new), Skb::on(ext));
        assert_eq!(source_port(&r.out), 46000);
        assert_counted(
            &r,
            &[Reason::Ipv4Tcp, Reason::FastSnat, Reason::LearnSnatFlow],
            "pod flow after the handover",
        );
    });
}

#[test]
fn exhaustion_drops_and_counts_and_closed_flows_free_their_ports() {
    let Some(rig) = Rig::new("ntexh") else {
        return;
    };
    let mut s = settings();
    s.ports = (40000, 40001);
    s.timeouts.udp = Duration::from_secs(1);
    s.timeouts.tcp_closed = Duration::from_secs(1);
    rig.with_nat(s, |fp, ext| {
        // Two ports for three flows to the same destination.
        let flow = |pod| Ipv4::new(pod, OUT, tcp(50000, 80, tcp_flags::SYN));
        let mut ports = Vec::new();
        for pod in [POD, POD2] {
            let r = run(fp, Hook::ToNetdev, &egress_frame(&flow(pod)), Skb::on(ext));
            assert_eq!(r.verdict, TC_ACT_OK);
            ports.push(source_port(&r.out));
        }
        ports.sort_unstable();
        assert_eq!(ports, [40000, 40001]);
        let frame = egress_frame(&flow(POD3));
        let r = run(fp, Hook::ToNetdev, &frame, Skb::on(ext));
        assert_eq!(r.verdict, TC_ACT_SHOT, "no free port: dropped");
        assert_counted(
            &r,
            &[Reason::Ipv4Tcp, Reason::DropSnatExhausted],
            "exhausted",
        );
        let exhausted = fp
            .counters()
            .expect("counters")
            .to_netdev
            .get(Reason::DropSnatExhausted);
        assert_eq!(exhausted.packets, 1);
        assert_eq!(exhausted.bytes, frame.len() as u64);

        // POD's flow closes (FIN both ways); POD2's stays established.
        let pod_port = |pod| {
            fp.nat_flows()
                .expect("flows")
                .iter()
                .find(|f| *f.orig.ip() == pod)
                .map(|f| f.nat.port())
                .expect("flow")
        };
        let (p1, p2) = (pod_port(POD), pod_port(POD2));
        let reply = |port, flags| Ipv4::new(OUT, NODE, tcp(80, port, flags));
        for (port, pod) in [(p1, POD), (p2, POD2)] {
            let r = run(
                fp,
                Hook::FromNetdev,
                &ingress_frame(&reply(port, tcp_flags::SYN | tcp_flags::ACK)),
                Skb::on(ext),
            );
            assert_bytes(
                &r.out,
                &ingress_frame(&with_destination(
                    &reply(port, tcp_flags::SYN | tcp_flags::ACK),
                    pod,
                    Some(50000),
                )),
                "syn-ack",
            );
        }
        let fin = Ipv4::new(POD, OUT, tcp(50000, 80, tcp_flags::FIN | tcp_flags::ACK));
        let _ = run(fp, Hook::ToNetdev, &egress_frame(&fin), Skb::on(ext));
        let _ = run(
            fp,
            Hook::FromNetdev,
            &ingress_frame(&reply(p1, tcp_flags::FIN | tcp_flags::ACK)),
            Skb::on(ext),
        );
        let states: Vec<String> = fp
            .nat_flows()
            .expect("flows")
            .iter()
            .map(ToString::to_string)
            .collect();
        assert!(
            states
                .iter()
                .any(|s| s.contains("10.244.1.5") && s.contains("closed")),
            "{states:#?}"
        );
        // Within the closing grace, the port is still taken.
        let r = run(fp, Hook::ToNetdev, &egress_frame(&flow(POD3)), Skb::on(ext));
        assert_eq!(r.verdict, TC_ACT_SHOT);
        thread::sleep(Duration::from_millis(1300));
        // After it, POD3 gets POD's port; POD2's established flow keeps its own.
        let r = run(fp, Hook::ToNetdev, &egress_frame(&flow(POD3)), Skb::on(ext));
        assert_eq!(r.verdict, TC_ACT_OK);
        assert_eq!(source_port(&r.out), p1);
        let r = run(
            fp,
            Hook::FromNetdev,
            &ingress_frame(&reply(p2, tcp_flags::ACK)),
            Skb::on(ext),
        );
        assert_bytes(
            &r.out,
            &ingress_frame(&with_destination(
                &reply(p2, tcp_flags::ACK),
                POD2,
                Some(50000),
            )),
            "established flow untouched",
        );

        // UDP flows expire after their (1 s) timeout and free the port as well.
        let udp = |pod| Ipv4::new(pod, OUT2, Udp::new(50000, 53).payload(b"q"));
        for pod in [POD, POD2] {
            let r = run(fp, Hook::ToNetdev, &egress_frame(&udp(pod)), Skb::on(ext));
            assert_eq!(r.verdict, TC_ACT_OK);
        }
        let r = run(fp, Hook::ToNetdev, &egress_frame(&udp(POD3)), Skb::on(ext));
        assert_eq!(r.verdict, TC_ACT_SHOT);
        thread::sleep(Duration::from_millis(1300));
        let r = run(fp, Hook::ToNetdev, &egress_frame(&udp(POD3)), Skb::on(ext));
        assert_eq!(r.verdict, TC_ACT_OK);

        // The sweep deletes what expired (both entries of each flow).
        thread::sleep(Duration::from_millis(1300));
        let before = fp.nat_flows().expect("flows");
        let stats = fp.nat_sweep().expect("sweep");
        let after = fp.nat_flows().expect("flows");
        assert_eq!(
            stats.expired,
            before.iter().filter(|f| f.expired).count(),
            "{before:#?}"
        );
        assert!(stats.expired >= 3, "{stats:?}");
        assert!(
            after.iter().all(|f| !f.expired && f.reverse_ok),
            "{after:#?}"
        );
        assert_eq!(stats.flows, after.len());
    });
}

#[test]
fn what_is_not_masqueraded_is_left_untouched() {
    let Some(rig) = Rig::new("ntskip") else {
        return;
    };
    rig.with_nat(settings(), |fp, ext| {
        let cases: Vec<(&str, Ipv4, u32, Reason)> = vec![
            (
                "to a remote pod",
                Ipv4::new(POD, REMOTE_POD, tcp(40000, 80, tcp_flags::SYN)),
                0,
                Reason::PassNotIpipRoute,
            ),
            (
                "to multicast",
                Ipv4::new(POD, Ipv4Addr::new(224, 0, 0, 251), Udp::new(5353, 5353)),
                0,
                Reason::PassNoRoute,
            ),
            (
                "to an excluded prefix",
                Ipv4::new(POD, EXCLUDED, tcp(40000, 80, tcp_flags::SYN)),
                0,
                Reason::PassSnatExcluded,
            ),
            (
                "marked by kube-proxy",
                Ipv4::new(POD, OUT, tcp(40000, 80, tcp_flags::SYN)),
                0x4000,
                Reason::PassSnatExcluded,
            ),
            (
                "from another host address",
                Ipv4::new(
                    Ipv4Addr::new(172, 17, 0, 2),
                    OUT,
                    tcp(40000, 80, tcp_flags::SYN),
                ),
                0,
                Reason::PassNoRoute,
            ),
            (
                "flannel.1's VXLAN",
                Ipv4::new(
                    NODE,
                    Ipv4Addr::new(192, 168, 77, 3),
                    Udp::new(45000, 8472).payload(&[0; 8]),
                ),
                0,
                Reason::PassNoRoute,
            ),
        ];
        for (what, ip, mark, verdict) in cases {
            let frame = egress_frame(&ip);
            let r = run(
                fp,
                Hook::ToNetdev,
                &frame,
                Skb {
                    mark,
                    ..Skb::on(ext)
                },
            );
            assert_eq!(r.verdict, TC_ACT_OK, "{what}");
            assert_bytes(&r.out, &frame, what);
            let class = match ip.payload {
                Transport::Tcp(_) => Reason::Ipv4Tcp,
                _ => Reason::Ipv4Udp,
            };
            let mut want = vec![class, verdict];
            if what == "to a remote pod" {
                want.push(Reason::LearnKernelFlow);
            }
            assert_counted(&r, &want, what);
        }
        assert!(fp.nat_flows().expect("flows").is_empty());

        // With masquerade off, pod traffic to the outside leaves as it is.
        fp.set_nat(None).expect("off");
        let frame = egress_frame(&Ipv4::new(POD, OUT, tcp(40000, 80, tcp_flags::SYN)));
        let r = run(fp, Hook::ToNetdev, &frame, Skb::on(ext));
        assert_bytes(&r.out, &frame, "nat off");
        assert_counted(&r, &[Reason::Ipv4Tcp, Reason::PassNoRoute], "nat off");
        assert_eq!(fp.nat_config().expect("config").flags, 0);
    });
}

#[test]
fn replies_to_unknown_tuples_are_passed_and_counted() {
    let Some(rig) = Rig::new("ntunk") else {
        return;
    };
    rig.with_nat(settings(), |fp, ext| {
        let cases: Vec<(&str, Ipv4, Vec<Reason>)> = vec![
            (
                "tcp in the range",
                Ipv4::new(OUT, NODE, tcp(443, 45000, tcp_flags::ACK)),
                vec![Reason::Ipv4Tcp, Reason::PassSnatNoEntry],
            ),
            (
                "udp in the range",
                Ipv4::new(OUT, NODE, Udp::new(53, 45000).payload(b"late")),
                vec![Reason::Ipv4Udp, Reason::PassSnatNoEntry],
            ),
            (
                "echo reply",
                Ipv4::new(OUT, NODE, Icmp::echo_reply(77, 1)),
                vec![Reason::Ipv4Icmp, Reason::PassSnatNoEntry],
            ),
            // Not replies at all: left to the program's usual handling.
            (
                "a SYN",
                Ipv4::new(OUT, NODE, tcp(50000, 45000, tcp_flags::SYN)),
                vec![Reason::Ipv4Tcp, Reason::PassNotForPod],
            ),
            (
                "a port outside the range",
                Ipv4::new(OUT, NODE, tcp(50000, 22, tcp_flags::ACK)),
                vec![Reason::Ipv4Tcp, Reason::PassNotForPod],
            ),
        ];
        for (what, ip, reasons) in cases {
            let frame = ingress_frame(&ip);
            let r = run(fp, Hook::FromNetdev, &frame, Skb::on(ext));
            assert_eq!(r.verdict, TC_ACT_OK, "{what}");
            assert_bytes(&r.out, &frame, what);
            assert_counted(&r, &reasons, what);
        }
        // A reply after its flow expired is unknown too.
        fp.set_nat(Some(&NatSettings {
            timeouts: flannel_agent::bpf::NatTimeouts {
                udp: Duration::from_secs(1),
                ..Default::default()
            },
            ..settings()
        }))
        .expect("settings");
        let query = Ipv4::new(POD, OUT, Udp::new(46000, 53).payload(b"q"));
        let _ = run(fp, Hook::ToNetdev, &egress_frame(&query), Skb::on(ext));
        thread::sleep(Duration::from_millis(1300));
        let late = Ipv4::new(OUT, NODE, Udp::new(53, 46000).payload(b"a"));
        let frame = ingress_frame(&late);
        let r = run(fp, Hook::FromNetdev, &frame, Skb::on(ext));
        assert_bytes(&r.out, &frame, "expired");
        assert_counted(&r, &[Reason::Ipv4Udp, Reason::PassSnatNoEntry], "expired");
    });
}

/// The first 28 bytes of a frame's IPv4 packet: what an ICMP error quotes.
fn quote(frame: &[u8]) -> Vec<u8> {
    frame[14..14 + 28].to_vec()
}

fn icmp_error(ty: u8, code: u8, quoted: Vec<u8>) -> Icmp {
    Icmp {
        ty,
        code,
        rest: [0, 0, 0x05, 0xdc],
        checksum: Checksum::Correct,
        payload: quoted,
    }
}

#[test]
fn icmp_errors_are_translated_with_the_header_they_quote() {
    let Some(rig) = Rig::new("nticmp") else {
        return;
    };
    rig.with_nat(settings(), |fp, ext| {
        // Two pods with the same port: the second one's port is moved, so the quoted port
        // matters as much as the address.
        for pod in [POD, POD2] {
            let syn = Ipv4::new(pod, OUT, tcp(47000, 443, tcp_flags::SYN));
            let _ = run(fp, Hook::ToNetdev, &egress_frame(&syn), Skb::on(ext));
        }
        let syn = Ipv4::new(POD2, OUT, tcp(47000, 443, tcp_flags::ACK));
        let pod_frame = egress_frame(&syn);
        let r = run(fp, Hook::ToNetdev, &pod_frame, Skb::on(ext));
        let moved = source_port(&r.out);
        assert_ne!(moved, 47000);

        // A router answers the translated packet with "fragmentation needed".
        let err = Ipv4::new(ROUTER, NODE, icmp_error(3, 4, quote(&r.out)));
        let r = run(fp, Hook::FromNetdev, &ingress_frame(&err), Skb::on(ext));
        assert_eq!(r.verdict, TC_ACT_OK);
        let want = Ipv4::new(ROUTER, POD2, icmp_error(3, 4, quote(&pod_frame)));
        assert_bytes(&r.out, &ingress_frame(&want), "frag needed for the pod");
        packet::verify(&r.out).expect("outer checksums");
        assert_eq!(
            packet::checksum(&r.out[14 + 28..14 + 48]),
            0,
            "quoted header"
        );
        assert_counted(
            &r,
            &[Reason::Ipv4Icmp, Reason::FastSnatIcmpError],
            "frag needed",
        );

        // The pod reports "port unreachable" for a UDP reply it got: the quoted reply is
        // put back the way it was on the wire.
        let query = Ipv4::new(POD2, OUT, Udp::new(5353, 53).payload(b"q"));
        let r = run(fp, Hook::ToNetdev, &egress_frame(&query), Skb::on(ext));
        let nat_port = source_port(&r.out);
        let wire_reply = Ipv4::new(OUT, NODE, Udp::new(53, nat_port).payload(b"answer!!"));
        let r = run(
            fp,
            Hook::FromNetdev,
            &ingress_frame(&wire_reply),
            Skb::on(ext),
        );
        let pod_view = r.out.clone();
        assert_bytes(
            &pod_view,
            &ingress_frame(&with_destination(&wire_reply, POD2, Some(5353))),
            "reply",
        );
        let unreachable = Ipv4::new(POD2, OUT, icmp_error(3, 3, quote(&pod_view)));
        let r = run(
            fp,
            Hook::ToNetdev,
            &egress_frame(&unreachable),
            Skb::on(ext),
        );
        let want = Ipv4::new(
            NODE,
            OUT,
            icmp_error(3, 3, quote(&ingress_frame(&wire_reply))),
        );
        assert_bytes(
            &r.out,
            &egress_frame(&want),
            "port unreachable from the pod",
        );
        packet::verify(&r.out).expect("outer checksums");
        assert_counted(
            &r,
            &[Reason::Ipv4Icmp, Reason::FastSnatIcmpError],
            "port unreachable",
        );

        // "Time exceeded" for a translated echo request goes back to the pod's identifier.
        let ping = Ipv4::new(POD, OUT2, Icmp::echo_request(9, 1));
        let pod_frame = egress_frame(&ping);
        let r = run(fp, Hook::ToNetdev, &pod_frame, Skb::on(ext));
        let err = Ipv4::new(ROUTER, NODE, icmp_error(11, 0, quote(&r.out)));
        let r = run(fp, Hook::FromNetdev, &ingress_frame(&err), Skb::on(ext));
        let want = Ipv4::new(ROUTER, POD, icmp_error(11, 0, quote(&pod_frame)));
        assert_bytes(&r.out, &ingress_frame(&want), "time exceeded");

        // An error about a flow the NAT does not know is left alone.
        let stranger = Ipv4::new(NODE, OUT, tcp(48000, 443, tcp_flags::ACK));
        let err = Ipv4::new(
            ROUTER,
            NODE,
            icmp_error(3, 4, quote(&egress_frame(&stranger))),
        );
        let frame = ingress_frame(&err);
        let r = run(fp, Hook::FromNetdev, &frame, Skb::on(ext));
        assert_bytes(&r.out, &frame, "unknown flow");
        assert_counted(
            &r,
            &[Reason::Ipv4Icmp, Reason::PassSnatNoEntry],
            "unknown flow",
        );
    });
}

/// An Ethernet frame (destination, source, IPv4) around an encoded IPv4 packet.
fn raw_frame(dst: Mac, src: Mac, ip: &[u8]) -> Vec<u8> {
    [&dst[..], &src[..], &[0x08, 0x00], ip].concat()
}

/// The reassembled UDP datagram of `frames` (fragments of one IPv4 packet, in order) with its
/// checksum verified against the pseudo-header of the first fragment's addresses.
fn reassembled_udp(frames: &[Vec<u8>]) -> (Ipv4Addr, Ipv4Addr, Vec<u8>) {
    let mut data = Vec::new();
    let mut addrs = None;
    for f in frames {
        let parsed = packet::parse(f).expect("fragment");
        let ParsedL3::Ipv4(ip) = parsed.l3 else {
            panic!("not IPv4")
        };
        assert!(ip.checksum_ok, "fragment header checksum");
        assert_eq!(usize::from(ip.fragment_offset) * 8, data.len());
        let ParsedL4::Raw(bytes) = ip.l4 else {
            panic!("fragments are raw")
        };
        data.extend_from_slice(&bytes);
        addrs.get_or_insert((ip.src, ip.dst));
        assert!(addrs == Some((ip.src, ip.dst)), "addresses differ");
    }
    let (src, dst) = addrs.expect("at least one fragment");
    let sum = packet::pseudo_header_v4(src, dst, 17, data.len());
    assert_eq!(
        packet::fold(packet::sum_words(&data, sum)),
        0xffff,
        "UDP checksum over the reassembled datagram"
    );
    (src, dst, data)
}

#[test]
fn fragments_follow_their_first_fragment() {
    let Some(rig) = Rig::new("ntfrag") else {
        return;
    };
    rig.with_nat(settings(), |fp, ext| {
        let payload: Vec<u8> = (0..3000u32).map(|i| (i % 251) as u8).collect();
        // Out: a pod's datagram, fragmented; the port (in range, free) is kept.
        let big = Ipv4 {
            id: 0x1234,
            ..Ipv4::new(POD, OUT, Udp::new(40500, 9000).payload(&payload))
        };
        let mut outs = Vec::new();
        for (i, frag) in big.fragments(1000).iter().enumerate() {
            let frame = raw_frame(GW_MAC, EXT_MAC, frag);
            let r = run(fp, Hook::ToNetdev, &frame, Skb::on(ext));
            assert_eq!(r.verdict, TC_ACT_OK);
            let want: &[Reason] = if i == 0 {
                &[
                    Reason::Ipv4Fragment,
                    Reason::FastSnat,
                    Reason::LearnSnatFlow,
                ]
            } else {
                &[Reason::Ipv4Fragment, Reason::FastSnatFragment]
            };
            assert_counted(&r, want, &format!("fragment {i}"));
            outs.push(r.out);
        }
        let translated = Ipv4 {
            src: NODE,
            ..big.clone()
        };
        for (got, want) in outs.iter().zip(translated.fragments(1000)) {
            assert_bytes(&got[14..], &want, "outgoing fragment");
        }
        let (src, _, data) = reassembled_udp(&outs);
        assert_eq!(src, NODE);
        assert_eq!(&data[8..], payload.as_slice());

        // In: the reply's fragments; later ones follow the first one's translation.
        let reply = Ipv4 {
            id: 0x4321,
            ..Ipv4::new(OUT, NODE, Udp::new(9000, 40500).payload(&payload))
        };
        let mut ins = Vec::new();
        for (i, frag) in reply.fragments(1000).iter().enumerate() {
            let frame = raw_frame(EXT_MAC, GW_MAC, frag);
            let r = run(fp, Hook::FromNetdev, &frame, Skb::on(ext));
            let want = if i == 0 {
                Reason::FastSnatReply
            } else {
                Reason::FastSnatFragment
            };
            assert_counted(&r, &[Reason::Ipv4Fragment, want], &format!("in {i}"));
            ins.push(r.out);
        }
        let back = Ipv4 {
            dst: POD,
            ..reply.clone()
        };
        for (got, want) in ins.iter().zip(back.fragments(1000)) {
            assert_bytes(&got[14..], &want, "incoming fragment");
        }
        let (_, dst, _) = reassembled_udp(&ins);
        assert_eq!(dst, POD);

        // A later fragment whose first fragment was never seen is passed as it is.
        let orphan = Ipv4 {
            id: 0x9999,
            ..Ipv4::new(OUT, NODE, Udp::new(9000, 40500).payload(&payload))
        };
        let frag = orphan.fragments(1000).remove(1);
        let frame = raw_frame(EXT_MAC, GW_MAC, &frag);
        let r = run(fp, Hook::FromNetdev, &frame, Skb::on(ext));
        assert_bytes(&r.out, &frame, "orphan fragment");
        assert_counted(
            &r,
            &[Reason::Ipv4Fragment, Reason::PassFragment],
            "orphan fragment",
        );
    });
}

/// Removes `key` from the pinned NAT map `name` (values of type `V`), as an LRU eviction
/// would; panics if the entry is not there.
fn remove_pinned<V: aya::Pod>(pin: &Path, name: &str, key: &NatKey) {
    let path = pin.join(names::PIN_LAYOUT_VERSION).join(name);
    let data = aya::maps::MapData::from_pin(&path).unwrap_or_else(|e| panic!("{name}: {e}"));
    let map = aya::maps::Map::from_map_data(data).unwrap_or_else(|e| panic!("{name}: {e}"));
    let mut map: aya::maps::HashMap<_, NatKey, V> =
        aya::maps::HashMap::try_from(map).unwrap_or_else(|e| panic!("{name}: {e}"));
    map.remove(key)
        .unwrap_or_else(|e| panic!("removing {key:?} from {name}: {e}"));
}

/// `bpftool -j map dump` of a pinned map: the entries as bpftool decodes them with the map's
/// BTF (the `formatted` part of each entry; bpftool also prints the raw bytes).
fn bpftool_dump(path: &Path) -> serde_json::Value {
    let out = Command::new("bpftool")
        .args(["-j", "map", "dump", "pinned"])
        .arg(path)
        .output()
        .expect("bpftool");
    assert!(out.status.success(), "bpftool: {out:?}");
    let raw: serde_json::Value = serde_json::from_slice(&out.stdout).expect("bpftool JSON");
    let entries = raw.as_array().expect("a list of entries");
    serde_json::Value::Array(
        entries
            .iter()
            .map(|e| {
                e.get("formatted")
                    .cloned()
                    .unwrap_or_else(|| panic!("no BTF: {e}"))
            })
            .collect(),
    )
}

#[test]
fn bpftool_shows_nat_entries_readably() {
    let Some(rig) = Rig::new("ntbtf") else {
        return;
    };
    let pin = rig.pin.clone();
    rig.with_nat(settings(), move |fp, ext| {
        let syn = Ipv4::new(POD, OUT, tcp(40000, 443, tcp_flags::SYN));
        let _ = run(fp, Hook::ToNetdev, &egress_frame(&syn), Skb::on(ext));
        let maps = pin.join(names::PIN_LAYOUT_VERSION);
        let fwd = bpftool_dump(&maps.join(names::NAT4));
        assert_eq!(fwd.as_array().map(Vec::len), Some(1), "{fwd}");
        let entry = &fwd[0];
        assert_eq!(entry["key"]["saddr"], serde_json::json!([10, 244, 1, 5]));
        assert_eq!(entry["key"]["daddr"], serde_json::json!([203, 0, 113, 10]));
        assert_eq!(entry["key"]["sport"], 40000);
        assert_eq!(entry["key"]["dport"], 443);
        assert_eq!(entry["key"]["proto"], 6);
        assert_eq!(
            entry["value"]["nat_addr"],
            serde_json::json!([192, 168, 77, 1])
        );
        assert_eq!(entry["value"]["nat_port"], 40000);
        assert!(entry["value"]["last_seen_ns"].as_u64().is_some(), "{entry}");
        let rev = bpftool_dump(&maps.join(names::NAT_REV4));
        assert_eq!(rev[0]["key"]["saddr"], serde_json::json!([203, 0, 113, 10]));
        assert_eq!(rev[0]["key"]["dport"], 40000);
        assert_eq!(
            rev[0]["value"]["orig_addr"],
            serde_json::json!([10, 244, 1, 5])
        );
        assert_eq!(rev[0]["value"]["orig_port"], 40000);
        assert_eq!(rev[0]["value"]["state"], 0);
        assert!(rev[0]["value"]["checked_ns"].as_u64().is_some(), "{rev}");
        let cfg = bpftool_dump(&maps.join(names::NAT_CONFIG));
        assert_eq!(cfg[0]["value"]["port_min"], 32768);
        assert_eq!(cfg[0]["value"]["port_max"], 60999);
        let nomasq = bpftool_dump(&maps.join(names::NO_MASQ4));
        assert_eq!(nomasq.as_array().map(Vec::len), Some(1), "{nomasq}");
        assert_eq!(fp.no_masq().expect("prefixes"), vec![net("100.64.0.0/10")]);
    });
}

#[test]
fn restart_adopts_and_resize_carries_the_flows_over() {
    let Some(rig) = Rig::new("ntsize") else {
        return;
    };
    rig.with_nat_sized(1024, settings(), |fp, ext| {
        assert_eq!(fp.nat_capacity().expect("capacity"), 1024);
        let syn = Ipv4::new(POD, OUT, tcp(40000, 443, tcp_flags::SYN));
        let _ = run(fp, Hook::ToNetdev, &egress_frame(&syn), Skb::on(ext));
    });
    // A restarted agent with the same size adopts the pinned maps.
    rig.with_nat_sized(1024, settings(), |fp, ext| {
        assert_eq!(fp.nat_flows().expect("flows").len(), 1);
        let reply = Ipv4::new(OUT, NODE, tcp(443, 40000, tcp_flags::SYN | tcp_flags::ACK));
        let r = run(fp, Hook::FromNetdev, &ingress_frame(&reply), Skb::on(ext));
        assert_bytes(
            &r.out,
            &ingress_frame(&with_destination(&reply, POD, None)),
            "reply after restart",
        );
    });
    // Another size: new maps, the flows carried over.
    rig.with_nat_sized(2048, settings(), |fp, ext| {
        assert_eq!(fp.nat_capacity().expect("capacity"), 2048);
        let flows = fp.nat_flows().expect("flows");
        assert_eq!(flows.len(), 1, "{flows:#?}");
        assert!(flows[0].reverse_ok);
        let reply = Ipv4::new(OUT, NODE, tcp(443, 40000, tcp_flags::ACK));
        let r = run(fp, Hook::FromNetdev, &ingress_frame(&reply), Skb::on(ext));
        assert_bytes(
            &r.out,
            &ingress_frame(&with_destination(&reply, POD, None)),
            "reply after resize",
        );
    });
}

/// A NAT map resize that a crash interrupted is finished by the next start: the agent moves
/// the old maps aside (`<pin path>/resizing/`) before it creates the new ones, and unpins
/// them only once their flows are copied and its programs attached. Here the state a crash
/// right after the move leaves (the old maps aside, no new ones pinned): the next start copies
/// the flow into maps of the new size, translates its reply, and removes the old maps once
/// attached. (The old maps used to be unpinned before the copy: a crash in between left no pin
/// of the flows, and every masqueraded connection was cut.) A leftover of an incompatible
/// layout is removed, not copied.
#[test]
fn a_resize_a_crash_interrupted_is_finished_by_the_next_start() {
    let Some(rig) = Rig::new("ntcrash") else {
        return;
    };
    rig.with_nat_sized(1024, settings(), |fp, ext| {
        let syn = Ipv4::new(POD, OUT, tcp(40000, 443, tcp_flags::SYN));
        let _ = run(fp, Hook::ToNetdev, &egress_frame(&syn), Skb::on(ext));
        assert_eq!(fp.nat_flows().expect("flows").len(), 1);
    });
    let layout = PinLayout::new(&rig.pin);
    std::fs::create_dir_all(layout.resizing_dir()).expect("resizing dir");
    for name in [names::NAT4, names::NAT_REV4] {
        std::fs::rename(layout.map(name), layout.resizing(name)).expect("move aside");
    }
    rig.with_nat_sized(2048, settings(), |fp, ext| {
        assert_eq!(fp.nat_capacity().expect("capacity"), 2048);
        fp.attach_netdev(ext, false).expect("attaching");
        let flows = fp.nat_flows().expect("flows");
        assert_eq!(flows.len(), 1, "{flows:#?}");
        assert!(flows[0].reverse_ok);
        let reply = Ipv4::new(OUT, NODE, tcp(443, 40000, tcp_flags::SYN | tcp_flags::ACK));
        let r = run(fp, Hook::FromNetdev, &ingress_frame(&reply), Skb::on(ext));
        assert_bytes(
            &r.out,
            &ingress_frame(&with_destination(&reply, POD, None)),
            "reply after the finished resize",
        );
    });
    for name in [names::NAT4, names::NAT_REV4] {
        assert!(
            !layout.resizing(name).exists(),
            "{name}'s old instance is still pinned"
        );
    }
    // A leftover that is no NAT map of this build (here the route map) is dropped.
    std::fs::create_dir_all(layout.resizing_dir()).expect("resizing dir");
    std::fs::hard_link(layout.map(names::ROUTES4), layout.resizing(names::NAT4))
        .expect("a foreign pin");
    rig.with_nat_sized(1024, settings(), |fp, ext| {
        assert_eq!(fp.nat_capacity().expect("capacity"), 1024);
        assert_eq!(fp.nat_flows().expect("flows").len(), 1);
        fp.attach_netdev(ext, false).expect("attaching");
    });
    assert!(!layout.resizing(names::NAT4).exists());
}

/// A resize midway: the old programs (NAT maps of 1,024 flows) attached, with a flow from
/// `POD`:40000 to `OUT`:443 made before a new fast path (maps of 2,048) was loaded, and one
/// from `POD2`:40001 made after; the new one is not attached yet. (In the rig's namespace.)
fn resized_midway(pin: &Path, ext: u32) -> (FastPath, FastPath) {
    let mut old = loaded(pin, 1024, &settings());
    old.attach_netdev(ext, false)
        .expect("attaching the old programs");
    let early = Ipv4::new(POD, OUT, tcp(40000, 443, tcp_flags::SYN));
    let _ = run(
        &mut old,
        Hook::ToNetdev,
        &egress_frame(&early),
        Skb::on(ext),
    );
    let new = loaded(pin, 2048, &settings());
    let late = Ipv4::new(POD2, OUT, tcp(40001, 443, tcp_flags::SYN));
    let _ = run(&mut old, Hook::ToNetdev, &egress_frame(&late), Skb::on(ext));
    (old, new)
}

/// A resize carries over what the old programs do until the new ones are attached: the old
/// ones stay attached while the new agent starts (the conntrack read, the lease), and go on
/// masquerading into the old maps. Here a flow they make after the load copied the maps, and
/// a reply they see to a flow copied before, are both in the new maps once the new programs
/// are attached, which unpins the old maps only then. (They used to be unpinned at load time,
/// and such flows were lost: their replies went to the node, which reset them.)
#[test]
fn a_resize_carries_the_old_programs_flows_until_the_new_ones_are_attached() {
    let Some(rig) = Rig::new("ntlate") else {
        return;
    };
    let pin = rig.pin.clone();
    rig.ns
        .enter(move || {
            let ext = ext0();
            let layout = PinLayout::new(&pin);
            let (mut old, mut new) = resized_midway(&pin, ext);
            assert_eq!(new.nat_flows().expect("flows").len(), 1, "copied at load");
            // The old programs, still attached, see the early flow's reply.
            let early_reply =
                Ipv4::new(OUT, NODE, tcp(443, 40000, tcp_flags::SYN | tcp_flags::ACK));
            let r = run(
                &mut old,
                Hook::FromNetdev,
                &ingress_frame(&early_reply),
                Skb::on(ext),
            );
            assert_counted(
                &r,
                &[Reason::Ipv4Tcp, Reason::FastSnatReply],
                "the early flow's reply, by the old programs",
            );

            new.attach_netdev(ext, false)
                .expect("attaching the new programs");
            let flows = new.nat_flows().expect("flows");
            assert_eq!(flows.len(), 2, "{flows:#?}");
            let flow = |pod: Ipv4Addr| flows.iter().find(|f| *f.orig.ip() == pod);
            let early_flow = flow(POD).expect("the early flow");
            assert_ne!(early_flow.state & nat::ST_REPLIED, 0, "{early_flow:?}");
            let late_flow = flow(POD2).expect("the late flow");
            assert!(late_flow.reverse_ok, "{late_flow:?}");
            for name in [names::NAT4, names::NAT_REV4] {
                assert!(
                    !layout.resizing(name).exists(),
                    "{name}'s old instance still pinned"
                );
            }
            let late_reply = Ipv4::new(OUT, NODE, tcp(443, 40001, tcp_flags::SYN | tcp_flags::ACK));
            let r = run(
                &mut new,
                Hook::FromNetdev,
                &ingress_frame(&late_reply),
                Skb::on(ext),
            );
            assert_bytes(
                &r.out,
                &ingress_frame(&with_destination(&late_reply, POD2, None)),
                "the late flow's reply, by the new programs",
            );
        })
        .expect("entering the namespace");
}

/// The way back to the kernel path during a resize (a new size loaded, the agent gone before
/// it attached its programs, the node then started with `--dataplane=kernel`) hands conntrack
/// the flows of the old maps pinned aside too, where the old programs, still attached, made
/// them: each is bound to the port the programs gave it. (The handover used to read only the
/// new maps' copy, and a flow made after it was cut.)
#[test]
fn the_way_back_during_a_resize_hands_over_the_old_maps_flows() {
    let Some(rig) = Rig::new("ntback") else {
        return;
    };
    let pin = rig.pin.clone();
    rig.ns
        .enter(move || {
            let ext = ext0();
            drop(resized_midway(&pin, ext));
        })
        .expect("entering the namespace");
    flannel_tests::bpfrig::cleanup_in(&rig.ns, &rig.pin).expect("the way back");
    let table = rig
        .ns
        .run(&["cat", "/proc/net/nf_conntrack"])
        .expect("conntrack");
    for (pod, port) in [(POD, 40000), (POD2, 40001)] {
        let original = format!("src={pod} dst={OUT} sport={port} dport=443 ");
        let line = table
            .lines()
            .find(|l| l.contains(" tcp ") && l.contains(&original))
            .unwrap_or_else(|| panic!("no conntrack entry for {original}:\n{table}"));
        let reply = format!("src={OUT} dst={NODE} sport=443 dport={port} ");
        assert!(line.contains(&reply), "not bound to {NODE}:{port}: {line}");
    }
}

/// Variants of masqueraded packets both ways (TCP, UDP with and without checksum, ICMP echo,
/// fragments, an ICMP error quoting a translated flow, and what is not masqueraded) keep the
/// programs' contract (`bpf_support::mutate`): counted once under a class and once under a
/// verdict, a pass unchanged, a drop dropped, and a translated packet whose checksums
/// verified still verifies: the incremental updates hold for any header, not only the
/// builder's.
#[test]
fn mutated_packets_keep_the_masquerades_contract() {
    let Some(rig) = Rig::new("ntmut") else {
        return;
    };
    rig.with_nat(settings(), |fp, ext| {
        let seed = |name, hook, ip: Ipv4| {
            let frame = match hook {
                Hook::ToNetdev => egress_frame(&ip),
                _ => ingress_frame(&ip),
            };
            mutate::Seed::tc(name, hook, Skb::on(ext), frame)
        };
        let out = |name, dst, l4: Transport| seed(name, Hook::ToNetdev, Ipv4::new(POD, dst, l4));
        let back = |name, l4: Transport| seed(name, Hook::FromNetdev, Ipv4::new(OUT, NODE, l4));
        let syn = tcp(40000, 443, tcp_flags::SYN);
        let no_checksum = |sport, dport| Udp {
            checksum: Checksum::Value(0),
            ..Udp::new(sport, dport).payload(b"nocsum")
        };
        let translated = egress_frame(&Ipv4::new(NODE, OUT, syn.clone()));
        let big = Ipv4::new(POD, OUT2, Udp::new(40003, 9000).payload(&[7; 600]));
        let fragments = big.fragments(256);
        let fragment = |name, bytes: &Vec<u8>| {
            let frame = [&egress_frame(&big)[..14], &bytes[..]].concat();
            mutate::Seed::tc(name, Hook::ToNetdev, Skb::on(ext), frame)
        };
        let seeds = vec![
            out("TCP SYN", OUT, syn.clone().into()),
            out("TCP ACK", OUT, tcp(40000, 443, tcp_flags::ACK).into()),
            out("UDP", OUT, Udp::new(40001, 53).payload(b"query").into()),
            out("UDP without checksum", OUT, no_checksum(40002, 5000).into()),
            out("ICMP echo", OUT, Icmp::echo_request(0x4242, 1).into()),
            fragment("first fragment", &fragments[0]),
            fragment("later fragment", &fragments[1]),
            out("excluded prefix", EXCLUDED, Udp::new(40004, 53).into()),
            out(
                "cluster destination",
                REMOTE_POD,
                Udp::new(40005, 53).into(),
            ),
            back(
                "TCP reply",
                tcp(443, 40000, tcp_flags::SYN | tcp_flags::ACK).into(),
            ),
            back("UDP reply", Udp::new(53, 40001).payload(b"answer").into()),
            back(
                "UDP reply without checksum",
                no_checksum(5000, 40002).into(),
            ),
            back("ICMP echo reply", Icmp::echo_reply(0x4242, 1).into()),
            seed(
                "ICMP error quoting a translated flow",
                Hook::FromNetdev,
                Ipv4::new(ROUTER, NODE, icmp_error(3, 4, quote(&translated))),
            ),
        ];
        let tally = mutate::check(fp, &seeds, 3000, Tunnel::Vxlan(8472));
        tally.assert_reached(
            &[
                Reason::FastSnat,
                Reason::FastSnatReply,
                Reason::FastSnatIcmpError,
                Reason::FastSnatFragment,
                Reason::PassSnatExcluded,
                Reason::LearnSnatFlow,
            ],
            150,
        );
    });
}
