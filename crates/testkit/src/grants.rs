//! The grant signing key of a system under test (or of the local stack): generated on first use
//! into the system's directory, never committed, the same across restarts of its processes. The
//! lock-server signs with it; both guards are given its public half (`--grant-verify-keys`).

use std::path::{Path, PathBuf};

use anyhow::Context;
use grant_signing::{PublicKey, Signer};

/// The key id the test systems and the local stack sign under.
pub const KEY_ID: &str = "local-1";
const KEY_FILE: &str = "grant-signing.key";

#[derive(Debug, Clone)]
pub struct GrantKeys {
    pub key_id: String,
    /// The private key (PKCS#8 in hex), mode 0600.
    pub key_file: PathBuf,
    pub public_key: PublicKey,
}

impl GrantKeys {
    /// The key in `dir`, made now if it is not there yet.
    pub fn in_dir(dir: &Path) -> anyhow::Result<Self> {
        let key_file = dir.join(KEY_FILE);
        let signer = load_or_generate(&key_file, KEY_ID)?;
        Ok(Self {
            key_id: KEY_ID.to_string(),
            key_file,
            public_key: signer.public_key(),
        })
    }

    /// The signer itself, for a test that mints grants without the lock service.
    pub fn signer(&self) -> anyhow::Result<Signer> {
        let text = std::fs::read_to_string(&self.key_file)?;
        Ok(Signer::from_hex(&self.key_id, &text)?)
    }

    /// What the guards' `--grant-verify-keys` takes.
    pub fn verify_keys(&self) -> String {
        self.public_key.to_string()
    }

    /// The lock-server's arguments for this key.
    pub fn lock_server_args(&self) -> [std::ffi::OsString; 4] {
        [
            "--grant-signing-key-id".into(),
            self.key_id.clone().into(),
            "--grant-signing-key-file".into(),
            self.key_file.clone().into_os_string(),
        ]
    }
}

/// The Ed25519 key `key_id` in `key_file` (PKCS#8 hex), made there first (mode 0600) if absent.
fn load_or_generate(key_file: &Path, key_id: &str) -> anyhow::Result<Signer> {
    match std::fs::read_to_string(key_file) {
        Ok(text) => Signer::from_hex(key_id, &text)
            .with_context(|| format!("reading {}", key_file.display())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let (signer, secret) = Signer::generate(key_id)?;
            write_secret(key_file, &secret)?;
            Ok(signer)
        }
        Err(e) => Err(e).with_context(|| format!("reading {}", key_file.display())),
    }
}

/// The operator of a system under test (or of the local stack): a key pair registered with the
/// payment resource (`--operator-keys`), which signs abandon signals as `payoutctl sign abandon`
/// does.
pub struct OperatorKey {
    pub signer: Signer,
    pub key_file: PathBuf,
}

/// The name the test systems' and the local stack's operator is registered under.
pub const OPERATOR: &str = "operator-1";

impl OperatorKey {
    pub fn in_dir(dir: &Path) -> anyhow::Result<Self> {
        let key_file = dir.join(format!("{OPERATOR}.key"));
        Ok(Self {
            signer: load_or_generate(&key_file, OPERATOR)?,
            key_file,
        })
    }

    /// What the payment resource's `--operator-keys` takes.
    pub fn registered(&self) -> String {
        self.signer.public_key().to_string()
    }

    /// The `abandon` signal's JSON for `payout_id`, signed now by this operator.
    pub fn abandon_signal(&self, payout_id: &str, reason: &str) -> serde_json::Value {
        let signed_at_unix_ms = grant_signing::operator::now_unix_ms();
        let signature = self
            .signer
            .sign_decision(&grant_signing::operator::Decision {
                operator: OPERATOR,
                decision: "abandon",
                payout_id,
                reason,
                signed_at_unix_ms,
            });
        serde_json::json!({
            "operator": OPERATOR,
            "reason": reason,
            "signed_at_unix_ms": signed_at_unix_ms,
            "signature": grant_signing::operator::to_hex(&signature.bytes),
        })
    }
}

impl std::fmt::Debug for OperatorKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OperatorKey")
            .field("key_file", &self.key_file)
            .finish_non_exhaustive()
    }
}

/// Writes a secret readable by its owner only.
pub fn write_secret(path: &Path, text: &str) -> anyhow::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .with_context(|| format!("creating {}", path.display()))?;
    f.write_all(text.as_bytes())?;
    Ok(())
}
