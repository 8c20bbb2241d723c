//! etcd backend (the default). A session is a lease; a lock is a key attached to that lease; the
//! token is the revision at which the key was created (it is never rewritten while held, so that is
//! also its ModRevision). Expiry is etcd's replicated lease decision: this process keeps no timer.
//!
//! The grace period of spec 2.4 is etcd's own: keep-alives are not replicated, so a new leader
//! cannot know how much of a lease was left, and its lessor renews every lease to its full TTL
//! plus an election timeout when it takes office (`Promote`; lease checkpointing, which would keep
//! the remaining TTL across elections, is experimental in 3.4, off here, and only ever applies to
//! leases longer than its five-minute interval). The lock-server adds no grace of its own; it
//! notices the election (a higher raft term with a leader) and shows every session ACTIVE for one
//! TTL. Proof on a real three-member cluster: `etcd_a_leader_election_gives_every_session_one_full_ttl`.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, EventType, GetOptions, LeaseTimeToLiveOptions,
    PutOptions, Txn, TxnOp, TxnOpResponse, WatchFilterType, WatchOptions,
};
use grant_signing::audit_chain;
use serde::{Deserialize, Serialize};

use super::{unix_now_ms, Attempt, GrantInfo, HandleRef, Holder, SessionGrant, WaitFrom};
use crate::error::LockError;
use crate::session::{Heartbeats, SessionMetrics, SessionState};

/// Reads per transaction when vouching for grants: below etcd's default `--max-txn-ops` (128).
pub const VOUCH_READS_PER_TXN: usize = 100;
const BACKEND: &str = "etcd";

/// Every unary etcd call is bounded: an election takes about a second with the cluster's timings,
/// so five seconds covers one election and still fails a request fast enough for a client whose
/// session TTL is a few seconds to learn about it while its lease may still be alive.
pub const REQUEST_TIMEOUT_MS: u64 = 5_000;
/// Connecting to an endpoint on loopback or a LAN either works quickly or not at all.
pub const CONNECT_TIMEOUT_MS: u64 = 2_000;
/// Force-revoke reads the holder and deletes it conditioned on that read; a holder change in
/// between is retried this many times before the operator is told to try again.
pub const REVOKE_ATTEMPTS_MAX: usize = 3;
/// Every force-revoke appends to the one audit chain, so revokes of different keys at once
/// conflict on its head: the one that lost reads the head again (another revoke landed, so each
/// round makes progress), at most this many times before the operator is told to try again.
pub const AUDIT_APPEND_ATTEMPTS_MAX: usize = 16;

/// How long a grant record is kept by default: the reconciler's INV-07 horizon (tokens first
/// accepted at a guard within it must have a record) is one day inside this week, and a week of
/// records fits the compose deployment's quota at the rates the ARCHITECTURE sizing states.
pub const GRANT_RETENTION_MS_DEFAULT: u64 = 7 * 24 * 3_600_000;
/// Shortest retention, for tests and the soak: etcd's shortest lease is two seconds with the
/// election timings used here (1.5 election timeouts, rounded up to whole seconds), and a window
/// this short still lets a test see a record before it goes. Deployments keep days.
pub const GRANT_RETENTION_MS_MIN: u64 = 2_000;
/// Longest retention: beyond a month the quota, not the window, would decide how long records
/// stay (a month at the compose deployment's rates is already most of its quota).
pub const GRANT_RETENTION_MS_MAX: u64 = 31 * 24 * 3_600_000;
/// Retention leases per window. Records written while a lease is current (one rotation period,
/// window / N) are attached to it, and the lease lives window + period: every record is kept at
/// least the window and at most (1 + 1/N) of it. Seven gives one lease a day at the default week,
/// so at most eight leases per lock-server are alive and the bound is a seventh above the window.
pub const RETENTION_LEASES_PER_WINDOW: u64 = 7;

/// What the key's value records: the holder. The session is the lease too; it is repeated here so
/// compare-and-delete can compare one value.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
struct Entry {
    owner: String,
    session_id: String,
}

/// The value of `{prefix}retention/{lease id}`, a key attached to its own retention lease: which
/// lease holds grant records and until when it may live. Lets any lock-server revoke a retention
/// lease by age (etcd 3.4 resets a lease's remaining TTL on every leader change, so the TTL alone
/// does not bound how long records stay), and tells operators which leases not to revoke after a
/// restore (RESTORE.md).
#[derive(Debug, Serialize, Deserialize)]
struct RetentionMarker {
    lease_id: i64,
    created_unix_ms: i64,
    expires_unix_ms: i64,
}

/// The retention lease new grant records are attached to, and when this process made it.
#[derive(Debug, Clone, Copy)]
struct RetentionLease {
    id: i64,
    made: Instant,
}

pub struct EtcdBackend {
    endpoints: Vec<String>,
    /// etcd's authority and this server's certificate from it: every connection is mutual TLS.
    tls: mtls::Tls,
    /// The member this process talks to, and its index in `endpoints`. A member that stops
    /// answering (connection refused, unavailable) is replaced by the next one that connects:
    /// etcd forwards every request to the leader, so any live member will do.
    current: tokio::sync::Mutex<(usize, Client)>,
    prefix: String,
    /// Granted TTL per lease, as seen by this process: only to report expiry hints without an
    /// extra round trip. Never used to decide anything.
    granted_ttl_ms: Mutex<HashMap<i64, u64>>,
    /// How long grant records are kept (see [`GRANT_RETENTION_MS_DEFAULT`]).
    grant_retention_ms: u64,
    /// The current retention lease; replaced every rotation period. Held across the rotation's
    /// etcd calls, so concurrent acquires wait for one new lease instead of each making one.
    retention: tokio::sync::Mutex<Option<RetentionLease>>,
    /// The last keep-alive answered for each session, for the session view (spec 2.4): etcd does
    /// not say when a lease was last refreshed. Never used to decide anything.
    heartbeats: Heartbeats,
    /// The highest raft term seen with a leader: a higher one is an election, after which etcd's
    /// lessor has renewed every lease to its full TTL (the grace period).
    raft_term: Mutex<Option<u64>>,
    session_metrics: SessionMetrics,
}

fn backend_err(e: impl std::fmt::Display) -> LockError {
    LockError::Backend {
        backend: BACKEND,
        detail: e.to_string(),
    }
}

fn is_lease_not_found(e: &etcd_client::Error) -> bool {
    e.to_string().contains("lease not found")
}

fn map_err(e: etcd_client::Error, session_id: Option<&str>) -> LockError {
    match session_id {
        Some(id) if is_lease_not_found(&e) => LockError::SessionNotFound {
            session_id: id.to_string(),
        },
        _ => backend_err(e),
    }
}

async fn connect_one(endpoint: &str, tls: &mtls::Tls) -> Result<Client, LockError> {
    let options = ConnectOptions::new()
        .with_connect_timeout(Duration::from_millis(CONNECT_TIMEOUT_MS))
        .with_tls(tls.etcd_client_config());
    Client::connect([endpoint], Some(options))
        .await
        .map_err(backend_err)
}

pub(crate) fn parse_lease(session_id: &str) -> Result<i64, LockError> {
    session_id
        .parse::<i64>()
        .ok()
        .filter(|id| *id > 0)
        .ok_or_else(|| LockError::invalid("session_id", "must be a positive decimal lease id"))
}

impl EtcdBackend {
    /// `prefix` namespaces every key this server writes (`{prefix}locks/...`, `{prefix}audit/...`
    /// and `{prefix}audit-head`, `{prefix}grants/...`, `{prefix}retention/...`); grant records are
    /// kept `grant_retention_ms`.
    /// Every connection is mutual TLS (`tls`: etcd's authority, this server's certificate from
    /// it); an endpoint that is not `https://` is refused.
    pub async fn connect(
        endpoints: &[String],
        tls: &mtls::Tls,
        prefix: &str,
        grant_retention_ms: u64,
        session_metrics: SessionMetrics,
    ) -> Result<Self, LockError> {
        if endpoints.is_empty() {
            return Err(LockError::invalid(
                "etcd_endpoints",
                "at least one endpoint",
            ));
        }
        if let Some(plain) = endpoints.iter().find(|e| mtls::require_https(e).is_err()) {
            return Err(LockError::invalid(
                "etcd_endpoints",
                format!(
                    "{plain}: etcd is reached over mutual TLS only, so the URL must be https://"
                ),
            ));
        }
        if !(GRANT_RETENTION_MS_MIN..=GRANT_RETENTION_MS_MAX).contains(&grant_retention_ms) {
            return Err(LockError::invalid(
                "grant_retention_ms",
                format!("must be within {GRANT_RETENTION_MS_MIN}..={GRANT_RETENTION_MS_MAX}"),
            ));
        }
        let mut last_error = None;
        let mut connected = None;
        for (i, endpoint) in endpoints.iter().enumerate() {
            match connect_one(endpoint, tls).await {
                Ok(c) => {
                    connected = Some((i, c));
                    break;
                }
                Err(e) => last_error = Some(e),
            }
        }
        let Some(current) = connected else {
            return Err(last_error.unwrap_or_else(|| backend_err("no endpoint")));
        };
        let mut prefix = prefix.to_string();
        if !prefix.ends_with('/') {
            prefix.push('/');
        }
        Ok(Self {
            endpoints: endpoints.to_vec(),
            tls: tls.clone(),
            current: tokio::sync::Mutex::new(current),
            prefix,
            granted_ttl_ms: Mutex::new(HashMap::new()),
            grant_retention_ms,
            retention: tokio::sync::Mutex::new(None),
            heartbeats: Heartbeats::default(),
            raft_term: Mutex::new(None),
            session_metrics,
        })
    }

    async fn client(&self) -> (usize, Client) {
        let current = self.current.lock().await;
        (current.0, current.1.clone())
    }

    /// Moves to the next member that accepts a connection, unless another call already moved.
    async fn fail_over(&self, failed: usize) {
        let mut current = self.current.lock().await;
        if current.0 != failed {
            return;
        }
        for step in 1..=self.endpoints.len() {
            let next = (failed + step) % self.endpoints.len();
            if let Ok(c) = connect_one(&self.endpoints[next], &self.tls).await {
                tracing::warn!(from = %self.endpoints[failed], to = %self.endpoints[next], "etcd endpoint failed over");
                *current = (next, c);
                return;
            }
        }
    }

    /// One bounded call. A member that is down or silent moves this process to another member;
    /// the call is retried there only when the request certainly never left (the connection was
    /// refused), because a retried write that did land would be applied twice. A request etcd
    /// refused because its users or roles changed while it was in flight
    /// (`mtls::etcd_access::AUTH_REVISION_OLD`: nothing was applied) is sent again, a bounded
    /// number of times.
    async fn call<T, F, Fut>(&self, session_id: Option<&str>, f: F) -> Result<T, LockError>
    where
        F: Fn(Client) -> Fut,
        Fut: std::future::Future<Output = Result<T, etcd_client::Error>>,
    {
        let mut attempts = 1;
        let mut auth_attempts = 1;
        loop {
            let (index, client) = self.client().await;
            match tokio::time::timeout(Duration::from_millis(REQUEST_TIMEOUT_MS), f(client)).await {
                Ok(Ok(v)) => return Ok(v),
                Err(_) => {
                    self.fail_over(index).await;
                    return Err(backend_err(format!(
                        "no answer within {REQUEST_TIMEOUT_MS} ms"
                    )));
                }
                Ok(Err(e)) => {
                    let (unavailable, never_sent) = match &e {
                        etcd_client::Error::GRpcStatus(s)
                            if s.code() == tonic::Code::Unavailable =>
                        {
                            (true, s.message().contains("connect"))
                        }
                        etcd_client::Error::TransportError(_) => (true, false),
                        _ => (false, false),
                    };
                    if unavailable {
                        self.fail_over(index).await;
                        if never_sent && attempts < self.endpoints.len() {
                            attempts += 1;
                            continue;
                        }
                    }
                    if mtls::etcd_access::is_auth_revision_old(&e.to_string())
                        && auth_attempts < mtls::etcd_access::AUTH_REVISION_OLD_ATTEMPTS_MAX
                    {
                        auth_attempts += 1;
                        continue;
                    }
                    return Err(map_err(e, session_id));
                }
            }
        }
    }

    fn lock_key(&self, key: &str) -> String {
        format!("{}locks/{key}", self.prefix)
    }

    /// `{prefix}grants/{key}/{uuid}`: one record per minted grant, kept for the retention window
    /// (see `try_acquire`).
    pub fn grants_prefix(&self) -> String {
        format!("{}grants/", self.prefix)
    }

    /// `{prefix}retention/`: one [`RetentionMarker`] per live retention lease.
    pub fn retention_prefix(&self) -> String {
        format!("{}retention/", self.prefix)
    }

    pub fn grant_retention_ms(&self) -> u64 {
        self.grant_retention_ms
    }

    /// How long one retention lease takes new records.
    fn rotation_ms(&self) -> u64 {
        self.grant_retention_ms / RETENTION_LEASES_PER_WINDOW
    }

    /// The retention lease for a record written now: the current one, or a new one once the
    /// current one has taken records for a rotation period.
    async fn retention_lease(&self) -> Result<i64, LockError> {
        let mut current = self.retention.lock().await;
        if let Some(lease) = *current {
            if lease.made.elapsed() < Duration::from_millis(self.rotation_ms()) {
                return Ok(lease.id);
            }
        }
        let id = self.new_retention_lease().await?;
        *current = Some(RetentionLease {
            id,
            made: Instant::now(),
        });
        drop(current);
        self.sweep_retention_leases().await;
        Ok(id)
    }

    /// Forgets `id` as the current retention lease (it is gone: revoked by an operator, or lost
    /// to a restore), so the next grant makes a new one.
    async fn forget_retention_lease(&self, id: i64) {
        let mut current = self.retention.lock().await;
        if current.is_some_and(|lease| lease.id == id) {
            *current = None;
        }
    }

    async fn new_retention_lease(&self) -> Result<i64, LockError> {
        let lifetime_ms = self.grant_retention_ms + self.rotation_ms();
        let ttl_s = lifetime_ms.div_ceil(1000) as i64;
        let id = self.grant_lease(ttl_s).await?.id();
        let created_unix_ms = unix_now_ms();
        let marker = RetentionMarker {
            lease_id: id,
            created_unix_ms,
            expires_unix_ms: created_unix_ms + lifetime_ms as i64,
        };
        let key = format!("{}{id}", self.retention_prefix());
        let value = serde_json::to_string(&marker).expect("marker serializes");
        self.call(None, |mut c| {
            let (key, value) = (key.clone(), value.clone());
            async move {
                c.put(key, value, Some(PutOptions::new().with_lease(id)))
                    .await
            }
        })
        .await?;
        tracing::info!(
            lease_id = id,
            ttl_s,
            grant_retention_ms = self.grant_retention_ms,
            "grant-record retention lease made"
        );
        Ok(id)
    }

    /// Revokes every retention lease (of any lock-server sharing the prefix) whose marker says it
    /// has outlived window + rotation period, deleting its grant records. etcd would expire it
    /// itself, but etcd 3.4 restarts a lease's TTL on every leader change, so without this a
    /// cluster that elects a leader more often than once a window would keep records forever.
    /// Best effort: a failure is logged and the next rotation sweeps again.
    async fn sweep_retention_leases(&self) {
        let prefix = self.retention_prefix();
        let got = match self
            .call(None, |mut c| {
                let prefix = prefix.clone();
                async move { c.get(prefix, Some(GetOptions::new().with_prefix())).await }
            })
            .await
        {
            Ok(got) => got,
            Err(e) => {
                tracing::warn!(error = %e, "retention sweep: reading the markers failed");
                return;
            }
        };
        let now = unix_now_ms();
        for kv in got.kvs() {
            let Ok(marker) = serde_json::from_slice::<RetentionMarker>(kv.value()) else {
                continue;
            };
            if marker.expires_unix_ms > now {
                continue;
            }
            let lease = marker.lease_id;
            match self
                .call(None, |mut c| async move { c.lease_revoke(lease).await })
                .await
            {
                Ok(_) => tracing::info!(
                    lease_id = lease,
                    created_unix_ms = marker.created_unix_ms,
                    "grant records past their retention window deleted (retention lease revoked)"
                ),
                Err(e) => {
                    tracing::warn!(lease_id = lease, error = %e, "retention sweep: revoke failed")
                }
            }
        }
    }

    async fn grant_lease(&self, ttl_s: i64) -> Result<etcd_client::LeaseGrantResponse, LockError> {
        let r = self
            .call(
                None,
                |mut c| async move { c.lease_grant(ttl_s, None).await },
            )
            .await?;
        if !r.error().is_empty() {
            return Err(backend_err(r.error()));
        }
        Ok(r)
    }

    /// Whether a lease still exists (etcd answers TTL -1 for a lease it does not know).
    async fn lease_alive(&self, lease: i64) -> Result<bool, LockError> {
        let r = self
            .call(None, |mut c| async move {
                c.lease_time_to_live(lease, None).await
            })
            .await?;
        Ok(r.ttl() > 0)
    }

    fn encode(owner: &str, session_id: &str) -> String {
        serde_json::to_string(&Entry {
            owner: owner.to_string(),
            session_id: session_id.to_string(),
        })
        .expect("entry serializes")
    }

    fn decode(value: &[u8]) -> Entry {
        // A value this server did not write is reported as an unknown holder, never as ours.
        serde_json::from_slice(value).unwrap_or(Entry {
            owner: "<unknown>".into(),
            session_id: String::new(),
        })
    }

    fn cached_ttl_ms(&self, lease: i64) -> Option<u64> {
        self.granted_ttl_ms
            .lock()
            .expect("ttl cache")
            .get(&lease)
            .copied()
    }

    async fn granted_ttl(&self, lease: i64) -> Result<u64, LockError> {
        if let Some(ttl) = self.cached_ttl_ms(lease) {
            return Ok(ttl);
        }
        let r = self
            .call(None, |mut c| async move {
                c.lease_time_to_live(lease, None).await
            })
            .await?;
        if r.ttl() <= 0 {
            return Err(LockError::SessionNotFound {
                session_id: lease.to_string(),
            });
        }
        let ttl = r.granted_ttl() as u64 * 1000;
        self.granted_ttl_ms
            .lock()
            .expect("ttl cache")
            .insert(lease, ttl);
        Ok(ttl)
    }

    /// The lease's remaining and granted TTL as etcd reports them, for introspection (whole
    /// seconds, the remaining one rounded down by etcd).
    async fn lease_ttl(&self, lease: i64) -> Result<(Duration, Duration), LockError> {
        let r = self
            .call(None, |mut c| async move {
                c.lease_time_to_live(lease, None).await
            })
            .await?;
        Ok((
            Duration::from_secs(r.ttl().max(0) as u64),
            Duration::from_secs(r.granted_ttl().max(0) as u64),
        ))
    }

    pub async fn create_session(
        &self,
        _owner: &str,
        ttl_ms: u64,
    ) -> Result<SessionGrant, LockError> {
        let ttl_s = ttl_ms.div_ceil(1000).max(1) as i64;
        let r = self.grant_lease(ttl_s).await?;
        let ttl_ms = r.ttl() as u64 * 1000;
        self.granted_ttl_ms
            .lock()
            .expect("ttl cache")
            .insert(r.id(), ttl_ms);
        self.heartbeats
            .beat(&r.id().to_string(), Duration::from_millis(ttl_ms));
        Ok(SessionGrant {
            session_id: r.id().to_string(),
            ttl_ms,
        })
    }

    pub async fn keep_alive(&self, session_id: &str) -> Result<u64, LockError> {
        let lease = parse_lease(session_id)?;
        // One request on a fresh keep-alive stream: the stream's first answer is the refresh.
        self.call(Some(session_id), |mut c| async move {
            c.lease_keep_alive(lease).await.map(|_| ())
        })
        .await?;
        let ttl_ms = self.granted_ttl(lease).await?;
        self.heartbeats
            .beat(session_id, Duration::from_millis(ttl_ms));
        Ok(ttl_ms)
    }

    /// Whether each handle holds its key now: one transaction of reads per
    /// [`VOUCH_READS_PER_TXN`] handles (etcd's own cap on a transaction's operations is 128).
    pub async fn held_among(&self, handles: &[HandleRef]) -> Result<Vec<bool>, LockError> {
        let mut held = Vec::with_capacity(handles.len());
        for chunk in handles.chunks(VOUCH_READS_PER_TXN) {
            let txn = Txn::new().and_then(
                chunk
                    .iter()
                    .map(|h| TxnOp::get(self.lock_key(&h.key), None))
                    .collect::<Vec<_>>(),
            );
            let resp = self
                .call(None, |mut c| {
                    let txn = txn.clone();
                    async move { c.txn(txn).await }
                })
                .await?;
            let answers = resp.op_responses();
            for (h, answer) in chunk.iter().zip(answers) {
                let kv = match answer {
                    TxnOpResponse::Get(g) => g.kvs().first().cloned(),
                    _ => None,
                };
                held.push(kv.is_some_and(|kv| {
                    let entry = Self::decode(kv.value());
                    kv.create_revision() as u64 == h.token
                        && entry.owner == h.owner
                        && entry.session_id == h.session_id
                }));
            }
        }
        Ok(held)
    }

    pub async fn close_session(&self, session_id: &str) -> Result<Vec<String>, LockError> {
        let lease = parse_lease(session_id)?;
        let keys = match self
            .call(None, |mut c| async move {
                c.lease_time_to_live(lease, Some(LeaseTimeToLiveOptions::new().with_keys()))
                    .await
            })
            .await
        {
            Ok(r) => r
                .keys()
                .iter()
                .filter_map(|k| String::from_utf8(k.clone()).ok())
                .filter_map(|k| {
                    k.strip_prefix(&format!("{}locks/", self.prefix))
                        .map(str::to_string)
                })
                .collect(),
            Err(_) => Vec::new(),
        };
        // Out of the view before the lease goes, so the sweep never takes the close for an
        // expiry (a session kept alive again through this process comes back into it).
        self.heartbeats.forget(session_id);
        // Revoking the lease deletes every key attached to it in one raft entry.
        match self
            .call(Some(session_id), |mut c| async move {
                c.lease_revoke(lease).await
            })
            .await
        {
            Ok(_) | Err(LockError::SessionNotFound { .. }) => {}
            Err(e) => return Err(e),
        }
        self.granted_ttl_ms
            .lock()
            .expect("ttl cache")
            .remove(&lease);
        Ok(keys)
    }

    pub async fn try_acquire(
        &self,
        key: &str,
        owner: &str,
        session_id: &str,
    ) -> Result<Attempt, LockError> {
        let lease = parse_lease(session_id)?;
        let k = self.lock_key(key);
        // Every minted grant also leaves a record in the same transaction, so its create revision
        // is the token: the reconciler's evidence that a token presented at a guard was really
        // issued (INV-07's detective control). Records are attached to a retention lease, so etcd
        // deletes them once the retention window (the reconciler's horizon) has passed.
        let grant_record = format!("{}{key}/{}", self.grants_prefix(), uuid::Uuid::new_v4());
        let mut retention = self.retention_lease().await?;
        let mut retried = false;
        let resp = loop {
            let txn = Txn::new()
                .when([Compare::create_revision(k.clone(), CompareOp::Equal, 0)])
                .and_then([
                    TxnOp::put(
                        k.clone(),
                        Self::encode(owner, session_id),
                        Some(PutOptions::new().with_lease(lease)),
                    ),
                    TxnOp::put(
                        grant_record.clone(),
                        Self::encode(owner, session_id),
                        Some(PutOptions::new().with_lease(retention)),
                    ),
                ])
                .or_else([TxnOp::get(k.clone(), None)]);
            match self
                .call(Some(session_id), |mut c| {
                    let txn = txn.clone();
                    async move { c.txn(txn).await }
                })
                .await
            {
                Ok(resp) => break resp,
                // etcd refuses the whole transaction when either lease is unknown. If it is the
                // retention lease (revoked by an operator, or lost to a restore), make a new one
                // and try once more; the session's loss is the caller's to handle.
                Err(e @ LockError::SessionNotFound { .. }) => {
                    if retried || self.lease_alive(retention).await? {
                        return Err(e);
                    }
                    tracing::warn!(
                        lease_id = retention,
                        "grant-record retention lease is gone; making a new one"
                    );
                    self.forget_retention_lease(retention).await;
                    retention = self.retention_lease().await?;
                    retried = true;
                }
                Err(e) => return Err(e),
            }
        };
        let revision = resp.header().map(|h| h.revision()).unwrap_or_default();
        let ttl_ms = self.granted_ttl(lease).await?;
        if resp.succeeded() {
            return Ok(Attempt::Granted(GrantInfo {
                key: key.to_string(),
                owner: owner.to_string(),
                session_id: session_id.to_string(),
                token: revision as u64,
                server_expiry_unix_ms: unix_now_ms() + ttl_ms as i64,
                ttl_ms,
                minted: true,
            }));
        }
        let kv = resp.op_responses().into_iter().find_map(|r| match r {
            TxnOpResponse::Get(g) => g.kvs().first().cloned(),
            _ => None,
        });
        let Some(kv) = kv else {
            // The compare said the key exists and the same transaction's read says it does not:
            // impossible in one etcd transaction, so stop loudly rather than guess.
            return Err(backend_err("etcd transaction compare and read disagree"));
        };
        let entry = Self::decode(kv.value());
        if entry.owner == owner && entry.session_id == session_id && kv.lease() == lease {
            return Ok(Attempt::Granted(GrantInfo {
                key: key.to_string(),
                owner: owner.to_string(),
                session_id: session_id.to_string(),
                token: kv.create_revision() as u64,
                server_expiry_unix_ms: unix_now_ms() + ttl_ms as i64,
                ttl_ms,
                minted: false,
            }));
        }
        Ok(Attempt::Held {
            holder: Holder {
                owner: entry.owner,
                session_id: entry.session_id,
                token: kv.create_revision() as u64,
                server_expiry_unix_ms: 0,
                session_state: None,
            },
            wait_from: WaitFrom::Revision(revision),
        })
    }

    /// Watches the key for a deletion after the revision at which it was seen held. Returns at the
    /// deadline, on a deletion, or when the watch cannot tell (an error, a cancel, a compacted start
    /// revision): the caller then attempts again, which reads the current state.
    pub async fn wait_for_release(
        &self,
        key: &str,
        from: &WaitFrom,
        deadline: Instant,
    ) -> Result<(), LockError> {
        let WaitFrom::Revision(revision) = from else {
            return Ok(());
        };
        let options = WatchOptions::new()
            .with_start_revision(revision + 1)
            .with_filters([WatchFilterType::NoPut]);
        let (index, mut c) = self.client().await;
        let deadline = tokio::time::Instant::from_std(deadline);
        let mut stream = tokio::select! {
            _ = tokio::time::sleep_until(deadline) => return Ok(()),
            s = c.watch(self.lock_key(key), Some(options)) => match s {
                Ok(s) => s,
                // The caller re-attempts (through another member); a waiter is not an error.
                Err(_) => {
                    self.fail_over(index).await;
                    return Ok(());
                }
            },
        };
        loop {
            tokio::select! {
                _ = tokio::time::sleep_until(deadline) => return Ok(()),
                message = stream.message() => match message {
                    Ok(Some(resp)) => {
                        if resp.compact_revision() > 0 {
                            // etcd compacted the history this watch was to start from (auto-
                            // compaction ran between the attempt and the watch): a release in
                            // between can no longer be replayed, so the caller reads the current
                            // state again (a fresh attempt) instead of waiting for an event that
                            // will never come.
                            tracing::debug!(key, from_revision = revision + 1, compact_revision = resp.compact_revision(), "watch start compacted; reading the key again");
                            return Ok(());
                        }
                        if resp.canceled() || resp.events().iter().any(|e| e.event_type() == EventType::Delete) {
                            return Ok(());
                        }
                    }
                    Ok(None) => return Ok(()),
                    Err(_) => {
                        self.fail_over(index).await;
                        return Ok(());
                    }
                },
            }
        }
    }

    fn holder_compare(&self, handle: &HandleRef) -> Vec<Compare> {
        let k = self.lock_key(&handle.key);
        vec![
            Compare::create_revision(k.clone(), CompareOp::Equal, handle.token as i64),
            Compare::value(
                k,
                CompareOp::Equal,
                Self::encode(&handle.owner, &handle.session_id),
            ),
        ]
    }

    fn not_holder(handle: &HandleRef, resp: &etcd_client::TxnResponse) -> LockError {
        let current_token = resp
            .op_responses()
            .into_iter()
            .find_map(|r| match r {
                TxnOpResponse::Get(g) => g.kvs().first().map(|kv| kv.create_revision() as u64),
                _ => None,
            })
            .unwrap_or(0);
        LockError::NotHolder {
            key: handle.key.clone(),
            presented_owner: handle.owner.clone(),
            presented_session_id: handle.session_id.clone(),
            presented_token: handle.token,
            current_token,
        }
    }

    pub async fn renew(&self, handle: &HandleRef) -> Result<GrantInfo, LockError> {
        let lease = parse_lease(&handle.session_id)?;
        let k = self.lock_key(&handle.key);
        let txn = Txn::new()
            .when(self.holder_compare(handle))
            .or_else([TxnOp::get(k, None)]);
        let resp = self
            .call(Some(&handle.session_id), |mut c| {
                let txn = txn.clone();
                async move { c.txn(txn).await }
            })
            .await?;
        if !resp.succeeded() {
            return Err(Self::not_holder(handle, &resp));
        }
        // The key is attached to the lease, so extending the lease is extending the grant.
        let ttl_ms = self.keep_alive(&handle.session_id).await?;
        let _ = lease;
        Ok(GrantInfo {
            key: handle.key.clone(),
            owner: handle.owner.clone(),
            session_id: handle.session_id.clone(),
            token: handle.token,
            server_expiry_unix_ms: unix_now_ms() + ttl_ms as i64,
            ttl_ms,
            minted: false,
        })
    }

    pub async fn release(&self, handle: &HandleRef) -> Result<(), LockError> {
        parse_lease(&handle.session_id)?;
        let k = self.lock_key(&handle.key);
        let txn = Txn::new()
            .when(self.holder_compare(handle))
            .and_then([TxnOp::delete(k.clone(), None)])
            .or_else([TxnOp::get(k, None)]);
        let resp = self
            .call(None, |mut c| {
                let txn = txn.clone();
                async move { c.txn(txn).await }
            })
            .await?;
        if !resp.succeeded() {
            return Err(Self::not_holder(handle, &resp));
        }
        Ok(())
    }

    /// Deletes `key`'s holder and appends the force-revoke's audit record to the chain
    /// (`grant_signing::audit_chain`): the record at `{prefix}audit/{seq:020}`, linked to the
    /// head's hash, and the head moved to it, in one transaction with the delete. The transaction
    /// compares the key's mod revision (the holder read is the one revoked), the head's (or its
    /// absence for the first record: two revokes at once cannot both take a seq) and the record
    /// key's absence (nothing is ever written over). A holder that moved in between is read
    /// again at most [`REVOKE_ATTEMPTS_MAX`] times, a head another revoke moved at most
    /// [`AUDIT_APPEND_ATTEMPTS_MAX`] times. A chain that is not consistent where it
    /// is appended to (a head missing or unreadable while records exist, a record already at the
    /// next seq) is refused, not repaired: that is tampering, and the reconciler's
    /// `lock_audit_chain_intact` names it.
    pub async fn force_revoke(
        &self,
        key: &str,
        expected_token: Option<u64>,
        operator: &str,
        reason: &str,
    ) -> Result<Holder, LockError> {
        let k = self.lock_key(key);
        let head_key = audit_chain::head_key(&self.prefix);
        let (mut holder_changes, mut head_changes) = (0, 0);
        while holder_changes < REVOKE_ATTEMPTS_MAX && head_changes < AUDIT_APPEND_ATTEMPTS_MAX {
            // The holder and the chain's head, read in one snapshot.
            let read = Txn::new().and_then([
                TxnOp::get(k.clone(), None),
                TxnOp::get(head_key.clone(), None),
            ]);
            let got = self
                .call(None, |mut c| {
                    let read = read.clone();
                    async move { c.txn(read).await }
                })
                .await?;
            let [holder_kv, head_kv] = Self::first_kvs(&got);
            let Some(kv) = holder_kv else {
                return Err(LockError::NotHeld {
                    key: key.to_string(),
                });
            };
            let (seq, prev, head_compare) = match &head_kv {
                Some(h) => {
                    let head = serde_json::from_slice::<audit_chain::Head>(h.value())
                        .ok()
                        .and_then(|head| Some((head.seq, audit_chain::from_hex(&head.hash)?)))
                        .ok_or_else(|| {
                            Self::chain_broken(format!("its head {head_key} is unreadable"))
                        })?;
                    (
                        head.0 + 1,
                        head.1,
                        Compare::mod_revision(head_key.clone(), CompareOp::Equal, h.mod_revision()),
                    )
                }
                None => (
                    1,
                    audit_chain::genesis(),
                    Compare::version(head_key.clone(), CompareOp::Equal, 0),
                ),
            };
            let entry = Self::decode(kv.value());
            let token = kv.create_revision() as u64;
            if let Some(expected) = expected_token.filter(|expected| *expected != token) {
                return Err(LockError::HolderChanged {
                    key: key.to_string(),
                    expected_token: expected,
                    current_token: token,
                });
            }
            let record = audit_chain::Record::chained(
                seq,
                &prev,
                "force_revoke",
                key,
                &entry.owner,
                &entry.session_id,
                token,
                operator,
                reason,
                unix_now_ms(),
            );
            let head = audit_chain::Head {
                seq,
                hash: record.hash.clone(),
            };
            let record_key = audit_chain::record_key(&self.prefix, seq);
            // Delete and audit in one transaction: there is no revocation without its record. The
            // holder's mod revision as read (so its create revision, the token checked above:
            // the expected grant, when one is expected) is compared in the same transaction; a
            // holder that changed since is read again, and a later grant is refused above.
            let txn = Txn::new()
                .when([
                    Compare::mod_revision(k.clone(), CompareOp::Equal, kv.mod_revision()),
                    Compare::create_revision(k.clone(), CompareOp::Equal, kv.create_revision()),
                    head_compare,
                    Compare::version(record_key.clone(), CompareOp::Equal, 0),
                ])
                .and_then([
                    TxnOp::delete(k.clone(), None),
                    TxnOp::put(
                        record_key.clone(),
                        serde_json::to_string(&record).expect("audit record serializes"),
                        None,
                    ),
                    TxnOp::put(
                        head_key.clone(),
                        serde_json::to_string(&head).expect("audit head serializes"),
                        None,
                    ),
                ])
                .or_else([
                    TxnOp::get(k.clone(), None),
                    TxnOp::get(head_key.clone(), None),
                    TxnOp::get(record_key.clone(), None),
                ]);
            let resp = self
                .call(None, |mut c| {
                    let txn = txn.clone();
                    async move { c.txn(txn).await }
                })
                .await?;
            if resp.succeeded() {
                return Ok(Holder {
                    owner: entry.owner,
                    session_id: entry.session_id,
                    token,
                    server_expiry_unix_ms: 0,
                    session_state: None,
                });
            }
            // Which compare failed: a holder or a head that moved is read again; a record already
            // at the next seq is not ours to write over.
            let [holder_now, head_now, record_now] = Self::first_kvs(&resp);
            let holder_moved = holder_now.is_none_or(|now| now.mod_revision() != kv.mod_revision());
            let head_moved = match (&head_kv, &head_now) {
                (Some(before), Some(now)) => now.mod_revision() != before.mod_revision(),
                (None, None) => false,
                _ => true,
            };
            if holder_moved {
                holder_changes += 1;
            } else if head_moved {
                head_changes += 1;
            } else if record_now.is_some() {
                return Err(Self::chain_broken(format!(
                    "a record already sits at {record_key} while the head {}",
                    match head_kv {
                        Some(_) => format!("is at seq {}", seq - 1),
                        None => "is missing".to_string(),
                    }
                )));
            } else {
                // No compare's key moved by its answer: counted like a holder change, so the loop
                // still ends.
                holder_changes += 1;
            }
        }
        Err(backend_err(if holder_changes == REVOKE_ATTEMPTS_MAX {
            "the holder kept changing during force-revoke; try again"
        } else {
            "other force-revokes kept advancing the audit chain during force-revoke; try again"
        }))
    }

    /// The first key-value of each of the first `N` range reads of a transaction's answer.
    fn first_kvs<const N: usize>(
        resp: &etcd_client::TxnResponse,
    ) -> [Option<etcd_client::KeyValue>; N] {
        let mut gets = resp.op_responses().into_iter().filter_map(|r| match r {
            TxnOpResponse::Get(g) => Some(g.kvs().first().cloned()),
            _ => None,
        });
        std::array::from_fn(|_| gets.next().flatten())
    }

    /// Force-revoke refuses to append to an audit chain that is not consistent where it would
    /// append: logged at alert level, the operator told why.
    fn chain_broken(what: String) -> LockError {
        tracing::error!(
            event = "audit_chain_broken",
            backend = BACKEND,
            what,
            "the force-revoke audit chain was tampered with: force-revoke refused (see the reconciler's lock_audit_chain_intact)"
        );
        backend_err(format!(
            "the force-revoke audit chain is not consistent ({what}); nothing was revoked: \
             the reconciler's lock_audit_chain_intact names the break"
        ))
    }

    pub async fn describe(&self, key: &str) -> Result<Option<Holder>, LockError> {
        let k = self.lock_key(key);
        let got = self
            .call(None, |mut c| {
                let k = k.clone();
                async move { c.get(k, None::<GetOptions>).await }
            })
            .await?;
        let Some(kv) = got.kvs().first().cloned() else {
            return Ok(None);
        };
        let entry = Self::decode(kv.value());
        let (server_expiry_unix_ms, session_state) =
            match self.lease_ttl(kv.lease()).await {
                Ok((remaining, granted)) => (
                    unix_now_ms() + remaining.as_millis() as i64,
                    // The key exists, so etcd still holds its lease: ACTIVE or SUSPECT. A session
                    // this process has not answered a keep-alive for is judged by what is left of
                    // its TTL (whole seconds).
                    Some(self.heartbeats.state(&entry.session_id).unwrap_or_else(|| {
                        self.heartbeats.state_from_remaining(granted, remaining)
                    })),
                ),
                Err(_) => (0, self.heartbeats.state(&entry.session_id)),
            };
        Ok(Some(Holder {
            owner: entry.owner,
            session_id: entry.session_id,
            token: kv.create_revision() as u64,
            server_expiry_unix_ms,
            session_state,
        }))
    }

    /// The session view (spec 2.4) of every session this process follows, and the election
    /// probe: a higher raft term with a leader means a new leader, whose lessor renewed every
    /// lease to its full TTL plus an election timeout (etcd's `Promote`), so every session is
    /// shown ACTIVE for one TTL from now. A session etcd no longer lists is EXPIRED.
    pub async fn sessions_view(&self) -> Result<Vec<(String, SessionState)>, LockError> {
        if let Ok(status) = self
            .call(None, |mut c| async move { c.status().await })
            .await
        {
            self.observe_term(status.leader(), status.raft_term());
        }
        let asked_at = Instant::now();
        let listed = self
            .call(None, |mut c| async move { c.leases().await })
            .await?;
        let alive: std::collections::HashSet<i64> =
            listed.leases().iter().map(|l| l.id()).collect();
        self.granted_ttl_ms
            .lock()
            .expect("ttl cache")
            .retain(|lease, _| alive.contains(lease));
        Ok(self.heartbeats.sweep(
            |id| id.parse::<i64>().is_ok_and(|lease| alive.contains(&lease)),
            asked_at,
        ))
    }

    fn observe_term(&self, leader: u64, term: u64) {
        if leader == 0 {
            return;
        }
        let mut last = self.raft_term.lock().expect("raft term");
        let elected = last.is_some_and(|t| term > t);
        if last.is_none_or(|t| term > t) {
            *last = Some(term);
        }
        drop(last);
        if elected {
            self.heartbeats.start_grace(Instant::now());
            let sessions = self.heartbeats.tracked() as u64;
            tracing::warn!(
                event = "grace_period",
                backend = BACKEND,
                cause = "leader_elected",
                raft_term = term,
                leader = format!("{leader:x}"),
                sessions,
                "etcd elected a new leader: its lessor renewed every lease to its full TTL, so every session is ACTIVE for one full TTL (grace period)"
            );
            self.session_metrics
                .grace(BACKEND, "leader_elected", sessions);
        }
    }

    /// The audit records written by force-revoke, oldest first (tests and operators): each an
    /// `audit_chain::Record` (seq, the revoke's fields, prev_hash, hash). The head
    /// (`{prefix}audit-head`) is outside this prefix.
    pub async fn audit_records(&self) -> Result<Vec<serde_json::Value>, LockError> {
        let k = audit_chain::records_prefix(&self.prefix);
        let got = self
            .call(None, |mut c| {
                let k = k.clone();
                async move { c.get(k, Some(GetOptions::new().with_prefix())).await }
            })
            .await?;
        let mut records: Vec<(i64, serde_json::Value)> = got
            .kvs()
            .iter()
            .filter_map(|kv| {
                serde_json::from_slice(kv.value())
                    .ok()
                    .map(|v| (kv.create_revision(), v))
            })
            .collect();
        records.sort_by_key(|(rev, _)| *rev);
        Ok(records.into_iter().map(|(_, v)| v).collect())
    }

    pub async fn ping(&self) -> bool {
        self.call(None, |mut c| async move { c.status().await })
            .await
            .is_ok()
    }
}
