//! The payout instruction: what the payment resource authorises the rail proxy to send, signed by
//! the payment resource when it marks the payout submitted (`Store::mark_submitted`) and verified
//! by the rail proxy before it sends anything (`ProxyService::check_instruction`).
//!
//! The worker and Temporal only carry it. Without it, anyone holding a genuine grant for an
//! account (a rogue workflow driving the genuine worker, an impostor `PayoutWorkflow`) could have
//! the proxy pay any amount to any beneficiary: the grant says who may write, never what.
//!
//! The instruction carries its own copy of the fields, not a signature over the request, so that
//! an altered amount (`mismatch`, an attack signal) is told apart from a corrupt signature
//! (`bad_signature`, a key problem). It expires: one captured instruction is worth one payout for
//! at most [`TTL_MAX_MS`], and the proxy's unique submission per payout makes it worth one send.

use std::fmt;

use crate::{Forged, Message, Signature, Signer, Verifier};

/// Domain tag: an instruction's signature is never a grant's, a decision's or a rail fact's.
const DOMAIN: &[u8] = b"payout-instruction-v1";
/// How long an instruction is honoured by default: a submit follows MarkSubmitted within one
/// activity's retries (seconds); ten minutes covers a slow retry without keeping a stolen
/// instruction useful for long.
pub const TTL_DEFAULT_MS: u64 = 600_000;
/// The longest life a payment resource may give an instruction, and so the wait before an old
/// instruction key's public half may be removed from the proxy in a rotation.
pub const TTL_MAX_MS: u64 = 3_600_000;
/// The payment resource's clock (issued_at) and the proxy host's (now) may differ this much in
/// either direction.
pub const CLOCK_SKEW_MS: i64 = 5_000;

/// What is authorised: one payout, its money, its beneficiary, under one grant, for a while.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Instruction {
    pub payout_id: String,
    pub account_id: String,
    pub currency: String,
    pub beneficiary_ref: String,
    pub client_reference: String,
    /// The grant's signed key, `payout:{account_id}`.
    pub lock_key: String,
    pub amount_minor: i64,
    pub token: u64,
    pub issued_at_unix_ms: i64,
    pub expires_at_unix_ms: i64,
}

impl Instruction {
    /// The bytes the signature covers: the domain tag, the signing key's id first (a signature
    /// cannot be moved to another key id), then the fields in the struct's order.
    pub fn message(&self, key_id: &str) -> Vec<u8> {
        let mut m = Message::new(DOMAIN);
        for field in [
            key_id,
            &self.payout_id,
            &self.account_id,
            &self.currency,
            &self.beneficiary_ref,
            &self.client_reference,
            &self.lock_key,
        ] {
            m.text(field);
        }
        m.i64(self.amount_minor)
            .u64(self.token)
            .i64(self.issued_at_unix_ms)
            .i64(self.expires_at_unix_ms);
        m.into_bytes()
    }

    /// The request this instruction authorises, field for field (what a faithful relay presents).
    pub fn presented(&self) -> Presented<'_> {
        Presented {
            payout_id: &self.payout_id,
            account_id: &self.account_id,
            amount_minor: self.amount_minor,
            currency: &self.currency,
            beneficiary_ref: &self.beneficiary_ref,
            client_reference: &self.client_reference,
            lock_key: &self.lock_key,
            token: self.token,
        }
    }
}

/// An instruction and the payment resource's signature over it, as it travels.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SignedInstruction {
    pub instruction: Instruction,
    pub signature: Signature,
}

/// What a submit asks the proxy to do: the request's own fields, compared one by one with the
/// signed instruction's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Presented<'a> {
    pub payout_id: &'a str,
    pub account_id: &'a str,
    pub amount_minor: i64,
    pub currency: &'a str,
    pub beneficiary_ref: &'a str,
    pub client_reference: &'a str,
    /// The request's grant key.
    pub lock_key: &'a str,
    pub token: u64,
}

/// Why the proxy refused an instruction. The `reason()` names are stable: the audit rows, the
/// wire's `InstructionRefused.reason` and `instructions_refused_total{reason}` use them.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refused {
    #[error("the submit carries no signed instruction")]
    Unsigned,
    #[error("the instruction is signed by key {0:?}, which this proxy does not know")]
    UnknownKeyId(String),
    #[error("the instruction's signature does not match its fields")]
    BadSignature,
    #[error("the request's {field} ({presented:?}) is not the instruction's ({signed:?})")]
    Mismatch {
        field: &'static str,
        signed: String,
        presented: String,
    },
    #[error("the instruction expired at {expires_at_unix_ms} ms (now {now_unix_ms} ms)")]
    Expired {
        expires_at_unix_ms: i64,
        now_unix_ms: i64,
    },
    #[error(
        "the instruction is issued at {issued_at_unix_ms} ms, ahead of now ({now_unix_ms} ms)"
    )]
    NotYetValid {
        issued_at_unix_ms: i64,
        now_unix_ms: i64,
    },
    #[error("the instruction lives {ttl_ms} ms, above the {TTL_MAX_MS} ms any is given")]
    TtlTooLong { ttl_ms: i64 },
}

/// Every reason [`Refused::reason`] can name, for counters registered at zero.
pub const REASONS: [&str; 7] = [
    "unsigned",
    "unknown_key_id",
    "bad_signature",
    "mismatch",
    "expired",
    "not_yet_valid",
    "ttl_too_long",
];

impl Refused {
    pub fn reason(&self) -> &'static str {
        match self {
            Refused::Unsigned => "unsigned",
            Refused::UnknownKeyId(_) => "unknown_key_id",
            Refused::BadSignature => "bad_signature",
            Refused::Mismatch { .. } => "mismatch",
            Refused::Expired { .. } => "expired",
            Refused::NotYetValid { .. } => "not_yet_valid",
            Refused::TtlTooLong { .. } => "ttl_too_long",
        }
    }

    /// The mismatched field's name, or "" for the other reasons.
    pub fn field(&self) -> &'static str {
        match self {
            Refused::Mismatch { field, .. } => field,
            _ => "",
        }
    }
}

impl From<Forged> for Refused {
    fn from(f: Forged) -> Self {
        match f {
            Forged::Unsigned => Refused::Unsigned,
            Forged::UnknownKeyId(id) => Refused::UnknownKeyId(id),
            Forged::BadSignature => Refused::BadSignature,
        }
    }
}

impl Signer {
    /// The payment resource's signature over `instruction`. Deterministic (Ed25519): the same
    /// instruction signed again gives the same bytes, so a repeated MarkSubmitted answers the
    /// same signed instruction without storing it.
    pub fn sign_instruction(&self, instruction: Instruction) -> SignedInstruction {
        let signature = self.sign_message(&instruction.message(self.key_id()));
        SignedInstruction {
            instruction,
            signature,
        }
    }
}

impl Verifier {
    /// Whether `signed` is a payment resource's instruction for exactly what is `presented`, valid
    /// at `now_unix_ms` (the proxy host's clock). Checked in this order: signature (unsigned,
    /// unknown key, bad signature), then each field, then time.
    pub fn verify_instruction(
        &self,
        signed: &SignedInstruction,
        presented: &Presented<'_>,
        now_unix_ms: i64,
    ) -> Result<(), Refused> {
        let i = &signed.instruction;
        self.verify_message(&signed.signature, |key_id| i.message(key_id))?;
        let texts: [(&'static str, &str, &str); 6] = [
            ("payout_id", &i.payout_id, presented.payout_id),
            ("account_id", &i.account_id, presented.account_id),
            ("currency", &i.currency, presented.currency),
            (
                "beneficiary_ref",
                &i.beneficiary_ref,
                presented.beneficiary_ref,
            ),
            (
                "client_reference",
                &i.client_reference,
                presented.client_reference,
            ),
            ("lock_key", &i.lock_key, presented.lock_key),
        ];
        for (field, signed, presented) in texts {
            if signed != presented {
                return Err(mismatch(field, signed, presented));
            }
        }
        if i.amount_minor != presented.amount_minor {
            return Err(mismatch(
                "amount_minor",
                i.amount_minor,
                presented.amount_minor,
            ));
        }
        if i.token != presented.token {
            return Err(mismatch("token", i.token, presented.token));
        }
        if i.issued_at_unix_ms > now_unix_ms.saturating_add(CLOCK_SKEW_MS) {
            return Err(Refused::NotYetValid {
                issued_at_unix_ms: i.issued_at_unix_ms,
                now_unix_ms,
            });
        }
        if now_unix_ms > i.expires_at_unix_ms.saturating_add(CLOCK_SKEW_MS) {
            return Err(Refused::Expired {
                expires_at_unix_ms: i.expires_at_unix_ms,
                now_unix_ms,
            });
        }
        let ttl_ms = i.expires_at_unix_ms.saturating_sub(i.issued_at_unix_ms);
        if ttl_ms > TTL_MAX_MS as i64 {
            return Err(Refused::TtlTooLong { ttl_ms });
        }
        Ok(())
    }
}

fn mismatch(
    field: &'static str,
    signed: impl fmt::Display,
    presented: impl fmt::Display,
) -> Refused {
    Refused::Mismatch {
        field,
        signed: signed.to_string(),
        presented: presented.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const NOW: i64 = 1_800_000_000_000;

    fn instruction() -> Instruction {
        Instruction {
            payout_id: "p-1".into(),
            account_id: "acct-a".into(),
            currency: "EUR".into(),
            beneficiary_ref: "benef-1".into(),
            client_reference: "cref-p-1".into(),
            lock_key: "payout:acct-a".into(),
            amount_minor: 12_345,
            token: 42,
            issued_at_unix_ms: NOW,
            expires_at_unix_ms: NOW + TTL_DEFAULT_MS as i64,
        }
    }

    fn presented(i: &Instruction) -> Presented<'_> {
        i.presented()
    }

    fn pair(id: &str) -> (Signer, Verifier) {
        let (signer, _) = Signer::generate(id).unwrap();
        let verifier = Verifier::new([signer.public_key()]).unwrap();
        (signer, verifier)
    }

    #[test]
    fn an_instruction_round_trips_and_signing_is_deterministic() {
        let (signer, verifier) = pair("pr-1");
        let signed = signer.sign_instruction(instruction());
        assert_eq!(signed.signature.key_id, "pr-1");
        assert_eq!(
            verifier.verify_instruction(&signed, &presented(&instruction()), NOW),
            Ok(())
        );
        assert_eq!(signer.sign_instruction(instruction()), signed);
    }

    #[test]
    fn a_request_that_differs_in_any_field_is_refused_naming_the_field() {
        let (signer, verifier) = pair("pr-1");
        let signed = signer.sign_instruction(instruction());
        let i = instruction();
        let base = presented(&i);
        let cases: Vec<(&str, Presented<'_>)> = vec![
            (
                "payout_id",
                Presented {
                    payout_id: "p-2",
                    ..base.clone()
                },
            ),
            (
                "account_id",
                Presented {
                    account_id: "acct-b",
                    ..base.clone()
                },
            ),
            (
                "amount_minor",
                Presented {
                    amount_minor: 12_346,
                    ..base.clone()
                },
            ),
            (
                "currency",
                Presented {
                    currency: "USD",
                    ..base.clone()
                },
            ),
            (
                "beneficiary_ref",
                Presented {
                    beneficiary_ref: "mallory",
                    ..base.clone()
                },
            ),
            (
                "client_reference",
                Presented {
                    client_reference: "cref-x",
                    ..base.clone()
                },
            ),
            (
                "lock_key",
                Presented {
                    lock_key: "payout:acct-b",
                    ..base.clone()
                },
            ),
            (
                "token",
                Presented {
                    token: 43,
                    ..base.clone()
                },
            ),
        ];
        for (field, p) in cases {
            let refused = verifier.verify_instruction(&signed, &p, NOW).unwrap_err();
            assert_eq!(refused.reason(), "mismatch", "{field}: {refused}");
            assert_eq!(refused.field(), field, "{refused}");
        }
    }

    #[test]
    fn changing_any_signed_field_breaks_the_signature() {
        let (signer, verifier) = pair("pr-1");
        let signed = signer.sign_instruction(instruction());
        type Edit = fn(&mut Instruction);
        let edits: Vec<(&str, Edit)> = vec![
            ("payout_id", |i| i.payout_id.push('x')),
            ("account_id", |i| i.account_id.push('x')),
            ("currency", |i| i.currency.push('x')),
            ("beneficiary_ref", |i| i.beneficiary_ref.push('x')),
            ("client_reference", |i| i.client_reference.push('x')),
            ("lock_key", |i| i.lock_key.push('x')),
            ("amount_minor", |i| i.amount_minor += 1),
            ("token", |i| i.token += 1),
            ("issued_at", |i| i.issued_at_unix_ms -= 1),
            ("expires_at", |i| i.expires_at_unix_ms += 1),
        ];
        for (field, edit) in edits {
            let mut forged = signed.clone();
            edit(&mut forged.instruction);
            // The request agrees with the altered instruction: only the signature can tell.
            let altered = forged.instruction.clone();
            assert_eq!(
                verifier.verify_instruction(&forged, &presented(&altered), NOW),
                Err(Refused::BadSignature),
                "{field}"
            );
        }
        // The signature moved to another key id is refused as well.
        let (other, _) = Signer::generate("pr-2").unwrap();
        let both = Verifier::new([signer.public_key(), other.public_key()]).unwrap();
        let mut moved = signed.clone();
        moved.signature.key_id = "pr-2".into();
        assert_eq!(
            both.verify_instruction(&moved, &presented(&instruction()), NOW),
            Err(Refused::BadSignature)
        );
    }

    #[test]
    fn unsigned_unknown_and_impostor_keys_are_refused_and_a_rotation_holds_two() {
        let (signer, verifier) = pair("pr-1");
        let i = instruction();
        let unsigned = SignedInstruction {
            instruction: i.clone(),
            signature: Signature::default(),
        };
        assert_eq!(
            verifier.verify_instruction(&unsigned, &presented(&i), NOW),
            Err(Refused::Unsigned)
        );
        let (stranger, _) = Signer::generate("pr-9").unwrap();
        assert_eq!(
            verifier.verify_instruction(&stranger.sign_instruction(i.clone()), &presented(&i), NOW),
            Err(Refused::UnknownKeyId("pr-9".into()))
        );
        let (impostor, _) = Signer::generate("pr-1").unwrap();
        assert_eq!(
            verifier.verify_instruction(&impostor.sign_instruction(i.clone()), &presented(&i), NOW),
            Err(Refused::BadSignature)
        );
        // Rotation: both keys verify while both are listed; the old one is refused once removed.
        let (new, _) = Signer::generate("pr-2").unwrap();
        let rotating = Verifier::new([signer.public_key(), new.public_key()]).unwrap();
        for s in [&signer, &new] {
            assert_eq!(
                rotating.verify_instruction(&s.sign_instruction(i.clone()), &presented(&i), NOW),
                Ok(())
            );
        }
        let after = Verifier::new([new.public_key()]).unwrap();
        assert_eq!(
            after.verify_instruction(&signer.sign_instruction(i.clone()), &presented(&i), NOW),
            Err(Refused::UnknownKeyId("pr-1".into()))
        );
    }

    #[test]
    fn validity_holds_to_the_clock_skew_on_either_edge_and_no_further() {
        let (signer, verifier) = pair("pr-1");
        let i = instruction();
        let signed = signer.sign_instruction(i.clone());
        let p = presented(&i);
        let issued = i.issued_at_unix_ms;
        let expires = i.expires_at_unix_ms;
        assert_eq!(
            verifier.verify_instruction(&signed, &p, issued - CLOCK_SKEW_MS),
            Ok(())
        );
        assert_eq!(
            verifier.verify_instruction(&signed, &p, issued - CLOCK_SKEW_MS - 1),
            Err(Refused::NotYetValid {
                issued_at_unix_ms: issued,
                now_unix_ms: issued - CLOCK_SKEW_MS - 1
            })
        );
        assert_eq!(
            verifier.verify_instruction(&signed, &p, expires + CLOCK_SKEW_MS),
            Ok(())
        );
        assert_eq!(
            verifier.verify_instruction(&signed, &p, expires + CLOCK_SKEW_MS + 1),
            Err(Refused::Expired {
                expires_at_unix_ms: expires,
                now_unix_ms: expires + CLOCK_SKEW_MS + 1
            })
        );
        let long = Instruction {
            expires_at_unix_ms: issued + TTL_MAX_MS as i64 + 1,
            ..i.clone()
        };
        assert_eq!(
            verifier.verify_instruction(
                &signer.sign_instruction(long.clone()),
                &presented(&long),
                NOW
            ),
            Err(Refused::TtlTooLong {
                ttl_ms: TTL_MAX_MS as i64 + 1
            })
        );
        for r in [
            Refused::Unsigned,
            Refused::UnknownKeyId(String::new()),
            Refused::BadSignature,
            mismatch("x", 1, 2),
            Refused::Expired {
                expires_at_unix_ms: 0,
                now_unix_ms: 0,
            },
            Refused::NotYetValid {
                issued_at_unix_ms: 0,
                now_unix_ms: 0,
            },
            Refused::TtlTooLong { ttl_ms: 0 },
        ] {
            assert!(REASONS.contains(&r.reason()), "{r:?}");
        }
    }
}
