//! The intake (issue 18, section 4): CreatePayout stages the workflow's start in the payout's own
//! transaction, and the starter delivers it, so a created payout's workflow `payout-{id}` starts
//! without anyone starting it: through a starter killed between the commit and the start, and a
//! Temporal that is down at the create. A real paydb, the payment resource's gRPC API (in-process,
//! its real authorisation table: the intake role creates), a real Temporal dev server, and the
//! starter in-process or as the dispatcher binary. No worker runs: a started workflow stays
//! RUNNING on its task queue, which is all these tests ask of Temporal.

use std::time::{Duration, Instant};

use outbox_dispatcher::starts::{StarterConfig, OUTCOME_STARTED};
use payment_client::model::NewPayout;
use payment_client::{PaymentClient, PaymentError};
use payment_resource::{Store, StoreOptions};
use payout_activities::types::AmbiguityPolicy;
use payout_domain::{AccountId, AmountMinor, BeneficiaryRef, Currency, PayoutId};
use service_kit::{Metrics, Shutdown};
use sqlx::PgPool;
use temporalio_client::errors::WorkflowInteractionError;
use temporalio_client::{Client, UntypedWorkflow, WorkflowDescribeOptions};
use testkit::pki::{tls, Role};
use testkit::temporal::TemporalDev;
use testkit::{eventually, PgServer, Stack};

/// Every bounded wait of this suite: a start takes milliseconds; a restarted Temporal seconds.
const WAIT: Duration = Duration::from_secs(60);

/// The payment resource in-process on paydb `url`, as a deployment serves it (its own table:
/// only the intake and operator roles create payouts; the fixture path on for the accounts).
struct Intake {
    /// Role intake: CreatePayout as an integrator calls it.
    client: PaymentClient,
    /// Role fixture: funded accounts.
    fixture: PaymentClient,
    _stop: tokio::sync::watch::Sender<bool>,
}

async fn intake(url: &str, options: StoreOptions) -> Intake {
    let pool = service_kit::connect_pg(url).await.expect("pool");
    payment_resource::migrate(&pool).await.expect("migrations");
    let metrics = Metrics::default();
    let store = Store::new(pool, options, &metrics);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!("https://{}", listener.local_addr().unwrap());
    let (shutdown, stop) = Shutdown::new();
    let front = payment_resource::Front::new(tls(Role::PaymentResource), metrics.clone())
        .with_fixture_accounts(true);
    tokio::spawn(async move {
        payment_resource::serve(listener, store, front, shutdown)
            .await
            .expect("serve")
    });
    let connect = |role| {
        let endpoint = endpoint.clone();
        async move {
            PaymentClient::connect(&endpoint, &tls(role))
                .await
                .expect("connect")
        }
    };
    Intake {
        client: connect(Role::Intake).await,
        fixture: connect(Role::Fixture).await,
        _stop: stop,
    }
}

fn options() -> StoreOptions {
    StoreOptions::without_grant_keys()
        .with_operator_keys(testkit::grants::test_operator().verifier())
}

impl Intake {
    async fn account(&self, id: &str) -> AccountId {
        let account = AccountId::parse(id).unwrap();
        testkit::grants::test_operator()
            .open_account(&self.fixture, &account, &eur(), 1_000_000)
            .await
            .expect("open account");
        account
    }

    async fn create(&self, id: &str, account: &AccountId, amount: i64) -> Result<(), PaymentError> {
        self.client
            .create_payout(&new_payout(id, account, amount))
            .await
            .map(|_| ())
    }
}

fn eur() -> Currency {
    Currency::parse("EUR").unwrap()
}

fn new_payout(id: &str, account: &AccountId, amount: i64) -> NewPayout {
    NewPayout {
        payout_id: PayoutId::parse(id).unwrap(),
        account_id: account.clone(),
        amount_minor: AmountMinor::new(amount).unwrap(),
        currency: eur(),
        beneficiary_ref: BeneficiaryRef::parse("ben-1").unwrap(),
    }
}

/// The starter's configuration for one test: its own task queue (nobody polls it), quick retries.
fn starter_config(temporal: &TemporalDev, task_queue: &str, instance: &str) -> StarterConfig {
    let target = payout_workflows::client::TemporalArgs::profile_of(
        temporal.clients_file(),
        Role::OutboxDispatcher.name(),
    )
    .resolve()
    .expect("a Temporal target");
    let mut config = StarterConfig::new(target, task_queue, AmbiguityPolicy::default(), instance);
    config.backoff_base_ms = 100;
    config.backoff_max_ms = 500;
    config
}

/// The starter in-process until the returned sender is dropped.
fn spawn_starter(
    pool: PgPool,
    config: StarterConfig,
) -> (Metrics, tokio::sync::watch::Sender<bool>) {
    let metrics = Metrics::default();
    let starter = outbox_dispatcher::starts::Starter::new(pool, config, &metrics);
    let (shutdown, stop) = Shutdown::new();
    tokio::spawn(async move { starter.run(shutdown.wait()).await });
    (metrics, stop)
}

/// An operator's client through the Temporal front.
async fn temporal_client(temporal: &TemporalDev) -> Client {
    let args = payout_workflows::client::TemporalArgs::profile_of(
        temporal.clients_file(),
        Role::Operator.name(),
    );
    payout_workflows::client::connect_configured(&args, "starts-test")
        .await
        .expect("Temporal client")
}

/// `payout-{id}`'s current run id, if Temporal has the workflow.
async fn run_of(temporal: &Client, payout_id: &str) -> Option<String> {
    let handle = temporal.get_workflow_handle::<UntypedWorkflow>(format!("payout-{payout_id}"));
    match handle.describe(WorkflowDescribeOptions::default()).await {
        Ok(d) => Some(d.run_id().to_string()),
        Err(WorkflowInteractionError::NotFound(_)) => None,
        Err(e) => panic!("describing payout-{payout_id}: {e}"),
    }
}

/// Bounded poll until `payout-{id}` exists in Temporal; its run id.
async fn started(temporal: &Client, payout_id: &str) -> String {
    eventually(WAIT, &format!("payout-{payout_id} started"), || async {
        run_of(temporal, payout_id).await
    })
    .await
    .unwrap()
}

/// [`started`], naming what the starters logged if it does not happen.
async fn started_or_logs(
    temporal: &Client,
    payout_id: &str,
    starters: &[&testkit::ManagedProcess],
) {
    let found = eventually(WAIT, &format!("payout-{payout_id} started"), || async {
        run_of(temporal, payout_id).await
    })
    .await;
    if let Err(e) = found {
        let logs: Vec<String> = starters
            .iter()
            .map(|p| format!("--- {}\n{}", p.name(), p.log_tail(40)))
            .collect();
        panic!("{e}\n{}", logs.join("\n"));
    }
}

/// The detective question the negative control must answer: PENDING payouts whose workflow
/// Temporal does not know (nobody will ever pay them).
async fn stranded(paydb: &PgPool, temporal: &Client) -> Vec<String> {
    let pending: Vec<String> =
        sqlx::query_scalar("SELECT id FROM payout WHERE state = 'PENDING' ORDER BY id")
            .fetch_all(paydb)
            .await
            .unwrap();
    let mut stranded = Vec::new();
    for id in pending {
        if run_of(temporal, &id).await.is_none() {
            stranded.push(id);
        }
    }
    stranded
}

/// (started_at set, start_outcome, attempts) of a payout's staged start, if one is staged.
async fn staged(paydb: &PgPool, payout_id: &str) -> Option<(bool, Option<String>, i32)> {
    sqlx::query_as(
        "SELECT started_at IS NOT NULL, start_outcome, attempts FROM workflow_start WHERE payout_id = $1",
    )
    .bind(payout_id)
    .fetch_optional(paydb)
    .await
    .unwrap()
}

/// [`staged`] once the row is marked started. The starter marks it after Temporal has answered
/// the start, so a test that has just seen the workflow in Temporal can read the row before the
/// mark: a clean-clone CI run read `(false, None)` right after `started` found the workflow.
async fn marked(paydb: &PgPool, payout_id: &str) -> Option<(bool, Option<String>, i32)> {
    eventually(WAIT, &format!("{payout_id}'s start marked"), || async {
        staged(paydb, payout_id)
            .await
            .filter(|(started, _, _)| *started)
    })
    .await
    .ok()
}

async fn last_error(paydb: &PgPool, payout_id: &str) -> Option<String> {
    sqlx::query_scalar("SELECT last_error FROM workflow_start WHERE payout_id = $1")
        .bind(payout_id)
        .fetch_one(paydb)
        .await
        .unwrap()
}

fn counter(metrics: &Metrics, line_prefix: &str) -> f64 {
    metrics
        .render()
        .lines()
        .find(|l| l.starts_with(line_prefix))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}

async fn fresh_paydb(stack: &Stack) -> (String, PgPool) {
    let url = stack.fresh_db(PgServer::Main).await;
    let pool = PgPool::connect(&url).await.unwrap();
    (url, pool)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn create_starts_the_workflow_and_a_second_create_starts_nothing() {
    let stack = Stack::shared();
    let temporal_dev = stack.temporal();
    let (url, paydb) = fresh_paydb(stack).await;
    let intake = intake(&url, options()).await;
    let temporal = temporal_client(temporal_dev).await;
    let queue = format!("starts-{}", stack.unique_prefix("q").replace('/', "-"));
    let (metrics, _starter) = spawn_starter(
        paydb.clone(),
        starter_config(temporal_dev, &queue, "starter-1"),
    );
    let account = intake.account("acct-s1").await;

    // One call; nobody starts the workflow; it starts.
    let submitted = Instant::now();
    intake.create("po-s1", &account, 500).await.unwrap();
    let run = started(&temporal, "po-s1").await;
    eprintln!(
        "CreatePayout returned to payout-po-s1 found in Temporal: {} ms (bounded poll of describe)",
        submitted.elapsed().as_millis()
    );
    assert_eq!(
        marked(&paydb, "po-s1").await,
        Some((true, Some(OUTCOME_STARTED.to_string()), 1)),
        "delivered once, marked, not deleted (last error: {:?})",
        last_error(&paydb, "po-s1").await
    );

    // The same payout again: the same answer, nothing staged, the same run.
    intake.create("po-s1", &account, 500).await.unwrap();
    // A different payload under the same id: refused, nothing written.
    let refused = intake.create("po-s1", &account, 501).await;
    assert!(
        matches!(
            refused,
            Err(PaymentError::PayoutExistsWithDifferentContent { .. })
        ),
        "{refused:?}"
    );
    // A later payout's start is delivered after both: the starter has seen whatever they staged.
    intake.create("po-s2", &account, 700).await.unwrap();
    started(&temporal, "po-s2").await;
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM workflow_start")
        .fetch_one(&paydb)
        .await
        .unwrap();
    assert_eq!(rows, 2, "one staged start per payout");
    assert_eq!(
        run_of(&temporal, "po-s1").await.as_deref(),
        Some(run.as_str()),
        "the second create started no new run"
    );
    assert_eq!(
        counter(&metrics, "workflow_starts_total{outcome=\"started\"}"),
        2.0
    );
    assert_eq!(
        counter(
            &metrics,
            "workflow_starts_total{outcome=\"already_started\"}"
        ),
        0.0,
        "nothing was started twice"
    );
    // The workflow runs with the standard options: a caller that still starts it itself is
    // told it exists (which it must treat as success), and no second run appears.
    let input = payout_activities::types::PayoutInput {
        payout_id: PayoutId::parse("po-s1").unwrap(),
        account_id: account.clone(),
        amount_minor: AmountMinor::new(500).unwrap(),
        currency: eur(),
        beneficiary_ref: BeneficiaryRef::parse("ben-1").unwrap(),
        ambiguity: AmbiguityPolicy::default(),
    };
    let again = payout_workflows::client::start_payout(&temporal, &queue, &input).await;
    assert!(
        matches!(
            again,
            Err(payout_workflows::client::PayoutClientError::AlreadyStarted { .. })
        ),
        "{again:?}"
    );
    assert!(stranded(&paydb, &temporal).await.is_empty());
}

/// Creates payouts while the starter is dead (one left claimed by the dead instance, as a kill
/// mid-round leaves it), restarts the starter binary, and returns the payouts Temporal then
/// knows nothing of. `stage`: CreatePayout stages the start (the product); off, it commits the
/// payout row alone (the negative control).
async fn killed_starter_leaves_stranded(stage: bool) -> Vec<String> {
    // Both runs of this scenario share the test binary's Temporal: ids of their own.
    let p = if stage { "po-k" } else { "po-n" };
    let id = |n: u32| format!("{p}{n}");
    let stack = Stack::shared();
    let temporal_dev = stack.temporal();
    let (url, paydb) = fresh_paydb(stack).await;
    let intake = intake(&url, options()).await;
    let unstaged = if stage {
        None
    } else {
        Some(intake_on_same_db(&url).await)
    };
    let temporal = temporal_client(temporal_dev).await;
    let queue = format!("starts-{}", stack.unique_prefix("q").replace('/', "-"));
    let dir = tempfile::tempdir().unwrap();
    let spawn = |instance: &str| {
        let spec = testkit::ProcessSpec::new(
            instance,
            env!("CARGO_BIN_EXE_outbox-dispatcher"),
            dir.path().join(format!("{instance}.log")),
        )
        .args(["--database-url", &url, "run", "--instance-id", instance])
        // The GL is not this suite's: its deliveries wait; the starts do not depend on them.
        .args(["--gl-endpoint", "https://127.0.0.1:9"])
        .args([
            "--metrics-listen",
            &format!("127.0.0.1:{}", testkit::free_port()),
        ])
        .args(["--temporal-address", &temporal_dev.address()])
        .envs(temporal_dev.env(Role::OutboxDispatcher))
        .args(["--payout-task-queue", &queue])
        .args(
            testkit::pki::shared()
                .issue(Role::OutboxDispatcher, instance)
                .unwrap()
                .to_args(),
        );
        testkit::ManagedProcess::start(spec).unwrap()
    };
    let first = spawn("starter-a");
    let account = intake.account(&format!("acct-{p}")).await;
    intake.create(&id(1), &account, 100).await.unwrap();
    started_or_logs(&temporal, &id(1), &[&first]).await;
    // The first start also marked delivered before the kill: a kill between Temporal's answer
    // and the mark would leave it claimed by the dead instance for the whole claim lease (60 s,
    // as long as this test waits), which is the scenario of the third payout below, not this one.
    eventually(WAIT, "the first start marked delivered", || async {
        staged(&paydb, &id(1))
            .await
            .and_then(|(started, _, _)| started.then_some(()))
    })
    .await
    .unwrap();

    // Killed: what commits now has nobody to start it.
    first.kill().unwrap();
    let creator = unstaged.as_ref().unwrap_or(&intake);
    creator.create(&id(2), &account, 200).await.unwrap();
    creator.create(&id(3), &account, 300).await.unwrap();
    // The third payout's start claimed by the dead instance (a kill mid-round): its lease must run out.
    sqlx::query(
        "UPDATE workflow_start SET claimed_by = 'starter-a', claim_expires_at = now() + interval '2 seconds',
                attempts = attempts + 1 WHERE payout_id = $1",
    )
    .bind(id(3))
    .execute(&paydb)
    .await
    .unwrap();

    let second = spawn("starter-b");
    // A payout created after the restart, staged: once its workflow exists (and the dead
    // instance's lease has run out), the restarted starter has been through every earlier row.
    intake.create(&id(4), &account, 400).await.unwrap();
    started_or_logs(&temporal, &id(4), &[&first, &second]).await;
    eventually(
        WAIT,
        "every claim of the dead instance expired and retried",
        || async {
            let held: i64 =
                sqlx::query_scalar("SELECT count(*) FROM workflow_start WHERE started_at IS NULL")
                    .fetch_one(&paydb)
                    .await
                    .ok()?;
            (held == 0).then_some(())
        },
    )
    .await
    .unwrap_or_else(|e| {
        // What is left and what the restarted starter said: the failure names its cause.
        let rows = start_rows(&paydb);
        let log = std::fs::read_to_string(dir.path().join("starter-b.log")).unwrap_or_default();
        let tail: Vec<&str> = log.lines().rev().take(30).collect();
        panic!(
            "{e}: workflow_start rows {rows:?}; starter-b's last log lines (newest first):\n{}",
            tail.join("\n")
        )
    });
    stranded(&paydb, &temporal).await
}

/// (payout, attempts, claimed by, last error, started) of every staged start, read on a thread
/// of its own (called from a failing assertion's closure, outside any async context).
type StartRow = (String, i32, Option<String>, Option<String>, bool);

fn start_rows(paydb: &PgPool) -> Vec<StartRow> {
    let url = (*paydb.connect_options()).clone();
    std::thread::spawn(move || {
        tokio::runtime::Runtime::new()
            .unwrap()
            .block_on(async move {
                let pool = sqlx::PgPool::connect_with(url).await.unwrap();
                sqlx::query_as(
                    "SELECT payout_id, attempts, claimed_by, last_error, started_at IS NOT NULL \
                 FROM workflow_start ORDER BY payout_id",
                )
                .fetch_all(&pool)
                .await
                .unwrap()
            })
    })
    .join()
    .unwrap()
}

/// A second payment resource on the same paydb whose CreatePayout stages nothing (the
/// negative control's switch, in test code only).
async fn intake_on_same_db(url: &str) -> Intake {
    intake(url, options().without_start_staging_for_tests()).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn starter_killed_between_commit_and_start_starts_it_on_restart() {
    let stranded = killed_starter_leaves_stranded(true).await;
    assert!(stranded.is_empty(), "stranded payouts: {stranded:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn negative_control_without_staging_the_killed_starter_strands_the_payout() {
    let stranded = killed_starter_leaves_stranded(false).await;
    assert_eq!(
        stranded,
        vec!["po-n2".to_string(), "po-n3".to_string()],
        "without the staged start, the payouts committed while the starter was dead wait for nobody"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn temporal_down_at_create_the_workflow_starts_when_it_is_back() {
    // A stack of its own: this test stops its Temporal.
    let stack = Stack::builder().temporal(false).start().unwrap();
    let temporal_dev = stack.temporal();
    let (url, paydb) = fresh_paydb(&stack).await;
    let intake = intake(&url, options()).await;
    let temporal = temporal_client(temporal_dev).await;
    let mut config = starter_config(temporal_dev, "starts-down", "starter-d");
    // Every failed attempt is overdue at once: the alert path is what this test watches.
    config.overdue_ms = 0;
    let (metrics, _starter) = spawn_starter(paydb.clone(), config);
    let account = intake.account("acct-d").await;
    intake.create("po-d1", &account, 100).await.unwrap();
    started(&temporal, "po-d1").await;

    temporal_dev.process.kill().unwrap();
    // The create does not need Temporal: the payout and its staged start commit.
    intake.create("po-d2", &account, 200).await.unwrap();
    // The starter tries, fails, retries with backoff, and says so.
    eventually(WAIT, "failed start attempts recorded", || async {
        let (attempts, error): (i32, Option<String>) = sqlx::query_as(
            "SELECT attempts, last_error FROM workflow_start WHERE payout_id = 'po-d2'",
        )
        .fetch_one(&paydb)
        .await
        .ok()?;
        // The third claim comes after the second attempt's failure was recorded and counted.
        (attempts >= 3 && error.is_some()).then_some(())
    })
    .await
    .unwrap();
    assert!(counter(&metrics, "workflow_start_retries_total") >= 2.0);
    assert!(
        counter(&metrics, "workflow_start_failing_total") >= 1.0,
        "a start that keeps failing is an alert"
    );
    assert!(counter(&metrics, "workflow_start_pending_oldest_age_seconds") > 0.0);
    assert_eq!(
        staged(&paydb, "po-d2").await.map(|s| s.0),
        Some(false),
        "undelivered while Temporal is down"
    );

    temporal_dev.process.restart().unwrap();
    temporal_dev.wait_ready().unwrap();
    let temporal = temporal_client(temporal_dev).await;
    started(&temporal, "po-d2").await;
    assert_eq!(
        marked(&paydb, "po-d2").await.map(|s| (s.0, s.1)),
        Some((true, Some(OUTCOME_STARTED.to_string())))
    );
    assert!(stranded(&paydb, &temporal).await.is_empty());
}
