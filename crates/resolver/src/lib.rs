//! The resolver: the corrective part of reconciliation. Where the `reconciler` crate only reads
//! and reports, this crate acts, on two kinds of payout nobody is left to finish:
//!
//! - [`resolve`]: a RAIL_AMBIGUOUS payout whose workflow is gone is resolved with evidence: a
//!   fenced inquiry at the rail proxy, then the payment resource's transition (FOUND → POSTED,
//!   ABSENT / NEVER_SENT → FAILED, UNKNOWN → left alone, for the resume pass).
//! - [`resume`]: a payout in PENDING, CLAIMED, RAIL_SUBMITTED, RAIL_ACKED or RAIL_AMBIGUOUS whose
//!   workflow is closed or was never started is handed back to a new workflow run, after its
//!   account's key is taken over (an audited force-revoke) from a grant whose workflow is not
//!   running; and a short pass (`resume_blocked_accounts`) does the same for the accounts where
//!   someone waits, every few seconds. A resumed ambiguous payout's run only asks the rail (at
//!   once, then every window) and never submits; an operator abandons it past the SLA through
//!   that run's abandon Update.
//!
//! Both full passes walk paydb's open payouts from where the last pass of the process stopped
//! ([`walk`]): a payout whose workflow runs takes no place in a pass's bound, and every open
//! payout is examined within `ceil(N / per_pass)` passes, whatever the number in flight.
//!
//! In one reconcile pass the orphan resolver goes first and the resume pass second: evidence
//! settles what it can at once, and only what is still ambiguous (UNKNOWN, or its account's key
//! busy) is handed to a workflow that keeps asking. The other order would hand every orphan to a
//! workflow before the resolver looked, and the resolver, which leaves a payout with a running
//! workflow alone, would never act.
//!
//! It takes real grants: a lock session of its own and a grant on the account's key for every
//! resolution, whose token it presents at both guards (the payment resource's fence, the rail
//! proxy's high-water) for every write; the rail is never contacted except through the proxy's
//! fenced inquiry, and nothing is ever resubmitted. It acts only on evidence: time alone resolves
//! nothing, an UNKNOWN answer leaves the payout as it is, and a payout whose state changed under
//! the grant is left to whoever changed it.
//!
//! Its own safety rests on the guards, not on the lock service and not on being alone: the guards
//! fence it like any other holder. If it loses a grant (its session expired, the key
//! force-revoked), the next holder's token is higher, and each guard refuses the resolver's token
//! once it has seen that one; a takeover works the same way against the holder it revokes.
//!
//! Two passes may run at once (`reconciler serve`'s scheduled pass and its keeper's short holder
//! pass, several replicas, an operator's `reconciler once --resume-stranded`): every write is
//! fenced, a takeover revokes only the grant it described and whose workflow it found not running
//! (a key that changed holder since is refused `HolderChanged`, so a workflow another pass just
//! resumed is never deposed), and a second start of a resumed workflow is Temporal's "already
//! started". The schedule never overlaps two scheduled runs.

pub mod facts;
pub mod resolve;
pub mod resume;
pub mod walk;

/// `lock` recording its lock history to `path` (`lock_client::history`), when a path is given: a
/// history that cannot be opened is logged and the pass goes on without it (recording never
/// decides anything).
pub(crate) fn with_lock_history(
    lock: lock_client::LockClient,
    path: Option<&std::path::Path>,
) -> lock_client::LockClient {
    let Some(path) = path else {
        return lock;
    };
    match lock_client::history::HistoryRecorder::open(path) {
        Ok(recorder) => lock.with_history(std::sync::Arc::new(recorder)),
        Err(e) => {
            tracing::error!(path = %path.display(), error = %e, "lock history: cannot open; not recorded");
            lock
        }
    }
}
