//! `payoutctl keys`: the keys an operator makes for a deployment.
//!
//! `keys grant-signing --key-id ID --out FILE` makes the lock service's grant signing key
//! (Ed25519, `crates/grant-signing`): the secret goes to FILE (its PKCS#8 document in hex, mode
//! 0600, never over an existing file) and the public key line the guards take
//! (`--grant-verify-keys` / `GRANT_VERIFY_KEYS`, `id=hex`) goes to standard output, alone, so a
//! script can capture it. The lock-server takes the secret with `--grant-signing-key-id ID
//! --grant-signing-key-file FILE`.
//!
//! `keys grant-public-key --key-id ID --key-file FILE` prints the public key line of a key made
//! earlier (a rotation adds it to the guards' list before the lock-server switches to it).

use std::path::{Path, PathBuf};

use anyhow::Context;
use clap::{Args as ClapArgs, Subcommand};
use grant_signing::Signer;

#[derive(Subcommand)]
pub enum Command {
    /// Make the lock service's grant signing key: the secret to --out (mode 0600, never
    /// overwritten), the guards' public key line (`id=hex`) to standard output.
    GrantSigning(GrantSigningArgs),
    /// Print the guards' public key line (`id=hex`) of an existing grant signing key.
    GrantPublicKey(GrantPublicKeyArgs),
    /// Make an operator's own key: the secret to --out (mode 0600, never overwritten; it stays
    /// with the operator), the registration line (`name=hex`, for the payment resource's
    /// --operator-keys / PAYOUT_OPERATOR_KEYS) to standard output.
    Operator(OperatorArgs),
}

#[derive(ClapArgs)]
pub struct OperatorArgs {
    /// The operator's name, as the audit trail will record it: 1 to 64 characters of
    /// [A-Za-z0-9._-].
    #[arg(long)]
    pub name: String,
    /// Where to write the secret. Refused if the file exists.
    #[arg(long)]
    pub out: PathBuf,
}

#[derive(ClapArgs)]
pub struct GrantSigningArgs {
    /// The key's id: 1 to 64 characters of [A-Za-z0-9._-]; a rotation gives the new key a new id
    /// (for example the month it starts signing).
    #[arg(long)]
    pub key_id: String,
    /// Where to write the secret. Refused if the file exists.
    #[arg(long)]
    pub out: PathBuf,
}

#[derive(ClapArgs)]
pub struct GrantPublicKeyArgs {
    /// The id the key was made under.
    #[arg(long)]
    pub key_id: String,
    /// The secret, as `keys grant-signing` wrote it.
    #[arg(long)]
    pub key_file: PathBuf,
}

pub fn run(command: Command) -> anyhow::Result<std::process::ExitCode> {
    match command {
        Command::GrantSigning(args) => {
            let public = grant_signing(&args.key_id, &args.out)?;
            println!("{public}");
            eprintln!(
                "payoutctl: wrote grant signing key {:?} to {} (mode 0600; keep it secret).\n  \
                 lock-server: --grant-signing-key-id {} --grant-signing-key-file {}\n  \
                 payment-resource and rail-proxy: add the line above to --grant-verify-keys \
                 (GRANT_VERIFY_KEYS, comma-separated)",
                args.key_id,
                args.out.display(),
                args.key_id,
                args.out.display()
            );
        }
        Command::GrantPublicKey(args) => {
            println!("{}", grant_public_key(&args.key_id, &args.key_file)?);
        }
        Command::Operator(args) => {
            // Same key kind and file format as a grant signing key; the id is the operator.
            let public = grant_signing(&args.name, &args.out)?;
            println!("{public}");
            eprintln!(
                "payoutctl: wrote operator {:?}'s key to {} (mode 0600; it never leaves the \
                 operator).\n  payment-resource: add the line above to --operator-keys \
                 (PAYOUT_OPERATOR_KEYS, comma-separated)\n  sign a decision: payoutctl sign \
                 abandon --operator {} --key-file {} --payout-id ID --reason '...'",
                args.name,
                args.out.display(),
                args.name,
                args.out.display()
            );
        }
    }
    Ok(std::process::ExitCode::SUCCESS)
}

/// Makes a key under `key_id`, writes its secret to `out` (mode 0600; an existing file is
/// refused and left as it was) and returns the public key line.
pub fn grant_signing(key_id: &str, out: &Path) -> anyhow::Result<grant_signing::PublicKey> {
    // The id is checked before anything is written.
    let (signer, secret) = Signer::generate(key_id)?;
    write_secret(out, &secret)?;
    Ok(signer.public_key())
}

/// The public key line of the key in `key_file`, made under `key_id`.
pub fn grant_public_key(key_id: &str, key_file: &Path) -> anyhow::Result<grant_signing::PublicKey> {
    let text = std::fs::read_to_string(key_file)
        .with_context(|| format!("reading the grant signing key {}", key_file.display()))?;
    Ok(Signer::from_hex(key_id, &text)
        .with_context(|| format!("reading the grant signing key {}", key_file.display()))?
        .public_key())
}

/// Writes `text` to a new file readable by its owner only; an existing file is refused.
fn write_secret(path: &Path, text: &str) -> anyhow::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut file = match std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
    {
        Ok(file) => file,
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => anyhow::bail!(
            "{} exists: refusing to overwrite a key (remove it first if it is really unused)",
            path.display()
        ),
        Err(e) => {
            return Err(e).with_context(|| format!("creating {}", path.display()));
        }
    };
    let written = file
        .write_all(text.as_bytes())
        .and_then(|()| file.sync_all());
    if let Err(e) = written {
        // No half-written key is left behind.
        let _ = std::fs::remove_file(path);
        return Err(e).with_context(|| format!("writing {}", path.display()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use grant_signing::Verifier;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn a_key_is_written_owner_only_and_its_public_line_verifies_its_grants() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("grant.key");
        let public = grant_signing("2026-12", &out).unwrap();
        let mode = std::fs::metadata(&out).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        // The line the guards take verifies what the lock-server signs with the file.
        let line = public.to_string();
        assert!(line.starts_with("2026-12="), "{line}");
        let verifier = Verifier::parse(&line).unwrap();
        let text = std::fs::read_to_string(&out).unwrap();
        let signer = Signer::from_hex("2026-12", &text).unwrap();
        let signature = signer.sign("payout:a", 7, "worker-1");
        assert_eq!(
            verifier.verify("payout:a", 7, "worker-1", &signature),
            Ok(())
        );
        assert_eq!(grant_public_key("2026-12", &out).unwrap(), public);
    }

    #[test]
    fn an_existing_file_is_never_overwritten_and_a_bad_id_writes_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("grant.key");
        std::fs::write(&out, "precious").unwrap();
        let e = grant_signing("k1", &out).unwrap_err();
        assert!(e.to_string().contains("refusing to overwrite"), "{e:#}");
        assert_eq!(std::fs::read_to_string(&out).unwrap(), "precious");

        let fresh = dir.path().join("other.key");
        let e = grant_signing("bad id", &fresh).unwrap_err();
        assert!(e.to_string().contains("key id"), "{e:#}");
        assert!(!fresh.exists());

        let e = grant_public_key("k1", &out).unwrap_err();
        assert!(format!("{e:#}").contains("not an Ed25519 PKCS#8"), "{e:#}");
    }
}
