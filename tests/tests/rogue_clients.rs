//! Part of the attack suite (issue 33; `attacks.rs` is the rest): rogue Temporal clients. Each
//! case is someone who can reach Temporal and runs a worker of their own
//! (`system_tests::rogue`): a workflow of another type, or an impostor registered as
//! `PayoutWorkflow`, scheduling the genuine activities on the system's queues with inputs of
//! their choosing. Each asserts what the genuine workers and the guards did with it: the refusal,
//! that nothing was written or paid, and that the refusal was counted where an operator sees it.

use payout_activities::types::PayoutInput;
use payout_domain::ClientReference;
use serde_json::json;
use std::time::Duration;
use system_tests::rogue::{Activity, Outcome, Report, Rogue, Script, Step};
use testkit::pki::Role;
use testkit::system::{System, SystemOptions};
use testkit::Stack;
use tokio::sync::OnceCell;

static SYSTEM: OnceCell<System> = OnceCell::const_new();

/// One system for the file: one genuine worker (so that its metrics are the ones to read), no
/// workflow starts of its own (each case starts what it needs, or nothing).
async fn system() -> &'static System {
    SYSTEM
        .get_or_init(|| async {
            System::start(
                Stack::shared(),
                SystemOptions {
                    workers: 1,
                    ..SystemOptions::default()
                },
            )
            .await
            .expect("the system starts")
        })
        .await
}

/// Opens an account with `balance_minor` and creates a PENDING payout of `amount_minor` on it,
/// paid to `ben-e2e`.
async fn pending_payout(
    system: &System,
    name: &str,
    balance_minor: i64,
    amount_minor: i64,
) -> PayoutInput {
    let input =
        system_tests::workload::unique_payout(name, amount_minor, Default::default()).unwrap();
    let payment =
        payment_client::PaymentClient::connect(&system.payment_url(), &system.tls(Role::Fixture))
            .await
            .unwrap();
    system
        .operator
        .open_account(&payment, &input.account_id, &input.currency, balance_minor)
        .await
        .unwrap();
    payment
        .create_payout(&system_tests::workload::new_payout(&input))
        .await
        .unwrap();
    input
}

async fn rogue(system: &System) -> Rogue {
    Rogue::start(payout_workflows::client::TemporalArgs::profile_of(
        &system.temporal_clients,
        "operator",
    ))
    .await
    .unwrap()
}

/// The harness itself: an impostor started as a real payout's workflow id reaches the genuine
/// worker on the system's queue and gets the payout's record back. Every case below rests on
/// this: the genuine workers serve what a rogue schedules on their queues.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_impostor_on_a_payouts_own_id_is_served_by_the_genuine_worker() {
    let system = system().await;
    let input = pending_payout(system, "impostor-reads", 10_000, 1_000).await;
    let rogue = rogue(system).await;
    let id = payout_domain::workflow_id(&input.payout_id);
    rogue
        .start_impostor(
            &id,
            Script {
                payout_queue: system.task_queue.clone(),
                steps: vec![Step::new(Activity::GetPayout, json!(input.payout_id))],
                abandon_answer: None,
            },
        )
        .await
        .unwrap();
    let report = rogue.report(&id).await.unwrap();
    let Some(Outcome::Answered(snapshot)) = report.outcome(Activity::GetPayout) else {
        panic!("the genuine worker answered the impostor's read: {report:?}");
    };
    assert_eq!(snapshot["payout_id"], json!(input.payout_id), "{snapshot}");
    assert_eq!(report.steps[0].task_queue, system.task_queue);
}

/// Row 1a: a workflow of another type drives the genuine worker through TryAcquireGrant and
/// SubmitToRail for a real payout, with its own beneficiary and amount. The genuine worker
/// refuses the first activity (`ForeignCaller`): no grant is made, nothing reaches the proxy or
/// the rail, and the refusal is counted on the worker's `/metrics`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rogue_workflow_type_cannot_drive_the_genuine_worker_to_pay() {
    let system = system().await;
    let input = pending_payout(system, "rogue-type", 10_000, 1_000).await;
    let rogue = rogue(system).await;
    let report = rogue
        .rogue(Script {
            payout_queue: system.task_queue.clone(),
            steps: vec![
                Step::new(
                    Activity::TryAcquireGrant,
                    json!({"payout_id": input.payout_id, "account_id": input.account_id}),
                ),
                rogue_submit(&input),
            ],
            abandon_answer: None,
        })
        .await
        .unwrap();
    assert_eq!(
        paid_for(system, &input).await,
        [],
        "the rail paid the rogue: {report:?}"
    );
    assert_eq!(
        report.refusal(Activity::TryAcquireGrant),
        Some("ForeignCaller"),
        "{report:?}"
    );
    assert_eq!(
        report.steps.len(),
        1,
        "nothing ran after the refusal: {report:?}"
    );
    let proxydb = sqlx::PgPool::connect(&system.databases.proxydb)
        .await
        .unwrap();
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM rail_submission WHERE payout_id = $1")
        .bind(input.payout_id.as_str())
        .fetch_one(&proxydb)
        .await
        .unwrap();
    testkit::util::close_pool(proxydb).await;
    assert_eq!(rows, 0, "no proxydb row");
    // No grant was made: the account's key is free at once.
    let lock = lock_client::LockClient::connect(&system.lock_url(), &system.tls(Role::Worker))
        .await
        .unwrap();
    let session = lock
        .open_session("rogue-clients-test", Duration::from_secs(10))
        .await
        .unwrap();
    let free = session
        .acquire(&payout_domain::lock_key(&input.account_id), Duration::ZERO)
        .await
        .unwrap();
    assert!(
        matches!(free, lock_client::Acquired::Granted(_)),
        "the key was free"
    );
    let counted = system_tests::metrics::sample(
        &system_tests::metrics::scrape(system.worker_metrics[0]).await,
        "payout_activity_foreign_callers_total",
        &["activity=\"TryAcquireGrant\""],
    );
    assert!(
        counted >= 1.0,
        "the worker counted the foreign caller: {counted}"
    );
}

/// The impostor's first steps on a real payout, as the genuine workflow takes them: the grant,
/// the claim, the submission mark (the payment resource signs the instruction into its answer,
/// which the impostor does not use). Then `tail`.
fn owned_and_marked(input: &PayoutInput, tail: Vec<Step>) -> Vec<Step> {
    let payout = json!({"payout_id": input.payout_id});
    let mut steps = vec![
        Step::new(
            Activity::TryAcquireGrant,
            json!({"payout_id": input.payout_id, "account_id": input.account_id}),
        ),
        Step::new(Activity::Claim, payout.clone()),
        Step::new(Activity::MarkSubmitted, payout),
    ];
    steps.extend(tail);
    steps
}

/// Runs `tail` as an impostor on `input`'s own workflow id after [`owned_and_marked`]'s steps,
/// and returns its report; every step before the tail must have been answered.
async fn impostor_on(system: &System, input: &PayoutInput, tail: Vec<Step>) -> Report {
    let rogue = rogue(system).await;
    let id = payout_domain::workflow_id(&input.payout_id);
    rogue
        .start_impostor(
            &id,
            Script {
                payout_queue: system.task_queue.clone(),
                steps: owned_and_marked(input, tail),
                abandon_answer: None,
            },
        )
        .await
        .unwrap();
    let report = rogue.report(&id).await.unwrap();
    for step in report.steps.iter().take(3) {
        assert!(
            matches!(step.outcome, Outcome::Answered(_)),
            "the genuine worker served the impostor up to the tail: {report:?}"
        );
    }
    report
}

/// The payout's state and its `rail_fact_refused` audit rows (operation, reason), from paydb.
async fn paydb_record(system: &System, input: &PayoutInput) -> (String, Vec<(String, String)>) {
    let paydb = sqlx::PgPool::connect(&system.databases.paydb)
        .await
        .unwrap();
    let state: String = sqlx::query_scalar("SELECT state FROM payout WHERE id = $1")
        .bind(input.payout_id.as_str())
        .fetch_one(&paydb)
        .await
        .unwrap();
    let refusals = sqlx::query_as(
        "SELECT detail->>'operation', detail->>'reason' FROM audit_event \
         WHERE payout_id = $1 AND kind = 'rail_fact_refused' ORDER BY id",
    )
    .bind(input.payout_id.as_str())
    .fetch_all(&paydb)
    .await
    .unwrap();
    testkit::util::close_pool(paydb).await;
    (state, refusals)
}

/// `metric{labels}` on service `index`'s `/metrics` (`SystemPorts::metrics` order).
async fn service_counter(system: &System, index: usize, metric: &str, labels: &[&str]) -> f64 {
    system_tests::metrics::sample(
        &system_tests::metrics::scrape(system.ports.metrics[index]).await,
        metric,
        labels,
    )
}

/// `activity` (RecordOutcome or ResolveAmbiguity) was refused by the payment resource as
/// unsigned: relayed by the worker, the payout still in `state`, one `rail_fact_refused` audit
/// row, counted on the payment resource's `/metrics`.
async fn unsigned_fact_refused(
    system: &System,
    input: &PayoutInput,
    report: &Report,
    activity: Activity,
    state: &str,
) {
    let operation = match activity {
        Activity::RecordOutcome => "record_outcome",
        _ => "resolve_ambiguity",
    };
    let refused = relayed_refusal(report, activity);
    assert!(
        refused.contains("rail fact refused") && refused.contains("unsigned"),
        "{refused}"
    );
    let (now, refusals) = paydb_record(system, input).await;
    assert_eq!(now, state, "the payout's record is unchanged");
    assert_eq!(refusals, [(operation.to_string(), "unsigned".to_string())]);
    let counted = service_counter(
        system,
        1,
        "payment_rail_facts_refused_total",
        &[&format!("operation=\"{operation}\""), "reason=\"unsigned\""],
    )
    .await;
    assert!(counted >= 1.0, "the payment resource counted it: {counted}");
}

/// The refusal the genuine worker relayed for `activity`: the payment resource's or the proxy's
/// named refusal in its text (the worker carries a guard's refusal as `InvalidRequest`).
fn relayed_refusal(report: &Report, activity: Activity) -> String {
    match report.outcome(activity) {
        Some(Outcome::Refused(refusal)) => refusal.to_string(),
        other => panic!("{activity:?} was refused: {other:?} in {report:?}"),
    }
}

/// The impostor's SubmitToRail: 90 000 to `ben-rogue` for `input`'s payout, no instruction.
fn rogue_submit(input: &PayoutInput) -> Step {
    Step::new(
        Activity::SubmitToRail,
        json!({
            "payout_id": input.payout_id,
            "account_id": input.account_id,
            "amount_minor": 90_000,
            "currency": "EUR",
            "beneficiary_ref": "ben-rogue",
            "client_reference": ClientReference::for_payout(&input.payout_id),
        }),
    )
}

/// What the rail paid for `input`'s payout: (amount, beneficiary) of each movement.
async fn paid_for(system: &System, input: &PayoutInput) -> Vec<(i64, String)> {
    let cref = ClientReference::for_payout(&input.payout_id);
    rail_stub::client::StubClient::new(system.rail_stub_endpoints())
        .expect("the harness's rail client")
        .ground_truth()
        .await
        .unwrap()
        .movements
        .iter()
        .filter(|m| m.client_reference == cref.as_str())
        .map(|m| (m.amount_minor, m.beneficiary_ref.clone()))
        .collect()
}

/// Row 1b's negative control: the same impostor against a system whose rail proxy is the
/// test-only `rail-proxy-failpoint --mode instruction-unverified` (the shipped start-up with the
/// instruction check switched off). The rail pays the impostor's amount to its beneficiary: the
/// refusal in the case below is the instruction check's doing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn negative_control_with_the_instruction_unchecked_the_impostor_is_paid() {
    let system = System::start(
        Stack::shared(),
        SystemOptions {
            workers: 1,
            rail_proxy_binary: Some((
                "rail-proxy-failpoint".into(),
                vec!["--mode".into(), "instruction-unverified".into()],
            )),
            ..SystemOptions::default()
        },
    )
    .await
    .expect("the system starts");
    let input = pending_payout(&system, "impostor-paid", 100_000, 1_000).await;
    let report = impostor_on(&system, &input, vec![rogue_submit(&input)]).await;
    assert!(
        matches!(
            report.outcome(Activity::SubmitToRail),
            Some(Outcome::Answered(answer)) if answer.get("Acked").is_some()
        ),
        "the unchecked proxy sent it: {report:?}"
    );
    assert_eq!(
        paid_for(&system, &input).await,
        [(90_000, "ben-rogue".to_string())],
        "the rail paid the impostor's amount to its beneficiary"
    );
}

/// Row 1b: an impostor `PayoutWorkflow` on a real payout's own id (so the caller check passes)
/// takes the grant, claims and marks the payout submitted, then asks the genuine worker to
/// submit another amount to its own beneficiary, with no instruction. The proxy refuses it
/// (`InstructionRefused{unsigned}`): nothing reaches the rail, the refusal is in proxydb's
/// `instruction_refusal` and counted. The proxy suite's
/// `negative_control_without_the_instruction_check_an_altered_submit_is_paid` is the control.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_impostor_cannot_pay_without_the_payment_resources_instruction() {
    let system = system().await;
    let input = pending_payout(system, "impostor-pays", 100_000, 1_000).await;
    let report = impostor_on(system, &input, vec![rogue_submit(&input)]).await;
    // The worker reads any refused submit conservatively, as an unclear answer (the genuine
    // workflow would then inquire, find nothing sent, and fail the payout unpaid).
    let Some(Outcome::Answered(answer)) = report.outcome(Activity::SubmitToRail) else {
        panic!("the submit was answered: {report:?}");
    };
    let detail = answer["Ambiguous"]["detail"].as_str().unwrap_or_default();
    assert!(
        detail.contains("instruction refused") && detail.contains("unsigned"),
        "{answer}"
    );
    assert_eq!(
        paid_for(system, &input).await,
        [],
        "nothing reached the rail"
    );
    let proxydb = sqlx::PgPool::connect(&system.databases.proxydb)
        .await
        .unwrap();
    let audited: Vec<(String, String, i64)> = sqlx::query_as(
        "SELECT reason, beneficiary_ref, amount_minor FROM instruction_refusal WHERE payout_id = $1",
    )
    .bind(input.payout_id.as_str())
    .fetch_all(&proxydb)
    .await
    .unwrap();
    let submitted: i64 =
        sqlx::query_scalar("SELECT count(*) FROM rail_submission WHERE payout_id = $1")
            .bind(input.payout_id.as_str())
            .fetch_one(&proxydb)
            .await
            .unwrap();
    testkit::util::close_pool(proxydb).await;
    assert_eq!(
        audited,
        [("unsigned".to_string(), "ben-rogue".to_string(), 90_000)]
    );
    assert_eq!(submitted, 0, "no submission was recorded");
    let counted = service_counter(
        system,
        3,
        "instructions_refused_total",
        &["reason=\"unsigned\""],
    )
    .await;
    assert!(counted >= 1.0, "the proxy counted the refusal: {counted}");
}

/// Row 2a: the same impostor submits the payout as the genuine workflow would (the payment
/// resource's instruction from MarkSubmitted's answer, the payout's own amount and beneficiary):
/// the rail pays and the proxy answers ACKED. It then records the rail's DECLINED instead (money
/// gone, the customer not debited, were it recorded). The genuine worker has no signed DECLINED
/// to attach (the proxy's record says ACKED), so the payment resource refuses it
/// (`RailFactRefused{unsigned}`): the payout stays RAIL_SUBMITTED, the refusal is audited and
/// counted, and the rail holds the one payment. The payment-resource suite's
/// `negative_control_without_rail_fact_verification_the_callers_word_is_recorded` is the
/// control (the same call then fails the payout).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_impostor_cannot_record_a_decline_after_a_real_ack() {
    let system = system().await;
    let input = pending_payout(system, "impostor-declines", 10_000, 1_000).await;
    let report = impostor_on(
        system,
        &input,
        vec![
            Step::new(
                Activity::SubmitToRail,
                json!({
                    "payout_id": input.payout_id,
                    "account_id": input.account_id,
                    "amount_minor": input.amount_minor,
                    "currency": input.currency,
                    "beneficiary_ref": input.beneficiary_ref,
                    "client_reference": ClientReference::for_payout(&input.payout_id),
                    "signed_instruction": system_tests::rogue::FROM_MARK_SUBMITTED,
                }),
            ),
            Step::new(
                Activity::RecordOutcome,
                json!({
                    "payout_id": input.payout_id,
                    "outcome": {"Declined": {"decline_code": "BENEFICIARY_CLOSED"}},
                }),
            ),
        ],
    )
    .await;
    assert!(
        matches!(
            report.outcome(Activity::SubmitToRail),
            Some(Outcome::Answered(answer)) if answer.get("Acked").is_some()
        ),
        "the genuine submission was paid: {report:?}"
    );
    assert_eq!(
        paid_for(system, &input).await,
        [(
            input.amount_minor.get(),
            input.beneficiary_ref.as_str().to_string()
        )],
        "the rail paid the payout once, as instructed"
    );
    unsigned_fact_refused(
        system,
        &input,
        &report,
        Activity::RecordOutcome,
        "RAIL_SUBMITTED",
    )
    .await;
}

/// Row 2b: the impostor pushes the payout to RAIL_AMBIGUOUS with an unsigned TIMEOUT (allowed:
/// a TIMEOUT only delays), then resolves it FOUND with a rail reference of its own making. The
/// payment resource refuses it without the proxy's signed evidence: the payout stays
/// RAIL_AMBIGUOUS and nobody is debited for a movement that never happened.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_impostor_cannot_resolve_an_ambiguity_with_a_movement_that_never_happened() {
    let system = system().await;
    let input = pending_payout(system, "impostor-finds", 10_000, 1_000).await;
    let report = impostor_on(
        system,
        &input,
        vec![
            Step::new(
                Activity::RecordOutcome,
                json!({
                    "payout_id": input.payout_id,
                    "outcome": {"Timeout": {"detail": "the impostor says so"}},
                }),
            ),
            Step::new(
                Activity::ResolveAmbiguity,
                json!({
                    "payout_id": input.payout_id,
                    "evidence": {"Found": {"rail_ref": "fake"}},
                }),
            ),
        ],
    )
    .await;
    assert!(
        matches!(
            report.outcome(Activity::RecordOutcome),
            Some(Outcome::Answered(_))
        ),
        "a TIMEOUT needs no fact: {report:?}"
    );
    unsigned_fact_refused(
        system,
        &input,
        &report,
        Activity::ResolveAmbiguity,
        "RAIL_AMBIGUOUS",
    )
    .await;
}

/// Row 3e: a rogue poller answers an operator's abandon. An impostor on a real PENDING payout's
/// workflow id answers the `abandon` Update "abandoned" without anything being done. `payoutctl
/// payout abandon` checks the answer against the payment resource's record: the payout is still
/// PENDING there and no transition names the operator, so it says NOT CONFIRMED and exits 1
/// (before issue 33 it printed ACCEPTED and exited 0). The control is the operator suite
/// (`payoutctl/tests/operate.rs`), where the genuine worker's answers are confirmed (exit 0,
/// `confirmation.agrees`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abandon_answered_by_a_rogue_poller_is_not_confirmed() {
    let system = system().await;
    let input = pending_payout(system, "rogue-answers", 10_000, 1_000).await;
    let rogue = rogue(system).await;
    let id = payout_domain::workflow_id(&input.payout_id);
    let forged = payout_workflows::AbandonAnswer {
        payout_id: input.payout_id.to_string(),
        outcome: payout_workflows::AbandonOutcome::Abandoned,
        accepted: true,
        decided_by: payout_workflows::AbandonDecider::PaymentResource,
        reason: "carried out".into(),
        state: payout_domain::PayoutState::Abandoned,
    };
    rogue
        .start_impostor(
            &id,
            Script {
                payout_queue: system.task_queue.clone(),
                steps: Vec::new(),
                abandon_answer: Some(serde_json::to_value(&forged).unwrap()),
            },
        )
        .await
        .unwrap();
    let tls = system
        .pki
        .issue(Role::Operator, testkit::grants::OPERATOR)
        .expect("the operator's certificate");
    let mut cmd = std::process::Command::new(testkit::util::bin_dir().join("payoutctl"));
    for (name, _) in std::env::vars() {
        if name.starts_with("PAYOUT_") || name.starts_with("TEMPORAL_") {
            cmd.env_remove(name);
        }
    }
    let out = cmd
        .args([
            "payout",
            "abandon",
            input.payout_id.as_str(),
            "--reason",
            "customer cancelled",
            "--operator",
            testkit::grants::OPERATOR,
            "--key-file",
            system.operator.key_file.to_str().unwrap(),
            "--json",
        ])
        .env("PAYOUT_PAYMENT_URL", system.payment_url())
        .env("PAYOUT_LOCK_URL", system.lock_url())
        .env("PAYOUT_PROXY_URL", system.proxy_url())
        .env("TEMPORAL_CONFIG_FILE", &system.temporal_clients)
        .env("TEMPORAL_PROFILE", "operator")
        .env("TEMPORAL_NAMESPACE", testkit::temporal::NAMESPACE)
        .env("PAYOUT_TLS_CA", &tls.ca)
        .env("PAYOUT_TLS_CERT", &tls.cert)
        .env("PAYOUT_TLS_KEY", &tls.key)
        .output()
        .expect("payoutctl runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stdout}\n{stderr}");
    let report: serde_json::Value = serde_json::from_str(stdout.trim()).expect("--json");
    assert_eq!(
        report["answer"]["outcome"], "abandoned",
        "the impostor answered: {report}"
    );
    assert_eq!(report["confirmation"]["agrees"], false, "{report}");
    assert_eq!(report["confirmation"]["state"], "PENDING", "{report}");
    let (state, _) = paydb_record(system, &input).await;
    assert_eq!(state, "PENDING", "nothing was abandoned");
}
