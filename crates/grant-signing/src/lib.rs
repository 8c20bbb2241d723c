//! Signed grants. The lock service signs every grant it issues; both guards (the payment
//! resource and the rail proxy) verify the signature before their fence statement, with the lock
//! service's public keys alone: they still know nothing of etcd or of the lock service's address.
//!
//! What is signed: the lock key (`payout:{account_id}`), the fencing token, the owner and the
//! signing key's id, length-prefixed under a domain tag ([`message`]), with Ed25519 (`ring`). A
//! token the lock service never issued has no valid signature (`forged_grant`), and a real grant
//! names the key it was issued for, so a guard refuses it on another account's write
//! (`grant_for_another_key`): tokens are etcd revisions, global across keys, so without the key in
//! the signature account B's fence would accept a higher token minted for account A.
//!
//! Rotation: a verifier holds several public keys by id ([`Verifier::parse`]: `id=hex,id=hex`);
//! the lock service signs with one. Add the new public key to both guards, then switch the lock
//! service's signing key, then (after every grant signed by the old key has ended: one session
//! TTL) remove the old public key (ARCHITECTURE.md, `services/lock-server/RESTORE.md`).

use std::collections::BTreeMap;
use std::fmt;

use ring::rand::SystemRandom;
use ring::signature::{Ed25519KeyPair, KeyPair, UnparsedPublicKey, ED25519};

/// The domain tag: a signature over one kind of message is never valid for another.
const DOMAIN: &[u8] = b"payout-grant-v1";
/// An Ed25519 signature's length.
pub const SIGNATURE_LEN: usize = 64;
/// An Ed25519 public key's length.
pub const PUBLIC_KEY_LEN: usize = 32;
/// A key id is short and printable: it travels in every fenced call.
pub const KEY_ID_LENGTH_MAX: usize = 64;

/// The bytes a grant's signature covers: the domain tag, then each field length-prefixed (u32,
/// big-endian) so no two different grants share a message, then the token (u64, big-endian).
pub fn message(key_id: &str, key: &str, owner: &str, token: u64) -> Vec<u8> {
    let mut m = Vec::with_capacity(DOMAIN.len() + 12 + key_id.len() + key.len() + owner.len() + 8);
    m.extend_from_slice(DOMAIN);
    for field in [key_id, key, owner] {
        m.extend_from_slice(&(field.len() as u32).to_be_bytes());
        m.extend_from_slice(field.as_bytes());
    }
    m.extend_from_slice(&token.to_be_bytes());
    m
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum KeyError {
    #[error("grant signing key {0}: not an Ed25519 PKCS#8 document")]
    BadPrivateKey(String),
    #[error("grant key id {0:?}: must be 1..={KEY_ID_LENGTH_MAX} characters of [A-Za-z0-9._-]")]
    BadKeyId(String),
    #[error("grant public key {0:?}: expected `key_id=<64 hex digits>`")]
    BadPublicKey(String),
    #[error("no grant verification key given: the guards refuse every fenced call without one")]
    NoKeys,
    #[error("grant key id {0:?} given twice")]
    DuplicateKeyId(String),
}

fn check_key_id(id: &str) -> Result<(), KeyError> {
    let ok = !id.is_empty()
        && id.len() <= KEY_ID_LENGTH_MAX
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    if ok {
        Ok(())
    } else {
        Err(KeyError::BadKeyId(id.to_string()))
    }
}

/// A grant's signature as it travels: which key made it, and the 64 bytes.
#[derive(Clone, PartialEq, Eq, Default)]
pub struct Signature {
    pub key_id: String,
    pub bytes: Vec<u8>,
}

impl fmt::Debug for Signature {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Signature({}:{})", self.key_id, hex(&self.bytes))
    }
}

/// The lock service's signing key.
pub struct Signer {
    key_id: String,
    pair: Ed25519KeyPair,
}

impl fmt::Debug for Signer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Signer({})", self.public_key())
    }
}

impl Signer {
    /// A signing key from its PKCS#8 document (what [`Signer::generate`] returns).
    pub fn from_pkcs8(key_id: &str, pkcs8: &[u8]) -> Result<Self, KeyError> {
        check_key_id(key_id)?;
        let pair = Ed25519KeyPair::from_pkcs8(pkcs8)
            .map_err(|_| KeyError::BadPrivateKey(key_id.to_string()))?;
        Ok(Self {
            key_id: key_id.to_string(),
            pair,
        })
    }

    /// A signing key from the text form [`Signer::generate`] writes: the PKCS#8 document in hex.
    pub fn from_hex(key_id: &str, text: &str) -> Result<Self, KeyError> {
        let bytes =
            unhex(text.trim()).ok_or_else(|| KeyError::BadPrivateKey(key_id.to_string()))?;
        Self::from_pkcs8(key_id, &bytes)
    }

    /// A fresh key: the signer and its PKCS#8 document in hex (keep it secret).
    pub fn generate(key_id: &str) -> Result<(Self, String), KeyError> {
        check_key_id(key_id)?;
        let doc = Ed25519KeyPair::generate_pkcs8(&SystemRandom::new())
            .map_err(|_| KeyError::BadPrivateKey(key_id.to_string()))?;
        let signer = Self::from_pkcs8(key_id, doc.as_ref())?;
        Ok((signer, hex(doc.as_ref())))
    }

    pub fn key_id(&self) -> &str {
        &self.key_id
    }

    /// What the guards are given to verify this key's grants.
    pub fn public_key(&self) -> PublicKey {
        let mut bytes = [0u8; PUBLIC_KEY_LEN];
        bytes.copy_from_slice(self.pair.public_key().as_ref());
        PublicKey {
            key_id: self.key_id.clone(),
            bytes,
        }
    }

    /// Signs the grant of `key` with `token` to `owner`.
    pub fn sign(&self, key: &str, token: u64, owner: &str) -> Signature {
        let sig = self.pair.sign(&message(&self.key_id, key, owner, token));
        Signature {
            key_id: self.key_id.clone(),
            bytes: sig.as_ref().to_vec(),
        }
    }
}

/// One public key of the lock service, by id. Text form: `key_id=<64 hex digits>`.
#[derive(Clone, PartialEq, Eq)]
pub struct PublicKey {
    pub key_id: String,
    pub bytes: [u8; PUBLIC_KEY_LEN],
}

impl fmt::Display for PublicKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}={}", self.key_id, hex(&self.bytes))
    }
}

impl fmt::Debug for PublicKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl std::str::FromStr for PublicKey {
    type Err = KeyError;
    fn from_str(s: &str) -> Result<Self, KeyError> {
        let bad = || KeyError::BadPublicKey(s.to_string());
        let (id, key) = s.trim().split_once('=').ok_or_else(bad)?;
        check_key_id(id)?;
        let raw = unhex(key).ok_or_else(bad)?;
        let bytes: [u8; PUBLIC_KEY_LEN] = raw.try_into().map_err(|_| bad())?;
        Ok(Self {
            key_id: id.to_string(),
            bytes,
        })
    }
}

/// Why a grant's signature was refused (the guards' `forged_grant`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Forged {
    #[error("the grant carries no signature")]
    Unsigned,
    #[error("the grant is signed by key {0:?}, which this guard does not know")]
    UnknownKeyId(String),
    #[error("the grant's signature does not match its key, token and owner")]
    BadSignature,
}

impl Forged {
    /// The refusal's reason as the wire, the audit rows and the metrics' labels name it.
    pub fn reason(&self) -> &'static str {
        match self {
            Forged::Unsigned => "unsigned",
            Forged::UnknownKeyId(_) => "unknown_key_id",
            Forged::BadSignature => "bad_signature",
        }
    }
}

/// The guards' side: the lock service's public keys, by id (several at once during a rotation).
#[derive(Clone)]
pub struct Verifier {
    keys: BTreeMap<String, [u8; PUBLIC_KEY_LEN]>,
}

impl fmt::Debug for Verifier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.keys.keys()).finish()
    }
}

impl Verifier {
    pub fn new(keys: impl IntoIterator<Item = PublicKey>) -> Result<Self, KeyError> {
        let mut map = BTreeMap::new();
        for k in keys {
            if map.insert(k.key_id.clone(), k.bytes).is_some() {
                return Err(KeyError::DuplicateKeyId(k.key_id));
            }
        }
        if map.is_empty() {
            return Err(KeyError::NoKeys);
        }
        Ok(Self { keys: map })
    }

    /// A verifier that knows no key: every grant is refused (unsigned, or by an unknown key).
    /// For a process that must never accept a fenced call (the payment resource's fixture
    /// command); a serving guard is always given keys ([`Verifier::new`] refuses none).
    pub fn refusing_all() -> Self {
        Self {
            keys: BTreeMap::new(),
        }
    }

    /// `id=hex[,id=hex...]`, as the guards' `--grant-verify-keys` takes it.
    pub fn parse(spec: &str) -> Result<Self, KeyError> {
        Self::new(
            spec.split(',')
                .filter(|p| !p.trim().is_empty())
                .map(str::parse)
                .collect::<Result<Vec<PublicKey>, _>>()?,
        )
    }

    /// The key ids this verifier accepts.
    pub fn key_ids(&self) -> impl Iterator<Item = &str> {
        self.keys.keys().map(String::as_str)
    }

    /// Whether `signature` is the lock service's over (`key`, `token`, `owner`).
    pub fn verify(
        &self,
        key: &str,
        token: u64,
        owner: &str,
        signature: &Signature,
    ) -> Result<(), Forged> {
        if signature.bytes.is_empty() && signature.key_id.is_empty() {
            return Err(Forged::Unsigned);
        }
        let public = self
            .keys
            .get(&signature.key_id)
            .ok_or_else(|| Forged::UnknownKeyId(signature.key_id.clone()))?;
        UnparsedPublicKey::new(&ED25519, public)
            .verify(
                &message(&signature.key_id, key, owner, token),
                &signature.bytes,
            )
            .map_err(|_| Forged::BadSignature)
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(text: &str) -> Option<Vec<u8>> {
    if !text.len().is_multiple_of(2) {
        return None;
    }
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(text.get(i..i + 2)?, 16).ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair() -> (Signer, Verifier) {
        let (signer, _) = Signer::generate("k1").unwrap();
        let verifier = Verifier::new([signer.public_key()]).unwrap();
        (signer, verifier)
    }

    #[test]
    fn a_signed_grant_verifies_and_any_change_to_it_does_not() {
        let (signer, verifier) = pair();
        let sig = signer.sign("payout:acct-a", 42, "worker-1");
        assert_eq!(
            verifier.verify("payout:acct-a", 42, "worker-1", &sig),
            Ok(())
        );
        for (key, token, owner) in [
            ("payout:acct-b", 42, "worker-1"),
            ("payout:acct-a", 43, "worker-1"),
            ("payout:acct-a", i64::MAX as u64, "worker-1"),
            ("payout:acct-a", 42, "worker-2"),
        ] {
            assert_eq!(
                verifier.verify(key, token, owner, &sig),
                Err(Forged::BadSignature),
                "{key} {token} {owner}"
            );
        }
        let mut flipped = sig.clone();
        flipped.bytes[0] ^= 1;
        assert_eq!(
            verifier.verify("payout:acct-a", 42, "worker-1", &flipped),
            Err(Forged::BadSignature)
        );
    }

    #[test]
    fn unsigned_unknown_and_short_signatures_are_refused() {
        let (signer, verifier) = pair();
        assert_eq!(
            verifier.verify("payout:a", 1, "w", &Signature::default()),
            Err(Forged::Unsigned)
        );
        let (other, _) = Signer::generate("k2").unwrap();
        assert_eq!(
            verifier.verify("payout:a", 1, "w", &other.sign("payout:a", 1, "w")),
            Err(Forged::UnknownKeyId("k2".into()))
        );
        let mut short = signer.sign("payout:a", 1, "w");
        short.bytes.truncate(10);
        assert_eq!(
            verifier.verify("payout:a", 1, "w", &short),
            Err(Forged::BadSignature)
        );
        // Another key presenting itself under a known id fails too.
        let (impostor, _) = Signer::generate("k1").unwrap();
        assert_eq!(
            verifier.verify("payout:a", 1, "w", &impostor.sign("payout:a", 1, "w")),
            Err(Forged::BadSignature)
        );
    }

    #[test]
    fn fields_cannot_slide_into_each_other() {
        assert_ne!(message("k", "ab", "c", 1), message("k", "a", "bc", 1));
    }

    #[test]
    fn keys_round_trip_through_their_text_forms_and_rotation_holds_two() {
        let (old, old_secret) = Signer::generate("2026-11").unwrap();
        let (new, _) = Signer::generate("2026-12").unwrap();
        let again = Signer::from_hex("2026-11", &old_secret).unwrap();
        assert_eq!(again.public_key(), old.public_key());
        let spec = format!("{},{}", old.public_key(), new.public_key());
        let verifier = Verifier::parse(&spec).unwrap();
        assert_eq!(
            verifier.key_ids().collect::<Vec<_>>(),
            ["2026-11", "2026-12"]
        );
        for s in [&old, &new] {
            assert_eq!(
                verifier.verify("payout:a", 9, "w", &s.sign("payout:a", 9, "w")),
                Ok(())
            );
        }
        assert!(matches!(Verifier::parse(""), Err(KeyError::NoKeys)));
        assert!(matches!(
            Verifier::parse("k=zz"),
            Err(KeyError::BadPublicKey(_))
        ));
        assert!(matches!(
            Signer::from_hex("k", "00"),
            Err(KeyError::BadPrivateKey(_))
        ));
        assert!(matches!(
            Signer::generate("bad id"),
            Err(KeyError::BadKeyId(_))
        ));
    }
}
