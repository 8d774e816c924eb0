//! Benchmarks run by `flannel-lab bench`: numbers are ratios against a baseline measured in
//! the same run, never absolute thresholds (this machine is shared and small).
//!
//! | module | job |
//! |---|---|
//! | [`variant`] | named setups (topology + setup function) yielding client and server |
//! | [`floor`] | the `floor-ebpf-*` variants' minimal forwarding program |
//! | [`measure`] | iperf3 throughput with /proc/stat CPU, ping-pong latency (sockperf; [`rr`] for IPv6) |
//! | [`progtime`] | the agent's BPF programs' run time over a measurement (`BPF_ENABLE_STATS`) |
//! | [`stats`] | median/min/max and ratios |
//! | [`rounds`] | the interleaved runner: set up every variant, measure round-robin, compare with the baseline |
//! | [`dataplane`] | `bench dataplane`: throughput, latency and CPU of the [`variant`] testbeds |
//! | [`targets`] | issue 4's targets checked on a `bench dataplane` report, the floor's figure next to the agent's |
//! | [`control`] | `bench control`: N fake leases → time until the kernel holds them |
//! | [`kubecache`] | `bench kube-cache`: the memory kube mode holds for N Nodes, against whole Node objects |
//! | [`learn`] | `bench learn`: the programs' time while kernel flows are learnt at a high rate, against a quiet run |
//! | [`programs`] | `bench programs`: one program run on a remembered flow's packet, timed in the kernel against the floor |
//! | [`masq`] | `bench masq`: pod → outside through eBPF SNAT, iptables MASQUERADE, no NAT |
//! | [`resync`] | `bench resync`: one read of conntrack's open NATed connections into the flow tables, held against lookups |
//! | [`crr`] | the TCP connection-rate tool `bench masq` uses (`flannel-lab crr`) |
//! | [`rr`] | the TCP ping-pong latency tool `bench dataplane` uses for IPv6 (`flannel-lab rr`) |
//! | [`report`] | Markdown, JSON and SVG output with the machine header |

pub mod control;
pub mod control_floor;
pub mod crr;
pub mod dataplane;
pub mod floor;
pub mod kubecache;
pub mod learn;
pub mod masq;
pub mod measure;
pub mod programs;
pub mod progtime;
pub mod report;
pub mod resync;
pub mod rounds;
pub mod rr;
pub mod stats;
pub mod targets;
pub mod variant;
