//! Issue 8: the whole system under a seeded nemesis, checked by an independent checker, and the
//! negative controls that show each guard is load-bearing.
//!
//! Run: `cargo build --bins && cargo test -p system-tests --test chaos -- --nocapture`.
//! The long run is a command: `payoutctl chaos --payouts 5000 --faults 200`.

use system_tests::chaos::{self, negative, ChaosConfig, DisableGuard};
use testkit::Stack;

/// CI size: fits a few minutes on a two-core machine.
const CI_PAYOUTS: usize = 80;
const CI_FAULTS: usize = 20;
const CI_SEED: u64 = 8;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn chaos_run_under_the_nemesis_has_no_violations() {
    // Its own stack: the nemesis restarts PostgreSQL servers and etcd members.
    let stack =
        tokio::task::block_in_place(|| Stack::builder().etcd_members(3).start()).expect("stack");
    let mut config = ChaosConfig::new(CI_SEED, CI_PAYOUTS, CI_FAULTS);
    config.verbose = true;
    let report = chaos::run(&stack, &config)
        .await
        .expect("the chaos run completes");
    println!("{}", report.render());
    println!("{}", serde_json::to_string(&report).unwrap());
    let injected: u64 = report.faults_injected_by_kind.values().sum();
    assert!(
        injected as usize >= CI_FAULTS / 2,
        "most faults were injected: {:?}",
        report.fault_errors
    );
    assert!(report.rail_movements > 0, "the workload moved money");
    assert!(report.settled, "the system settled after the faults");
    assert_eq!(report.violations, 0, "{}", report.render());
}

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
