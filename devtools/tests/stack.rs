//! `payoutdev stack up | status | down` as a newcomer runs them: every part healthy, the UI
//! answering, data kept across down/up, and nothing left running after down.

use std::path::Path;
use std::process::Command;

mod common;

use common::stack_ports;

fn payoutdev(state: &Path, args: &[&str], ports: &[(&str, u16)]) -> std::process::Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_payoutdev"));
    cmd.args(args).env("PAYOUT_STATE_DIR", state);
    for (var, port) in ports {
        cmd.env(var, port.to_string());
    }
    cmd.output().expect("payoutdev runs")
}

fn status_json(state: &Path) -> (bool, serde_json::Value) {
    let out = payoutdev(state, &["stack", "status", "--json"], &[]);
    let value: serde_json::Value =
        serde_json::from_slice(&out.stdout).expect("status --json is JSON");
    (out.status.success(), value)
}

/// `stack up` on `ports`, which must succeed; what it said on stderr.
fn up_ok(state: &Path, ports: &[(&str, u16)]) -> String {
    let up = payoutdev(state, &["stack", "up"], ports);
    let stderr = String::from_utf8_lossy(&up.stderr).into_owned();
    assert!(
        up.status.success(),
        "up failed: {}\n{stderr}",
        String::from_utf8_lossy(&up.stdout)
    );
    stderr
}

#[tokio::test]
async fn stack_up_status_down_up_keeps_data() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("stack");
    let ports = stack_ports();
    let stop = scopeguard(&state);
    up_ok(&state, &ports);
    let (ok, status) = status_json(&state);
    assert!(ok, "status: {status}");
    let parts = status["parts"].as_array().unwrap();
    for name in [
        "postgres-main",
        "postgres-proxy",
        "etcd-m0",
        "temporal",
        "temporal-ui",
    ] {
        let part = parts
            .iter()
            .find(|p| p["name"] == name)
            .unwrap_or_else(|| panic!("{name} in {status}"));
        assert_eq!(part["healthy"], true, "{name}: {status}");
    }
    // The reconciler logs in as its own role and stays up: it creates its schedule and polls.
    // (It was once handed the superuser's URL without a password: it retried for about twenty
    // seconds, so the status above still saw it, then exited, and the stack ran no reconciler.)
    let reconciler_log = state.join("system").join("reconciler.log");
    testkit::eventually(
        std::time::Duration::from_secs(60),
        "the reconciler polls",
        || async {
            std::fs::read_to_string(&reconciler_log)
                .unwrap_or_default()
                .contains("reconciler worker polling")
                .then_some(())
        },
    )
    .await
    .unwrap_or_else(|e| {
        panic!(
            "{e}: {}",
            std::fs::read_to_string(&reconciler_log).unwrap_or_default()
        )
    });
    let (ok, status) = status_json(&state);
    assert!(
        ok,
        "every part still healthy once the reconciler runs: {status}"
    );

    // The UI serves its page behind the Temporal front: over TLS, to its login only.
    let ui_port = ports[4].1;
    let clients = state.join("temporal-clients");
    let password = std::fs::read_to_string(clients.join("temporal-ui.password")).unwrap();
    let url = format!("https://127.0.0.1:{ui_port}/");
    let ui = |login: Option<&str>| {
        testkit::temporal_front::ui_status(&url, &clients.join("ca.pem"), login).unwrap()
    };
    assert_eq!(ui(None), "401", "the UI without its login");
    assert_eq!(
        ui(Some(&format!("operator:{password}"))),
        "200",
        "the UI with its login"
    );

    // Write into paydb, go down, come up: the row is still there.
    // What the stack prints holds no password; the superuser's is in the stack's credentials file.
    let printed = status["databases"]["paydb"].as_str().unwrap().to_string();
    assert!(
        printed.starts_with("postgres://postgres@") && printed.contains("sslmode=verify-full"),
        "{printed}"
    );
    let credentials =
        testkit::db_access::Credentials::load(&state.join(testkit::db_access::CREDENTIALS_FILE))
            .expect("the stack's generated credentials");
    let paydb = printed.replacen(
        "postgres://postgres@",
        &format!("postgres://postgres:{}@", credentials.superuser),
        1,
    );
    {
        let pool = sqlx::PgPool::connect(&paydb).await.unwrap();
        sqlx::query("CREATE TABLE kit_persisted (x int)")
            .execute(&pool)
            .await
            .unwrap();
        sqlx::query("INSERT INTO kit_persisted VALUES (42)")
            .execute(&pool)
            .await
            .unwrap();
        pool.close().await;
    }
    let pids: Vec<i32> = parts
        .iter()
        .filter_map(|p| p["pid"].as_i64())
        .map(|p| p as i32)
        .collect();
    let down = payoutdev(&state, &["stack", "down"], &[]);
    assert!(
        down.status.success(),
        "down: {} {}",
        String::from_utf8_lossy(&down.stdout),
        String::from_utf8_lossy(&down.stderr)
    );
    eprintln!("down said: {}", String::from_utf8_lossy(&down.stdout));
    for pid in &pids {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        assert!(
            !testkit::util::pid_alive(*pid as u32),
            "pid {pid} still alive after down: {stat}"
        );
    }
    let (ok, _) = status_json(&state);
    assert!(!ok, "status must fail while the stack is down");

    up_ok(&state, &ports);
    let pool = sqlx::PgPool::connect(&paydb).await.unwrap();
    let x: i32 = sqlx::query_scalar("SELECT x FROM kit_persisted")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(x, 42);
    pool.close().await;
    drop(stop);
}

/// Brings the stack down even when an assertion fails.
fn scopeguard(state: &Path) -> impl Drop + '_ {
    struct Down<'a>(&'a Path);
    impl Drop for Down<'_> {
        fn drop(&mut self) {
            let _ = payoutdev(self.0, &["stack", "down"], &[]);
        }
    }
    Down(state)
}

/// Every part's recorded pid, by name, from `stack status --json` (the UI's row is Temporal's).
fn pids(state: &Path) -> std::collections::BTreeMap<String, i64> {
    let (_, status) = status_json(state);
    status["parts"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| p["name"] != "temporal-ui")
        .map(|p| {
            (
                p["name"].as_str().unwrap().to_string(),
                p["pid"].as_i64().unwrap(),
            )
        })
        .collect()
}

/// SIGKILL to a part's whole process group (its leader's pid), as a crash would.
fn kill_part(pid: i64) {
    // SAFETY: a signal to a process group this test's stack started.
    unsafe {
        libc::kill(-(pid as i32), libc::SIGKILL);
    }
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while testkit::util::pid_alive(pid as u32) && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    assert!(
        !testkit::util::pid_alive(pid as u32),
        "pid {pid} survived SIGKILL"
    );
}

/// `up` again after `victim` died: only `victim` has a new pid; status all healthy.
fn up_restarts_only(state: &Path, victim: &str) {
    let before = pids(state);
    kill_part(before[victim]);
    let (ok, status) = status_json(state);
    assert!(!ok, "status must report {victim} down: {status}");
    let stderr = up_ok(state, &[]);
    assert!(
        stderr.contains(&format!("started again: {victim}")),
        "up names what it restarted: {stderr}"
    );
    let after = pids(state);
    for (name, pid) in &before {
        if name == victim {
            assert_ne!(after[name], *pid, "{victim} was started again");
        } else {
            assert_eq!(
                after[name], *pid,
                "{name} kept running (up restarted only {victim})"
            );
        }
    }
    let (ok, status) = status_json(state);
    assert!(ok, "every part healthy after up: {status}");
}

#[tokio::test]
async fn up_after_one_part_died_restarts_that_part_only() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("stack");
    let stop = scopeguard(&state);
    // Long operations say what they do.
    let stderr = up_ok(&state, &stack_ports());
    assert!(stderr.contains("provisioning the databases"), "{stderr}");

    // One of our services; then a database (its services reconnect by themselves).
    up_restarts_only(&state, "payment-resource");
    up_restarts_only(&state, "postgres-proxy");

    // A part restarted by hand (another pid than the recorded one) is reported by what it does,
    // and `up` keeps it.
    let recorded = pids(&state);
    kill_part(recorded["rail-stub"]);
    let launch: serde_json::Value =
        serde_json::from_slice(&std::fs::read(state.join("parts").join("rail-stub.json")).unwrap())
            .unwrap();
    let by_hand = {
        use std::os::unix::process::CommandExt;
        Command::new(launch["program"].as_str().unwrap())
            .args(
                launch["args"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|a| a.as_str().unwrap()),
            )
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .process_group(0)
            .spawn()
            .unwrap()
    };
    let by_hand_pid = by_hand.id() as i64;
    let _kill_by_hand = KillOnDrop(by_hand_pid);
    testkit::eventually(
        std::time::Duration::from_secs(30),
        "the hand-started rail stub reported healthy",
        || async {
            let (ok, status) = status_json(&state);
            let stub = status["parts"]
                .as_array()?
                .iter()
                .find(|p| p["name"] == "rail-stub")?
                .clone();
            (ok && stub["healthy"] == true && stub["running"] == true).then_some(())
        },
    )
    .await
    .unwrap();
    let stderr = up_ok(&state, &[]);
    assert!(stderr.contains("stack already up"), "{stderr}");
    // `status` shows the pid that serves the stub's port (the hand-started one), and the pid
    // `up` recorded beside it; every other part keeps its pid.
    let mut expected = recorded.clone();
    expected.insert("rail-stub".into(), by_hand_pid);
    assert_eq!(pids(&state), expected, "up restarted nothing");
    let (_, status) = status_json(&state);
    let stub = status["parts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == "rail-stub")
        .unwrap();
    assert_eq!(stub["recorded_pid"], recorded["rail-stub"], "{status}");
    assert!(testkit::util::pid_alive(by_hand_pid as u32));
    // `down` stops the process that serves, not only the recorded one.
    drop(stop);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while testkit::util::pid_alive(by_hand_pid as u32) && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    assert!(
        !testkit::util::pid_alive(by_hand_pid as u32),
        "down stopped the hand-started stub"
    );
}

/// Kills a process group this test started by hand, whatever happens.
struct KillOnDrop(i64);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        // SAFETY: a signal to the process group this test created.
        unsafe {
            libc::kill(-(self.0 as i32), libc::SIGKILL);
        }
    }
}

/// The binary of our own `name` that the `payoutdev` under test starts: `PAYOUT_BIN_DIR`'s, else
/// the one beside it (as `testkit::util::bin_dir` resolves them), with its links resolved as the
/// kernel shows a process's program.
fn this_build(name: &str) -> std::path::PathBuf {
    let dir = std::env::var_os("PAYOUT_BIN_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| {
            Path::new(env!("CARGO_BIN_EXE_payoutdev"))
                .parent()
                .unwrap()
                .to_path_buf()
        });
    std::fs::canonicalize(dir.join(name)).unwrap()
}

/// The program a live process runs, as the kernel names it.
fn exe(pid: i64) -> std::path::PathBuf {
    std::fs::read_link(format!("/proc/{pid}/exe"))
        .unwrap_or_else(|e| panic!("pid {pid} runs no program we can read: {e}"))
}

/// Issue 32: a stack first started by one build of `payoutdev` (the debug one of `scripts/run.sh`)
/// kept running that build's services under every later `payoutdev`, because `up` restarted each
/// part's saved program. Another build here is a copy of the rail stub in another folder (its
/// `/proc/<pid>/exe` tells it apart as a release binary's would): `up` must start this
/// `payoutdev`'s own rail stub whether the part is down with the copy in its saved launch, or
/// healthy and running the copy.
#[tokio::test]
async fn up_runs_this_payoutdevs_build_of_our_services() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("stack");
    let stop = scopeguard(&state);
    up_ok(&state, &stack_ports());
    let ours = this_build("rail-stub");
    let other_dir = dir.path().join("other-build");
    std::fs::create_dir(&other_dir).unwrap();
    let other = other_dir.join("rail-stub");
    std::fs::copy(&ours, &other).unwrap();
    let launch_file = state.join("parts").join("rail-stub.json");
    let mut launch: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&launch_file).unwrap()).unwrap();
    launch["program"] = other.to_str().unwrap().into();
    std::fs::write(&launch_file, serde_json::to_vec_pretty(&launch).unwrap()).unwrap();

    // 1. The part is down, and its saved launch names the other build.
    let before = pids(&state);
    kill_part(before["rail-stub"]);
    let stderr = up_ok(&state, &[]);
    assert!(stderr.contains("started again: rail-stub"), "{stderr}");
    let after = pids(&state);
    assert_eq!(
        exe(after["rail-stub"]),
        ours,
        "up started the saved program, not this payoutdev's: {stderr}"
    );

    // 2. The part answers, but it runs the other build (started by hand, its pid recorded).
    kill_part(after["rail-stub"]);
    let by_hand = {
        use std::os::unix::process::CommandExt;
        Command::new(&other)
            .args(
                launch["args"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|a| a.as_str().unwrap()),
            )
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .process_group(0)
            .spawn()
            .unwrap()
    };
    let by_hand_pid = by_hand.id() as i64;
    let _kill_by_hand = KillOnDrop(by_hand_pid);
    let record_file = state.join("stack.json");
    let mut record: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&record_file).unwrap()).unwrap();
    for part in record["parts"].as_array_mut().unwrap() {
        if part["name"] == "rail-stub" {
            part["pid"] = by_hand_pid.into();
        }
    }
    std::fs::write(&record_file, serde_json::to_vec_pretty(&record).unwrap()).unwrap();
    testkit::eventually(
        std::time::Duration::from_secs(30),
        "the rail stub of the other build reported healthy",
        || async {
            let (ok, status) = status_json(&state);
            let stub = status["parts"]
                .as_array()?
                .iter()
                .find(|p| p["name"] == "rail-stub")?
                .clone();
            (ok && stub["healthy"] == true).then_some(())
        },
    )
    .await
    .unwrap();
    assert_eq!(exe(by_hand_pid), other);
    let stderr = up_ok(&state, &[]);
    assert!(
        stderr.contains(&format!("rail-stub runs {}", other.display()))
            && stderr.contains("restarting it"),
        "up says which build it replaces: {stderr}"
    );
    assert!(
        !testkit::util::pid_alive(by_hand_pid as u32),
        "the other build's rail stub was stopped: {stderr}"
    );
    let last = pids(&state);
    for (name, pid) in &after {
        if name != "rail-stub" {
            assert_eq!(last[name], *pid, "{name} kept running: {stderr}");
        }
    }
    assert_eq!(exe(last["rail-stub"]), ours, "{stderr}");
    let (ok, status) = status_json(&state);
    assert!(ok, "every part healthy after up: {status}");
    drop(stop);
}
