//! `payment-resource serve` runs the service; `payment-resource fixture` (test builds only,
//! feature `fixture-command`) loads accounts.

use std::net::SocketAddr;

use anyhow::Context;
use clap::{Parser, Subcommand};
use grant_signing::Verifier;
#[cfg(feature = "fixture-command")]
use payment_resource::fixture;
use payment_resource::{serve, Store, StoreOptions};
use service_kit::{Metrics, Shutdown};

#[derive(Parser)]
#[command(
    name = "payment-resource",
    about = "paydb's first guard, payout state machine, ledger and GL outbox"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

// Parsed once at start; the size of the serve variant costs nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand)]
enum Command {
    /// Serve payment.v1.PaymentResource, grpc.health.v1 and /metrics.
    Serve {
        #[arg(
            long,
            env = "PAYMENT_RESOURCE_LISTEN",
            default_value = "127.0.0.1:50052"
        )]
        listen: SocketAddr,
        #[arg(
            long,
            env = "PAYMENT_RESOURCE_METRICS_LISTEN",
            default_value = "127.0.0.1:9102"
        )]
        metrics_listen: SocketAddr,
        #[arg(long, env = "PAYDB_URL")]
        database_url: String,
        /// Finance's resolution SLA: an ambiguous payout may be abandoned by an operator only
        /// this long after it became RAIL_AMBIGUOUS (by paydb's own record and clock).
        #[arg(long, env = "PAYOUT_RESOLUTION_SLA_MS", default_value_t = payment_resource::RESOLUTION_SLA_DEFAULT.as_millis() as u64)]
        resolution_sla_ms: u64,
        /// The lock service's grant public keys, `key_id=<64 hex digits>[,...]` (several during a
        /// rotation). Required: every fenced call's grant must carry the signature of one of them
        /// (else `forged_grant`); there is no unsigned mode.
        #[arg(long, env = "GRANT_VERIFY_KEYS", value_name = "ID=HEX,...", value_parser = parse_verify_keys)]
        grant_verify_keys: Verifier,
        /// The registered operators' public keys, `name=<64 hex digits>[,...]` (`payoutctl keys
        /// operator`). An abandon is carried out only under one of their signatures; without any,
        /// every operator decision is refused and recorded as refused.
        #[arg(long, env = "PAYOUT_OPERATOR_KEYS", value_name = "NAME=HEX,...", default_value = "", value_parser = parse_operator_keys)]
        operator_keys: Verifier,
        /// The id of this service's instruction signing key (`payoutctl keys
        /// instruction-signing`). Required: MarkSubmitted answers the signed instruction the rail
        /// proxy requires to send a payout; there is no unsigned mode.
        #[arg(long, env = "PAYOUT_INSTRUCTION_SIGNING_KEY_ID")]
        instruction_signing_key_id: String,
        /// The instruction signing key's file (its PKCS#8 document in hex, readable by this
        /// service only).
        #[arg(long, env = "PAYOUT_INSTRUCTION_SIGNING_KEY_FILE")]
        instruction_signing_key_file: std::path::PathBuf,
        /// How long a signed instruction is honoured by the rail proxy, at most
        /// `grant_signing::instruction::TTL_MAX_MS` (one hour).
        #[arg(long, env = "PAYOUT_INSTRUCTION_TTL_MS", default_value_t = grant_signing::instruction::TTL_DEFAULT_MS)]
        instruction_ttl_ms: u64,
        /// The rail proxy's rail-fact public keys, `key_id=<64 hex digits>[,...]`. Required: an
        /// ACKED / DECLINED outcome or an evidence is recorded only on the proxy's signed fact.
        #[arg(long, env = "RAIL_FACT_VERIFY_KEYS", value_name = "ID=HEX,...", value_parser = parse_verify_keys)]
        rail_fact_verify_keys: Verifier,
        #[command(flatten)]
        tls: service_kit::grpc::ServerTlsArgs,
        /// Serve OpenAccount (funded accounts from nothing) to the fixture role. Off by default;
        /// the local stack and the tests turn it on, a deployment does not.
        #[arg(long, env = "PAYOUT_FIXTURE_ACCOUNTS")]
        fixture_accounts: bool,
    },
    /// Open accounts with opening balances (idempotent), through the same code as OpenAccount.
    /// Test builds only (feature `fixture-command`): the shipped binary has no way to mint.
    #[cfg(feature = "fixture-command")]
    Fixture {
        #[arg(long, env = "PAYDB_URL")]
        database_url: String,
        /// A JSON file: [{"account_id":"acct-1","currency":"EUR","opening_balance_minor":100000}].
        #[arg(long, conflicts_with_all = ["accounts"])]
        file: Option<std::path::PathBuf>,
        /// How many numbered accounts ({prefix}1..{prefix}N) to open.
        #[arg(long)]
        accounts: Option<usize>,
        #[arg(long, default_value = "acct-")]
        prefix: String,
        #[arg(long, default_value_t = 1_000_000)]
        balance_minor: i64,
        #[arg(long, default_value = "EUR")]
        currency: String,
    },
}

/// `--operator-keys`: empty registers nobody; a malformed entry stops the start.
fn parse_operator_keys(spec: &str) -> Result<Verifier, String> {
    Verifier::parse_operators(spec).map_err(|e| e.to_string())
}

/// `--grant-verify-keys`: a malformed or empty list stops the start with the key's own error.
fn parse_verify_keys(spec: &str) -> Result<Verifier, String> {
    Verifier::parse(spec).map_err(|e| e.to_string())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    service_kit::init_tracing("payment-resource");
    match Cli::parse().command {
        Command::Serve {
            listen,
            metrics_listen,
            database_url,
            resolution_sla_ms,
            grant_verify_keys,
            operator_keys,
            instruction_signing_key_id,
            instruction_signing_key_file,
            instruction_ttl_ms,
            rail_fact_verify_keys,
            tls,
            fixture_accounts,
        } => {
            let tls = tls.load().context("TLS material")?;
            let facts = payment_resource::SignedFacts::load(
                &instruction_signing_key_id,
                &instruction_signing_key_file,
                instruction_ttl_ms,
                rail_fact_verify_keys,
            )
            .context("signed facts' keys")?;
            let pool = service_kit::connect_pg(&database_url).await?;
            payment_resource::require_schema(&pool).await?;
            let metrics = Metrics::default();
            // The binary has no way to disable a check (the fence predicate, the grant's signature
            // or its key binding): the switches are test-only and unreachable from here.
            let key_ids: Vec<String> = grant_verify_keys.key_ids().map(str::to_string).collect();
            let operators: Vec<String> = operator_keys.key_ids().map(str::to_string).collect();
            tracing::info!(?operators, "registered operators");
            tracing::info!(instruction_signing_key_id, instruction_ttl_ms, rail_fact_verify_key_ids = ?facts.rail_fact_key_ids(), "signed facts");
            let options = StoreOptions::new(grant_verify_keys, facts)
                .with_operator_keys(operator_keys)
                .with_resolution_sla(std::time::Duration::from_millis(resolution_sla_ms));
            let store = Store::new(pool, options, &metrics);
            let shutdown = Shutdown::on_signal();
            let listener = service_kit::bind(listen).await?;
            let metrics_listener = service_kit::bind(metrics_listen).await?;
            tracing::info!(%listen, %metrics_listen, grant_verify_key_ids = ?key_ids, "payment-resource serving");
            let front = payment_resource::Front::new(tls, metrics.clone())
                .with_fixture_accounts(fixture_accounts);
            let metrics_task = tokio::spawn(service_kit::serve_metrics(
                metrics_listener,
                metrics,
                shutdown.clone().wait(),
            ));
            serve(listener, store, front, shutdown)
                .await
                .context("gRPC server")?;
            metrics_task.await.context("metrics task")??;
            tracing::info!("payment-resource stopped");
        }
        #[cfg(feature = "fixture-command")]
        Command::Fixture {
            database_url,
            file,
            accounts,
            prefix,
            balance_minor,
            currency,
        } => {
            let pool = service_kit::connect_pg(&database_url).await?;
            payment_resource::require_schema(&pool).await?;
            let wanted = match (file, accounts) {
                (Some(path), _) => {
                    let text = std::fs::read_to_string(&path)
                        .with_context(|| format!("reading {}", path.display()))?;
                    serde_json::from_str(&text)
                        .with_context(|| format!("parsing {}", path.display()))?
                }
                (None, Some(n)) => fixture::numbered(&prefix, n, balance_minor, &currency),
                (None, None) => anyhow::bail!("give --accounts N or --file accounts.json"),
            };
            // Accounts only: this store takes no fenced call, and would refuse every one.
            let store = Store::new(
                pool,
                StoreOptions::without_grant_keys(),
                &Metrics::default(),
            );
            let opened = fixture::load(&store, &wanted)
                .await
                .context("opening fixture accounts")?;
            for a in &opened {
                println!("{} {} {}", a.account_id, a.currency, a.balance_minor);
            }
            tracing::info!(count = opened.len(), "fixture accounts opened");
        }
    }
    Ok(())
}
