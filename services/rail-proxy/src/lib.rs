//! The rail proxy: the second, independent guard in front of the rail (spec 2.2, 2.3, 2.5, 2.6).
//!
//! Architecture invariant: the proxy knows nothing of etcd, paydb or Temporal. The only thing it
//! shares with the rest of the system is the fencing token, which it validates against its own
//! per-account high-water in its own database (proxydb), together with a unique submission per
//! payout, **before** the rail is contacted. It then calls the rail exactly once and records the
//! outcome exactly once; nothing, under any token or after any delay, calls the rail again for
//! that payout.
//!
//! The token must come with the lock service's signature over (key, token, owner), checked with
//! the lock service's public keys alone ([`ProxyConfig::new`] takes them: there is no unsigned
//! mode), and the signed key must be the account's (`payout:{account_id}`). Otherwise Submit and
//! Inquire are refused (`forged_grant`, `grant_for_another_key`) before the high-water
//! statement, and only the refusal's guard event is written.
//!
//! gRPC (`railproxy.v1.RailProxy`): `Submit`, `Lookup`, `Inquire`, `RailMovements`. The contract
//! (the typed client, the types that cross the wire and their conversions) is the crate
//! `rail-proxy-client`; this server uses its definitions and does not re-export them, and callers
//! (including those that start this server in-process) reach them through that crate alone.
//!
//! Test machinery (the switches that turn a protection off, the failpoints) exists only with the
//! cargo feature `negative-controls`, which only test crates enable; no shipped binary is built
//! with it.

pub mod authz;
pub mod model;
pub mod rail;
mod service;
pub mod store;
mod timed;

use std::sync::Arc;
use std::time::Duration;

use payout_proto::railproxy::rail_proxy_server::RailProxyServer;
use service_kit::Shutdown;

/// The lock service's public keys, as the proxy is given them (`--grant-verify-keys`).
pub use grant_signing::{KeyError, Signer, Verifier};
pub use model::DuplicateClass;
pub use rail::{
    RailLink, RailLinkArgs, RailLinkError, RAIL_CALL_TIMEOUT_MS_DEFAULT, RAIL_CALL_TIMEOUT_MS_MAX,
};
pub use store::MIGRATOR;

/// The gRPC service name, also the name its health status is reported under.
pub const SERVICE_NAME: &str = "railproxy.v1.RailProxy";

/// Whether the guard runs. Only [`ProxyConfig::disable_guards_for_negative_control`] turns it
/// off; it exists only with the `negative-controls` feature, which no shipped binary has.
#[cfg(feature = "negative-controls")]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Guards {
    Enforced,
    DisabledForNegativeControl,
}

/// TEST ONLY (feature `negative-controls`): crash and stall points.
#[cfg(feature = "negative-controls")]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failpoint {
    /// `std::process::abort()` right after the intent commits, before the rail is called: the
    /// "proxy died between intent and answer" case, which must leave a NULL outcome.
    AbortAfterIntent,
    /// Stall this long right after the intent commits, before the rail is called: the "proxy
    /// paused between intent and send" case, which the instruction's expiry must make harmless.
    PauseAfterIntent { ms: u64 },
}

/// The protections a test may switch off, each only through a setter that exists only with the
/// `negative-controls` feature, to show what it prevents. Without the feature all are on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Protections {
    /// A fenced inquiry that finds no submission seals the payout (NOT_SENT).
    pub seal: bool,
    /// Every payment instruction carries `valid_until`, and ABSENT waits for it to pass.
    pub expiry: bool,
    /// Every fenced call's grant must carry the lock service's signature (`forged_grant`).
    pub grant_signature: bool,
    /// Every fenced call's signed key must be its account's (`grant_for_another_key`).
    pub grant_key_binding: bool,
    /// No high-water advance passes a database that does not admit the token: a copy restored
    /// from a backup and not re-armed, or a token below the re-arming's horizon (migration 0006).
    pub restore_check: bool,
    /// Every submit carries the payment resource's signed instruction for exactly its payment
    /// (issue 33, `instruction_refused`).
    pub instruction: bool,
    /// Every rail answer must carry the rail's signature over exactly its request and itself,
    /// or it is ambiguous (a payment) or unknown (a lookup) (issue 34).
    pub rail_answer: bool,
}

/// The keys the proxy judges and signs with, all required (there is no unsigned mode): the lock
/// service's grant keys, the payment resource's instruction keys (issue 33: a submit is sent only
/// on a signed instruction for exactly its payment), and the proxy's own rail-fact signing key
/// (every final outcome and every evidence it answers is signed, for the payment resource).
#[derive(Debug, Clone)]
pub struct GuardKeys {
    pub grants: Verifier,
    pub instructions: Verifier,
    pub fact_signer: Arc<Signer>,
}

/// The binaries' flags for [`GuardKeys`] (the shipped proxy and the test failpoint proxy).
#[derive(Debug, clap::Args)]
pub struct GuardKeyArgs {
    /// The lock service's public grant keys, `key_id=<64 hex digits>[,key_id=<...>]` (two during
    /// a rotation). Required: every fenced call's grant must be signed by one of them.
    #[arg(long, env = "GRANT_VERIFY_KEYS", value_parser = Verifier::parse)]
    pub grant_verify_keys: Verifier,
    /// The payment resource's instruction public keys, `key_id=<64 hex digits>[,...]` (`payoutctl
    /// keys instruction-signing`). Required: a submit is sent only on an instruction one of them
    /// signed for exactly that payment.
    #[arg(long, env = "INSTRUCTION_VERIFY_KEYS", value_parser = Verifier::parse)]
    pub instruction_verify_keys: Verifier,
    /// The id of this proxy's rail-fact signing key (`payoutctl keys rail-fact-signing`).
    #[arg(long, env = "RAIL_FACT_SIGNING_KEY_ID")]
    pub rail_fact_signing_key_id: String,
    /// The rail-fact signing key's file (its PKCS#8 document in hex, readable by the proxy only).
    #[arg(long, env = "RAIL_FACT_SIGNING_KEY_FILE")]
    pub rail_fact_signing_key_file: std::path::PathBuf,
}

impl GuardKeyArgs {
    pub fn load(self) -> anyhow::Result<GuardKeys> {
        use anyhow::Context;
        let path = &self.rail_fact_signing_key_file;
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading the rail-fact signing key {}", path.display()))?;
        let signer = Signer::from_hex(&self.rail_fact_signing_key_id, &text)
            .with_context(|| format!("reading the rail-fact signing key {}", path.display()))?;
        Ok(GuardKeys {
            grants: self.grant_verify_keys,
            instructions: self.instruction_verify_keys,
            fact_signer: Arc::new(signer),
        })
    }
}

#[derive(Debug, Clone)]
pub struct ProxyConfig {
    /// The rail's address and answer keys.
    rail: RailLink,
    /// Timeout of the single payment call; bounded by [`RAIL_CALL_TIMEOUT_MS_MAX`].
    pub rail_timeout: Duration,
    /// The lock service's public keys: a fenced call's grant must be signed by one of them.
    verifier: Verifier,
    /// The payment resource's instruction keys: a submit is sent only on an instruction one of
    /// them signed for exactly that payment.
    instructions: Verifier,
    /// Signs every final outcome and evidence the proxy answers.
    fact_signer: Arc<Signer>,
    /// The proxy's certificate; every caller must present one from the same authority, and
    /// `authz::POLICY` decides what its role may call.
    tls: service_kit::grpc::Tls,
    policy: &'static service_kit::grpc::Policy,
    /// TEST ONLY: serve without TLS and without the authorisation table (the bench's "security
    /// off" path).
    #[cfg(feature = "negative-controls")]
    plaintext: bool,
    #[cfg(feature = "negative-controls")]
    guards: Guards,
    pub(crate) protections: Protections,
    #[cfg(feature = "negative-controls")]
    failpoint: Option<Failpoint>,
}

#[derive(Debug, thiserror::Error)]
pub enum ProxyServerError {
    #[error("rail timeout of {0} ms is zero or above the bound of {RAIL_CALL_TIMEOUT_MS_MAX} ms")]
    RailTimeoutOutOfBounds(u128),
    #[error(transparent)]
    Store(#[from] store::StoreError),
    #[error("serving gRPC: {0}")]
    Serve(#[from] tonic::transport::Error),
}

impl ProxyConfig {
    /// How the proxy serves: as deployed (mutual TLS, the authorisation table, the bounds), or
    /// the benches' plaintext control in a `negative-controls` build.
    fn serving(
        &self,
        metrics: &service_kit::Metrics,
    ) -> Result<service_kit::grpc::Serving, tonic::transport::Error> {
        #[cfg(feature = "negative-controls")]
        if self.plaintext {
            return Ok(service_kit::grpc::Serving::plaintext_for_benches(
                "rail proxy",
            ));
        }
        service_kit::grpc::Serving::secure(
            &self.tls,
            self.policy,
            service_kit::grpc::BOUNDS,
            metrics,
        )
    }

    /// The proxy in front of the rail at `rail` (believing only answers its keys signed),
    /// verifying every fenced call's grant and instruction and signing its rail facts with
    /// `keys`, serving over mutual TLS with `tls`. There is no configuration without any of them.
    pub fn new(rail: RailLink, keys: GuardKeys, tls: service_kit::grpc::Tls) -> Self {
        Self {
            rail,
            rail_timeout: Duration::from_millis(RAIL_CALL_TIMEOUT_MS_DEFAULT),
            verifier: keys.grants,
            instructions: keys.instructions,
            fact_signer: keys.fact_signer,
            tls,
            policy: &authz::POLICY,
            #[cfg(feature = "negative-controls")]
            plaintext: false,
            #[cfg(feature = "negative-controls")]
            guards: Guards::Enforced,
            protections: Protections {
                seal: true,
                expiry: true,
                grant_signature: true,
                grant_key_binding: true,
                restore_check: true,
                instruction: true,
                rail_answer: true,
            },
            #[cfg(feature = "negative-controls")]
            failpoint: None,
        }
    }

    /// TEST ONLY (feature `negative-controls`): serve without TLS and without the authorisation
    /// table, so the bench can print what mutual TLS and the table cost a Submit beside what they
    /// protect. No binary can reach it: the shipped one is never built with the feature.
    #[cfg(feature = "negative-controls")]
    #[doc(hidden)]
    pub fn plaintext_for_benches(mut self) -> Self {
        self.plaintext = true;
        self
    }

    /// TEST ONLY (feature `negative-controls`): serve with another authorisation table (this
    /// crate's suite calls as worker and reconciler from one client:
    /// `testkit::pki::every_role(&authz::POLICY)`).
    #[cfg(feature = "negative-controls")]
    #[doc(hidden)]
    pub fn with_policy_for_tests(mut self, policy: &'static service_kit::grpc::Policy) -> Self {
        self.policy = policy;
        self
    }

    pub fn with_rail_timeout(mut self, timeout: Duration) -> Self {
        self.rail_timeout = timeout;
        self
    }

    /// The lock service's public keys this proxy verifies grants with.
    pub fn verifier(&self) -> &Verifier {
        &self.verifier
    }

    /// The key this proxy signs its rail facts with.
    pub(crate) fn fact_signer(&self) -> &Signer {
        &self.fact_signer
    }

    /// The payment resource's instruction keys this proxy verifies with.
    pub(crate) fn instructions(&self) -> &Verifier {
        &self.instructions
    }

    /// TEST ONLY (feature `negative-controls`): the negative control of the signed instruction.
    /// Every submit is taken at its word (no instruction is checked), so a caller with a genuine
    /// grant has the rail pay whatever it asks. No binary can reach it.
    #[cfg(feature = "negative-controls")]
    #[doc(hidden)]
    pub fn disable_instruction_verification_for_negative_control(mut self) -> Self {
        self.protections.instruction = false;
        self
    }

    /// TEST ONLY (feature `negative-controls`): the negative control of the rail's answer
    /// signature. Every answer on the rail's address is believed, so an impostor's `accepted`
    /// makes a payout POSTED without a movement. No binary can reach it.
    #[cfg(feature = "negative-controls")]
    #[doc(hidden)]
    pub fn disable_rail_answer_verification_for_negative_control(mut self) -> Self {
        self.protections.rail_answer = false;
        self
    }

    /// TEST ONLY (feature `negative-controls`): the negative control of the grant signature.
    /// Every fenced call is taken at its word (no signature is checked), so a fabricated token
    /// (i64::MAX, unsigned) is accepted and fences the real holder out. The key binding still
    /// runs; it is not reachable from any flag or environment variable.
    #[cfg(feature = "negative-controls")]
    #[doc(hidden)]
    pub fn disable_grant_verification_for_negative_control(mut self) -> Self {
        self.protections.grant_signature = false;
        self
    }

    /// TEST ONLY (feature `negative-controls`): the negative control of the key binding. A
    /// genuine grant signed for another lock key than the account's is accepted, so a token of
    /// account A fences account B. The signature is still verified.
    #[cfg(feature = "negative-controls")]
    #[doc(hidden)]
    pub fn disable_grant_key_binding_for_negative_control(mut self) -> Self {
        self.protections.grant_key_binding = false;
        self
    }

    /// TEST ONLY (feature `negative-controls`): the negative control of the restore check. The
    /// high-water statement does not ask whether proxydb is a restored copy, so a stale token
    /// passes a rewound high-water. Not reachable from any flag or environment variable.
    #[cfg(feature = "negative-controls")]
    #[doc(hidden)]
    pub fn disable_restore_check_for_negative_control(mut self) -> Self {
        self.protections.restore_check = false;
        self
    }

    /// TEST ONLY (feature `negative-controls`): the negative control. Skips the high-water and
    /// the uniqueness check and records nothing, so a test can show the duplicate payment the
    /// guard prevents. It is not reachable from any flag or environment variable.
    #[cfg(feature = "negative-controls")]
    #[doc(hidden)]
    pub fn disable_guards_for_negative_control(mut self) -> Self {
        self.guards = Guards::DisabledForNegativeControl;
        self
    }

    /// TEST ONLY (feature `negative-controls`): the negative control of the seal. A fenced
    /// inquiry still advances the high-water but never seals an unsubmitted payout, so a late
    /// Submit with a token at or above the inquirer's is accepted and sent.
    #[cfg(feature = "negative-controls")]
    #[doc(hidden)]
    pub fn disable_seal_for_negative_control(mut self) -> Self {
        self.protections.seal = false;
        self
    }

    /// TEST ONLY (feature `negative-controls`): the negative control of the expiry. Payment
    /// instructions carry no `valid_until`, and an inquiry takes the rail's ABSENT at its word.
    #[cfg(feature = "negative-controls")]
    #[doc(hidden)]
    pub fn disable_instruction_expiry_for_negative_control(mut self) -> Self {
        self.protections.expiry = false;
        self
    }

    /// TEST ONLY (feature `negative-controls`): a crash or stall point. No binary exposes it; a
    /// test that needs a crashing process runs the server itself in a process of its own.
    #[cfg(feature = "negative-controls")]
    #[doc(hidden)]
    pub fn with_failpoint(mut self, failpoint: Option<Failpoint>) -> Self {
        self.failpoint = failpoint;
        self
    }

    fn validate(&self) -> Result<(), ProxyServerError> {
        let ms = self.rail_timeout.as_millis();
        if ms == 0 || ms > u128::from(RAIL_CALL_TIMEOUT_MS_MAX) {
            return Err(ProxyServerError::RailTimeoutOutOfBounds(ms));
        }
        Ok(())
    }
}

/// Applies proxydb's migrations (tests and in-process harnesses; a deployment runs
/// `payoutctl migrate` as the owner role).
pub async fn migrate(pool: &sqlx::PgPool) -> Result<(), store::StoreError> {
    MIGRATOR.run(pool).await?;
    Ok(())
}

/// Refuses to serve a proxydb whose schema is not this build's (the binary's check at start: its
/// own role may not run DDL).
pub async fn require_schema(pool: &sqlx::PgPool) -> Result<(), db_access::DbError> {
    db_access::require_schema(pool, &MIGRATOR, "proxydb").await
}

/// Serves `railproxy.v1.RailProxy` and `grpc.health.v1` on `listener` until `shutdown` fires.
/// The caller has applied the migrations (see [`migrate`]).
pub async fn run(
    listener: tokio::net::TcpListener,
    pool: sqlx::PgPool,
    config: ProxyConfig,
    metrics: service_kit::Metrics,
    shutdown: Shutdown,
) -> Result<(), ProxyServerError> {
    config.validate()?;
    let (reporter, health) = tonic_health::server::health_reporter();
    let health_task = tokio::spawn(service_kit::health_from_db(
        reporter,
        SERVICE_NAME,
        pool.clone(),
        Duration::from_millis(service_kit::HEALTH_PERIOD_MS),
    ));
    #[cfg(feature = "negative-controls")]
    if !config.protections.grant_signature || !config.protections.grant_key_binding {
        tracing::error!(
            grant_signature = config.protections.grant_signature,
            grant_key_binding = config.protections.grant_key_binding,
            "rail proxy grant checks DISABLED (test-only negative control)"
        );
    }
    let incarnation_task = tokio::spawn(service_kit::watch_incarnation(
        pool.clone(),
        service_kit::Guard::RailProxy.label(),
        metrics.database_restored(),
        Duration::from_millis(service_kit::INCARNATION_PERIOD_MS),
    ));
    let rail = rail::Rail::new(
        &config.rail,
        config.rail_timeout,
        &metrics,
        config.protections.rail_answer,
    );
    let counters = service::Counters::new(&metrics);
    tracing::info!(addr = ?listener.local_addr().ok(), rail = %config.rail.url, rail_answer_verify_keys = ?config.rail.answer_keys, rail_timeout_ms = config.rail_timeout.as_millis() as u64, grant_verify_keys = ?config.verifier, instruction_verify_keys = ?config.instructions, rail_fact_signing_key_id = config.fact_signer.key_id(), "rail proxy listening");
    let serving = config.serving(&metrics)?;
    let service = service::ProxyService(Arc::new(service::Inner {
        pool,
        rail,
        config,
        counters,
    }));
    let service = RailProxyServer::new(timed::TimedProxy::new(service, &metrics))
        .max_decoding_message_size(service_kit::grpc::REQUEST_BYTES_MAX);
    let routes = tonic::service::Routes::new(health).add_service(service);
    let result = serving.serve(routes, listener, shutdown.wait()).await;
    health_task.abort();
    incarnation_task.abort();
    Ok(result?)
}

/// A proxy running in this process (tests, the benchmark).
pub struct RunningProxy {
    pub addr: std::net::SocketAddr,
    pub metrics: service_kit::Metrics,
    stop: tokio::sync::watch::Sender<bool>,
    task: tokio::task::JoinHandle<Result<(), ProxyServerError>>,
}

impl RunningProxy {
    /// Migrates `pool`'s database and serves `config` on a free 127.0.0.1 port.
    pub async fn start(pool: sqlx::PgPool, config: ProxyConfig) -> Result<Self, ProxyServerError> {
        config.validate()?;
        migrate(&pool).await?;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .map_err(|e| store::StoreError::Db(sqlx::Error::Io(e)))?;
        let addr = listener
            .local_addr()
            .map_err(|e| store::StoreError::Db(sqlx::Error::Io(e)))?;
        let metrics = service_kit::Metrics::default();
        let (shutdown, stop) = Shutdown::new();
        let task = tokio::spawn(run(listener, pool, config, metrics.clone(), shutdown));
        Ok(Self {
            addr,
            metrics,
            stop,
            task,
        })
    }

    pub fn endpoint(&self) -> String {
        format!("https://{}", self.addr)
    }

    pub async fn stop(self) -> Result<(), ProxyServerError> {
        let _ = self.stop.send(true);
        self.task.await.expect("proxy task does not panic")
    }
}
