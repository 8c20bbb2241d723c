//! Alerting end to end, with real Prometheus and Alertmanager (Debian's packages) and the
//! project's rules (deploy/monitoring/alerts.yml), scraping a real system every second:
//! - a healthy system fires nothing but the heartbeat: every target is scraped and up (the
//!   watchers too: Prometheus, Alertmanager, the silence watch), the rules have been evaluated
//!   several times since, and Prometheus and Alertmanager hold no alert but `Watchdog`;
//! - the fault suite's stale holder (tests/src/chaos/negative.rs: holder A's grant is revoked,
//!   B claims, A's late claim is refused by the payment resource's fence) makes `FencedOut`
//!   appear in Alertmanager's API with `guard="payment_resource"`;
//! - negative control: with the `FencedOut` rule left out (test-only configuration), the same
//!   planted fault is in Prometheus (`fenced_out_total` 1) and Alertmanager never hears of it;
//! - issue 34, rows 3b/3c: a silence over a page alert pages (`PageAlertSilenced`, naming it), a
//!   silence over a ticket alert does not, and a silence over everything stops the `Watchdog`
//!   heartbeat (what an external dead man's switch pages on); the control: without the silence
//!   watch the same silence pages nobody, and `SilenceWatchBlind` fires instead;
//! - issue 34, row 3a: both APIs answer only over TLS and only to a login (an anonymous silence
//!   over everything, a fake page, a query: refused); the control: the same Alertmanager without
//!   its web configuration takes the anonymous silence and the fake page.

use std::time::Duration;

use system_tests::chaos::guards::DisableGuard;
use system_tests::chaos::negative;
use testkit::monitoring::{self, intruder, Monitoring, MonitoringOptions, Target};
use testkit::system::{System, SystemOptions};
use testkit::Stack;

/// Start-up and the first scrape of every target at a 1 s interval.
const TARGETS_UP_TIMEOUT: Duration = Duration::from_secs(30);
/// A scrape (1 s), a rule evaluation (1 s) and Alertmanager's group_wait (5 s), with margin.
const ALERT_TIMEOUT: Duration = Duration::from_secs(30);
/// Rule group evaluations to wait for before an absence of alerts means something.
const EVALUATIONS_BEFORE_ABSENCE: usize = 3;

async fn monitored_system(without_alerts: &[&str]) -> (System, Monitoring, Vec<Target>) {
    let stack = Stack::shared();
    let system = System::start(
        stack,
        SystemOptions {
            workers: 0,
            ..SystemOptions::default()
        },
    )
    .await
    .expect("system starts");
    let mut targets = monitoring::system_targets(&system);
    targets.extend(monitoring::stack_targets(stack));
    let monitoring = Monitoring::start(
        &system.dir.join("monitoring"),
        &targets,
        MonitoringOptions {
            without_alerts: without_alerts.iter().map(|s| s.to_string()).collect(),
            ..MonitoringOptions::default()
        },
    )
    .await
    .expect("prometheus and alertmanager start");
    // The watchers too (Prometheus, Alertmanager, the silence watch): the test counts their
    // `up` series beside the system's, so it waits for their first scrape as well.
    let mut scraped = targets.clone();
    scraped.extend(monitoring.watcher_targets());
    monitoring
        .wait_targets_up(&scraped, TARGETS_UP_TIMEOUT)
        .await
        .expect("every target scraped and up");
    (system, monitoring, targets)
}

/// Waits until every rule group has been evaluated `n` more times (each evaluation changes the
/// group's lastEvaluation).
async fn wait_evaluations(monitoring: &Monitoring, n: usize) {
    let mut last = monitoring.rule_group_evaluations().await.unwrap();
    assert!(!last.is_empty(), "the rule groups are loaded");
    for _ in 0..n {
        last = testkit::eventually(ALERT_TIMEOUT, "a rule evaluation of every group", || {
            let before = last.clone();
            async move {
                let now = monitoring.rule_group_evaluations().await.ok()?;
                now.iter()
                    .all(|(group, at)| before.get(group).is_some_and(|b| b != at) && !at.is_empty())
                    .then_some(now)
            }
        })
        .await
        .unwrap();
    }
}

/// Alertmanager's active alerts once the heartbeat has reached it (the pipeline delivers).
async fn heartbeat_only(monitoring: &Monitoring) -> Vec<monitoring::Alert> {
    testkit::eventually(
        ALERT_TIMEOUT,
        "the Watchdog heartbeat in Alertmanager",
        || async {
            let alerts = monitoring.alertmanager_alerts().await.ok()?;
            alerts
                .iter()
                .any(|a| a.name() == monitoring::WATCHDOG)
                .then_some(alerts)
        },
    )
    .await
    .unwrap()
}

/// The value of a query's single-series result.
async fn scalar(monitoring: &Monitoring, promql: &str) -> Option<f64> {
    let result = monitoring.query(promql).await.ok()?;
    let series = result.first()?;
    series["value"][1].as_str()?.parse().ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stale_holders_refused_write_fires_fenced_out_in_alertmanager_and_a_healthy_system_fires_nothing(
) {
    let (mut system, monitoring, targets) = monitored_system(&[]).await;

    // Healthy: every part scraped (one `up` series per target, all 1), the guards' refusal
    // counters exported at 0, several evaluations since, and not one alert anywhere.
    let up = monitoring.query("up").await.unwrap();
    assert_eq!(
        up.len(),
        targets.len() + monitoring.watcher_targets().len(),
        "one up series per target, the watchers' too: {up:?}"
    );
    assert!(up.iter().all(|s| s["value"][1] == "1"), "{up:?}");
    for guard in ["payment_resource", "rail_proxy"] {
        assert_eq!(
            scalar(
                &monitoring,
                &format!("sum(fenced_out_total{{guard=\"{guard}\"}})")
            )
            .await,
            Some(0.0),
            "{guard}'s fenced_out_total is scraped at 0"
        );
    }
    wait_evaluations(&monitoring, EVALUATIONS_BEFORE_ABSENCE).await;
    let rules = monitoring.alert_rules().await.unwrap();
    assert!(rules.contains(&"FencedOut".to_string()), "{rules:?}");
    let prometheus_alerts = monitoring.prometheus_firing().await.unwrap();
    assert_eq!(
        prometheus_alerts,
        [monitoring::WATCHDOG],
        "a healthy system fires nothing in Prometheus but the heartbeat"
    );
    let pending_or_firing = monitoring
        .query(&format!(
            "ALERTS{{alertname!=\"{}\"}}",
            monitoring::WATCHDOG
        ))
        .await
        .unwrap();
    assert!(
        pending_or_firing.is_empty(),
        "no alert even pending: {pending_or_firing:?}"
    );
    let alerts = heartbeat_only(&monitoring).await;
    assert!(
        alerts.iter().all(|a| a.name() == monitoring::WATCHDOG),
        "a healthy system leaves Alertmanager with the heartbeat alone: {alerts:?}"
    );

    // The planted stale holder: its claim is refused at the payment resource's fence.
    let report = negative::stale_holder_on(&mut system, DisableGuard::None, 1)
        .await
        .expect("the stale-holder scenario runs");
    assert!(
        !report.steps[0].stale_claim_accepted,
        "the fence refused the stale claim: {report:?}"
    );
    let fired = testkit::eventually(ALERT_TIMEOUT, "FencedOut in Alertmanager", || async {
        monitoring
            .alertmanager_alerts()
            .await
            .ok()?
            .into_iter()
            .find(|a| {
                a.name() == "FencedOut"
                    && a.labels.get("guard").map(String::as_str) == Some("payment_resource")
            })
    })
    .await
    .unwrap();
    assert_eq!(fired.status.state, "active");
    assert_eq!(fired.labels["severity"], "page");
    assert_eq!(fired.labels["operation"], "claim");
    assert_eq!(fired.labels["job"], "payment-resource");
    assert!(
        fired.annotations["summary"].contains("payment_resource"),
        "{fired:?}"
    );
    assert!(
        fired.annotations["description"].contains("First:"),
        "the runbook's first command: {fired:?}"
    );
    println!(
        "fired: {}",
        serde_json::to_string_pretty(&serde_json::json!({
            "labels": fired.labels, "annotations": fired.annotations, "state": fired.status.state,
        }))
        .unwrap()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn negative_control_without_the_fenced_out_rule_the_planted_stale_holder_never_reaches_alertmanager(
) {
    let (mut system, monitoring, _targets) = monitored_system(&["FencedOut"]).await;
    let rules = monitoring.alert_rules().await.unwrap();
    assert!(!rules.contains(&"FencedOut".to_string()), "{rules:?}");

    let report = negative::stale_holder_on(&mut system, DisableGuard::None, 1)
        .await
        .expect("the stale-holder scenario runs");
    assert!(!report.steps[0].stale_claim_accepted, "{report:?}");
    // The refusal is in Prometheus ...
    testkit::eventually(ALERT_TIMEOUT, "the refusal scraped", || async {
        (scalar(
            &monitoring,
            "sum(fenced_out_total{guard=\"payment_resource\"})",
        )
        .await?
            >= 1.0)
            .then_some(())
    })
    .await
    .unwrap();
    // ... the rules have been evaluated since, and the same plant's force-revoke (LockForceRevoked,
    // same group, same evaluations) has reached Alertmanager through the same path ...
    wait_evaluations(&monitoring, EVALUATIONS_BEFORE_ABSENCE).await;
    let alerts = testkit::eventually(
        ALERT_TIMEOUT,
        "LockForceRevoked in Alertmanager",
        || async {
            let alerts = monitoring.alertmanager_alerts().await.ok()?;
            alerts
                .iter()
                .any(|a| a.name() == "LockForceRevoked")
                .then_some(alerts)
        },
    )
    .await
    .unwrap();
    // ... and Alertmanager has no fenced-out alert: the rule is what alerts.
    assert!(alerts.iter().all(|a| a.name() != "FencedOut"), "{alerts:?}");
    assert!(monitoring
        .prometheus_firing()
        .await
        .unwrap()
        .iter()
        .all(|a| a != "FencedOut"));
}

/// Prometheus, Alertmanager and the silence watch alone (nothing else to scrape): the rules over
/// the watchers are all that is evaluated here.
async fn watchers_only(silence_watch: bool) -> (tempfile::TempDir, Monitoring) {
    let dir = tempfile::tempdir().unwrap();
    let monitoring = Monitoring::start(
        &dir.path().join("monitoring"),
        &[],
        MonitoringOptions {
            silence_watch,
            ..MonitoringOptions::default()
        },
    )
    .await
    .expect("prometheus, alertmanager and the silence watch start");
    let watchers = monitoring.watcher_targets();
    monitoring
        .wait_targets_up(&watchers, TARGETS_UP_TIMEOUT)
        .await
        .expect("the watchers scraped and up");
    (dir, monitoring)
}

/// Silences every alert whose name matches `alertname` (a regex if `is_regex`) for a day, as
/// `created_by` (with the operator's login: any operator may silence); the silence's id.
async fn silence_for_a_day(
    monitoring: &Monitoring,
    alertname: &str,
    is_regex: bool,
    created_by: &str,
) -> String {
    monitoring
        .create_silence(
            &[("alertname", alertname, is_regex)],
            created_by,
            "silenced by the alerting suite",
            Duration::from_secs(86_400),
        )
        .await
        .unwrap()
}

/// Rows 3b and 3c: an operator (any holder of the login) silences `FencedOut` for a day. The
/// silence watch sees that an active silence covers a page rule and `PageAlertSilenced` reaches
/// Alertmanager (the silence does not cover it) naming `FencedOut`; a silence over a ticket
/// alert pages nobody. A silence over everything also covers the watchers: the `Watchdog`
/// heartbeat stops, which is what the external dead man's switch pages on; expired, the heartbeat
/// fires again (row 3c's control: the silence, not something else, stopped it).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_silence_over_a_page_alert_pages_and_one_over_everything_stops_the_heartbeat() {
    let (_dir, monitoring) = watchers_only(true).await;
    heartbeat_only(&monitoring).await;

    silence_for_a_day(&monitoring, "PayoutNonTerminalTooLong", false, "ops").await;
    let id = silence_for_a_day(&monitoring, "FencedOut", false, "intruder").await;
    let paged = testkit::eventually(
        ALERT_TIMEOUT,
        "PageAlertSilenced in Alertmanager",
        || async {
            let alerts = monitoring.alertmanager_alerts().await.ok()?;
            let paged: Vec<String> = alerts
                .iter()
                .filter(|a| a.name() == "PageAlertSilenced")
                .filter_map(|a| a.labels.get("rule").cloned())
                .collect();
            (!paged.is_empty()).then_some(paged)
        },
    )
    .await
    .unwrap();
    assert_eq!(paged, ["FencedOut"], "only the page rule's silence pages");
    let covering = scalar(
        &monitoring,
        "monitoring_page_alerts_silenced{rule=\"FencedOut\"}",
    )
    .await;
    assert_eq!(covering, Some(1.0), "silence {id} covers FencedOut");
    assert_eq!(
        scalar(&monitoring, "monitoring_silences_active").await,
        Some(2.0)
    );

    // A silence over every alert covers the watchers: the heartbeat stops in Prometheus.
    let everything = silence_for_a_day(&monitoring, ".+", true, "intruder").await;
    testkit::eventually(ALERT_TIMEOUT, "the Watchdog stops", || async {
        let firing = monitoring.prometheus_firing().await.ok()?;
        (!firing.iter().any(|a| a == monitoring::WATCHDOG)).then_some(())
    })
    .await
    .unwrap();
    // Row 3c's control: the silence, expired, is what stopped it: the heartbeat fires again.
    monitoring.expire_silence(&everything).await.unwrap();
    testkit::eventually(ALERT_TIMEOUT, "the Watchdog fires again", || async {
        let firing = monitoring.prometheus_firing().await.ok()?;
        firing
            .iter()
            .any(|a| a == monitoring::WATCHDOG)
            .then_some(())
    })
    .await
    .unwrap();
}

/// The control of rows 3b/3c: without the silence watch, the same silence over `FencedOut`
/// pages nobody (no `PageAlertSilenced` ever), and what fires instead is `SilenceWatchBlind`,
/// with no heartbeat: the rule that notices a missing watch is what keeps this from passing
/// silently.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn negative_control_without_the_silence_watch_a_silenced_page_pages_nobody() {
    let (_dir, monitoring) = watchers_only(false).await;
    silence_for_a_day(&monitoring, "FencedOut", false, "intruder").await;
    let firing = testkit::eventually(ALERT_TIMEOUT, "SilenceWatchBlind", || async {
        let firing = monitoring.prometheus_firing().await.ok()?;
        firing
            .iter()
            .any(|a| a == "SilenceWatchBlind")
            .then_some(firing)
    })
    .await
    .unwrap();
    wait_evaluations(&monitoring, EVALUATIONS_BEFORE_ABSENCE).await;
    let firing_now = monitoring.prometheus_firing().await.unwrap();
    assert!(
        !firing_now
            .iter()
            .any(|a| a == "PageAlertSilenced" || a == monitoring::WATCHDOG),
        "nobody watches: no page for the silence, no heartbeat: {firing:?} / {firing_now:?}"
    );
}

/// The JSON answer of a request that must succeed.
async fn json_of(request: reqwest::RequestBuilder) -> serde_json::Value {
    let response = request.send().await.unwrap();
    assert!(response.status().is_success(), "{}", response.status());
    response.json().await.unwrap()
}

/// Row 3a: Prometheus and Alertmanager answer only over TLS, and only to a login. From the
/// network, with no login: plain HTTP is refused (400, "client sent an HTTP request to an HTTPS
/// server"); over TLS, the silence over everything and the fake page are refused 401, and so are
/// a Prometheus query and a wrong password; no silence and no fake alert is there afterwards. The
/// operator's login reads both. (The control is the next test.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_monitoring_apis_refuse_an_anonymous_caller() {
    let (_dir, monitoring) = watchers_only(true).await;
    let plain = reqwest::Client::new();
    let over_http = intruder::attack(
        &plain,
        &format!("http://127.0.0.1:{}", monitoring.alertmanager_port),
    )
    .await;
    // Go answers 400 and closes (or the close resets the connection first): either way nothing
    // was taken (checked below), but a refused connection would mean nothing listened.
    for answer in &over_http {
        assert!(
            matches!(
                answer,
                intruder::Answer::Status(400) | intruder::Answer::LostAfterSending(_)
            ),
            "plain HTTP to a TLS-only API: {over_http:?}"
        );
    }

    let anonymous = monitoring::Api::with_login(
        &monitoring.dir,
        monitoring.prometheus_port,
        monitoring.alertmanager_port,
        None,
    )
    .unwrap();
    let tls = reqwest::Client::builder()
        .tls_built_in_root_certs(false)
        .add_root_certificate(
            reqwest::Certificate::from_pem(
                &std::fs::read(monitoring::ca_file(&monitoring.dir)).unwrap(),
            )
            .unwrap(),
        )
        .build()
        .unwrap();
    let over_tls = intruder::attack(&tls, &monitoring.alertmanager_url("")).await;
    assert_eq!(
        over_tls,
        [intruder::Answer::Status(401), intruder::Answer::Status(401)],
        "over TLS without a login"
    );
    for (who, api) in [
        ("no login", anonymous),
        (
            "the operator with a wrong password",
            monitoring::Api::with_login(
                &monitoring.dir,
                monitoring.prometheus_port,
                monitoring.alertmanager_port,
                Some((monitoring::OPERATOR_USER.into(), "not-the-password".into())),
            )
            .unwrap(),
        ),
    ] {
        let query = api
            .get(&api.prometheus_url("/api/v1/query?query=up"))
            .send()
            .await
            .unwrap();
        assert_eq!(query.status().as_u16(), 401, "{who}: a Prometheus query");
        let silence = api
            .create_silence(
                &[("alertname", ".+", true)],
                "intruder",
                "",
                Duration::from_secs(60),
            )
            .await;
        assert!(
            silence
                .as_ref()
                .is_err_and(|e| e.to_string().contains("401")),
            "{who}: a silence: {silence:?}"
        );
    }

    // The operator reads both, and nothing the attempts sent is there.
    let status = monitoring
        .get(&monitoring.alertmanager_url("/api/v2/status"))
        .send()
        .await
        .unwrap();
    assert_eq!(status.status().as_u16(), 200);
    let silences = json_of(monitoring.get(&monitoring.alertmanager_url("/api/v2/silences"))).await;
    assert_eq!(silences, serde_json::json!([]), "no silence was created");
    let alerts = heartbeat_only(&monitoring).await;
    assert!(
        alerts.iter().all(|a| a.name() != "FencedOut"),
        "no fake page was accepted: {alerts:?}"
    );
}

/// The control of row 3a: the same Alertmanager, its configuration and version, started without
/// its web configuration (as every deployment ran it before issue 34) takes both anonymous
/// requests: the silence over everything until 2099 and the fake page.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn negative_control_without_its_web_configuration_alertmanager_takes_an_anonymous_silence() {
    let dir = tempfile::tempdir().unwrap();
    let port = testkit::util::free_port();
    let alertmanager = testkit::process::ManagedProcess::start(
        monitoring::alertmanager_spec(dir.path(), port, None).unwrap(),
    )
    .unwrap();
    let base = format!("http://127.0.0.1:{port}");
    let plain = reqwest::Client::new();
    testkit::eventually(TARGETS_UP_TIMEOUT, "alertmanager ready", || async {
        let r = plain.get(format!("{base}/-/ready")).send().await.ok()?;
        r.status().is_success().then_some(())
    })
    .await
    .unwrap_or_else(|e| panic!("{e}: {}", alertmanager.log_path().display()));
    let answers = intruder::attack(&plain, &base).await;
    assert_eq!(
        answers,
        [intruder::Answer::Status(200), intruder::Answer::Status(200)],
        "an open Alertmanager takes both"
    );
    let silences = json_of(plain.get(format!("{base}/api/v2/silences"))).await;
    assert!(intruder::took_a_silence(&silences), "{silences}");
}

/// `(rule, severity)` of every row of the README's alerts table (a row may name several rules).
fn readme_alerts_table(readme: &str) -> Vec<(String, String)> {
    let table = readme
        .split_once("| alert | severity | means | first command |")
        .map(|(_, rest)| rest)
        .expect("the README has its alerts table");
    let mut out = Vec::new();
    for row in table.lines().skip(2).take_while(|l| l.starts_with('|')) {
        let cells: Vec<&str> = row.split('|').map(str::trim).collect();
        let (names, severity) = (cells[1], cells[2]);
        for name in names.split(',') {
            out.push((
                name.trim().trim_matches('`').to_string(),
                severity.to_string(),
            ));
        }
    }
    out
}

/// The README's alerts table, which an operator reads when paged, names every rule of
/// `alerts.yml` with the severity the rule carries, and nothing that is not a rule: a rule added,
/// renamed or re-graded without its row fails here.
#[test]
fn the_readme_alerts_table_names_every_rule_with_its_severity() {
    let rules = std::fs::read_to_string(monitoring::config_dir().join("alerts.yml")).unwrap();
    let readme =
        std::fs::read_to_string(testkit::util::workspace_root().join("README.md")).unwrap();
    let mut rules = monitoring::rules_with_severity(&rules);
    let mut table = readme_alerts_table(&readme);
    assert!(rules.len() > 40, "the rules were read: {rules:?}");
    assert!(
        rules.iter().all(|(_, s)| !s.is_empty()),
        "every rule has a severity: {rules:?}"
    );
    rules.sort();
    table.sort();
    assert_eq!(table, rules, "README.md's alerts table against alerts.yml");
}

/// The table's parse reads what a row says: every name of a row that names several, the severity
/// as written, and the table's end at its first non-row line (so a re-graded or missing row
/// reaches the comparison above as a difference).
#[test]
fn the_readme_alerts_table_parse_reads_each_row_and_stops_at_the_tables_end() {
    let readme = "intro\n\
        | alert | severity | means | first command |\n\
        |---|---|---|---|\n\
        | `A`, `B` | page | a | x |\n\
        | `C` | ticket | c | y |\n\
        \n\
        | `D` | page | after the table | z |\n";
    assert_eq!(
        readme_alerts_table(readme),
        [("A", "page"), ("B", "page"), ("C", "ticket")]
            .map(|(n, s)| (n.to_string(), s.to_string()))
            .to_vec()
    );
}
