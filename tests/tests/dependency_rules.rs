//! The architecture's dependency rules, read from `cargo metadata` and `cargo tree`: each rule is
//! a sentence of ARCHITECTURE.md, and this test fails when a change to a `Cargo.toml` breaks one.
//! Only normal (non-dev) dependencies count: what a package's library and binaries link. A test
//! may link anything.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::process::Command;

/// The processes we run: their packages must be leaves (nothing but the developer harness links
/// them in-process).
const SERVERS: &[&str] = &[
    "lock-server",
    "payment-resource",
    "rail-proxy",
    "general-ledger",
    "outbox-dispatcher",
    "rail-stub",
];

/// What the images ship (deploy/build-images.sh builds exactly these packages).
const SHIPPED: &[&str] = &[
    "lock-server",
    "payment-resource",
    "rail-stub",
    "rail-proxy",
    "general-ledger",
    "outbox-dispatcher",
    "payout-worker",
    // The reconciler on its schedule (compose's `reconciler` service).
    "reconciler-service",
    "payoutctl",
    // payout-probe, the containers' health check.
    "compose-tests",
];

/// Test and developer machinery: never linked by a shipped package. testcontainers (and bollard,
/// the Docker client it wraps) drive the compose suite: compose-tests ships payout-probe, so they
/// stay its dev-dependencies.
const HARNESS: &[&str] = &[
    "testkit",
    "system-tests",
    "service-benches",
    "payoutdev",
    "testcontainers",
    "bollard",
];

/// Packages allowed to start servers in-process (the developer harness and the fault suite).
const MAY_LINK_SERVERS: &[&str] = &["system-tests", "service-benches", "payoutdev"];

/// The contract crates: what crosses one process boundary, and nothing of the server behind it.
const CONTRACTS: &[&str] = &["lock-client", "payment-client", "rail-proxy-client"];

/// The workspace the rules are read from: this one, or (`DEPENDENCY_RULES_WORKSPACE`) another
/// checkout, which is how the rules were seen failing on the tree before they held.
fn workspace_root() -> PathBuf {
    if let Some(other) = std::env::var_os("DEPENDENCY_RULES_WORKSPACE") {
        return PathBuf::from(other);
    }
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ sits in the workspace")
        .to_path_buf()
}

fn cargo() -> Command {
    let mut cmd = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    cmd.current_dir(workspace_root());
    cmd
}

/// Every package's normal dependencies, by name (one version per name is all this workspace has
/// of its own crates; external crates are named too, so `sqlx` and `etcd-client` can be ruled).
struct Graph {
    deps: BTreeMap<String, BTreeSet<String>>,
    workspace: BTreeSet<String>,
}

impl Graph {
    fn load() -> Self {
        let out = cargo()
            .args(["metadata", "--format-version", "1", "--offline"])
            .output()
            .expect("cargo metadata runs");
        assert!(
            out.status.success(),
            "cargo metadata: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let meta: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let names: BTreeMap<String, String> = meta["packages"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| {
                (
                    p["id"].as_str().unwrap().to_string(),
                    p["name"].as_str().unwrap().to_string(),
                )
            })
            .collect();
        let workspace = meta["workspace_members"]
            .as_array()
            .unwrap()
            .iter()
            .map(|id| names[id.as_str().unwrap()].clone())
            .collect();
        let mut deps: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        for node in meta["resolve"]["nodes"].as_array().unwrap() {
            let name = names[node["id"].as_str().unwrap()].clone();
            let entry = deps.entry(name).or_default();
            for dep in node["deps"].as_array().unwrap() {
                let normal = dep["dep_kinds"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .any(|k| k["kind"].is_null());
                if normal {
                    entry.insert(names[dep["pkg"].as_str().unwrap()].clone());
                }
            }
        }
        Self { deps, workspace }
    }

    /// Everything `package` links, directly or through another crate.
    fn closure(&self, package: &str) -> BTreeSet<String> {
        let mut seen = BTreeSet::new();
        let mut stack = vec![package.to_string()];
        while let Some(p) = stack.pop() {
            for d in self.deps.get(&p).into_iter().flatten() {
                if seen.insert(d.clone()) {
                    stack.push(d.clone());
                }
            }
        }
        seen
    }

    fn workspace_closure(&self, package: &str) -> BTreeSet<String> {
        self.closure(package)
            .into_iter()
            .filter(|d| self.workspace.contains(d))
            .collect()
    }
}

/// Collects every broken rule, so one run names them all.
#[derive(Default)]
struct Verdict(Vec<String>);

impl Verdict {
    fn forbid(&mut self, graph: &Graph, package: &str, forbidden: &[&str], why: &str) {
        if !graph.workspace.contains(package) {
            self.0.push(format!(
                "{package} is not a workspace package: a rule names a crate that does not exist"
            ));
            return;
        }
        let links = graph.closure(package);
        for f in forbidden {
            if links.contains(*f) {
                self.0.push(format!("{package} links {f}: {why}"));
            }
        }
    }
}

#[test]
fn the_dependency_rules_hold() {
    let g = Graph::load();
    let mut v = Verdict::default();

    // The servers are leaves: only their own binary, their tests and the harness link them.
    for package in g.workspace.iter() {
        if MAY_LINK_SERVERS.contains(&package.as_str()) {
            continue;
        }
        for server in SERVERS {
            if package != server && g.closure(package).contains(*server) {
                v.0.push(format!(
                    "{package} links the server {server}: talk to it through its contract crate"
                ));
            }
        }
    }

    // The guards know nothing of the lock service: a token is all they see.
    v.forbid(
        &g,
        "rail-proxy",
        &[
            "etcd-client",
            "lock-client",
            "lock-server",
            "payment-resource",
            "payment-client",
            "rail-stub",
        ],
        "the proxy knows nothing of etcd, the lock service, paydb or the stub",
    );
    v.forbid(
        &g,
        "payment-resource",
        &["etcd-client", "lock-client", "lock-server", "rail-proxy"],
        "the payment resource knows nothing of the lock service",
    );
    // The lock service knows nothing of payouts or money.
    v.forbid(
        &g,
        "lock-server",
        &[
            "payout-domain",
            "payment-client",
            "payment-resource",
            "rail-proxy-client",
            "rail-proxy",
            "general-ledger",
            "payout-activities",
            "payout-workflows",
        ],
        "the lock service knows nothing of payouts or money",
    );

    for package in SHIPPED.iter().chain(CONTRACTS) {
        if !g.workspace.contains(*package) {
            v.0.push(format!("{package} is not a workspace package"));
        }
    }

    // Workflows are deterministic code: beside the Temporal SDK, the activity contract and the
    // domain, nothing; never a database driver, etcd, or a service.
    let ours = g.workspace_closure("payout-workflows");
    let allowed: BTreeSet<String> = ["payout-activities", "payout-domain"]
        .map(String::from)
        .into();
    for extra in ours.difference(&allowed) {
        v.0.push(format!(
            "payout-workflows links {extra}: workflows depend on the activity contract and the domain only"
        ));
    }
    v.forbid(
        &g,
        "payout-workflows",
        &["sqlx", "etcd-client", "reqwest"],
        "workflows do no I/O of their own",
    );
    // The activity contract declares; it implements nothing.
    v.forbid(
        &g,
        "payout-activities",
        &["sqlx", "etcd-client", "reqwest"]
            .into_iter()
            .chain(CONTRACTS.iter().copied())
            .collect::<Vec<_>>(),
        "the activity contract holds no client: the worker wires the services",
    );

    // A contract crate carries no server code and no database driver.
    for contract in CONTRACTS {
        v.forbid(
            &g,
            contract,
            &["sqlx", "testkit"]
                .into_iter()
                .chain(SERVERS.iter().copied())
                .collect::<Vec<_>>(),
            "a contract crate is the client, the wire types and the errors only",
        );
    }

    // The detective reconciler takes no grant and writes nothing: the resolver that does is
    // apart from it.
    v.forbid(
        &g,
        "reconciler",
        &["lock-client", "payment-client", "resolver"],
        "the detective checks are read-only; the corrective resolver is its own crate",
    );

    // No shipped binary carries test machinery.
    for package in SHIPPED {
        v.forbid(
            &g,
            package,
            HARNESS,
            "a shipped binary links no test kit, fault harness or bench",
        );
    }

    assert!(
        v.0.is_empty(),
        "broken dependency rules:\n  {}",
        v.0.join("\n  ")
    );
}

/// The switches that turn a guard off (the rail proxy's failpoints, and the plaintext serving of
/// the lock server, the payment resource and the proxy) sit behind the `negative-controls`
/// features: the build of the shipped packages alone (what the image build
/// runs) must not enable it, whatever the test crates enable for themselves.
#[test]
fn the_shipped_build_enables_no_negative_control() {
    let mut cmd = cargo();
    cmd.args(["tree", "--offline", "--edges", "normal", "--prefix", "none"])
        .args(["--format", "{p} [{f}]"]);
    for package in SHIPPED {
        cmd.args(["-p", package]);
    }
    let out = cmd.output().expect("cargo tree runs");
    assert!(
        out.status.success(),
        "cargo tree: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let tree = String::from_utf8_lossy(&out.stdout);
    let proxy: Vec<&str> = tree
        .lines()
        .filter(|l| l.starts_with("rail-proxy v"))
        .collect();
    assert!(
        !proxy.is_empty(),
        "rail-proxy is in the shipped build:\n{tree}"
    );
    for line in tree.lines() {
        assert!(
            !line.contains("negative-controls"),
            "the shipped build enables a negative control: {line}"
        );
        // `payment-resource fixture` opens funded accounts straight on paydb: a test build's
        // command, never a shipped one (issue 34, row 6a).
        assert!(
            !line.contains("fixture-command"),
            "the shipped build can mint money (payment-resource's fixture subcommand): {line}"
        );
        for harness in HARNESS {
            assert!(
                !line.starts_with(&format!("{harness} v")),
                "the shipped build links {harness}"
            );
        }
    }
}
