//! PostgreSQL backend (`lockdb`). A session is a `lock_session` row whose expiry the database's
//! clock decides; a lock is a `lock_entry` row; tokens come from `lock_token_seq`, never reset.
//! Acquire is one conditional statement. Waiters are woken by `NOTIFY lock_released` (sent in the
//! same statement as every delete) or at the holder's expiry as the database computed it.

use std::time::{Duration, Instant};

use sqlx::{PgPool, Row};
use tokio::sync::broadcast;

use super::{Attempt, GrantInfo, HandleRef, Holder, SessionGrant, WaitFrom};
use crate::error::LockError;

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

static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("../../migrations/lockdb");

fn backend_err(e: impl std::fmt::Display) -> LockError {
    LockError::Backend {
        backend: BACKEND,
        detail: e.to_string(),
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
}

impl Drop for PgBackend {
    fn drop(&mut self) {
        self._listener.abort();
    }
}

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
       OR NOT EXISTS (SELECT 1 FROM lock_session s WHERE s.session_id = cur.session_id AND s.state = 'ACTIVE')
RETURNING token,
    (SELECT (extract(epoch FROM s.expires_at) * 1000)::bigint FROM lock_session s WHERE s.session_id = $3) AS expires_unix_ms,
    (SELECT s.ttl_ms FROM lock_session s WHERE s.session_id = $3) AS ttl_ms
"#;

const ENTRY_SQL: &str = r#"
SELECT e.owner, e.session_id, e.token, s.ttl_ms,
       (s.state = 'ACTIVE' AND s.expires_at > clock_timestamp()) AS alive,
       (extract(epoch FROM s.expires_at) * 1000)::bigint AS expires_unix_ms,
       GREATEST(0, extract(epoch FROM (s.expires_at - clock_timestamp())) * 1000)::bigint AS remaining_ms
FROM lock_entry e JOIN lock_session s ON s.session_id = e.session_id
WHERE e.key = $1
"#;

struct EntryRow {
    owner: String,
    session_id: i64,
    token: i64,
    ttl_ms: i64,
    alive: bool,
    expires_unix_ms: i64,
    remaining_ms: i64,
}

impl PgBackend {
    /// Connects, checks that lockdb is at this build's schema (`payoutctl migrate` applies it as
    /// the owner role; this role may not run DDL), and starts the release-notification listener.
    pub async fn connect(database_url: &str) -> Result<Self, LockError> {
        let pool = service_kit::connect_pg(database_url)
            .await
            .map_err(|e| backend_err(format!("{e:#}")))?;
        db_access::require_schema(&pool, &MIGRATOR, "lockdb")
            .await
            .map_err(backend_err)?;
        let (released, _) = broadcast::channel(NOTIFY_BUFFER);
        let listener = tokio::spawn(listen(pool.clone(), released.clone()));
        Ok(Self {
            pool,
            released,
            _listener: listener,
        })
    }

    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    pub fn subscribe(&self) -> broadcast::Receiver<String> {
        self.released.subscribe()
    }

    async fn entry(&self, key: &str) -> Result<Option<EntryRow>, LockError> {
        let row = sqlx::query(ENTRY_SQL)
            .bind(key)
            .fetch_optional(&self.pool)
            .await
            .map_err(backend_err)?;
        Ok(row.map(|r| EntryRow {
            owner: r.get("owner"),
            session_id: r.get("session_id"),
            token: r.get("token"),
            ttl_ms: r.get("ttl_ms"),
            alive: r.get("alive"),
            expires_unix_ms: r.get("expires_unix_ms"),
            remaining_ms: r.get("remaining_ms"),
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
        .fetch_one(&self.pool)
        .await
        .map_err(backend_err)?;
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
        .fetch_all(&self.pool)
        .await
        .map_err(backend_err)?;
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
        .fetch_optional(&self.pool)
        .await
        .map_err(backend_err)?;
        ttl.map(|t| t as u64)
            .ok_or_else(|| LockError::SessionNotFound {
                session_id: session_id.to_string(),
            })
    }

    pub async fn close_session(&self, session_id: &str) -> Result<Vec<String>, LockError> {
        let id = parse_session(session_id)?;
        let mut tx = self.pool.begin().await.map_err(backend_err)?;
        sqlx::query(
            "UPDATE lock_session SET state = 'CLOSED', ended_at = clock_timestamp() \
             WHERE session_id = $1 AND state = 'ACTIVE'",
        )
        .bind(id)
        .execute(&mut *tx)
        .await
        .map_err(backend_err)?;
        let keys: Vec<String> = sqlx::query_scalar(
            "WITH d AS (DELETE FROM lock_entry WHERE session_id = $1 RETURNING key) \
             SELECT key FROM d, LATERAL pg_notify('lock_released', d.key) AS n",
        )
        .bind(id)
        .fetch_all(&mut *tx)
        .await
        .map_err(backend_err)?;
        tx.commit().await.map_err(backend_err)?;
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
                .fetch_optional(&self.pool)
                .await
                .map_err(backend_err)?;
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
            .fetch_optional(&self.pool)
            .await
            .map_err(backend_err)?;
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
        .fetch_optional(&self.pool)
        .await
        .map_err(backend_err)?;
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
        .fetch_all(&self.pool)
        .await
        .map_err(backend_err)?;
        if released.is_empty() {
            return Err(self.not_holder(handle).await);
        }
        Ok(())
    }

    pub async fn force_revoke(
        &self,
        key: &str,
        operator: &str,
        reason: &str,
    ) -> Result<Holder, LockError> {
        // Delete, audit and notify in one statement: there is no revocation without its record.
        let row = sqlx::query(
            "WITH d AS (DELETE FROM lock_entry WHERE key = $1 RETURNING key, owner, session_id, token), \
             a AS (INSERT INTO lock_audit (action, key, revoked_owner, revoked_session_id, revoked_token, operator, reason) \
                   SELECT 'force_revoke', key, owner, session_id, token, $2, $3 FROM d) \
             SELECT owner, session_id, token FROM d, LATERAL pg_notify('lock_released', d.key) AS n",
        )
        .bind(key)
        .bind(operator)
        .bind(reason)
        .fetch_optional(&self.pool)
        .await
        .map_err(backend_err)?;
        let Some(r) = row else {
            return Err(LockError::NotHeld {
                key: key.to_string(),
            });
        };
        Ok(Holder {
            owner: r.get("owner"),
            session_id: r.get::<i64, _>("session_id").to_string(),
            token: r.get::<i64, _>("token") as u64,
            server_expiry_unix_ms: 0,
        })
    }

    pub async fn describe(&self, key: &str) -> Result<Option<Holder>, LockError> {
        Ok(self.entry(key).await?.filter(|e| e.alive).map(|e| Holder {
            owner: e.owner,
            session_id: e.session_id.to_string(),
            token: e.token as u64,
            server_expiry_unix_ms: e.expires_unix_ms,
        }))
    }

    pub async fn ping(&self) -> bool {
        sqlx::query("SELECT 1").execute(&self.pool).await.is_ok()
    }
}

/// Forwards `NOTIFY lock_released` payloads to the in-process waiters, reconnecting on loss.
async fn listen(pool: PgPool, released: broadcast::Sender<String>) {
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
                                break;
                            }
                        }
                    }
                }
            }
            Err(e) => tracing::warn!(error = %e, "lock release listener could not connect"),
        }
        tokio::time::sleep(Duration::from_millis(LISTENER_RECONNECT_MS)).await;
    }
}
