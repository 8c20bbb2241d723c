//! The rail proxy's signed facts in the form the payment resource takes them (issue 33): the
//! outcome a RecordOutcome carries and the evidence a ResolveAmbiguity carries. Only converted
//! from the proxy's answers: nothing here signs, checks or alters one.

use payment_client::model::{RailEvidence, RailFact};
use rail_proxy_client::{Evidence, Resolution, Submission};

/// `submission`'s signed final outcome, as the proxy answered it (none while PENDING, or if the
/// answer carried no signature).
pub fn outcome(submission: &Submission) -> Option<RailFact> {
    let signed = submission.outcome_signature.as_ref()?;
    let fact = submission.outcome_fact()?;
    Some(RailFact {
        outcome: fact.outcome.to_string(),
        rail_ref: fact.rail_ref.to_string(),
        decline_code: fact.decline_code.to_string(),
        token: fact.token,
        signed_at_unix_ms: signed.signed_at_unix_ms,
        signature: signed.signature.clone(),
    })
}

/// `resolution`'s signed evidence, as the proxy answered it (none if it carried no signature).
pub fn evidence(resolution: &Resolution) -> Option<RailEvidence> {
    let signed = resolution.signature.as_ref()?;
    Some(RailEvidence {
        evidence: resolution.evidence.name().to_string(),
        rail_refs: match &resolution.evidence {
            Evidence::Found { rail_refs } => rail_refs.clone(),
            _ => Vec::new(),
        },
        asked_by: resolution.asked_by.clone(),
        asked_at_unix_ms: resolution.asked_at_unix_ms,
        signature: signed.signature.clone(),
    })
}
