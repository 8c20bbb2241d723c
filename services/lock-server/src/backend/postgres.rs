//! PostgreSQL backend (`lockdb`). A session is a `lock_session` row whose expiry the database's
//! clock decides; a lock is a `lock_entry` row; tokens come from `lock_token_seq`, never reset.
//! Acquire is one conditional statement. Waiters are woken by `NOTIFY lock_released` (sent in the
//! same statement as every delete) or at the holder's expiry as the database computed it.
//!
//! The grace period (spec 2.4): lockdb's clock runs on through an outage while no client can keep
//! alive, so without it every session whose expiry fell inside the outage would be gone the moment
//! lockdb answers again. An outage is noticed by a failed call, the release listener losing its
//! connection, or the sweep's probe going unanswered; the first connection taken after it runs
//! `GRACE_SQL` before any call is answered: every session alive at the last contact before the
//! outage gets one full TTL from the database's clock.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, LazyLock, Mutex};
use std::time::{Duration, Instant};

use sqlx::pool::PoolConnection;
use sqlx::{PgPool, Postgres, Row};
use tokio::sync::broadcast;

use super::{Attempt, GrantInfo, HandleRef, Holder, SessionGrant, WaitFrom};
use crate::error::LockError;
use crate::session::{self, SessionMetrics, SessionState};

const BACKEND: &str = "postgres";
/// The NOTIFY channel; the payload is the released key.
pub const RELEASE_CHANNEL: &str = "lock_released";
/// Notifications buffered per lagging waiter; a waiter that lags simply re-attempts.
pub const NOTIFY_BUFFER: usize = 1024;
/// A waiter woken by the holder's expiry sleeps this much past it, so that the database clock has
/// certainly passed the expiry when the next attempt is evaluated (avoids one wasted attempt).
pub const EXPIRY_SLACK_MS: u64 = 20;
/// A lost listener connection is re-established after this pause, so a database outage does not
/// become a busy reconnect loop.
pub const LISTENER_RECONNECT_MS: u64 = 500;
/// Acquire re-runs its statement when the row it conflicted with vanished or died in between;
/// bounded because each re-run means another client is actively moving the key.
pub const ACQUIRE_ATTEMPTS_MAX: usize = 3;
/// The sweep's probe (`session::SWEEP_MS` apart) that does not answer within this is an outage.
/// Long enough that a loaded database is not taken for a lost one; a lost connection is seen at
/// once anyway (the listener's, or a call's, error).
pub const PROBE_TIMEOUT_MS: u64 = 1_000;

static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("../../migrations/lockdb");

fn backend_err(e: impl std::fmt::Display) -> LockError {
    LockError::Backend {
        backend: BACKEND,
        detail: e.to_string(),
    }
}

/// Whether `e` says the database (or the way to it) is gone, rather than refusing a statement.
fn is_connectivity(e: &sqlx::Error) -> bool {
    match e {
        // admin_shutdown, crash_shutdown, cannot_connect_now (57P0x); connection_exception (08).
        sqlx::Error::Database(d) => d
            .code()
            .is_some_and(|c| c.starts_with("57P") || c.starts_with("08")),
        sqlx::Error::RowNotFound
        | sqlx::Error::TypeNotFound { .. }
        | sqlx::Error::ColumnIndexOutOfBounds { .. }
        | sqlx::Error::ColumnNotFound(_)
        | sqlx::Error::ColumnDecode { .. }
        | sqlx::Error::Decode(_)
        | sqlx::Error::Encode(_)
        | sqlx::Error::Configuration(_)
        | sqlx::Error::Migrate(_) => false,
        _ => true,
    }
}

/// What the lock-server knows of its contact with lockdb: an outage seen and not yet recovered
/// from, and the database's clock at the last contact before it.
struct Contact {
    state: Mutex<ContactState>,
    /// Held while the grace statement runs: one recovery, every other call waits for it.
    recovering: tokio::sync::Mutex<()>,
    /// TEST ONLY switch (the grace period's negative control): off, lockdb's return gives no
    /// grace period and every session whose `expires_at` passed during the outage is gone.
    grace_enabled: AtomicBool,
}

#[derive(Default)]
struct ContactState {
    /// The database clock (µs since the epoch) at the last successful probe.
    last_seen_us: Option<i64>,
    outage: Option<Outage>,
}

#[derive(Debug, Clone, Copy)]
struct Outage {
    since: Instant,
    /// `last_seen_us` when the outage began: sessions alive then are the ones the grace covers.
    last_seen_us: Option<i64>,
}

impl Contact {
    fn lost(&self, why: &str) {
        let mut state = self.state.lock().expect("contact");
        if state.outage.is_none() {
            tracing::warn!(
                backend = BACKEND,
                why,
                "lockdb unreachable: an outage begins (a grace period follows its end)"
            );
            state.outage = Some(Outage {
                since: Instant::now(),
                last_seen_us: state.last_seen_us,
            });
        }
    }

    fn seen(&self, now_us: i64) {
        let mut state = self.state.lock().expect("contact");
        if state.outage.is_none() {
            state.last_seen_us = Some(now_us);
        }
    }

    fn outage(&self) -> Option<Outage> {
        self.state.lock().expect("contact").outage
    }
}

fn parse_session(session_id: &str) -> Result<i64, LockError> {
    session_id
        .parse::<i64>()
        .ok()
        .filter(|id| *id > 0)
        .ok_or_else(|| LockError::invalid("session_id", "must be a positive decimal session id"))
}

pub struct PgBackend {
    pool: PgPool,
    released: broadcast::Sender<String>,
    _listener: tokio::task::JoinHandle<()>,
    contact: Arc<Contact>,
    session_metrics: SessionMetrics,
}

impl Drop for PgBackend {
    fn drop(&mut self) {
        self._listener.abort();
    }
}

/// The acquire: a free key is inserted; a taken key is taken over only on proof that its holder's
/// session is dead. Under READ COMMITTED the unique index and the ON CONFLICT row lock arbitrate
/// on the key's newest committed row, even one the statement's snapshot cannot see, but every
/// subquery reads that snapshot. So the takeover asks for a session that is EXPIRED or CLOSED
/// (both final: a snapshot that shows one is never stale in the direction that matters), never
/// for the absence of an ACTIVE one: a holder whose session was created after the snapshot is
/// absent from it, and reading absence as death took live keys (issue 35, item 6; two live
/// holders, the later one with the lower token: `tests/pg_acquire_race.rs`). Such a holder is
/// taken as alive: no row comes back and `try_acquire`'s re-read (a new snapshot) names it. A
/// holder whose lease ran out is taken over here too: `expired`'s UPDATE locks its session row and
/// re-checks it in its newest version (EvalPlanQual) before the takeover relies on it.
const ACQUIRE_SQL: &str = r#"
WITH expired AS (
    UPDATE lock_session s SET state = 'EXPIRED', ended_at = clock_timestamp()
    FROM lock_entry e
    WHERE e.key = $1 AND s.session_id = e.session_id AND s.state = 'ACTIVE'
      AND s.expires_at <= clock_timestamp()
    RETURNING s.session_id
),
me AS (
    SELECT s.session_id FROM lock_session s
    WHERE s.session_id = $3 AND s.state = 'ACTIVE' AND s.expires_at > clock_timestamp()
      AND NOT EXISTS (SELECT 1 FROM lock_entry e WHERE e.key = $1 AND e.session_id = $3 AND e.owner = $2)
)
INSERT INTO lock_entry AS cur (key, owner, session_id, token, acquired_at)
SELECT $1, $2, me.session_id, nextval('lock_token_seq'), clock_timestamp() FROM me
ON CONFLICT (key) DO UPDATE
    SET owner = EXCLUDED.owner, session_id = EXCLUDED.session_id, token = EXCLUDED.token,
        acquired_at = EXCLUDED.acquired_at
    WHERE cur.session_id IN (SELECT session_id FROM expired)
       OR EXISTS (SELECT 1 FROM lock_session s WHERE s.session_id = cur.session_id AND s.state <> 'ACTIVE')
RETURNING token,
    (SELECT (extract(epoch FROM s.expires_at) * 1000)::bigint FROM lock_session s WHERE s.session_id = $3) AS expires_unix_ms,
    (SELECT s.ttl_ms FROM lock_session s WHERE s.session_id = $3) AS ttl_ms
"#;

static ENTRY_SQL: LazyLock<String> = LazyLock::new(|| {
    format!(
        "SELECT e.owner, e.session_id, e.token, s.ttl_ms, \
                (s.state = 'ACTIVE' AND s.expires_at > clock_timestamp()) AS alive, \
                (extract(epoch FROM s.expires_at) * 1000)::bigint AS expires_unix_ms, \
                GREATEST(0, extract(epoch FROM (s.expires_at - clock_timestamp())) * 1000)::bigint AS remaining_ms, \
                {state} AS session_state \
         FROM lock_entry e JOIN lock_session s ON s.session_id = e.session_id \
         WHERE e.key = $1",
        state = session::sql_state()
    )
});

/// Every live session (and the followed ones, to see them end) with its state.
static SESSIONS_SQL: LazyLock<String> = LazyLock::new(|| {
    format!(
        "SELECT s.session_id, {state} AS session_state FROM lock_session s \
         WHERE (s.state = 'ACTIVE' AND s.expires_at > clock_timestamp()) OR s.session_id = ANY($1)",
        state = session::sql_state()
    )
});

/// The grace period after an outage (spec 2.4), in one statement by the database's clock: every
/// session alive at the lock-server's last contact before the outage ($1, µs since the epoch; NULL
/// if it had none) and not ended since is given one full TTL from now. `grace_until` shows it
/// ACTIVE meanwhile. A session that had already expired before the outage stays expired.
const GRACE_SQL: &str = "\
WITH g AS (
    UPDATE lock_session
    SET expires_at = GREATEST(expires_at, clock_timestamp() + ttl_ms * interval '1 millisecond'),
        grace_until = clock_timestamp() + ttl_ms * interval '1 millisecond'
    WHERE state = 'ACTIVE'
      AND ($1::bigint IS NULL OR expires_at > timestamptz 'epoch' + $1::bigint * interval '1 microsecond')
    RETURNING session_id)
SELECT count(*), (extract(epoch FROM clock_timestamp()) * 1000000)::bigint FROM g";
/// The database clock, µs since the epoch: the probe, and the last contact it records.
const CLOCK_SQL: &str = "SELECT (extract(epoch FROM clock_timestamp()) * 1000000)::bigint";

struct EntryRow {
    owner: String,
    session_id: i64,
    token: i64,
    ttl_ms: i64,
    alive: bool,
    expires_unix_ms: i64,
    remaining_ms: i64,
    session_state: String,
}

impl PgBackend {
    /// Connects, checks that lockdb is at this build's schema (`payoutctl migrate` applies it as
    /// the owner role; this role may not run DDL), and starts the release-notification listener.
    pub async fn connect(
        database_url: &str,
        session_metrics: SessionMetrics,
    ) -> Result<Self, LockError> {
        let pool = service_kit::connect_pg(database_url)
            .await
            .map_err(|e| backend_err(format!("{e:#}")))?;
        db_access::require_schema(&pool, &MIGRATOR, "lockdb")
            .await
            .map_err(backend_err)?;
        let (released, _) = broadcast::channel(NOTIFY_BUFFER);
        let contact = Arc::new(Contact {
            state: Mutex::new(ContactState::default()),
            recovering: tokio::sync::Mutex::new(()),
            grace_enabled: AtomicBool::new(true),
        });
        let listener = tokio::spawn(listen(pool.clone(), released.clone(), contact.clone()));
        let backend = Self {
            pool,
            released,
            _listener: listener,
            contact,
            session_metrics,
        };
        backend.probe().await?;
        Ok(backend)
    }

    /// TEST ONLY (the negative control of the grace period): `false` makes lockdb's return after
    /// an outage give no grace period. No flag or setting of the binary reaches it.
    #[doc(hidden)]
    pub fn set_grace_period_enabled_for_tests(&self, enabled: bool) {
        self.contact.grace_enabled.store(enabled, Ordering::SeqCst);
    }

    /// A statement's error, noting an outage when it says the database is gone.
    fn failed(&self, e: sqlx::Error) -> LockError {
        if is_connectivity(&e) {
            self.contact.lost(&e.to_string());
        }
        backend_err(e)
    }

    /// A connection for one call. After an outage, the first call to get one runs the grace
    /// statement on it before anything else is answered (the others wait for it), so no
    /// keep-alive, acquire or renew is judged against an expiry the outage made pass.
    async fn conn(&self) -> Result<PoolConnection<Postgres>, LockError> {
        let mut conn = self.pool.acquire().await.map_err(|e| self.failed(e))?;
        if self.contact.outage().is_some() {
            self.recover(&mut conn).await?;
        }
        Ok(conn)
    }

    /// lockdb answers again after an outage: the grace period (spec 2.4), once.
    async fn recover(&self, conn: &mut PoolConnection<Postgres>) -> Result<(), LockError> {
        let _one = self.contact.recovering.lock().await;
        let Some(outage) = self.contact.outage() else {
            return Ok(());
        };
        let outage_ms = outage.since.elapsed().as_millis() as u64;
        // One statement: the grace and the clock it was given by, or nothing done.
        let (sessions, now_us) = if self.contact.grace_enabled.load(Ordering::SeqCst) {
            let (n, now_us): (i64, i64) = sqlx::query_as(GRACE_SQL)
                .bind(outage.last_seen_us)
                .fetch_one(&mut **conn)
                .await
                .map_err(|e| self.failed(e))?;
            (Some(n as u64), now_us)
        } else {
            let now_us: i64 = sqlx::query_scalar(CLOCK_SQL)
                .fetch_one(&mut **conn)
                .await
                .map_err(|e| self.failed(e))?;
            (None, now_us)
        };
        {
            let mut state = self.contact.state.lock().expect("contact");
            state.outage = None;
            state.last_seen_us = Some(now_us);
        }
        match sessions {
            Some(sessions) => {
                tracing::warn!(
                    event = "grace_period",
                    backend = BACKEND,
                    cause = "database_back",
                    outage_ms,
                    sessions,
                    "lockdb is back: every session alive before the outage is ACTIVE for one full TTL (grace period)"
                );
                self.session_metrics
                    .grace(BACKEND, "database_back", sessions);
            }
            None => tracing::warn!(
                backend = BACKEND,
                outage_ms,
                "lockdb is back; the grace period is switched off (TEST ONLY)"
            ),
        }
        Ok(())
    }

    /// One probe of lockdb: an outage is noted when it fails or does not answer within
    /// [`PROBE_TIMEOUT_MS`]; the first answer after one runs the grace period.
    pub async fn probe(&self) -> Result<(), LockError> {
        let asked = tokio::time::timeout(
            Duration::from_millis(PROBE_TIMEOUT_MS),
            sqlx::query_scalar::<_, i64>(CLOCK_SQL).fetch_one(&self.pool),
        )
        .await;
        match asked {
            Ok(Ok(now_us)) => {
                if self.contact.outage().is_some() {
                    // Recovers on the connection it takes.
                    self.conn().await?;
                } else {
                    self.contact.seen(now_us);
                }
                Ok(())
            }
            Ok(Err(e)) => Err(self.failed(e)),
            Err(_) => {
                self.contact.lost("probe unanswered");
                Err(backend_err(format!(
                    "no answer within {PROBE_TIMEOUT_MS} ms"
                )))
            }
        }
    }

    /// The session view (spec 2.4): every live session and every one in `followed`, with its
    /// state by the database's clock. Probes first, so lockdb's return is seen here too.
    pub async fn sessions_view(
        &self,
        followed: &[String],
    ) -> Result<Vec<(String, SessionState)>, LockError> {
        self.probe().await?;
        let ids: Vec<i64> = followed.iter().filter_map(|s| s.parse().ok()).collect();
        let mut conn = self.conn().await?;
        let rows: Vec<(i64, String)> = sqlx::query_as(SESSIONS_SQL.as_str())
            .bind(&ids)
            .fetch_all(&mut *conn)
            .await
            .map_err(|e| self.failed(e))?;
        Ok(rows
            .into_iter()
            .filter_map(|(id, state)| Some((id.to_string(), SessionState::parse(&state)?)))
            .collect())
    }

    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    pub fn subscribe(&self) -> broadcast::Receiver<String> {
        self.released.subscribe()
    }

    async fn entry(&self, key: &str) -> Result<Option<EntryRow>, LockError> {
        let mut conn = self.conn().await?;
        let row = sqlx::query(ENTRY_SQL.as_str())
            .bind(key)
            .fetch_optional(&mut *conn)
            .await
            .map_err(|e| self.failed(e))?;
        Ok(row.map(|r| EntryRow {
            owner: r.get("owner"),
            session_id: r.get("session_id"),
            token: r.get("token"),
            ttl_ms: r.get("ttl_ms"),
            alive: r.get("alive"),
            expires_unix_ms: r.get("expires_unix_ms"),
            remaining_ms: r.get("remaining_ms"),
            session_state: r.get("session_state"),
        }))
    }

    pub async fn create_session(
        &self,
        owner: &str,
        ttl_ms: u64,
    ) -> Result<SessionGrant, LockError> {
        let id: i64 = sqlx::query_scalar(
            "INSERT INTO lock_session (owner, ttl_ms, expires_at) \
             VALUES ($1, $2, clock_timestamp() + $2 * interval '1 millisecond') RETURNING session_id",
        )
        .bind(owner)
        .bind(ttl_ms as i64)
        .fetch_one(&mut *self.conn().await?)
        .await
        .map_err(|e| self.failed(e))?;
        Ok(SessionGrant {
            session_id: id.to_string(),
            ttl_ms,
        })
    }

    /// Whether each handle holds its key now (same token, owner and live session): one query.
    pub async fn held_among(&self, handles: &[HandleRef]) -> Result<Vec<bool>, LockError> {
        let keys: Vec<String> = handles.iter().map(|h| h.key.clone()).collect();
        let rows: Vec<(String, String, i64, i64)> = sqlx::query_as(
            "SELECT e.key, e.owner, e.token, e.session_id FROM lock_entry e JOIN lock_session s USING (session_id) \
             WHERE e.key = ANY($1) AND s.state = 'ACTIVE' AND s.expires_at > clock_timestamp()",
        )
        .bind(&keys)
        .fetch_all(&mut *self.conn().await?)
        .await
        .map_err(|e| self.failed(e))?;
        Ok(handles
            .iter()
            .map(|h| {
                rows.iter().any(|(key, owner, token, session)| {
                    *key == h.key
                        && *owner == h.owner
                        && *token as u64 == h.token
                        && session.to_string() == h.session_id
                })
            })
            .collect())
    }

    pub async fn keep_alive(&self, session_id: &str) -> Result<u64, LockError> {
        let id = parse_session(session_id)?;
        // Conditioned on being alive now: an expired session never comes back (an acquire may
        // already have taken its keys over).
        let ttl: Option<i64> = sqlx::query_scalar(
            "UPDATE lock_session SET expires_at = clock_timestamp() + ttl_ms * interval '1 millisecond', \
             last_heartbeat_at = clock_timestamp() \
             WHERE session_id = $1 AND state = 'ACTIVE' AND expires_at > clock_timestamp() RETURNING ttl_ms",
        )
        .bind(id)
        .fetch_optional(&mut *self.conn().await?)
        .await
        .map_err(|e| self.failed(e))?;
        ttl.map(|t| t as u64)
            .ok_or_else(|| LockError::SessionNotFound {
                session_id: session_id.to_string(),
            })
    }

    pub async fn close_session(&self, session_id: &str) -> Result<Vec<String>, LockError> {
        let id = parse_session(session_id)?;
        let mut conn = self.conn().await?;
        let mut tx = sqlx::Connection::begin(&mut *conn)
            .await
            .map_err(|e| self.failed(e))?;
        sqlx::query(
            "UPDATE lock_session SET state = 'CLOSED', ended_at = clock_timestamp() \
             WHERE session_id = $1 AND state = 'ACTIVE'",
        )
        .bind(id)
        .execute(&mut *tx)
        .await
        .map_err(|e| self.failed(e))?;
        let keys: Vec<String> = sqlx::query_scalar(
            "WITH d AS (DELETE FROM lock_entry WHERE session_id = $1 RETURNING key) \
             SELECT key FROM d, LATERAL pg_notify('lock_released', d.key) AS n",
        )
        .bind(id)
        .fetch_all(&mut *tx)
        .await
        .map_err(|e| self.failed(e))?;
        tx.commit().await.map_err(|e| self.failed(e))?;
        Ok(keys)
    }

    pub async fn try_acquire(
        &self,
        key: &str,
        owner: &str,
        session_id: &str,
    ) -> Result<Attempt, LockError> {
        let id = parse_session(session_id)?;
        for _ in 0..ACQUIRE_ATTEMPTS_MAX {
            let row = sqlx::query(ACQUIRE_SQL)
                .bind(key)
                .bind(owner)
                .bind(id)
                .fetch_optional(&mut *self.conn().await?)
                .await
                .map_err(|e| self.failed(e))?;
            if let Some(r) = row {
                let token: i64 = r.get("token");
                let expires: Option<i64> = r.get("expires_unix_ms");
                let ttl: Option<i64> = r.get("ttl_ms");
                return Ok(Attempt::Granted(GrantInfo {
                    key: key.to_string(),
                    owner: owner.to_string(),
                    session_id: session_id.to_string(),
                    token: token as u64,
                    server_expiry_unix_ms: expires.unwrap_or_default(),
                    ttl_ms: ttl.unwrap_or_default() as u64,
                    minted: true,
                }));
            }
            let own_alive: Option<bool> = sqlx::query_scalar(
                "SELECT state = 'ACTIVE' AND expires_at > clock_timestamp() FROM lock_session WHERE session_id = $1",
            )
            .bind(id)
            .fetch_optional(&mut *self.conn().await?)
            .await
            .map_err(|e| self.failed(e))?;
            if own_alive != Some(true) {
                return Err(LockError::SessionNotFound {
                    session_id: session_id.to_string(),
                });
            }
            match self.entry(key).await? {
                Some(e) if e.session_id == id && e.owner == owner && e.alive => {
                    return Ok(Attempt::Granted(GrantInfo {
                        key: key.to_string(),
                        owner: owner.to_string(),
                        session_id: session_id.to_string(),
                        token: e.token as u64,
                        server_expiry_unix_ms: e.expires_unix_ms,
                        ttl_ms: e.ttl_ms as u64,
                        minted: false,
                    }));
                }
                Some(e) if e.alive => {
                    return Ok(Attempt::Held {
                        holder: Holder {
                            owner: e.owner,
                            session_id: e.session_id.to_string(),
                            token: e.token as u64,
                            server_expiry_unix_ms: e.expires_unix_ms,
                            session_state: SessionState::parse(&e.session_state),
                        },
                        wait_from: WaitFrom::ExpiresInMs(e.remaining_ms.max(0) as u64),
                    });
                }
                // Freed or expired between the statement and the read: run the statement again.
                _ => continue,
            }
        }
        Ok(Attempt::Held {
            holder: Holder::default(),
            wait_from: WaitFrom::ExpiresInMs(0),
        })
    }

    pub async fn wait_for_release(
        &self,
        key: &str,
        from: &WaitFrom,
        deadline: Instant,
        subscription: Option<&mut broadcast::Receiver<String>>,
    ) -> Result<(), LockError> {
        let wake = match from {
            WaitFrom::ExpiresInMs(ms) => {
                deadline.min(Instant::now() + Duration::from_millis(ms + EXPIRY_SLACK_MS))
            }
            WaitFrom::Revision(_) => deadline,
        };
        let wake = tokio::time::Instant::from_std(wake);
        let Some(rx) = subscription else {
            tokio::time::sleep_until(wake).await;
            return Ok(());
        };
        loop {
            tokio::select! {
                _ = tokio::time::sleep_until(wake) => return Ok(()),
                received = rx.recv() => match received {
                    Ok(k) if k == key => return Ok(()),
                    Ok(_) => continue,
                    // Lagged or closed: re-attempt rather than risk a missed release.
                    Err(_) => return Ok(()),
                },
            }
        }
    }

    async fn current_token(&self, key: &str) -> Result<u64, LockError> {
        Ok(self
            .entry(key)
            .await?
            .filter(|e| e.alive)
            .map(|e| e.token as u64)
            .unwrap_or(0))
    }

    async fn not_holder(&self, handle: &HandleRef) -> LockError {
        let current_token = self.current_token(&handle.key).await.unwrap_or(0);
        LockError::NotHolder {
            key: handle.key.clone(),
            presented_owner: handle.owner.clone(),
            presented_session_id: handle.session_id.clone(),
            presented_token: handle.token,
            current_token,
        }
    }

    pub async fn renew(&self, handle: &HandleRef) -> Result<GrantInfo, LockError> {
        let id = parse_session(&handle.session_id)?;
        let row = sqlx::query(
            "UPDATE lock_session s SET expires_at = clock_timestamp() + s.ttl_ms * interval '1 millisecond', \
                 last_heartbeat_at = clock_timestamp() \
             FROM lock_entry e \
             WHERE e.key = $1 AND e.token = $2 AND e.session_id = $3 AND e.owner = $4 \
               AND s.session_id = e.session_id AND s.state = 'ACTIVE' AND s.expires_at > clock_timestamp() \
             RETURNING (extract(epoch FROM s.expires_at) * 1000)::bigint AS expires_unix_ms, s.ttl_ms",
        )
        .bind(&handle.key)
        .bind(handle.token as i64)
        .bind(id)
        .bind(&handle.owner)
        .fetch_optional(&mut *self.conn().await?)
        .await
        .map_err(|e| self.failed(e))?;
        let Some(r) = row else {
            return Err(self.not_holder(handle).await);
        };
        Ok(GrantInfo {
            key: handle.key.clone(),
            owner: handle.owner.clone(),
            session_id: handle.session_id.clone(),
            token: handle.token,
            server_expiry_unix_ms: r.get("expires_unix_ms"),
            ttl_ms: r.get::<i64, _>("ttl_ms") as u64,
            minted: false,
        })
    }

    pub async fn release(&self, handle: &HandleRef) -> Result<(), LockError> {
        let id = parse_session(&handle.session_id)?;
        let released: Vec<String> = sqlx::query_scalar(
            "WITH d AS ( \
                 DELETE FROM lock_entry e USING lock_session s \
                 WHERE e.key = $1 AND e.token = $2 AND e.session_id = $3 AND e.owner = $4 \
                   AND s.session_id = e.session_id AND s.state = 'ACTIVE' AND s.expires_at > clock_timestamp() \
                 RETURNING e.key) \
             SELECT key FROM d, LATERAL pg_notify('lock_released', d.key) AS n",
        )
        .bind(&handle.key)
        .bind(handle.token as i64)
        .bind(id)
        .bind(&handle.owner)
        .fetch_all(&mut *self.conn().await?)
        .await
        .map_err(|e| self.failed(e))?;
        if released.is_empty() {
            return Err(self.not_holder(handle).await);
        }
        Ok(())
    }

    pub async fn force_revoke(
        &self,
        key: &str,
        expected_token: Option<u64>,
        operator: &str,
        reason: &str,
    ) -> Result<Holder, LockError> {
        // Delete, audit and notify in one statement: there is no revocation without its record,
        // and the expected token (if any) is part of the DELETE's own condition, so a grant that
        // took the key since the caller looked is never the one deleted. The record's place in
        // the audit chain (chain_seq, prev_hash, row_hash; lockdb 0004) is filled by
        // lock_audit's BEFORE INSERT trigger, which runs as the owner and moves the chain's
        // head: this role inserts the record's content only.
        let row = sqlx::query(
            "WITH d AS (DELETE FROM lock_entry WHERE key = $1 AND ($4::bigint IS NULL OR token = $4) \
                        RETURNING key, owner, session_id, token), \
             a AS (INSERT INTO lock_audit (action, key, revoked_owner, revoked_session_id, revoked_token, operator, reason) \
                   SELECT 'force_revoke', key, owner, session_id, token, $2, $3 FROM d) \
             SELECT owner, session_id, token FROM d, LATERAL pg_notify('lock_released', d.key) AS n",
        )
        .bind(key)
        .bind(operator)
        .bind(reason)
        .bind(expected_token.map(|t| t as i64))
        .fetch_optional(&mut *self.conn().await?)
        .await
        .map_err(|e| self.failed(e))?;
        let Some(r) = row else {
            // Nothing deleted: say why from a read after the fact (tokens are never reused, so
            // an entry there now is a later grant than the expected one).
            return Err(match (expected_token, self.entry(key).await?) {
                (Some(expected), Some(now)) => LockError::HolderChanged {
                    key: key.to_string(),
                    expected_token: expected,
                    current_token: now.token as u64,
                },
                _ => LockError::NotHeld {
                    key: key.to_string(),
                },
            });
        };
        Ok(Holder {
            owner: r.get("owner"),
            session_id: r.get::<i64, _>("session_id").to_string(),
            token: r.get::<i64, _>("token") as u64,
            server_expiry_unix_ms: 0,
            session_state: None,
        })
    }

    pub async fn describe(&self, key: &str) -> Result<Option<Holder>, LockError> {
        Ok(self.entry(key).await?.filter(|e| e.alive).map(|e| Holder {
            owner: e.owner,
            session_id: e.session_id.to_string(),
            token: e.token as u64,
            server_expiry_unix_ms: e.expires_unix_ms,
            session_state: SessionState::parse(&e.session_state),
        }))
    }

    pub async fn ping(&self) -> bool {
        let Ok(mut conn) = self.conn().await else {
            return false;
        };
        sqlx::query("SELECT 1")
            .execute(&mut *conn)
            .await
            .map_err(|e| self.failed(e))
            .is_ok()
    }
}

/// Forwards `NOTIFY lock_released` payloads to the in-process waiters, reconnecting on loss. Its
/// connection's loss is the first sign of an outage (a shut-down server closes it at once).
async fn listen(pool: PgPool, released: broadcast::Sender<String>, contact: Arc<Contact>) {
    loop {
        match sqlx::postgres::PgListener::connect_with(&pool).await {
            Ok(mut listener) => {
                if let Err(e) = listener.listen(RELEASE_CHANNEL).await {
                    tracing::warn!(error = %e, "lock release listener could not subscribe");
                } else {
                    loop {
                        match listener.recv().await {
                            Ok(n) => {
                                let _ = released.send(n.payload().to_string());
                            }
                            Err(e) => {
                                tracing::warn!(error = %e, "lock release listener lost its connection");
                                if is_connectivity(&e) {
                                    contact.lost("the release listener lost its connection");
                                }
                                break;
                            }
                        }
                    }
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "lock release listener could not connect");
                if is_connectivity(&e) {
                    contact.lost("the release listener could not connect");
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(LISTENER_RECONNECT_MS)).await;
    }
}
