//! `lock-server`: the lock service process.

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Context;
use clap::{Parser, ValueEnum};

#[derive(Debug, Clone, Copy, ValueEnum)]
enum BackendKind {
    Etcd,
    Postgres,
}

#[derive(Debug, Parser)]
#[command(about = "Lock service: sessions and grants with fencing tokens")]
struct Args {
    #[arg(long, env = "LOCK_LISTEN", default_value = "127.0.0.1:7100")]
    listen: SocketAddr,
    #[arg(long, env = "LOCK_METRICS_LISTEN", default_value = "127.0.0.1:9100")]
    metrics_listen: SocketAddr,
    #[arg(long, env = "LOCK_BACKEND", value_enum, default_value = "etcd")]
    backend: BackendKind,
    /// Comma-separated etcd client URLs (`https://`: etcd is reached over mutual TLS only).
    #[arg(
        long,
        env = "LOCK_ETCD_ENDPOINTS",
        value_delimiter = ',',
        default_value = "https://127.0.0.1:2379"
    )]
    etcd_endpoints: Vec<String>,
    /// etcd's authority and this server's certificate from it, for `--backend etcd`.
    #[command(flatten)]
    etcd_tls: mtls::EtcdTlsArgs,
    #[arg(long, env = "LOCK_ETCD_PREFIX", default_value = "/payout/lock/")]
    etcd_prefix: String,
    /// How long etcd keeps each grant record (the reconciler's INV-07 evidence) before deleting it
    /// with its retention lease. The reconciler's horizon must stay inside it.
    #[arg(long, env = "LOCK_GRANT_RETENTION_MS", default_value_t = lock_server::backend::etcd::GRANT_RETENTION_MS_DEFAULT)]
    grant_retention_ms: u64,
    /// lockdb URL, for `--backend postgres`.
    #[arg(long, env = "LOCK_DATABASE_URL")]
    database_url: Option<String>,
    /// The INV-04 record of the highest token issued per key. Must survive restarts of this
    /// process and must NOT live in the backend it checks.
    #[arg(
        long,
        env = "LOCK_ISSUED_TOKENS_PATH",
        default_value = "lock-server-issued-tokens.json"
    )]
    issued_tokens_path: PathBuf,
    /// How long the INV-04 record keeps a key after its token was last raised; older keys are
    /// pruned into one floor that every new key's token must exceed. Default: the grant records'
    /// retention.
    #[arg(long, env = "LOCK_ISSUED_TOKENS_RETENTION_MS", default_value_t = lock_server::issued::RETENTION_MS_DEFAULT)]
    issued_tokens_retention_ms: u64,
    /// The grant signing key's id (the guards know its public half under this id).
    #[arg(long, env = "LOCK_GRANT_SIGNING_KEY_ID")]
    grant_signing_key_id: String,
    /// A file holding the grant signing key (its PKCS#8 document in hex, as `payoutctl keys
    /// grant-signing` writes it). Required: the server signs every grant, there is no unsigned mode.
    #[arg(long, env = "LOCK_GRANT_SIGNING_KEY_FILE")]
    grant_signing_key_file: PathBuf,
    #[command(flatten)]
    tls: service_kit::grpc::ServerTlsArgs,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    service_kit::init_tracing("lock-server");
    let args = Args::parse();
    let tls = args.tls.load().context("TLS material")?;
    let backend = match args.backend {
        BackendKind::Etcd => lock_server::BackendConfig::Etcd {
            endpoints: args.etcd_endpoints,
            tls: args.etcd_tls.load().context("etcd TLS material")?,
            prefix: args.etcd_prefix,
            grant_retention_ms: args.grant_retention_ms,
        },
        BackendKind::Postgres => lock_server::BackendConfig::Postgres {
            database_url: args
                .database_url
                .context("--database-url is required with --backend postgres")?,
        },
    };
    let secret = std::fs::read_to_string(&args.grant_signing_key_file).with_context(|| {
        format!(
            "reading the grant signing key {}",
            args.grant_signing_key_file.display()
        )
    })?;
    let signer = grant_signing::Signer::from_hex(&args.grant_signing_key_id, &secret)?;
    tracing::info!(public_key = %signer.public_key(), "grants are signed");
    let config = lock_server::Config {
        backend,
        issued_tokens_path: args.issued_tokens_path,
        issued_tokens_limits: lock_server::issued::Limits {
            retention_ms: args.issued_tokens_retention_ms,
            ..Default::default()
        },
        caller_limits: lock_server::callers::CallerLimits::SHIPPED,
        signer: std::sync::Arc::new(signer),
    };
    let metrics = service_kit::Metrics::default();
    let service = lock_server::build(&config, &metrics)
        .await
        .context("starting the lock service")?;
    let shutdown = service_kit::Shutdown::on_signal();
    let metrics_listener = service_kit::bind(args.metrics_listen).await?;
    let metrics_shutdown = shutdown.clone();
    tokio::spawn(service_kit::serve_metrics(
        metrics_listener,
        metrics.clone(),
        metrics_shutdown.wait(),
    ));
    let listener = service_kit::bind(args.listen).await?;
    tracing::info!(listen = %args.listen, backend = service.backend().name(), "lock-server serving");
    lock_server::serve(
        service,
        listener,
        &tls,
        &lock_server::authz::POLICY,
        &metrics,
        shutdown,
    )
    .await
    .context("serving")?;
    tracing::info!("lock-server stopped");
    Ok(())
}
