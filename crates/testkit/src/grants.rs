//! The signing keys of a system under test (or of the local stack): generated on first use into
//! the system's directory, never committed, the same across restarts of its processes. Three
//! [`SigningKey`]s, each secret given to its one owner and its public half to the verifiers: the
//! grant key (lock-server signs; both guards verify, `--grant-verify-keys`), the instruction key
//! (payment resource signs; rail proxy verifies, `--instruction-verify-keys`) and the rail-fact key
//! (rail proxy signs; payment resource verifies, `--rail-fact-verify-keys`). And the operator's key.

use std::path::{Path, PathBuf};

use anyhow::Context;
use grant_signing::{PublicKey, Signer};

/// The key id the test systems and the local stack sign grants under.
pub const KEY_ID: &str = "local-1";
const KEY_FILE: &str = "grant-signing.key";
/// The payment resource's instruction key of the test systems and the local stack.
pub const INSTRUCTION_KEY_ID: &str = "local-instruction-1";
const INSTRUCTION_KEY_FILE: &str = "instruction-signing.key";
/// The rail proxy's rail-fact key of the test systems and the local stack.
pub const RAIL_FACT_KEY_ID: &str = "local-rail-fact-1";
const RAIL_FACT_KEY_FILE: &str = "rail-fact-signing.key";
/// The rail's (the stub's) answer key of the test systems and the local stack: the provider's
/// key, outside the system's own; the proxy holds its public half (`--rail-answer-verify-keys`).
pub const RAIL_ANSWER_KEY_ID: &str = "local-rail-answer-1";
const RAIL_ANSWER_KEY_FILE: &str = "rail-answer-signing.key";

/// One Ed25519 signing key on disk: its id, its secret's file and its public half.
#[derive(Debug, Clone)]
pub struct SigningKey {
    pub key_id: String,
    /// The private key (PKCS#8 in hex), mode 0600.
    pub key_file: PathBuf,
    pub public_key: PublicKey,
}

impl SigningKey {
    /// The key `key_id` in `dir/file`, made now if it is not there yet.
    pub fn in_dir(dir: &Path, file: &str, key_id: &str) -> anyhow::Result<Self> {
        let key_file = dir.join(file);
        let signer = load_or_generate(&key_file, key_id)?;
        Ok(Self {
            key_id: key_id.to_string(),
            key_file,
            public_key: signer.public_key(),
        })
    }

    /// The lock-server's grant key in `dir`.
    pub fn grant(dir: &Path) -> anyhow::Result<Self> {
        Self::in_dir(dir, KEY_FILE, KEY_ID)
    }

    /// The payment resource's instruction key in `dir`.
    pub fn instruction(dir: &Path) -> anyhow::Result<Self> {
        Self::in_dir(dir, INSTRUCTION_KEY_FILE, INSTRUCTION_KEY_ID)
    }

    /// The rail proxy's rail-fact key in `dir`.
    pub fn rail_fact(dir: &Path) -> anyhow::Result<Self> {
        Self::in_dir(dir, RAIL_FACT_KEY_FILE, RAIL_FACT_KEY_ID)
    }

    /// The rail stub's answer key in `dir`.
    pub fn rail_answer(dir: &Path) -> anyhow::Result<Self> {
        Self::in_dir(dir, RAIL_ANSWER_KEY_FILE, RAIL_ANSWER_KEY_ID)
    }

    /// The signing process's arguments for this key: `--{kind}-signing-key-id ID
    /// --{kind}-signing-key-file FILE` (`kind`: `grant`, `instruction`, `rail-fact`, `answer`).
    pub fn signing_args(&self, kind: &str) -> [std::ffi::OsString; 4] {
        [
            format!("--{kind}-signing-key-id").into(),
            self.key_id.clone().into(),
            format!("--{kind}-signing-key-file").into(),
            self.key_file.clone().into_os_string(),
        ]
    }

    /// A verifier of this key alone, for in-process hosts.
    pub fn verifier(&self) -> anyhow::Result<grant_signing::Verifier> {
        Ok(grant_signing::Verifier::new([self.public_key.clone()])?)
    }

    /// The signer itself, for a test that mints grants without the lock service.
    pub fn signer(&self) -> anyhow::Result<Signer> {
        let text = std::fs::read_to_string(&self.key_file)?;
        Ok(Signer::from_hex(&self.key_id, &text)?)
    }

    /// What the verifiers' `--*-verify-keys` takes.
    pub fn verify_keys(&self) -> String {
        self.public_key.to_string()
    }

    /// The lock-server's arguments for this (grant) key.
    pub fn lock_server_args(&self) -> [std::ffi::OsString; 4] {
        self.signing_args("grant")
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

    /// An operator's existing key (`payoutctl keys operator --name NAME --out FILE`), for a
    /// deployment: nothing is generated.
    pub fn load(name: &str, key_file: &Path) -> anyhow::Result<Self> {
        use anyhow::Context;
        let text = std::fs::read_to_string(key_file)
            .with_context(|| format!("reading the operator key {}", key_file.display()))?;
        Ok(Self {
            signer: Signer::from_hex(name, &text)
                .with_context(|| format!("reading the operator key {}", key_file.display()))?,
            key_file: key_file.to_path_buf(),
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

impl OperatorKey {
    /// This operator's authorisation of `account`'s opening balance, signed now (what `payoutctl
    /// sign fund` prints): the payment resource opens a funded account only under one.
    pub fn funding(
        &self,
        account: &str,
        currency: &str,
        amount_minor: i64,
    ) -> payment_client::model::Funding {
        let signed_at_unix_ms = grant_signing::operator::now_unix_ms();
        let operator = self.signer.key_id();
        let signature = self.signer.sign_funding(&grant_signing::operator::Funding {
            operator,
            account_id: account,
            currency,
            amount_minor,
            signed_at_unix_ms,
        });
        payment_client::model::Funding {
            operator: operator.to_string(),
            signature: signature.bytes,
            signed_at_unix_ms,
        }
    }

    /// Opens `account` with `balance_minor` through `client` (a certificate of a role that may
    /// call OpenAccount), the funding signed by this operator (none for an empty account).
    pub async fn open_account(
        &self,
        client: &payment_client::PaymentClient,
        account: &payout_domain::AccountId,
        currency: &payout_domain::Currency,
        balance_minor: i64,
    ) -> Result<payment_client::model::Account, payment_client::PaymentError> {
        if balance_minor == 0 {
            return client.open_account(account, currency, 0).await;
        }
        let funding = self.funding(account.as_str(), currency.as_str(), balance_minor);
        client
            .open_funded_account(account, currency, balance_minor, &funding)
            .await
    }

    /// The payment resource's (and the reconciler's) verifier of this operator alone.
    pub fn verifier(&self) -> grant_signing::Verifier {
        grant_signing::Verifier::new([self.signer.public_key()]).expect("one operator key")
    }
}

/// One registered operator for a test process's in-process payment resources: their
/// `StoreOptions::with_operator_keys(test_operator().verifier())`, and the fundings the tests sign.
pub fn test_operator() -> &'static OperatorKey {
    static OPERATOR_KEY: std::sync::OnceLock<(tempfile::TempDir, OperatorKey)> =
        std::sync::OnceLock::new();
    &OPERATOR_KEY
        .get_or_init(|| {
            let dir = tempfile::tempdir().expect("a folder for the test operator's key");
            let key = OperatorKey::in_dir(dir.path()).expect("the test operator's key");
            (dir, key)
        })
        .1
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
