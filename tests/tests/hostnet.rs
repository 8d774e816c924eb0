//! The interface snapshot read from a real kernel feeds interface selection as upstream's
//! `ipmatch` tests describe (default-route interface, --iface by name or IP, --iface-regex,
//! --iface-can-reach).

use std::net::{IpAddr, Ipv4Addr};

use flannel_agent::{
    hostnet,
    iface::{self, IfaceOptions},
    ip::IpStack,
    netlink::Netlink,
};
use flannel_tests::netns::{NetNs, veth};

fn options() -> IfaceOptions {
    IfaceOptions {
        ifaces: vec![],
        iface_regex: vec![],
        iface_can_reach: None,
        public_ip: None,
        public_ipv6: None,
        stack: IpStack::V4,
    }
}

#[test]
fn snapshot_drives_interface_selection() {
    flannel_tests::require_root!();
    let node = NetNs::new("hn-node").unwrap();
    let peer = NetNs::new("hn-peer").unwrap();
    veth(&node, "ext0", &peer, "p0").unwrap();
    veth(&node, "side0", &peer, "p1").unwrap();
    node.run(&["ip", "addr", "add", "192.168.77.10/24", "dev", "ext0"])
        .unwrap();
    node.run(&["ip", "addr", "add", "172.16.30.18/24", "dev", "side0"])
        .unwrap();
    node.run(&[
        "ip",
        "route",
        "add",
        "default",
        "via",
        "192.168.77.1",
        "dev",
        "ext0",
    ])
    .unwrap();
    node.run(&[
        "ip",
        "route",
        "add",
        "172.16.32.0/24",
        "via",
        "172.16.30.1",
        "dev",
        "side0",
        "onlink",
    ])
    .unwrap();

    let select = |opts: IfaceOptions| {
        node.enter(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async {
                let nl = Netlink::new().unwrap();
                let snap = hostnet::snapshot(&nl, opts.iface_can_reach).await.unwrap();
                iface::select(&opts, &snap)
            })
        })
        .unwrap()
    };

    // No options: the default-route interface and its address.
    let ext = select(options()).unwrap();
    assert_eq!(ext.name, "ext0");
    assert_eq!(ext.iface_addr, Some(Ipv4Addr::new(192, 168, 77, 10)));
    assert_eq!(ext.mtu, 1500);

    // By name, by address, by regex on addresses, by reachability.
    let by_name = select(IfaceOptions {
        ifaces: vec!["side0".into()],
        ..options()
    })
    .unwrap();
    assert_eq!(by_name.name, "side0");
    let by_ip = select(IfaceOptions {
        ifaces: vec!["172.16.30.18".into()],
        ..options()
    })
    .unwrap();
    assert_eq!(by_ip.name, "side0");
    let by_regex = select(IfaceOptions {
        iface_regex: vec![r"172\.16\.30\.\d+".into()],
        ..options()
    })
    .unwrap();
    assert_eq!(by_regex.iface_addr, Some(Ipv4Addr::new(172, 16, 30, 18)));
    let can_reach = select(IfaceOptions {
        iface_can_reach: Some(IpAddr::V4(Ipv4Addr::new(172, 16, 32, 254))),
        ..options()
    })
    .unwrap();
    assert_eq!(can_reach.name, "side0");

    // A public IP that no interface holds, without other options: upstream's failure.
    let missing = select(IfaceOptions {
        public_ip: Some(Ipv4Addr::new(10, 9, 9, 9)),
        ..options()
    });
    assert!(missing.is_err(), "{missing:?}");
    // An --iface that does not exist: no match, with the attempts listed.
    let none = select(IfaceOptions {
        ifaces: vec!["nope0".into()],
        ..options()
    })
    .unwrap_err();
    assert!(
        none.to_string().contains("Failed to find interface"),
        "{none}"
    );
}
