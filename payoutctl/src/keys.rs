//! `payoutctl keys`: the keys an operator makes for a deployment.
//!
//! `keys grant-signing --key-id ID --out FILE` makes the lock service's grant signing key
//! (Ed25519, `crates/grant-signing`): the secret goes to FILE (its PKCS#8 document in hex, mode
//! 0600, never over an existing file) and the public key line the guards take
//! (`--grant-verify-keys` / `GRANT_VERIFY_KEYS`, `id=hex`) goes to standard output, alone, so a
//! script can capture it. The lock-server takes the secret with `--grant-signing-key-id ID
//! --grant-signing-key-file FILE`.
//!
//! `keys instruction-signing` makes the payment resource's instruction signing key (its public
//! line goes to the rail proxy's `--instruction-verify-keys`); `keys rail-fact-signing` makes the
//! rail proxy's rail-fact signing key (its public line goes to the payment resource's
//! `--rail-fact-verify-keys`). Same key kind, file format and 0600 rule as the grant's; each
//! service is given only its own secret.
//!
//! `keys public-key --key-id ID --key-file FILE` prints the public key line of any key made
//! earlier (a rotation adds it to the verifiers' list before the signer switches to it);
//! `keys grant-public-key` is the same command under its older name.
//!
//! `keys ui-user --name NAME --password-out FILE` makes a login for the Temporal UI behind the
//! front: a random password to FILE (mode 0600, never over an existing file) and the `htpasswd`
//! line (`NAME:{SSHA}...`) the front's `auth_basic_user_file` takes to standard output.

use std::path::{Path, PathBuf};

use anyhow::Context;
use clap::{Args as ClapArgs, Subcommand};
use grant_signing::Signer;

#[derive(Subcommand)]
pub enum Command {
    /// Make the lock service's grant signing key: the secret to --out (mode 0600, never
    /// overwritten), the guards' public key line (`id=hex`) to standard output.
    GrantSigning(GrantSigningArgs),
    /// Make the payment resource's instruction signing key: the secret to --out (mode 0600,
    /// never overwritten), the rail proxy's public key line (`id=hex`, for
    /// --instruction-verify-keys / INSTRUCTION_VERIFY_KEYS) to standard output.
    InstructionSigning(GrantSigningArgs),
    /// Make the rail proxy's rail-fact signing key: the secret to --out (mode 0600, never
    /// overwritten), the payment resource's public key line (`id=hex`, for
    /// --rail-fact-verify-keys / RAIL_FACT_VERIFY_KEYS) to standard output.
    RailFactSigning(GrantSigningArgs),
    /// Print the public key line (`id=hex`) of an existing signing key of any kind (grant,
    /// instruction, rail fact, operator).
    #[command(alias = "grant-public-key")]
    PublicKey(GrantPublicKeyArgs),
    /// Make an operator's own key: the secret to --out (mode 0600, never overwritten; it stays
    /// with the operator), the registration line (`name=hex`, for the payment resource's
    /// --operator-keys / PAYOUT_OPERATOR_KEYS) to standard output.
    Operator(OperatorArgs),
    /// Make a login for the Temporal UI: a random password to --password-out (mode 0600, never
    /// overwritten), the front's htpasswd line (`name:{SSHA}...`) to standard output.
    UiUser(UiUserArgs),
}

#[derive(ClapArgs)]
pub struct UiUserArgs {
    /// The user's name: 1 to 64 characters of [A-Za-z0-9._-].
    #[arg(long)]
    pub name: String,
    /// Where to write the password. Refused if the file exists.
    #[arg(long)]
    pub password_out: PathBuf,
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
        Command::GrantSigning(args) => make_signing_key(&SIGNED_BY[0], &args)?,
        Command::InstructionSigning(args) => make_signing_key(&SIGNED_BY[1], &args)?,
        Command::RailFactSigning(args) => make_signing_key(&SIGNED_BY[2], &args)?,
        Command::PublicKey(args) => {
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
        Command::UiUser(args) => {
            println!("{}", ui_user(&args.name, &args.password_out)?);
            eprintln!(
                "payoutctl: wrote UI user {:?}'s password to {} (mode 0600).\n  the front: \
                 append the line above to its htpasswd file (PAYOUT_TEMPORAL_UI_HTPASSWD in \
                 compose)",
                args.name,
                args.password_out.display()
            );
        }
    }
    Ok(std::process::ExitCode::SUCCESS)
}

/// A service's signing key: what it signs, the signer's flag prefix, who verifies and with
/// which flag (and its environment variable).
struct SignedBy {
    what: &'static str,
    signer: &'static str,
    flag: &'static str,
    verifiers: &'static str,
    verify_flag: &'static str,
    verify_env: &'static str,
}

const SIGNED_BY: [SignedBy; 3] = [
    SignedBy {
        what: "grant",
        signer: "lock-server",
        flag: "grant",
        verifiers: "payment-resource and rail-proxy",
        verify_flag: "--grant-verify-keys",
        verify_env: "GRANT_VERIFY_KEYS",
    },
    SignedBy {
        what: "instruction",
        signer: "payment-resource",
        flag: "instruction",
        verifiers: "rail-proxy",
        verify_flag: "--instruction-verify-keys",
        verify_env: "INSTRUCTION_VERIFY_KEYS",
    },
    SignedBy {
        what: "rail-fact",
        signer: "rail-proxy",
        flag: "rail-fact",
        verifiers: "payment-resource",
        verify_flag: "--rail-fact-verify-keys",
        verify_env: "RAIL_FACT_VERIFY_KEYS",
    },
];

/// Makes the key, prints its public line alone on standard output and how to use both halves
/// on standard error.
fn make_signing_key(kind: &SignedBy, args: &GrantSigningArgs) -> anyhow::Result<()> {
    let public = grant_signing(&args.key_id, &args.out)?;
    println!("{public}");
    let (id, out, flag) = (&args.key_id, args.out.display(), kind.flag);
    eprintln!(
        "payoutctl: wrote {} signing key {id:?} to {out} (mode 0600; keep it secret).\n  \
         {}: --{flag}-signing-key-id {id} --{flag}-signing-key-file {out}\n  \
         {}: add the line above to {} ({}, comma-separated)",
        kind.what, kind.signer, kind.verifiers, kind.verify_flag, kind.verify_env
    );
    Ok(())
}

/// Makes UI user `name`, writes the password to `password_out` (mode 0600; an existing file is
/// refused and left as it was) and returns the htpasswd line.
pub fn ui_user(name: &str, password_out: &Path) -> anyhow::Result<String> {
    // The name is checked before anything is written.
    let user = mtls::htpasswd::ui_user(name)?;
    write_secret(password_out, &user.password)?;
    Ok(user.line)
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
        .with_context(|| format!("reading the signing key {}", key_file.display()))?;
    Ok(Signer::from_hex(key_id, &text)
        .with_context(|| format!("reading the signing key {}", key_file.display()))?
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

    #[derive(clap::Parser)]
    struct Keys {
        #[command(subcommand)]
        command: Command,
    }

    #[test]
    fn instruction_and_rail_fact_keys_are_made_like_grant_keys_and_public_key_reads_any() {
        use clap::Parser;
        use grant_signing::instruction::{Instruction, Presented};
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("instruction.key");
        let made = Keys::try_parse_from([
            "keys",
            "instruction-signing",
            "--key-id",
            "pr-1",
            "--out",
            out.to_str().unwrap(),
        ])
        .unwrap();
        run(made.command).unwrap();
        let mode = std::fs::metadata(&out).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        // The line `public-key` prints (under both names) verifies what the file signs.
        for name in ["public-key", "grant-public-key"] {
            let parsed = Keys::try_parse_from([
                "keys",
                name,
                "--key-id",
                "pr-1",
                "--key-file",
                out.to_str().unwrap(),
            ])
            .unwrap();
            assert!(matches!(parsed.command, Command::PublicKey(_)), "{name}");
        }
        let verifier =
            Verifier::parse(&grant_public_key("pr-1", &out).unwrap().to_string()).unwrap();
        let signer = Signer::from_hex("pr-1", &std::fs::read_to_string(&out).unwrap()).unwrap();
        let i = Instruction {
            payout_id: "p".into(),
            account_id: "a".into(),
            currency: "EUR".into(),
            beneficiary_ref: "b".into(),
            client_reference: "c".into(),
            lock_key: "payout:a".into(),
            amount_minor: 1,
            token: 1,
            issued_at_unix_ms: 0,
            expires_at_unix_ms: 1,
        };
        let presented = Presented {
            payout_id: "p",
            account_id: "a",
            amount_minor: 1,
            currency: "EUR",
            beneficiary_ref: "b",
            client_reference: "c",
            lock_key: "payout:a",
            token: 1,
        };
        assert_eq!(
            verifier.verify_instruction(&signer.sign_instruction(i), &presented, 0),
            Ok(())
        );
        // rail-fact-signing writes its own file by the same rules (an existing one is refused).
        let facts = dir.path().join("rail-fact.key");
        for expect_ok in [true, false] {
            let made = Keys::try_parse_from([
                "keys",
                "rail-fact-signing",
                "--key-id",
                "proxy-1",
                "--out",
                facts.to_str().unwrap(),
            ])
            .unwrap();
            assert_eq!(run(made.command).is_ok(), expect_ok);
        }
    }

    #[test]
    fn a_ui_user_gets_an_owner_only_password_file_and_a_line_for_that_password() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("ui.password");
        let line = ui_user("alice", &out).unwrap();
        let mode = std::fs::metadata(&out).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let password = std::fs::read_to_string(&out).unwrap();
        assert_eq!(password.len(), mtls::htpasswd::PASSWORD_LEN);
        let (name, stored) = line.split_once(':').unwrap();
        assert_eq!(name, "alice");
        assert!(stored.starts_with("{SSHA}"), "{line}");
        let e = ui_user("alice", &out).unwrap_err();
        assert!(e.to_string().contains("refusing to overwrite"), "{e:#}");
        assert_eq!(std::fs::read_to_string(&out).unwrap(), password);
        let fresh = dir.path().join("bad.password");
        assert!(ui_user("a:b", &fresh).is_err());
        assert!(!fresh.exists());
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
