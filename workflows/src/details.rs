//! What the Temporal UI shows for a running payout: the workflow's current details (short
//! markdown, kept up to date by the workflow) and the summaries on its activities and timers.
//! None of it is part of the workflow's decisions: it is set from state the workflow already
//! keeps, and a summary is metadata on a command, not a command.

use std::time::{Duration, SystemTime};

use payout_domain::PayoutState;

/// What a step is for, by activity name, for the summary the UI shows on the activity.
pub fn step_summary(activity: &str) -> &'static str {
    match activity {
        "GetPayout" => "read the payout's record from the payment resource",
        "TryAcquireGrant" => "try to take the account's lock (payout:{account})",
        "AcquireGrant" => "wait in the account's line for its lock",
        "Claim" => "claim the payout under the grant's fencing token",
        "MarkSubmitted" => "mark the payout RAIL_SUBMITTED before the rail is called",
        "SubmitToRail" => "submit the payment to the rail, once (never retried)",
        "RecordOutcome" => "record the rail's answer in the payment resource",
        "PostLedger" => "post the payout to the ledger",
        "InquireRail" => "ask the rail whether it has the payment (evidence)",
        "ResolveAmbiguity" => "resolve RAIL_AMBIGUOUS from the rail's evidence",
        "Abandon" => "carry out the operator's accepted abandon",
        "RecordOperatorDecision" => "record the operator's decision in the audit trail first",
        "ReleaseGrant" | "ReleaseGrantHere" => "give the account's lock back",
        _ => "payout step",
    }
}

/// What the run waits for in `state` when nothing more specific was noted.
pub fn next_in(state: PayoutState) -> &'static str {
    match state {
        PayoutState::Pending => "the account's lock, then the claim",
        PayoutState::Claimed => "the mark before the rail is called",
        PayoutState::RailSubmitted => "the rail's answer to the submission",
        PayoutState::RailAcked => "the ledger posting",
        PayoutState::RailAmbiguous => "the rail's evidence (settlement window, then inquiry)",
        PayoutState::Posted | PayoutState::Failed | PayoutState::Abandoned => {
            "nothing: the payout is finished"
        }
    }
}

/// `at` as UTC `YYYY-MM-DD HH:MM:SS UTC` (workflow time, so the same on every replay).
pub fn utc(at: SystemTime) -> String {
    let seconds = at
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or(Duration::ZERO)
        .as_secs();
    let (days, of_day) = (seconds / 86_400, seconds % 86_400);
    let (year, month, day) = civil_from_days(days as i64);
    format!(
        "{year:04}-{month:02}-{day:02} {:02}:{:02}:{:02} UTC",
        of_day / 3_600,
        of_day % 3_600 / 60,
        of_day % 60
    )
}

/// Days since 1970-01-01 to the proleptic Gregorian date (H. Hinnant's `civil_from_days`).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

/// The facts the current details are made of.
pub struct Facts<'a> {
    pub state: PayoutState,
    pub token: Option<u64>,
    pub claimer: &'a str,
    pub waiting_for: Option<&'a str>,
    pub operator: Option<&'a str>,
    pub last_event: &'a str,
    pub pays: &'a str,
}

/// The workflow's current details: a few markdown lines, most important first.
pub fn render(f: &Facts<'_>) -> String {
    let mut lines = Vec::with_capacity(6);
    let mut state = format!("**State** {}", f.state);
    if let Some(token) = f.token {
        state.push_str(&format!(" · token {token}"));
    }
    if !f.claimer.is_empty() {
        state.push_str(&format!(" · claimed by `{}`", f.claimer));
    }
    lines.push(state);
    lines.push(format!(
        "**Waiting for** {}",
        f.waiting_for.unwrap_or_else(|| next_in(f.state))
    ));
    if let Some(operator) = f.operator {
        lines.push(format!("**Operator** {operator}"));
    }
    if !f.last_event.is_empty() {
        lines.push(format!("**Last event** {}", f.last_event));
    }
    if !f.pays.is_empty() {
        lines.push(format!("**Pays** {}", f.pays));
    }
    lines.join("  \n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn utc_formats_workflow_time() {
        let at = SystemTime::UNIX_EPOCH + Duration::from_secs(1_796_251_021);
        assert_eq!(utc(at), "2026-12-02 22:37:01 UTC");
        assert_eq!(utc(SystemTime::UNIX_EPOCH), "1970-01-01 00:00:00 UTC");
        let leap = SystemTime::UNIX_EPOCH + Duration::from_secs(951_782_400);
        assert_eq!(utc(leap), "2000-02-29 00:00:00 UTC");
    }

    #[test]
    fn details_say_what_the_run_waits_for() {
        let facts = Facts {
            state: PayoutState::RailAmbiguous,
            token: Some(7),
            claimer: "worker-a",
            waiting_for: None,
            operator: None,
            last_event: "RECORD_OUTCOME -> RAIL_AMBIGUOUS",
            pays: "EUR 12.34 from `a-1` to `ben-1`",
        };
        let shown = render(&facts);
        assert!(shown.starts_with("**State** RAIL_AMBIGUOUS · token 7 · claimed by `worker-a`"));
        assert!(
            shown.contains("**Waiting for** the rail's evidence"),
            "{shown}"
        );
        assert!(shown.contains("**Pays** EUR 12.34"), "{shown}");
    }
}
