//! `payoutctl lock describe|revoke`: who holds a lock key (an account's key is
//! `payout:<account id>`), and the operator's break-glass that takes it from its holder.
//!
//! The revoke is the lock service's ForceRevoke: the service records it under the operator name
//! the caller's certificate proves (an operator's certificate carries `<name>.operator`; another
//! name is refused, nothing revoked), logs it at alert level and counts it. The next grant of the
//! key has a higher token, so the deposed holder is fenced out at both guards. It takes only the
//! grant the operator looked at: `--expected-token` (by default the token `lock describe` shows
//! at the moment of the revoke, printed) is compared by the lock service in the backend's
//! transaction, and a key another grant holds by then is refused, nothing revoked.

use clap::{Args as ClapArgs, Subcommand};
use serde::Serialize;

use crate::ops::{exit, Deployment, READER_NAME};

#[derive(Subcommand)]
pub enum Command {
    /// Who holds KEY: holder, token, the holder's session state (ACTIVE, SUSPECT), its lease
    /// expiry and the waiters. Introspection only: by the time it prints, it may have changed.
    Describe(DescribeArgs),
    /// Take KEY from its holder (the lock service's ForceRevoke), audited under the operator's
    /// certified name, only if the grant of the expected token still holds it. Exit status 1
    /// when nobody holds it, another grant holds it, or the certificate does not carry the
    /// operator's name (nothing revoked).
    Revoke(RevokeArgs),
}

#[derive(ClapArgs)]
pub struct DescribeArgs {
    /// The lock key (an account's: `payout:<account id>`).
    pub key: String,
    /// One JSON object instead of a table.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub deployment: Deployment,
}

#[derive(ClapArgs)]
pub struct RevokeArgs {
    /// The lock key (an account's: `payout:<account id>`).
    pub key: String,
    /// Why (the incident or ticket): recorded with the revoke.
    #[arg(long)]
    pub reason: String,
    /// Who revokes: the operator's name, as the certificate carries it (`<name>.operator`; the
    /// local stack issues one for this name).
    #[arg(long)]
    pub operator: String,
    /// The token of the grant to revoke, as `lock describe` showed it: a later holder is refused
    /// (nothing revoked). Default: the token the key's holder has when this command reads it
    /// (printed on stderr), for a revoke without a look first.
    #[arg(long, value_parser = parse_token)]
    pub expected_token: Option<lock_client::FencingToken>,
    /// One JSON object instead of a line.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub deployment: Deployment,
}

fn parse_token(value: &str) -> Result<lock_client::FencingToken, String> {
    let token: u64 = value
        .parse()
        .map_err(|e| format!("{value:?} is not a token: {e}"))?;
    lock_client::FencingToken::new(token).map_err(|e| e.to_string())
}

/// `lock describe`'s answer.
#[derive(Debug, Clone, Serialize)]
pub struct Described {
    pub key: String,
    pub held: bool,
    pub holder: Option<String>,
    pub token: Option<u64>,
    /// ACTIVE or SUSPECT (spec 2.4), when held.
    pub session_state: Option<String>,
    /// The backend's expiry of the holder's session (RFC 3339, UTC), when held.
    pub lease_expires_at: Option<String>,
    /// Acquire calls waiting on the key at the answering lock-server process.
    pub waiters: u64,
}

/// `lock revoke`'s answer.
#[derive(Debug, Clone, Serialize)]
pub struct Revoked {
    pub key: String,
    pub revoked_owner: String,
    pub revoked_token: u64,
    /// The token the revoke expected (`--expected-token`, or the one read just before).
    pub expected_token: u64,
    pub operator: String,
    pub reason: String,
}

async fn client(
    deployment: &Deployment,
    operator: &str,
) -> anyhow::Result<lock_client::LockClient> {
    let parts = deployment.parts()?;
    let url = parts.lock_url()?;
    let tls = parts.operator_tls(operator)?;
    lock_client::LockClient::connect(&url, &tls)
        .await
        .map_err(|e| exit::unreachable(format!("the lock service at {url}"), e))
}

/// A lock service error: no answer is "could not connect", anything else is a refusal.
fn lock_error(url_what: &str, e: lock_client::ClientError) -> anyhow::Error {
    match e {
        lock_client::ClientError::Connect(_) | lock_client::ClientError::Timeout(_) => {
            exit::unreachable(url_what, e)
        }
        lock_client::ClientError::Status(ref status)
            if status.code() == tonic::Code::Unavailable =>
        {
            exit::unreachable(url_what, e)
        }
        other => anyhow::Error::new(other),
    }
}

pub async fn run(command: Command) -> anyhow::Result<std::process::ExitCode> {
    match command {
        Command::Describe(args) => describe(args).await,
        Command::Revoke(args) => revoke(args).await,
    }
}

fn check_key(key: &str) -> anyhow::Result<()> {
    anyhow::ensure!(!key.trim().is_empty(), "the lock key is empty");
    Ok(())
}

async fn describe(args: DescribeArgs) -> anyhow::Result<std::process::ExitCode> {
    check_key(&args.key)?;
    let lock = client(&args.deployment, READER_NAME).await?;
    let d = lock
        .describe(&args.key)
        .await
        .map_err(|e| lock_error("the lock service", e))?;
    let described = Described {
        key: d.key.clone(),
        held: d.held,
        holder: d.held.then(|| d.holder_owner.clone()),
        token: d.held.then_some(d.token),
        session_state: (d.held && !d.holder_session_state.is_empty())
            .then(|| d.holder_session_state.clone()),
        lease_expires_at: (d.held && d.server_expiry_unix_ms > 0)
            .then(|| {
                chrono::DateTime::<chrono::Utc>::from_timestamp_millis(d.server_expiry_unix_ms)
                    .map(|t| t.format("%Y-%m-%dT%H:%M:%S%.3fZ").to_string())
            })
            .flatten(),
        waiters: d.waiter_count,
    };
    if args.json {
        println!("{}", serde_json::to_string(&described)?);
    } else {
        print!("{}", render_described(&described));
    }
    Ok(std::process::ExitCode::SUCCESS)
}

pub fn render_described(d: &Described) -> String {
    if !d.held {
        return format!("{}: free (nobody holds it; {} waiting)\n", d.key, d.waiters);
    }
    crate::ops::table(
        &[
            "KEY",
            "HOLDER",
            "TOKEN",
            "SESSION",
            "LEASE_EXPIRES",
            "WAITERS",
        ],
        &[vec![
            d.key.clone(),
            crate::ops::cell(&d.holder),
            crate::ops::cell(&d.token),
            crate::ops::cell(&d.session_state),
            crate::ops::cell(&d.lease_expires_at),
            d.waiters.to_string(),
        ]],
    )
}

async fn revoke(args: RevokeArgs) -> anyhow::Result<std::process::ExitCode> {
    check_key(&args.key)?;
    let reason = args.reason.trim();
    anyhow::ensure!(!reason.is_empty(), "--reason must say why");
    let operator = args.operator.trim();
    anyhow::ensure!(
        mtls::is_operator_name(operator),
        "--operator {operator:?}: an operator's name is one DNS label (letters, digits and '-', at most 63)"
    );
    let lock = client(&args.deployment, operator).await?;
    let expected = match args.expected_token {
        Some(token) => token,
        None => {
            let d = lock
                .describe(&args.key)
                .await
                .map_err(|e| lock_error("the lock service", e))?;
            if !d.held {
                return refused(
                    &args,
                    format!("nobody holds {}: nothing was revoked", args.key),
                );
            }
            let token = lock_client::FencingToken::new(d.token).map_err(|e| {
                anyhow::anyhow!(
                    "the lock service described {} with token {}: {e}",
                    args.key,
                    d.token
                )
            })?;
            eprintln!(
                "payoutctl: {} is held by {} (token {}): revoking that grant only \
                 (--expected-token {} to name it yourself)",
                args.key,
                d.holder_owner,
                token.get(),
                token.get()
            );
            token
        }
    };
    let answer = lock
        .force_revoke(&args.key, expected, operator, reason)
        .await;
    let revoked = match answer {
        Ok(r) => Revoked {
            key: r.key,
            revoked_owner: r.revoked_owner,
            revoked_token: r.revoked_token,
            expected_token: expected.get(),
            operator: operator.to_string(),
            reason: reason.to_string(),
        },
        Err(e) => {
            let refusal = match e.rejection() {
                Some(lock_client::Rejection::NotHeld(_)) => {
                    Some(format!("nobody holds {}: nothing was revoked", args.key))
                }
                Some(lock_client::Rejection::HolderChanged(h)) => Some(format!(
                    "{} is no longer held by the grant of token {} but by token {}: nothing \
                     was revoked (`payoutctl lock describe {}` shows the holder now)",
                    args.key, h.expected_token, h.current_token, args.key
                )),
                Some(lock_client::Rejection::OperatorNotCertified(_)) => Some(format!(
                    "the lock service refused: this certificate does not carry the operator \
                     {operator:?} ({operator}.operator): nothing was revoked"
                )),
                Some(lock_client::Rejection::InvalidArgument(i)) => Some(format!(
                    "the lock service refused {}: {}: nothing was revoked",
                    i.field, i.problem
                )),
                _ => None,
            };
            let Some(refusal) = refusal else {
                return Err(
                    lock_error("the lock service", e).context(format!("revoking {}", args.key))
                );
            };
            return refused(&args, refusal);
        }
    };
    if args.json {
        println!("{}", serde_json::to_string(&revoked)?);
    } else {
        println!(
            "revoked {} from {} (token {}, as expected) as {}: {:?}. The next grant's token is \
             higher: the deposed holder is fenced out at both guards.",
            revoked.key,
            revoked.revoked_owner,
            revoked.revoked_token,
            revoked.operator,
            revoked.reason
        );
    }
    Ok(std::process::ExitCode::SUCCESS)
}

/// A revoke refused, nothing revoked: said on stderr (and as JSON when asked), exit status 1.
fn refused(args: &RevokeArgs, refusal: String) -> anyhow::Result<std::process::ExitCode> {
    if args.json {
        println!(
            "{}",
            serde_json::json!({"key": args.key, "revoked": false, "refused": refusal})
        );
    }
    eprintln!("payoutctl: {refusal}");
    Ok(std::process::ExitCode::from(exit::PROBLEM))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_flag_has_help() {
        crate::ops::cli_test::assert_every_flag_has_help::<Command>();
    }

    #[test]
    fn a_free_key_says_so_and_a_held_one_is_a_table() {
        let mut d = Described {
            key: "payout:a-1".into(),
            held: false,
            holder: None,
            token: None,
            session_state: None,
            lease_expires_at: None,
            waiters: 0,
        };
        assert_eq!(
            render_described(&d),
            "payout:a-1: free (nobody holds it; 0 waiting)\n"
        );
        d.held = true;
        d.holder = Some("worker-0".into());
        d.token = Some(42);
        d.session_state = Some("ACTIVE".into());
        let text = render_described(&d);
        assert!(
            text.starts_with("KEY") && text.contains("worker-0") && text.contains("42"),
            "{text}"
        );
    }
}
