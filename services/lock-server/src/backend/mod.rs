//! The two backends behind one interface. Each decides mutual exclusion and expiry itself (etcd's
//! replicated lease decision, PostgreSQL's clock); the service layer above adds only events,
//! metrics, bounded waiting and the INV-04 check.

pub mod etcd;
pub mod postgres;

use std::time::Instant;

use crate::error::LockError;
use crate::session::SessionState;

/// A session as the backend granted it.
#[derive(Debug, Clone)]
pub struct SessionGrant {
    pub session_id: String,
    pub ttl_ms: u64,
}

/// What a caller presents to renew or release.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HandleRef {
    pub key: String,
    pub owner: String,
    pub session_id: String,
    pub token: u64,
}

/// A held lock, as the backend reports it.
#[derive(Debug, Clone)]
pub struct GrantInfo {
    pub key: String,
    pub owner: String,
    pub session_id: String,
    pub token: u64,
    pub server_expiry_unix_ms: i64,
    pub ttl_ms: u64,
    /// True when this call created the entry; false for an idempotent re-acquire (nothing minted).
    pub minted: bool,
}

/// The current holder, for not-acquired answers, revocation and introspection.
#[derive(Debug, Clone, Default)]
pub struct Holder {
    pub owner: String,
    pub session_id: String,
    pub token: u64,
    pub server_expiry_unix_ms: i64,
    /// The holder's session in the server's view (spec 2.4), where the backend said; the key
    /// being held, it is ACTIVE or SUSPECT.
    pub session_state: Option<SessionState>,
}

/// Where a waiter resumes watching after a failed attempt.
#[derive(Debug, Clone)]
pub enum WaitFrom {
    /// etcd: the revision at which the key was seen held; deletions after it wake the waiter.
    Revision(i64),
    /// PostgreSQL: the holder's session expires in this many ms by the database clock, unless
    /// renewed; a release notification may come earlier.
    ExpiresInMs(u64),
}

#[derive(Debug, Clone)]
pub enum Attempt {
    Granted(GrantInfo),
    Held { holder: Holder, wait_from: WaitFrom },
}

/// The configured backend.
pub enum Backend {
    Etcd(Box<etcd::EtcdBackend>),
    Postgres(postgres::PgBackend),
}

impl Backend {
    pub fn name(&self) -> &'static str {
        match self {
            Self::Etcd(_) => "etcd",
            Self::Postgres(_) => "postgres",
        }
    }

    pub async fn create_session(
        &self,
        owner: &str,
        ttl_ms: u64,
    ) -> Result<SessionGrant, LockError> {
        match self {
            Self::Etcd(b) => b.create_session(owner, ttl_ms).await,
            Self::Postgres(b) => b.create_session(owner, ttl_ms).await,
        }
    }
    pub async fn keep_alive(&self, session_id: &str) -> Result<u64, LockError> {
        match self {
            Self::Etcd(b) => b.keep_alive(session_id).await,
            Self::Postgres(b) => b.keep_alive(session_id).await,
        }
    }
    /// For each handle, whether it holds its key now (same token, owner and session): one read.
    pub async fn held_among(&self, handles: &[HandleRef]) -> Result<Vec<bool>, LockError> {
        match self {
            Self::Etcd(b) => b.held_among(handles).await,
            Self::Postgres(b) => b.held_among(handles).await,
        }
    }
    /// Releases every lock of the session in the same action. Idempotent.
    pub async fn close_session(&self, session_id: &str) -> Result<Vec<String>, LockError> {
        match self {
            Self::Etcd(b) => b.close_session(session_id).await,
            Self::Postgres(b) => b.close_session(session_id).await,
        }
    }
    pub async fn try_acquire(
        &self,
        key: &str,
        owner: &str,
        session_id: &str,
    ) -> Result<Attempt, LockError> {
        match self {
            Self::Etcd(b) => b.try_acquire(key, owner, session_id).await,
            Self::Postgres(b) => b.try_acquire(key, owner, session_id).await,
        }
    }
    /// A subscription taken before an attempt, so a release between the attempt and the wait is
    /// not missed (PostgreSQL notifications). etcd needs none: it watches from a revision.
    pub fn subscribe(&self) -> Option<tokio::sync::broadcast::Receiver<String>> {
        match self {
            Self::Etcd(_) => None,
            Self::Postgres(b) => Some(b.subscribe()),
        }
    }
    /// Returns when the key may have become free, or at `deadline`. Never polls the backend.
    pub async fn wait_for_release(
        &self,
        key: &str,
        from: &WaitFrom,
        deadline: Instant,
        subscription: Option<&mut tokio::sync::broadcast::Receiver<String>>,
    ) -> Result<(), LockError> {
        match self {
            Self::Etcd(b) => b.wait_for_release(key, from, deadline).await,
            Self::Postgres(b) => b.wait_for_release(key, from, deadline, subscription).await,
        }
    }
    pub async fn renew(&self, handle: &HandleRef) -> Result<GrantInfo, LockError> {
        match self {
            Self::Etcd(b) => b.renew(handle).await,
            Self::Postgres(b) => b.renew(handle).await,
        }
    }
    pub async fn release(&self, handle: &HandleRef) -> Result<(), LockError> {
        match self {
            Self::Etcd(b) => b.release(handle).await,
            Self::Postgres(b) => b.release(handle).await,
        }
    }
    /// Deletes `key`'s entry and writes its audit record in one transaction; with
    /// `expected_token`, only if the grant of that token holds the key, compared in the same
    /// transaction ([`LockError::HolderChanged`] otherwise, nothing written).
    pub async fn force_revoke(
        &self,
        key: &str,
        expected_token: Option<u64>,
        operator: &str,
        reason: &str,
    ) -> Result<Holder, LockError> {
        match self {
            Self::Etcd(b) => b.force_revoke(key, expected_token, operator, reason).await,
            Self::Postgres(b) => b.force_revoke(key, expected_token, operator, reason).await,
        }
    }
    pub async fn describe(&self, key: &str) -> Result<Option<Holder>, LockError> {
        match self {
            Self::Etcd(b) => b.describe(key).await,
            Self::Postgres(b) => b.describe(key).await,
        }
    }
    /// The session view (spec 2.4): the state of every session the backend can tell about (every
    /// live lockdb session; the etcd sessions this process answered for) and of `followed`, and
    /// the backend probed for a failover (an etcd election, lockdb back after an outage), after
    /// which every session is ACTIVE for one full TTL.
    pub async fn sessions_view(
        &self,
        followed: &[String],
    ) -> Result<Vec<(String, SessionState)>, LockError> {
        match self {
            Self::Etcd(b) => b.sessions_view().await,
            Self::Postgres(b) => b.sessions_view(followed).await,
        }
    }
    /// A cheap liveness probe for grpc.health.v1.
    pub async fn ping(&self) -> bool {
        match self {
            Self::Etcd(b) => b.ping().await,
            Self::Postgres(b) => b.ping().await,
        }
    }
}

pub(crate) fn unix_now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or_default()
}
