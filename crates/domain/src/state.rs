//! The payout state machine of spec 2.3, written once, as data.
//!
//! `TRANSITIONS` is the whole table: a (state, event) pair that is not in it is refused. The
//! payment resource performs transitions only through [`PayoutState::apply`], so the table here is
//! the single definition the service, the workflow and the reconciler all read.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum PayoutState {
    Pending,
    Claimed,
    RailSubmitted,
    RailAcked,
    RailAmbiguous,
    Posted,
    Failed,
    Abandoned,
}

impl PayoutState {
    pub const ALL: [PayoutState; 8] = [
        PayoutState::Pending,
        PayoutState::Claimed,
        PayoutState::RailSubmitted,
        PayoutState::RailAcked,
        PayoutState::RailAmbiguous,
        PayoutState::Posted,
        PayoutState::Failed,
        PayoutState::Abandoned,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            PayoutState::Pending => "PENDING",
            PayoutState::Claimed => "CLAIMED",
            PayoutState::RailSubmitted => "RAIL_SUBMITTED",
            PayoutState::RailAcked => "RAIL_ACKED",
            PayoutState::RailAmbiguous => "RAIL_AMBIGUOUS",
            PayoutState::Posted => "POSTED",
            PayoutState::Failed => "FAILED",
            PayoutState::Abandoned => "ABANDONED",
        }
    }

    pub fn parse(value: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|s| s.as_str() == value)
    }

    /// POSTED, FAILED and ABANDONED have no outgoing transitions, ever (INV-08).
    pub fn is_terminal(self) -> bool {
        matches!(
            self,
            PayoutState::Posted | PayoutState::Failed | PayoutState::Abandoned
        )
    }

    /// States in which a payout is "in flight": at most one per account (spec 2.2).
    pub fn is_in_flight(self) -> bool {
        matches!(
            self,
            PayoutState::Claimed
                | PayoutState::RailSubmitted
                | PayoutState::RailAcked
                | PayoutState::RailAmbiguous
        )
    }

    /// Looks the pair up in the table. The actor must be the one the table names.
    pub fn apply(self, event: PayoutEvent, actor: Actor) -> Result<PayoutState, RefusedTransition> {
        let row = TRANSITIONS
            .iter()
            .find(|t| t.from == self && t.event == event)
            .ok_or(RefusedTransition::NotInTable { from: self, event })?;
        if row.actor != actor {
            return Err(RefusedTransition::WrongActor {
                from: self,
                event,
                actor,
                required: row.actor,
            });
        }
        Ok(row.to)
    }
}

impl std::fmt::Display for PayoutState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What happened to a payout. Each is a row trigger of the 2.3 table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum PayoutEvent {
    /// Claim (from PENDING) or recovery re-claim by a later holder (from CLAIMED), fenced.
    Claim,
    /// Funds were insufficient at claim time: no rail call.
    FundsInsufficient,
    /// The rail proxy recorded the submission intent.
    SubmissionAccepted,
    /// The rail acknowledged: money has left.
    RailAcked,
    /// The rail declined (a business rejection): no money moved.
    RailDeclined,
    /// Timeout, connection failure or 5xx: we may have moved money.
    RailTimeout,
    /// A later holder found a submission with no recorded outcome (a crash after forwarding).
    OutcomeMissing,
    /// Two balanced ledger rows written, balance updated.
    Posted,
    /// A rail lookup by client reference found the settled movement.
    EvidenceFound,
    /// A rail lookup, after the settlement window, definitively found nothing.
    EvidenceAbsent,
    /// An operator's decision, with identity and reason.
    OperatorAbandon,
}

impl PayoutEvent {
    pub const ALL: [PayoutEvent; 11] = [
        PayoutEvent::Claim,
        PayoutEvent::FundsInsufficient,
        PayoutEvent::SubmissionAccepted,
        PayoutEvent::RailAcked,
        PayoutEvent::RailDeclined,
        PayoutEvent::RailTimeout,
        PayoutEvent::OutcomeMissing,
        PayoutEvent::Posted,
        PayoutEvent::EvidenceFound,
        PayoutEvent::EvidenceAbsent,
        PayoutEvent::OperatorAbandon,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            PayoutEvent::Claim => "CLAIM",
            PayoutEvent::FundsInsufficient => "FUNDS_INSUFFICIENT",
            PayoutEvent::SubmissionAccepted => "SUBMISSION_ACCEPTED",
            PayoutEvent::RailAcked => "RAIL_ACKED",
            PayoutEvent::RailDeclined => "RAIL_DECLINED",
            PayoutEvent::RailTimeout => "RAIL_TIMEOUT",
            PayoutEvent::OutcomeMissing => "OUTCOME_MISSING",
            PayoutEvent::Posted => "POSTED",
            PayoutEvent::EvidenceFound => "EVIDENCE_FOUND",
            PayoutEvent::EvidenceAbsent => "EVIDENCE_ABSENT",
            PayoutEvent::OperatorAbandon => "OPERATOR_ABANDON",
        }
    }

    pub fn parse(value: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|e| e.as_str() == value)
    }
}

/// Who may trigger a row. Every actor acts under a lock grant (INV-07): the token is required
/// by the mutating API whoever calls it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum Actor {
    /// The worker holding `payout:{account}`; a later holder recovering a payout is also this.
    Holder,
    /// Whoever presents rail evidence (the reconciler, or the payout's own resolution step).
    /// Time is never evidence.
    Resolver,
    /// A human operator, identified, with a reason.
    Operator,
}

impl Actor {
    pub fn as_str(self) -> &'static str {
        match self {
            Actor::Holder => "HOLDER",
            Actor::Resolver => "RESOLVER",
            Actor::Operator => "OPERATOR",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum RefusedTransition {
    #[error("transition {event:?} from {from} is not in the payout state table")]
    NotInTable {
        from: PayoutState,
        event: PayoutEvent,
    },
    #[error("transition {event:?} from {from} may be triggered by {required:?}, not {actor:?}")]
    WrongActor {
        from: PayoutState,
        event: PayoutEvent,
        actor: Actor,
        required: Actor,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Transition {
    pub from: PayoutState,
    pub event: PayoutEvent,
    pub to: PayoutState,
    pub actor: Actor,
}

const fn row(from: PayoutState, event: PayoutEvent, to: PayoutState, actor: Actor) -> Transition {
    Transition {
        from,
        event,
        to,
        actor,
    }
}

use Actor::*;
use PayoutEvent as E;
use PayoutState as S;

/// Spec 2.3, row by row. Terminal states have no rows, so every event from them is refused.
pub const TRANSITIONS: [Transition; 13] = [
    row(S::Pending, E::Claim, S::Claimed, Holder),
    row(S::Pending, E::FundsInsufficient, S::Failed, Holder),
    row(S::Pending, E::OperatorAbandon, S::Abandoned, Operator),
    row(S::Claimed, E::Claim, S::Claimed, Holder),
    row(S::Claimed, E::SubmissionAccepted, S::RailSubmitted, Holder),
    row(S::RailSubmitted, E::RailAcked, S::RailAcked, Holder),
    row(S::RailSubmitted, E::RailDeclined, S::Failed, Holder),
    row(S::RailSubmitted, E::RailTimeout, S::RailAmbiguous, Holder),
    row(
        S::RailSubmitted,
        E::OutcomeMissing,
        S::RailAmbiguous,
        Holder,
    ),
    row(S::RailAcked, E::Posted, S::Posted, Holder),
    row(S::RailAmbiguous, E::EvidenceFound, S::RailAcked, Resolver),
    row(S::RailAmbiguous, E::EvidenceAbsent, S::Failed, Resolver),
    row(S::RailAmbiguous, E::OperatorAbandon, S::Abandoned, Operator),
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn terminal_states_have_no_outgoing_rows() {
        for t in TRANSITIONS {
            assert!(!t.from.is_terminal(), "{t:?}");
        }
        for s in PayoutState::ALL.into_iter().filter(|s| s.is_terminal()) {
            for e in PayoutEvent::ALL {
                for a in [Holder, Resolver, Operator] {
                    assert!(s.apply(e, a).is_err());
                }
            }
        }
    }

    #[test]
    fn table_has_no_duplicate_pairs() {
        for (i, a) in TRANSITIONS.iter().enumerate() {
            for b in &TRANSITIONS[i + 1..] {
                assert!(!(a.from == b.from && a.event == b.event), "{a:?} {b:?}");
            }
        }
    }

    #[test]
    fn ambiguity_is_resolved_only_by_evidence_or_an_operator() {
        let out: Vec<_> = TRANSITIONS
            .iter()
            .filter(|t| t.from == S::RailAmbiguous)
            .collect();
        assert_eq!(out.len(), 3);
        assert!(out.iter().all(|t| t.actor != Holder));
    }

    #[test]
    fn wrong_actor_is_refused() {
        assert!(matches!(
            S::Pending.apply(E::OperatorAbandon, Holder),
            Err(RefusedTransition::WrongActor { .. })
        ));
        assert_eq!(
            S::Pending.apply(E::OperatorAbandon, Operator),
            Ok(S::Abandoned)
        );
    }

    #[test]
    fn names_round_trip() {
        for s in PayoutState::ALL {
            assert_eq!(PayoutState::parse(s.as_str()), Some(s));
        }
        for e in PayoutEvent::ALL {
            assert_eq!(PayoutEvent::parse(e.as_str()), Some(e));
        }
    }
}
