//! What one run of the process did: the checks' report, the corrective outcomes before it, and
//! the error of each part that failed (the others ran all the same).

use reconciler::Report;
use resolver::{resolve::Resolution, resume::Resumption};
use serde::{Deserialize, Serialize};

/// The three parts of a run, each run whatever the others did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Pass {
    /// The orphan resolver (`--resolve-orphans`).
    Orphans,
    /// The resume pass (`--resume-stranded`).
    Resume,
    /// The detective checks.
    Checks,
}

impl Pass {
    pub const ALL: [Pass; 3] = [Pass::Orphans, Pass::Resume, Pass::Checks];

    /// The label of `reconciler_pass_errors_total{pass}` and of the report's errors.
    pub fn as_str(&self) -> &'static str {
        match self {
            Self::Orphans => "orphans",
            Self::Resume => "resume",
            Self::Checks => "checks",
        }
    }
}

/// A part of the run that failed as a whole (its source unreachable, its configuration
/// incomplete); what it did before it failed is not reported.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PassError {
    pub pass: Pass,
    pub detail: String,
}

impl PassError {
    pub fn new(pass: Pass, error: &anyhow::Error) -> Self {
        Self {
            pass,
            detail: format!("{error:#}"),
        }
    }
}

/// One run: the detective checks' [`Report`] (none if they failed), what the resolver did
/// before them, and each part's error. Its JSON is the checks' object with `resolutions`,
/// `resumptions` and `errors` after their fields.
#[derive(Debug, Clone, Serialize)]
pub struct RunReport {
    #[serde(flatten)]
    pub checks: Option<Report>,
    /// Orphaned RAIL_AMBIGUOUS payouts handled before the checks ran (`--resolve-orphans`).
    pub resolutions: Vec<Resolution>,
    /// Stranded payouts handed back to a workflow before the checks ran (`--resume-stranded`).
    pub resumptions: Vec<Resumption>,
    /// The parts of the run that failed; the others ran.
    pub errors: Vec<PassError>,
}

impl RunReport {
    /// Whether the checks ran and found nothing and no part of the run failed (what the resolver
    /// did is not a finding).
    pub fn is_clean(&self) -> bool {
        self.errors.is_empty() && self.checks.as_ref().is_some_and(Report::is_clean)
    }

    /// A readable table: the checks, then the orphans and the stranded payouts handled (when
    /// there were any), then the parts that failed, then the total of violations.
    pub fn render(&self) -> String {
        let mut out = self
            .checks
            .as_ref()
            .map(Report::render_checks)
            .unwrap_or_default();
        if !self.resolutions.is_empty() {
            out.push_str(&format!(
                "{:<24} {:<12} {:<11} {:<14} {:>6}  DETAIL\n",
                "ORPHAN", "WORKFLOW", "EVIDENCE", "NEW STATE", "TOKEN"
            ));
            for r in &self.resolutions {
                out.push_str(&format!(
                    "{:<24} {:<12} {:<11} {:<14} {:>6}  {}\n",
                    r.payout_id,
                    r.workflow,
                    r.evidence,
                    r.new_state,
                    r.token.map(|t| t.to_string()).unwrap_or_default(),
                    r.detail
                ));
            }
        }
        if !self.resumptions.is_empty() {
            out.push_str(&format!(
                "{:<24} {:<14} {:<12} {:<16} {:<28}  DETAIL\n",
                "STRANDED", "STATE", "WORKFLOW", "ACTION", "KEY TAKEN FROM"
            ));
            for r in &self.resumptions {
                out.push_str(&format!(
                    "{:<24} {:<14} {:<12} {:<16} {:<28}  {}\n",
                    if r.payout_id.is_empty() {
                        &r.account_id
                    } else {
                        &r.payout_id
                    },
                    r.state,
                    r.workflow,
                    r.action,
                    r.took_over_from.as_deref().unwrap_or("-"),
                    r.detail
                ));
            }
        }
        for e in &self.errors {
            out.push_str(&format!("  ERROR {}: {}\n", e.pass.as_str(), e.detail));
        }
        match &self.checks {
            Some(checks) => out.push_str(&checks.render_total()),
            None => out.push_str("violations: unknown (the checks did not run)\n"),
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use reconciler::{Check, Report};
    use resolver::{resolve::Resolution, resume::Resumption};

    use super::{Pass, PassError, RunReport};

    fn run_report() -> RunReport {
        RunReport {
            checks: Some(Report {
                checks: vec![
                    Check {
                        name: "one_in_flight_payout_per_account",
                        invariant: "INV-01",
                        examined: 3,
                        violations: vec!["account a has several payouts in flight: x,y".into()],
                        skipped: None,
                        note: None,
                        partial: None,
                    },
                    Check {
                        name: "guard_tokens_were_granted",
                        invariant: "INV-07",
                        examined: 0,
                        violations: Vec::new(),
                        skipped: Some("no etcd".into()),
                        note: Some("a note".into()),
                        partial: None,
                    },
                ],
                violations: 1,
                payouts_by_state: BTreeMap::from([("POSTED".into(), 2), ("FAILED".into(), 1)]),
                rail_movements: 2,
                rail_cursor: None,
                outbox_pending: 0,
                ambiguous_payouts: vec!["po-1".into()],
                audit_heads: Vec::new(),
                watermark: reconciler::Watermark {
                    paydb_unix_ms: 0,
                    proxydb_unix_ms: 0,
                    gldb_unix_ms: 0,
                    full_pass_unix_ms: 0,
                },
                accounts_examined: None,
            }),
            resolutions: vec![
                Resolution {
                    payout_id: "po-1".into(),
                    account_id: "acc-1".into(),
                    workflow: "NOT_FOUND".into(),
                    evidence: "FOUND".into(),
                    new_state: "POSTED".into(),
                    token: Some(7),
                    detail: "d".into(),
                },
                Resolution {
                    payout_id: "po-2".into(),
                    account_id: "acc-2".into(),
                    workflow: "TERMINATED".into(),
                    evidence: "LOCK_BUSY".into(),
                    new_state: "RAIL_AMBIGUOUS".into(),
                    token: None,
                    detail: String::new(),
                },
            ],
            resumptions: vec![
                Resumption {
                    payout_id: String::new(),
                    account_id: "acc-3".into(),
                    state: String::new(),
                    workflow: String::new(),
                    action: "TOOK_OVER".into(),
                    took_over_from: Some("worker-0/po-9".into()),
                    detail: String::new(),
                },
                Resumption {
                    payout_id: "po-4".into(),
                    account_id: "acc-4".into(),
                    state: "CLAIMED".into(),
                    workflow: "TERMINATED".into(),
                    action: "RESUMED".into(),
                    took_over_from: None,
                    detail: "x".into(),
                },
            ],
            errors: Vec::new(),
        }
    }

    /// The text of `reconciler once` is what it was when the checks' report carried the
    /// corrective outcomes itself: checks, the pass (full or incremental), orphans, stranded
    /// payouts, then the total.
    #[test]
    fn the_run_renders_the_checks_then_the_corrective_sections_then_the_total() {
        let expected = [
            "CHECK                              INVARIANT       EXAMINED VIOLATIONS",
            "one_in_flight_payout_per_account   INV-01                 3          1",
            "guard_tokens_were_granted          INV-07                 0    skipped",
            "  VIOLATION one_in_flight_payout_per_account: account a has several payouts in flight: x,y",
            "  guard_tokens_were_granted skipped: no etcd",
            "  guard_tokens_were_granted: a note",
            "full pass: every account",
            "payouts: FAILED=1 POSTED=2; rail movements: 2; outbox pending: 0; ambiguous: 1",
            "ORPHAN                   WORKFLOW     EVIDENCE    NEW STATE       TOKEN  DETAIL",
            "po-1                     NOT_FOUND    FOUND       POSTED              7  d",
            "po-2                     TERMINATED   LOCK_BUSY   RAIL_AMBIGUOUS         ",
            "STRANDED                 STATE          WORKFLOW     ACTION           KEY TAKEN FROM                DETAIL",
            "acc-3                                                TOOK_OVER        worker-0/po-9                 ",
            "po-4                     CLAIMED        TERMINATED   RESUMED          -                             x",
            "violations: 1",
        ];
        assert_eq!(run_report().render(), expected.join("\n") + "\n");
        let mut empty = run_report();
        empty.resolutions.clear();
        empty.resumptions.clear();
        assert_eq!(empty.render(), empty.checks.as_ref().unwrap().render());
        let expected = [
            "CHECK                              INVARIANT       EXAMINED VIOLATIONS",
            "one_in_flight_payout_per_account   INV-01                 3          1",
            "guard_tokens_were_granted          INV-07                 0    skipped",
            "  VIOLATION one_in_flight_payout_per_account: account a has several payouts in flight: x,y",
            "  guard_tokens_were_granted skipped: no etcd",
            "  guard_tokens_were_granted: a note",
            "full pass: every account",
            "payouts: FAILED=1 POSTED=2; rail movements: 2; outbox pending: 0; ambiguous: 1",
            "violations: 1",
        ];
        assert_eq!(empty.render(), expected.join("\n") + "\n");
    }

    /// `reconciler once --json` is one object: the checks' fields, then `resolutions` and
    /// `resumptions`, as before the split.
    #[test]
    fn the_run_serializes_as_one_object_with_the_corrective_outcomes_last() {
        assert_eq!(
            serde_json::to_string(&run_report()).unwrap(),
            r#"{"checks":[{"name":"one_in_flight_payout_per_account","invariant":"INV-01","examined":3,"violations":["account a has several payouts in flight: x,y"],"skipped":null,"note":null},{"name":"guard_tokens_were_granted","invariant":"INV-07","examined":0,"violations":[],"skipped":"no etcd","note":"a note"}],"violations":1,"payouts_by_state":{"FAILED":1,"POSTED":2},"rail_movements":2,"outbox_pending":0,"ambiguous_payouts":["po-1"],"audit_heads":[],"watermark":{"paydb_unix_ms":0,"proxydb_unix_ms":0,"gldb_unix_ms":0,"full_pass_unix_ms":0},"accounts_examined":null,"resolutions":[{"payout_id":"po-1","account_id":"acc-1","workflow":"NOT_FOUND","evidence":"FOUND","new_state":"POSTED","token":7,"detail":"d"},{"payout_id":"po-2","account_id":"acc-2","workflow":"TERMINATED","evidence":"LOCK_BUSY","new_state":"RAIL_AMBIGUOUS","token":null,"detail":""}],"resumptions":[{"payout_id":"","account_id":"acc-3","state":"","workflow":"","action":"TOOK_OVER","took_over_from":"worker-0/po-9","detail":""},{"payout_id":"po-4","account_id":"acc-4","state":"CLAIMED","workflow":"TERMINATED","action":"RESUMED","took_over_from":null,"detail":"x"}],"errors":[]}"#
        );
        let mut empty = run_report();
        empty.resolutions.clear();
        empty.resumptions.clear();
        assert_eq!(
            serde_json::to_string(&empty).unwrap(),
            r#"{"checks":[{"name":"one_in_flight_payout_per_account","invariant":"INV-01","examined":3,"violations":["account a has several payouts in flight: x,y"],"skipped":null,"note":null},{"name":"guard_tokens_were_granted","invariant":"INV-07","examined":0,"violations":[],"skipped":"no etcd","note":"a note"}],"violations":1,"payouts_by_state":{"FAILED":1,"POSTED":2},"rail_movements":2,"outbox_pending":0,"ambiguous_payouts":["po-1"],"audit_heads":[],"watermark":{"paydb_unix_ms":0,"proxydb_unix_ms":0,"gldb_unix_ms":0,"full_pass_unix_ms":0},"accounts_examined":null,"resolutions":[],"resumptions":[],"errors":[]}"#
        );
    }

    /// A run whose resume pass failed (Temporal unreachable) still shows the checks, says which
    /// part failed, and is not clean; one whose checks failed says their total is unknown.
    #[test]
    fn a_failed_part_is_shown_and_the_run_is_not_clean() {
        let mut report = run_report();
        report.checks.as_mut().unwrap().violations = 0;
        report.checks.as_mut().unwrap().checks[0].violations.clear();
        assert!(report.is_clean());
        report.errors.push(PassError {
            pass: Pass::Resume,
            detail: "connecting to temporal: refused".into(),
        });
        assert!(!report.is_clean());
        let text = report.render();
        assert!(
            text.contains("  ERROR resume: connecting to temporal: refused\nviolations: 0\n"),
            "{text}"
        );
        assert!(text.starts_with("CHECK"), "{text}");
        let json = serde_json::to_value(&report).unwrap();
        assert_eq!(
            json["errors"],
            serde_json::json!([{"pass": "resume", "detail": "connecting to temporal: refused"}])
        );
        report.checks = None;
        report.errors.push(PassError {
            pass: Pass::Checks,
            detail: "paydb: refused".into(),
        });
        assert!(report.render().ends_with(
            "  ERROR checks: paydb: refused\nviolations: unknown (the checks did not run)\n"
        ));
        assert!(serde_json::to_value(&report)
            .unwrap()
            .get("checks")
            .is_none());
    }
}
