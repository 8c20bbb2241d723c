//! The payment resource: paydb, with the account fence as the first guard (spec 2.5 INV-01,
//! INV-05), the payout state machine of spec 2.3 (INV-08), the double-entry ledger (INV-03) and
//! the GL outbox (spec 002, with this service in the role of "Wallet").
//!
//! Architecture invariants:
//! - Only this service writes `account.fence`, and only through one conditional statement at the
//!   start of a mutating transaction (`store::FENCE_ADVANCE_SQL`); it never reads the fence and
//!   then writes it.
//! - This service knows nothing of the lock service's address or etcd: what it shares with them is
//!   the grant a caller presents (key, token, owner) and the lock service's public keys
//!   (`--grant-verify-keys`). Every fenced call's grant is verified before the fence statement
//!   (`forged_grant`), and the statement is bound to the signed key's account
//!   (`grant_for_another_key`); `StoreOptions` has no unsigned mode outside its test-only switches.
//! - Transitions come only from `payout_domain::TRANSITIONS` via `PayoutState::apply`.
//! - The ledger and the audit trail are append-only, enforced by paydb's triggers.
//!
//! The contract of its gRPC boundary (the client, the wire conversions, the typed errors, the
//! request and response types) is the `payment-client` crate, which this crate uses and does not
//! re-export: callers depend on `payment-client`, not on this crate.

// `ServerError` holds `payment_client::PaymentError`, whose refusals carry every field a caller
// matches on (`ForgedGrant` is the largest): an error is a refused call, never a hot path.
#![allow(clippy::result_large_err)]

pub mod api;
pub mod authz;
pub mod error;
#[cfg(feature = "fixture-command")]
pub mod fixture;
pub mod model;
pub mod outbox;
pub mod payout_ages;
pub mod store;

use std::time::Duration;

pub use error::ServerError;
pub use grant_signing::instruction::TTL_DEFAULT_MS as INSTRUCTION_TTL_DEFAULT_MS;
/// The lock service's public keys, as `StoreOptions::new` takes them.
pub use grant_signing::Verifier;
pub use store::{FactKeyError, SignedFacts, Store, StoreOptions, RESOLUTION_SLA_DEFAULT};

/// The gRPC service name, as `grpc.health.v1` reports it.
pub const SERVICE_NAME: &str = "payment.v1.PaymentResource";

/// paydb's migrations. `payoutctl migrate` applies them as the owner role; the binary only checks
/// them ([`require_schema`]): its own role may not run DDL.
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("../../migrations/paydb");

/// Applies paydb's migrations (tests and in-process harnesses, which connect as the superuser).
pub async fn migrate(pool: &sqlx::PgPool) -> Result<(), sqlx::migrate::MigrateError> {
    MIGRATOR.run(pool).await
}

/// Refuses to serve a paydb whose schema is not this build's (see `db_access::require_schema`).
pub async fn require_schema(pool: &sqlx::PgPool) -> Result<(), db_access::DbError> {
    db_access::require_schema(pool, &MIGRATOR, "paydb").await
}

/// How long in-flight requests may drain after shutdown is signalled. Clients keep HTTP/2
/// connections open indefinitely, so an unbounded graceful stop would wait for them forever; a
/// request cut off here rolls back its transaction, which is always safe.
pub const SHUTDOWN_DRAIN_MS: u64 = 3_000;

/// How the server meets its callers: its TLS identity, its authorisation table, and whether the
/// fixture path is served.
#[derive(Clone)]
pub struct Front {
    tls: service_kit::grpc::Tls,
    metrics: service_kit::Metrics,
    policy: &'static service_kit::grpc::Policy,
    /// OpenAccount (funded accounts from nothing): off in a deployment.
    fixture_accounts: bool,
    /// TEST ONLY: serve without TLS and without the authorisation table.
    #[cfg(feature = "negative-controls")]
    plaintext: bool,
}

impl Front {
    /// `authz::POLICY`, the fixture path off.
    pub fn new(tls: service_kit::grpc::Tls, metrics: service_kit::Metrics) -> Self {
        Self {
            tls,
            metrics,
            policy: &authz::POLICY,
            fixture_accounts: false,
            #[cfg(feature = "negative-controls")]
            plaintext: false,
        }
    }
    pub fn with_fixture_accounts(mut self, on: bool) -> Self {
        self.fixture_accounts = on;
        self
    }
    /// TEST ONLY: serve with another table (this crate's own suite serves with
    /// `testkit::pki::every_role(&authz::POLICY)`). The binary has no way to call it.
    #[doc(hidden)]
    pub fn with_policy_for_tests(mut self, policy: &'static service_kit::grpc::Policy) -> Self {
        self.policy = policy;
        self
    }
    /// TEST ONLY (feature `negative-controls`): serve without TLS and without the authorisation
    /// table, so `payoutdev bench e2e` can print what the security costs a payout. The shipped
    /// binary is never built with the feature.
    #[cfg(feature = "negative-controls")]
    #[doc(hidden)]
    pub fn plaintext_for_benches(mut self) -> Self {
        self.plaintext = true;
        self
    }
}

impl Front {
    /// How this front serves: as deployed (mutual TLS, its authorisation table, the bounds), or
    /// the benches' plaintext control in a `negative-controls` build.
    fn serving(&self) -> Result<service_kit::grpc::Serving, tonic::transport::Error> {
        #[cfg(feature = "negative-controls")]
        if self.plaintext {
            return Ok(service_kit::grpc::Serving::plaintext_for_benches(
                "payment resource",
            ));
        }
        service_kit::grpc::Serving::secure(
            &self.tls,
            self.policy,
            service_kit::grpc::BOUNDS,
            &self.metrics,
        )
    }
}

/// Serves `payment.v1.PaymentResource` and `grpc.health.v1` on `listener` until `shutdown`,
/// over mutual TLS, behind `authz::POLICY`. Tests run it in-process on a port-0 listener; the
/// binary on its configured address.
pub async fn serve(
    listener: tokio::net::TcpListener,
    store: Store,
    front: Front,
    shutdown: service_kit::Shutdown,
) -> Result<(), tonic::transport::Error> {
    let (reporter, health) = tonic_health::server::health_reporter();
    let health_task = tokio::spawn(service_kit::health_from_db(
        reporter,
        SERVICE_NAME,
        store.pool().clone(),
        Duration::from_millis(service_kit::HEALTH_PERIOD_MS),
    ));
    let incarnation_task = tokio::spawn(service_kit::watch_incarnation(
        store.pool().clone(),
        service_kit::Guard::PaymentResource.label(),
        front.metrics.database_restored(),
        Duration::from_millis(service_kit::INCARNATION_PERIOD_MS),
    ));
    let payout_ages_task = tokio::spawn(payout_ages::watch(
        store.pool().clone(),
        store.payout_age_gauges().clone(),
        store.resolution_sla(),
        Duration::from_millis(payout_ages::PAYOUT_AGES_PERIOD_MS),
    ));
    let service = payout_proto::payment::payment_resource_server::PaymentResourceServer::new(
        api::PaymentApi::new(store, front.fixture_accounts, &front.metrics),
    )
    .max_decoding_message_size(service_kit::grpc::REQUEST_BYTES_MAX);
    let serving = front.serving()?;
    let routes = tonic::service::Routes::new(health).add_service(service);
    let server = serving.serve(routes, listener, shutdown.clone().wait());
    let drain_deadline = async {
        shutdown.wait().await;
        tokio::time::sleep(Duration::from_millis(SHUTDOWN_DRAIN_MS)).await;
    };
    let result = tokio::select! {
        result = server => result,
        () = drain_deadline => {
            tracing::warn!(drain_ms = SHUTDOWN_DRAIN_MS, "connections still open after the drain period; stopping");
            Ok(())
        }
    };
    health_task.abort();
    incarnation_task.abort();
    payout_ages_task.abort();
    result
}
