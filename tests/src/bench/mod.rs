//! Benchmarks run by `flannel-lab bench`: numbers are ratios against a baseline measured in
//! the same run, never absolute thresholds (this machine is shared and small).
//!
//! | module | job |
//! |---|---|
//! | [`variant`] | named setups (topology + setup function) yielding client and server |
//! | [`measure`] | iperf3 throughput with /proc/stat CPU, sockperf ping-pong latency |
//! | [`stats`] | median/min/max and ratios |
//! | [`dataplane`] | the round-robin runner of `bench dataplane` |
//! | [`control`] | `bench control`: N fake leases → time until the kernel holds them |
//! | [`report`] | Markdown, JSON and SVG output with the machine header |

pub mod control;
pub mod dataplane;
pub mod measure;
pub mod report;
pub mod stats;
pub mod variant;
