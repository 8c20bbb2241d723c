//! Every activity call's timeouts and retry policy, stated once with the reason for each number.
//! Nothing here relies on a Temporal default: "no policy" would mean unlimited retries.

use std::time::Duration;

use temporalio_common::RetryPolicy;
use temporalio_sdk::{ActivityCloseTimeouts, ActivityOptions, LocalActivityOptions};

/// The task queue the payout worker polls.
pub const TASK_QUEUE: &str = "payouts";

/// One guard call is one short PostgreSQL transaction behind one gRPC hop; ten seconds is far
/// beyond a healthy answer and short enough that a lost worker is noticed quickly.
pub const GUARD_CALL_START_TO_CLOSE: Duration = Duration::from_secs(10);
/// Acquire waits at most the lock client's bounded wait (5 s) for a release, plus the hop.
pub const ACQUIRE_START_TO_CLOSE: Duration = Duration::from_secs(15);
/// A queued acquire waits in the lock server's first-come-first-served queue until it is granted,
/// in one activity: an hour bounds a wait that no healthy account comes near (each payout holds
/// the key for about a second), and the activity answers NotAcquired just before it, so the
/// workflow asks again with one new activity per hour of waiting.
pub const ACQUIRE_QUEUED_START_TO_CLOSE: Duration = Duration::from_secs(3_600);
/// The waiting activity heartbeats every third of this: a worker lost while its payouts wait is
/// noticed within it and the wait moves to another worker (at the back of the line). The SDK
/// sends heartbeats at most every 80% of it, so this is also the margin a busy dev server has to
/// record one (6 s here; 20 s left 4 s, and a loaded fault-suite run saw an attempt time out and
/// its grant reach nobody). A grant made as Temporal gives up on an attempt is handed back by the
/// worker once no workflow has used it for a minute (`UNCLAIMED_GRANT_MAX_MS_DEFAULT`).
pub const ACQUIRE_QUEUED_HEARTBEAT: Duration = Duration::from_secs(30);
/// The proxy gives the rail its own bounded timeout (10 s) and must then record the ending;
/// thirty seconds covers both. Overrunning it is an ambiguous outcome, never a retry.
pub const SUBMIT_START_TO_CLOSE: Duration = Duration::from_secs(30);
/// A rail lookup through the proxy: the proxy's bounded rail timeout plus the hop.
pub const INQUIRE_START_TO_CLOSE: Duration = Duration::from_secs(15);

/// A fenced activity runs on the task queue of the worker process that holds the grant. That
/// process polls its queue continuously, so a task still waiting after this long means the
/// process is gone or frozen: the workflow then treats the grant as lost and acquires a new one
/// on any live worker. Generous enough for a busy worker's backlog during a batch.
pub const FENCED_SCHEDULE_TO_START: Duration = Duration::from_secs(15);

/// First retry quickly: most transient faults are a restarting service or a connection reset.
const RETRY_INITIAL_INTERVAL: Duration = Duration::from_millis(500);
/// Doubling reaches the ceiling in about six attempts.
const RETRY_BACKOFF_COEFFICIENT: f64 = 2.0;
/// An outage of a service should not turn into a retry storm; thirty seconds between attempts
/// keeps a long outage cheap and a short one quickly recovered.
const RETRY_INTERVAL_MAX: Duration = Duration::from_secs(30);
/// Steps that are safe to repeat (acquire, lookups, fenced state transitions the table refuses
/// on repetition, posting a RAIL_ACKED payout) retry until the service answers: a RAIL_ACKED
/// payout whose posting stopped retrying would leave money moved and the ledger without its
/// row. Zero is Temporal's "no attempt limit"; the interval ceiling bounds the cost.
const SAFE_RETRY_ATTEMPTS_MAX: u32 = 0;
/// The rail submission: one attempt, ever (spec 2.3). Anything unclear is RAIL_AMBIGUOUS.
const SUBMIT_ATTEMPTS_MAX: u32 = 1;

/// The refusals are non-retryable on the failure itself; naming them here as well keeps them
/// non-retryable even if an activity forgot the flag.
const REFUSALS: [&str; 8] = [
    "FencedOut",
    "GrantLost",
    "DuplicateSubmission",
    "RefusedTransition",
    "AccountBusy",
    "ResolutionSlaNotPassed",
    "InvalidRequest",
    "ForeignCaller",
];

fn safe_to_repeat() -> RetryPolicy {
    RetryPolicy::builder()
        .initial_interval(RETRY_INITIAL_INTERVAL)
        .backoff_coefficient(RETRY_BACKOFF_COEFFICIENT)
        .maximum_interval(RETRY_INTERVAL_MAX)
        .maximum_attempts(SAFE_RETRY_ATTEMPTS_MAX)
        .non_retryable_error_types(REFUSALS)
        .build()
}

fn options(start_to_close: Duration, retry: RetryPolicy) -> ActivityOptions {
    ActivityOptions::with_start_to_close_timeout(start_to_close)
        .retry_policy(retry)
        .build()
}

/// Routes a fenced call to the worker process whose session holds `grant` (see
/// `Grant::task_queue`), bounded by [`FENCED_SCHEDULE_TO_START`]. A grant without a queue (a
/// one-worker setup) runs on the workflow's own queue.
pub fn fenced(
    mut options: ActivityOptions,
    grant: &payout_activities::types::Grant,
) -> ActivityOptions {
    if !grant.task_queue.is_empty() {
        options.task_queue = Some(grant.task_queue.clone());
        options.schedule_to_start_timeout = Some(FENCED_SCHEDULE_TO_START);
    }
    options
}

/// Claim, mark submitted, record outcome, resolve, abandon, post, reads, operator decisions.
pub fn guard_call() -> ActivityOptions {
    options(GUARD_CALL_START_TO_CLOSE, safe_to_repeat())
}

/// The pre-queue shape (a short wait, then a durable timer), kept for histories that use it.
pub fn acquire() -> ActivityOptions {
    options(ACQUIRE_START_TO_CLOSE, safe_to_repeat())
}

/// Waits in the lock server's queue until granted, heartbeating.
pub fn acquire_queued() -> ActivityOptions {
    let mut options = options(ACQUIRE_QUEUED_START_TO_CLOSE, safe_to_repeat());
    options.heartbeat_timeout = Some(ACQUIRE_QUEUED_HEARTBEAT);
    options
}

pub fn inquire() -> ActivityOptions {
    options(INQUIRE_START_TO_CLOSE, safe_to_repeat())
}

/// At most one attempt: `maximum_attempts(1)`.
pub fn submit() -> ActivityOptions {
    options(
        SUBMIT_START_TO_CLOSE,
        RetryPolicy::builder()
            .maximum_attempts(SUBMIT_ATTEMPTS_MAX)
            .non_retryable_error_types(REFUSALS)
            .build(),
    )
}

/// The same call as a local activity: run by the worker that runs the workflow task, its
/// answer recorded as a marker when that task completes (no activity task, no extra workflow
/// task). Same timeouts and retry policy as the activity form; a local retry that would wait
/// longer than [`LOCAL_RETRY_TIMER_THRESHOLD`] waits on a durable timer instead, so a long
/// outage does not hold a workflow task open.
///
/// A step that is safe to repeat tries locally for [`LOCAL_STEP_BUDGET`] at most, not for ever:
/// a worker that cannot reach a service keeps the payout's workflow tasks (they are sticky to it
/// while it polls Temporal), so an endless local retry would hold the payout there until the
/// service came back. The workflow then makes the same call as an activity task.
pub fn local(options: ActivityOptions) -> LocalActivityOptions {
    let repeatable = repeatable(&options);
    let mut local = LocalActivityOptions::default();
    local.start_to_close_timeout = options.close_timeouts.start_to_close();
    local.retry_policy = options.retry_policy.unwrap_or_else(safe_to_repeat);
    local.timer_backoff_threshold = Some(LOCAL_RETRY_TIMER_THRESHOLD);
    local.summary = options.summary.clone();
    if repeatable {
        local.schedule_to_close_timeout = Some(LOCAL_STEP_BUDGET);
    }
    local
}

/// Retried until it succeeds (Temporal's "no attempt limit"): the steps that are safe to repeat.
pub fn repeatable(options: &ActivityOptions) -> bool {
    options
        .retry_policy
        .as_ref()
        .is_some_and(|policy| policy.maximum_attempts() == SAFE_RETRY_ATTEMPTS_MAX)
}

/// How long a local step that is safe to repeat keeps trying on this worker before the call is
/// handed to an activity task: two of its attempts' start-to-close, so a restarting service
/// (seconds) is ridden out locally while a worker cut off from a service hands its payouts over
/// within this long.
pub const LOCAL_STEP_BUDGET: Duration = Duration::from_secs(20);

/// A local retry waits in the worker up to this long; longer backoffs become durable timers.
pub const LOCAL_RETRY_TIMER_THRESHOLD: Duration = Duration::from_secs(5);

/// The queued acquire, routed to the worker that ran the try (`TryAcquired::worker_queue`): the
/// grant is then made in the process that runs the payout's workflow tasks, where its local
/// steps can vouch for it. A queue nobody polls (that worker is gone) is noticed after
/// [`FENCED_SCHEDULE_TO_START`] and the workflow tries again where it now runs.
///
/// Only that worker polls its queue, so a retry there meets the same trouble: a wait that fails
/// [`PRIVATE_QUEUE_WAIT_ATTEMPTS`] times (that worker cannot get through to the lock service)
/// ends, and the workflow waits in line on the shared queue instead.
pub fn acquire_queued_on(worker_queue: &str) -> ActivityOptions {
    let mut options = acquire_queued();
    if !worker_queue.is_empty() {
        options.task_queue = Some(worker_queue.to_string());
        options.schedule_to_start_timeout = Some(FENCED_SCHEDULE_TO_START);
        if let Some(policy) = options.retry_policy.as_mut() {
            policy.set_maximum_attempts(PRIVATE_QUEUE_WAIT_ATTEMPTS);
        }
    }
    options
}

/// Attempts of a wait in line on one worker's own queue: 0.5 s and 1 s apart, enough to ride out
/// a dropped connection, short of holding a payout on a worker that cannot serve it.
pub const PRIVATE_QUEUE_WAIT_ATTEMPTS: u32 = 3;

/// Hands a grant back when the workflow no longer uses it (lost, or another payout must go
/// first), bounded: if it cannot run, the session's lease (or the worker's unclaimed-grant
/// reaper) frees the key, and the payout must not wait on it.
pub fn release_best_effort() -> ActivityOptions {
    let mut options = guard_call();
    options.close_timeouts = ActivityCloseTimeouts::ScheduleAndStartToClose {
        schedule_to_close: RELEASE_BEST_EFFORT_BUDGET,
        start_to_close: GUARD_CALL_START_TO_CLOSE,
    };
    options
}

/// See [`release_best_effort`].
pub const RELEASE_BEST_EFFORT_BUDGET: Duration = Duration::from_secs(30);

#[cfg(test)]
mod tests {
    use super::*;
    use payout_activities::refusal::Refusal;

    #[test]
    fn every_refusal_name_is_non_retryable() {
        let samples = [
            Refusal::FencedOut {
                key: String::new(),
                presented: 1,
                stored: 2,
                owner: String::new(),
            },
            Refusal::GrantLost {
                key: String::new(),
                token: 1,
                reason: String::new(),
            },
            Refusal::DuplicateSubmission {
                payout_id: String::new(),
                existing_outcome: None,
            },
            Refusal::RefusedTransition {
                payout_id: String::new(),
                from: String::new(),
                event: String::new(),
            },
            Refusal::AccountBusy {
                account_id: String::new(),
                in_flight_payout_id: String::new(),
            },
            Refusal::ResolutionSlaNotPassed {
                payout_id: String::new(),
            },
            Refusal::InvalidRequest {
                detail: String::new(),
            },
            Refusal::ForeignCaller {
                activity: String::new(),
                workflow_type: String::new(),
                workflow_id: String::new(),
                payout_id: String::new(),
            },
        ];
        for refusal in samples {
            assert!(REFUSALS.contains(&refusal.name()), "{}", refusal.name());
        }
    }

    #[test]
    fn a_local_step_that_is_safe_to_repeat_gives_up_within_its_budget_and_the_submission_keeps_its_own(
    ) {
        let read = local(guard_call());
        assert_eq!(read.schedule_to_close_timeout, Some(LOCAL_STEP_BUDGET));
        assert_eq!(read.retry_policy.maximum_attempts(), 0);
        let submission = local(submit());
        assert_eq!(submission.schedule_to_close_timeout, None);
        assert_eq!(submission.retry_policy.maximum_attempts(), 1);
        assert_eq!(
            submission.start_to_close_timeout,
            Some(SUBMIT_START_TO_CLOSE)
        );
    }

    #[test]
    fn a_wait_on_one_workers_queue_is_bounded_and_on_the_shared_queue_is_not() {
        let private = acquire_queued_on("payouts-worker-1");
        let attempts = |o: &ActivityOptions| o.retry_policy.as_ref().unwrap().maximum_attempts();
        assert_eq!(attempts(&private), PRIVATE_QUEUE_WAIT_ATTEMPTS);
        assert_eq!(attempts(&acquire_queued()), 0);
        assert_eq!(attempts(&acquire_queued_on("")), 0);
    }

    #[test]
    fn the_submission_has_exactly_one_attempt() {
        let policy = submit().retry_policy.expect("explicit policy");
        assert_eq!(policy.maximum_attempts(), 1);
    }
}
