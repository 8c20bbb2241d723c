//! A restored paydb, once re-armed, leaves the outbox and the General Ledger consistent (issue 35,
//! item 9), shown by the experiment on the real stack (testkit `System`: Temporal, etcd,
//! PostgreSQL, every service its own process).
//!
//! A batch of payouts is in flight when paydb is dumped (`pg_dump`); the batch goes on (payouts
//! POSTED, their lifecycle events and postings delivered to the GL); paydb is restored from the
//! dump (`pg_restore --clean`, the payment resource and the dispatcher stopped, as the procedure
//! says); the operator's procedure re-arms it (`payoutctl restore rearm`'s functions: the horizon
//! from etcd, what the GL holds beyond the restored copy from gldb, both carried into paydb as the
//! owner); every payout the restored copy holds unfinished is run again (the resume pass's
//! stand-in: a second workflow per payout, which moves no money twice); then, once every payout
//! is terminal and the outbox drained: nothing quarantined, the reconciler finds the GL matching
//! paydb (the lost timeline named in `gl_matches_paydb`'s note), each payout moved at most once
//! at the rail and posted at most once in the GL.
//!
//! Run: `cargo build --bins -p lock-server -p payment-resource -p rail-stub -p rail-proxy
//! -p general-ledger -p outbox-dispatcher -p payout-worker && cargo test -p system-tests --test
//! paydb_restore`.

use std::collections::BTreeMap;
use std::time::Duration;

use payment_client::PaymentClient;
use payout_activities::types::{AmbiguityPolicy, PayoutInput};
use payout_domain::ClientReference;
use payout_workflows::client as wf;
use testkit::pki::Role;
use testkit::system::{System, SystemOptions};
use testkit::Stack;

/// A dozen payouts: enough for some to be finished, some in flight and some not started at the
/// dump, each on its own account (so each runs at once).
const PAYOUTS: usize = 12;
/// Payouts settled before the dump, and payouts started just before it (in flight at the dump);
/// the rest start after it.
const SETTLED_BEFORE_DUMP: usize = 4;
const IN_FLIGHT_AT_DUMP: usize = 4;
/// A payout through every service settles in seconds; a loaded two-core machine may take tens.
/// This bounds one payout's wait, and the outbox's drain, in a test that went wrong.
const SETTLE_TIMEOUT: Duration = Duration::from_secs(120);
/// The rail proxy gives up on the rail after this: an ambiguous path stays short.
const RAIL_TIMEOUT_MS: u64 = 2_000;

struct Ctx {
    system: System,
    temporal: temporalio_client::Client,
    payment: PaymentClient,
    paydb: sqlx::PgPool,
    gldb: sqlx::PgPool,
}

impl Ctx {
    async fn new(system: System) -> Self {
        let temporal = wf::connect_configured(
            &wf::TemporalArgs::profile_of(&system.temporal_clients, "operator"),
            "system-tests",
        )
        .await
        .unwrap();
        let payment = PaymentClient::connect(&system.payment_url(), &system.tls(Role::Fixture))
            .await
            .unwrap();
        let pool = |url: String| async move {
            sqlx::postgres::PgPoolOptions::new()
                .max_connections(2)
                .connect(&url)
                .await
                .unwrap()
        };
        let paydb = pool(system.databases.paydb.clone()).await;
        let gldb = pool(system.databases.gldb.clone()).await;
        Self {
            system,
            temporal,
            payment,
            paydb,
            gldb,
        }
    }

    /// The batch: one payout per account, each funded, through the one workload builder.
    async fn create_batch(&self) -> Vec<PayoutInput> {
        let run_id = Stack::shared()
            .unique_prefix("restore")
            .replace(['/', ':'], "-")
            .trim_matches('-')
            .to_string();
        let batch = system_tests::workload::Batch {
            run_id,
            payouts: PAYOUTS,
            accounts: PAYOUTS,
            opening_balance_minor: 10_000,
            insufficient_rate: 0.0,
            amount_max_minor: 5_000,
            beneficiaries: 4,
            seed: 9,
            ambiguity: AmbiguityPolicy {
                settlement_window_ms: 500,
                resolution_sla_ms: 600_000,
            },
            round_robin: true,
        };
        batch
            .create(&self.payment, &self.system.operator)
            .await
            .unwrap()
            .1
    }

    async fn start(&self, input: &PayoutInput) -> String {
        wf::start_payout(&self.temporal, &self.system.task_queue, input)
            .await
            .unwrap()
    }

    async fn wait(&self, workflow_id: &str) {
        wf::wait_result(&self.temporal, workflow_id, SETTLE_TIMEOUT)
            .await
            .unwrap_or_else(|e| panic!("{workflow_id}: {e}"));
    }

    /// The batch's accounts, as paydb names them.
    fn accounts(batch: &[PayoutInput]) -> Vec<&str> {
        batch.iter().map(|p| p.account_id.as_str()).collect()
    }

    async fn states(&self, batch: &[PayoutInput]) -> BTreeMap<String, String> {
        let ids: Vec<&str> = batch.iter().map(|p| p.payout_id.as_str()).collect();
        sqlx::query_as::<_, (String, String)>("SELECT id, state FROM payout WHERE id = ANY($1)")
            .bind(&ids)
            .fetch_all(&self.paydb)
            .await
            .unwrap()
            .into_iter()
            .collect()
    }

    /// Until every payout of the batch is terminal in paydb and every outbox row of its accounts
    /// is delivered; a quarantined row ends the wait at once (it is never delivered).
    async fn settled_and_drained(&self, batch: &[PayoutInput], when: &str) {
        let accounts = Self::accounts(batch);
        let what = format!("{when}: every payout terminal and the outbox drained");
        let outcome = testkit::eventually(SETTLE_TIMEOUT, &what, || async {
            let states = self.states(batch).await;
            let terminal = states
                .values()
                .all(|s| matches!(s.as_str(), "POSTED" | "FAILED" | "ABANDONED"));
            let (undelivered, quarantined): (i64, i64) = sqlx::query_as(
                "SELECT count(*) FILTER (WHERE delivered_at IS NULL), \
                        count(*) FILTER (WHERE quarantined_at IS NOT NULL) \
                 FROM ledger_outbox WHERE account_id = ANY($1)",
            )
            .bind(&accounts)
            .fetch_one(&self.paydb)
            .await
            .ok()?;
            (quarantined > 0 || (terminal && states.len() == batch.len() && undelivered == 0))
                .then_some(())
        })
        .await;
        if let Err(e) = outcome {
            panic!("{e}: {:?}", self.states(batch).await);
        }
    }

    /// Outbox rows of the batch's accounts the dispatcher quarantined: (key, last error).
    async fn quarantined(&self, batch: &[PayoutInput]) -> Vec<(String, Option<String>)> {
        let accounts = Self::accounts(batch);
        sqlx::query_as(
            "SELECT idempotency_key, last_error FROM ledger_outbox \
             WHERE account_id = ANY($1) AND quarantined_at IS NOT NULL ORDER BY id",
        )
        .bind(&accounts)
        .fetch_all(&self.paydb)
        .await
        .unwrap()
    }

    /// The GL's journals of each payout (its postings), by payout id.
    async fn gl_postings(&self, batch: &[PayoutInput]) -> BTreeMap<String, i64> {
        let ids: Vec<&str> = batch.iter().map(|p| p.payout_id.as_str()).collect();
        sqlx::query_as::<_, (String, i64)>(
            "SELECT source_transaction_id, count(*) FROM journals \
             WHERE source_service = 'payment-resource' AND source_transaction_id = ANY($1) \
             GROUP BY source_transaction_id",
        )
        .bind(&ids)
        .fetch_all(&self.gldb)
        .await
        .unwrap()
        .into_iter()
        .collect()
    }
}

/// Which re-arming the experiment runs after the restore.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Procedure {
    /// `payoutctl restore rearm --database paydb`: the fences, and the GL's records beyond the
    /// copy carried forward (`gl_beyond_paydb`, `rearm_paydb`).
    CarryTheGlForward,
    /// The negative control: the fences alone (`rearm`, the procedure before paydb 0014), the GL
    /// never read.
    FencesOnly,
}

/// What the experiment leaves once everything settled.
struct Aftermath {
    ctx: Ctx,
    batch: Vec<PayoutInput>,
    quarantined: Vec<(String, Option<String>)>,
}

/// Runs the experiment (module doc) up to the settled aftermath.
async fn experiment(procedure: Procedure) -> Aftermath {
    let system = System::start(
        Stack::shared(),
        SystemOptions {
            workers: 1,
            settlement_window_ms: 1_000,
            rail_timeout_ms: RAIL_TIMEOUT_MS,
            ..SystemOptions::default()
        },
    )
    .await
    .expect("the system starts");
    let ctx = Ctx::new(system).await;
    let batch = ctx.create_batch().await;

    // Before the dump: some settled, some started (in flight at the dump, wherever they are).
    let mut runs = Vec::new();
    for input in &batch[..SETTLED_BEFORE_DUMP] {
        runs.push(ctx.start(input).await);
    }
    for run in &runs {
        ctx.wait(run).await;
    }
    for input in &batch[SETTLED_BEFORE_DUMP..SETTLED_BEFORE_DUMP + IN_FLIGHT_AT_DUMP] {
        runs.push(ctx.start(input).await);
    }
    let pg = Stack::shared().pg(testkit::PgServer::Main);
    let paydb = testkit::system::database_name(&ctx.system.databases.paydb).to_string();
    let dir = tempfile::tempdir().unwrap();
    let dump = dir.path().join("paydb.dump");
    tokio::task::block_in_place(|| pg.dump(&paydb, &dump)).unwrap();

    // After the dump: the batch goes on to the end, and the GL receives all of it.
    for input in &batch[SETTLED_BEFORE_DUMP + IN_FLIGHT_AT_DUMP..] {
        runs.push(ctx.start(input).await);
    }
    for run in &runs {
        ctx.wait(run).await;
    }
    ctx.settled_and_drained(&batch, "before the restore").await;
    assert_eq!(ctx.quarantined(&batch).await, vec![], "before the restore");

    // The restore, with the procedure's stops: the payment resource and the dispatcher down.
    tokio::task::block_in_place(|| {
        ctx.system.payment_resource.kill().unwrap();
        ctx.system.dispatcher.kill().unwrap();
        pg.restore_clean(&paydb, &dump).unwrap();
        ctx.system.payment_resource.restart().unwrap();
        ctx.system.dispatcher.restart().unwrap();
    });
    let restored = ctx.states(&batch).await;
    assert!(
        batch[..SETTLED_BEFORE_DUMP]
            .iter()
            .all(|p| restored[p.payout_id.as_str()] == "POSTED"),
        "the payouts settled before the dump are POSTED in the restored copy: {restored:?}"
    );
    let unfinished: Vec<&PayoutInput> = batch
        .iter()
        .filter(|p| {
            !matches!(
                restored[p.payout_id.as_str()].as_str(),
                "POSTED" | "FAILED" | "ABANDONED"
            )
        })
        .collect();
    assert!(
        unfinished.len() >= PAYOUTS - SETTLED_BEFORE_DUMP - IN_FLIGHT_AT_DUMP,
        "the payouts started after the dump are unfinished in the restored copy: {restored:?}"
    );

    // The procedure: the horizon from etcd; what the GL holds beyond the copy, from gldb; both
    // carried into paydb as the owner.
    let horizon = payoutctl::restore::etcd_horizon(
        Stack::shared().etcd_endpoints(),
        // What an operator's `restore rearm` reads with: the reconciler's role on the prefix
        // `etcd_horizon` reads (the deployment's; the horizon is the cluster's revision).
        Stack::shared().etcd_identity_tls(
            testkit::etcd::EtcdRole::Reconciler,
            payoutctl::record::LOCK_ETCD_PREFIX,
        ),
    )
    .await
    .unwrap();
    let owner_url = pg.login_url(db_access::OWNER, &paydb);
    let reason = "paydb restored from the mid-batch dump";
    match procedure {
        Procedure::CarryTheGlForward => {
            let gl_lost =
                payoutctl::restore::gl_beyond_paydb(&owner_url, &ctx.system.databases.gldb)
                    .await
                    .unwrap();
            let lost =
                payoutctl::restore::rearm_paydb(&owner_url, horizon, "alice", reason, &gl_lost)
                    .await
                    .unwrap();
            eprintln!("re-armed: {lost:?}; states in the restored copy: {restored:?}");
            assert!(
                lost.payouts_lifted as usize >= PAYOUTS - SETTLED_BEFORE_DUMP - IN_FLIGHT_AT_DUMP
                    && lost.carried >= lost.payouts_lifted,
                "every payout the GL saw go further than the copy is lifted: {lost:?}"
            );
        }
        Procedure::FencesOnly => {
            let raised = payoutctl::restore::rearm(&owner_url, horizon, "alice", reason)
                .await
                .unwrap();
            eprintln!("re-armed (fences only): {raised} fence(s) raised");
        }
    }

    // Every unfinished payout runs again (its first workflow ended; the resume pass's stand-in).
    let mut reruns = Vec::new();
    for input in &unfinished {
        // Under the payout's own id (the only one whose activities the worker serves), a new
        // run of the ended one, as the resume pass starts it.
        let mut options = payout_workflows::start_options(&ctx.system.task_queue, input);
        options.id_reuse_policy = temporalio_client::WorkflowIdReusePolicy::AllowDuplicate;
        let id = options.workflow_id.clone();
        ctx.temporal
            .start_workflow(
                payout_workflows::PayoutWorkflow::run,
                payout_activities::types::PayoutStartInput::from(*input),
                options,
            )
            .await
            .unwrap();
        reruns.push(id);
    }
    for run in &reruns {
        ctx.wait(run).await;
    }
    ctx.settled_and_drained(&batch, "after the restore").await;
    let quarantined = ctx.quarantined(&batch).await;
    Aftermath {
        ctx,
        batch,
        quarantined,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_restored_paydb_once_rearmed_leaves_the_outbox_and_the_gl_consistent() {
    let Aftermath {
        ctx,
        batch,
        quarantined,
    } = experiment(Procedure::CarryTheGlForward).await;
    // Nothing quarantined: no re-run wrote a key the GL holds with other content.
    assert_eq!(quarantined, vec![], "after the restore");
    // The postings of the payouts the GL had seen POSTED were carried, never sent again: at
    // least those started after the dump (PENDING in the copy, POSTED in the lost timeline).
    let accounts = Ctx::accounts(&batch);
    let carried: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM ledger_outbox WHERE account_id = ANY($1) AND kind = 'JOURNAL' \
           AND idempotency_key LIKE '%:posting:v1' AND attempts = 0 AND delivered_at IS NOT NULL",
    )
    .bind(&accounts)
    .fetch_one(&ctx.paydb)
    .await
    .unwrap();
    assert!(
        carried as usize >= PAYOUTS - SETTLED_BEFORE_DUMP - IN_FLIGHT_AT_DUMP,
        "{carried} posting(s) carried by the GL's journal"
    );
    // Each payout paid at most once: one movement at the rail, one posting in the GL.
    let stub = rail_stub::client::StubClient::new(ctx.system.rail_stub_endpoints())
        .expect("the harness's rail client");
    let truth = stub.ground_truth().await.unwrap();
    let postings = ctx.gl_postings(&batch).await;
    let states = ctx.states(&batch).await;
    for input in &batch {
        let cref = ClientReference::for_payout(&input.payout_id);
        let moved = truth
            .movement_counts
            .get(cref.as_str())
            .copied()
            .unwrap_or(0);
        let posted = postings.get(input.payout_id.as_str()).copied().unwrap_or(0);
        let state = &states[input.payout_id.as_str()];
        assert!(
            moved <= 1 && posted <= 1,
            "{}: {moved} movement(s), {posted} GL posting(s)",
            input.payout_id
        );
        if state == "POSTED" {
            assert_eq!((moved, posted), (1, 1), "{} POSTED", input.payout_id);
        }
    }
    // The reconciler: the GL matches paydb; the lost timeline is named, not a violation.
    let reader = |db: &str| {
        let name = testkit::system::database_name(db).to_string();
        Stack::shared()
            .pg(
                if name == testkit::system::database_name(&ctx.system.databases.proxydb) {
                    testkit::PgServer::Proxy
                } else {
                    testkit::PgServer::Main
                },
            )
            .login_url("reconciler", &name)
    };
    let sources = reconciler::Sources {
        paydb: sqlx::PgPool::connect(&reader(&ctx.system.databases.paydb))
            .await
            .unwrap(),
        proxydb: sqlx::PgPool::connect(&reader(&ctx.system.databases.proxydb))
            .await
            .unwrap(),
        gldb: sqlx::PgPool::connect(&reader(&ctx.system.databases.gldb))
            .await
            .unwrap(),
        rail_proxy: None,
        lock_grants: None,
        operators: Some(ctx.system.operator.verifier()),
    };
    let report = reconciler::reconcile(
        &sources,
        &reconciler::Options {
            require_outbox_drained: true,
            ..reconciler::Options::default()
        },
    )
    .await
    .unwrap();
    let gl = report
        .checks
        .iter()
        .find(|c| c.name == "gl_matches_paydb")
        .expect("gl_matches_paydb ran");
    assert_eq!(gl.violations, Vec::<String>::new(), "gl_matches_paydb");
    assert!(
        gl.note
            .as_deref()
            .is_some_and(|n| n.starts_with("restore aftermath")),
        "the lost timeline is named: {:?}",
        gl.note
    );
    let violations: Vec<(&str, &Vec<String>)> = report
        .checks
        .iter()
        .filter(|c| !c.violations.is_empty())
        .map(|c| (c.name, &c.violations))
        .collect();
    assert!(report.is_clean(), "the reconciler is clean: {violations:?}");
    eprintln!("gl_matches_paydb: {:?}", gl.note);
}

/// The negative control: the same experiment re-armed by the fences alone (the procedure before
/// paydb 0014) leaves outbox rows quarantined as IDEMPOTENCY_CONFLICT, the defect of issue 35
/// item 9 as it was found on the local stack. Lifecycle events conflict in every run; a payout
/// the GL had seen POSTED may also conflict on its posting (`:posting:v1`), depending on where
/// the dump caught it, and that is the same defect: a key the GL holds, sent with other content.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn negative_control_re_armed_by_the_fences_alone_the_re_runs_conflict_in_the_gl() {
    let Aftermath { quarantined, .. } = experiment(Procedure::FencesOnly).await;
    eprintln!("quarantined: {quarantined:?}");
    let conflict = |error: &Option<String>| {
        error
            .as_deref()
            .is_some_and(|e| e.contains("IDEMPOTENCY_CONFLICT"))
    };
    assert!(
        quarantined.iter().any(|(key, _)| key.contains(":event:v"))
            && quarantined.iter().all(|(key, error)| {
                (key.contains(":event:v") || key.contains(":posting:v")) && conflict(error)
            }),
        "the re-runs reused event (and posting) versions the GL holds with other content: \
         {quarantined:?}"
    );
}
