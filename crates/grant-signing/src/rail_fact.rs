//! Rail facts: what the rail proxy says the rail did, signed by the proxy from its own rows and
//! verified by the payment resource before it records money on them.
//!
//! Two kinds. An **outcome** (`ACKED`, `REJECTED`, `TIMEOUT`, `NOT_SENT`) is the proxy's
//! `rail_submission` row once final; an **evidence** (`FOUND`, `ABSENT`, `NEVER_SENT`, `UNKNOWN`) is
//! one of its `resolution` rows (an inquiry's answer). The worker and Temporal carry them; without
//! the signature a rogue caller could record DECLINED after a real ACK (money gone, customer not
//! debited) or FOUND for a payment that never moved (customer debited for nothing).
//!
//! A definitive fact is permanent for its payout (one submission per payout, an outcome written
//! once), so a fact has no expiry: replaying a true fact records the truth. The proxy signs on the
//! fly whenever it answers; Ed25519 is deterministic, so nothing new is stored.

use crate::{Forged, Message, Signature, Signer, Verifier};

/// Domain tags: an outcome's signature is never an evidence's, and neither is a grant's, an
/// instruction's or an operator decision's.
const OUTCOME_DOMAIN: &[u8] = b"payout-rail-outcome-v1";
const EVIDENCE_DOMAIN: &[u8] = b"payout-rail-evidence-v1";

/// Every reason the payment resource names a refused rail fact by (`RailFactRefused.reason`,
/// `rail_facts_refused_total{reason}`): the three of [`Forged::reason`], and `contradicts` for a
/// genuine fact that says something else than the request.
pub const REASONS: [&str; 4] = ["unsigned", "unknown_key_id", "bad_signature", "contradicts"];

/// A submission's final outcome as the proxy recorded it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcome<'a> {
    pub payout_id: &'a str,
    pub account_id: &'a str,
    pub client_reference: &'a str,
    /// `ACKED`, `REJECTED`, `TIMEOUT` or `NOT_SENT`.
    pub outcome: &'a str,
    pub rail_ref: &'a str,
    pub decline_code: &'a str,
    /// The token the submission was made under.
    pub token: u64,
    /// When the outcome was recorded (the row's `resolved_at`).
    pub signed_at_unix_ms: i64,
}

impl Outcome<'_> {
    /// The bytes the signature covers: domain tag, the signing key's id first, then the fields in
    /// the struct's order.
    pub fn message(&self, key_id: &str) -> Vec<u8> {
        let mut m = Message::new(OUTCOME_DOMAIN);
        for field in [
            key_id,
            self.payout_id,
            self.account_id,
            self.client_reference,
            self.outcome,
            self.rail_ref,
            self.decline_code,
        ] {
            m.text(field);
        }
        m.u64(self.token).i64(self.signed_at_unix_ms);
        m.into_bytes()
    }
}

/// An inquiry's answer as the proxy recorded it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Evidence<'a> {
    pub payout_id: &'a str,
    pub account_id: &'a str,
    pub client_reference: &'a str,
    /// `FOUND`, `ABSENT`, `NEVER_SENT` or `UNKNOWN`.
    pub evidence: &'a str,
    /// The rail's references found (any order: the message sorts them).
    pub rail_refs: &'a [String],
    pub asked_by: &'a str,
    /// When the inquiry was answered (the row's `asked_at`).
    pub signed_at_unix_ms: i64,
}

impl Evidence<'_> {
    /// The bytes the signature covers: domain tag, the signing key's id first, the fields, the
    /// rail references sorted as a u32 count then each length-prefixed.
    pub fn message(&self, key_id: &str) -> Vec<u8> {
        let mut m = Message::new(EVIDENCE_DOMAIN);
        for field in [
            key_id,
            self.payout_id,
            self.account_id,
            self.client_reference,
            self.evidence,
        ] {
            m.text(field);
        }
        let mut refs: Vec<&str> = self.rail_refs.iter().map(String::as_str).collect();
        refs.sort_unstable();
        m.count(refs.len());
        for r in refs {
            m.text(r);
        }
        m.text(self.asked_by).i64(self.signed_at_unix_ms);
        m.into_bytes()
    }
}

impl Signer {
    /// The proxy's signature over a final outcome.
    pub fn sign_outcome(&self, outcome: &Outcome<'_>) -> Signature {
        self.sign_message(&outcome.message(self.key_id()))
    }

    /// The proxy's signature over an inquiry's evidence.
    pub fn sign_evidence(&self, evidence: &Evidence<'_>) -> Signature {
        self.sign_message(&evidence.message(self.key_id()))
    }
}

impl Verifier {
    /// Whether `signature` is a registered proxy key's over exactly `outcome`.
    pub fn verify_outcome(
        &self,
        outcome: &Outcome<'_>,
        signature: &Signature,
    ) -> Result<(), Forged> {
        self.verify_message(signature, |key_id| outcome.message(key_id))
    }

    /// Whether `signature` is a registered proxy key's over exactly `evidence`.
    pub fn verify_evidence(
        &self,
        evidence: &Evidence<'_>,
        signature: &Signature,
    ) -> Result<(), Forged> {
        self.verify_message(signature, |key_id| evidence.message(key_id))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::instruction::{Instruction, Presented};
    use crate::operator::Decision;

    fn outcome() -> Outcome<'static> {
        Outcome {
            payout_id: "p-1",
            account_id: "acct-a",
            client_reference: "cref-p-1",
            outcome: "ACKED",
            rail_ref: "rail-77",
            decline_code: "",
            token: 42,
            signed_at_unix_ms: 1_800_000_000_000,
        }
    }

    fn refs() -> Vec<String> {
        vec!["rail-77".into(), "rail-12".into()]
    }

    fn evidence(rail_refs: &[String]) -> Evidence<'_> {
        Evidence {
            payout_id: "p-1",
            account_id: "acct-a",
            client_reference: "cref-p-1",
            evidence: "FOUND",
            rail_refs,
            asked_by: "resolver",
            signed_at_unix_ms: 1_800_000_000_000,
        }
    }

    fn pair(id: &str) -> (Signer, Verifier) {
        let (signer, _) = Signer::generate(id).unwrap();
        let verifier = Verifier::new([signer.public_key()]).unwrap();
        (signer, verifier)
    }

    #[test]
    fn an_outcome_round_trips_and_changing_any_field_breaks_it() {
        let (signer, verifier) = pair("proxy-1");
        let o = outcome();
        let sig = signer.sign_outcome(&o);
        assert_eq!(verifier.verify_outcome(&o, &sig), Ok(()));
        assert_eq!(signer.sign_outcome(&o), sig, "deterministic");
        let changed = [
            (
                "payout_id",
                Outcome {
                    payout_id: "p-2",
                    ..o.clone()
                },
            ),
            (
                "account_id",
                Outcome {
                    account_id: "acct-b",
                    ..o.clone()
                },
            ),
            (
                "client_reference",
                Outcome {
                    client_reference: "cref-x",
                    ..o.clone()
                },
            ),
            (
                "outcome",
                Outcome {
                    outcome: "REJECTED",
                    ..o.clone()
                },
            ),
            (
                "rail_ref",
                Outcome {
                    rail_ref: "fake",
                    ..o.clone()
                },
            ),
            (
                "decline_code",
                Outcome {
                    decline_code: "R01",
                    ..o.clone()
                },
            ),
            (
                "token",
                Outcome {
                    token: 43,
                    ..o.clone()
                },
            ),
            (
                "signed_at",
                Outcome {
                    signed_at_unix_ms: 1,
                    ..o.clone()
                },
            ),
        ];
        for (field, other) in changed {
            assert_eq!(
                verifier.verify_outcome(&other, &sig),
                Err(Forged::BadSignature),
                "{field}"
            );
        }
    }

    #[test]
    fn an_evidence_round_trips_in_any_ref_order_and_changing_any_field_breaks_it() {
        let (signer, verifier) = pair("proxy-1");
        let r = refs();
        let e = evidence(&r);
        let sig = signer.sign_evidence(&e);
        assert_eq!(verifier.verify_evidence(&e, &sig), Ok(()));
        let mut reversed = r.clone();
        reversed.reverse();
        assert_eq!(verifier.verify_evidence(&evidence(&reversed), &sig), Ok(()));
        let one = vec!["rail-77".to_string()];
        let fake = vec!["rail-77".to_string(), "fake".to_string()];
        let changed = [
            (
                "payout_id",
                Evidence {
                    payout_id: "p-2",
                    ..e.clone()
                },
            ),
            (
                "account_id",
                Evidence {
                    account_id: "acct-b",
                    ..e.clone()
                },
            ),
            (
                "client_reference",
                Evidence {
                    client_reference: "x",
                    ..e.clone()
                },
            ),
            (
                "evidence",
                Evidence {
                    evidence: "ABSENT",
                    ..e.clone()
                },
            ),
            (
                "rail_refs (fewer)",
                Evidence {
                    rail_refs: &one,
                    ..e.clone()
                },
            ),
            (
                "rail_refs (other)",
                Evidence {
                    rail_refs: &fake,
                    ..e.clone()
                },
            ),
            (
                "asked_by",
                Evidence {
                    asked_by: "worker",
                    ..e.clone()
                },
            ),
            (
                "signed_at",
                Evidence {
                    signed_at_unix_ms: 1,
                    ..e.clone()
                },
            ),
        ];
        for (field, other) in changed {
            assert_eq!(
                verifier.verify_evidence(&other, &sig),
                Err(Forged::BadSignature),
                "{field}"
            );
        }
    }

    #[test]
    fn unknown_impostor_and_unsigned_facts_are_refused_and_a_rotation_holds_two() {
        let (signer, verifier) = pair("proxy-1");
        let o = outcome();
        assert_eq!(
            verifier.verify_outcome(&o, &Signature::default()),
            Err(Forged::Unsigned)
        );
        let (stranger, _) = Signer::generate("proxy-9").unwrap();
        assert_eq!(
            verifier.verify_outcome(&o, &stranger.sign_outcome(&o)),
            Err(Forged::UnknownKeyId("proxy-9".into()))
        );
        let (impostor, _) = Signer::generate("proxy-1").unwrap();
        assert_eq!(
            verifier.verify_outcome(&o, &impostor.sign_outcome(&o)),
            Err(Forged::BadSignature)
        );
        let (new, _) = Signer::generate("proxy-2").unwrap();
        let rotating = Verifier::new([signer.public_key(), new.public_key()]).unwrap();
        let r = refs();
        for s in [&signer, &new] {
            assert_eq!(rotating.verify_outcome(&o, &s.sign_outcome(&o)), Ok(()));
            assert_eq!(
                rotating.verify_evidence(&evidence(&r), &s.sign_evidence(&evidence(&r))),
                Ok(())
            );
        }
    }

    /// A signature of each of the five kinds (grant, operator decision, instruction, outcome,
    /// evidence) verifies as its own kind only, even when every field a kind shares is equal.
    #[test]
    fn a_signature_of_one_kind_never_verifies_as_another() {
        let (signer, verifier) = pair("k1");
        let instruction = Instruction {
            payout_id: "p-1".into(),
            account_id: "acct-a".into(),
            currency: "EUR".into(),
            beneficiary_ref: "b".into(),
            client_reference: "cref-p-1".into(),
            lock_key: "payout:acct-a".into(),
            amount_minor: 1,
            token: 42,
            issued_at_unix_ms: 1_800_000_000_000,
            expires_at_unix_ms: 1_800_000_600_000,
        };
        let r = refs();
        let decision = Decision {
            operator: "k1",
            decision: "abandon",
            payout_id: "p-1",
            reason: "r",
            signed_at_unix_ms: 1_800_000_000_000,
        };
        let messages: [(&str, Vec<u8>); 5] = [
            ("grant", crate::message("k1", "payout:acct-a", "k1", 42)),
            ("decision", decision.message()),
            ("instruction", instruction.message("k1")),
            ("outcome", outcome().message("k1")),
            ("evidence", evidence(&r).message("k1")),
        ];
        let signatures = [
            signer.sign("payout:acct-a", 42, "k1"),
            signer.sign_decision(&decision),
            signer.sign_instruction(instruction.clone()).signature,
            signer.sign_outcome(&outcome()),
            signer.sign_evidence(&evidence(&r)),
        ];
        for (i, signature) in signatures.iter().enumerate() {
            for (j, (kind, message)) in messages.iter().enumerate() {
                let verdict = verifier.verify_message(signature, |_| message.clone());
                assert_eq!(
                    verdict.is_ok(),
                    i == j,
                    "signature of {} checked as {kind}",
                    messages[i].0
                );
            }
        }
        // And through the typed verifiers: an outcome's signature is no instruction's.
        let p = Presented {
            payout_id: "p-1",
            account_id: "acct-a",
            amount_minor: 1,
            currency: "EUR",
            beneficiary_ref: "b",
            client_reference: "cref-p-1",
            lock_key: "payout:acct-a",
            token: 42,
        };
        let smuggled = crate::instruction::SignedInstruction {
            instruction,
            signature: signatures[3].clone(),
        };
        assert_eq!(
            verifier.verify_instruction(&smuggled, &p, 1_800_000_000_000),
            Err(crate::instruction::Refused::BadSignature)
        );
    }
}
