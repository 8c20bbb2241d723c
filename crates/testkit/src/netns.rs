//! A separate network host for one process: a Linux network namespace joined to this host by a
//! veth pair, so the nemesis can cut one link (a worker from the lock-server) while every other
//! link (the worker to the guards and Temporal) stays up. This is a real network path with a
//! real partition: packets are dropped, connections hang, keep-alives time out.
//!
//! The services listen on 127.0.0.1 only; the namespace reaches them at the veth's host address,
//! DNAT'ed to loopback on the host side (`route_localnet`). A cut is an `iptables DROP` of one
//! TCP port in both directions inside the namespace.
//!
//! Needs root and `ip`/`iptables` (iproute2, iptables: `scripts/setup.sh`); [`NetNs::available`]
//! says whether this machine allows it, and why not.

use std::net::Ipv4Addr;
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};

use anyhow::Context;

use crate::process::ProcessSpec;

/// The packets a one-way answer drop takes: those of this length or more (IPv4 and TCP headers
/// included) carry data. A bare ACK is 52 bytes with TCP timestamps, a SYN-ACK 60; an answer is a
/// TLS record of more than a hundred bytes.
pub const DATA_PACKETS: &str = "120:65535";
/// The connection mark bits of [`HostDrop::answers_of`]: the client has sent one data packet
/// (its TLS ClientHello), and a second (its second flight, or its request).
const CLIENT_SENT_ONE: &str = "0x100000/0x100000";
const CLIENT_SENT_TWO: &str = "0x200000/0x200000";

/// The match of a server's answers: TCP from `port`, carrying data ([`DATA_PACKETS`]).
fn answer_data(port: &str) -> Vec<String> {
    strings(&[
        "-p",
        "tcp",
        "--sport",
        port,
        "-m",
        "length",
        "--length",
        DATA_PACKETS,
    ])
}

/// `args` as owned strings.
fn strings(args: &[&str]) -> Vec<String> {
    args.iter().map(|a| a.to_string()).collect()
}

/// The packet count of the DROP rule whose line in `iptables -L -v -x -n` contains `marker`
/// (0 when there is none): the first column.
fn rule_packets(listing: &str, marker: &str) -> u64 {
    listing
        .lines()
        .filter(|l| l.contains("DROP") && l.contains(marker))
        .filter_map(|l| l.split_whitespace().next()?.parse::<u64>().ok())
        .sum()
}

/// Namespaces made by this process so far: part of each name and subnet.
static SEQUENCE: AtomicU32 = AtomicU32::new(0);

pub struct NetNs {
    pub name: String,
    host_if: String,
    /// This host's address as the namespace sees it: every service is reached here.
    pub host_ip: Ipv4Addr,
    pub ns_ip: Ipv4Addr,
}

/// Runs `program` with `args`; its stderr is the error when it fails.
pub(crate) fn run(program: &str, args: &[&str]) -> anyhow::Result<()> {
    let out = Command::new(program)
        .args(args)
        .output()
        .with_context(|| format!("running {program}"))?;
    anyhow::ensure!(
        out.status.success(),
        "{program} {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr).trim()
    );
    Ok(())
}

impl NetNs {
    /// Removes what a killed run left behind: namespaces (and their NAT rules) named after a
    /// process that no longer exists. Drop cleans up after a run that ends normally.
    fn remove_stale() {
        let owner_gone = |name: &str, marker: char| {
            name.strip_prefix("pw")
                .and_then(|rest| rest.split(marker).next())
                .and_then(|pid| pid.parse::<u32>().ok())
                .is_some_and(|pid| !std::path::Path::new(&format!("/proc/{pid}")).exists())
        };
        if let Ok(out) = Command::new("ip").args(["netns", "list"]).output() {
            for line in String::from_utf8_lossy(&out.stdout).lines() {
                let name = line.split_whitespace().next().unwrap_or_default();
                if owner_gone(name, 'n') {
                    let _ = run("ip", &["netns", "del", name]);
                }
            }
        }
        if let Ok(out) = Command::new("iptables")
            .args(["-w", "-t", "nat", "-S", "PREROUTING"])
            .output()
        {
            for rule in String::from_utf8_lossy(&out.stdout).lines() {
                let Some(dev) = rule.split_whitespace().skip_while(|w| *w != "-i").nth(1) else {
                    continue;
                };
                if rule.contains("DNAT") && owner_gone(dev, 'h') {
                    let mut args = vec!["-w", "-t", "nat", "-D"];
                    args.extend(rule.split_whitespace().skip(1));
                    let _ = run("iptables", &args);
                }
            }
        }
    }

    /// Whether namespaces can be made here: `Err` says why not (no root, no `ip`, no iptables).
    pub fn available() -> Result<(), String> {
        Self::remove_stale();
        let probe = format!("pwprobe{}", std::process::id());
        run("ip", &["netns", "add", &probe]).map_err(|e| format!("ip netns add: {e:#}"))?;
        let iptables = run(
            "ip",
            &["netns", "exec", &probe, "iptables", "-w", "-L", "OUTPUT"],
        )
        .map_err(|e| format!("iptables in a namespace: {e:#}"));
        let _ = run("ip", &["netns", "del", &probe]);
        iptables
    }

    /// Makes a namespace with a veth link to this host and loopback DNAT for every port.
    pub fn create() -> anyhow::Result<Self> {
        let seq = SEQUENCE.fetch_add(1, Ordering::SeqCst);
        let pid = std::process::id();
        // Interface names are at most 15 bytes; a /30 per namespace in the link-local range.
        let name = format!("pw{pid}n{seq}");
        let host_if = format!("pw{pid}h{seq}");
        let ns_if = format!("pw{pid}p{seq}");
        let subnet = (pid % 64) * 64 + seq % 64;
        let third = 100 + (subnet / 64) as u8;
        let fourth = ((subnet % 64) * 4) as u8;
        let host_ip = Ipv4Addr::new(169, 254, third, fourth + 1);
        let ns_ip = Ipv4Addr::new(169, 254, third, fourth + 2);
        let ns = Self {
            name,
            host_if,
            host_ip,
            ns_ip,
        };
        ns.setup(&ns_if)
            .with_context(|| format!("network namespace {}", ns.name))?;
        Ok(ns)
    }

    fn setup(&self, ns_if: &str) -> anyhow::Result<()> {
        let (name, host_if) = (self.name.as_str(), self.host_if.as_str());
        let host_cidr = format!("{}/30", self.host_ip);
        let ns_cidr = format!("{}/30", self.ns_ip);
        run("ip", &["netns", "add", name])?;
        run(
            "ip",
            &[
                "link", "add", host_if, "type", "veth", "peer", "name", ns_if,
            ],
        )?;
        run("ip", &["link", "set", ns_if, "netns", name])?;
        run("ip", &["addr", "add", &host_cidr, "dev", host_if])?;
        run("ip", &["link", "set", host_if, "up"])?;
        let in_ns = |args: &[&str]| {
            let mut all = vec!["netns", "exec", name];
            all.extend_from_slice(args);
            run("ip", &all)
        };
        in_ns(&["ip", "addr", "add", &ns_cidr, "dev", ns_if])?;
        in_ns(&["ip", "link", "set", ns_if, "up"])?;
        in_ns(&["ip", "link", "set", "lo", "up"])?;
        in_ns(&[
            "ip",
            "route",
            "add",
            "default",
            "via",
            &self.host_ip.to_string(),
        ])?;
        run(
            "sysctl",
            &[
                "-q",
                "-w",
                &format!("net.ipv4.conf.{host_if}.route_localnet=1"),
            ],
        )?;
        run("iptables", &self.nat_rule("-A"))?;
        Ok(())
    }

    fn nat_rule<'a>(&'a self, op: &'a str) -> Vec<&'a str> {
        vec![
            "-w",
            "-t",
            "nat",
            op,
            "PREROUTING",
            "-i",
            &self.host_if,
            "-p",
            "tcp",
            "-j",
            "DNAT",
            "--to-destination",
            "127.0.0.1",
        ]
    }

    fn drop_rules(&self, op: &str, port: u16) -> anyhow::Result<()> {
        let port = port.to_string();
        for (chain, dir) in [("OUTPUT", "--dport"), ("INPUT", "--sport")] {
            run(
                "ip",
                &[
                    "netns", "exec", &self.name, "iptables", "-w", op, chain, "-p", "tcp", dir,
                    &port, "-j", "DROP",
                ],
            )?;
        }
        Ok(())
    }

    /// Cuts the namespace off from this host's TCP `port`, both directions: packets are
    /// dropped, so open connections hang rather than reset (a partition, not a crash).
    pub fn cut(&self, port: u16) -> anyhow::Result<()> {
        self.drop_rules("-A", port)
    }

    /// Heals a [`NetNs::cut`].
    pub fn heal(&self, port: u16) -> anyhow::Result<()> {
        self.drop_rules("-D", port)
    }

    /// Drops `port`'s answers to this namespace, one way: the packets from it that carry data
    /// ([`DATA_PACKETS`]). Bare ACKs still pass, so on a connection already open (a worker's
    /// gRPC channels to the guards are) requests keep arriving and the service acts on them;
    /// what it answers never arrives (a lost answer, not a partition). The held-back answer is
    /// retransmitted by the service's TCP and dropped again until [`NetNs::heal_answers`]. A
    /// connection opened meanwhile stops at its TLS handshake.
    pub fn drop_answers(&self, port: u16) -> anyhow::Result<()> {
        self.answer_rule("-A", port)
    }

    /// Heals a [`NetNs::drop_answers`].
    pub fn heal_answers(&self, port: u16) -> anyhow::Result<()> {
        self.answer_rule("-D", port)
    }

    /// Packets [`NetNs::drop_answers`] has dropped so far (the rule's own counter).
    pub fn answers_dropped(&self, port: u16) -> anyhow::Result<u64> {
        let out = Command::new("ip")
            .args([
                "netns", "exec", &self.name, "iptables", "-w", "-L", "INPUT", "-v", "-x", "-n",
            ])
            .output()
            .context("listing the namespace's INPUT rules")?;
        let listing = String::from_utf8_lossy(&out.stdout);
        Ok(rule_packets(&listing, &format!("spt:{port} ")))
    }

    fn answer_rule(&self, op: &str, port: u16) -> anyhow::Result<()> {
        let mut args = strings(&["netns", "exec", &self.name, "iptables", "-w", op, "INPUT"]);
        args.extend(answer_data(&port.to_string()));
        args.extend(strings(&["-j", "DROP"]));
        run("ip", &args.iter().map(String::as_str).collect::<Vec<_>>())
    }

    /// `spec` run inside this namespace (`ip netns exec` execs the program: same pid, so signals
    /// and restarts reach it as before), with every `127.0.0.1` in its environment replaced by
    /// this host's address as seen from the namespace.
    pub fn wrap(&self, mut spec: ProcessSpec) -> ProcessSpec {
        let program = std::mem::replace(&mut spec.program, "ip".into());
        let mut args: Vec<std::ffi::OsString> =
            vec!["netns".into(), "exec".into(), self.name.clone().into()];
        args.push(program.into_os_string());
        args.append(&mut spec.args);
        spec.args = args;
        let host = self.host_ip.to_string();
        for value in spec.env.values_mut() {
            *value = value.replace("127.0.0.1", &host);
        }
        spec
    }
}

impl Drop for NetNs {
    fn drop(&mut self) {
        let _ = run("iptables", &self.nat_rule("-D"));
        // Deleting the namespace removes its end of the veth pair, which removes both ends.
        let _ = run("ip", &["netns", "del", &self.name]);
    }
}

/// A drop on this host's loopback, in its `OUTPUT` chain, removed on drop: for a link between
/// two services that both run on this host (the rail proxy and the rail, the dispatcher and the
/// GL), where neither side has a namespace of its own. Each rule carries a comment naming this
/// process (`pwdrop<pid>-<seq>`), so a killed run's rules are swept by the next one.
pub struct HostDrop {
    comment: String,
    rules: Vec<Vec<String>>,
}

/// Host drops made by this process so far: part of each comment.
static HOST_DROPS: AtomicU32 = AtomicU32::new(0);

impl HostDrop {
    /// Drops the data-carrying packets from `port` ([`DATA_PACKETS`]) on a connection whose
    /// client has sent two data packets: its TLS ClientHello, then its second flight (its
    /// Finished, or its Finished and its request). The server's flight that answers the
    /// ClientHello still passes, so the handshake completes and the request is made; whatever
    /// the server sends after that (its session tickets, its answer) is dropped, since a TLS 1.3
    /// server sends nothing between its flight and the client's Finished. The service listening
    /// there receives every request and acts on it; its answers never leave (one way). A link
    /// that opens a connection per request (the proxy's to the rail) needs this: a drop of every
    /// data packet from the server stops each request at its handshake, and the server never
    /// acts. The client's data packets are counted by marking the connection (`CONNMARK`), not
    /// by conntrack's packet or byte counts: its bare ACKs (Linux acknowledges each early
    /// segment at once) and its certificate's size would move those.
    pub fn answers_of(port: u16) -> anyhow::Result<Self> {
        let port = port.to_string();
        let client_data = [
            "-p",
            "tcp",
            "--dport",
            &port,
            "-m",
            "length",
            "--length",
            DATA_PACKETS,
        ];
        let mut second = strings(&client_data);
        second.extend(strings(&[
            "-m",
            "connmark",
            "--mark",
            CLIENT_SENT_ONE,
            "-j",
            "CONNMARK",
            "--set-xmark",
            CLIENT_SENT_TWO,
        ]));
        let mut first = strings(&client_data);
        first.extend(strings(&["-j", "CONNMARK", "--set-xmark", CLIENT_SENT_ONE]));
        let mut answers = answer_data(&port);
        answers.extend(strings(&[
            "-m",
            "connmark",
            "--mark",
            CLIENT_SENT_TWO,
            "-j",
            "DROP",
        ]));
        // In this order: a client's first data packet sets only the first mark.
        Self::install(vec![second, first, answers])
    }

    /// Drops every packet to and from `port`: the service listening there is partitioned from
    /// its clients on this host (connections hang; nothing is reset).
    pub fn partition(port: u16) -> anyhow::Result<Self> {
        let port = port.to_string();
        Self::install(vec![
            strings(&["-p", "tcp", "--dport", &port, "-j", "DROP"]),
            strings(&["-p", "tcp", "--sport", &port, "-j", "DROP"]),
        ])
    }

    /// Appends `rules` (each its matches and its target) to `OUTPUT` on loopback, in order, each
    /// with this drop's comment.
    fn install(rules: Vec<Vec<String>>) -> anyhow::Result<Self> {
        Self::remove_stale();
        let comment = format!(
            "pwdrop{}-{}",
            std::process::id(),
            HOST_DROPS.fetch_add(1, Ordering::SeqCst)
        );
        let mut drop = Self {
            comment,
            rules: Vec::new(),
        };
        for spec in rules {
            let target = spec.iter().position(|a| a == "-j").unwrap_or(spec.len());
            let mut rule = strings(&["OUTPUT", "-o", "lo"]);
            rule.extend(spec[..target].iter().cloned());
            rule.extend(strings(&["-m", "comment", "--comment", &drop.comment]));
            rule.extend(spec[target..].iter().cloned());
            let mut add = strings(&["-w", "-A"]);
            add.extend(rule.iter().cloned());
            run(
                "iptables",
                &add.iter().map(String::as_str).collect::<Vec<_>>(),
            )?;
            // Kept as installed, so Drop deletes exactly these (and those before a failure).
            drop.rules.push(rule);
        }
        Ok(drop)
    }

    /// Packets dropped so far by this drop's rules.
    pub fn dropped(&self) -> anyhow::Result<u64> {
        let out = Command::new("iptables")
            .args(["-w", "-L", "OUTPUT", "-v", "-x", "-n"])
            .output()
            .context("listing this host's OUTPUT rules")?;
        Ok(rule_packets(
            &String::from_utf8_lossy(&out.stdout),
            &format!("/* {} */", self.comment),
        ))
    }

    /// Deletes the rules of drops whose process no longer exists (a killed run's).
    fn remove_stale() {
        let Ok(out) = Command::new("iptables")
            .args(["-w", "-S", "OUTPUT"])
            .output()
        else {
            return;
        };
        for rule in String::from_utf8_lossy(&out.stdout).lines() {
            let Some(pid) = rule
                .split("pwdrop")
                .nth(1)
                .and_then(|rest| rest.split('-').next())
                .and_then(|pid| pid.parse::<u32>().ok())
            else {
                continue;
            };
            if !std::path::Path::new(&format!("/proc/{pid}")).exists() {
                let mut args = vec!["-w", "-D"];
                args.extend(rule.split_whitespace().skip(1).map(|w| w.trim_matches('"')));
                let _ = run("iptables", &args);
            }
        }
    }
}

impl Drop for HostDrop {
    fn drop(&mut self) {
        for rule in &self.rules {
            let mut args = vec!["-w", "-D"];
            args.extend(rule.iter().map(String::as_str));
            let _ = run("iptables", &args);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::rule_packets;

    #[test]
    fn a_drop_rules_packets_are_read_from_its_line_alone() {
        let listing = "Chain OUTPUT (policy ACCEPT 10 packets, 600 bytes)
 pkts bytes target prot opt in out source destination
      7   840 DROP   tcp  --  *  lo  0.0.0.0/0 0.0.0.0/0 tcp spt:4100 length 120:65535 /* pwdrop9-0 */
     12  1000 DROP   tcp  --  *  lo  0.0.0.0/0 0.0.0.0/0 tcp spt:41001 /* pwdrop9-1 */
      3    90 ACCEPT tcp  --  *  lo  0.0.0.0/0 0.0.0.0/0 tcp spt:4100 /* pwdrop9-0 */
";
        assert_eq!(rule_packets(listing, "/* pwdrop9-0 */"), 7);
        assert_eq!(rule_packets(listing, "spt:4100 "), 7);
        assert_eq!(rule_packets(listing, "/* pwdrop9-2 */"), 0);
    }
}
