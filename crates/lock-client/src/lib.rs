//! Client of the lock service, for the activities.
//!
//! - A [`GrantHandle`] (this process's live handle on a grant) carries a REQUIRED [`FencingToken`]:
//!   code that mutates takes the token from a
//!   grant, so a mutating path without one does not compile (INV-07).
//! - Conservative local expiry (spec 2.4, client view): the deadline is on the local MONOTONIC
//!   clock (`std::time::Instant`), computed from the SEND time of the last successful keep-alive
//!   plus the TTL, minus [`LOCAL_DEADLINE_MARGIN`]; never the wall clock. [`GrantHandle::is_held`] turns
//!   false the moment it passes, and [`GrantHandle::lost`] notifies. This narrows the window in which a
//!   stale holder keeps working; it is not safety: the token at the guards is.
//! - A key can be taken from a live session (an operator's force-revoke frees it without ending
//!   the session), so each grant is also vouched for on its own: every keep-alive names the
//!   session's live grants and the answer says which of them it no longer holds (one read of
//!   the backend per keep-alive, whatever the number of grants); a grant is held only while its
//!   own deadline (the last vouching keep-alive's SEND time + TTL - margin) is ahead too. A
//!   deposed holder therefore stops believing within one TTL of the revoke (INV-06).
//! - Fail closed: any error on acquire is an `Err`, never a grant. There is no switch for that.

pub mod history;

pub use grant_signing::Signature;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use history::{monotonic_ns, HistoryEvent, HistoryRecorder};

pub use payout_domain::FencingToken;
use payout_proto::lock as pb;
use pb::lock_service_client::LockServiceClient;
use tokio::sync::watch;
use tonic::transport::Channel;

/// The client gives up this long before the earliest moment the server could expire the session.
/// Why it is needed at all: the server's expiry is measured from when the leader RECEIVED the
/// keep-alive, ours from when we SENT it, so ours is already earlier by the one-way delay; the
/// margin adds room for what the client cannot see: the time between `is_held()` answering true
/// and the caller's write leaving this process (a scheduler pause, a GC-like stall of a busy
/// worker), and the rate difference between this machine's monotonic clock and the etcd leader's.
/// Half a second covers a stalled tokio worker on a loaded 2-core machine with room to spare while
/// leaving most of a multi-second TTL usable.
pub const LOCAL_DEADLINE_MARGIN: Duration = Duration::from_millis(500);
/// Keep-alives are sent every TTL / this: three chances to succeed before the deadline passes.
/// The lock-server shows a session SUSPECT once its last keep-alive is older than one such
/// interval plus a little slack (`lock_server::session::CLIENT_KEEP_ALIVES_PER_TTL`, asserted
/// equal to this in its suite): change both together.
pub const KEEP_ALIVE_PER_TTL: u32 = 3;
/// Grants named in one keep-alive, as the lock service bounds them: a worker holds one per
/// account in flight, far fewer; beyond it the rest are vouched for by their deadlines running out.
pub const VOUCH_PER_KEEP_ALIVE_MAX: usize = 1_000;
/// A failed keep-alive is retried after this pause (bounded by the deadline, after which the
/// session is lost for good).
pub const KEEP_ALIVE_RETRY_MS: u64 = 100;
/// Every unary call is bounded; a lock service that does not answer in this time is treated as
/// down (acquire fails closed). Acquire adds its own wait bound on top.
pub const REQUEST_TIMEOUT_MS: u64 = 5_000;
/// Connecting to the lock service either works quickly or not at all.
pub const CONNECT_TIMEOUT_MS: u64 = 2_000;

pub use pb::rejection::Kind as Rejection;

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("cannot reach the lock service: {0}")]
    Connect(#[from] tonic::transport::Error),
    #[error("lock service TLS: {0}")]
    Tls(#[from] mtls::TlsError),
    /// A typed refusal from the server (e.g. `NotHolder`, `SessionNotFound`, `TokenRegression`).
    #[error("refused by the lock service: {message}")]
    Rejected { kind: Rejection, message: String },
    #[error("lock service call failed: {0}")]
    Status(tonic::Status),
    #[error("the session is lost locally: its deadline passed or the server ended it")]
    SessionLost,
    #[error("the lock service answered something malformed: {0}")]
    Malformed(&'static str),
    #[error("no answer from the lock service within {0:?}")]
    Timeout(Duration),
}

impl From<tonic::Status> for ClientError {
    fn from(status: tonic::Status) -> Self {
        match payout_proto::rejection::decode::<pb::Rejection>(&status).and_then(|r| r.kind) {
            Some(kind) => Self::Rejected {
                kind,
                message: status.message().to_string(),
            },
            None => Self::Status(status),
        }
    }
}

impl ClientError {
    pub fn rejection(&self) -> Option<&Rejection> {
        match self {
            Self::Rejected { kind, .. } => Some(kind),
            _ => None,
        }
    }
}

async fn bounded<T>(
    timeout: Duration,
    fut: impl std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
) -> Result<T, ClientError> {
    match tokio::time::timeout(timeout, fut).await {
        Ok(Ok(r)) => Ok(r.into_inner()),
        Ok(Err(status)) => Err(status.into()),
        Err(_) => Err(ClientError::Timeout(timeout)),
    }
}

#[derive(Clone)]
pub struct LockClient {
    rpc: LockServiceClient<Channel>,
    /// Where this client records what it believed about its grants (INV-06 evidence), if anywhere.
    history: Option<Arc<HistoryRecorder>>,
}

impl LockClient {
    /// Connects to `endpoint` (`https://...`) over mutual TLS, presenting `tls`'s certificate
    /// and accepting only a lock-server certificate. Sessions this client creates belong to that
    /// certificate: the server refuses them to any other.
    pub async fn connect(endpoint: &str, tls: &mtls::Tls) -> Result<Self, ClientError> {
        let channel = tls
            .endpoint(endpoint, mtls::Role::LockServer)?
            .connect_timeout(Duration::from_millis(CONNECT_TIMEOUT_MS))
            .connect()
            .await?;
        Ok(Self {
            rpc: LockServiceClient::new(channel),
            history: None,
        })
    }

    /// A client on a channel the caller built (its own TLS or channel options). Sessions belong
    /// to whatever identity that channel presents.
    pub fn from_channel(channel: Channel) -> Self {
        Self {
            rpc: LockServiceClient::new(channel),
            history: None,
        }
    }

    /// Records every grant, session deadline, loss and release of this client (and of the
    /// sessions and grants it makes) with `recorder`: the lock history INV-06 is checked against.
    pub fn with_history(mut self, recorder: Arc<HistoryRecorder>) -> Self {
        self.history = Some(recorder);
        self
    }

    fn record(&self, event: impl FnOnce() -> HistoryEvent) {
        if let Some(h) = &self.history {
            h.record(&event());
        }
    }

    fn timeout() -> Duration {
        Duration::from_millis(REQUEST_TIMEOUT_MS)
    }

    /// Opens a session and starts its background keep-alive.
    pub async fn open_session(&self, owner: &str, ttl: Duration) -> Result<Session, ClientError> {
        let sent_at = Instant::now();
        let mut rpc = self.rpc.clone();
        let r = bounded(
            Self::timeout(),
            rpc.create_session(pb::CreateSessionRequest {
                owner: owner.to_string(),
                ttl_ms: ttl.as_millis() as u64,
            }),
        )
        .await?;
        if r.session_id.is_empty() || r.ttl_ms == 0 {
            return Err(ClientError::Malformed("session without id or ttl"));
        }
        Ok(Session::start(
            self.clone(),
            owner.to_string(),
            r.session_id,
            Duration::from_millis(r.ttl_ms),
            sent_at,
        ))
    }

    /// Adopts an existing session (another process created it) and keeps it alive from here.
    /// The first keep-alive proves it is alive and starts the local deadline.
    pub async fn adopt_session(
        &self,
        owner: &str,
        session_id: &str,
    ) -> Result<Session, ClientError> {
        let sent_at = Instant::now();
        let mut rpc = self.rpc.clone();
        let r = bounded(
            Self::timeout(),
            rpc.keep_alive(pb::KeepAliveRequest {
                session_id: session_id.to_string(),
                vouch: Vec::new(),
            }),
        )
        .await?;
        Ok(Session::start(
            self.clone(),
            owner.to_string(),
            session_id.to_string(),
            Duration::from_millis(r.ttl_ms),
            sent_at,
        ))
    }

    pub async fn describe(&self, key: &str) -> Result<pb::DescribeResponse, ClientError> {
        let mut rpc = self.rpc.clone();
        bounded(
            Self::timeout(),
            rpc.describe(pb::DescribeRequest {
                key: key.to_string(),
            }),
        )
        .await
    }

    /// Operator break-glass: revokes `key` only while the grant of `expected_token` (what the
    /// caller saw in [`Self::describe`]) holds it; the server compares in the same backend
    /// transaction as the revoke, so a grant taken since is never deposed by mistake: it is
    /// refused as [`Rejection::HolderChanged`] (a key nobody holds: [`Rejection::NotHeld`]).
    /// Both `operator` and `reason` are required by the server.
    pub async fn force_revoke(
        &self,
        key: &str,
        expected_token: FencingToken,
        operator: &str,
        reason: &str,
    ) -> Result<pb::ForceRevokeResponse, ClientError> {
        let mut rpc = self.rpc.clone();
        let request = pb::ForceRevokeRequest {
            key: key.to_string(),
            operator: operator.to_string(),
            reason: reason.to_string(),
            expected_token: Some(expected_token.get()),
        };
        let sent_at = Instant::now();
        let answer = bounded(Self::timeout(), rpc.force_revoke(request)).await?;
        if let Some(h) = &self.history {
            h.record(&HistoryEvent::Revoke {
                key: key.to_string(),
                token: answer.revoked_token,
                sent_ns: monotonic_ns(sent_at),
                answered_ns: monotonic_ns(Instant::now()),
            });
        }
        Ok(answer)
    }

    /// The raw generated client, for callers that need a call this crate does not wrap.
    pub fn rpc(&self) -> LockServiceClient<Channel> {
        self.rpc.clone()
    }
}

/// Local liveness of one session: the deadline and the loss notification.
struct Liveness {
    deadline: Mutex<Instant>,
    lost: watch::Sender<bool>,
    /// The session's id and the client's recorder: every deadline and the loss are recorded.
    history: Option<(String, Arc<HistoryRecorder>)>,
}

impl Liveness {
    fn new(deadline: Instant, history: Option<(String, Arc<HistoryRecorder>)>) -> Arc<Self> {
        let (lost, _) = watch::channel(false);
        let liveness = Arc::new(Self {
            deadline: Mutex::new(deadline),
            lost,
            history,
        });
        liveness.record_deadline(deadline);
        liveness
    }

    fn record_deadline(&self, deadline: Instant) {
        if let Some((session, h)) = &self.history {
            h.record(&HistoryEvent::Deadline {
                session: session.clone(),
                deadline_ns: monotonic_ns(deadline),
            });
        }
    }

    fn deadline(&self) -> Instant {
        *self.deadline.lock().expect("deadline")
    }

    fn is_alive(&self) -> bool {
        !*self.lost.borrow() && Instant::now() < self.deadline()
    }

    /// A successful keep-alive SENT at `sent_at`: the server's expiry is at least `sent_at + ttl`.
    /// Once lost, a session stays lost: the caller must open a new one and acquire again.
    fn extend(&self, sent_at: Instant, ttl: Duration) {
        if *self.lost.borrow() {
            return;
        }
        let candidate = local_deadline(sent_at, ttl);
        let mut deadline = self.deadline.lock().expect("deadline");
        if candidate > *deadline {
            *deadline = candidate;
            // Under the lock: deadlines are recorded in the order they were set.
            self.record_deadline(candidate);
        }
    }

    fn mark_lost(&self, why: &str, session_id: &str) {
        if !*self.lost.borrow() {
            tracing::warn!(session_id, why, "lock session lost locally");
            if let Some((session, h)) = &self.history {
                h.record(&HistoryEvent::Lost {
                    session: session.clone(),
                    at_ns: monotonic_ns(Instant::now()),
                });
            }
        }
        self.lost.send_replace(true);
    }
}

/// The conservative local deadline for a keep-alive sent at `sent_at` that granted `ttl`.
pub fn local_deadline(sent_at: Instant, ttl: Duration) -> Instant {
    sent_at + ttl.saturating_sub(LOCAL_DEADLINE_MARGIN)
}

struct SessionInner {
    client: LockClient,
    owner: String,
    session_id: String,
    ttl: Duration,
    liveness: Arc<Liveness>,
    /// The grants made on this session and not yet dropped: each keep-alive round vouches for them.
    grants: Mutex<Vec<std::sync::Weak<GrantLiveness>>>,
    keep_alive: Mutex<Option<tokio::task::JoinHandle<()>>>,
    /// Test-only: keep-alives are no longer sent (a partitioned client); the loss is still
    /// announced at the deadline.
    suspended: std::sync::atomic::AtomicBool,
}

impl Drop for SessionInner {
    fn drop(&mut self) {
        if let Some(task) = self.keep_alive.lock().expect("keep-alive task").take() {
            task.abort();
        }
    }
}

/// A session with a background keep-alive. Cheap to clone; the keep-alive stops when the last
/// clone (including grants) is dropped, or on [`Session::close`].
#[derive(Clone)]
pub struct Session {
    inner: Arc<SessionInner>,
}

impl Session {
    fn start(
        client: LockClient,
        owner: String,
        session_id: String,
        ttl: Duration,
        sent_at: Instant,
    ) -> Self {
        let history = client.history.clone().map(|h| (session_id.clone(), h));
        let liveness = Liveness::new(local_deadline(sent_at, ttl), history);
        let inner = Arc::new(SessionInner {
            client,
            owner,
            session_id,
            ttl,
            liveness,
            grants: Mutex::new(Vec::new()),
            keep_alive: Mutex::new(None),
            suspended: std::sync::atomic::AtomicBool::new(false),
        });
        let task = tokio::spawn(keep_alive_loop(Arc::downgrade(&inner)));
        *inner.keep_alive.lock().expect("keep-alive task") = Some(task);
        Self { inner }
    }

    pub fn id(&self) -> &str {
        &self.inner.session_id
    }
    pub fn owner(&self) -> &str {
        &self.inner.owner
    }
    pub fn ttl(&self) -> Duration {
        self.inner.ttl
    }
    /// The local monotonic deadline: the session is treated as lost from this instant on.
    pub fn deadline(&self) -> Instant {
        self.inner.liveness.deadline()
    }
    pub fn is_alive(&self) -> bool {
        self.inner.liveness.is_alive()
    }
    /// Turns `true` once the session is lost locally (deadline passed or server said gone).
    pub fn lost(&self) -> watch::Receiver<bool> {
        self.inner.liveness.lost.subscribe()
    }

    /// Acquires `key`, waiting at most `wait` for a release. Fail closed: any error is `Err`; a
    /// grant is returned only if the server granted it to this owner and session AND the local
    /// deadline has not passed by the time the answer arrives.
    pub async fn acquire(&self, key: &str, wait: Duration) -> Result<Acquired, ClientError> {
        let owner = self.inner.owner.clone();
        self.acquire_as(key, &owner, wait).await
    }

    /// Acquires on this session under a narrower owner than the session's: one process runs
    /// many units of work (a worker runs many workflows), and each must hold its own grant.
    /// Acquire is idempotent per (owner, session), so two units sharing the session's owner
    /// would both be handed the same grant: mutual exclusion between them would be gone.
    pub async fn acquire_as(
        &self,
        key: &str,
        owner: &str,
        wait: Duration,
    ) -> Result<Acquired, ClientError> {
        if !self.is_alive() {
            return Err(ClientError::SessionLost);
        }
        let mut rpc = self.inner.client.rpc.clone();
        let request = pb::AcquireRequest {
            key: key.to_string(),
            owner: owner.to_string(),
            session_id: self.inner.session_id.clone(),
            wait_ms: wait.as_millis() as u64,
        };
        // The lock history's `requested_ns`: the service granted no earlier than this.
        let sent_at = Instant::now();
        let r = bounded(wait + LockClient::timeout(), rpc.acquire(request)).await?;
        match r.result {
            Some(pb::acquire_response::Result::Grant(g)) => {
                if g.key != key || g.owner != owner || g.session_id != self.inner.session_id {
                    return Err(ClientError::Malformed(
                        "grant for another key, owner or session",
                    ));
                }
                let token = FencingToken::new(g.token).map_err(|e| {
                    ClientError::Malformed(match e {
                        payout_domain::TokenError::Zero => "grant without a token",
                        payout_domain::TokenError::AboveMax { .. } => "grant token above i64::MAX",
                    })
                })?;
                if !self.is_alive() {
                    return Err(ClientError::SessionLost);
                }
                tracing::info!(key, owner = %g.owner, session_id = %g.session_id, token = g.token, "lock acquired");
                self.inner.client.record(|| HistoryEvent::Grant {
                    key: g.key.clone(),
                    owner: g.owner.clone(),
                    token: g.token,
                    session: g.session_id.clone(),
                    at_ns: monotonic_ns(Instant::now()),
                    requested_ns: Some(monotonic_ns(sent_at)),
                });
                // The grant's own first deadline counts from its arrival: an acquire may wait at
                // the server for most of a TTL, and the session's deadline already bounds the
                // lease; the next keep-alive round (within TTL / 3) vouches for it.
                let liveness = self.register_grant(&g.key, &g.owner, token, Instant::now());
                Ok(Acquired::Granted(GrantHandle {
                    key: g.key,
                    owner: g.owner,
                    token,
                    signature: Signature {
                        key_id: g.signing_key_id,
                        bytes: g.signature,
                    },
                    server_expiry_unix_ms: g.server_expiry_unix_ms,
                    session: self.clone(),
                    liveness,
                }))
            }
            Some(pb::acquire_response::Result::NotAcquired(n)) => Ok(Acquired::NotAcquired {
                holder_owner: n.holder_owner,
                holder_token: n.holder_token,
            }),
            None => Err(ClientError::Malformed("acquire answer without a result")),
        }
    }

    /// A grant's own liveness, vouched for by every keep-alive round from now on; its first
    /// deadline counts from `vouched_at`, an instant the client knew it held the key.
    fn register_grant(
        &self,
        key: &str,
        owner: &str,
        token: FencingToken,
        vouched_at: Instant,
    ) -> Arc<GrantLiveness> {
        let liveness = Arc::new(GrantLiveness {
            key: key.to_string(),
            owner: owner.to_string(),
            token,
            deadline: Mutex::new(vouched_at),
            revoked: std::sync::atomic::AtomicBool::new(false),
            history: self.inner.client.history.clone(),
        });
        liveness.extend(vouched_at, self.inner.ttl);
        let mut grants = self.inner.grants.lock().expect("grants");
        grants.retain(|g| g.strong_count() > 0);
        grants.push(Arc::downgrade(&liveness));
        liveness
    }

    /// Ends the session; the server releases every lock attached to it in one action.
    pub async fn close(&self) -> Result<(), ClientError> {
        if let Some(task) = self
            .inner
            .keep_alive
            .lock()
            .expect("keep-alive task")
            .take()
        {
            task.abort();
        }
        self.inner
            .liveness
            .mark_lost("closed", &self.inner.session_id);
        let mut rpc = self.inner.client.rpc.clone();
        bounded(
            LockClient::timeout(),
            rpc.close_session(pb::CloseSessionRequest {
                session_id: self.inner.session_id.clone(),
            }),
        )
        .await?;
        Ok(())
    }

    /// Stops sending keep-alives without telling the server: what a partitioned or frozen client
    /// looks like from the server. For tests of expiry; the deadline then runs out on its own.
    #[doc(hidden)]
    pub fn stop_keep_alive(&self) {
        self.inner
            .suspended
            .store(true, std::sync::atomic::Ordering::SeqCst);
    }
}

async fn keep_alive_loop(inner: std::sync::Weak<SessionInner>) {
    loop {
        let (mut rpc, session_id, ttl, liveness, suspended) = {
            let Some(s) = inner.upgrade() else { return };
            let suspended = s.suspended.load(std::sync::atomic::Ordering::SeqCst);
            (
                s.client.rpc.clone(),
                s.session_id.clone(),
                s.ttl,
                s.liveness.clone(),
                suspended,
            )
        };
        let deadline = liveness.deadline();
        if suspended {
            sleep_or_lose(&liveness, &session_id, deadline).await;
            return;
        }
        let period = ttl / KEEP_ALIVE_PER_TTL;
        let now = Instant::now();
        if now >= deadline {
            liveness.mark_lost("deadline passed", &session_id);
            return;
        }
        // Wake for the next keep-alive, or at the deadline to announce the loss on time.
        let next = now + period;
        // The grants relied on now; one registered after this is covered by its own first
        // deadline until the next round.
        let vouched: Vec<Arc<GrantLiveness>> = {
            let Some(s) = inner.upgrade() else { return };
            let mut grants = s.grants.lock().expect("grants");
            grants.retain(|g| g.strong_count() > 0);
            grants
                .iter()
                .filter_map(std::sync::Weak::upgrade)
                .filter(|g| !g.is_revoked())
                .take(VOUCH_PER_KEEP_ALIVE_MAX)
                .collect()
        };
        let sent_at = Instant::now();
        let call = rpc.keep_alive(pb::KeepAliveRequest {
            session_id: session_id.clone(),
            vouch: vouched
                .iter()
                .map(|g| pb::Handle {
                    key: g.key.clone(),
                    owner: g.owner.clone(),
                    session_id: session_id.clone(),
                    token: g.token.get(),
                })
                .collect(),
        });
        let outcome = tokio::select! {
            r = tokio::time::timeout(deadline.saturating_duration_since(sent_at), call) => r,
            _ = tokio::time::sleep_until(tokio::time::Instant::from_std(deadline)) => {
                liveness.mark_lost("deadline passed", &session_id);
                return;
            }
        };
        match outcome {
            Ok(Ok(r)) => {
                let r = r.into_inner();
                let ttl = Duration::from_millis(r.ttl_ms);
                // The losses first: a grant the answer disowns is never extended by it. An
                // unvouched answer extends the session only.
                for g in vouched.iter().filter(|_| !r.unvouched) {
                    let lost = r
                        .not_held
                        .iter()
                        .any(|h| h.key == g.key && h.owner == g.owner && h.token == g.token.get());
                    if lost {
                        g.revoke("the lock service says this session no longer holds the key");
                    } else {
                        g.extend(sent_at, ttl);
                    }
                }
                liveness.extend(sent_at, ttl);
                let wake = next.min(liveness.deadline());
                sleep_or_lose(&liveness, &session_id, wake).await;
            }
            Ok(Err(status)) if status.code() == tonic::Code::NotFound => {
                liveness.mark_lost("server says the session is gone", &session_id);
                return;
            }
            Ok(Err(status)) => {
                tracing::warn!(session_id, error = %status, "keep-alive failed; retrying until the deadline");
                let retry = Instant::now() + Duration::from_millis(KEEP_ALIVE_RETRY_MS);
                sleep_or_lose(&liveness, &session_id, retry.min(liveness.deadline())).await;
            }
            Err(_) => {
                liveness.mark_lost("deadline passed during keep-alive", &session_id);
                return;
            }
        }
        if *liveness.lost.borrow() {
            return;
        }
    }
}

/// One grant's own liveness, apart from its session's: the key can be taken from a live session.
struct GrantLiveness {
    key: String,
    owner: String,
    token: FencingToken,
    deadline: Mutex<Instant>,
    revoked: std::sync::atomic::AtomicBool,
    history: Option<Arc<HistoryRecorder>>,
}

impl GrantLiveness {
    fn deadline(&self) -> Instant {
        *self.deadline.lock().expect("grant deadline")
    }

    fn is_revoked(&self) -> bool {
        self.revoked.load(std::sync::atomic::Ordering::SeqCst)
    }

    fn is_alive(&self) -> bool {
        !self.is_revoked() && Instant::now() < self.deadline()
    }

    /// The server said "still the holder" to a request SENT at `sent_at`.
    fn extend(&self, sent_at: Instant, ttl: Duration) {
        if self.is_revoked() {
            return;
        }
        let candidate = local_deadline(sent_at, ttl);
        let mut deadline = self.deadline.lock().expect("grant deadline");
        if candidate > *deadline {
            *deadline = candidate;
            if let Some(h) = &self.history {
                h.record(&HistoryEvent::GrantDeadline {
                    key: self.key.clone(),
                    owner: self.owner.clone(),
                    token: self.token.get(),
                    deadline_ns: monotonic_ns(candidate),
                });
            }
        }
    }

    fn revoke(&self, why: &str) {
        if !self.revoked.swap(true, std::sync::atomic::Ordering::SeqCst) {
            tracing::warn!(key = %self.key, owner = %self.owner, token = self.token.get(), why, "grant lost while its session lives");
            if let Some(h) = &self.history {
                h.record(&HistoryEvent::GrantLost {
                    key: self.key.clone(),
                    owner: self.owner.clone(),
                    token: self.token.get(),
                    at_ns: monotonic_ns(Instant::now()),
                });
            }
        }
    }
}

async fn sleep_or_lose(liveness: &Liveness, session_id: &str, wake: Instant) {
    tokio::time::sleep_until(tokio::time::Instant::from_std(wake)).await;
    if Instant::now() >= liveness.deadline() {
        liveness.mark_lost("deadline passed", session_id);
    }
}

#[derive(Debug)]
pub enum Acquired {
    Granted(GrantHandle),
    NotAcquired {
        holder_owner: String,
        holder_token: u64,
    },
}

impl Acquired {
    pub fn granted(self) -> Option<GrantHandle> {
        match self {
            Self::Granted(g) => Some(g),
            Self::NotAcquired { .. } => None,
        }
    }
}

/// A grant handle: key, owner, session, the REQUIRED token, and the local deadline.
pub struct GrantHandle {
    key: String,
    /// The grant's owner: the session's owner, or a narrower one (`Session::acquire_as`).
    owner: String,
    token: FencingToken,
    /// The lock service's signature over (key, token, owner): what the guards verify.
    signature: Signature,
    server_expiry_unix_ms: i64,
    session: Session,
    /// Vouched for by the session's keep-alive rounds while this handle lives.
    liveness: Arc<GrantLiveness>,
}

impl std::fmt::Debug for GrantHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrantHandle")
            .field("key", &self.key)
            .field("owner", &self.owner)
            .field("session_id", &self.session.id())
            .field("token", &self.token)
            .finish()
    }
}

impl GrantHandle {
    pub fn key(&self) -> &str {
        &self.key
    }
    pub fn owner(&self) -> &str {
        &self.owner
    }
    pub fn session_id(&self) -> &str {
        self.session.id()
    }
    pub fn token(&self) -> FencingToken {
        self.token
    }
    /// The lock service's signature of this grant, presented with the token to both guards.
    pub fn signature(&self) -> &Signature {
        &self.signature
    }
    pub fn session(&self) -> &Session {
        &self.session
    }
    /// The server's expiry hint at grant time (wall clock, informative only: never decide on it).
    pub fn server_expiry_unix_ms(&self) -> i64 {
        self.server_expiry_unix_ms
    }
    /// The local monotonic deadline after which this grant must not be relied on: the earlier of
    /// its session's and its own (last vouched for by a Renew).
    pub fn deadline(&self) -> Instant {
        self.session.deadline().min(self.liveness.deadline())
    }
    /// False from the instant either local deadline passes, the session is lost, or the lock
    /// service answered that this handle no longer holds the key (a force-revoke), before the
    /// server's expiry. Liveness, not safety: the token at the guards is the safety.
    pub fn is_held(&self) -> bool {
        self.session.is_alive() && self.liveness.is_alive()
    }
    /// Turns `true` when the grant's SESSION is lost locally; `changed()` wakes work that must
    /// stop. A revoke of this one key is seen by [`GrantHandle::is_held`], checked before every write.
    pub fn lost(&self) -> watch::Receiver<bool> {
        self.session.lost()
    }

    fn handle(&self) -> pb::Handle {
        pb::Handle {
            key: self.key.clone(),
            owner: self.owner.clone(),
            session_id: self.session.id().to_string(),
            token: self.token.get(),
        }
    }

    /// Extends the session if this handle still holds the key; the token is unchanged.
    pub async fn renew(&self) -> Result<(), ClientError> {
        let sent_at = Instant::now();
        let mut rpc = self.session.inner.client.rpc.clone();
        let r = bounded(
            LockClient::timeout(),
            rpc.renew(pb::RenewRequest {
                handle: Some(self.handle()),
            }),
        )
        .await
        .inspect_err(|e| {
            if matches!(
                e.rejection(),
                Some(Rejection::NotHolder(_) | Rejection::NotHeld(_))
            ) {
                self.liveness
                    .revoke("the lock service says this handle no longer holds the key");
            }
        })?;
        let grant = r
            .grant
            .ok_or(ClientError::Malformed("renew answer without a grant"))?;
        if grant.token != self.token.get() {
            return Err(ClientError::Malformed("renew changed the token"));
        }
        let ttl = Duration::from_millis(grant.ttl_ms);
        self.session.inner.liveness.extend(sent_at, ttl);
        self.liveness.extend(sent_at, ttl);
        Ok(())
    }

    /// Compare-and-delete on this handle. Refused (`NotHolder`) if it no longer holds the key.
    /// Takes `&self` so that a release that failed in transit can be tried again with the same
    /// handle; a second release of a released key is refused, never harmful.
    pub async fn release(&self) -> Result<(), ClientError> {
        self.session.inner.client.record(|| HistoryEvent::Release {
            key: self.key.clone(),
            owner: self.owner.clone(),
            token: self.token.get(),
            at_ns: monotonic_ns(Instant::now()),
        });
        let mut rpc = self.session.inner.client.rpc.clone();
        bounded(
            LockClient::timeout(),
            rpc.release(pb::ReleaseRequest {
                handle: Some(self.handle()),
            }),
        )
        .await?;
        // Only a freed key is recorded: a refusal or a lost answer leaves the release open.
        self.session.inner.client.record(|| HistoryEvent::Released {
            key: self.key.clone(),
            owner: self.owner.clone(),
            token: self.token.get(),
            at_ns: monotonic_ns(Instant::now()),
        });
        Ok(())
    }

    /// Re-establishes a handle in another process from what the first one recorded: verifies it
    /// still holds the key (a Renew, which also extends the session), adopts the session's
    /// keep-alive here, and starts this process's own local deadline from that renewal's send time.
    pub async fn reestablish(
        client: &LockClient,
        key: &str,
        owner: &str,
        session_id: &str,
        token: FencingToken,
    ) -> Result<GrantHandle, ClientError> {
        let sent_at = Instant::now();
        let handle = pb::Handle {
            key: key.to_string(),
            owner: owner.to_string(),
            session_id: session_id.to_string(),
            token: token.get(),
        };
        let mut rpc = client.rpc.clone();
        let r = bounded(
            LockClient::timeout(),
            rpc.renew(pb::RenewRequest {
                handle: Some(handle),
            }),
        )
        .await?;
        let grant = r
            .grant
            .ok_or(ClientError::Malformed("renew answer without a grant"))?;
        if grant.token != token.get() {
            return Err(ClientError::Malformed("renew changed the token"));
        }
        let session = Session::start(
            client.clone(),
            owner.to_string(),
            session_id.to_string(),
            Duration::from_millis(grant.ttl_ms),
            sent_at,
        );
        let liveness = session.register_grant(key, owner, token, sent_at);
        Ok(GrantHandle {
            key: key.to_string(),
            owner: owner.to_string(),
            token,
            signature: Signature {
                key_id: grant.signing_key_id,
                bytes: grant.signature,
            },
            server_expiry_unix_ms: grant.server_expiry_unix_ms,
            session,
            liveness,
        })
        .inspect(|g| {
            client.record(|| HistoryEvent::Grant {
                key: g.key.clone(),
                owner: g.owner.clone(),
                token: g.token.get(),
                session: g.session.id().to_string(),
                at_ns: monotonic_ns(Instant::now()),
                requested_ns: Some(monotonic_ns(sent_at)),
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_local_deadline_is_earlier_than_send_time_plus_ttl() {
        let sent = Instant::now();
        let ttl = Duration::from_secs(2);
        assert_eq!(
            local_deadline(sent, ttl),
            sent + ttl - LOCAL_DEADLINE_MARGIN
        );
        // A TTL below the margin yields an already-passed deadline: fail closed.
        assert_eq!(local_deadline(sent, Duration::from_millis(100)), sent);
    }

    #[tokio::test]
    async fn liveness_is_lost_for_good_once_marked() {
        let l = Liveness::new(Instant::now() + Duration::from_secs(10), None);
        assert!(l.is_alive());
        l.mark_lost("test", "1");
        l.extend(Instant::now(), Duration::from_secs(60));
        assert!(!l.is_alive());
    }
}
