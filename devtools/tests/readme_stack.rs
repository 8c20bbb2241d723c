//! The local stack started exactly as the README starts it, and its alerting seen working end to
//! end: `payoutdev stack up` with no `--state-dir` (the default, relative `.state/stack`, resolved
//! against the working directory), a main job whose summary reads the alerting path, then one
//! safety signal (a stale token refused at the payment resource's fence) that must reach that
//! stack's Alertmanager as `FencedOut`.
//!
//! The tests' other stacks are all given absolute state directories, which is why a local stack
//! whose Prometheus loaded no rule and scraped nothing (its configuration named them relative to
//! its own folder) passed every test while no alert could fire where a new user looks.
//!
//! The working directory is a fresh folder standing for the clone's root, not the checkout itself:
//! a developer's own stack lives in the checkout's `.state/stack` and must not be taken over.
//! Ports come from the environment variables the README documents, so the test runs beside others.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use lock_client::{Acquired, LockClient};
use payment_client::model::{Fence, NewPayout};
use payment_client::{PaymentClient, PaymentError};
use payout_domain::{AccountId, AmountMinor, BeneficiaryRef, Currency, PayoutId, PayoutState};
use testkit::pki::{Pki, Role};

mod common;
use common::stack_ports;

/// `stack up` waits for every part itself; this bounds a payout's way through the stack's
/// workers on a loaded machine.
const PAYOUT_LEAVES_PENDING_WITHIN: Duration = Duration::from_secs(120);
/// A scrape and a rule evaluation at the stack's 5 s interval, and Prometheus's delivery to
/// Alertmanager, on a loaded two-core machine.
const ALERT_WITHIN: Duration = Duration::from_secs(120);
/// A reload of Prometheus's configuration (SIGHUP) reaching what `status` reads.
const RELOAD_SEEN_WITHIN: Duration = Duration::from_secs(60);
/// Two of the stack's 5 s scrapes of every target, with margin for a loaded machine.
const HEALTHY_WITHIN: Duration = Duration::from_secs(30);
const LEASE: Duration = Duration::from_secs(30);
const ACQUIRE_WAIT: Duration = Duration::from_secs(30);

/// `payoutdev` run in `root` as a user runs it there: no state directory given.
fn payoutdev(root: &Path, args: &[&str], ports: &[(&str, u16)]) -> std::process::Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_payoutdev"));
    cmd.args(args)
        .current_dir(root)
        .env_remove("PAYOUT_STATE_DIR");
    for (var, port) in ports {
        cmd.env(var, port.to_string());
    }
    cmd.output().expect("payoutdev runs")
}

fn ok(out: &std::process::Output, what: &str) -> String {
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{what} failed: {stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// Brings the stack down even when an assertion fails.
struct Down(PathBuf);

impl Drop for Down {
    fn drop(&mut self) {
        let _ = payoutdev(&self.0, &["stack", "down"], &[]);
    }
}

fn part<'a>(status: &'a serde_json::Value, name: &str) -> &'a serde_json::Value {
    status["parts"]
        .as_array()
        .and_then(|parts| parts.iter().find(|p| p["name"] == name))
        .unwrap_or_else(|| panic!("no {name} in {status}"))
}

fn status(root: &Path) -> (bool, serde_json::Value) {
    let out = payoutdev(root, &["stack", "status", "--json"], &[]);
    let value = serde_json::from_slice(&out.stdout).expect("status --json is JSON");
    (out.status.success(), value)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_readme_stack_with_its_relative_state_dir_loads_its_rules_and_a_stale_token_pages() {
    let root = tempfile::tempdir().unwrap();
    let root = root.path().to_path_buf();
    let ports = stack_ports();
    let base = ports[5].1;
    let down = Down(root.clone());
    ok(&payoutdev(&root, &["stack", "up"], &ports), "stack up");
    let state = root.join(".state/stack");
    assert!(
        state.join("stack.json").exists(),
        "the default state directory is the relative .state/stack"
    );

    // Prometheus names its rules and targets by absolute paths, and `status` judges it by them:
    // every rule loaded, every target up (`up` waited for it).
    let config = std::fs::read_to_string(state.join("monitoring/prometheus.yml")).unwrap();
    let monitoring = state.canonicalize().unwrap().join("monitoring");
    assert!(
        config.contains(&format!("  - {}/alerts.yml\n", monitoring.display())),
        "{config}"
    );
    assert!(
        config.contains(&format!("[\"{}/targets/*.json\"]", monitoring.display())),
        "{config}"
    );
    // `up` waited for every part; a target's health is its last scrape's, so one scrape of a
    // busy process may fail between two looks: wait (bounded) for the path as a whole.
    let status_now = testkit::eventually(HEALTHY_WITHIN, "every part healthy", || async {
        let (healthy, s) = status(&root);
        healthy.then_some(s)
    })
    .await
    .unwrap_or_else(|e| panic!("{e}: {}", status(&root).1));
    assert_eq!(part(&status_now, "prometheus")["healthy"], true);
    let api =
        testkit::monitoring::Api::open(&state.join("monitoring"), base + 30, base + 31).unwrap();
    let health = testkit::eventually(HEALTHY_WITHIN, "rules loaded and targets up", || async {
        let h = api.alerting_health(&state.join("monitoring")).await.ok()?;
        h.problems().is_empty().then_some(h)
    })
    .await
    .unwrap();
    assert!(health.rules_loaded > 20, "{health:?}");
    assert!(health.targets_expected.len() >= 10, "{health:?}");
    // A second `up` keeps every part: nothing the first one saved names a relative path.
    let again = payoutdev(&root, &["stack", "up"], &[]);
    let said = String::from_utf8_lossy(&again.stderr);
    ok(&again, "a second stack up");
    assert!(said.contains("stack already up"), "{said}");

    // The main job's summary says how the alerting path stands, and that nothing fires.
    let run = ok(
        &payoutdev(
            &root,
            &["run", "--payouts", "6", "--accounts", "2", "--json"],
            &[],
        ),
        "the main job",
    );
    let summary: serde_json::Value = serde_json::from_str(run.trim()).expect("one JSON object");
    let alerting = &summary["alerting"];
    assert_eq!(alerting["dark"], serde_json::json!([]), "{summary}");
    assert_eq!(
        alerting["targets_up"], alerting["targets"],
        "every target up: {summary}"
    );
    assert_eq!(
        alerting["active_in_alertmanager"],
        serde_json::json!([]),
        "a clean run pages nobody: {summary}"
    );

    // One safety signal: a genuine but superseded grant presented to the payment resource.
    let pki = Pki::in_dir(&state.join("system")).unwrap();
    let url = |offset: u16| format!("https://127.0.0.1:{}", base + offset);
    let lock = LockClient::connect(&url(1), &pki.tls(Role::Worker))
        .await
        .unwrap();
    let worker = PaymentClient::connect(&url(2), &pki.tls(Role::Worker))
        .await
        .unwrap();
    let fixture = PaymentClient::connect(&url(2), &pki.tls(Role::Fixture))
        .await
        .unwrap();
    let account = AccountId::parse("readme-stale-a").unwrap();
    let payout_id = PayoutId::parse("readme-stale-p").unwrap();
    let eur = Currency::parse("EUR").unwrap();
    // Funded under the stack's own registered operator's signature.
    testkit::grants::OperatorKey::in_dir(&state.join("system"))
        .unwrap()
        .open_account(&fixture, &account, &eur, 100_000)
        .await
        .unwrap();
    // The stale holder: granted the account's lock first, then it lets go (as a paused worker
    // whose lease ran out would) ...
    let session = lock
        .open_session("readme-stale-holder", LEASE)
        .await
        .unwrap();
    let Acquired::Granted(stale) = session
        .acquire(&payout_domain::lock_key(&account), ACQUIRE_WAIT)
        .await
        .unwrap()
    else {
        panic!("the stale holder is granted the free key");
    };
    let stale_fence = Fence::new(stale.owner(), stale.token())
        .unwrap()
        .signed(stale.key(), stale.signature().clone());
    stale.release().await.unwrap();
    session.close().await.unwrap();
    // ... the payout's own workflow takes the lock next (a later token) and claims it ...
    fixture
        .create_payout(&NewPayout {
            payout_id: payout_id.clone(),
            account_id: account.clone(),
            amount_minor: AmountMinor::new(1_000).unwrap(),
            currency: eur.clone(),
            beneficiary_ref: BeneficiaryRef::parse("ben-readme").unwrap(),
        })
        .await
        .unwrap();
    testkit::eventually(
        PAYOUT_LEAVES_PENDING_WITHIN,
        "the payout's workflow claims it",
        || async {
            let p = worker.get_payout(&payout_id).await.ok()?;
            (p.payout.state != PayoutState::Pending).then_some(())
        },
    )
    .await
    .unwrap();
    // ... and the stale holder carries on: the fence refuses it.
    let refused = worker.claim(&payout_id, &stale_fence).await;
    assert!(
        matches!(refused, Err(PaymentError::FencedOut { .. })),
        "the stale claim is fenced out: {refused:?}"
    );

    // The page reaches this stack's Alertmanager.
    let fired = testkit::eventually(
        ALERT_WITHIN,
        "FencedOut in the stack's Alertmanager",
        || async {
            api.alertmanager_alerts().await.ok()?.into_iter().find(|a| {
                a.name() == "FencedOut"
                    && a.labels.get("guard").map(String::as_str) == Some("payment_resource")
            })
        },
    )
    .await
    .unwrap();
    assert_eq!(fired.labels["severity"], "page", "{fired:?}");
    assert_eq!(fired.labels["job"], "payment-resource", "{fired:?}");

    // Negative control: the configuration as it was rendered before (the default state
    // directory's paths, relative), reloaded into the running Prometheus. It still answers its
    // readiness check, but loads no rule and discovers no target; `status` must call it
    // unhealthy and say why.
    let relative = config.replace(
        &format!("{}/", monitoring.display()),
        ".state/stack/monitoring/",
    );
    assert!(relative.contains("  - .state/stack/monitoring/alerts.yml\n"));
    std::fs::write(state.join("monitoring/prometheus.yml"), relative).unwrap();
    let prometheus_pid = part(&status(&root).1, "prometheus")["pid"]
        .as_i64()
        .unwrap();
    // SAFETY: SIGHUP (reload the configuration) to the Prometheus this test's stack started.
    unsafe {
        libc::kill(prometheus_pid as i32, libc::SIGHUP);
    }
    let (healthy, dark) = testkit::eventually(
        RELOAD_SEEN_WITHIN,
        "status reports the reloaded Prometheus",
        || async {
            let (healthy, s) = status(&root);
            let problem = part(&s, "prometheus")["problem"].as_str()?.to_string();
            problem
                .contains("alert rules loaded")
                .then_some((healthy, s))
        },
    )
    .await
    .unwrap();
    assert!(!healthy, "a dark Prometheus fails status: {dark}");
    let prometheus = part(&dark, "prometheus");
    assert_eq!(prometheus["healthy"], false, "{dark}");
    let problem = prometheus["problem"].as_str().unwrap();
    assert!(problem.contains("0 of "), "{problem}");
    drop(down);
}
