//! The proxy's domain. The types that cross the process boundary (the submit request, the
//! inquiry, the submission record, the evidence) are the contract crate's
//! ([`rail_proxy_client::model`]), which the server uses and does not re-export; the
//! classification of a duplicate is the server's own.

pub(crate) use rail_proxy_client::model::{
    Evidence, InquirePayout, InvalidArgument, Outcome, Payment, Resolution, Submission,
    SubmitPayout,
};

/// Why a Submit found its payout already recorded. Both are refused and send nothing; only the
/// second is a defect signal (spec 2.3: a second submission attempt pages).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DuplicateClass {
    /// The recorded submission's own grant asking again, for the same payment: the ordinary
    /// recovery of a submitter that crashed or lost the answer.
    Retry,
    /// Anyone else: another token or owner (a later holder, a stale one, a bug), another
    /// payment under the same grant, or a Submit of a payout sealed unsent.
    SecondSubmitter,
}

impl DuplicateClass {
    /// Which kind of duplicate `request` is, given `existing`, the record of its payout.
    pub fn of(existing: &Submission, request: &SubmitPayout) -> Self {
        let same_grant = existing.token == request.token && existing.owner == request.owner;
        if same_grant && !existing.is_sealed() && existing.same_payload(request) {
            Self::Retry
        } else {
            Self::SecondSubmitter
        }
    }

    /// The `guard_event.duplicate` value.
    pub fn name(self) -> &'static str {
        match self {
            Self::Retry => "RETRY",
            Self::SecondSubmitter => "SECOND_SUBMITTER",
        }
    }
    /// The `kind` label of `rail_proxy_duplicate_submissions_total`.
    pub fn label(self) -> &'static str {
        match self {
            Self::Retry => "retry",
            Self::SecondSubmitter => "second_submitter",
        }
    }
}
