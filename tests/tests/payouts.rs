//! The payout workflow end to end, on the real stack: Temporal, etcd, PostgreSQL, and every
//! service as its own process (testkit `System`), with `payout-worker` processes running the
//! service-backed activities. Ground truth is the rail stub's book (`/admin/movements`) and
//! paydb's ledger rows, never the workflow's own account of itself.
//!
//! One shared `System` serves the tests that do not disturb services (each test has its own
//! accounts); the operator-abandon-after-SLA test needs a rail whose lookups never answer, so it
//! has a second `System`.
//!
//! Run: `cargo build --bins -p lock-server -p payment-resource -p rail-stub -p rail-proxy
//! -p general-ledger -p outbox-dispatcher -p payout-worker && cargo test -p system-tests`.

use std::time::Duration;
use testkit::pki::Role;

use lock_client::{Acquired, LockClient};
use payment_client::PaymentClient;
use payout_activities::types::{AmbiguityPolicy, PayoutInput};
use payout_domain::{
    AccountId, AmountMinor, BeneficiaryRef, ClientReference, Currency, PayoutId, PayoutState,
};
use payout_workflows::client as wf;
use payout_workflows::{PayoutResult, PayoutStatus};
use rail_stub::client::StubClient;
use rail_stub::FaultMode;
use temporalio_client::Client;
use testkit::system::{System, SystemOptions};
use testkit::Stack;
use tokio::sync::OnceCell;

/// A payout through every service settles in a few seconds; an ambiguous one within its
/// settlement window plus a lookup. This bounds a test that went wrong.
const SETTLE_TIMEOUT: Duration = Duration::from_secs(90);
/// The rail proxy gives up on the rail after this in the shared system: the ambiguous paths
/// stay fast.
const RAIL_TIMEOUT_MS: u64 = 2_000;

static SHARED: OnceCell<System> = OnceCell::const_new();
static SILENT_RAIL: OnceCell<System> = OnceCell::const_new();

async fn shared() -> &'static System {
    SHARED
        .get_or_init(|| async {
            two_workers_short_lease(RAIL_TIMEOUT_MS)
                .await
                .expect("the shared system starts")
        })
        .await
}

/// A rail whose lookups never answer in time: the proxy reports UNKNOWN, so only an operator
/// can end an ambiguous payout.
async fn silent_rail() -> &'static System {
    SILENT_RAIL
        .get_or_init(|| async {
            System::start(
                Stack::shared(),
                SystemOptions {
                    workers: 1,
                    settlement_window_ms: 1_000,
                    rail_timeout_ms: RAIL_TIMEOUT_MS,
                    rail_faults_json: Some(r#"{"lookup_latency_ms": 60000}"#.into()),
                    // The payment resource's own SLA, the one the abandon test's workflow uses.
                    resolution_sla_ms: Some(15_000),
                    ..SystemOptions::default()
                },
            )
            .await
            .expect("the silent-rail system starts")
        })
        .await
}

struct Ctx {
    system: &'static System,
    temporal: Client,
    payment: PaymentClient,
    stub: StubClient,
    paydb: sqlx::PgPool,
}

impl Ctx {
    async fn new(system: &'static System) -> Self {
        let temporal = wf::connect_configured(
            &wf::TemporalArgs::profile_of(&system.temporal_clients, "operator"),
            "system-tests",
        )
        .await
        .unwrap();
        let payment = PaymentClient::connect(&system.payment_url(), &system.tls(Role::Fixture))
            .await
            .unwrap();
        let paydb = sqlx::postgres::PgPoolOptions::new()
            .max_connections(2)
            .connect(&system.databases.paydb)
            .await
            .unwrap();
        Self {
            system,
            temporal,
            payment,
            stub: rail_stub::client::StubClient::new(system.rail_stub_endpoints())
                .expect("the harness's rail client"),
            paydb,
        }
    }

    /// Opens an account with `balance_minor` and creates one payout of `amount_minor` on it.
    async fn payout(
        &self,
        name: &str,
        balance_minor: i64,
        amount_minor: i64,
        ambiguity: AmbiguityPolicy,
    ) -> PayoutInput {
        let input = system_tests::workload::unique_payout(name, amount_minor, ambiguity).unwrap();
        self.system
            .operator
            .open_account(
                &self.payment,
                &input.account_id,
                &input.currency,
                balance_minor,
            )
            .await
            .unwrap();
        self.payment
            .create_payout(&system_tests::workload::new_payout(&input))
            .await
            .unwrap();
        input
    }

    async fn force(&self, input: &PayoutInput, mode: FaultMode) {
        let cref = ClientReference::for_payout(&input.payout_id);
        self.stub.force(cref.as_str(), Some(mode)).await.unwrap();
    }

    async fn start(&self, input: &PayoutInput) -> String {
        wf::start_payout(&self.temporal, &self.system.task_queue, input)
            .await
            .unwrap()
    }

    async fn result(&self, workflow_id: &str) -> PayoutResult {
        wf::wait_result(&self.temporal, workflow_id, SETTLE_TIMEOUT)
            .await
            .unwrap()
    }

    async fn status(&self, workflow_id: &str) -> PayoutStatus {
        wf::status(&self.temporal, workflow_id).await.unwrap()
    }

    async fn wait_status(
        &self,
        workflow_id: &str,
        what: &str,
        check: impl Fn(&PayoutStatus) -> bool,
    ) -> PayoutStatus {
        testkit::eventually(SETTLE_TIMEOUT, what, || async {
            let s = wf::status(&self.temporal, workflow_id).await.ok()?;
            check(&s).then_some(s)
        })
        .await
        .unwrap()
    }

    /// Until paydb shows the payout RAIL_SUBMITTED: its claimer and the account's fence (the
    /// token it was claimed and marked under). Read from paydb, the record, not from the
    /// workflow's `status` query: with local steps a workflow task runs every step of a payout,
    /// and the query sees the state only when that task completes.
    async fn submitted_in_paydb(&self, input: &PayoutInput) -> (String, u64) {
        testkit::eventually(SETTLE_TIMEOUT, "RAIL_SUBMITTED in paydb", || async {
            let row: Option<(String, Option<String>, i64)> = sqlx::query_as(
                "SELECT p.state, p.claimed_by, a.fence FROM payout p JOIN account a ON a.id = p.account_id WHERE p.id = $1",
            )
            .bind(input.payout_id.as_str())
            .fetch_optional(&self.paydb)
            .await
            .ok()?;
            match row {
                Some((state, Some(claimer), fence)) if state == "RAIL_SUBMITTED" => {
                    Some((claimer, fence as u64))
                }
                _ => None,
            }
        })
        .await
        .unwrap()
    }

    /// Rail ground truth: (movements, payment requests received) for the payout's reference.
    async fn rail(&self, input: &PayoutInput) -> (u64, u64) {
        let cref = ClientReference::for_payout(&input.payout_id);
        let truth = self.stub.ground_truth().await.unwrap();
        (
            truth
                .movement_counts
                .get(cref.as_str())
                .copied()
                .unwrap_or(0),
            truth
                .submit_request_counts
                .get(cref.as_str())
                .copied()
                .unwrap_or(0),
        )
    }

    async fn ledger_rows(&self, input: &PayoutInput) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM ledger_entry WHERE payout_id = $1")
            .bind(input.payout_id.as_str())
            .fetch_one(&self.paydb)
            .await
            .unwrap()
    }

    /// Waits until every outbox row of the payout's account reached the GL, then reads what the GL
    /// holds of the payout: its lifecycle events from gldb (event type, version, source sequence;
    /// in version order) and its posting's journal through GetJournal, as a reconciler (a role the
    /// GL's table allows to read journals) over mutual TLS.
    async fn in_the_gl(
        &self,
        input: &PayoutInput,
    ) -> (
        Vec<(String, i32, Option<i64>)>,
        payout_proto::ledger::Journal,
    ) {
        testkit::eventually(SETTLE_TIMEOUT, "the account's outbox drained", || async {
            let pending: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM ledger_outbox WHERE account_id = $1 AND delivered_at IS NULL",
            )
            .bind(input.account_id.as_str())
            .fetch_one(&self.paydb)
            .await
            .ok()?;
            (pending == 0).then_some(())
        })
        .await
        .unwrap();
        let gldb = sqlx::postgres::PgPoolOptions::new()
            .max_connections(1)
            .connect(&self.system.databases.gldb)
            .await
            .unwrap();
        let events = sqlx::query_as(
            "SELECT event_type, event_version, source_sequence FROM transaction_events \
             WHERE source_service = 'payment-resource' AND source_transaction_id = $1 ORDER BY event_version",
        )
        .bind(input.payout_id.as_str())
        .fetch_all(&gldb)
        .await
        .unwrap();
        testkit::util::close_pool(gldb).await;
        let mut gl =
            payout_proto::ledger::general_ledger_service_client::GeneralLedgerServiceClient::new(
                self.system
                    .tls(Role::Reconciler)
                    .connect(&self.system.gl_url(), Role::GeneralLedger)
                    .await
                    .unwrap(),
            );
        let journal = gl
            .get_journal(payout_proto::ledger::GetJournalRequest {
                key: Some(
                    payout_proto::ledger::get_journal_request::Key::IdempotencyKey(format!(
                        "payment-resource:payout:{}:posting:v1",
                        input.payout_id
                    )),
                ),
            })
            .await
            .unwrap()
            .into_inner();
        (events, journal)
    }

    async fn balance(&self, input: &PayoutInput) -> i64 {
        self.payment
            .get_account(&input.account_id)
            .await
            .unwrap()
            .balance_minor
    }

    async fn operator_decisions(&self, input: &PayoutInput) -> Vec<serde_json::Value> {
        self.payment
            .get_payout(&input.payout_id)
            .await
            .unwrap()
            .history
            .into_iter()
            .filter(|e| e.kind == "operator_decision")
            .map(|e| e.detail)
            .collect()
    }

    /// The workflow's whole history as JSON.
    async fn history_json(&self, workflow_id: &str) -> Vec<u8> {
        self.temporal
            .get_workflow_handle::<payout_workflows::PayoutWorkflow>(workflow_id)
            .fetch_history(temporalio_client::WorkflowFetchHistoryOptions::builder().build())
            .to_json()
            .await
            .unwrap()
    }

    /// Takes the account's key as another holder, starts the payout's workflow and waits until it
    /// waits for that key (PENDING, nothing claimed). The caller releases the grant to let it go.
    async fn start_behind_a_holder(
        &self,
        input: &PayoutInput,
    ) -> (lock_client::Session, lock_client::GrantHandle, String) {
        let lock = LockClient::connect(&self.system.lock_url(), &self.system.tls(Role::Worker))
            .await
            .unwrap();
        let session = lock
            .open_session("operator-test-holder", Duration::from_secs(30))
            .await
            .unwrap();
        let Acquired::Granted(grant) = session
            .acquire(
                &payout_domain::lock_key(&input.account_id),
                Duration::from_secs(1),
            )
            .await
            .unwrap()
        else {
            panic!("the test acquires the free key")
        };
        let id = self.start(input).await;
        self.wait_status(&id, "waiting for the lock", |s| {
            s.last_event.starts_with("WAITING_FOR_LOCK")
        })
        .await;
        (session, grant, id)
    }

    /// The operator path, exactly as typed: `temporal workflow signal ... --name abandon` with the
    /// input `payoutctl sign abandon` makes, signed by the system's registered operator.
    fn signal_abandon(&self, workflow_id: &str, input: &PayoutInput, reason: &str) {
        let signed = self
            .system
            .operator
            .abandon_signal(input.payout_id.as_str(), reason);
        self.signal_abandon_raw(workflow_id, &signed.to_string());
    }

    /// The same signal with any input: what someone who can reach Temporal can send.
    fn signal_abandon_raw(&self, workflow_id: &str, input: &str) {
        Stack::shared()
            .temporal()
            .cli(&[
                "workflow",
                "signal",
                "--namespace",
                testkit::temporal::NAMESPACE,
                "--workflow-id",
                workflow_id,
                "--name",
                "abandon",
                "--input",
                input,
            ])
            .unwrap();
    }
}

/// With `PAYOUT_RECORD_HISTORIES=1`, exports a history recorded against the real services into
/// the workflow crate's committed histories, which `replay_committed_histories` replays.
async fn record_history(ctx: &Ctx, name: &str, workflow_id: &str) {
    if std::env::var_os("PAYOUT_RECORD_HISTORIES").is_none() {
        return;
    }
    let json = ctx.history_json(workflow_id).await;
    let dir = testkit::workspace_root().join("workflows/tests/histories");
    std::fs::write(dir.join(format!("{name}.json")), json).unwrap();
}

/// The index of the worker that holds a payout's grant. The claimer is the grant's owner,
/// `worker-N/{payout_id}` (one grant per payout, not per worker).
fn worker_index(claimer: &str) -> usize {
    claimer
        .strip_prefix("worker-")
        .and_then(|rest| rest.split('/').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("claimer {claimer:?} is not worker-N/{{payout}}"))
}

fn fast_ambiguity() -> AmbiguityPolicy {
    AmbiguityPolicy {
        settlement_window_ms: 500,
        resolution_sla_ms: 600_000,
    }
}

#[tokio::test]
async fn normal_path_moves_money_once_and_posts_two_balanced_rows() {
    let ctx = Ctx::new(shared().await).await;
    let input = ctx.payout("normal", 10_000, 1_000, fast_ambiguity()).await;
    let id = ctx.start(&input).await;
    let done = ctx.result(&id).await;
    assert_eq!(done.state, PayoutState::Posted, "{done:?}");
    assert!(!done.rail_ref.is_empty());
    assert_eq!(ctx.rail(&input).await, (1, 1), "one request, one movement");
    assert_eq!(ctx.ledger_rows(&input).await, 2);
    assert_eq!(ctx.balance(&input).await, 9_000);
    let status = ctx.status(&id).await;
    assert!(status.claimer.starts_with("worker-"), "{status:?}");
    // Issue 19: the GL holds the payout's lifecycle, in order, beside its journal, which carries
    // the rail's reference and the client reference as fields.
    let (events, journal) = ctx.in_the_gl(&input).await;
    let versions: Vec<i32> = events.iter().map(|(_, v, _)| *v).collect();
    assert_eq!(
        versions,
        (1..=events.len() as i32).collect::<Vec<_>>(),
        "{events:?}"
    );
    let sequences: Vec<i64> = events.iter().filter_map(|(_, _, s)| *s).collect();
    assert_eq!(
        sequences.len(),
        events.len(),
        "every event has its source order: {events:?}"
    );
    assert!(
        sequences.windows(2).all(|w| w[0] < w[1]),
        "source order follows the versions: {events:?}"
    );
    // A re-claim by the same workflow (a retried activity) is CLAIMED again: one step.
    let mut steps: Vec<&str> = events.iter().map(|(t, _, _)| t.as_str()).collect();
    steps.dedup();
    assert_eq!(
        steps,
        [
            "PAYOUT_CREATED",
            "PAYOUT_CLAIMED",
            "PAYOUT_SUBMITTED",
            "PAYOUT_ACKNOWLEDGED",
            "PAYOUT_POSTED"
        ],
        "{events:?}"
    );
    let cref = ClientReference::for_payout(&input.payout_id);
    assert_eq!(
        (
            journal.settlement_reference.as_str(),
            journal.client_reference.as_str(),
            journal.effect_kind.as_str()
        ),
        (done.rail_ref.as_str(), cref.as_str(), "PAYOUT_POSTED")
    );
    // The posting's journal sits in the source's order between ACKNOWLEDGED and POSTED (its
    // outbox row was written in the posting's transaction, before the POSTED event's).
    let posted_at = sequences[sequences.len() - 1];
    assert!(
        journal.source_sequence > sequences[sequences.len() - 2] as u64
            && journal.source_sequence < posted_at as u64,
        "journal at {} among {events:?}",
        journal.source_sequence
    );
    record_history(&ctx, "real_backend_normal_path", &id).await;
    // A duplicate start for the same payout is refused by Temporal (id reuse policy).
    let again = wf::start_payout(&ctx.temporal, &ctx.system.task_queue, &input).await;
    assert!(
        matches!(again, Err(wf::PayoutClientError::AlreadyStarted { .. })),
        "{again:?}"
    );
}

/// An operator starts a payout's workflow by hand (`temporal workflow start`, as deploy/README
/// shows): with a typo in the amount it is refused before anything is claimed or sent, and says
/// which field disagrees with the payout record; with only the payout id it pays exactly what
/// the payment resource recorded. (Before, the rail was asked for the input's amount while paydb
/// debited the recorded one.)
#[tokio::test]
async fn a_workflow_started_by_hand_pays_the_record_or_is_refused_before_the_rail() {
    let ctx = Ctx::new(shared().await).await;
    let input = ctx.payout("by-hand", 10_000, 1_000, fast_ambiguity()).await;
    let start = |workflow_id: &str, raw: serde_json::Value| {
        Stack::shared()
            .temporal()
            .cli(&[
                "workflow",
                "start",
                "--namespace",
                testkit::temporal::NAMESPACE,
                "--type",
                "PayoutWorkflow",
                "--task-queue",
                &ctx.system.task_queue,
                "--workflow-id",
                workflow_id,
                "--input",
                &raw.to_string(),
            ])
            .unwrap();
    };
    // The typo runs under the payout's own id (the worker serves no other: ForeignCaller); the
    // corrected start then reuses the id of the failed run.
    let typo_id = payout_domain::workflow_id(&input.payout_id);
    let mut typo = serde_json::to_value(&input).unwrap();
    typo["amount_minor"] = 100_000.into();
    start(&typo_id, typo);
    let refused = wf::wait_result(&ctx.temporal, &typo_id, SETTLE_TIMEOUT)
        .await
        .expect_err("the typo is refused");
    let refused = format!("{refused:?}");
    assert!(
        refused.contains("InputDisagreesWithRecord")
            && refused.contains("amount_minor: the input says 100000, the payout record says 1000"),
        "{refused}"
    );
    assert_eq!(ctx.rail(&input).await, (0, 0), "nothing reached the rail");
    let pending = ctx.payment.get_payout(&input.payout_id).await.unwrap();
    assert_eq!(pending.payout.state, PayoutState::Pending);

    let id = payout_domain::workflow_id(&input.payout_id);
    start(
        &id,
        serde_json::json!({"payout_id": input.payout_id.as_str(), "ambiguity": fast_ambiguity()}),
    );
    let done = ctx.result(&id).await;
    assert_eq!(done.state, PayoutState::Posted, "{done:?}");
    let cref = ClientReference::for_payout(&input.payout_id);
    let truth = ctx.stub.ground_truth().await.unwrap();
    let paid: Vec<i64> = truth
        .movements
        .iter()
        .filter(|m| m.client_reference == cref.as_str())
        .map(|m| m.amount_minor)
        .collect();
    assert_eq!(paid, [1_000], "the rail paid the recorded amount, once");
    assert_eq!(ctx.balance(&input).await, 9_000);
}

#[tokio::test]
async fn decline_fails_without_money_or_ledger() {
    let ctx = Ctx::new(shared().await).await;
    let input = ctx.payout("decline", 10_000, 1_000, fast_ambiguity()).await;
    ctx.force(&input, FaultMode::Decline).await;
    let done = ctx.result(&ctx.start(&input).await).await;
    assert_eq!(done.state, PayoutState::Failed, "{done:?}");
    assert!(done.failure_reason.contains("RAIL_DECLINED"), "{done:?}");
    assert_eq!(ctx.rail(&input).await, (0, 1));
    assert_eq!(ctx.ledger_rows(&input).await, 0);
    assert_eq!(ctx.balance(&input).await, 10_000);
}

#[tokio::test]
async fn insufficient_funds_fails_without_a_rail_call() {
    let ctx = Ctx::new(shared().await).await;
    let input = ctx.payout("funds", 500, 1_000, fast_ambiguity()).await;
    let done = ctx.result(&ctx.start(&input).await).await;
    assert_eq!(done.state, PayoutState::Failed, "{done:?}");
    assert!(
        done.failure_reason.starts_with("INSUFFICIENT_FUNDS"),
        "{done:?}"
    );
    assert_eq!(ctx.rail(&input).await, (0, 0), "the rail never saw it");
    assert_eq!(ctx.ledger_rows(&input).await, 0);
}

#[tokio::test]
async fn accepted_then_silent_is_ambiguous_then_found_and_posted_never_resubmitted() {
    let ctx = Ctx::new(shared().await).await;
    let input = ctx
        .payout("amb-found", 10_000, 1_000, fast_ambiguity())
        .await;
    ctx.force(&input, FaultMode::AcceptThenHang).await;
    let id = ctx.start(&input).await;
    ctx.wait_status(&id, "RAIL_AMBIGUOUS reached", |s| {
        s.state == PayoutState::RailAmbiguous
    })
    .await;
    let done = ctx.result(&id).await;
    assert_eq!(done.state, PayoutState::Posted, "{done:?}");
    assert_eq!(
        ctx.rail(&input).await,
        (1, 1),
        "one movement, never resubmitted"
    );
    assert_eq!(ctx.ledger_rows(&input).await, 2);
    assert_eq!(ctx.balance(&input).await, 9_000);
}

#[tokio::test]
async fn failed_before_acting_is_ambiguous_then_absent_and_failed() {
    let ctx = Ctx::new(shared().await).await;
    let input = ctx
        .payout("amb-absent", 10_000, 1_000, fast_ambiguity())
        .await;
    ctx.force(&input, FaultMode::FailBeforeActing).await;
    let id = ctx.start(&input).await;
    let done = ctx.result(&id).await;
    assert_eq!(done.state, PayoutState::Failed, "{done:?}");
    assert!(done.failure_reason.contains("RAIL_ABSENT"), "{done:?}");
    assert_eq!(ctx.rail(&input).await, (0, 1), "asked once, nothing moved");
    assert_eq!(ctx.ledger_rows(&input).await, 0);
}

#[tokio::test]
async fn abandon_of_a_pending_payout_is_recorded_then_honoured() {
    let ctx = Ctx::new(shared().await).await;
    let input = ctx
        .payout("abandon-pending", 10_000, 1_000, fast_ambiguity())
        .await;
    // Another holder (this test) has the account's key: the payout waits in PENDING.
    let (session, grant, id) = ctx.start_behind_a_holder(&input).await;
    ctx.signal_abandon(&id, &input, "customer withdrew the request");
    ctx.wait_status(&id, "the abandon accepted", |s| {
        s.last_event.starts_with("ABANDON ACCEPTED")
    })
    .await;
    // Recorded in the payment resource's audit trail before anything acted on it.
    let decisions = ctx.operator_decisions(&input).await;
    assert_eq!(decisions.len(), 1, "{decisions:?}");
    assert_eq!(
        ctx.payment
            .get_payout(&input.payout_id)
            .await
            .unwrap()
            .payout
            .state,
        PayoutState::Pending
    );
    grant.release().await.unwrap();
    let done = ctx.result(&id).await;
    assert_eq!(done.state, PayoutState::Abandoned, "{done:?}");
    assert_eq!(ctx.rail(&input).await, (0, 0));
    assert_eq!(ctx.ledger_rows(&input).await, 0);
    session.close().await.unwrap();
}

/// Temporal authenticates nobody: anyone who reaches it can send `abandon` with any name in it.
/// Unsigned, or signed by a key nobody registered, the signal is recorded as refused (the
/// payment resource downgrades the workflow's "accepted" and says why), the workflow takes the
/// record's word (its status says REFUSED by the payment resource, and no Abandon is attempted:
/// the resource's own refusal of an unverified Abandon is its suite's
/// `an_abandon_without_a_registered_operators_signature_is_refused_and_changes_nothing`), and the
/// payout is paid as if nothing had been sent.
#[tokio::test]
async fn an_unsigned_or_forged_abandon_signal_is_refused_on_record_and_the_payout_is_paid() {
    let ctx = Ctx::new(shared().await).await;
    let input = ctx
        .payout("abandon-forged", 10_000, 1_000, fast_ambiguity())
        .await;
    let (session, grant, id) = ctx.start_behind_a_holder(&input).await;
    // Unsigned: a name and a reason only.
    ctx.signal_abandon_raw(
        &id,
        &serde_json::json!({"operator": "operator-1", "reason": "no signature"}).to_string(),
    );
    // Forged: the registered operator's name, a key of the attacker's own.
    let (rogue, _) = grant_signing::Signer::generate("operator-1").unwrap();
    let at = grant_signing::operator::now_unix_ms();
    let forged = rogue.sign_decision(&grant_signing::operator::Decision {
        operator: "operator-1",
        decision: "abandon",
        payout_id: input.payout_id.as_str(),
        reason: "forged",
        signed_at_unix_ms: at,
    });
    ctx.signal_abandon_raw(
        &id,
        &serde_json::json!({"operator": "operator-1", "reason": "forged", "signed_at_unix_ms": at,
            "signature": grant_signing::operator::to_hex(&forged.bytes)})
        .to_string(),
    );
    let decisions =
        testkit::eventually(Duration::from_secs(60), "both decisions on record", || {
            let ctx = &ctx;
            let input = &input;
            async move {
                let d = ctx.operator_decisions(input).await;
                (d.len() >= 2).then_some(d)
            }
        })
        .await
        .unwrap();
    for d in &decisions {
        assert_eq!(d["accepted"], false, "{d}");
        assert_eq!(d["operator_verified"], false, "{d}");
    }
    ctx.wait_status(&id, "the refusal by the payment resource", |s| {
        s.last_event
            .starts_with("ABANDON REFUSED by the payment resource")
    })
    .await;
    grant.release().await.unwrap();
    let done = ctx.result(&id).await;
    assert_eq!(done.state, PayoutState::Posted, "{done:?}");
    assert_eq!(ctx.rail(&input).await, (1, 1), "paid once");
    let refused: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM audit_event WHERE payout_id = $1 AND kind = 'operator_not_verified'",
    )
    .bind(input.payout_id.as_str())
    .fetch_one(&ctx.paydb)
    .await
    .unwrap();
    assert_eq!(
        refused, 0,
        "no Abandon is attempted on a decision recorded as refused"
    );
    session.close().await.unwrap();
}

#[tokio::test]
async fn abandon_is_refused_before_the_sla_and_honoured_past_it() {
    let ctx = Ctx::new(silent_rail().await).await;
    // The rail's lookups take 10 s (the proxy's bound) and say UNKNOWN: the first inquiry ends
    // well inside the 15 s SLA, the second one past it.
    let input = ctx
        .payout(
            "abandon-amb",
            10_000,
            1_000,
            AmbiguityPolicy {
                settlement_window_ms: 300,
                resolution_sla_ms: 15_000,
            },
        )
        .await;
    ctx.force(&input, FaultMode::FailBeforeActing).await;
    let id = ctx.start(&input).await;
    ctx.wait_status(&id, "RAIL_AMBIGUOUS", |s| {
        s.state == PayoutState::RailAmbiguous
    })
    .await;
    ctx.signal_abandon(&id, &input, "too early");
    let refused = ctx
        .wait_status(&id, "the refusal", |s| {
            s.last_event.starts_with("ABANDON REFUSED")
        })
        .await;
    assert_eq!(refused.state, PayoutState::RailAmbiguous);
    assert!(!refused.resolution_sla_passed);
    // Time alone resolves nothing: past the SLA the payout is still ambiguous.
    let past = ctx
        .wait_status(&id, "the SLA passed", |s| s.resolution_sla_passed)
        .await;
    assert_eq!(past.state, PayoutState::RailAmbiguous);
    ctx.signal_abandon(&id, &input, "finance ticket 42");
    let done = ctx.result(&id).await;
    assert_eq!(done.state, PayoutState::Abandoned, "{done:?}");
    let decisions = ctx.operator_decisions(&input).await;
    assert_eq!(decisions.len(), 2, "{decisions:?}");
    assert_eq!(
        ctx.rail(&input).await,
        (0, 1),
        "submitted once, never again"
    );
    assert_eq!(ctx.ledger_rows(&input).await, 0);
}

/// History is diagnostic only: a second workflow for the same payout under another id (refused
/// by the worker at its first step, ForeignCaller: it is not the payout's own workflow), running
/// at the same time, and then an operator's `temporal workflow reset` of the finished one to its
/// first workflow task (which re-runs every step from the start): one rail movement, one
/// posting, whatever Temporal replays.
#[tokio::test]
async fn a_second_workflow_and_a_reset_move_no_money_twice() {
    let ctx = Ctx::new(shared().await).await;
    let input = ctx.payout("history", 10_000, 1_000, fast_ambiguity()).await;
    let id = ctx.start(&input).await;
    let twin = wf::start_payout_with_id(
        &ctx.temporal,
        &ctx.system.task_queue,
        &input,
        &format!("{id}-operator-mistake"),
    )
    .await
    .unwrap();
    let (done, twin_done) = tokio::join!(
        ctx.result(&id),
        wf::wait_result(&ctx.temporal, &twin, SETTLE_TIMEOUT)
    );
    assert_eq!(done.state, PayoutState::Posted, "{done:?}");
    // The twin is not the payout's own workflow (`payout-{id}`): the worker refuses its first
    // step (issue 33, the caller check), so it never reaches a guard.
    let twin_refused = format!("{:?}", twin_done.expect_err("the twin is refused"));
    assert!(twin_refused.contains("ForeignCaller"), "{twin_refused}");
    assert_eq!(ctx.rail(&input).await, (1, 1));
    assert_eq!(ctx.ledger_rows(&input).await, 2);

    Stack::shared()
        .temporal()
        .cli(&[
            "workflow",
            "reset",
            "--namespace",
            testkit::temporal::NAMESPACE,
            "--workflow-id",
            &id,
            "--type",
            "FirstWorkflowTask",
            "--reason",
            "system test: history is diagnostic only",
        ])
        .unwrap();
    // The reset run is the workflow's current run; its result is awaited by id.
    let reset = ctx.result(&id).await;
    assert_eq!(reset.state, PayoutState::Posted, "{reset:?}");
    assert_eq!(ctx.rail(&input).await, (1, 1), "no second movement");
    assert_eq!(ctx.ledger_rows(&input).await, 2, "no second posting");
    assert_eq!(ctx.balance(&input).await, 9_000);
}

/// See the kill test: the timeouts that must pass before the survivor may act, with room for a
/// loaded machine.
const KILLED_WORKER_SETTLE_TIMEOUT: Duration = Duration::from_secs(240);

static FAULTS: OnceCell<System> = OnceCell::const_new();

/// Two workers with a 3 s lease, so a dead or frozen worker's key comes free quickly; the rail
/// proxy gives up on the rail after `rail_timeout_ms`.
async fn two_workers_short_lease(rail_timeout_ms: u64) -> anyhow::Result<System> {
    System::start(
        Stack::shared(),
        SystemOptions {
            workers: 2,
            settlement_window_ms: 1_000,
            rail_timeout_ms,
            worker_env: vec![("PAYOUT_LOCK_TTL_MS".into(), "3000".into())],
            ..SystemOptions::default()
        },
    )
    .await
}

/// `workers` workers with a short lease (3 s) and the test-only stall points `stalls`
/// (`system_tests::stall::STALL_ENV`, read by the test worker).
async fn with_stall_points(workers: usize, stalls: String) -> anyhow::Result<System> {
    System::start(
        Stack::shared(),
        SystemOptions {
            workers,
            settlement_window_ms: 1_000,
            rail_timeout_ms: RAIL_TIMEOUT_MS,
            worker_env: vec![
                ("PAYOUT_LOCK_TTL_MS".into(), "3000".into()),
                (system_tests::stall::STALL_ENV.into(), stalls),
            ],
            test_worker: true,
            ..SystemOptions::default()
        },
    )
    .await
}

/// A system whose processes the test may kill: two workers with a short lease (3 s), so a dead
/// worker's key comes free quickly.
async fn faults() -> &'static System {
    FAULTS
        .get_or_init(|| async {
            two_workers_short_lease(RAIL_TIMEOUT_MS)
                .await
                .expect("the fault system starts")
        })
        .await
}

/// The worker holding the grant is SIGKILLed while its submission is in flight (the rail
/// accepted and went silent). The surviving worker finds the grant's worker gone, acquires a
/// higher token once the lease expires, records the ambiguity, and resolves it from the rail's
/// evidence: POSTED, one movement, one rail request (never resubmitted), two ledger rows.
#[tokio::test]
async fn a_worker_killed_between_submit_and_outcome_ends_resolved_never_resubmitted() {
    let system = faults().await;
    let ctx = Ctx::new(system).await;
    let input = ctx.payout("killed", 10_000, 1_000, fast_ambiguity()).await;
    ctx.force(&input, FaultMode::AcceptThenHang).await;
    let id = ctx.start(&input).await;
    let (claimer, first_token) = ctx.submitted_in_paydb(&input).await;
    let index = worker_index(&claimer);
    // Kill only once the submission has reached the rail (which accepts and goes silent): the
    // worker dies between submit and outcome, not before its submission left (that case is the
    // frozen-worker test's).
    testkit::eventually(
        SETTLE_TIMEOUT,
        "the rail to receive the submission",
        || async { (ctx.rail(&input).await.1 == 1).then_some(()) },
    )
    .await
    .unwrap();
    system.workers[index].kill().unwrap();
    // The submission's start-to-close (30 s), the dead worker's queue's schedule-to-start
    // (15 s), its lease (3 s) and a workflow task timeout on its sticky queue: about a minute.
    let done = wf::wait_result(&ctx.temporal, &id, KILLED_WORKER_SETTLE_TIMEOUT)
        .await
        .unwrap();
    assert_eq!(done.state, PayoutState::Posted, "{done:?}");
    let last_token = done.token.expect("a grant").get();
    assert!(
        last_token > first_token,
        "the survivor holds a higher token ({last_token} > {first_token})"
    );
    assert_eq!(ctx.rail(&input).await, (1, 1), "never resubmitted");
    // Not even asked: the survivor found the payout RAIL_SUBMITTED without having marked it
    // under its own grant (the killed worker's local steps left no trace in the history), so it
    // treated it as maybe sent and never sent a Submit the proxy would have had to refuse.
    let proxydb = sqlx::PgPool::connect(&system.databases.proxydb)
        .await
        .unwrap();
    let duplicates: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM guard_event WHERE payout_id = $1 AND kind = 'DUPLICATE'",
    )
    .bind(input.payout_id.as_str())
    .fetch_one(&proxydb)
    .await
    .unwrap();
    assert_eq!(duplicates, 0, "no second Submit reached the proxy");
    assert_eq!(ctx.ledger_rows(&input).await, 2);
    assert!(
        !system.workers[index].is_running(),
        "the killed worker stayed dead"
    );
}

/// Issue 7, end to end: the worker holding the grant is frozen (SIGSTOP) after marking the payout
/// RAIL_SUBMITTED and before its submission reached the proxy (a test-only stall point holds it
/// there: with local steps the Submit follows MarkSubmitted within milliseconds), past its lease.
/// The other worker takes over with a higher token, finds no outcome, goes RAIL_AMBIGUOUS and
/// asks the proxy with its grant, which seals the payout: FAILED with no movement. Then the
/// frozen worker resumes; its submission, and one replayed deterministically as it would arrive,
/// is FENCED at the proxy, while one at the resolver's own token is a DUPLICATE: nothing is ever
/// sent.
static FROZEN: OnceCell<System> = OnceCell::const_new();

const FROZEN_PAYOUT: &str = "frozen-payout";
/// How long the claimer waits after its grant check, before its Submit of [`FROZEN_PAYOUT`]: the
/// payout is RAIL_SUBMITTED in paydb and nothing has reached the proxy, long enough for the
/// test to see it and freeze the worker there (the next step follows MarkSubmitted at once).
const FROZEN_STALL_MS: u64 = 8_000;

/// Its own two workers (3 s lease): a frozen worker here must not take a worker away from the
/// killed-worker test running beside it. Either worker stalls before its Submit of
/// [`FROZEN_PAYOUT`] (a test-only stall point).
async fn frozen_system() -> &'static System {
    FROZEN
        .get_or_init(|| async {
            let stalls = (0..2)
                .map(|i| format!("worker-{i}:submit:{FROZEN_PAYOUT}:{FROZEN_STALL_MS}"))
                .collect::<Vec<_>>()
                .join(",");
            with_stall_points(2, stalls)
                .await
                .expect("the frozen-worker system starts")
        })
        .await
}

#[tokio::test]
async fn a_worker_frozen_after_marking_submitted_never_moves_money_for_a_failed_payout() {
    use rail_proxy_client::{ProxyError, RailProxyClient, SubmitPayout};

    let system = frozen_system().await;
    let ctx = Ctx::new(system).await;
    let input = explicit_payout(&ctx, FROZEN_PAYOUT, "frozen-acct").await;
    let proxydb = sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .connect(&system.databases.proxydb)
        .await
        .unwrap();
    let id = ctx.start(&input).await;
    // The claimer is held after its grant check, before its Submit (the stall point): the
    // freeze lands in the window the lease check cannot close.
    let (claimer, _) = ctx.submitted_in_paydb(&input).await;
    let index = worker_index(&claimer);
    system.workers[index].pause().unwrap();
    let frozen_token: i64 = sqlx::query_scalar("SELECT fence FROM account WHERE id = $1")
        .bind(input.account_id.as_str())
        .fetch_one(&ctx.paydb)
        .await
        .unwrap();
    let done = wf::wait_result(&ctx.temporal, &id, KILLED_WORKER_SETTLE_TIMEOUT).await;
    system.workers[index].resume().unwrap();
    let done = done.unwrap();
    let resolver_token = done.token.expect("a grant").get();
    assert!(resolver_token > frozen_token as u64, "{done:?}");
    let record: Option<(Option<String>, i64)> =
        sqlx::query_as("SELECT outcome, fence_token FROM rail_submission WHERE payout_id = $1")
            .bind(input.payout_id.as_str())
            .fetch_optional(&proxydb)
            .await
            .unwrap();
    let (moved, requests) = ctx.rail(&input).await;
    assert!(moved <= 1, "at most one rail movement ({moved})");
    match done.state {
        PayoutState::Posted => assert_eq!((moved, ctx.ledger_rows(&input).await), (1, 2)),
        PayoutState::Failed => assert_eq!((moved, ctx.ledger_rows(&input).await), (0, 0)),
        other => panic!("unexpected terminal state {other}: {done:?}"),
    }
    let sealed = matches!(&record, Some((Some(outcome), _)) if outcome == "NOT_SENT");
    eprintln!(
        "freeze landed before the proxy: {sealed}; record {record:?}; rail ({moved}, {requests})"
    );
    // The stall point holds the claimer before its Submit, so the freeze always lands before the
    // proxy: the hole's case, every run.
    assert!(sealed, "the freeze landed before the proxy: {record:?}");
    if sealed {
        assert_eq!(done.state, PayoutState::Failed);
        assert_eq!((moved, requests), (0, 0), "nothing ever reached the rail");
        let mut proxy = RailProxyClient::connect(&system.proxy_url(), &system.tls(Role::Worker))
            .await
            .unwrap();
        // Genuine signatures (the system's own grant key): the guards must refuse these late
        // submissions on their token and on the seal, not as forged.
        let signer = system.grant_keys.signer().unwrap();
        let instructions = system.instruction_keys.signer().unwrap();
        let key = payout_domain::lock_key(&input.account_id);
        let late = |token: u64, owner: &str| {
            SubmitPayout::new(
                input.payout_id.clone(),
                input.account_id.clone(),
                payout_domain::FencingToken::new(token).unwrap(),
                owner,
                input.amount_minor,
                input.currency.clone(),
                input.beneficiary_ref.clone(),
            )
            .signed(key.clone(), signer.sign(&key, token, owner))
            .instructed_now(&instructions)
        };
        let stale = proxy.submit(&late(frozen_token as u64, &claimer)).await;
        assert!(
            matches!(stale, Err(ProxyError::FencedOut { presented, stored, .. }) if presented == frozen_token as u64 && stored >= resolver_token),
            "{stale:?}"
        );
        let at_resolver = proxy.submit(&late(resolver_token, "late-resolver")).await;
        assert!(
            matches!(&at_resolver, Err(ProxyError::Duplicate { existing, .. }) if existing.is_sealed()),
            "{at_resolver:?}"
        );
        assert_eq!(ctx.rail(&input).await, (0, 0));
    }
    // The frozen holder's own attempts after it resumed, if it made any, were refused by a guard
    // (it cannot have acted: its grant is stale at both).
    let fenced_at_proxy: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM guard_event WHERE payout_id = $1 AND kind = 'FENCED'",
    )
    .bind(input.payout_id.as_str())
    .fetch_one(&proxydb)
    .await
    .unwrap();
    let fenced_at_paydb: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM audit_event WHERE payout_id = $1 AND kind = 'fenced_out'",
    )
    .bind(input.payout_id.as_str())
    .fetch_one(&ctx.paydb)
    .await
    .unwrap();
    eprintln!("fenced_out: proxy {fenced_at_proxy}, paydb {fenced_at_paydb}");
    assert_eq!(
        ctx.rail(&input).await.0,
        moved,
        "nothing moved after the resume"
    );
}

static OPERATOR: OnceCell<System> = OnceCell::const_new();

/// Its own two workers (3 s lease) and a patient rail proxy (20 s), so that a submission stays
/// in flight long enough for an operator to act on it.
async fn operator_system() -> &'static System {
    OPERATOR
        .get_or_init(|| async {
            two_workers_short_lease(20_000)
                .await
                .expect("the operator system starts")
        })
        .await
}

/// The workflow's pending activities, from `temporal workflow describe`.
fn pending_activities(workflow_id: &str) -> Vec<serde_json::Value> {
    let out = Stack::shared()
        .temporal()
        .cli(&[
            "workflow",
            "describe",
            "--workflow-id",
            workflow_id,
            "--output",
            "json",
        ])
        .unwrap();
    let described: serde_json::Value = serde_json::from_str(&out).unwrap();
    described["pendingActivities"]
        .as_array()
        .cloned()
        .unwrap_or_default()
}

/// Until the workflow's history holds a completed workflow task (a reset point).
async fn a_workflow_task_completed(workflow_id: &str) {
    testkit::eventually(SETTLE_TIMEOUT, "a completed workflow task", || async {
        let out = Stack::shared()
            .temporal()
            .cli(&[
                "workflow",
                "show",
                "--workflow-id",
                workflow_id,
                "--output",
                "json",
            ])
            .ok()?;
        (out.contains("WORKFLOW_TASK_COMPLETED") || out.contains("WorkflowTaskCompleted"))
            .then_some(())
    })
    .await
    .unwrap();
}

/// History is diagnostic only, against an operator. With local steps the submission in flight is
/// not an activity task: there is nothing an operator could retry, re-route or reset (describe
/// lists no pending activity; before local steps, this test raised the submission's retry policy,
/// re-routed it and reset it, and the extra attempt was refused for want of the grant). What an
/// operator can still do is reset the workflow: with the claimer frozen and its submission in
/// flight at the rail, the workflow is reset to its first workflow task. The reset run finds the
/// payout RAIL_SUBMITTED, treats it as maybe sent (it did not mark it under its own grant),
/// and resolves it from the rail's evidence under a higher token. Ground truth: one rail
/// request, one movement, two ledger rows.
#[tokio::test]
async fn an_operator_resetting_a_payout_while_its_submission_is_in_flight_moves_no_money_twice() {
    let system = operator_system().await;
    let ctx = Ctx::new(system).await;
    let input = ctx
        .payout("operator", 10_000, 1_000, fast_ambiguity())
        .await;
    ctx.force(&input, FaultMode::AcceptThenHang).await;
    let id = ctx.start(&input).await;
    let (claimer, first_token) = ctx.submitted_in_paydb(&input).await;
    testkit::eventually(
        SETTLE_TIMEOUT,
        "the rail to receive the submission",
        || async { (ctx.rail(&input).await.1 == 1).then_some(()) },
    )
    .await
    .unwrap();
    assert!(
        pending_activities(&id).is_empty(),
        "the submission in flight is a local step, not an activity task an operator can re-dispatch"
    );
    // The proxy waits 20 s for the rail: the local submission keeps its workflow task open,
    // which the worker heartbeats (completes and reopens) after 80% of the task timeout.
    a_workflow_task_completed(&id).await;
    let index = worker_index(&claimer);
    system.workers[index].pause().unwrap();
    Stack::shared()
        .temporal()
        .cli(&[
            "workflow",
            "reset",
            "--namespace",
            testkit::temporal::NAMESPACE,
            "--workflow-id",
            &id,
            "--type",
            "FirstWorkflowTask",
            "--reason",
            "system test: an operator resets a payout whose submission is in flight",
        ])
        .unwrap();
    let done = wf::wait_result(&ctx.temporal, &id, KILLED_WORKER_SETTLE_TIMEOUT).await;
    system.workers[index].resume().unwrap();
    let done = done.unwrap();
    assert_eq!(done.state, PayoutState::Posted, "{done:?}");
    assert!(
        done.token.expect("a grant").get() > first_token,
        "recovered under a higher token"
    );
    // Let the frozen worker's own late attempt finish before counting.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(ctx.rail(&input).await, (1, 1), "one request, one movement");
    assert_eq!(ctx.ledger_rows(&input).await, 2, "one posting");
}

static STALLED: OnceCell<System> = OnceCell::const_new();
const STALL_PAYDB_PAYOUT: &str = "stall-paydb";
const STALL_PROXY_PAYOUT: &str = "stall-proxy";

/// One worker (`worker-0`, 3 s lease) with test-only stall points: it waits 20 s after its grant
/// check, before its MarkSubmitted of one payout and before its Submit of another. The test
/// brings a second worker in itself.
async fn stalled_system() -> &'static System {
    STALLED
        .get_or_init(|| async {
            let stalls = format!(
                "worker-0:mark_submitted:{STALL_PAYDB_PAYOUT}:20000,worker-0:submit:{STALL_PROXY_PAYOUT}:20000"
            );
            with_stall_points(1, stalls)
                .await
                .expect("the stalled system starts")
        })
        .await
}

static LOST_ANSWERS: OnceCell<System> = OnceCell::const_new();
/// The payout whose guard steps each lose their first answer after the guard committed.
const LOST_ANSWERS_PAYOUT: &str = "lost-answers-p";

/// One test worker that loses the first answer of the claim, MarkSubmitted, RecordOutcome and
/// Post of [`LOST_ANSWERS_PAYOUT`] (`system_tests::stall::LOSE_ANSWER_ENV`): each guard call
/// commits, and the worker reports a transient error in place of its answer.
async fn lost_answers_system() -> &'static System {
    LOST_ANSWERS
        .get_or_init(|| async {
            let lost = ["claim", "mark_submitted", "record_outcome", "post"]
                .map(|step| format!("{step}:{LOST_ANSWERS_PAYOUT}"))
                .join(",");
            System::start(
                Stack::shared(),
                SystemOptions {
                    workers: 1,
                    settlement_window_ms: 1_000,
                    rail_timeout_ms: RAIL_TIMEOUT_MS,
                    worker_env: vec![(system_tests::stall::LOSE_ANSWER_ENV.into(), lost)],
                    test_worker: true,
                    ..SystemOptions::default()
                },
            )
            .await
            .expect("the lost-answers system starts")
        })
        .await
}

/// Issue 35: a committed step whose answer is lost (a restart after COMMIT, a reset connection,
/// a local-activity timeout) is retried under the same grant, and the guard answers the retry
/// with the record, not a refusal. Before, the retried MarkSubmitted was refused as a transition
/// from RAIL_SUBMITTED; the run, not having seen its own mark, recorded OUTCOME_MISSING without
/// calling the proxy, and after the settlement window the payout ended FAILED: never sent,
/// failed for a network blip, with RefusedTransition paging. Now every step's lost answer is
/// recovered: POSTED, one movement, one rail request, two ledger rows, and no refusal recorded.
#[tokio::test]
async fn a_step_whose_answer_is_lost_after_its_commit_is_answered_with_the_record_and_paid_once() {
    let system = lost_answers_system().await;
    let ctx = Ctx::new(system).await;
    let input = explicit_payout(&ctx, LOST_ANSWERS_PAYOUT, "lost-answers-acct").await;
    let id = ctx.start(&input).await;
    let done = ctx.result(&id).await;
    assert_eq!(done.state, PayoutState::Posted, "{done:?}");
    let log = std::fs::read_to_string(system.workers[0].log_path()).unwrap_or_default();
    for step in ["claim", "mark_submitted", "record_outcome", "post"] {
        assert!(
            log.lines()
                .any(|l| l.contains("its answer is lost") && l.contains(step)),
            "the answer of {step} was lost once (the fault happened)"
        );
    }
    assert_eq!(ctx.rail(&input).await, (1, 1), "one movement, one request");
    assert_eq!(ctx.ledger_rows(&input).await, 2);
    let refused: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM audit_event WHERE payout_id = $1 AND kind = 'refused_transition'",
    )
    .bind(input.payout_id.as_str())
    .fetch_one(&ctx.paydb)
    .await
    .unwrap();
    assert_eq!(refused, 0, "a repeat under its own grant is no refusal");
}

static LONG_WINDOW: OnceCell<System> = OnceCell::const_new();
/// The worker hands back a grant no fenced call has used within this (production: a minute).
const LONG_WINDOW_UNCLAIMED_GRANT_MS: u64 = 1_000;
/// The rail's settlement window, and the workflow's: several times the worker's hand-back, as a
/// real rail's minutes are against its minute.
const LONG_WINDOW_SETTLEMENT_MS: u64 = 6_000;

/// One worker that hands back an unused grant after [`LONG_WINDOW_UNCLAIMED_GRANT_MS`], a short
/// lease (3 s, so a restarted worker's old key comes free soon), and a rail whose settlement
/// window is [`LONG_WINDOW_SETTLEMENT_MS`].
async fn long_window_system() -> &'static System {
    LONG_WINDOW
        .get_or_init(|| async {
            System::start(
                Stack::shared(),
                SystemOptions {
                    workers: 1,
                    settlement_window_ms: LONG_WINDOW_SETTLEMENT_MS,
                    rail_timeout_ms: RAIL_TIMEOUT_MS,
                    worker_env: vec![
                        ("PAYOUT_LOCK_TTL_MS".into(), "3000".into()),
                        (
                            "PAYOUT_UNCLAIMED_GRANT_MS".into(),
                            LONG_WINDOW_UNCLAIMED_GRANT_MS.to_string(),
                        ),
                    ],
                    ..SystemOptions::default()
                },
            )
            .await
            .expect("the long-window system starts")
        })
        .await
}

/// Issue 35: waiting for the rail never depends on holding an unused grant. The rail accepts and
/// goes silent (RAIL_AMBIGUOUS); the worker is restarted in the middle of the settlement window,
/// which is longer than the time after which a worker hands back a grant no fenced call used.
/// The run re-acquires and asks the rail at once under the new grant (the inquiry uses it), then
/// waits the window out holding it, and resolves from the rail's evidence: POSTED, one movement,
/// never resubmitted. Before, the run waited the window before its first fenced call, the worker
/// handed the unused grant back mid-wait, the inquiry failed GrantLost, and so again each time
/// until the workflow failed (GrantLostTooOften) with the payout still RAIL_AMBIGUOUS.
#[tokio::test]
async fn an_ambiguous_payout_whose_window_outlasts_an_unused_grant_is_resolved_after_a_worker_restart(
) {
    let system = long_window_system().await;
    let ctx = Ctx::new(system).await;
    let ambiguity = AmbiguityPolicy {
        settlement_window_ms: LONG_WINDOW_SETTLEMENT_MS + 500,
        resolution_sla_ms: 600_000,
    };
    let input = ctx.payout("long-window", 10_000, 1_000, ambiguity).await;
    ctx.force(&input, FaultMode::AcceptThenHang).await;
    let id = ctx.start(&input).await;
    testkit::eventually(SETTLE_TIMEOUT, "the payout RAIL_AMBIGUOUS", || async {
        let state: String = sqlx::query_scalar("SELECT state FROM payout WHERE id = $1")
            .bind(input.payout_id.as_str())
            .fetch_one(&ctx.paydb)
            .await
            .ok()?;
        (state == "RAIL_AMBIGUOUS").then_some(())
    })
    .await
    .unwrap();
    // In the middle of the window: the worker and its session (and grant) are gone.
    system.workers[0].kill().unwrap();
    system.workers[0].restart().unwrap();
    let done = wf::wait_result(&ctx.temporal, &id, KILLED_WORKER_SETTLE_TIMEOUT)
        .await
        .unwrap();
    assert_eq!(done.state, PayoutState::Posted, "{done:?}");
    assert_eq!(ctx.rail(&input).await, (1, 1), "never resubmitted");
    assert_eq!(ctx.ledger_rows(&input).await, 2);
    let resolved: String = sqlx::query_scalar(
        "SELECT event FROM audit_event WHERE payout_id = $1 AND kind = 'transition' \
         AND from_state = 'RAIL_AMBIGUOUS'",
    )
    .bind(input.payout_id.as_str())
    .fetch_one(&ctx.paydb)
    .await
    .unwrap();
    assert_eq!(
        resolved, "EVIDENCE_FOUND",
        "resolved by the rail's evidence"
    );
}

/// An explicit payout on an account of its own, both named after `name` and unique in the stack.
async fn unique_explicit_payout(ctx: &Ctx, name: &str) -> PayoutInput {
    let unique = Stack::shared().unique_prefix(name).replace(['/', ':'], "-");
    let unique = unique.trim_matches('-').to_string();
    explicit_payout(ctx, &format!("{unique}-p"), &format!("{unique}-acct")).await
}

async fn explicit_payout(ctx: &Ctx, payout: &str, account: &str) -> PayoutInput {
    let currency = Currency::parse("EUR").unwrap();
    let input = PayoutInput {
        payout_id: PayoutId::parse(payout).unwrap(),
        account_id: AccountId::parse(account).unwrap(),
        amount_minor: AmountMinor::new(1_000).unwrap(),
        currency: currency.clone(),
        beneficiary_ref: BeneficiaryRef::parse("ben-e2e").unwrap(),
        ambiguity: fast_ambiguity(),
    };
    ctx.system
        .operator
        .open_account(&ctx.payment, &input.account_id, &currency, 10_000)
        .await
        .unwrap();
    ctx.payment
        .create_payout(&system_tests::workload::new_payout(&input))
        .await
        .unwrap();
    input
}

/// Issue 7: a worker paused (SIGSTOP) past its lease while it holds grants, frozen where the
/// lease check cannot help (after the check passed, before the guard call: a test-only stall
/// point holds it there). Another worker takes over with higher tokens and finishes both payouts.
/// Then the first worker resumes and makes its stale calls: MarkSubmitted reaches the payment
/// resource and is fenced out (account fence above its token), Submit reaches the rail proxy and
/// is fenced out (high-water above its token). Ground truth: one movement for the payout that was
/// submitted (POSTED once), none for the one the resolver sealed (FAILED).
#[tokio::test]
async fn a_worker_paused_past_its_lease_is_fenced_out_at_both_guards() {
    let system = stalled_system().await;
    let ctx = Ctx::new(system).await;
    let p = explicit_payout(&ctx, STALL_PAYDB_PAYOUT, "stall-acct-1").await;
    let q = explicit_payout(&ctx, STALL_PROXY_PAYOUT, "stall-acct-2").await;
    let (id_p, id_q) = (ctx.start(&p).await, ctx.start(&q).await);
    let log = system.workers[0].log_path().to_path_buf();
    testkit::eventually(
        SETTLE_TIMEOUT,
        "worker-0 inside both stall points",
        || async {
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            let waiting = text
                .lines()
                .filter(|l| l.contains("test stall point: waiting"))
                .count();
            (waiting >= 2).then_some(())
        },
    )
    .await
    .unwrap();
    // Frozen at once, inside both stall points. The stale tokens are the accounts' fences (each
    // payout was claimed under its grant), read from paydb: the `status` query would wait for
    // the workflow task that runs the stalled local step to complete.
    system.workers[0].pause().unwrap();
    let fence = |account: &'static str| {
        let paydb = ctx.paydb.clone();
        async move {
            sqlx::query_scalar::<_, i64>("SELECT fence FROM account WHERE id = $1")
                .bind(account)
                .fetch_one(&paydb)
                .await
                .unwrap() as u64
        }
    };
    let (stale_p, stale_q) = (fence("stall-acct-1").await, fence("stall-acct-2").await);
    let rescuer = system.start_worker("worker-1").unwrap();
    let (done_p, done_q) = tokio::join!(
        wf::wait_result(&ctx.temporal, &id_p, KILLED_WORKER_SETTLE_TIMEOUT),
        wf::wait_result(&ctx.temporal, &id_q, KILLED_WORKER_SETTLE_TIMEOUT),
    );
    system.workers[0].resume().unwrap();
    let (done_p, done_q) = (done_p.unwrap(), done_q.unwrap());
    assert_eq!(done_p.state, PayoutState::Posted, "{done_p:?}");
    assert!(done_p.token.expect("a grant").get() > stale_p);
    assert_eq!(
        done_q.state,
        PayoutState::Failed,
        "sealed as never sent: {done_q:?}"
    );
    assert!(done_q.token.expect("a grant").get() > stale_q);

    // The resumed worker's stale calls arrive and are refused by the guards, each on its own.
    let proxydb = sqlx::PgPool::connect(&system.databases.proxydb)
        .await
        .unwrap();
    testkit::eventually(SETTLE_TIMEOUT, "the stale calls refused at both guards", || async {
        let paydb: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM audit_event WHERE kind = 'fenced_out' AND payout_id = $1 AND token = $2",
        )
        .bind(STALL_PAYDB_PAYOUT)
        .bind(stale_p as i64)
        .fetch_one(&ctx.paydb)
        .await
        .ok()?;
        let proxy: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM guard_event WHERE kind = 'FENCED' AND payout_id = $1 AND presented = $2",
        )
        .bind(STALL_PROXY_PAYOUT)
        .bind(stale_q as i64)
        .fetch_one(&proxydb)
        .await
        .ok()?;
        (paydb >= 1 && proxy >= 1).then_some(())
    })
    .await
    .unwrap();
    assert_eq!(ctx.rail(&p).await, (1, 1), "posted once, paid once");
    assert_eq!(
        ctx.rail(&q).await,
        (0, 0),
        "the stale submission never reached the rail"
    );
    assert_eq!(ctx.ledger_rows(&p).await, 2);
    assert_eq!(ctx.ledger_rows(&q).await, 0);
    drop(rescuer);
}

/// A grant whose acquire's answer reached nobody (Temporal had already given up on that attempt:
/// seen in a loaded fault-suite run, where the same payout's retry on the other worker then
/// waited behind it for good, and every later payout of the account behind that) is handed back
/// by its worker once no workflow has used it for `unclaimed_grant_max`. The control: a grant a
/// workflow used (a fenced call vouched for it) is kept past the same bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_grant_no_workflow_takes_up_is_handed_back_and_a_used_one_is_kept() {
    use payout_activities::types::{AcquireInput, AcquireOutcome};
    use payout_activities::Backend;
    use payout_worker::services::{ServiceBackend, ServiceConfig};

    let system = shared().await;
    let unclaimed_grant_max = Duration::from_secs(2);
    let backend = ServiceBackend::connect(ServiceConfig {
        owner: "unclaimed-test".into(),
        private_task_queue: "unclaimed-test".into(),
        tls: system.tls(Role::Worker),
        lock_server_url: system.lock_url(),
        payment_resource_url: system.payment_url(),
        rail_proxy_url: system.proxy_url(),
        lock_ttl: Duration::from_secs(10),
        lock_history_path: None,
        unclaimed_grant_max,
    })
    .await
    .unwrap();
    let grant = |account: &str| {
        let input = AcquireInput {
            payout_id: PayoutId::parse(format!("p-{account}")).unwrap(),
            account_id: AccountId::parse(account).unwrap(),
        };
        let backend = &backend;
        async move {
            match backend.acquire(input, Duration::ZERO).await.unwrap() {
                AcquireOutcome::Granted(g) => g,
                other => panic!("{other:?}"),
            }
        }
    };
    let unique = Stack::shared()
        .unique_prefix("unclaimed")
        .replace(['/', ':'], "-");
    let unique = unique.trim_matches('-');
    let (orphan_account, used_account) = (format!("{unique}-orphan"), format!("{unique}-used"));
    let _orphan = grant(&orphan_account).await;
    let used = grant(&used_account).await;
    backend.check_held(&used).expect("held and vouched for");
    let lock = LockClient::connect(&system.lock_url(), &system.tls(Role::Worker))
        .await
        .unwrap();
    let held = |account: String| {
        let lock = lock.clone();
        async move {
            lock.describe(&payout_domain::lock_key(
                &AccountId::parse(account).unwrap(),
            ))
            .await
            .unwrap()
            .held
        }
    };
    assert!(held(orphan_account.clone()).await && held(used_account.clone()).await);
    // Past the bound and a sweep (every 2 s here: the sweep runs at most every bound).
    tokio::time::sleep(unclaimed_grant_max * 3).await;
    assert!(
        !held(orphan_account).await,
        "the grant nobody took up was handed back"
    );
    assert!(
        held(used_account).await,
        "the grant a workflow used is kept"
    );
    backend.check_held(&used).expect("still held");
    backend.close().await;
}

/// The worker presents, with every fenced call, the signature the lock service gave its own
/// handle of the grant (signed grants): a claim under a fresh grant is accepted by the payment
/// resource, which verifies it. A grant the worker handed back after its check passed (a call
/// frozen between the check and the guard) keeps its signature, so the late call still reaches
/// the guard and is refused there on its token (`FencedOut`), not as forged and not by the worker.
/// A grant this process never held has no signature here: `GrantLost`, and nothing is sent.
/// The worker's own service backend, run by the test as a holder of its own (`owner`): its grants
/// are genuine, signed by the lock service, and its guard calls are the worker's.
async fn holder(system: &System, owner: &str) -> payout_worker::services::ServiceBackend {
    use payout_worker::services::{ServiceBackend, ServiceConfig};
    ServiceBackend::connect(ServiceConfig {
        owner: owner.into(),
        private_task_queue: owner.into(),
        tls: system.tls(Role::Worker),
        lock_server_url: system.lock_url(),
        payment_resource_url: system.payment_url(),
        rail_proxy_url: system.proxy_url(),
        lock_ttl: Duration::from_secs(10),
        lock_history_path: None,
        unclaimed_grant_max: Duration::from_secs(60),
    })
    .await
    .unwrap()
}

/// A grant on `input`'s account, taken at once (the key must be free).
async fn granted(
    backend: &payout_worker::services::ServiceBackend,
    input: &PayoutInput,
) -> payout_activities::types::Grant {
    use payout_activities::types::{AcquireInput, AcquireOutcome};
    use payout_activities::Backend;
    match backend
        .acquire(
            AcquireInput {
                payout_id: input.payout_id.clone(),
                account_id: input.account_id.clone(),
            },
            Duration::ZERO,
        )
        .await
        .unwrap()
    {
        AcquireOutcome::Granted(g) => g,
        other => panic!("{other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_worker_presents_its_own_grants_signature_and_a_handed_back_grant_still_meets_the_fence(
) {
    use payout_activities::refusal::{ActivityFailure, Refusal};
    use payout_activities::types::FencedInput;
    use payout_activities::Backend;

    let system = shared().await;
    let ctx = Ctx::new(system).await;
    let input = unique_explicit_payout(&ctx, "signed").await;
    let backend = holder(system, "signed-test").await;
    let acquire = || granted(&backend, &input);
    let fenced = |grant: &payout_activities::types::Grant| FencedInput {
        payout_id: input.payout_id.clone(),
        grant: grant.clone(),
    };

    let first = acquire().await;
    backend.check_held(&first).unwrap();
    let claimed = backend.claim(fenced(&first)).await.unwrap();
    assert_eq!(claimed.state, PayoutState::Claimed);
    // Handed back after its check, then the key goes to a later grant, which writes.
    backend.release(first.clone()).await.unwrap();
    let second = acquire().await;
    assert!(second.token > first.token);
    backend.check_held(&second).unwrap();
    let marked = backend.mark_submitted(fenced(&second)).await.unwrap();
    assert_eq!(marked.state, PayoutState::RailSubmitted);
    // The first grant's late call: signed with its own (kept) signature, refused on its token.
    match backend.mark_submitted(fenced(&first)).await {
        Err(ActivityFailure::Refused(Refusal::FencedOut {
            presented, stored, ..
        })) => assert_eq!((presented, stored), (first.token.get(), second.token.get())),
        other => panic!("expected the guard's FencedOut, got {other:?}"),
    }
    // A grant this process never held (another session's): nothing to present, nothing sent.
    let foreign = payout_activities::types::Grant {
        session_id: "another-process".into(),
        ..second.clone()
    };
    match backend.post(fenced(&foreign)).await {
        Err(ActivityFailure::Refused(Refusal::GrantLost { token, .. })) => {
            assert_eq!(token, second.token.get())
        }
        other => panic!("expected GrantLost, got {other:?}"),
    }
    let fenced_out: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM audit_event WHERE kind = 'fenced_out' AND payout_id = $1 AND token = $2",
    )
    .bind(input.payout_id.as_str())
    .bind(first.token.get() as i64)
    .fetch_one(&ctx.paydb)
    .await
    .unwrap();
    assert_eq!(
        fenced_out, 1,
        "the late call reached the guard and was audited"
    );
    let fence: i64 = sqlx::query_scalar("SELECT fence FROM account WHERE id = $1")
        .bind(input.account_id.as_str())
        .fetch_one(&ctx.paydb)
        .await
        .unwrap();
    assert_eq!(fence as u64, second.token.get());
    backend.release(second).await.unwrap();
    backend.close().await;
}

/// How long the cut test waits for every payout: the cut worker's local steps give up after
/// `LOCAL_STEP_BUDGET` (20 s), and a retried activity may land on the cut worker a few times (a
/// hanging attempt ends at its start-to-close or heartbeat timeout) before the other takes it.
const CUT_SETTLE_TIMEOUT: Duration = Duration::from_secs(240);
const CUT_PAYOUTS: usize = 12;

/// A worker cut off from the lock service while it still polls Temporal (a real partition: its
/// packets to the lock-server's port are dropped in its own network namespace) takes some of the
/// payouts' workflow tasks, and with them their local steps. Each such step gives up within its
/// budget, and the run moves to activity tasks that the other worker serves: every payout settles
/// while the cut lasts, each paid once and posted once. Cut for longer than a lease, the worker
/// stops polling (so no retry of those activity tasks lands on it), and polls again once healed. Before the local step had a budget, the
/// cut worker kept retrying its local acquire and its payouts stayed PENDING until the cut healed
/// (the compose suite's lock-network cut saw one stay PENDING for 240 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_worker_cut_off_from_the_lock_service_hands_its_payouts_to_the_other_worker() {
    if let Err(why) = tokio::task::block_in_place(testkit::netns::NetNs::available) {
        panic!("this test needs network namespaces (root, ip, iptables): {why}");
    }
    let mut system = two_workers_short_lease(RAIL_TIMEOUT_MS).await.unwrap();
    // worker-1 is replaced by one that runs in its own network namespace.
    let replaced = system.workers.pop().unwrap();
    drop(replaced);
    let ns = tokio::task::block_in_place(testkit::netns::NetNs::create).unwrap();
    let spec = ns.wrap(system.worker_spec("worker-1"));
    let cut_worker = tokio::task::block_in_place(|| testkit::ManagedProcess::start(spec)).unwrap();
    testkit::eventually(SETTLE_TIMEOUT, "the cut worker to poll", || async {
        let log = std::fs::read_to_string(cut_worker.log_path()).unwrap_or_default();
        log.contains("worker polling").then_some(())
    })
    .await
    .unwrap();
    system.workers.push(cut_worker);
    let system: &'static System = Box::leak(Box::new(system));
    let cut_worker = system.workers.last().expect("the cut worker");
    tokio::task::block_in_place(|| ns.cut(system.ports.lock_server)).unwrap();

    let ctx = Ctx::new(system).await;
    let mut started = Vec::new();
    for i in 0..CUT_PAYOUTS {
        let input = ctx
            .payout(&format!("cut-{i}"), 10_000, 1_000, fast_ambiguity())
            .await;
        let id = ctx.start(&input).await;
        started.push((input, id));
    }
    let mut handed_over = 0;
    for (input, id) in &started {
        let done = wf::wait_result(&ctx.temporal, id, CUT_SETTLE_TIMEOUT)
            .await
            .unwrap_or_else(|e| panic!("{id} did not settle while the cut lasted: {e:#}"));
        assert_eq!(done.state, PayoutState::Posted, "{done:?}");
        assert_eq!(
            ctx.rail(input).await,
            (1, 1),
            "{id}: one request, one movement"
        );
        assert_eq!(ctx.ledger_rows(input).await, 2, "{id}: posted once");
        assert_eq!(ctx.balance(input).await, 9_000, "{id}");
        let claimer = ctx
            .payment
            .get_payout(&input.payout_id)
            .await
            .unwrap()
            .payout
            .claimed_by;
        assert!(
            claimer.as_deref().is_some_and(|c| worker_index(c) == 0),
            "{id}: claimed by {claimer:?}, but only worker-0 reaches the lock service"
        );
        if history_has_activity(&ctx, id, "TryAcquireGrant").await {
            if handed_over == 0 {
                // The path from a local step that gave up to activity tasks, replayed by
                // `replay_committed_histories`.
                record_history(&ctx, "local_step_gave_up", id).await;
            }
            handed_over += 1;
        }
    }
    // Cut for longer than a lease, the worker stops polling (issue 36; the fault-suite design's
    // section 5.1): the tasks it cannot do go to the worker that can. It does not exit.
    let log_has = |needle: &'static str, times: usize| {
        let path = cut_worker.log_path().to_path_buf();
        move || {
            let path = path.clone();
            async move {
                let log = std::fs::read_to_string(&path).unwrap_or_default();
                (log.matches(needle).count() >= times).then_some(())
            }
        }
    };
    testkit::eventually(
        CUT_OFF_SEEN_TIMEOUT,
        "the cut worker to stop polling",
        log_has("stopping polling", 1),
    )
    .await
    .unwrap_or_else(|e| panic!("{e:#}\n{}", cut_worker.log_tail(20)));
    tokio::task::block_in_place(|| ns.heal(system.ports.lock_server)).unwrap();
    testkit::eventually(
        CUT_OFF_SEEN_TIMEOUT,
        "the healed worker to poll again",
        log_has("worker polling", 2),
    )
    .await
    .unwrap_or_else(|e| panic!("{e:#}\n{}", cut_worker.log_tail(20)));
    assert!(
        cut_worker.is_running(),
        "the cut worker waited, it did not exit"
    );
    // The case under test happened: the cut worker took workflow tasks, its local try gave up,
    // and the try was made again as an activity task (a local step is never an activity task
    // otherwise).
    assert!(
        handed_over > 0,
        "no payout's workflow task reached the cut worker: the case was not exercised"
    );
    println!("{handed_over} of {CUT_PAYOUTS} payouts were handed over by the cut worker");
}

/// A worker cut off from the lock service notices within two leases (its session's loss, then a
/// lease of failed attempts to open another), polling stopped; healed, it polls again within a
/// few checks. Bounds, not expectations.
const CUT_OFF_SEEN_TIMEOUT: Duration = Duration::from_secs(60);

/// Whether the workflow's history has an activity task of `activity_type` (not a local one).
async fn history_has_activity(ctx: &Ctx, workflow_id: &str, activity_type: &str) -> bool {
    let json = ctx.history_json(workflow_id).await;
    let history: serde_json::Value = serde_json::from_slice(&json).unwrap();
    history["events"]
        .as_array()
        .into_iter()
        .flatten()
        .any(|event| {
            event["attributes"]["ActivityTaskScheduledEventAttributes"]["activity_type"]["name"]
                == activity_type
        })
}

static STARTS_ALONE: OnceCell<System> = OnceCell::const_new();

/// Waits until the (restarted) payment resource answers over gRPC.
async fn payment_resource_answers(system: &System) {
    testkit::system::wait_grpc(
        system.ports.payment_resource,
        &system.payment_resource,
        &system.tls(Role::Reconciler),
        Role::PaymentResource,
    )
    .await
    .unwrap();
}

/// A system of its own with one worker, for a test that stops or rewinds a part of it.
async fn one_worker_system(cell: &'static OnceCell<System>) -> &'static System {
    cell.get_or_init(|| async {
        System::start(
            Stack::shared(),
            SystemOptions {
                workers: 1,
                settlement_window_ms: 1_000,
                ..SystemOptions::default()
            },
        )
        .await
        .expect("the system starts")
    })
    .await
}

/// A worker started while the payment resource is down waits for it and then pays, instead of
/// exiting. Before, `serve` returned "connecting the worker's services: payment resource:
/// transport: Unavailable" at once: every restart during an outage was a crash loop for whoever
/// supervised it, and the fault suite's planted holders were lost with the worker (their calls
/// never answered: `chaos_run_under_the_nemesis_has_no_violations` failed on it).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_worker_started_while_a_guard_is_down_waits_for_it_and_then_pays() {
    let system = one_worker_system(&STARTS_ALONE).await;
    let worker = &system.workers[0];
    let log_mark = std::fs::read_to_string(worker.log_path())
        .unwrap_or_default()
        .len();
    tokio::task::block_in_place(|| {
        system.payment_resource.kill().unwrap();
        worker.kill().unwrap();
        worker.restart().unwrap();
    });
    let waiting = testkit::eventually(Duration::from_secs(60), "the worker waits", || async {
        let log = std::fs::read_to_string(worker.log_path()).unwrap_or_default();
        log.get(log_mark..)
            .is_some_and(|new| new.contains("a service the worker needs is not reachable"))
            .then_some(())
    })
    .await;
    assert!(
        waiting.is_ok() && worker.is_running(),
        "the worker waits for the payment resource instead of exiting (running: {}):\n{}",
        worker.is_running(),
        worker.log_tail(20)
    );
    tokio::task::block_in_place(|| system.payment_resource.restart().unwrap());
    payment_resource_answers(system).await;
    let ctx = Ctx::new(system).await;
    let input = ctx
        .payout("starts-alone", 10_000, 1_000, fast_ambiguity())
        .await;
    let done = ctx.result(&ctx.start(&input).await).await;
    assert_eq!(done.state, PayoutState::Posted, "{done:?}");
    assert_eq!(ctx.rail(&input).await, (1, 1), "one request, one movement");
    assert!(worker.is_running());
}

static RESTORED: OnceCell<System> = OnceCell::const_new();

/// `guard_database_restored{guard="payment_resource"}` as the running binary exports it.
async fn paydb_restored_gauge(system: &System) -> Option<String> {
    let body = reqwest::get(format!(
        "http://127.0.0.1:{}/metrics",
        system.ports.metrics[1]
    ))
    .await
    .ok()?
    .text()
    .await
    .ok()?;
    body.lines()
        .find(|l| l.starts_with("guard_database_restored{guard=\"payment_resource\"}"))
        .and_then(|l| l.rsplit(' ').next())
        .map(str::to_string)
}

/// Issue 19, section 3, on the whole system: paydb restored from a real dump taken mid-run. A
/// holder claims the payout (fence = its token), the dump is taken, the key passes to a successor
/// whose grant claims again (fence = the successor's token, the first holder's late write fenced
/// out), then paydb is restored from the dump with the payment resource stopped: the fence is
/// back at the first holder's token. The restarted payment resource raises the alarm
/// (`guard_database_restored` 1) and refuses the first holder's late write (`DatabaseRestored`,
/// which the worker reads as transient: it waits, nothing lands). The operator's procedure reads
/// the lock service's horizon from etcd and re-arms paydb as the owner (`payoutctl restore
/// rearm`'s functions): both old holders are fenced out, the alarm clears, and the payout's
/// workflow pays it once with a grant above the horizon. The payment resource's own suite has the
/// negative control (`negative_control_without_the_restore_check_a_stale_token_lands_on_a_restored_paydb`).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_paydb_restored_from_a_mid_run_dump_refuses_the_stale_holder_until_rearmed() {
    use payout_activities::refusal::{ActivityFailure, Refusal};
    use payout_activities::types::{FencedInput, Grant};
    use payout_activities::Backend;

    let system = one_worker_system(&RESTORED).await;
    let ctx = Ctx::new(system).await;
    let input = unique_explicit_payout(&ctx, "restored").await;
    let backend = holder(system, "restore-test").await;
    let acquire = || granted(&backend, &input);
    let fenced = |grant: &Grant| FencedInput {
        payout_id: input.payout_id.clone(),
        grant: grant.clone(),
    };
    let record = || async {
        sqlx::query_as::<_, (String, Option<i64>, i64)>(
            "SELECT p.state, p.token_stamp, a.fence FROM payout p JOIN account a ON a.id = p.account_id WHERE p.id = $1",
        )
        .bind(input.payout_id.as_str())
        .fetch_one(&ctx.paydb)
        .await
        .unwrap()
    };

    let first = acquire().await;
    backend.check_held(&first).unwrap();
    backend.claim(fenced(&first)).await.unwrap();
    let pg = Stack::shared().pg(testkit::PgServer::Main);
    let paydb = testkit::system::database_name(&system.databases.paydb).to_string();
    let dir = tempfile::tempdir().unwrap();
    let dump = dir.path().join("paydb.dump");
    tokio::task::block_in_place(|| pg.dump(&paydb, &dump)).unwrap();

    backend.release(first.clone()).await.unwrap();
    let second = acquire().await;
    assert!(second.token > first.token);
    backend.check_held(&second).unwrap();
    backend.claim(fenced(&second)).await.unwrap();
    match backend.mark_submitted(fenced(&first)).await {
        Err(ActivityFailure::Refused(Refusal::FencedOut { .. })) => {}
        other => panic!("before the restore the first holder is fenced out, got {other:?}"),
    }
    backend.release(second.clone()).await.unwrap();

    tokio::task::block_in_place(|| {
        system.payment_resource.kill().unwrap();
        pg.restore_clean(&paydb, &dump).unwrap();
        system.payment_resource.restart().unwrap();
    });
    payment_resource_answers(system).await;
    let rewound = record().await;
    assert_eq!(
        rewound,
        (
            "CLAIMED".to_string(),
            Some(first.token.get() as i64),
            first.token.get() as i64
        ),
        "the restore rewound the fence to the first holder's token"
    );
    testkit::eventually(Duration::from_secs(30), "the alarm", || async {
        (paydb_restored_gauge(system).await.as_deref() == Some("1")).then_some(())
    })
    .await
    .expect("guard_database_restored is 1 on the restored paydb");

    // The first holder's late write: with the rewound fence at its own token it would land; the
    // restored copy refuses it, and the worker waits (transient), nothing written.
    match backend.mark_submitted(fenced(&first)).await {
        Err(ActivityFailure::Transient(detail)) => {
            assert!(detail.contains("restored from a backup"), "{detail}")
        }
        other => panic!("expected the restored copy's refusal, got {other:?}"),
    }
    assert_eq!(record().await, rewound, "no stale write landed");

    // The procedure: the horizon from the lock backend itself, paydb re-armed as the owner.
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
    assert!(horizon >= second.token.get() as i64, "{horizon}");
    let raised = payoutctl::restore::rearm(
        &pg.login_url(db_access::OWNER, &paydb),
        horizon,
        "alice",
        "paydb restored from the mid-run dump",
    )
    .await
    .unwrap();
    assert!(raised >= 1, "{raised}");
    for stale in [&first, &second] {
        match backend.mark_submitted(fenced(stale)).await {
            Err(ActivityFailure::Refused(Refusal::FencedOut { stored, .. })) => {
                assert!(stored as i64 >= horizon)
            }
            other => panic!("expected FencedOut after the re-arming, got {other:?}"),
        }
    }
    testkit::eventually(Duration::from_secs(30), "the alarm clears", || async {
        (paydb_restored_gauge(system).await.as_deref() == Some("0")).then_some(())
    })
    .await
    .expect("guard_database_restored back to 0");
    backend.close().await;

    // The payout continues: its workflow takes a grant above the horizon and pays it once.
    let done = ctx.result(&ctx.start(&input).await).await;
    assert_eq!(done.state, PayoutState::Posted, "{done:?}");
    let (state, token_stamp, _) = record().await;
    assert_eq!(state, "POSTED");
    assert!(
        token_stamp.unwrap() > horizon,
        "{token_stamp:?} > {horizon}"
    );
    assert_eq!(ctx.rail(&input).await, (1, 1), "one request, one movement");
}

// ----- telemetry: the latency histograms and the worker's endpoint -----

/// The sum of every sample of `name` whose labels include all of `labels`, in a Prometheus
/// text exposition (0 when there is none).
fn sample_sum(text: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    text.lines()
        .filter(|line| !line.starts_with('#'))
        .filter_map(|line| line.rsplit_once(' '))
        .filter(|(series, _)| {
            let (series_name, series_labels) = series.split_once('{').unwrap_or((series, ""));
            series_name == name
                && labels
                    .iter()
                    .all(|(k, v)| series_labels.contains(&format!("{k}=\"{v}\"")))
        })
        .filter_map(|(_, value)| value.parse::<f64>().ok())
        .sum()
}

/// Every scrape the test reads: the payment resource's, the proxy's and each worker's.
struct Scrapes {
    payment: String,
    proxy: String,
    workers: Vec<String>,
}

async fn scrape(system: &System) -> Scrapes {
    let get = |port: u16, path: &'static str| async move {
        let response = reqwest::get(format!("http://127.0.0.1:{port}{path}"))
            .await
            .unwrap_or_else(|e| panic!("GET {path} on {port}: {e}"));
        assert_eq!(response.status(), 200, "GET {path} on {port}");
        response.text().await.unwrap()
    };
    let mut workers = Vec::new();
    for port in &system.worker_metrics {
        workers.push(get(*port, "/metrics").await);
    }
    Scrapes {
        payment: get(system.ports.metrics[1], "/metrics").await,
        proxy: get(system.ports.metrics[3], "/metrics").await,
        workers,
    }
}

impl Scrapes {
    fn workers_sum(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        self.workers
            .iter()
            .map(|w| sample_sum(w, name, labels))
            .sum()
    }
}

/// Issue 18, part 1: one payout through the real system shows up in every latency histogram:
/// each guard call it made (`guard_call_duration_seconds` at both guards, one name), the payout
/// end to end (`payout_duration_seconds{final_state}`), the rail call
/// (`rail_call_duration_seconds`) and each workflow step (`payout_activity_duration_seconds`
/// on the worker that ran it), counted in the `+Inf` bucket and in a finite one; each worker's
/// `/metrics` also carries the Temporal SDK's own metric families, and its `/healthz` answers 200.
/// Counts are compared before and after the payout (the shared system runs other tests).
#[tokio::test]
async fn a_payout_is_counted_in_every_latency_histogram_and_the_workers_export_the_sdks_metrics() {
    let ctx = Ctx::new(shared().await).await;
    let before = scrape(ctx.system).await;
    let input = ctx
        .payout("telemetry", 10_000, 1_000, fast_ambiguity())
        .await;
    let id = ctx.start(&input).await;
    let done = ctx.result(&id).await;
    assert_eq!(done.state, PayoutState::Posted, "{done:?}");
    let after = scrape(ctx.system).await;

    let bucket = |le: &'static str| ("le", le);
    // The guards: every fenced step of a paid payout, ok, in the +Inf bucket and under 30 s.
    for (text_before, text_after, guard, operation) in [
        (
            &before.payment,
            &after.payment,
            "payment_resource",
            "create_payout",
        ),
        (&before.payment, &after.payment, "payment_resource", "claim"),
        (
            &before.payment,
            &after.payment,
            "payment_resource",
            "mark_submitted",
        ),
        (
            &before.payment,
            &after.payment,
            "payment_resource",
            "record_outcome",
        ),
        (&before.payment, &after.payment, "payment_resource", "post"),
        (&before.proxy, &after.proxy, "rail_proxy", "submit"),
    ] {
        for le in ["+Inf", "30"] {
            let labels = [
                ("guard", guard),
                ("operation", operation),
                ("outcome", "ok"),
                bucket(le),
            ];
            let grew = sample_sum(text_after, "guard_call_duration_seconds_bucket", &labels)
                - sample_sum(text_before, "guard_call_duration_seconds_bucket", &labels);
            assert!(
                grew >= 1.0,
                "{guard} {operation} le={le}: +{grew}\n{text_after}"
            );
        }
    }
    // The payout end to end, by its final state: once, creation to POSTED.
    for le in ["+Inf", "86400"] {
        let labels = [("final_state", "POSTED"), bucket(le)];
        let grew = sample_sum(&after.payment, "payout_duration_seconds_bucket", &labels)
            - sample_sum(&before.payment, "payout_duration_seconds_bucket", &labels);
        assert!(
            grew >= 1.0,
            "payout POSTED le={le}: +{grew}\n{}",
            after.payment
        );
    }
    // The rail call: one payment, acknowledged.
    for le in ["+Inf", "60"] {
        let labels = [("operation", "pay"), ("outcome", "acked"), bucket(le)];
        let grew = sample_sum(&after.proxy, "rail_call_duration_seconds_bucket", &labels)
            - sample_sum(&before.proxy, "rail_call_duration_seconds_bucket", &labels);
        assert!(grew >= 1.0, "rail pay le={le}: +{grew}\n{}", after.proxy);
    }
    // The workflow's steps, on whichever worker ran them.
    for activity in [
        "Claim",
        "MarkSubmitted",
        "SubmitToRail",
        "RecordOutcome",
        "PostLedger",
    ] {
        for le in ["+Inf", "300"] {
            let labels = [("activity", activity), ("outcome", "ok"), bucket(le)];
            let grew = after.workers_sum("payout_activity_duration_seconds_bucket", &labels)
                - before.workers_sum("payout_activity_duration_seconds_bucket", &labels);
            assert!(
                grew >= 1.0,
                "activity {activity} le={le}: +{grew}\n{}",
                after.workers.join("\n")
            );
        }
    }
    // The Temporal SDK's own families: pollers, slots and starts on every worker; the task
    // latencies and the sticky cache on the worker(s) that ran the payout.
    for (i, text) in after.workers.iter().enumerate() {
        for family in [
            "temporal_num_pollers",
            "temporal_worker_task_slots_available",
            "temporal_worker_start_total",
        ] {
            assert!(
                text.lines().any(|l| l.starts_with(family)),
                "worker {i} /metrics lacks {family}:\n{text}"
            );
        }
    }
    // The SDK records a workflow task's latency once the server has answered its completion,
    // which can be after the client saw the workflow's result: the families may appear a
    // moment after the payout ended, so the workers are scraped again until they do (bounded).
    let families = [
        "temporal_workflow_task_schedule_to_start_latency",
        "temporal_workflow_task_execution_latency",
        // The payout's steps run as local activities (ARCHITECTURE: local steps).
        "temporal_local_activity_execution_latency",
        "temporal_sticky_cache_size",
    ];
    let missing = |workers: &[String]| -> Vec<&'static str> {
        families
            .iter()
            .copied()
            .filter(|family| {
                !workers
                    .iter()
                    .any(|text| text.lines().any(|l| l.starts_with(family)))
            })
            .collect()
    };
    let mut workers = after.workers.clone();
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    while !missing(&workers).is_empty() && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(200)).await;
        workers = scrape(ctx.system).await.workers;
    }
    let absent = missing(&workers);
    assert!(
        absent.is_empty(),
        "no worker's /metrics has {absent:?} 15 s after the payout ended:\n{}",
        workers.join("\n")
    );
    for port in &ctx.system.worker_metrics {
        let (code, body) =
            testkit::util::http_get(*port, "/healthz", Duration::from_secs(2)).unwrap();
        assert_eq!(code, 200, "worker on {port}: {body}");
    }
}

static RAIL_IMPOSTOR: OnceCell<System> = OnceCell::const_new();
static BELIEVING_PROXY: OnceCell<System> = OnceCell::const_new();

/// One worker, a short rail timeout; with `believing`, the rail proxy is the test-only
/// `rail-proxy-failpoint --mode rail-answers-unverified` (the shipped start-up believing every
/// answer on the rail's address).
async fn impostor_system(believing: bool) -> System {
    System::start(
        Stack::shared(),
        SystemOptions {
            workers: 1,
            settlement_window_ms: 1_000,
            rail_timeout_ms: RAIL_TIMEOUT_MS,
            rail_proxy_binary: believing.then(|| {
                (
                    "rail-proxy-failpoint".to_string(),
                    vec!["--mode".to_string(), "rail-answers-unverified".to_string()],
                )
            }),
            ..SystemOptions::default()
        },
    )
    .await
    .expect("the system starts")
}

/// Puts an impostor on the rail's address: the rail's own software and TLS certificate, with an
/// answer key of its own (it has the code, the address and the certificate, not the rail's answer
/// key), keeping its movements to itself. The real
/// rail is killed first; the returned switch stops the impostor.
async fn impostor_on_the_rails_address(system: &System) -> tokio::sync::watch::Sender<bool> {
    system.rail_stub.kill().unwrap();
    let port = system.ports.rail_stub;
    let listener = testkit::eventually(
        Duration::from_secs(30),
        "the rail's port is free",
        || async {
            tokio::net::TcpListener::bind(("127.0.0.1", port))
                .await
                .ok()
        },
    )
    .await
    .unwrap();
    // Its own admin and metrics listeners anywhere: only the payments address is the rail's.
    let spare = rail_stub::StubListeners::local().await.unwrap();
    let listeners = rail_stub::StubListeners {
        payments: listener,
        ..spare
    };
    let (shutdown, stop) = service_kit::Shutdown::new();
    // It holds the rail's TLS material too (the worst case: the stub's certificate and key
    // taken), so only the answer key tells it apart.
    let tls = system.rail_tls.stub.load().unwrap();
    tokio::spawn(async move {
        rail_stub::run(listeners, &tls, rail_stub::StubConfig::default(), shutdown).await
    });
    stop
}

/// Stops the impostor and starts the real rail again on its address.
async fn real_rail_back(system: &System, stop: tokio::sync::watch::Sender<bool>) {
    let _ = stop.send(true);
    testkit::eventually(
        Duration::from_secs(30),
        "the rail's port is free",
        || async { std::net::TcpListener::bind(("127.0.0.1", system.ports.rail_stub)).ok() },
    )
    .await
    .unwrap();
    system.rail_stub.restart().unwrap();
}

/// The rail proxy's `rail_answers_unauthenticated_total` series, as one text.
async fn unauthenticated_answers(system: &System) -> String {
    system_tests::metrics::scrape(system.ports.metrics[3])
        .await
        .lines()
        .filter(|l| l.starts_with("rail_answers_unauthenticated_total{"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// Issue 34, row 5a, end to end: with an impostor answering on the rail's address (`accepted`,
/// signed with a key that is not the rail's), the payout is never POSTED and the customer never
/// debited: the proxy records the answer as ambiguous (counted, `RailAnswerUnauthenticated`),
/// and its inquiries get nothing believable either. Once the real rail answers again, the
/// inquiry's authenticated ABSENT fails the payout: nothing moved, nothing posted.
/// `negative_control_a_proxy_believing_every_answer_posts_a_payout_the_rail_never_saw` is the
/// control.
#[tokio::test]
async fn a_rail_impostor_cannot_make_a_payout_posted() {
    let system = RAIL_IMPOSTOR.get_or_init(|| impostor_system(false)).await;
    let ctx = Ctx::new(system).await;
    let input = ctx
        .payout("rail-impostor", 10_000, 1_000, fast_ambiguity())
        .await;
    let stop = impostor_on_the_rails_address(system).await;
    let id = ctx.start(&input).await;
    ctx.wait_status(&id, "RAIL_AMBIGUOUS on the impostor's answer", |s| {
        s.state == PayoutState::RailAmbiguous
    })
    .await;
    let counted = testkit::eventually(SETTLE_TIMEOUT, "the refusal counted", || async {
        let series = unauthenticated_answers(system).await;
        series
            .contains(
                "rail_answers_unauthenticated_total{operation=\"pay\",reason=\"unknown_key_id\"} 1",
            )
            .then_some(series)
    })
    .await
    .unwrap();
    assert!(counted.contains("operation=\"pay\""), "{counted}");
    assert_eq!(
        ctx.ledger_rows(&input).await,
        0,
        "nothing posted on its word"
    );
    // The real rail back on its address: the inquiry's authenticated answer decides.
    real_rail_back(system, stop).await;
    let done = ctx.result(&id).await;
    assert_eq!(done.state, PayoutState::Failed, "{done:?}");
    assert!(done.failure_reason.contains("RAIL_ABSENT"), "{done:?}");
    assert_eq!(ctx.rail(&input).await, (0, 0), "the real rail never saw it");
    assert_eq!(ctx.ledger_rows(&input).await, 0);
}

/// Row 5a's control: the same impostor, with the rail proxy believing every answer on the rail's
/// address. The payout is POSTED and its ledger rows written, while the real rail has no
/// movement for it: the customer debited for money that never left.
#[tokio::test]
async fn negative_control_a_proxy_believing_every_answer_posts_a_payout_the_rail_never_saw() {
    let system = BELIEVING_PROXY.get_or_init(|| impostor_system(true)).await;
    let ctx = Ctx::new(system).await;
    let input = ctx
        .payout("rail-believed", 10_000, 1_000, fast_ambiguity())
        .await;
    let stop = impostor_on_the_rails_address(system).await;
    let id = ctx.start(&input).await;
    let done = ctx.result(&id).await;
    assert_eq!(done.state, PayoutState::Posted, "{done:?}");
    assert_eq!(ctx.ledger_rows(&input).await, 2);
    real_rail_back(system, stop).await;
    testkit::eventually(SETTLE_TIMEOUT, "the real rail answers", || async {
        ctx.stub.ground_truth().await.ok()
    })
    .await
    .unwrap();
    assert_eq!(ctx.rail(&input).await, (0, 0), "the real rail never saw it");
}
