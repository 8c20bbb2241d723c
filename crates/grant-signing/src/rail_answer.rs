//! Rail answers: what the rail said, signed by the rail and verified by the rail proxy before it
//! acts on it, as payment providers sign their responses and webhooks.
//!
//! Without it, anything that can answer on the rail's address (an impostor on the network, a
//! compromised container on the path) can say `accepted` for a payment that never moved (the
//! customer debited for nothing) or `declined` for one that did (money gone, nothing debited),
//! and the reconciler, which asks through the proxy, would believe it too.
//!
//! The rail signs every answer it gives on its payments API with Ed25519 (the proxy holds only
//! the public key, so the proxy's own configuration cannot forge an answer). The signature covers
//! the request the answer is for, as the proxy sent it (a fresh random **request id** the proxy
//! sends as [`REQUEST_ID_HEADER`], the method, the path and query, the SHA-256 of the request
//! body) and the answer itself (its HTTP status, when it was signed, the exact body bytes). An
//! answer cannot be moved to another request, including a genuine `accepted` replayed for
//! another payment: the request id is never reused. The signature travels in
//! [`SIGNATURE_HEADER`]: `v1; key_id=<id>; t=<unix ms>; sig=<128 hex digits>`.
//!
//! The proxy treats an answer that fails verification as an **ambiguous** outcome (a payment) or
//! an **unknown** lookup, never as an accept, a decline, FOUND or ABSENT: an unauthenticated
//! answer tells nothing about what the rail did, so only an authenticated answer (or an
//! operator's signed decision) may settle the payout.

use ring::digest::{digest, SHA256};
use ring::rand::{SecureRandom, SystemRandom};

use crate::{hex, unhex, Message, Signature, Signer, Verifier, SIGNATURE_LEN};

/// Domain tag: a rail answer's signature is never valid as any other fact's, nor theirs as this.
const DOMAIN: &[u8] = b"payout-rail-answer-v1";

/// The request header carrying the proxy's fresh request id (the rail signs it back).
pub const REQUEST_ID_HEADER: &str = "rail-request-id";
/// The answer header carrying the rail's signature.
pub const SIGNATURE_HEADER: &str = "rail-signature";
/// The signature header's version prefix.
const VERSION: &str = "v1";
/// An answer signed further than this from the verifier's clock is refused `stale`: the request
/// id already binds it to one request, so this only bounds how long a captured pair is useful.
pub const MAX_SKEW_MS: i64 = 5 * 60 * 1_000;
/// Longest request id accepted (the proxy's are 32 hex digits).
pub const REQUEST_ID_LENGTH_MAX: usize = 64;

/// Every reason an answer is refused, as `rail_answers_unauthenticated_total{reason}` names it.
pub const REASONS: [&str; 5] = [
    "unsigned",
    "malformed",
    "unknown_key_id",
    "bad_signature",
    "stale",
];

/// One answer of the rail to one request, as both sides see it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answer<'a> {
    /// The proxy's request id for this call.
    pub request_id: &'a str,
    /// `POST`, `GET`.
    pub method: &'a str,
    /// The request's path and query, as sent (`/v1/payments?client_reference=...`).
    pub path_and_query: &'a str,
    /// The request's body (hashed into the message).
    pub request_body: &'a [u8],
    /// The answer's HTTP status.
    pub status: u16,
    /// When the rail signed it.
    pub signed_at_unix_ms: i64,
    /// The answer's body, exactly as sent.
    pub body: &'a [u8],
}

impl Answer<'_> {
    /// The bytes the signature covers: domain tag, the signing key's id, request id, method, path
    /// and query (each length-prefixed), the request body's SHA-256 (length-prefixed), the
    /// status, the signing time, then the answer's body (length-prefixed).
    pub fn message(&self, key_id: &str) -> Vec<u8> {
        let mut m = Message::new(DOMAIN);
        for field in [key_id, self.request_id, self.method, self.path_and_query] {
            m.text(field);
        }
        m.bytes(digest(&SHA256, self.request_body).as_ref())
            .u64(u64::from(self.status))
            .i64(self.signed_at_unix_ms)
            .bytes(self.body);
        m.into_bytes()
    }
}

/// Why a rail answer was not believed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Unauthenticated {
    #[error("the answer carries no rail signature")]
    Unsigned,
    #[error("the rail signature header is malformed: {0}")]
    Malformed(String),
    #[error("the answer is signed by key {0:?}, which the proxy does not know")]
    UnknownKeyId(String),
    #[error("the rail signature does not match this request and answer")]
    BadSignature,
    #[error(
        "signed at {signed_at_unix_ms} ms, more than {MAX_SKEW_MS} ms from now ({now_unix_ms} ms)"
    )]
    Stale {
        signed_at_unix_ms: i64,
        now_unix_ms: i64,
    },
}

impl Unauthenticated {
    /// As the metrics' labels and the logs name it (one of [`REASONS`]).
    pub fn reason(&self) -> &'static str {
        match self {
            Unauthenticated::Unsigned => "unsigned",
            Unauthenticated::Malformed(_) => "malformed",
            Unauthenticated::UnknownKeyId(_) => "unknown_key_id",
            Unauthenticated::BadSignature => "bad_signature",
            Unauthenticated::Stale { .. } => "stale",
        }
    }
}

/// A fresh request id: 128 random bits in hex.
pub fn request_id() -> String {
    let mut bytes = [0u8; 16];
    // The system's randomness failing is not recoverable (ring's SystemRandom reads getrandom).
    SystemRandom::new()
        .fill(&mut bytes)
        .expect("the system random source works");
    hex(&bytes)
}

/// The signature header's value for `signature` made at `signed_at_unix_ms`.
pub fn header_value(signature: &Signature, signed_at_unix_ms: i64) -> String {
    format!(
        "{VERSION}; key_id={}; t={signed_at_unix_ms}; sig={}",
        signature.key_id,
        hex(&signature.bytes)
    )
}

/// The signature and signing time a header carries, or why it is malformed.
pub fn parse_header(value: &str) -> Result<(Signature, i64), Unauthenticated> {
    let malformed = |what: &str| Unauthenticated::Malformed(what.to_string());
    let mut parts = value.split(';').map(str::trim);
    if parts.next() != Some(VERSION) {
        return Err(malformed("not a v1 signature"));
    }
    let (mut key_id, mut at, mut sig) = (None, None, None);
    for part in parts {
        let (name, v) = part
            .split_once('=')
            .ok_or_else(|| malformed("a field without `=`"))?;
        let slot = match name {
            "key_id" => &mut key_id,
            "t" => &mut at,
            "sig" => &mut sig,
            _ => return Err(malformed("an unknown field")),
        };
        if slot.replace(v).is_some() {
            return Err(malformed("a field given twice"));
        }
    }
    let key_id = key_id.ok_or_else(|| malformed("no key_id"))?;
    let at: i64 = at
        .ok_or_else(|| malformed("no t"))?
        .parse()
        .map_err(|_| malformed("t is not an integer"))?;
    let bytes = unhex(sig.ok_or_else(|| malformed("no sig"))?)
        .filter(|b| b.len() == SIGNATURE_LEN)
        .ok_or_else(|| malformed("sig is not 64 bytes in hex"))?;
    Ok((
        Signature {
            key_id: key_id.to_string(),
            bytes,
        },
        at,
    ))
}

impl Signer {
    /// The rail's signature header value over `answer` (whose `signed_at_unix_ms` is the time
    /// written into the header).
    pub fn sign_rail_answer(&self, answer: &Answer<'_>) -> String {
        let signature = self.sign_message(&answer.message(self.key_id()));
        header_value(&signature, answer.signed_at_unix_ms)
    }
}

impl Verifier {
    /// Whether `header` (the [`SIGNATURE_HEADER`] value, `None` when absent) is a registered rail
    /// key's signature over exactly this request and answer, made within [`MAX_SKEW_MS`] of
    /// `now_unix_ms`. `answer.signed_at_unix_ms` is ignored: the header's time is the one signed.
    pub fn verify_rail_answer(
        &self,
        answer: &Answer<'_>,
        header: Option<&str>,
        now_unix_ms: i64,
    ) -> Result<(), Unauthenticated> {
        let header = header.ok_or(Unauthenticated::Unsigned)?;
        let (signature, signed_at_unix_ms) = parse_header(header)?;
        let signed = Answer {
            signed_at_unix_ms,
            ..answer.clone()
        };
        self.verify_message(&signature, |key_id| signed.message(key_id))
            .map_err(|forged| match forged {
                crate::Forged::Unsigned => Unauthenticated::Unsigned,
                crate::Forged::UnknownKeyId(id) => Unauthenticated::UnknownKeyId(id),
                crate::Forged::BadSignature => Unauthenticated::BadSignature,
            })?;
        if (signed_at_unix_ms - now_unix_ms).abs() > MAX_SKEW_MS {
            return Err(Unauthenticated::Stale {
                signed_at_unix_ms,
                now_unix_ms,
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const NOW: i64 = 1_800_000_000_000;

    fn answer() -> Answer<'static> {
        Answer {
            request_id: "00112233445566778899aabbccddeeff",
            method: "POST",
            path_and_query: "/v1/payments",
            request_body: br#"{"client_reference":"cref-p-1","amount_minor":1000}"#,
            status: 200,
            signed_at_unix_ms: NOW,
            body: br#"{"status":"accepted","rail_ref":"rail-1"}"#,
        }
    }

    fn pair() -> (Signer, Verifier) {
        let (signer, _) = Signer::generate("rail-1").unwrap();
        let verifier = Verifier::new([signer.public_key()]).unwrap();
        (signer, verifier)
    }

    #[test]
    fn a_signed_answer_verifies_and_any_change_of_request_or_answer_breaks_it() {
        let (signer, verifier) = pair();
        let a = answer();
        let header = signer.sign_rail_answer(&a);
        assert_eq!(verifier.verify_rail_answer(&a, Some(&header), NOW), Ok(()));
        let changed = [
            Answer {
                request_id: "ffeeddccbbaa99887766554433221100",
                ..a.clone()
            },
            Answer {
                method: "GET",
                ..a.clone()
            },
            Answer {
                path_and_query: "/v1/payments?client_reference=x",
                ..a.clone()
            },
            Answer {
                request_body: br#"{"client_reference":"cref-p-1","amount_minor":1001}"#,
                ..a.clone()
            },
            Answer {
                status: 422,
                ..a.clone()
            },
            Answer {
                body: br#"{"status":"accepted","rail_ref":"rail-2"}"#,
                ..a.clone()
            },
        ];
        for c in changed {
            assert_eq!(
                verifier.verify_rail_answer(&c, Some(&header), NOW),
                Err(Unauthenticated::BadSignature),
                "{c:?}"
            );
        }
    }

    #[test]
    fn missing_malformed_foreign_and_stale_signatures_are_named() {
        let (signer, verifier) = pair();
        let a = answer();
        assert_eq!(
            verifier.verify_rail_answer(&a, None, NOW),
            Err(Unauthenticated::Unsigned)
        );
        for bad in [
            "",
            "v2; key_id=rail-1; t=1; sig=00",
            "v1; key_id=rail-1; t=x; sig=00",
            "v1; key_id=rail-1; t=1",
            "v1; key_id=rail-1; t=1; sig=zz",
            "v1; key_id=rail-1; key_id=rail-2; t=1; sig=00",
        ] {
            let refused = verifier.verify_rail_answer(&a, Some(bad), NOW).unwrap_err();
            assert_eq!(refused.reason(), "malformed", "{bad:?}: {refused}");
        }
        let (impostor, _) = Signer::generate("rail-2").unwrap();
        assert_eq!(
            verifier.verify_rail_answer(&a, Some(&impostor.sign_rail_answer(&a)), NOW),
            Err(Unauthenticated::UnknownKeyId("rail-2".into()))
        );
        let (same_id, _) = Signer::generate("rail-1").unwrap();
        assert_eq!(
            verifier.verify_rail_answer(&a, Some(&same_id.sign_rail_answer(&a)), NOW),
            Err(Unauthenticated::BadSignature)
        );
        // The time is signed: moving it in the header breaks the signature.
        let header = signer.sign_rail_answer(&a);
        let moved = header.replace(&format!("t={NOW}"), &format!("t={}", NOW + 1));
        assert_eq!(
            verifier.verify_rail_answer(&a, Some(&moved), NOW),
            Err(Unauthenticated::BadSignature)
        );
        for at in [NOW - MAX_SKEW_MS - 1, NOW + MAX_SKEW_MS + 1] {
            let old = Answer {
                signed_at_unix_ms: at,
                ..a.clone()
            };
            let refused = verifier
                .verify_rail_answer(&a, Some(&signer.sign_rail_answer(&old)), NOW)
                .unwrap_err();
            assert_eq!(refused.reason(), "stale");
        }
        let edge = Answer {
            signed_at_unix_ms: NOW - MAX_SKEW_MS,
            ..a.clone()
        };
        assert_eq!(
            verifier.verify_rail_answer(&a, Some(&signer.sign_rail_answer(&edge)), NOW),
            Ok(())
        );
    }

    #[test]
    fn a_rail_answer_signature_is_no_other_facts() {
        let (signer, verifier) = pair();
        let a = answer();
        let header = signer.sign_rail_answer(&a);
        let (signature, _) = parse_header(&header).unwrap();
        // Not a grant's signature over anything the answer's fields could spell.
        assert!(verifier
            .verify("/v1/payments", 200, "POST", &signature)
            .is_err());
        assert_eq!(REASONS.len(), 5);
        for r in [
            Unauthenticated::Unsigned,
            Unauthenticated::Malformed(String::new()),
            Unauthenticated::UnknownKeyId(String::new()),
            Unauthenticated::BadSignature,
            Unauthenticated::Stale {
                signed_at_unix_ms: 0,
                now_unix_ms: 0,
            },
        ] {
            assert!(REASONS.contains(&r.reason()));
        }
    }

    #[test]
    fn request_ids_are_fresh_and_128_bits() {
        let (a, b) = (request_id(), request_id());
        assert_ne!(a, b);
        assert_eq!(a.len(), 32);
        assert!(a.len() <= REQUEST_ID_LENGTH_MAX);
    }
}
