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
