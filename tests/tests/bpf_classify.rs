//! The packet classifier (`tc_classify`, `xdp_classify`) run in the kernel with
//! `BPF_PROG_TEST_RUN` on crafted packets: verdict, untouched bytes, and the exact counter
//! increments per class in the per-CPU stats maps. Needs root (skips otherwise).

use std::{
    fs,
    net::{Ipv4Addr, Ipv6Addr},
    path::PathBuf,
    process::Command,
};

use aya::{
    Ebpf, TestRun as _, TestRunOptions,
    maps::PerCpuArray,
    programs::{ProgramError, SchedClassifier, Xdp},
};
use flannel_common::{
    maps::{TC_STATS, XDP_STATS},
    programs::{TC_CLASSIFY, XDP_CLASSIFY},
    stats::{Counter, Reason, ReasonKind},
};
use flannel_tests::packet::{
    Arp, Checksum, ETH_P_IP, ETH_P_IPV6, Ethernet, IPPROTO_IPIP, IPPROTO_NONE, IPPROTO_TCP, Icmp,
    Ipv4, Ipv6, Ipv6Ext, L3, MAC_A, MAC_B, MAC_BROADCAST, Tcp, Transport, Udp, hexdump,
};

const TC_ACT_OK: u32 = 0;
const XDP_PASS: u32 = 2;

const A4: Ipv4Addr = Ipv4Addr::new(10, 244, 1, 2);
const B4: Ipv4Addr = Ipv4Addr::new(10, 244, 2, 3);
const A6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x10, 0x244, 1, 0, 0, 0, 2);
const B6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x10, 0x244, 2, 0, 0, 0, 3);

#[derive(Clone, Copy, Debug)]
enum Hook {
    Tc,
    Xdp,
}

impl Hook {
    fn program(self) -> &'static str {
        match self {
            Hook::Tc => TC_CLASSIFY,
            Hook::Xdp => XDP_CLASSIFY,
        }
    }

    fn stats_map(self) -> &'static str {
        match self {
            Hook::Tc => TC_STATS,
            Hook::Xdp => XDP_STATS,
        }
    }

    /// Whether `BPF_PROG_TEST_RUN` takes `frame` for this hook. Both refuse frames shorter than
    /// an Ethernet header; for skb programs (TC) the kernel also refuses IPv4 and IPv6 frames
    /// whose fixed IP header is incomplete (EINVAL). Such frames do reach TC on a real device,
    /// so the parser still handles them; XDP and the unit tests cover those cases.
    fn test_run_accepts(self, frame: &[u8]) -> bool {
        if frame.len() < 14 {
            return false;
        }
        match (self, u16::from_be_bytes([frame[12], frame[13]])) {
            (Hook::Xdp, _) => true,
            (Hook::Tc, ETH_P_IP) => frame.len() >= 14 + 20,
            (Hook::Tc, ETH_P_IPV6) => frame.len() >= 14 + 40,
            (Hook::Tc, _) => true,
        }
    }

    fn pass_verdict(self) -> u32 {
        match self {
            Hook::Tc => TC_ACT_OK,
            Hook::Xdp => XDP_PASS,
        }
    }
}

/// The object with `hook`'s program loaded, or `None` (test skipped) when not root or when the
/// agent was built with `AYA_BUILD_SKIP=1` (empty object).
fn load(hook: Hook) -> Option<Ebpf> {
    if !flannel_tests::is_root() {
        eprintln!("skipped: needs root (BPF_PROG_TEST_RUN)");
        return None;
    }
    if flannel_agent::EBPF_OBJECT.is_empty() {
        eprintln!("skipped: flannel-agent was built with AYA_BUILD_SKIP=1 (no eBPF object)");
        return None;
    }
    let mut ebpf = match Ebpf::load(flannel_agent::EBPF_OBJECT) {
        Ok(ebpf) => ebpf,
        Err(e) => panic!("loading the eBPF object: {e:?}"),
    };
    let program = ebpf
        .program_mut(hook.program())
        .unwrap_or_else(|| panic!("no program {}", hook.program()));
    let loaded = match hook {
        Hook::Tc => <&mut SchedClassifier>::try_from(program).map(|p| p.load()),
        Hook::Xdp => <&mut Xdp>::try_from(program).map(|p| p.load()),
    };
    match loaded {
        Ok(Ok(())) => {}
        Ok(Err(e)) => panic!("loading {} (verifier): {e:?}", hook.program()),
        Err(e) => panic!("{} has the wrong program type: {e:?}", hook.program()),
    }
    Some(ebpf)
}

/// Runs `hook`'s program once on `frame`: (return value, output bytes).
fn run(ebpf: &mut Ebpf, hook: Hook, frame: &[u8]) -> Result<(u32, Vec<u8>), ProgramError> {
    let mut out = vec![0u8; frame.len() + 512];
    let opts = TestRunOptions {
        data_in: Some(frame),
        data_out: Some(&mut out),
        ..TestRunOptions::default()
    };
    let program = ebpf.program_mut(hook.program()).expect("program exists");
    let result = match hook {
        Hook::Tc => <&mut SchedClassifier>::try_from(program)
            .expect("classifier")
            .test_run(opts),
        Hook::Xdp => <&mut Xdp>::try_from(program).expect("xdp").test_run(opts),
    };
    let result = result?;
    out.truncate(result.data_size_out as usize);
    Ok((result.return_value, out))
}

/// Every counter of `hook`'s stats map, summed over the CPUs, in [`Reason`] order.
fn counters(ebpf: &Ebpf, hook: Hook) -> Vec<Counter> {
    let map = ebpf
        .map(hook.stats_map())
        .unwrap_or_else(|| panic!("no map {}", hook.stats_map()));
    let array = PerCpuArray::<_, Counter>::try_from(map).expect("per-CPU array of Counter");
    assert_eq!(array.len() as usize, Reason::COUNT, "map size");
    Reason::ALL
        .iter()
        .map(|reason| {
            let per_cpu = array.get(&reason.index(), 0).expect("lookup");
            per_cpu.iter().fold(Counter::default(), |mut sum, c| {
                sum.add(c);
                sum
            })
        })
        .collect()
}

fn eth(payload: impl Into<L3>) -> Ethernet {
    Ethernet::new(MAC_A, MAC_B, payload)
}

fn v4(payload: impl Into<Transport>) -> Ipv4 {
    Ipv4::new(A4, B4, payload)
}

fn v6(payload: impl Into<Transport>) -> Ipv6 {
    Ipv6::new(A6, B6, payload)
}

fn tcp() -> Tcp {
    Tcp::new(40000, 80).payload(b"GET /")
}

fn udp() -> Udp {
    Udp::new(5353, 53).payload(b"query")
}

/// Raw Ethernet + IP bytes, for headers the builder would refuse to make consistent.
fn raw(ethertype: u16, bytes: Vec<u8>) -> Vec<u8> {
    eth(L3::Raw { ethertype, bytes }).encode()
}

/// Crafted frames and the one reason each must be counted under.
fn cases() -> Vec<(&'static str, Vec<u8>, Reason)> {
    let tcp_frame = eth(v4(tcp())).encode();
    let mut cases = vec![
        ("IPv4 TCP", tcp_frame.clone(), Reason::Ipv4Tcp),
        ("IPv4 UDP", eth(v4(udp())).encode(), Reason::Ipv4Udp),
        (
            "IPv4 ICMP echo",
            eth(v4(Icmp::echo_request(1, 1))).encode(),
            Reason::Ipv4Icmp,
        ),
        (
            "IPv4 in IPv4",
            eth(v4(Transport::Raw {
                proto: IPPROTO_IPIP,
                bytes: v4(udp()).encode(),
            }))
            .encode(),
            Reason::Ipv4OtherProto,
        ),
        (
            "IPv4 UDP padded to the Ethernet minimum",
            Ethernet {
                trailer: vec![0; 60 - 14 - 20 - 8],
                ..eth(v4(Udp::new(1, 2)))
            }
            .encode(),
            Reason::Ipv4Udp,
        ),
        ("IPv6 TCP", eth(v6(tcp())).encode(), Reason::Ipv6Tcp),
        ("IPv6 UDP", eth(v6(udp())).encode(), Reason::Ipv6Udp),
        (
            "IPv6 ICMPv6 echo",
            eth(v6(Transport::Icmpv6(Icmp::echo6_request(1, 1)))).encode(),
            Reason::Ipv6Icmp,
        ),
        (
            "IPv6 hop-by-hop then UDP",
            eth(Ipv6 {
                extensions: vec![Ipv6Ext::hop_by_hop_padding()],
                ..v6(udp())
            })
            .encode(),
            Reason::Ipv6ExtHeader,
        ),
        (
            "IPv6 fragment header",
            eth(Ipv6 {
                extensions: vec![Ipv6Ext::fragment(0, true, 7)],
                ..v6(udp())
            })
            .encode(),
            Reason::Ipv6ExtHeader,
        ),
        (
            "IPv6 no next header",
            eth(v6(Transport::Raw {
                proto: IPPROTO_NONE,
                bytes: Vec::new(),
            }))
            .encode(),
            Reason::Ipv6OtherProto,
        ),
        (
            "ARP request",
            Ethernet::new(MAC_A, MAC_BROADCAST, Arp::request(MAC_A, A4, B4)).encode(),
            Reason::Arp,
        ),
        (
            "802.1Q tagged IPv4",
            Ethernet {
                vlan: Some(10),
                ..eth(v4(tcp()))
            }
            .encode(),
            Reason::OtherEthertype,
        ),
        (
            "IPv4 with a router-alert option",
            eth(Ipv4 {
                options: vec![0x94, 0x04, 0x00, 0x00],
                ..v4(tcp())
            })
            .encode(),
            Reason::Ipv4Options,
        ),
        // Malformed: lengths and header fields.
        (
            "Ethernet header only, IPv4",
            tcp_frame[..14].to_vec(),
            Reason::Ipv4Truncated,
        ),
        (
            "IPv4 header cut at 19 bytes",
            tcp_frame[..14 + 19].to_vec(),
            Reason::Ipv4Truncated,
        ),
        (
            "IPv4 IHL 15 but 20 header bytes present",
            eth(Ipv4 {
                ihl: Some(15),
                ..v4(Transport::Raw {
                    proto: 253,
                    bytes: vec![0; 8],
                })
            })
            .encode(),
            Reason::Ipv4Truncated,
        ),
        (
            "IPv4 version 6",
            eth(Ipv4 {
                version: Some(6),
                ..v4(tcp())
            })
            .encode(),
            Reason::Ipv4BadVersion,
        ),
        (
            "IPv4 IHL 4",
            eth(Ipv4 {
                ihl: Some(4),
                ..v4(tcp())
            })
            .encode(),
            Reason::Ipv4BadIhl,
        ),
        (
            "IPv4 IHL 0",
            eth(Ipv4 {
                ihl: Some(0),
                ..v4(tcp())
            })
            .encode(),
            Reason::Ipv4BadIhl,
        ),
        (
            "IPv4 total length beyond the packet",
            eth(Ipv4 {
                total_length: Some(20 + 20 + 5 + 1),
                ..v4(tcp())
            })
            .encode(),
            Reason::Ipv4BadLength,
        ),
        (
            "IPv4 total length below the header length",
            eth(Ipv4 {
                total_length: Some(19),
                ..v4(tcp())
            })
            .encode(),
            Reason::Ipv4BadLength,
        ),
        (
            "TCP header cut at 10 bytes",
            {
                let short = eth(Ipv4 {
                    total_length: Some(20 + 10),
                    ..v4(tcp())
                })
                .encode();
                short[..14 + 30].to_vec()
            },
            Reason::L4Truncated,
        ),
        (
            "UDP header cut at 7 bytes",
            raw(ETH_P_IP, {
                let mut ip = v4(Transport::Raw {
                    proto: 17,
                    bytes: vec![0; 7],
                })
                .encode();
                ip.truncate(27);
                ip
            }),
            Reason::L4Truncated,
        ),
        (
            "ICMP header cut at 4 bytes",
            eth(v4(Transport::Raw {
                proto: 1,
                bytes: vec![8, 0, 0, 0],
            }))
            .encode(),
            Reason::L4Truncated,
        ),
        (
            "TCP data offset 4",
            eth(v4(Tcp {
                data_offset: Some(4),
                ..tcp()
            }))
            .encode(),
            Reason::TcpBadOffset,
        ),
        (
            "TCP data offset 15 in a 25-byte segment",
            eth(v4(Tcp {
                data_offset: Some(15),
                ..tcp()
            }))
            .encode(),
            Reason::TcpBadOffset,
        ),
        (
            "IPv6 header cut at 39 bytes",
            eth(v6(udp())).encode()[..14 + 39].to_vec(),
            Reason::Ipv6Truncated,
        ),
        (
            "IPv6 version 4",
            eth(Ipv6 {
                version: Some(4),
                ..v6(udp())
            })
            .encode(),
            Reason::Ipv6BadVersion,
        ),
        (
            "IPv6 payload length beyond the packet",
            eth(Ipv6 {
                payload_length: Some(8 + 5 + 1),
                ..v6(udp())
            })
            .encode(),
            Reason::Ipv6BadLength,
        ),
        (
            "IPv6 TCP header cut at 19 bytes",
            eth(Ipv6 {
                payload_length: Some(19),
                ..v6(tcp())
            })
            .encode()[..14 + 40 + 19]
                .to_vec(),
            Reason::L4Truncated,
        ),
        (
            "ICMPv6 header cut at 4 bytes",
            raw(ETH_P_IPV6, {
                let mut ip = v6(Transport::Raw {
                    proto: 58,
                    bytes: vec![128, 0, 0, 0],
                })
                .encode();
                ip.truncate(44);
                ip
            }),
            Reason::L4Truncated,
        ),
    ];

    // Fragments: the first (MF, offset 0) and the rest (offset != 0, no L4 header).
    let fragments = v4(Udp::new(5000, 6000).payload(&[7; 100])).fragments(48);
    assert_eq!(fragments.len(), 3);
    for (i, fragment) in fragments.into_iter().enumerate() {
        let name = [
            "IPv4 first fragment",
            "IPv4 middle fragment",
            "IPv4 last fragment",
        ][i];
        cases.push((name, raw(ETH_P_IP, fragment), Reason::Ipv4Fragment));
    }
    // A fragment that also carries options is a fragment first.
    let with_options = Ipv4 {
        options: vec![0x94, 0x04, 0x00, 0x00],
        more_fragments: true,
        dont_fragment: false,
        ..v4(tcp())
    };
    cases.push((
        "IPv4 fragment with options",
        eth(with_options).encode(),
        Reason::Ipv4Fragment,
    ));
    // A TCP header whose checksum is wrong is still well formed: the parser does not check sums.
    let bad_sum = Tcp {
        checksum: Checksum::Value(0xdead),
        ..tcp()
    };
    cases.push((
        "IPv4 TCP with a wrong checksum",
        eth(v4(bad_sum)).encode(),
        Reason::Ipv4Tcp,
    ));
    // Next header TCP in a packet truncated to the IPv6 header itself.
    let mut v6_no_l4 = v6(tcp()).encode();
    v6_no_l4.truncate(40);
    v6_no_l4[4..6].copy_from_slice(&0u16.to_be_bytes());
    assert_eq!(v6_no_l4[6], IPPROTO_TCP);
    cases.push((
        "IPv6 TCP with no TCP bytes",
        raw(ETH_P_IPV6, v6_no_l4),
        Reason::L4Truncated,
    ));
    cases
}

fn check_every_case(hook: Hook) {
    let Some(mut ebpf) = load(hook) else { return };
    let cases = cases();
    let mut seen = std::collections::HashSet::new();
    for (name, frame, expected) in &cases {
        if !hook.test_run_accepts(frame) {
            // Refused by the kernel, see frames_test_run_refuses.
            continue;
        }
        seen.insert(*expected);
        let before = counters(&ebpf, hook);
        let (verdict, out) = run(&mut ebpf, hook, frame)
            .unwrap_or_else(|e| panic!("{hook:?} test_run on {name}: {e:?}"));
        let after = counters(&ebpf, hook);

        assert_eq!(verdict, hook.pass_verdict(), "{hook:?} verdict for {name}");
        assert_eq!(
            out,
            *frame,
            "{hook:?} changed the bytes of {name}:\nin:\n{}out:\n{}",
            hexdump(frame),
            hexdump(&out)
        );
        for reason in Reason::ALL {
            let i = reason.index() as usize;
            let delta = Counter {
                packets: after[i].packets - before[i].packets,
                bytes: after[i].bytes - before[i].bytes,
            };
            let want = if reason == *expected {
                Counter {
                    packets: 1,
                    bytes: frame.len() as u64,
                }
            } else {
                Counter::default()
            };
            assert_eq!(
                delta,
                want,
                "{hook:?}: {name} should count once under {} (got {delta:?} under {})",
                expected.name(),
                reason.name()
            );
        }
    }
    // Every classification reason is covered, except those only frames refused by test_run
    // can produce. (Verdict and event reasons belong to the fast-path programs.)
    for reason in Reason::ALL
        .into_iter()
        .filter(|r| matches!(r.kind(), ReasonKind::Class | ReasonKind::Malformed))
    {
        let unreachable = match hook {
            Hook::Xdp => [Reason::EthTruncated].as_slice(),
            Hook::Tc => &[Reason::EthTruncated, Reason::Ipv6Truncated],
        };
        if !unreachable.contains(&reason) {
            assert!(
                seen.contains(&reason),
                "{hook:?}: no case for {}",
                reason.name()
            );
        }
    }
}

#[test]
fn tc_classify_counts_every_class_once_and_passes() {
    check_every_case(Hook::Tc);
}

#[test]
fn xdp_classify_counts_every_class_once_and_passes() {
    check_every_case(Hook::Xdp);
}

/// The frames `Hook::test_run_accepts` says the kernel refuses are refused (EINVAL), and the
/// shortest accepted ones run: if a kernel changes this, the skipped cases should run instead.
#[test]
fn frames_test_run_refuses() {
    let v4 = eth(v4(tcp())).encode();
    let v6 = eth(v6(tcp())).encode();
    let arp = Ethernet::new(MAC_A, MAC_BROADCAST, Arp::request(MAC_A, A4, B4)).encode();
    for hook in [Hook::Tc, Hook::Xdp] {
        let Some(mut ebpf) = load(hook) else { return };
        let before = counters(&ebpf, hook);
        let mut refused = 0;
        for frame in [&v4, &v6, &arp] {
            for len in 0..=frame.len() {
                let cut = &frame[..len];
                let result = run(&mut ebpf, hook, cut);
                assert_eq!(
                    result.is_ok(),
                    hook.test_run_accepts(cut),
                    "{hook:?}, {len} of {} bytes: {result:?}",
                    frame.len()
                );
                if result.is_err() {
                    refused += 1;
                }
            }
        }
        let after = counters(&ebpf, hook);
        let runs: u64 = after.iter().map(|c| c.packets).sum::<u64>()
            - before.iter().map(|c| c.packets).sum::<u64>();
        let total = (v4.len() + v6.len() + arp.len() + 3) as u64;
        assert_eq!(
            runs,
            total - refused,
            "{hook:?}: only accepted frames are counted"
        );
    }
}

/// Removes the pin directory (and the pinned map in it) on drop.
struct PinDir(PathBuf);

impl Drop for PinDir {
    fn drop(&mut self) {
        if let Ok(entries) = fs::read_dir(&self.0) {
            for entry in entries.flatten() {
                let _ = fs::remove_file(entry.path());
            }
        }
        let _ = fs::remove_dir(&self.0);
    }
}

/// The stats map carries BTF: bpftool prints keys and `Counter` fields by name.
#[test]
fn bpftool_dumps_the_stats_map_as_typed_json() {
    let Some(mut ebpf) = load(Hook::Tc) else {
        return;
    };
    let frame = eth(v4(tcp())).encode();
    for _ in 0..3 {
        run(&mut ebpf, Hook::Tc, &frame).expect("test_run");
    }

    let bpffs = fs::read_to_string("/proc/mounts")
        .unwrap_or_default()
        .lines()
        .any(|l| {
            l.split_whitespace().nth(1) == Some("/sys/fs/bpf")
                && l.split_whitespace().nth(2) == Some("bpf")
        });
    assert!(
        bpffs,
        "bpffs is not mounted at /sys/fs/bpf; run `cargo xtask setup`"
    );
    let dir = PinDir(PathBuf::from(format!(
        "/sys/fs/bpf/{}classify",
        flannel_tests::netns::run_prefix()
    )));
    fs::create_dir_all(&dir.0).expect("creating the pin directory");
    let pin = dir.0.join(TC_STATS);
    ebpf.map(TC_STATS)
        .expect("stats map")
        .pin(&pin)
        .expect("pinning the stats map");

    let out = Command::new("bpftool")
        .args(["--json", "map", "dump", "pinned"])
        .arg(&pin)
        .output()
        .expect("bpftool not found; run `cargo xtask setup`");
    assert!(
        out.status.success(),
        "bpftool: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).expect("bpftool prints JSON");
    let entries = json.as_array().expect("a JSON array of entries");
    assert_eq!(entries.len(), Reason::COUNT);
    // With BTF, `bpftool --json` adds a "formatted" view next to the raw bytes: the key as a
    // number and the value as an object with Counter's field names. Legacy maps lack it.
    let typed: Vec<&serde_json::Value> = entries
        .iter()
        .map(|e| {
            e.get("formatted")
                .unwrap_or_else(|| panic!("no typed view in {e}"))
        })
        .collect();
    let tcp_entry = typed
        .iter()
        .find(|e| e["key"] == Reason::Ipv4Tcp.index())
        .unwrap_or_else(|| panic!("no typed key {} in {json}", Reason::Ipv4Tcp.index()));
    let values = tcp_entry["values"].as_array().expect("per-CPU values");
    let (mut packets, mut bytes) = (0, 0);
    for v in values {
        packets += v["value"]["packets"]
            .as_u64()
            .unwrap_or_else(|| panic!("untyped value {v}"));
        bytes += v["value"]["bytes"]
            .as_u64()
            .unwrap_or_else(|| panic!("untyped value {v}"));
    }
    assert_eq!((packets, bytes), (3, 3 * frame.len() as u64));
    drop(dir);
    assert!(!pin.exists());
}
