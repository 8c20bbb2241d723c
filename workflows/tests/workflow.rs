//! The payout workflow on a real Temporal dev server (testkit), against activities whose
//! services are the controllable in-memory world of `payout-activities` (feature
//! `test-backend`). Each test runs its own worker on its own task queue with its own world.
//!
//! Histories: with `PAYOUT_RECORD_HISTORIES=1` each test exports its workflow's history with
//! `temporal workflow show --output json` into `tests/histories/`; `replay_committed_histories`
//! replays every committed file against the current workflow code.

use std::sync::Arc;
use std::time::Duration;

use payout_activities::in_memory::{InMemoryBackend, RailScript};
use payout_activities::types::{AmbiguityPolicy, Inquiry, PayoutInput, PayoutStartInput};
use payout_activities::PayoutActivities;
use payout_domain::{AccountId, AmountMinor, BeneficiaryRef, Currency, PayoutId, PayoutState};
use payout_workflows::{
    AbandonAnswer, AbandonDecider, AbandonOutcome, AbandonSignal, PayoutResult, PayoutStatus,
    PayoutWorkflow,
};
use temporalio_client::{
    Client, WorkflowFetchHistoryOptions, WorkflowGetResultOptions, WorkflowQueryOptions,
    WorkflowStartOptions,
};
use temporalio_sdk::workflow_replayer::{WorkflowReplayer, WorkflowReplayerOptions};
use temporalio_sdk::{Runtime, Worker, WorkerOptions};
use testkit::Stack;

/// A payout settles in well under a second here; this bounds a test that went wrong.
const SETTLE_TIMEOUT: Duration = Duration::from_secs(60);
const HISTORIES_DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/histories");

async fn client() -> Client {
    // Through the Temporal front, as an operator (the tests start and drive workflows).
    let args = payout_workflows::client::TemporalArgs::profile_of(
        Stack::shared().temporal().clients_file(),
        "operator",
    );
    payout_workflows::client::connect_configured(&args, "payout-workflow-tests")
        .await
        .unwrap()
}

fn input(name: &str, amount: i64, ambiguity: AmbiguityPolicy) -> PayoutInput {
    let unique = Stack::shared().unique_prefix(name).replace(['/', ':'], "-");
    let unique = unique.trim_matches('-').to_string();
    PayoutInput {
        payout_id: PayoutId::parse(format!("p-{unique}")).unwrap(),
        account_id: AccountId::parse(format!("a-{unique}")).unwrap(),
        amount_minor: AmountMinor::new(amount).unwrap(),
        currency: Currency::parse("EUR").unwrap(),
        beneficiary_ref: BeneficiaryRef::parse("ben-1").unwrap(),
        ambiguity,
    }
}

fn fast_ambiguity() -> AmbiguityPolicy {
    AmbiguityPolicy {
        settlement_window_ms: 200,
        resolution_sla_ms: 600_000,
    }
}

/// Runs a worker for `world` on its own task queue while `body` runs, then shuts it down.
async fn with_worker<F, Fut, T>(world: &InMemoryBackend, queue: &str, body: F) -> T
where
    F: FnOnce(Client, String) -> Fut,
    Fut: std::future::Future<Output = T>,
{
    let runtime = Runtime::from_current_tokio(Default::default()).unwrap();
    let client = client().await;
    let options = WorkerOptions::new(queue)
        .register_workflow::<PayoutWorkflow>()
        .unwrap()
        .register_activities(PayoutActivities::new(Arc::new(world.clone())))
        .build();
    let mut worker = Worker::new(&runtime, client.clone(), options).unwrap();
    let shutdown = worker.shutdown_handle();
    let (run, out) = tokio::join!(worker.run(), async {
        let out = body(client, queue.to_string()).await;
        shutdown();
        out
    });
    run.unwrap();
    out
}

async fn start(client: &Client, queue: &str, input: &PayoutInput) -> String {
    let id = payout_domain::workflow_id(&input.payout_id);
    client
        .start_workflow(
            PayoutWorkflow::run,
            PayoutStartInput::from(input),
            WorkflowStartOptions::new(queue, id.clone()).build(),
        )
        .await
        .unwrap();
    id
}

async fn result(client: &Client, id: &str) -> PayoutResult {
    let handle = client.get_workflow_handle::<PayoutWorkflow>(id);
    tokio::time::timeout(
        SETTLE_TIMEOUT,
        handle.get_result(WorkflowGetResultOptions::default()),
    )
    .await
    .expect("workflow settles in time")
    .unwrap()
}

async fn status(client: &Client, id: &str) -> PayoutStatus {
    client
        .get_workflow_handle::<PayoutWorkflow>(id)
        .query(PayoutWorkflow::status, (), WorkflowQueryOptions::default())
        .await
        .unwrap()
}

/// Until the workflow `id` waits for its account's key (another holder has it).
async fn waiting_for_the_lock(client: &Client, id: &str) {
    testkit::eventually(SETTLE_TIMEOUT, "waiting for the lock", || async {
        status(client, id)
            .await
            .last_event
            .starts_with("WAITING_FOR_LOCK")
            .then_some(())
    })
    .await
    .unwrap();
}

/// The operator path: exactly what an operator types.
fn signal_abandon(id: &str, operator: &str, reason: &str) {
    let input = serde_json::json!({ "operator": operator, "reason": reason }).to_string();
    Stack::shared()
        .temporal()
        .cli(&[
            "workflow",
            "signal",
            "--namespace",
            "default",
            "--workflow-id",
            id,
            "--name",
            "abandon",
            "--input",
            &input,
        ])
        .unwrap();
}

/// Exports the finished workflow's history from the server, in the JSON shape the SDK's
/// `WorkflowHistory::from_json` reads. (The CLI's `temporal workflow show --output json` is
/// protobuf-JSON, which this SDK version cannot parse: its history types are not pbjson.)
async fn record_history(client: &Client, name: &str, id: &str) {
    if std::env::var_os("PAYOUT_RECORD_HISTORIES").is_none() {
        return;
    }
    let json = client
        .get_workflow_handle::<PayoutWorkflow>(id)
        .fetch_history(WorkflowFetchHistoryOptions::builder().build())
        .to_json()
        .await
        .unwrap();
    std::fs::write(format!("{HISTORIES_DIR}/{name}.json"), json).unwrap();
}

fn queue(name: &str) -> String {
    Stack::shared().unique_prefix(&format!("q-{name}"))
}

/// A 1,000 payout of 5,000 whose rail accepts and never answers, and whose every inquiry is
/// "rail cannot say": it goes RAIL_AMBIGUOUS and stays there until someone abandons it.
fn ambiguous_forever(name: &str, resolution_sla_ms: u64) -> (InMemoryBackend, PayoutInput) {
    let world = InMemoryBackend::new("worker-a");
    let input = input(
        name,
        1_000,
        AmbiguityPolicy {
            settlement_window_ms: 300,
            resolution_sla_ms,
        },
    );
    world.open_account(&input.account_id, 5_000);
    world.create_payout(&input, RailScript::TimeoutAfterAcceptance);
    let unknown = Inquiry::Unknown {
        detail: "rail cannot say".into(),
    };
    world.script_inquiries(&input.payout_id, vec![unknown; 1_000]);
    (world, input)
}

#[tokio::test]
async fn normal_path_posts_once_and_keeps_search_attributes_current() {
    let world = InMemoryBackend::new("worker-a");
    let input = input("normal", 1_000, fast_ambiguity());
    world.open_account(&input.account_id, 5_000);
    world.create_payout(&input, RailScript::Ack);
    let q = queue("normal");
    let (id, done, st) = with_worker(&world, &q, |client, q| async move {
        let id = start(&client, &q, &input).await;
        let done = result(&client, &id).await;
        let st = status(&client, &id).await;
        (id, done, st)
    })
    .await;
    assert_eq!(done.state, PayoutState::Posted);
    assert!(done.rail_ref.starts_with("rail-cref-"));
    assert_eq!(world.rail_movements(&done.payout_id), 1);
    assert_eq!(world.postings(&done.payout_id), 1);
    assert_eq!(world.balance(&world_account(&done)), 4_000);
    assert_eq!(st.state, PayoutState::Posted);
    assert_eq!(st.token, done.token);
    assert_eq!(st.claimer, "worker-a");
    assert!(st.last_event.contains("RELEASED"), "{}", st.last_event);
    // The grant is released at the end.
    assert!(world.lock_holder(&world_account(&done)).is_none());
    // Operators find it by its search attributes.
    let listed = Stack::shared()
        .temporal()
        .cli(&[
            "workflow",
            "list",
            "--namespace",
            "default",
            "--query",
            &format!(
                "PayoutState='POSTED' AND AccountId='{}'",
                world_account(&done)
            ),
        ])
        .unwrap();
    assert!(listed.contains(&id), "{listed}");
    // An uncontended payout's steps all ran as local activities on the workflow's worker
    // (get, try-acquire, claim, mark submitted, submit, record outcome, post, release): markers
    // in its history, not one activity task.
    let kinds = event_kinds(&client().await, &id).await;
    assert!(
        !kinds.iter().any(|k| k.starts_with("ActivityTask")),
        "{kinds:?}"
    );
    assert_eq!(
        kinds.iter().filter(|k| *k == "MarkerRecorded").count(),
        8 + 1,
        "eight steps and the patch marker: {kinds:?}"
    );
    record_history(&client().await, "normal_path", &id).await;
}

fn world_account(done: &PayoutResult) -> AccountId {
    AccountId::parse(done.payout_id.as_str().replacen("p-", "a-", 1)).unwrap()
}

#[tokio::test]
async fn decline_fails_without_posting() {
    let world = InMemoryBackend::new("worker-a");
    let input = input("decline", 1_000, fast_ambiguity());
    world.open_account(&input.account_id, 5_000);
    world.create_payout(&input, RailScript::Decline);
    let q = queue("decline");
    let (id, done) = with_worker(&world, &q, |client, q| async move {
        let id = start(&client, &q, &input).await;
        (id.clone(), result(&client, &id).await)
    })
    .await;
    assert_eq!(done.state, PayoutState::Failed);
    assert_eq!(done.failure_reason, "INSUFFICIENT_BENEFICIARY_DETAILS");
    assert_eq!(world.postings(&done.payout_id), 0);
    assert_eq!(world.balance(&world_account(&done)), 5_000);
    record_history(&client().await, "decline", &id).await;
}

#[tokio::test]
async fn insufficient_funds_fails_without_a_rail_call() {
    let world = InMemoryBackend::new("worker-a");
    let input = input("funds", 9_000, fast_ambiguity());
    world.open_account(&input.account_id, 5_000);
    world.create_payout(&input, RailScript::Ack);
    let q = queue("funds");
    let done = with_worker(&world, &q, |client, q| async move {
        let id = start(&client, &q, &input).await;
        result(&client, &id).await
    })
    .await;
    assert_eq!(done.state, PayoutState::Failed);
    assert_eq!(done.failure_reason, "FUNDS_INSUFFICIENT");
    assert_eq!(world.submit_calls(&done.payout_id), 0);
}

#[tokio::test]
async fn timeout_after_acceptance_is_ambiguous_then_resolved_found_and_posted() {
    let world = InMemoryBackend::new("worker-a");
    let input = input("amb-found", 1_000, fast_ambiguity());
    world.open_account(&input.account_id, 5_000);
    world.create_payout(&input, RailScript::TimeoutAfterAcceptance);
    world.script_inquiries(
        &input.payout_id,
        vec![Inquiry::Unknown {
            detail: "not settled yet".into(),
        }],
    );
    let q = queue("amb-found");
    let (id, done) = with_worker(&world, &q, |client, q| async move {
        let id = start(&client, &q, &input).await;
        (id.clone(), result(&client, &id).await)
    })
    .await;
    assert_eq!(done.state, PayoutState::Posted);
    assert_eq!(world.submit_calls(&done.payout_id), 1, "never resubmitted");
    assert_eq!(world.rail_movements(&done.payout_id), 1);
    assert_eq!(world.postings(&done.payout_id), 1);
    record_history(&client().await, "ambiguous_found", &id).await;
}

#[tokio::test]
async fn timeout_before_rail_is_ambiguous_then_resolved_absent_and_failed() {
    let world = InMemoryBackend::new("worker-a");
    let input = input("amb-absent", 1_000, fast_ambiguity());
    world.open_account(&input.account_id, 5_000);
    world.create_payout(&input, RailScript::TimeoutBeforeRail);
    let q = queue("amb-absent");
    let done = with_worker(&world, &q, |client, q| async move {
        let id = start(&client, &q, &input).await;
        result(&client, &id).await
    })
    .await;
    assert_eq!(done.state, PayoutState::Failed);
    assert_eq!(world.submit_calls(&done.payout_id), 1);
    assert_eq!(world.postings(&done.payout_id), 0);
}

#[tokio::test]
async fn a_failed_submission_activity_is_never_retried_and_becomes_ambiguous() {
    let world = InMemoryBackend::new("worker-a");
    let input = input("amb-crash", 1_000, fast_ambiguity());
    world.open_account(&input.account_id, 5_000);
    world.create_payout(&input, RailScript::ActivityFailsAfterRail);
    let q = queue("amb-crash");
    let done = with_worker(&world, &q, |client, q| async move {
        let id = start(&client, &q, &input).await;
        result(&client, &id).await
    })
    .await;
    assert_eq!(done.state, PayoutState::Posted);
    assert_eq!(
        world.submit_calls(&done.payout_id),
        1,
        "maximum_attempts(1): the failed attempt is not retried"
    );
    assert_eq!(world.rail_movements(&done.payout_id), 1);
    assert_eq!(world.postings(&done.payout_id), 1);
}

#[tokio::test]
async fn a_lost_grant_is_reacquired_with_a_higher_token_and_the_payout_continues() {
    let world = InMemoryBackend::new("worker-a");
    let input = input("lost-grant", 1_000, fast_ambiguity());
    world.open_account(&input.account_id, 5_000);
    world.create_payout(&input, RailScript::Ack);
    world.expire_session_after_submit();
    let q = queue("lost-grant");
    let (id, done) = with_worker(&world, &q, |client, q| async move {
        let id = start(&client, &q, &input).await;
        (id.clone(), result(&client, &id).await)
    })
    .await;
    assert_eq!(done.state, PayoutState::Posted);
    assert_eq!(world.submit_calls(&done.payout_id), 1, "not resubmitted");
    assert_eq!(world.rail_movements(&done.payout_id), 1);
    assert_eq!(world.postings(&done.payout_id), 1);
    // The first grant's token was 1; the re-acquired one is higher and is the fence now.
    let token = done.token.expect("a grant").get();
    assert!(token > 1, "re-acquired token {token}");
    assert_eq!(world.fence(&world_account(&done)), token);
    record_history(&client().await, "lost_grant", &id).await;
}

#[tokio::test]
async fn abandon_of_a_pending_payout_is_recorded_then_honoured() {
    let world = InMemoryBackend::new("worker-a");
    let input = input("abandon-pending", 1_000, fast_ambiguity());
    world.open_account(&input.account_id, 5_000);
    world.create_payout(&input, RailScript::Ack);
    // Another payout of the account holds the lock: this one waits in PENDING.
    let other = world.hold_lock_elsewhere(&input.account_id);
    let q = queue("abandon-pending");
    let w = world.clone();
    let (id, done) = with_worker(&world, &q, |client, q| async move {
        let id = start(&client, &q, &input).await;
        waiting_for_the_lock(&client, &id).await;
        signal_abandon(&id, "alice", "customer withdrew the request");
        testkit::eventually(SETTLE_TIMEOUT, "the decision recorded", || async {
            (!w.decisions().is_empty()).then_some(())
        })
        .await
        .unwrap();
        w.release_elsewhere(&other);
        (id.clone(), result(&client, &id).await)
    })
    .await;
    assert_eq!(done.state, PayoutState::Abandoned);
    let decisions = world.decisions();
    assert_eq!(decisions.len(), 1);
    assert!(decisions[0].accepted);
    assert_eq!(decisions[0].operator, "alice");
    assert_eq!(world.submit_calls(&done.payout_id), 0);
    record_history(&client().await, "abandon_pending", &id).await;
}

/// The kinds of the events in the workflow's history, in order.
async fn event_kinds(client: &Client, id: &str) -> Vec<String> {
    client
        .get_workflow_handle::<PayoutWorkflow>(id)
        .fetch_history(WorkflowFetchHistoryOptions::builder().build())
        .into_events()
        .await
        .unwrap()
        .iter()
        .map(|e| format!("{:?}", e.event_type()))
        .collect()
}

/// Waiting for the account's key is one activity in the lock server's queue: a payout that
/// waited ten seconds has the same history as one that waited one second (before the queue, it
/// added an acquire attempt and a timer every four seconds, and two workflow tasks with them).
#[tokio::test]
async fn a_payout_that_waits_for_its_account_adds_nothing_to_its_history_while_it_waits() {
    let world = InMemoryBackend::new("worker-a");
    let long = input("waited-long", 1_000, fast_ambiguity());
    let short = input("waited-short", 1_000, fast_ambiguity());
    for i in [&long, &short] {
        world.open_account(&i.account_id, 5_000);
        world.create_payout(i, RailScript::Ack);
    }
    let long_holder = world.hold_lock_elsewhere(&long.account_id);
    let short_holder = world.hold_lock_elsewhere(&short.account_id);
    let q = queue("waited");
    let w = world.clone();
    let (long_events, short_events) = with_worker(&world, &q, |client, q| async move {
        let short_id = start(&client, &q, &short).await;
        waiting_for_the_lock(&client, &short_id).await;
        tokio::time::sleep(Duration::from_secs(1)).await;
        w.release_elsewhere(&short_holder);
        assert_eq!(result(&client, &short_id).await.state, PayoutState::Posted);
        let id = start(&client, &q, &long).await;
        waiting_for_the_lock(&client, &id).await;
        tokio::time::sleep(Duration::from_secs(10)).await;
        w.release_elsewhere(&long_holder);
        assert_eq!(result(&client, &id).await.state, PayoutState::Posted);
        (
            event_kinds(&client, &id).await,
            event_kinds(&client, &short_id).await,
        )
    })
    .await;
    // Before the queue, ten seconds of waiting added an acquire attempt and a timer every four
    // seconds. Now the wait is one activity however long it lasts. A workflow task may end early
    // to answer a status query, so the two histories may differ by one workflow task (three
    // events), never by what the wait's length would add.
    for events in [&long_events, &short_events] {
        assert!(
            !events.iter().any(|k| k.starts_with("Timer")),
            "no timer while waiting: {events:?}"
        );
        assert_eq!(
            events
                .iter()
                .filter(|k| *k == "ActivityTaskScheduled")
                .count(),
            1,
            "one waiting activity: {events:?}"
        );
    }
    assert!(
        long_events.len() <= short_events.len() + 3,
        "ten seconds of waiting leave the history of one second:\n{long_events:?}\n{short_events:?}"
    );
}

#[tokio::test]
async fn abandon_is_refused_before_the_sla_and_honoured_after_it() {
    let (world, input) = ambiguous_forever("abandon-amb", 3_000);
    // The payment resource's own SLA, the same as the workflow's here.
    world.set_resolution_sla(Duration::from_millis(3_000));
    let q = queue("abandon-amb");
    let w = world.clone();
    let (id, done) = with_worker(&world, &q, |client, q| async move {
        let id = start(&client, &q, &input).await;
        testkit::eventually(SETTLE_TIMEOUT, "RAIL_AMBIGUOUS", || async {
            (status(&client, &id).await.state == PayoutState::RailAmbiguous).then_some(())
        })
        .await
        .unwrap();
        // Before the SLA: refused, and the refusal is recorded.
        signal_abandon(&id, "bob", "too early");
        testkit::eventually(SETTLE_TIMEOUT, "the refusal recorded", || async {
            (w.decisions().len() == 1).then_some(())
        })
        .await
        .unwrap();
        assert!(!w.decisions()[0].accepted);
        assert_eq!(status(&client, &id).await.state, PayoutState::RailAmbiguous);
        // Time alone resolves nothing: past the SLA the payout is still ambiguous.
        testkit::eventually(SETTLE_TIMEOUT, "the SLA passed", || async {
            status(&client, &id)
                .await
                .resolution_sla_passed
                .then_some(())
        })
        .await
        .unwrap();
        assert_eq!(status(&client, &id).await.state, PayoutState::RailAmbiguous);
        signal_abandon(&id, "carol", "finance ticket 42");
        (id.clone(), result(&client, &id).await)
    })
    .await;
    assert_eq!(done.state, PayoutState::Abandoned);
    let decisions = world.decisions();
    assert_eq!(decisions.len(), 2);
    assert!(decisions[1].accepted);
    assert_eq!(decisions[1].operator, "carol");
    assert_eq!(world.submit_calls(&done.payout_id), 1);
    assert_eq!(world.postings(&done.payout_id), 0);
    record_history(&client().await, "abandon_ambiguous", &id).await;
}

/// Starts the workflow of `id`'s payout with a raw JSON input, as `temporal workflow start
/// --input '...'` would.
async fn start_raw(client: &Client, queue: &str, id: &str, raw: serde_json::Value) {
    client
        .start_workflow(
            PayoutWorkflow::run,
            PayoutStartInput(raw),
            WorkflowStartOptions::new(queue, id.to_string()).build(),
        )
        .await
        .unwrap();
}

/// The workflow's failure, as text (type and message), within a bound.
async fn failure(client: &Client, id: &str) -> String {
    let handle = client.get_workflow_handle::<PayoutWorkflow>(id);
    let outcome = tokio::time::timeout(
        SETTLE_TIMEOUT,
        handle.get_result(WorkflowGetResultOptions::default()),
    )
    .await
    .expect("the workflow ends in time");
    format!("{:?}", outcome.expect_err("the workflow fails"))
}

/// A start input the workflow cannot use fails the workflow at once, non-retryably, naming the
/// field. (With a typed input, the first workflow task failed to decode and was retried for
/// ever, the workflow sitting RUNNING.)
#[tokio::test]
async fn start_inputs_it_cannot_use_fail_at_once_naming_the_field() {
    let world = InMemoryBackend::new("worker-a");
    let q = queue("bad-input");
    let cases = [
        ("payout_id", serde_json::json!({})),
        ("payout_id", serde_json::json!({"payout_id": 5})),
        (
            "amount_minor",
            serde_json::json!({"payout_id": "p-1", "amount_minor": -5}),
        ),
        (
            "amount",
            serde_json::json!({"payout_id": "p-1", "amount": 100}),
        ),
        (
            "ambiguity.settlement_window_ms",
            serde_json::json!({"payout_id": "p-1", "ambiguity": {"settlement_window_ms": 0, "resolution_sla_ms": 1000}}),
        ),
        ("(input)", serde_json::json!(["p-1"])),
    ];
    with_worker(&world, &q, |client, q| async move {
        for (i, (field, raw)) in cases.into_iter().enumerate() {
            let id = format!("{q}-bad-{i}").replace(['/', ':'], "-");
            start_raw(&client, &q, &id, raw.clone()).await;
            let failure = failure(&client, &id).await;
            assert!(
                failure.contains("InvalidInput") && failure.contains(field),
                "{raw}: {failure}"
            );
        }
    })
    .await;
}

/// What the rail is asked to pay is the payment resource's record: a start input that describes
/// the payout differently (a typo in a hand-started workflow) stops before anything is claimed,
/// and says which field; one that gives only the payout id pays what was recorded.
#[tokio::test]
async fn the_rail_is_asked_for_the_recorded_payout_never_for_the_input() {
    let world = InMemoryBackend::new("worker-a");
    let input = input("recorded", 1_000, fast_ambiguity());
    world.open_account(&input.account_id, 5_000);
    world.create_payout(&input, RailScript::Ack);
    let mut typo = input.clone();
    typo.amount_minor = AmountMinor::new(9_999).unwrap();
    let q = queue("recorded");
    let w = world.clone();
    let payout = input.payout_id.clone();
    let done = with_worker(&world, &q, |client, q| async move {
        // Under the payout's own id: the worker serves no other (ForeignCaller). The corrected
        // start below reuses the id of this failed run.
        let id = payout_domain::workflow_id(&input.payout_id);
        start_raw(&client, &q, &id, PayoutStartInput::from(&typo).0).await;
        let failure = failure(&client, &id).await;
        assert!(
            failure.contains("InputDisagreesWithRecord")
                && failure.contains("amount_minor: the input says 9999, the payout record says 1000"),
            "{failure}"
        );
        assert_eq!(w.state(&input.payout_id), PayoutState::Pending);
        assert_eq!(w.fence(&input.account_id), 0, "nothing was claimed");
        start_raw(
            &client,
            &q,
            &id,
            serde_json::json!({"payout_id": input.payout_id.as_str(), "ambiguity": fast_ambiguity()}),
        )
        .await;
        result(&client, &id).await
    })
    .await;
    assert_eq!(done.state, PayoutState::Posted);
    assert_eq!(world.submitted_amount(&payout), Some(1_000));
    assert_eq!(world.submit_calls(&payout), 1);
}

/// Operator input cannot fail a payout: an abandon without an operator, without a reason (or
/// with neither field at all), or with an oversize reason is refused, the refusal is on record,
/// and the payout goes on to settle. (Before, a missing field failed the signal's decoding, and
/// an empty one was refused by the audit trail, which failed the workflow.)
#[tokio::test]
async fn an_unusable_abandon_is_refused_on_record_and_the_payout_goes_on() {
    let world = InMemoryBackend::new("worker-a");
    let input = input("bad-abandon", 1_000, fast_ambiguity());
    world.open_account(&input.account_id, 5_000);
    world.create_payout(&input, RailScript::Ack);
    let other = world.hold_lock_elsewhere(&input.account_id);
    let q = queue("bad-abandon");
    let w = world.clone();
    let done = with_worker(&world, &q, |client, q| async move {
        let id = start(&client, &q, &input).await;
        waiting_for_the_lock(&client, &id).await;
        let long = "x".repeat(1_001);
        for raw in [
            "{}".to_string(),
            serde_json::json!({"operator": "", "reason": "r"}).to_string(),
            serde_json::json!({"operator": "dave", "reason": long}).to_string(),
        ] {
            Stack::shared()
                .temporal()
                .cli(&[
                    "workflow",
                    "signal",
                    "--namespace",
                    "default",
                    "--workflow-id",
                    &id,
                    "--name",
                    "abandon",
                    "--input",
                    &raw,
                ])
                .unwrap();
        }
        testkit::eventually(SETTLE_TIMEOUT, "three refusals recorded", || async {
            (w.decisions().len() == 3).then_some(())
        })
        .await
        .unwrap();
        w.release_elsewhere(&other);
        result(&client, &id).await
    })
    .await;
    assert_eq!(done.state, PayoutState::Posted);
    let decisions = world.decisions();
    assert!(decisions.iter().all(|d| !d.accepted), "{decisions:?}");
    assert_eq!(decisions[0].operator, "(missing)");
    assert!(
        decisions[0].note.contains("operator is missing"),
        "{decisions:?}"
    );
    assert!(
        decisions[1].note.contains("operator is missing"),
        "{decisions:?}"
    );
    assert!(
        decisions[2].note.contains("reason is longer"),
        "{decisions:?}"
    );
    assert_eq!(world.submit_calls(&done.payout_id), 1);
}

/// The race: an abandon accepted while the payout was PENDING, then a concurrent run claims it
/// first. The payment resource refuses the abandon; it is withdrawn on record, not left armed
/// (before, it stayed armed and abandoned the payout the moment it reached RAIL_AMBIGUOUS, with
/// no SLA and no inquiry); the payout goes on and is resolved by evidence.
#[tokio::test]
async fn an_abandon_overtaken_by_a_concurrent_claim_is_withdrawn_not_left_armed() {
    let world = InMemoryBackend::new("worker-a");
    let input = input("abandon-race", 1_000, fast_ambiguity());
    world.open_account(&input.account_id, 5_000);
    world.create_payout(&input, RailScript::TimeoutBeforeRail);
    // The resource would allow an abandon of an ambiguous payout at once: only the withdrawal
    // keeps the old acceptance from being carried out there.
    world.set_resolution_sla(Duration::ZERO);
    let unknown = Inquiry::Unknown {
        detail: "not yet".into(),
    };
    world.script_inquiries(&input.payout_id, vec![unknown, Inquiry::Absent]);
    let other = world.hold_lock_elsewhere(&input.account_id);
    let q = queue("abandon-race");
    let w = world.clone();
    let done = with_worker(&world, &q, |client, q| async move {
        let id = start(&client, &q, &input).await;
        waiting_for_the_lock(&client, &id).await;
        signal_abandon(&id, "alice", "customer withdrew the request");
        testkit::eventually(SETTLE_TIMEOUT, "the acceptance recorded", || async {
            (w.decisions().len() == 1).then_some(())
        })
        .await
        .unwrap();
        // A concurrent run of the same payout claims it under the key it held.
        w.claim_elsewhere(&input.payout_id, &other);
        w.release_elsewhere(&other);
        result(&client, &id).await
    })
    .await;
    assert_eq!(done.state, PayoutState::Failed, "{done:?}");
    let decisions = world.decisions();
    assert_eq!(decisions.len(), 2, "{decisions:?}");
    assert!(decisions[0].accepted);
    assert!(!decisions[1].accepted);
    assert!(decisions[1].note.starts_with("withdrawn"), "{decisions:?}");
}

/// The payment resource decides the resolution SLA from its own record: when it refuses an
/// abandon the workflow accepted on its own clock, that is an answer (the abandon is withdrawn
/// on record and the payout stays RAIL_AMBIGUOUS, still asking the rail), never a failure. Once
/// the resource's SLA has passed, a new abandon is carried out. (Before, the refusal failed the
/// workflow while it held the account's grant.)
#[tokio::test]
async fn the_resources_sla_refusal_is_an_answer_not_a_failure() {
    let (world, input) = ambiguous_forever("sla-refused", 1_000);
    let q = queue("sla-refused");
    let w = world.clone();
    let done = with_worker(&world, &q, |client, q| async move {
        let id = start(&client, &q, &input).await;
        testkit::eventually(SETTLE_TIMEOUT, "the workflow's SLA passed", || async {
            status(&client, &id)
                .await
                .resolution_sla_passed
                .then_some(())
        })
        .await
        .unwrap();
        signal_abandon(&id, "erin", "finance ticket 7");
        // The withdrawal as recorded in the resource's audit trail (the status query's last
        // event shows it only until the next step, too briefly to poll for).
        let withdrawn = testkit::eventually(SETTLE_TIMEOUT, "the withdrawal", || async {
            w.decisions()
                .into_iter()
                .find(|d| !d.accepted && d.note.starts_with("withdrawn"))
        })
        .await
        .unwrap();
        assert!(withdrawn.note.contains("resolution SLA"), "{withdrawn:?}");
        assert_eq!(status(&client, &id).await.state, PayoutState::RailAmbiguous);
        w.set_resolution_sla(Duration::ZERO);
        signal_abandon(&id, "erin", "finance ticket 7, again");
        result(&client, &id).await
    })
    .await;
    assert_eq!(done.state, PayoutState::Abandoned, "{done:?}");
    let decisions = world.decisions();
    let accepted: Vec<bool> = decisions.iter().map(|d| d.accepted).collect();
    assert_eq!(accepted, [true, false, true], "{decisions:?}");
    assert_eq!(world.postings(&done.payout_id), 0);
}

/// The operator path for the Update: exactly what an operator types. The answer's JSON, or the
/// CLI's error (a rejected Update) as text. The CLI waits for the answer, so it runs off the
/// test's runtime, where the worker runs.
async fn update_abandon(id: &str, input: &str) -> Result<AbandonAnswer, String> {
    update_abandon_as(id, input, None).await
}

/// The same, with the Update's id (`--update-id`): a repeat of an id is the same Update.
async fn update_abandon_as(
    id: &str,
    input: &str,
    update_id: Option<&str>,
) -> Result<AbandonAnswer, String> {
    let (id, input) = (id.to_string(), input.to_string());
    let update_id = update_id.map(str::to_string);
    let out = tokio::task::spawn_blocking(move || {
        let mut args = vec![
            "workflow",
            "update",
            "execute",
            "--namespace",
            "default",
            "--workflow-id",
            &id,
            "--name",
            "abandon",
            "--input",
            &input,
            "--output",
            "json",
        ];
        if let Some(update_id) = &update_id {
            args.extend(["--update-id", update_id.as_str()]);
        }
        Stack::shared().temporal().cli(&args)
    })
    .await
    .unwrap()
    .map_err(|e| e.to_string())?;
    let printed: serde_json::Value =
        serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"));
    Ok(serde_json::from_value(printed["result"].clone()).unwrap_or_else(|e| panic!("{e}: {out}")))
}

/// A CLI command that needs the worker to answer (a query), run off the test's runtime.
async fn cli_off_runtime(args: &[&str]) -> String {
    let mut args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
    args.extend(["--namespace".to_string(), "default".to_string()]);
    tokio::task::spawn_blocking(move || {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        Stack::shared().temporal().cli(&args)
    })
    .await
    .unwrap()
    .unwrap()
}

fn abandon_input(operator: &str, reason: &str) -> String {
    serde_json::json!({ "operator": operator, "reason": reason }).to_string()
}

/// The Update on a PENDING payout waiting for its account's key: it answers at once that the
/// abandon is accepted and on record (the decision is in the audit trail before the answer),
/// and carries it out once the key comes. A second abandon meanwhile, as a signal, is refused on
/// record; as an Update, rejected at once; neither acts again.
#[tokio::test]
async fn the_abandon_update_answers_at_once_and_is_carried_out_once() {
    let world = InMemoryBackend::new("worker-a");
    let input = input("update-pending", 1_000, fast_ambiguity());
    world.open_account(&input.account_id, 5_000);
    world.create_payout(&input, RailScript::Ack);
    let other = world.hold_lock_elsewhere(&input.account_id);
    let q = queue("update-pending");
    let w = world.clone();
    let (id, done) = with_worker(&world, &q, |client, q| async move {
        // Started as every starter starts it: the UI's summary and details come with the start.
        let id = payout_domain::workflow_id(&input.payout_id);
        client
            .start_workflow(
                PayoutWorkflow::run,
                PayoutStartInput::from(&input),
                payout_workflows::start_options(&q, &input),
            )
            .await
            .unwrap();
        waiting_for_the_lock(&client, &id).await;
        let described = cli_off_runtime(&["workflow", "describe", "--workflow-id", &id]).await;
        assert!(
            described.contains(&format!("Payout {}: EUR 10.00 from", input.payout_id)),
            "the summary: {described}"
        );
        assert!(
            described.contains("**Client reference** `cref-"),
            "the details: {described}"
        );
        let metadata = cli_off_runtime(&["workflow", "metadata", "--workflow-id", &id]).await;
        assert!(
            metadata.contains("**Waiting for** the account's lock `payout:a-"),
            "the current details: {metadata}"
        );
        assert!(metadata.contains("**Pays** EUR 10.00"), "{metadata}");
        let input_alice = abandon_input("alice", "customer withdrew");
        let answer = update_abandon_as(&id, &input_alice, Some("alice-1"))
            .await
            .unwrap();
        // The same Update sent again (a retried command): the same answer, nothing new done.
        let repeated = update_abandon_as(&id, &input_alice, Some("alice-1"))
            .await
            .unwrap();
        assert_eq!(repeated, answer);
        assert_eq!(
            answer.outcome,
            AbandonOutcome::AcceptedWaitingForLock,
            "{answer:?}"
        );
        assert!(answer.accepted);
        assert_eq!(answer.state, PayoutState::Pending);
        assert_eq!(answer.reason, "PENDING: operator cancel");
        // On record before the answer, and before anything acted on it.
        let decisions = w.decisions();
        assert_eq!(decisions.len(), 1, "{decisions:?}");
        assert!(decisions[0].accepted);
        assert_eq!(w.state(&input.payout_id), PayoutState::Pending);
        let again = update_abandon(&id, &abandon_input("bob", "again"))
            .await
            .unwrap_err();
        assert!(
            again.contains("an abandon is already being carried out"),
            "{again}"
        );
        signal_abandon(&id, "bob", "again, as a signal");
        testkit::eventually(SETTLE_TIMEOUT, "the second refused on record", || async {
            (w.decisions().len() == 2).then_some(())
        })
        .await
        .unwrap();
        w.release_elsewhere(&other);
        (id.clone(), result(&client, &id).await)
    })
    .await;
    assert_eq!(done.state, PayoutState::Abandoned);
    let decisions = world.decisions();
    let seen: Vec<(&str, bool)> = decisions
        .iter()
        .map(|d| (d.operator.as_str(), d.accepted))
        .collect();
    assert_eq!(seen, [("alice", true), ("bob", false)], "{decisions:?}");
    assert!(decisions[1].note.contains("already being carried out"));
    assert_eq!(world.submit_calls(&done.payout_id), 0);
    record_history(&client().await, "update_abandon_pending", &id).await;
}

/// Past the resolution SLA (the workflow's and the resource's), the Update answers once the
/// payment resource has carried the abandon out; before the resource's own SLA, it answers with
/// the resource's refusal, and the payout goes on.
#[tokio::test]
async fn the_abandon_update_answers_with_what_the_payment_resource_did() {
    let (world, input) = ambiguous_forever("update-amb", 1_000);
    let q = queue("update-amb");
    let w = world.clone();
    let (id, done) = with_worker(&world, &q, |client, q| async move {
        let id = start(&client, &q, &input).await;
        testkit::eventually(SETTLE_TIMEOUT, "RAIL_AMBIGUOUS", || async {
            (status(&client, &id).await.state == PayoutState::RailAmbiguous).then_some(())
        })
        .await
        .unwrap();
        // Before the workflow's SLA: rejected at once, nothing recorded.
        let early = update_abandon(&id, &abandon_input("bob", "too early"))
            .await
            .unwrap_err();
        assert!(early.contains("resolution SLA has not passed"), "{early}");
        assert!(w.decisions().is_empty());
        testkit::eventually(SETTLE_TIMEOUT, "the workflow's SLA passed", || async {
            status(&client, &id)
                .await
                .resolution_sla_passed
                .then_some(())
        })
        .await
        .unwrap();
        // The resource's own record says the SLA has not passed: its refusal is the answer.
        let request = AbandonSignal {
            operator: "erin".into(),
            reason: "finance ticket 7".into(),
            signature: String::new(),
            signed_at_unix_ms: 0,
        };
        let refused = payout_workflows::abandon::execute(&client, &id, request.clone(), None)
            .await
            .unwrap();
        assert_eq!(refused.outcome, AbandonOutcome::Refused, "{refused:?}");
        assert!(!refused.accepted);
        assert_eq!(refused.decided_by, AbandonDecider::PaymentResource);
        assert!(refused.reason.contains("resolution SLA"), "{refused:?}");
        assert_eq!(refused.state, PayoutState::RailAmbiguous);
        let recorded: Vec<bool> = w.decisions().iter().map(|d| d.accepted).collect();
        assert_eq!(
            recorded,
            [true, false],
            "accepted, then withdrawn on record"
        );
        w.set_resolution_sla(Duration::ZERO);
        let abandoned = payout_workflows::abandon::execute(&client, &id, request, None)
            .await
            .unwrap();
        assert_eq!(
            abandoned.outcome,
            AbandonOutcome::Abandoned,
            "{abandoned:?}"
        );
        assert!(abandoned.accepted);
        assert_eq!(abandoned.decided_by, AbandonDecider::PaymentResource);
        assert_eq!(abandoned.state, PayoutState::Abandoned);
        (id.clone(), result(&client, &id).await)
    })
    .await;
    assert_eq!(done.state, PayoutState::Abandoned, "{done:?}");
    let recorded: Vec<bool> = world.decisions().iter().map(|d| d.accepted).collect();
    assert_eq!(recorded, [true, false, true]);
    assert_eq!(world.postings(&done.payout_id), 0);
    record_history(&client().await, "update_abandon_ambiguous", &id).await;
}

/// The status query says what the payment resource decided: an unsigned abandon of a PENDING
/// payout, which the workflow would accept, is recorded by a resource that verifies operators as
/// refused ("operator not verified"). The signal's decision is then REFUSED in `last_event`, the
/// Update's answer is refused by the payment resource with its reason, nothing is armed, and the
/// payout is paid once its account's key comes. (Before, the query said `ABANDON ACCEPTED` and
/// the Update answered accepted and waiting for the lock, against the record.)
#[tokio::test]
async fn an_abandon_the_payment_resource_records_as_refused_is_refused_not_armed() {
    let world = InMemoryBackend::new("worker-a");
    world.refuse_unsigned_operators();
    let input = input("abandon-unverified", 1_000, fast_ambiguity());
    world.open_account(&input.account_id, 5_000);
    world.create_payout(&input, RailScript::Ack);
    let other = world.hold_lock_elsewhere(&input.account_id);
    let q = queue("abandon-unverified");
    let w = world.clone();
    let (id, done) = with_worker(&world, &q, |client, q| async move {
        let id = start(&client, &q, &input).await;
        waiting_for_the_lock(&client, &id).await;
        signal_abandon(&id, "operator-1", "no signature");
        // The decision is on record, then the workflow's account of it.
        testkit::eventually(SETTLE_TIMEOUT, "the decision recorded", || async {
            (w.decisions().len() == 1).then_some(())
        })
        .await
        .unwrap();
        let decided = testkit::eventually(SETTLE_TIMEOUT, "the decision in the status", || async {
            let s = status(&client, &id).await;
            s.last_event.starts_with("ABANDON").then_some(s)
        })
        .await
        .unwrap();
        assert!(
            decided
                .last_event
                .starts_with("ABANDON REFUSED by the payment resource (asked by operator-1)"),
            "{decided:?}"
        );
        assert!(
            decided
                .last_event
                .contains("operator not verified (unsigned)"),
            "{decided:?}"
        );
        assert_eq!(decided.state, PayoutState::Pending);
        // The same through the Update: answered with the resource's refusal.
        let request = AbandonSignal {
            operator: "operator-1".into(),
            reason: "no signature, as an Update".into(),
            signature: String::new(),
            signed_at_unix_ms: 0,
        };
        let answer = payout_workflows::abandon::execute(&client, &id, request, None)
            .await
            .unwrap();
        assert_eq!(answer.outcome, AbandonOutcome::Refused, "{answer:?}");
        assert!(!answer.accepted);
        assert_eq!(answer.decided_by, AbandonDecider::PaymentResource);
        assert!(
            answer.reason.contains("operator not verified (unsigned)"),
            "{answer:?}"
        );
        assert_eq!(answer.state, PayoutState::Pending);
        let metadata = cli_off_runtime(&["workflow", "metadata", "--workflow-id", &id]).await;
        assert!(
            metadata.contains("ABANDON REFUSED by the payment resource"),
            "the UI's current details: {metadata}"
        );
        assert!(
            !metadata.contains("accepted and on record"),
            "the UI's current details: {metadata}"
        );
        w.release_elsewhere(&other);
        (id.clone(), result(&client, &id).await)
    })
    .await;
    assert_eq!(done.state, PayoutState::Posted, "{done:?}");
    let decisions = world.decisions();
    assert_eq!(decisions.len(), 2, "{decisions:?}");
    assert!(decisions.iter().all(|d| !d.accepted), "{decisions:?}");
    assert_eq!(world.submit_calls(&done.payout_id), 1);
    record_history(&client().await, "abandon_refused_by_resource", &id).await;
}

/// What the validator turns down is rejected at once with the reason, recorded nowhere, and the
/// payout goes on: input that does not parse, no operator, a state where abandon is never
/// allowed. A closed workflow's Update fails as the server reports it.
#[tokio::test]
async fn the_abandon_update_rejects_what_it_can_decide_alone() {
    let world = InMemoryBackend::new("worker-a");
    let input = input("update-rejected", 1_000, fast_ambiguity());
    world.open_account(&input.account_id, 5_000);
    world.create_payout(&input, RailScript::TimeoutBeforeRail);
    world.script_inquiries(
        &input.payout_id,
        vec![
            Inquiry::Unknown {
                detail: "not yet".into(),
            };
            1_000
        ],
    );
    let q = queue("update-rejected");
    let w = world.clone();
    with_worker(&world, &q, |client, q| async move {
        let id = start(&client, &q, &input).await;
        testkit::eventually(SETTLE_TIMEOUT, "RAIL_AMBIGUOUS", || async {
            (status(&client, &id).await.state == PayoutState::RailAmbiguous).then_some(())
        })
        .await
        .unwrap();
        let unparsable = update_abandon(&id, r#""abandon it please""#)
            .await
            .unwrap_err();
        assert!(unparsable.contains("invalid type"), "{unparsable}");
        let no_operator = update_abandon(&id, &abandon_input(" ", "why"))
            .await
            .unwrap_err();
        assert!(
            no_operator.contains("the operator is missing"),
            "{no_operator}"
        );
        let early = update_abandon(&id, &abandon_input("bob", "too early"))
            .await
            .unwrap_err();
        assert!(early.contains("resolution SLA has not passed"), "{early}");
        assert!(w.decisions().is_empty(), "nothing recorded");
        assert_eq!(status(&client, &id).await.state, PayoutState::RailAmbiguous);
    })
    .await;
}

/// Every event id (`event_id`, `*_event_id`) above `removed` one lower, as if that event had
/// never been written.
fn renumber_after(value: &mut serde_json::Value, removed: u64) {
    match value {
        serde_json::Value::Object(fields) => {
            for (key, field) in fields.iter_mut() {
                match field.as_u64() {
                    Some(id) if key.ends_with("event_id") && id > removed => {
                        *field = serde_json::Value::from(id - 1)
                    }
                    _ => renumber_after(field, removed),
                }
            }
        }
        serde_json::Value::Array(items) => {
            items.iter_mut().for_each(|i| renumber_after(i, removed))
        }
        _ => {}
    }
}

#[tokio::test]
async fn replay_committed_histories() {
    let mut files: Vec<_> = std::fs::read_dir(HISTORIES_DIR)
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    files.sort();
    // The v1_ histories were recorded before the queued acquire (QUEUED_ACQUIRE_PATCH) and
    // replay on its old path; the v2_ ones with it, before the local steps (LOCAL_STEPS_PATCH),
    // and replay on the activity path; the others were recorded with local steps
    // (`local_step_gave_up`: a local acquire that gave up on a worker cut off from the lock
    // service, the run then on activity tasks). `real_backend_normal_path` is the real services'
    // shape since issue 33 (the signed instruction in MarkSubmitted's answer and SubmitToRail's
    // input, the proxy's signed outcome in its answer and RecordOutcome's input);
    // `v3_real_backend_normal_path` the same path recorded before, without them.
    for required in [
        "normal_path",
        "real_backend_normal_path",
        "v3_real_backend_normal_path",
        "local_step_gave_up",
        "decline",
        "v1_normal_path",
        "v1_decline",
        "v2_normal_path",
        "v2_decline",
        "update_abandon_pending",
        "update_abandon_ambiguous",
    ] {
        assert!(
            files.iter().any(|p| p.file_stem().unwrap() == required),
            "history {required}.json must be committed"
        );
    }
    let replayer = WorkflowReplayer::new(
        WorkflowReplayerOptions::new()
            .register_workflow::<PayoutWorkflow>()
            .unwrap()
            .build(),
    )
    .unwrap();
    for file in files {
        let bytes = std::fs::read(&file).unwrap();
        let history = temporalio_client::WorkflowHistory::from_json(&bytes).unwrap();
        replayer
            .replay_workflow(history)
            .await
            .unwrap_or_else(|e| panic!("{} does not replay: {e}", file.display()));
    }
    // Negative control: a history whose second activity differs from what the code schedules
    // must be reported as nondeterministic, or the replays above prove nothing.
    let bytes = std::fs::read_to_string(format!("{HISTORIES_DIR}/v2_normal_path.json")).unwrap();
    let tampered = bytes.replacen(
        r#""activity_type":{"name":"AcquireGrant"}"#,
        r#""activity_type":{"name":"Claim"}"#,
        1,
    );
    assert_ne!(bytes, tampered, "the history names AcquireGrant");
    let history = temporalio_client::WorkflowHistory::from_json(tampered.as_bytes()).unwrap();
    assert!(
        replayer.replay_workflow(history).await.is_err(),
        "a changed activity sequence must fail replay"
    );
    // The abandon Update answers only after its decision is on record: a history in which it
    // answered with no RecordOperatorDecision before it (the marker removed, the later events
    // renumbered) is not what this code does, and must fail replay.
    let bytes =
        std::fs::read_to_string(format!("{HISTORIES_DIR}/update_abandon_pending.json")).unwrap();
    let mut tampered: serde_json::Value = serde_json::from_str(&bytes).unwrap();
    let events = tampered["events"].as_array_mut().unwrap();
    // Event types: 25 MarkerRecorded, 41 UpdateAccepted, 43 UpdateCompleted.
    let accepted = events.iter().position(|e| e["event_type"] == 41).unwrap();
    let record = accepted + 1;
    assert_eq!(
        events[record]["event_type"], 25,
        "the record follows the acceptance"
    );
    assert_eq!(
        events[record + 1]["event_type"],
        43,
        "the answer follows the record"
    );
    let removed = events.remove(record)["event_id"].as_u64().unwrap();
    for event in events.iter_mut() {
        renumber_after(event, removed);
    }
    let tampered = serde_json::to_vec(&tampered).unwrap();
    let history = temporalio_client::WorkflowHistory::from_json(&tampered).unwrap();
    // The code answers only once the record is there: it has no answer for that UpdateCompleted.
    let replayed = format!("{:?}", replayer.replay_workflow(history).await);
    assert!(
        replayed.contains("Nondeterminism")
            && replayed.contains("WorkflowExecutionUpdateCompleted"),
        "an abandon Update answered before its audit record must fail replay: {replayed}"
    );
}
