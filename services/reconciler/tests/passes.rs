//! The corrective passes see every open payout at any size, and one part's error aborts nothing
//! else (issue 35, item 4). Against a real system (every service a process, the testkit's
//! Temporal), with each pass's bound set to 3 (`RECONCILE_CORRECTIVE_PER_PASS`) and payouts
//! whose workflows run sorting first:
//!
//! - the resume pass hands every stranded payout back within `ceil(open / 3)` passes (before:
//!   the first 3 rows, all running, filled its bound, and nothing was ever resumed);
//! - the orphan resolver of one process asks about every orphan within `ceil(ambiguous / 3)`
//!   passes, its cursor going on where the last pass stopped; the control, each pass from the
//!   start, never reaches the orphans past the first 3;
//! - with Temporal unreachable, the corrective passes fail and say so, and the detective checks
//!   still run and report (before: the run aborted with no report).

use std::collections::{BTreeMap, BTreeSet};

use clap::Parser;
use reconciler_service::service::{run_once, Config, Cursors};
use testkit::system::{System, SystemOptions};
use testkit::Stack;

mod common;
use common::{
    create_payouts, drive_to_ambiguous, once_json, source_args, start_unpolled_workflow,
    system_with_an_undecided_rail, Ambiguity,
};

/// Each corrective pass's bound in these tests.
const PER_PASS: usize = 3;
/// Payouts whose workflows run, made first (they sort first by age and by id).
const RUNNING: usize = 4;
/// Payouts with no workflow at all, made after them.
const STRANDED: usize = 7;

/// The corrective part's sources, Temporal at `temporal_address`, and no not-started grace.
fn corrective_args(system: &System, temporal_address: &str) -> Vec<String> {
    let mut args = source_args(system, temporal_address);
    args.extend(["--not-started-grace-ms".to_string(), "0".to_string()]);
    args
}

#[tokio::test]
async fn every_stranded_payout_is_resumed_within_the_stated_passes_though_running_ones_sort_first()
{
    // No worker: a resumed run stays RUNNING on the payout queue, so a later pass sees it running.
    let system = System::start(
        Stack::shared(),
        SystemOptions {
            workers: 0,
            ..SystemOptions::default()
        },
    )
    .await
    .unwrap();
    let running: Vec<String> = (0..RUNNING).map(|i| format!("c-0-run-{i}")).collect();
    let stranded: Vec<String> = (0..STRANDED).map(|i| format!("c-1-str-{i}")).collect();
    for (i, payout) in running.iter().enumerate() {
        create_payouts(&system, &format!("c-acct-run-{i}"), &[payout]).await;
        start_unpolled_workflow(&system, payout);
    }
    for (i, payout) in stranded.iter().enumerate() {
        create_payouts(&system, &format!("c-acct-str-{i}"), &[payout]).await;
    }
    let mut args = corrective_args(&system, &system.temporal_address);
    args.push("--resume-stranded".to_string());
    let per_pass = PER_PASS.to_string();
    // The bound the walk states: every open payout examined within ceil(open / per pass).
    let stated = (RUNNING + STRANDED).div_ceil(PER_PASS);
    let mut resumed: BTreeMap<String, usize> = BTreeMap::new();
    let mut passes = 0;
    while passes < stated && resumed.len() < STRANDED {
        passes += 1;
        let (report, _) = once_json(&args, &[("RECONCILE_CORRECTIVE_PER_PASS", &per_pass)]);
        let done = common::resumptions(&report);
        for payout in &running {
            assert!(
                !done.contains_key(payout),
                "a payout whose workflow runs is not resumed: {report:#}"
            );
        }
        for (payout, r) in done {
            if r["action"] == "RESUMED" {
                *resumed.entry(payout).or_default() += 1;
            }
        }
    }
    let expected: BTreeMap<String, usize> = stranded.iter().map(|p| (p.clone(), 1)).collect();
    assert_eq!(
        resumed, expected,
        "every stranded payout resumed once within {stated} passes (passes made: {passes})"
    );
}

/// The orphan resolver of one process (its cursor kept across runs, as `reconciler serve`
/// keeps it), in process: every orphan asked within the stated passes. The control runs each
/// pass from the start (a fresh cursor, as a one-off `reconciler once` does): the orphans past
/// the first [`PER_PASS`] are never asked, however many passes.
#[tokio::test]
async fn every_orphan_is_asked_within_the_stated_passes_of_one_process() {
    // Every orphan stays UNKNOWN, a candidate in every pass.
    let system = system_with_an_undecided_rail().await;
    let running = ["o-0-run-0", "o-0-run-1"];
    let orphans: Vec<String> = (0..5).map(|i| format!("o-1-unk-{i}")).collect();
    for (i, payout) in running.iter().enumerate() {
        drive_to_ambiguous(
            &system,
            &format!("o-acct-run-{i}"),
            payout,
            Ambiguity::NeverSubmitted,
        )
        .await;
        start_unpolled_workflow(&system, payout);
    }
    for (i, payout) in orphans.iter().enumerate() {
        drive_to_ambiguous(
            &system,
            &format!("o-acct-unk-{i}"),
            payout,
            Ambiguity::FailedBeforeActing,
        )
        .await;
    }
    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        config: Config,
    }
    let args = corrective_args(&system, &system.temporal_address)
        .into_iter()
        .chain([
            "--resolve-orphans".to_string(),
            "--corrective-per-pass".to_string(),
            PER_PASS.to_string(),
        ]);
    let config = Cli::try_parse_from(std::iter::once("reconciler".to_string()).chain(args))
        .unwrap()
        .config;
    let sources = config.sources().await.unwrap();
    let stated = (running.len() + orphans.len()).div_ceil(PER_PASS);
    let asked = |report: &reconciler_service::RunReport| -> BTreeSet<String> {
        assert!(report.errors.is_empty(), "{}", report.render());
        for r in &report.resolutions {
            assert!(
                !running.contains(&r.payout_id.as_str()),
                "a payout whose workflow runs is not touched: {r:?}"
            );
            assert_eq!(r.evidence, "UNKNOWN", "{r:?}");
        }
        assert!(report.resolutions.len() <= PER_PASS, "{}", report.render());
        report
            .resolutions
            .iter()
            .map(|r| r.payout_id.clone())
            .collect()
    };

    let cursors = Cursors::default();
    let mut seen = BTreeSet::new();
    for _ in 0..stated {
        seen.extend(asked(&run_once(&config, &sources, &cursors).await.unwrap()));
    }
    let all: BTreeSet<String> = orphans.iter().cloned().collect();
    assert_eq!(seen, all, "every orphan asked within {stated} passes");

    // Control: each pass from the start.
    let mut from_start = BTreeSet::new();
    for _ in 0..2 * stated {
        from_start.extend(asked(
            &run_once(&config, &sources, &Cursors::default())
                .await
                .unwrap(),
        ));
    }
    let first: BTreeSet<String> = orphans[..PER_PASS].iter().cloned().collect();
    assert_eq!(
        from_start, first,
        "without the cursor only the first {PER_PASS} orphans are ever asked"
    );
}

/// Temporal unreachable (nothing listens at its address): the orphan resolver and the resume
/// pass fail and say so, and the detective checks run all the same and report.
#[tokio::test]
async fn an_unreachable_temporal_fails_the_corrective_passes_and_the_checks_still_report() {
    // Every orphan stays UNKNOWN, a candidate in every pass.
    let system = system_with_an_undecided_rail().await;
    create_payouts(&system, "e-acct-0", &["e-pending"]).await;
    drive_to_ambiguous(&system, "e-acct-1", "e-orphan", Ambiguity::NeverSubmitted).await;
    let nowhere = format!("127.0.0.1:{}", testkit::free_port());
    let mut args = corrective_args(&system, &nowhere);
    args.extend([
        "--resolve-orphans".to_string(),
        "--resume-stranded".to_string(),
    ]);
    let (report, clean) = once_json(&args, &[]);
    assert!(!clean, "a run whose parts failed is not clean: {report:#}");
    let checks = report["checks"].as_array().cloned().unwrap_or_default();
    assert!(
        checks.len() > 5,
        "the detective checks ran and reported: {report:#}"
    );
    assert!(
        report["payouts_by_state"]["RAIL_AMBIGUOUS"] == 1
            && report["payouts_by_state"]["PENDING"] == 1,
        "the checks read paydb: {report:#}"
    );
    let failed: BTreeSet<&str> = report["errors"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|e| e["pass"].as_str())
        .collect();
    assert_eq!(
        failed,
        BTreeSet::from(["orphans", "resume"]),
        "each corrective pass says it failed: {report:#}"
    );
    // Nothing was done to either payout.
    assert_eq!(report["resolutions"], serde_json::json!([]), "{report:#}");
    assert_eq!(report["resumptions"], serde_json::json!([]), "{report:#}");
}
