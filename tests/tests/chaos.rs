//! Issue 8: the whole system under a seeded nemesis, checked by an independent checker, and the
//! negative controls that show each guard is load-bearing.
//!
//! Run: `cargo build --bins && cargo test -p system-tests --test chaos -- --nocapture`.
//! The long run is a command: `payoutdev chaos --payouts 5000 --faults 200`.

use system_tests::chaos::nemesis::FaultKind;
use system_tests::chaos::{self, negative, ChaosConfig, DisableGuard, Report};
use testkit::Stack;

/// CI size: a few hundred payouts and dozens of faults (every kind at least once), a few minutes
/// on a two-core machine.
const CI_PAYOUTS: usize = 200;
const CI_FAULTS: usize = 40;
const CI_SEED: u64 = 8;

fn check<'a>(report: &'a Report, name: &str) -> &'a chaos::CheckResult {
    report
        .checks
        .iter()
        .find(|c| c.name == name)
        .unwrap_or_else(|| panic!("no check {name}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn chaos_run_under_the_nemesis_has_no_violations() {
    // Its own stack: the nemesis restarts PostgreSQL servers and etcd members.
    let stack = tokio::task::block_in_place(|| {
        Stack::builder()
            .etcd_members(3)
            .capped_volumes(true)
            .start()
    })
    .expect("stack");
    let mut config = ChaosConfig::new(CI_SEED, CI_PAYOUTS, CI_FAULTS);
    config.verbose = true;
    let report = chaos::run(&stack, &config)
        .await
        .expect("the chaos run completes");
    println!("{}", report.render());
    println!("{}", serde_json::to_string(&report).unwrap());
    let injected: u64 = report.faults_injected_by_kind.values().sum();
    assert!(
        injected as usize >= CI_FAULTS * 3 / 4,
        "most faults were injected: {:?}",
        report.fault_errors
    );
    // Every kind is scheduled once first; the ones this issue singles out must have happened.
    let mut required = vec![
        FaultKind::EtcdRestore,
        FaultKind::EtcdRestoreWithoutProcedure,
        FaultKind::OutboxRedeliver,
        FaultKind::WorkerPause,
        FaultKind::EtcdLeaderKill,
        FaultKind::ForceRevoke,
        FaultKind::TemporalKill,
        FaultKind::TemporalAmnesiaDeleted,
        FaultKind::TemporalAmnesiaOldCopy,
        FaultKind::ClockJump,
        FaultKind::RollingRestart,
        FaultKind::UpgradeRollout,
    ];
    required.extend([FaultKind::AnswerLossRail, FaultKind::DispatcherGlPartition]);
    match &report.partitions_unavailable {
        None => required.extend(FaultKind::NETWORK_HOST),
        Some(why) => println!("no partitions on this machine: {why}"),
    }
    // The full disks need the stack's capped volumes (root's `mount`): where they could not be
    // made the run says why, and the "sometimes" below fails on their zero counts.
    required.extend(FaultKind::DISK);
    for kind in required {
        assert!(
            report.faults_injected_by_kind.contains_key(kind.name()),
            "{} was injected: {:?}",
            kind.name(),
            report.fault_errors
        );
    }
    assert!(
        report.safety_events["lock_token_regression_alarms"] >= 1,
        "the restore without the procedure raised the INV-04 alarm"
    );
    assert!(
        check(&report, "grants_never_overlap").checked > 0,
        "the lock history was recorded and checked"
    );
    assert!(
        check(&report, "deposed_holders_stop_within_one_lease").checked > 0,
        "an operator's revoke was paired with the grant it took, and its holder checked"
    );
    // The planted holders were stale when they reached their guards (released only after a
    // successor's write had landed there), and were refused: the pass is not vacuous. A plant
    // whose worker process exited with its call (the Temporal SDK's own panic after a pause, see
    // `Plant::worker_exited`; the supervisor starts the worker again) never reaches its guard:
    // only when every plant was lost so is the pass without one, and it says so. (That a stale
    // holder's call is refused is held on its own by
    // `planted_stale_holders_are_refused_by_the_guards_and_pay_without_the_proxy`.)
    let answered: Vec<_> = report
        .stale_holders
        .iter()
        .filter(|p| p.answer.is_some())
        .collect();
    let all_lost_with_their_worker =
        !report.stale_holders.is_empty() && report.stale_holders.iter().all(|p| p.worker_exited);
    assert!(
        !answered.is_empty() || all_lost_with_their_worker,
        "a planted stale holder reached its guard: {:?}",
        report.stale_holders
    );
    if answered.is_empty() {
        eprintln!(
            "every planted stale holder's worker exited with its call (the SDK's panic): this pass \
             had none at a guard: {:?}",
            report.stale_holders
        );
    }
    for p in answered {
        assert!(
            p.was_stale() && p.refused(),
            "a planted call reached its guard stale and was refused: {p:?}"
        );
    }
    assert!(report.rail_movements > 0, "the workload moved money");
    assert!(report.settled, "the system settled after the faults");
    assert_eq!(report.violations, 0, "{}", report.render());
    // "Sometimes" (issue 36): the run reached each hard case at least once, so no check above
    // passed vacuously for it. The counts are printed in the report's `reached:` line.
    for case in SOMETIMES {
        assert!(
            report.reached.get(case).copied().unwrap_or(0) > 0,
            "the run never reached {case}: {:?}",
            report.reached
        );
    }
}

/// The hard cases the CI-sized run must reach at least once each. The fences' refusals are met
/// by the planted stale holders: the first plant before each step is made stale by an operator's
/// revoke (`PlantMethod::Revoke`), whose worker runs on and delivers the frozen call, so each
/// guard's fence is reached whenever the stale-holder kind runs (every kind runs once at least).
const SOMETIMES: [&str; 13] = [
    chaos::checker::REACHED_FENCED_OUT_PAYMENT_RESOURCE,
    chaos::checker::REACHED_FENCED_OUT_RAIL_PROXY,
    chaos::checker::REACHED_RESOLVED_FOUND,
    chaos::checker::REACHED_RESOLVED_ABSENT,
    chaos::checker::REACHED_TOKEN_REGRESSION,
    chaos::checker::REACHED_RECOVERED_AFTER_AMNESIA,
    // A full disk refused at each store (`chaos::disk`).
    "disk_full_refused@pg_main",
    "disk_full_refused@pg_proxy",
    "disk_full_refused@etcd_member",
    "disk_full_refused@etcd_quota",
    // A lost answer recovered at each link (`chaos::answer_loss`).
    "answer_lost_recovered@payment_resource",
    "answer_lost_recovered@rail_proxy",
    "answer_lost_recovered@rail",
];

/// Stale holders planted in the running system (the nemesis's `stale_holder_planted` alone), the
/// same run with each guard configuration. A planted holder freezes after its grant check, its
/// grant is force-revoked by an operator (the first two plants; later ones are paused past their
/// lease), and its call is released only once a successor's write has landed at
/// the guard the call goes to (paydb's fence for MarkSubmitted, the proxy's high-water for
/// Submit, or with the proxy's guard off the payout's resolution): every planted call is stale
/// when it arrives, whatever the machine's speed, and each configuration's expectation holds for
/// every ordering that can then occur:
/// - Guards on: MarkSubmitted is fenced out; Submit is fenced (or a duplicate); nothing violated.
/// - Fence off: the stale MarkSubmitted lands if the payout is still CLAIMED when it arrives (the
///   successor has re-claimed but not yet marked it: a stale write, which the checker reports,
///   and nothing else), or meets the state machine's refusal if the successor got there first;
///   either way the proxy refuses the stale Submit and no money moves wrongly.
/// - Proxy off, or both off: the stale Submit is paid for a payout the system had resolved
///   FAILED (sealed as never sent): money left the account with no ledger row, and the checker
///   finds the movement of a FAILED payout. The fence cannot help there, and is not meant to:
///   the last payment resource write before Submit (MarkSubmitted) was made under the
///   still-valid grant, so the proxy is the only guard on the rail's side of the window (spec
///   2.5: INV-02 is the proxy's). Where a stale holder must cross the payment resource first, the
///   fence alone suffices: the targeted control below.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn planted_stale_holders_are_refused_by_the_guards_and_pay_without_the_proxy() {
    let stack = Stack::shared();
    for disable in [
        DisableGuard::None,
        DisableGuard::Fence,
        DisableGuard::Proxy,
        DisableGuard::Both,
    ] {
        let mut config = ChaosConfig::new(STALE_SEED, STALE_PAYOUTS, STALE_PLANTS);
        config.accounts = STALE_ACCOUNTS;
        config.kinds = Some(vec![FaultKind::StaleHolder]);
        config.partitions = false;
        config.fault_window = STALE_FAULT_WINDOW;
        config.disable = disable;
        // The claim is the guards': an honest rail pays whatever stale Submit reaches it (its
        // fault mix once declined the one plant of a run, and the control saw nothing paid).
        config.rail_faults = false;
        config.verbose = true;
        // The guards alone against the planted calls, as in every run before the reconciler
        // joined the harness: nothing else resumes or resolves a payout here.
        config.reconciler = false;
        let report = chaos::run(stack, &config).await.expect("the run completes");
        println!("{}", report.render());
        let plants = &report.stale_holders;
        for step in ["mark_submitted", "submit"] {
            assert!(
                plants.iter().any(|p| p.step == step),
                "a stale holder was planted before {step}: {:?}",
                report.fault_errors
            );
        }
        for p in plants {
            assert!(
                p.was_stale() && p.answer.is_some(),
                "every planted call reached its guard after a successor's write had landed there: {p:?}"
            );
        }
        let answers = |step: &str| -> Vec<&str> {
            plants
                .iter()
                .filter(|p| p.step == step)
                .filter_map(|p| p.answer.as_deref())
                .collect()
        };
        let (marks, submits) = (answers("mark_submitted"), answers("submit"));
        let stale_writes = check(&report, "paydb_tokens_never_decrease")
            .violations
            .len();
        let unowned_movements = check(&report, "movements_belong_to_live_payouts")
            .violations
            .len();
        // With the fence off, a stale MarkSubmitted lands or meets the state machine, by
        // whether the successor had marked the payout before it arrived.
        let fence_off_marks_ok = |marks: &[&str]| {
            marks
                .iter()
                .all(|a| matches!(*a, "accepted" | "refused_transition"))
        };
        let landed_marks = marks.iter().filter(|a| **a == "accepted").count();
        let paid_submits = submits.iter().filter(|a| **a == "accepted: acked").count();
        match disable {
            DisableGuard::None => {
                assert!(marks.iter().all(|a| *a == "fenced_out"), "{marks:?}");
                assert!(
                    submits
                        .iter()
                        .all(|a| matches!(*a, "fenced_out" | "duplicate")),
                    "{submits:?}"
                );
                assert_eq!(report.violations, 0, "{}", report.render());
            }
            DisableGuard::Fence => {
                assert!(fence_off_marks_ok(&marks), "{marks:?}");
                assert!(
                    submits
                        .iter()
                        .all(|a| matches!(*a, "fenced_out" | "duplicate")),
                    "the proxy refuses the stale Submit: {submits:?}"
                );
                assert_eq!(
                    (stale_writes, report.violations),
                    (landed_marks, landed_marks),
                    "each landed stale MarkSubmitted is reported as a stale write, and nothing else is: {}",
                    report.render()
                );
            }
            DisableGuard::Proxy | DisableGuard::Both => {
                if disable == DisableGuard::Proxy {
                    assert!(marks.iter().all(|a| *a == "fenced_out"), "{marks:?}");
                } else {
                    assert!(fence_off_marks_ok(&marks), "{marks:?}");
                }
                assert!(
                    submits.iter().all(|a| a.starts_with("accepted")),
                    "the unguarded proxy takes the stale Submit: {submits:?}"
                );
                // The unguarded proxy keeps no submission record to check tokens against; the
                // rail's book shows what landed.
                assert!(
                    paid_submits >= 1 && unowned_movements >= paid_submits,
                    "every paid stale submission moved money for a payout resolved as never sent: {}",
                    report.render()
                );
            }
        }
    }
}

/// INV-06's check on a real recorded lock history: an operator's force-revoke hands a key to a
/// second holder while the first still believes it holds it. With the revoke on record the check
/// is clean; withheld, the check sees the two holders (its negative control).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_lock_history_check_sees_two_holders_unless_an_operator_revoked_the_first() {
    let (with_revoke, without_revoke) = negative::lock_history_overlap_control(Stack::shared())
        .await
        .expect("the scenario runs");
    assert_eq!(
        with_revoke, 0,
        "break-glass ends the revoked holder's belief"
    );
    assert_eq!(without_revoke, 1, "two holders of one key at once");
}

/// INV-04's alarm, and its negative control: etcd restored from a snapshot without the procedure
/// while the lock-server also lost its issued-token record (which RESTORE.md forbids). Nothing
/// notices the rewind: the probe is granted a token it was issued before, and the checker
/// reports the missed alarm. (The same restore with the record kept is refused by the alarm:
/// `etcd_restore_without_procedure` in the nemesis run above.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_restore_that_also_loses_the_issued_token_record_is_reported() {
    // Its own stack: the restore rewinds etcd.
    let stack =
        tokio::task::block_in_place(|| Stack::builder().etcd_members(1).start()).expect("stack");
    let mut config = ChaosConfig::new(RESTORE_SEED, RESTORE_PAYOUTS, 1);
    config.kinds = Some(vec![FaultKind::EtcdRestoreWithoutProcedure]);
    config.partitions = false;
    config.fault_window = std::time::Duration::from_secs(2);
    config.lose_issued_tokens_on_restore = true;
    config.verbose = true;
    let report = chaos::run(&stack, &config)
        .await
        .expect("the run completes");
    println!("{}", report.render());
    let alarm = check(&report, "restore_without_procedure_alarm_fires");
    assert_eq!(
        alarm.violations.len(),
        1,
        "the rewound grant was reported: {}",
        report.render()
    );
    assert_eq!(report.safety_events["lock_token_regression_alarms"], 0);
}

/// Temporal's amnesia without the reconciler (its negative control): the payouts whose workflows
/// Temporal lost have nobody left to finish them, the run does not settle, and the checker names
/// them: the outside observation reproduced. (With the reconciler, the CI-sized run above
/// requires `recovered_after_temporal_amnesia` and settles.) The amnesia waits until a payout is in
/// flight; every payout is started at once, so the others wait for their accounts' keys in
/// workflows that the amnesia takes too.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn without_the_reconciler_temporal_amnesia_strands_the_payouts_open() {
    // Its own stack: the fault deletes Temporal's database.
    let stack =
        tokio::task::block_in_place(|| Stack::builder().etcd_members(1).start()).expect("stack");
    let mut config = ChaosConfig::new(AMNESIA_SEED, AMNESIA_PAYOUTS, 1);
    config.accounts = AMNESIA_ACCOUNTS;
    config.kinds = Some(vec![FaultKind::TemporalAmnesiaDeleted]);
    config.partitions = false;
    config.fault_window = std::time::Duration::from_secs(1);
    config.start_spread = Some(std::time::Duration::ZERO);
    config.reconciler = false;
    // Nothing can settle them: this bounds the wait for what must not happen.
    config.settle_timeout = AMNESIA_CONTROL_SETTLE;
    config.verbose = true;
    let report = chaos::run(&stack, &config)
        .await
        .expect("the run completes");
    println!("{}", report.render());
    assert_eq!(
        report
            .faults_injected_by_kind
            .get(FaultKind::TemporalAmnesiaDeleted.name()),
        Some(&1),
        "{:?}",
        report.fault_errors
    );
    assert!(
        report.amnesias.iter().all(|a| a.open_payouts > 0),
        "the amnesia took payouts in flight: {:?}",
        report.amnesias
    );
    assert!(!report.settled, "nothing resumed the stranded payouts");
    assert!(
        !check(&report, "every_payout_settled").violations.is_empty(),
        "the checker names the stranded payouts: {}",
        report.render()
    );
}

/// `upgrade_rollout`'s negative control: the rollout stops the old build's workers as soon as the
/// new build is current, without the drain. Payouts pinned to the old build are left on a build
/// no worker runs: the run does not settle, and every payout it leaves unsettled is one that was
/// pinned to the old build at the switch (with the drain, as in the CI-sized run above and
/// `payoutdev chaos --kinds upgrade_rollout`, the same rollout settles).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_rollout_without_the_drain_strands_the_payouts_pinned_to_the_old_build() {
    let stack = Stack::shared();
    let mut config = ChaosConfig::new(ROLLOUT_SEED, ROLLOUT_PAYOUTS, 1);
    config.accounts = ROLLOUT_ACCOUNTS;
    config.kinds = Some(vec![FaultKind::UpgradeRollout]);
    config.partitions = false;
    // Every payout started at once over few accounts: at the switch most wait for their
    // account's key in workflows already pinned to the old build.
    config.start_spread = Some(std::time::Duration::ZERO);
    config.rollout_without_drain = true;
    // Nothing can finish the stranded payouts: this bounds the wait for what must not happen.
    config.settle_timeout = ROLLOUT_CONTROL_SETTLE;
    config.verbose = true;
    let report = chaos::run(stack, &config).await.expect("the run completes");
    println!("{}", report.render());
    let [rollout] = report.rollouts.as_slice() else {
        panic!(
            "one rollout: {:?} {:?}",
            report.rollouts, report.fault_errors
        );
    };
    assert!(
        rollout.old_stopped && rollout.drain_s.is_none(),
        "{rollout:?}"
    );
    assert!(
        !rollout.pinned_at_switch.is_empty(),
        "payouts were pinned to the old build at the switch: {rollout:?}"
    );
    assert!(!report.settled, "nothing finished the stranded payouts");
    let stuck: Vec<&str> = check(&report, "every_payout_settled")
        .violations
        .iter()
        .filter_map(|v| v.detail.split_whitespace().nth(1))
        .collect();
    assert!(!stuck.is_empty(), "{}", report.render());
    for payout in &stuck {
        assert!(
            rollout.pinned_at_switch.iter().any(|p| p == payout),
            "every stranded payout was pinned to the old build at the switch: {payout} was not \
             ({:?})",
            rollout.pinned_at_switch
        );
    }
}

const ROLLOUT_SEED: u64 = 17;
const ROLLOUT_PAYOUTS: usize = 40;
const ROLLOUT_ACCOUNTS: usize = 4;
/// A payout started after the switch (or not yet pinned at it) settles on the new build within
/// this on a loaded machine; a pinned one never does.
const ROLLOUT_CONTROL_SETTLE: std::time::Duration = std::time::Duration::from_secs(60);

const AMNESIA_SEED: u64 = 13;
const AMNESIA_PAYOUTS: usize = 40;
const AMNESIA_ACCOUNTS: usize = 4;
const AMNESIA_CONTROL_SETTLE: std::time::Duration = std::time::Duration::from_secs(30);

const RESTORE_SEED: u64 = 11;
const RESTORE_PAYOUTS: usize = 40;

/// The planted-holder runs: enough payouts on few accounts that payouts are still flowing when
/// each plant is armed; two plants, one before each step.
const STALE_SEED: u64 = 5;
const STALE_PAYOUTS: usize = 60;
const STALE_ACCOUNTS: usize = 3;
const STALE_PLANTS: usize = 2;
const STALE_FAULT_WINDOW: std::time::Duration = std::time::Duration::from_secs(3);

/// Stale-holder scenarios per configuration.
const NEGATIVE_PAYOUTS: usize = 3;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn negative_controls_each_guard_alone_prevents_the_duplicate_both_off_pay_twice() {
    let stack = Stack::shared();
    let mut reports = Vec::new();
    for disable in [
        DisableGuard::None,
        DisableGuard::Fence,
        DisableGuard::Proxy,
        DisableGuard::Both,
    ] {
        let report = negative::stale_holder(stack, disable, NEGATIVE_PAYOUTS)
            .await
            .expect("scenario runs");
        println!("{}", serde_json::to_string(&report).unwrap());
        reports.push((disable, report));
    }
    for (disable, r) in &reports {
        match disable {
            DisableGuard::None => {
                assert_eq!(r.duplicate_payments(), 0, "{r:?}");
                assert_eq!(r.stale_writes(), 0, "{r:?}");
                assert_eq!(r.rail_movements, NEGATIVE_PAYOUTS, "{r:?}");
                assert!(
                    r.safety_events["paydb_fenced_out"] >= NEGATIVE_PAYOUTS as i64,
                    "{r:?}"
                );
            }
            // The fence is off; the proxy alone keeps the payment single.
            DisableGuard::Fence => {
                assert_eq!(r.duplicate_payments(), 0, "{r:?}");
                assert_eq!(r.rail_movements, NEGATIVE_PAYOUTS, "{r:?}");
                assert!(
                    r.steps.iter().all(|s| s.stale_claim_accepted),
                    "the fence really was off: {r:?}"
                );
                assert!(
                    r.steps.iter().all(|s| !s.fresh_submit_accepted),
                    "the proxy refused the second: {r:?}"
                );
            }
            // The proxy's checks are off; the fence alone stops the stale holder.
            DisableGuard::Proxy => {
                assert_eq!(r.duplicate_payments(), 0, "{r:?}");
                assert_eq!(r.stale_writes(), 0, "{r:?}");
                assert_eq!(r.rail_movements, NEGATIVE_PAYOUTS, "{r:?}");
            }
            // Both off: the checker sees the duplicate payment and the stale write.
            DisableGuard::Both => {
                assert_eq!(r.duplicate_payments(), NEGATIVE_PAYOUTS, "{r:?}");
                assert!(r.stale_writes() >= NEGATIVE_PAYOUTS, "{r:?}");
            }
        }
    }
}

/// etcd's `NOSPACE` alarm, and the negative control of RESTORE.md's procedure (issue 36): the
/// quota reached by a runaway writer's keys, then every step of "etcd's backend quota" but the
/// last (keys deleted, compacted, defragmented, NOT disarmed). The space is back and yet the lock
/// service still grants nothing: the alarm stands until an operator disarms it. Disarmed, the
/// next grant is given. (The whole procedure runs in the CI-sized run above: `etcd_nospace`, and
/// `disk_full_refused@etcd_quota` is required there.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn etcd_nospace_recovery_without_disarming_the_alarm_grants_nothing() {
    use system_tests::chaos::disk::{self, NospaceProcedure};
    use system_tests::chaos::nemesis::{Fault, Outcome};
    // Its own stack: the fault fills etcd's quota.
    let stack = tokio::task::block_in_place(|| {
        Stack::builder()
            .etcd_members(1)
            .capped_volumes(true)
            .start()
    })
    .expect("stack");
    assert_eq!(
        stack.volumes_unavailable, None,
        "the stack's quota is small"
    );
    let system = testkit::system::System::start(&stack, Default::default())
        .await
        .expect("system");
    let fault = Fault {
        at_ms: 0,
        kind: FaultKind::EtcdNospace,
        worker: 0,
        down_ms: 0,
        seed: 1,
    };
    let mut outcome = Outcome::default();
    let refused = disk::etcd_nospace_with(
        &stack,
        &system,
        &fault,
        &mut outcome,
        NospaceProcedure::WithoutDisarm,
    )
    .await
    .expect_err("without the disarm the lock service grants nothing");
    let refused = format!("{refused:#}");
    assert!(
        refused.contains("still refuses") && refused.contains("database space exceeded"),
        "{refused}"
    );
    assert!(outcome.disk_full_refusals.is_empty(), "{outcome:?}");
    // The missing step, as RESTORE.md gives it; then a grant.
    tokio::task::block_in_place(|| stack.etcd.etcdctl_as_root(&["alarm", "disarm"]))
        .expect("alarm disarm");
    let token = disk::grant_once(&system, "payout:chaos-nospace-control")
        .await
        .expect("granted once disarmed");
    assert!(token > 0);
}
