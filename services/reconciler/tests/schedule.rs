//! The reconciler talks to Temporal through its client, never the `temporal` CLI: its schedule
//! is created once and kept across restarts (and concurrent replicas), a changed interval
//! updates it, and describing a workflow that does not exist is Temporal's typed not-found
//! (gRPC NOT_FOUND), told apart from Temporal being unreachable. A real dev server.

use std::time::Duration;

use payout_workflows::client::{connect_configured, TemporalArgs};
use reconciler_service::service::{
    ensure_schedule, schedule_intervals, ScheduleOutcome, ServeOptions, RECONCILE_WORKFLOW_TYPE,
};
use resolver::resume::{ResumeError, Temporal, TemporalConfig, WorkflowStatus};
use temporalio_client::schedules::ScheduleDescriptionAction;
use testkit::Stack;

fn temporal_args() -> TemporalArgs {
    TemporalArgs::profile_of(Stack::shared().temporal().clients_file(), "reconciler")
}

fn serve(schedule_id: &str, interval: Duration) -> ServeOptions {
    ServeOptions {
        task_queue: format!("{schedule_id}-queue"),
        schedule_id: schedule_id.to_string(),
        interval,
        identity: "schedule-test".into(),
        keeper_interval: reconciler_service::service::KEEPER_INTERVAL,
    }
}

/// The schedule's interval(s) in whole seconds, as Temporal describes it.
async fn intervals_s(client: &temporalio_client::Client, schedule_id: &str) -> Vec<i64> {
    let described = client
        .get_schedule_handle(schedule_id)
        .describe(Default::default())
        .await
        .unwrap();
    let ScheduleDescriptionAction::StartWorkflow(action) = described.action() else {
        panic!("the schedule starts no workflow")
    };
    assert_eq!(action.workflow_type(), RECONCILE_WORKFLOW_TYPE);
    assert_eq!(action.task_queue(), format!("{schedule_id}-queue"));
    schedule_intervals(&described)
        .iter()
        .map(|d| d.as_secs() as i64)
        .collect()
}

#[tokio::test]
async fn the_schedule_is_created_once_and_kept_on_restart() {
    let client = connect_configured(&temporal_args(), "schedule-test")
        .await
        .unwrap();
    let id = "reconciler-idempotent";
    let every_5s = serve(id, Duration::from_secs(5));
    assert_eq!(
        ensure_schedule(&client, &every_5s).await.unwrap(),
        ScheduleOutcome::Created
    );
    // A restart (the same configuration) finds it and leaves it alone.
    assert_eq!(
        ensure_schedule(&client, &every_5s).await.unwrap(),
        ScheduleOutcome::Unchanged
    );
    assert_eq!(intervals_s(&client, id).await, vec![5]);

    // A redeployment with another interval updates it in place.
    let every_7s = serve(id, Duration::from_secs(7));
    assert_eq!(
        ensure_schedule(&client, &every_7s).await.unwrap(),
        ScheduleOutcome::Updated
    );
    assert_eq!(intervals_s(&client, id).await, vec![7]);
    assert_eq!(
        ensure_schedule(&client, &every_7s).await.unwrap(),
        ScheduleOutcome::Unchanged
    );

    // Two replicas starting at once: one creates, the other reads ALREADY_EXISTS as success.
    let raced = "reconciler-raced";
    let options = serve(raced, Duration::from_secs(5));
    let (a, b) = tokio::join!(
        ensure_schedule(&client, &options),
        ensure_schedule(&client, &options)
    );
    let mut outcomes = vec![a.unwrap(), b.unwrap()];
    outcomes.sort_by_key(|o| format!("{o:?}"));
    assert_eq!(
        outcomes,
        vec![ScheduleOutcome::Created, ScheduleOutcome::Unchanged]
    );

    // Exactly one schedule of each id exists.
    let listed = Stack::shared()
        .temporal()
        .cli(&[
            "schedule",
            "list",
            "--namespace",
            testkit::temporal::NAMESPACE,
            "--output",
            "json",
        ])
        .unwrap();
    let listed: serde_json::Value = serde_json::from_str(&listed).unwrap_or_else(|e| {
        panic!("temporal schedule list --output json: {e}: {listed}");
    });
    for schedule in [id, raced] {
        let count = listed
            .as_array()
            .unwrap()
            .iter()
            .filter(|s| s["scheduleId"] == schedule)
            .count();
        assert_eq!(count, 1, "{schedule} listed {count} times: {listed}");
    }
}

fn resolver_config(connection: TemporalArgs) -> TemporalConfig {
    TemporalConfig {
        connection,
        payout_task_queue: "schedule-test-payouts".into(),
        settlement_window_ms: 500,
        resolution_sla_ms: 60_000,
    }
}

#[tokio::test]
async fn describing_a_missing_workflow_is_the_typed_not_found() {
    let temporal = Temporal::connect(&resolver_config(temporal_args()))
        .await
        .unwrap();
    assert_eq!(
        temporal.status("payout-never-started").await.unwrap(),
        WorkflowStatus::NotFound
    );

    // The control: a workflow that exists is described as such (here the reconciler's own,
    // started on a queue nobody polls, so it stays running).
    let client = connect_configured(&temporal_args(), "schedule-test")
        .await
        .unwrap();
    client
        .start_workflow(
            reconciler_service::service::ReconcileWorkflow::run,
            (),
            temporalio_client::WorkflowStartOptions::new(
                "nobody-polls-this-queue",
                "reconcile-describe-control",
            )
            .build(),
        )
        .await
        .unwrap();
    assert_eq!(
        temporal.status("reconcile-describe-control").await.unwrap(),
        WorkflowStatus::Running
    );

    // Temporal unreachable is an error, never read as "no workflow" (which would resume it).
    let closed_port = testkit::free_port();
    let unreachable = Temporal::connect(&resolver_config(TemporalArgs::at(
        format!("127.0.0.1:{closed_port}"),
        testkit::temporal::NAMESPACE,
    )))
    .await;
    assert!(
        matches!(unreachable, Err(ResumeError::Connect { .. })),
        "{:?}",
        unreachable.err()
    );
}
