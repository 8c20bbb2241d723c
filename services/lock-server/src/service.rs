//! The gRPC `LockService`: validation, bounded waiting, the INV-04 check, events and metrics on top
//! of a backend. Conversion between wire types and backend types happens here and nowhere else.

use grant_signing::Signer;
use std::sync::Arc;
use std::time::{Duration, Instant};

use payout_proto::lock as pb;
use prometheus::IntCounterVec;
use service_kit::grpc::Caller;
use tonic::{Request, Response, Status};

use crate::backend::{Attempt, Backend, GrantInfo, HandleRef, Holder};
use crate::callers::{CallerLimits, Callers};
use crate::error::LockError;
use crate::issued::{AdmitError, IssuedTokens};
use crate::queue::{Queues, Ticket};
use crate::session::{SessionMetrics, SessionState, Tracker};

/// Owner identities are names of workers or operators, not documents.
pub const OWNER_LENGTH_MAX: usize = 256;
/// Lock keys are `payout:{account id}` and nothing else ([`crate::key`]).
pub use crate::key::KEY_LENGTH_MAX;
/// A force-revoke's reason: a ticket reference and a sentence, not a document.
pub const REASON_LENGTH_MAX: usize = 512;
/// etcd leases have whole-second granularity; below a second a client's safety margin would eat
/// the whole TTL.
pub const SESSION_TTL_MS_MIN: u64 = 1_000;
/// A dead client blocks its keys for at most this long; longer TTLs trade liveness for nothing.
pub const SESSION_TTL_MS_MAX: u64 = 300_000;
/// One Acquire call waits at most this long: a gRPC call held open longer ties up a server task
/// and a connection for a caller that can just as well call again.
pub const WAIT_MS_MAX: u64 = 60_000;
/// A caller whose Acquire call ended unanswered keeps its place in the key's queue this long, for
/// its next call (a waiting client asks in calls of bounded length, one straight after another).
pub const PLACE_KEPT_MS: u64 = 1_000;
/// How often the health status is refreshed from a backend ping.
pub const HEALTH_PERIOD_MS: u64 = 1_000;

/// Every event of spec 2.4 as a counter label.
pub mod event {
    pub const ACQUIRED: &str = "acquired";
    pub const REACQUIRED: &str = "reacquired";
    pub const RENEWED: &str = "renewed";
    pub const RELEASED: &str = "released";
    pub const EXPIRED: &str = "expired";
    pub const REVOKED: &str = "revoked";
    pub const NOT_ACQUIRED: &str = "not_acquired";
    pub const TOKEN_REGRESSION: &str = "token_regression";
    pub const SESSION_CREATED: &str = "session_created";
    pub const SESSION_CLOSED: &str = "session_closed";
    /// A call on a session by a certificate other than the one that created it: refused.
    pub const SESSION_NOT_OWNED: &str = "session_not_owned";
    /// An Acquire refused because the waiter bound (`WAITERS_MAX`) is reached in this process.
    pub const WAITERS_FULL: &str = "waiters_full";
    /// A force-revoke refused because a later grant than the expected one holds the key (logged;
    /// counted in `lock_force_revokes_refused_total`, not here, so no revoke alert fires).
    pub const REVOKE_REFUSED: &str = "revoke_refused";
}

/// Acquire calls that may wait in one lock-server process at once, over every key. Each holds a
/// request slot and a little memory; past it a waiting Acquire is refused RESOURCE_EXHAUSTED
/// (the caller retries with backoff) instead of parking without bound. The shipped bound: a
/// service is built with it ([`LockServiceImpl::new`]); tests set a smaller one
/// ([`LockServiceImpl::with_waiters_max`]).
pub const WAITERS_MAX: usize = 4_096;

/// The lock service's server bounds: every parked waiter holds a request slot for up to
/// `WAIT_MS_MAX`, so the concurrency bound is the waiter bound plus room for the calls that do
/// not wait (keep-alives, releases), and a request may last the longest wait plus its backend
/// calls. A waiting Acquire is never cut off by the server's own deadline.
pub const BOUNDS: service_kit::grpc::Bounds = service_kit::grpc::Bounds {
    concurrency_max: WAITERS_MAX + 512,
    request_timeout_ms: WAIT_MS_MAX + 30_000,
};
const _: () = assert!(BOUNDS.request_timeout_ms > WAIT_MS_MAX + 10_000);
const _: () = assert!(BOUNDS.concurrency_max > WAITERS_MAX);

#[derive(Clone)]
pub struct LockMetrics {
    events: IntCounterVec,
    token_regressions: IntCounterVec,
    /// The server's `unauthorised_calls_total`: a force-revoke naming an operator its
    /// certificate does not carry is counted there.
    unauthorised_calls: IntCounterVec,
    /// Force-revokes refused by the backend's compare (a later grant holds the key): apart from
    /// the revokes carried out (`lock_force_revokes_total`, whose alerts fire on them).
    force_revokes_refused: IntCounterVec,
    /// Force-revokes carried out, by who did it ([`revoked_by`], from the caller's verified
    /// certificate role): an operator's break-glass pages (LockForceRevoked) on any occurrence,
    /// the resolver's takeover only when takeovers repeat (LockTakeoversRepeating). Every revoke
    /// is also counted in `lock_events_total{event="revoked"}`, kept for dashboards.
    force_revokes: IntCounterVec,
    /// Calls refused at a per-caller bound (`crate::callers`), by bound.
    caller_limit_refusals: IntCounterVec,
    /// The session lifecycle's (spec 2.4).
    pub sessions: SessionMetrics,
}

impl LockMetrics {
    pub fn register(metrics: &service_kit::Metrics) -> Self {
        Self {
            events: metrics.counter_vec("lock_events_total", "Lock service events by kind and backend", &[
                "event", "backend",
            ]),
            token_regressions: metrics.counter_vec(
                "lock_token_regression_total",
                "INV-04 alarms: a backend returned a token not above one already issued for the key",
                &["backend"],
            ),
            unauthorised_calls: metrics.unauthorised_calls(),
            force_revokes_refused: metrics.counter_vec(
                "lock_force_revokes_refused_total",
                "Force-revokes refused, nothing revoked: holder_changed = the key is held by a later grant than the one the caller expected",
                &["reason", "backend"],
            ),
            force_revokes: metrics.counter_vec(
                "lock_force_revokes_total",
                "Force-revokes carried out, by who did it (the caller's certificate role): operator = break-glass, resolver = the reconciler's takeover of a key whose workflow is not running",
                &["by", "backend"],
            ),
            caller_limit_refusals: metrics.counter_vec(
                "lock_caller_limit_refusals_total",
                "Calls refused because one caller (client certificate) reached a per-caller bound: sessions, held_keys, waiters or grant_rate (the caller's fingerprint is in the log line)",
                &["limit"],
            ),
            sessions: SessionMetrics::register(metrics),
        }
    }
}

/// Who did a force-revoke, as `lock_force_revokes_total{by}` and the log line say.
pub mod revoked_by {
    /// A person at `payoutctl` (break-glass), or any role but the resolver's.
    pub const OPERATOR: &str = "operator";
    /// The reconciler's resolver: an audited takeover of a key whose payout's workflow is not running.
    pub const RESOLVER: &str = "resolver";
}

/// Who did a force-revoke, from the caller's verified certificate role, never from the request's
/// operator field (which a caller writes). Only a Reconciler certificate is the resolver; every
/// other role (the authorisation table lets only Operator and Reconciler call ForceRevoke) counts
/// as an operator, so a revoke nobody expected pages rather than passes as healing.
pub fn revoked_by(caller: &Caller) -> &'static str {
    match caller.role {
        service_kit::grpc::Role::Reconciler => revoked_by::RESOLVER,
        _ => revoked_by::OPERATOR,
    }
}

struct Inner {
    backend: Backend,
    issued: Arc<IssuedTokens>,
    /// Signs every grant this server hands out.
    signer: Arc<Signer>,
    metrics: LockMetrics,
    /// The Acquire calls waiting in this process, first come first served, per key.
    queues: Arc<Queues>,
    /// Places kept for the next call of a caller whose call ended unanswered, by (key, owner,
    /// session), each for [`PLACE_KEPT_MS`].
    kept: std::sync::Mutex<std::collections::HashMap<(String, String, String), Ticket>>,
    /// The last state seen of each session: transitions and the `lock_sessions` gauge.
    sessions: Tracker,
    /// At most this many Acquire calls wait in this process at once ([`WAITERS_MAX`] unless a
    /// test set another).
    waiters_max: usize,
    /// ForceRevoke records only the operator the caller's certificate carries (always, except in
    /// a negative control).
    operator_certification: bool,
    /// What each caller (client certificate) uses of this server, within its bounds.
    callers: Arc<Callers>,
}

#[derive(Clone)]
pub struct LockServiceImpl {
    inner: Arc<Inner>,
}

fn check_text(field: &'static str, value: &str, max: usize) -> Result<(), LockError> {
    if value.trim().is_empty() {
        return Err(LockError::invalid(field, "required"));
    }
    if value.len() > max {
        return Err(LockError::invalid(
            field,
            format!("longer than {max} bytes"),
        ));
    }
    // The PostgreSQL backend cannot store or even compare it (text holds no NUL): it would fail
    // as BACKEND_UNAVAILABLE; both backends refuse it here so they answer alike.
    if value.contains('\0') {
        return Err(LockError::invalid(field, "contains a NUL character"));
    }
    Ok(())
}

/// Grants vouched for in one keep-alive: a worker holds one grant per account in flight, so a
/// thousand is far beyond one process's share, and bounds the read a keep-alive costs.
pub const VOUCH_PER_KEEP_ALIVE_MAX: usize = 1_000;

fn check_token(field: &'static str, token: u64) -> Result<(), LockError> {
    if token == 0 {
        return Err(LockError::invalid(field, "zero is never a token"));
    }
    // Tokens are etcd revisions or a bigint sequence: a larger value was never issued, and the
    // backends' `as i64` would read it as a negative revision.
    if i64::try_from(token).is_err() {
        return Err(LockError::invalid(
            field,
            "above i64::MAX: no backend ever issues it",
        ));
    }
    Ok(())
}

fn handle_from(h: Option<pb::Handle>) -> Result<HandleRef, LockError> {
    let h = h.ok_or_else(|| LockError::invalid("handle", "required"))?;
    crate::key::check("key", &h.key)?;
    check_text("owner", &h.owner, OWNER_LENGTH_MAX)?;
    check_text("session_id", &h.session_id, OWNER_LENGTH_MAX)?;
    check_token("token", h.token)?;
    Ok(HandleRef {
        key: h.key,
        owner: h.owner,
        session_id: h.session_id,
        token: h.token,
    })
}

/// A grant as the caller receives it, signed: the signature over (key, token, owner) is what
/// both guards verify before they accept the token (`crates/grant-signing`).
fn grant_to_pb(signer: &Signer, g: &GrantInfo) -> pb::Grant {
    let signature = signer.sign(&g.key, g.token, &g.owner);
    pb::Grant {
        key: g.key.clone(),
        owner: g.owner.clone(),
        token: g.token,
        session_id: g.session_id.clone(),
        server_expiry_unix_ms: g.server_expiry_unix_ms,
        ttl_ms: g.ttl_ms,
        signing_key_id: signature.key_id,
        signature: signature.bytes,
    }
}

impl LockServiceImpl {
    pub fn new(
        backend: Backend,
        issued: Arc<IssuedTokens>,
        metrics: LockMetrics,
        signer: Arc<Signer>,
    ) -> Self {
        let sessions = Tracker::new(metrics.sessions.clone(), backend.name());
        let callers = Callers::new(CallerLimits::SHIPPED, metrics.caller_limit_refusals.clone());
        Self {
            inner: Arc::new(Inner {
                backend,
                issued,
                signer,
                metrics,
                queues: Arc::new(Queues::default()),
                kept: Default::default(),
                sessions,
                waiters_max: WAITERS_MAX,
                operator_certification: true,
                callers,
            }),
        }
    }

    /// The same service with another waiter bound than [`WAITERS_MAX`]: a test parks a few
    /// callers against a bound of a few. A bound above `WAITERS_MAX` is none in effect: the
    /// server's [`BOUNDS`] leave room for `WAITERS_MAX` waiters, and past them the server sheds
    /// calls (UNAVAILABLE) before this bound would refuse them (a test's negative control turns
    /// the bound off so). Set before the service is cloned or served.
    pub fn with_waiters_max(mut self, waiters_max: usize) -> Self {
        Arc::get_mut(&mut self.inner)
            .expect("the waiter bound is set before the service is cloned or served")
            .waiters_max = waiters_max;
        self
    }

    /// The same service with other per-caller bounds than [`CallerLimits::SHIPPED`]: the tests'
    /// small ones, or [`CallerLimits::NONE`] for the bench (one certificate, a thousand grants a
    /// second) and the negative controls. Set before the service is cloned or served.
    pub fn with_caller_limits(mut self, limits: CallerLimits) -> Self {
        let inner = Arc::get_mut(&mut self.inner)
            .expect("the caller bounds are set before the service is cloned or served");
        inner.callers = Callers::new(limits, inner.metrics.caller_limit_refusals.clone());
        self
    }

    /// What each caller uses of this service ([`crate::callers`]).
    pub fn callers(&self) -> &Callers {
        &self.inner.callers
    }

    /// NEGATIVE CONTROL ONLY: ForceRevoke records the operator the request names without asking
    /// whether the caller's certificate carries that name. Tests use it to show that the
    /// certified-operator tests detect what they claim to. Set before the service is cloned or
    /// served; the binary has no way to call it.
    #[doc(hidden)]
    pub fn without_operator_certification_for_tests(mut self) -> Self {
        Arc::get_mut(&mut self.inner)
            .expect("the check is switched before the service is cloned or served")
            .operator_certification = false;
        self
    }

    /// How many Acquire calls wait in this service now, over every key.
    pub fn waiting(&self) -> usize {
        self.inner.queues.waiting_total()
    }

    /// The most Acquire calls this service lets wait at once.
    pub fn waiters_max(&self) -> usize {
        self.inner.waiters_max
    }

    /// One reading of the session view (spec 2.4): transitions counted and logged, the
    /// `lock_sessions` gauge set, and the backend probed for a failover. Run every
    /// [`crate::session::SWEEP_MS`] by [`crate::serve`]; a failed reading is skipped.
    pub async fn sweep_sessions(&self) {
        let followed = self.inner.sessions.followed();
        match self.inner.backend.sessions_view(&followed).await {
            Ok(view) => {
                for (id, state) in &view {
                    if state.is_final() {
                        self.inner.callers.session_ended(id);
                    }
                }
                self.inner.sessions.observe_all(view)
            }
            Err(e) => tracing::debug!(error = %e, "session view not read this time"),
        }
    }

    /// Transitions seen between two states, for tests and `payoutctl`.
    pub fn session_transitions(&self, from: SessionState, to: SessionState) -> u64 {
        self.inner.sessions.transitions(from, to)
    }

    pub fn backend(&self) -> &Backend {
        &self.inner.backend
    }

    pub fn issued_tokens(&self) -> &IssuedTokens {
        &self.inner.issued
    }

    /// Refuses to park one more waiter past the service's waiter bound ([`WAITERS_MAX`]).
    fn room_to_wait(&self) -> Result<(), LockError> {
        let waiting = self.inner.queues.waiting_total();
        let max = self.inner.waiters_max;
        if waiting >= max {
            self.count(event::WAITERS_FULL);
            tracing::warn!(
                event = event::WAITERS_FULL,
                waiting,
                waiters_max = max,
                "acquire refused: too many callers waiting"
            );
            return Err(LockError::Overloaded { waiting, max });
        }
        Ok(())
    }

    fn count(&self, event: &str) {
        self.inner
            .metrics
            .events
            .with_label_values(&[event, self.inner.backend.name()])
            .inc();
    }

    /// Counter value, for tests and `payoutctl`.
    pub fn event_count(&self, event: &str) -> u64 {
        self.inner
            .metrics
            .events
            .with_label_values(&[event, self.inner.backend.name()])
            .get()
    }

    pub fn token_regression_count(&self) -> u64 {
        self.inner
            .metrics
            .token_regressions
            .with_label_values(&[self.inner.backend.name()])
            .get()
    }

    fn observe_error(&self, e: &LockError) {
        if let LockError::SessionNotFound { session_id } = e {
            self.inner.callers.session_ended(session_id);
            tracing::info!(event = event::EXPIRED, session_id = %session_id, backend = self.inner.backend.name(), "session expired or gone");
            self.count(event::EXPIRED);
        }
    }

    pub async fn create_session(
        &self,
        owner: &str,
        ttl_ms: u64,
    ) -> Result<(String, u64), LockError> {
        check_text("owner", owner, OWNER_LENGTH_MAX)?;
        if !(SESSION_TTL_MS_MIN..=SESSION_TTL_MS_MAX).contains(&ttl_ms) {
            return Err(LockError::invalid(
                "ttl_ms",
                format!("must be within {SESSION_TTL_MS_MIN}..={SESSION_TTL_MS_MAX}"),
            ));
        }
        let s = self.inner.backend.create_session(owner, ttl_ms).await?;
        tracing::info!(event = event::SESSION_CREATED, owner, session_id = %s.session_id, ttl_ms = s.ttl_ms, "session created");
        self.count(event::SESSION_CREATED);
        self.inner
            .sessions
            .observe(&s.session_id, SessionState::Active);
        Ok((s.session_id, s.ttl_ms))
    }

    pub async fn keep_alive(&self, session_id: &str) -> Result<u64, LockError> {
        check_text("session_id", session_id, OWNER_LENGTH_MAX)?;
        self.inner
            .backend
            .keep_alive(session_id)
            .await
            .inspect_err(|e| self.observe_error(e))
    }

    /// A keep-alive that also vouches for grants: extends the session, then answers which of
    /// `vouch` (all of this session) it no longer holds, in one read of the backend.
    pub async fn keep_alive_vouching(
        &self,
        session_id: &str,
        vouch: Vec<pb::Handle>,
    ) -> Result<pb::KeepAliveResponse, LockError> {
        if vouch.len() > VOUCH_PER_KEEP_ALIVE_MAX {
            return Err(LockError::invalid(
                "vouch",
                format!("more than {VOUCH_PER_KEEP_ALIVE_MAX} handles"),
            ));
        }
        let handles = vouch
            .into_iter()
            .map(|h| {
                let h = handle_from(Some(h))?;
                if h.session_id != session_id {
                    return Err(LockError::invalid(
                        "vouch.session_id",
                        "a handle of another session",
                    ));
                }
                Ok(h)
            })
            .collect::<Result<Vec<_>, _>>()?;
        let ttl_ms = self.keep_alive(session_id).await?;
        if handles.is_empty() {
            return Ok(pb::KeepAliveResponse {
                ttl_ms,
                ..Default::default()
            });
        }
        // The lease is extended either way: a failed read of the grants must not cost the
        // session (and every grant of it); it only vouches for nothing this time.
        let held = match self.inner.backend.held_among(&handles).await {
            Ok(held) => held,
            Err(e) => {
                self.observe_error(&e);
                tracing::warn!(session_id, error = %e, "keep-alive: grants not vouched for this time");
                return Ok(pb::KeepAliveResponse {
                    ttl_ms,
                    unvouched: true,
                    ..Default::default()
                });
            }
        };
        let not_held = handles
            .into_iter()
            .zip(held)
            .filter(|(_, held)| !held)
            .inspect(|(h, _)| self.inner.callers.released(&h.session_id, &h.key))
            .map(|(h, _)| pb::Handle {
                key: h.key,
                owner: h.owner,
                session_id: h.session_id,
                token: h.token,
            })
            .collect();
        Ok(pb::KeepAliveResponse {
            ttl_ms,
            not_held,
            unvouched: false,
        })
    }

    pub async fn close_session(&self, session_id: &str) -> Result<(), LockError> {
        check_text("session_id", session_id, OWNER_LENGTH_MAX)?;
        let keys = self.inner.backend.close_session(session_id).await?;
        for key in &keys {
            tracing::info!(event = event::RELEASED, key = %key, session_id, cause = "session_closed", "lock released with its session");
            self.count(event::RELEASED);
        }
        tracing::info!(
            event = event::SESSION_CLOSED,
            session_id,
            locks_released = keys.len(),
            "session closed"
        );
        self.count(event::SESSION_CLOSED);
        self.inner.callers.session_ended(session_id);
        self.inner
            .sessions
            .observe(session_id, SessionState::Closed);
        Ok(())
    }

    /// Acquire for a caller the per-caller bounds do not apply to (in-process callers and tests);
    /// the gRPC service calls [`LockServiceImpl::acquire_for`] with the caller's certificate.
    pub async fn acquire(
        &self,
        key: &str,
        owner: &str,
        session_id: &str,
        wait_ms: u64,
    ) -> Result<pb::AcquireResponse, LockError> {
        self.acquire_for(None, key, owner, session_id, wait_ms)
            .await
    }

    /// Acquire on behalf of `caller` (its certificate's fingerprint), within its bounds
    /// ([`crate::callers`]): its held keys and grant rate before the backend is asked, its parked
    /// waiters before it joins a queue.
    pub async fn acquire_for(
        &self,
        caller: Option<&str>,
        key: &str,
        owner: &str,
        session_id: &str,
        wait_ms: u64,
    ) -> Result<pb::AcquireResponse, LockError> {
        crate::key::check("key", key)?;
        check_text("owner", owner, OWNER_LENGTH_MAX)?;
        check_text("session_id", session_id, OWNER_LENGTH_MAX)?;
        if let Some(caller) = caller {
            self.inner.callers.may_acquire(caller, session_id, key)?;
        }
        let started = Instant::now();
        let deadline = started + Duration::from_millis(wait_ms.min(WAIT_MS_MAX));
        // First come, first served among this process's waiters (see `queue`): a newcomer that
        // finds callers already waiting for the key queues behind them, without asking the
        // backend, unless it is the holder itself asking again for what it holds (the same token
        // back, so a retried Acquire never waits behind its own grant).
        let place = (key.to_string(), owner.to_string(), session_id.to_string());
        let mut ticket: Option<Ticket> = self.inner.kept.lock().expect("kept").remove(&place);
        if ticket.is_none() && self.inner.queues.len(key) > 0 {
            let holder = self
                .inner
                .backend
                .describe(key)
                .await
                .inspect_err(|e| self.observe_error(e))?;
            if !holder
                .as_ref()
                .is_some_and(|h| h.owner == owner && h.session_id == session_id)
            {
                // A caller that will not wait is answered at once: it takes no place in the
                // line, so the waiter bound is not its answer.
                if wait_ms == 0 {
                    return Ok(self.not_acquired(key, owner, session_id, holder, started));
                }
                ticket = Some(self.park(caller, key)?);
            }
        }
        loop {
            if let Some(t) = ticket.as_mut() {
                if !t.wait_turn(tokio::time::Instant::from_std(deadline)).await {
                    let holder = self.inner.backend.describe(key).await.ok().flatten();
                    if wait_ms > 0 {
                        self.keep_place(place, ticket.take().expect("checked"));
                    }
                    return Ok(self.not_acquired(key, owner, session_id, holder, started));
                }
            }
            let mut subscription = self.inner.backend.subscribe();
            let attempt = self
                .inner
                .backend
                .try_acquire(key, owner, session_id)
                .await
                .inspect_err(|e| self.observe_error(e))?;
            match attempt {
                Attempt::Granted(grant) => {
                    // Granted: the ticket (if any) is left as this returns, which wakes the next.
                    self.admit(&grant).await?;
                    if let Some(caller) = caller {
                        self.inner
                            .callers
                            .granted(caller, session_id, key, grant.minted);
                    }
                    let ev = if grant.minted {
                        event::ACQUIRED
                    } else {
                        event::REACQUIRED
                    };
                    tracing::info!(
                        event = ev,
                        key,
                        owner,
                        session_id,
                        token = grant.token,
                        queued = ticket.is_some(),
                        waited_ms = started.elapsed().as_millis() as u64,
                        backend = self.inner.backend.name(),
                        "lock granted"
                    );
                    self.count(ev);
                    return Ok(pb::AcquireResponse {
                        result: Some(pb::acquire_response::Result::Grant(grant_to_pb(
                            &self.inner.signer,
                            &grant,
                        ))),
                    });
                }
                Attempt::Held { holder, wait_from } => {
                    if Instant::now() >= deadline {
                        if let Some(t) = ticket.take() {
                            self.keep_place(place, t);
                        }
                        return Ok(self.not_acquired(
                            key,
                            owner,
                            session_id,
                            Some(holder),
                            started,
                        ));
                    }
                    if ticket.is_none() {
                        let joined = self.park(caller, key)?;
                        let first = joined.is_head();
                        ticket = Some(joined);
                        if !first {
                            // Others joined meanwhile: wait for our turn first.
                            continue;
                        }
                    }
                    self.inner
                        .backend
                        .wait_for_release(key, &wait_from, deadline, subscription.as_mut())
                        .await?;
                }
            }
        }
    }

    /// A place in `key`'s queue: within the caller's waiter bound first, then the server's.
    fn park(&self, caller: Option<&str>, key: &str) -> Result<Ticket, LockError> {
        let slot = caller
            .map(|caller| self.inner.callers.park(caller))
            .transpose()?;
        self.room_to_wait()?;
        let mut ticket = self.inner.queues.join(key);
        ticket.hold(slot);
        Ok(ticket)
    }

    /// Keeps `ticket` for the same caller's next call, for [`PLACE_KEPT_MS`].
    fn keep_place(&self, place: (String, String, String), ticket: Ticket) {
        let number = ticket.number();
        self.inner
            .kept
            .lock()
            .expect("kept")
            .insert(place.clone(), ticket);
        let inner = Arc::clone(&self.inner);
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(PLACE_KEPT_MS)).await;
            let mut kept = inner.kept.lock().expect("kept");
            if kept.get(&place).is_some_and(|t| t.number() == number) {
                kept.remove(&place);
            }
        });
    }

    fn not_acquired(
        &self,
        key: &str,
        owner: &str,
        session_id: &str,
        holder: Option<Holder>,
        started: Instant,
    ) -> pb::AcquireResponse {
        let waited_ms = started.elapsed().as_millis() as u64;
        let (holder_owner, holder_token) = holder.map(|h| (h.owner, h.token)).unwrap_or_default();
        tracing::info!(event = event::NOT_ACQUIRED, key, owner, session_id, holder_owner = %holder_owner, holder_token, waited_ms, "lock not acquired");
        self.count(event::NOT_ACQUIRED);
        pb::AcquireResponse {
            result: Some(pb::acquire_response::Result::NotAcquired(pb::NotAcquired {
                key: key.to_string(),
                holder_owner,
                holder_token,
                waited_ms,
            })),
        }
    }

    /// INV-04 check, before any grant leaves this process.
    async fn admit(&self, grant: &GrantInfo) -> Result<(), LockError> {
        match self
            .inner
            .issued
            .admit(&grant.key, grant.token, grant.minted)
            .await
        {
            Ok(()) => Ok(()),
            Err(AdmitError::Store(e)) => Err(e),
            Err(AdmitError::Regression(r)) => {
                tracing::error!(
                    event = event::TOKEN_REGRESSION,
                    alert = true,
                    key = %grant.key,
                    owner = %grant.owner,
                    session_id = %grant.session_id,
                    token = grant.token,
                    highest_issued_token = r.highest_issued_token,
                    backend = self.inner.backend.name(),
                    "INV-04 broken: the backend returned a token not above one already issued for this key; grant refused (see RESTORE.md)"
                );
                self.count(event::TOKEN_REGRESSION);
                self.inner
                    .metrics
                    .token_regressions
                    .with_label_values(&[self.inner.backend.name()])
                    .inc();
                Err(LockError::TokenRegression {
                    key: grant.key.clone(),
                    returned_token: grant.token,
                    highest_issued_token: r.highest_issued_token,
                })
            }
        }
    }

    pub async fn renew(&self, handle: HandleRef) -> Result<GrantInfo, LockError> {
        let grant = self
            .inner
            .backend
            .renew(&handle)
            .await
            .inspect_err(|e| self.observe_error(e))?;
        tracing::info!(event = event::RENEWED, key = %handle.key, owner = %handle.owner, session_id = %handle.session_id, token = handle.token, "lock renewed");
        self.count(event::RENEWED);
        Ok(grant)
    }

    pub async fn release(&self, handle: HandleRef) -> Result<(), LockError> {
        self.inner.backend.release(&handle).await.inspect_err(|e| {
            if let LockError::NotHolder { current_token, .. } = e {
                tracing::warn!(key = %handle.key, owner = %handle.owner, session_id = %handle.session_id, token = handle.token, current_token, "release refused: not the holder");
            }
        })?;
        tracing::info!(event = event::RELEASED, key = %handle.key, owner = %handle.owner, session_id = %handle.session_id, token = handle.token, "lock released");
        self.count(event::RELEASED);
        self.inner.callers.released(&handle.session_id, &handle.key);
        Ok(())
    }

    /// Break-glass: takes `key` from its holder, and with `expected_token` only from the grant
    /// of that token (compared in the backend's transaction with the revoke; a later holder is
    /// refused as [`LockError::HolderChanged`], nothing revoked, audited or counted as a revoke).
    /// The operator recorded (the backend's audit record, the alert) is `operator` only if
    /// `caller`'s certificate carries it ([`service_kit::grpc::certified_operator`]); otherwise
    /// PERMISSION_DENIED and nothing is revoked.
    pub async fn force_revoke(
        &self,
        caller: &Caller,
        key: &str,
        expected_token: Option<u64>,
        operator: &str,
        reason: &str,
    ) -> Result<pb::ForceRevokeResponse, LockError> {
        crate::key::check("key", key)?;
        check_text("operator", operator, OWNER_LENGTH_MAX)?;
        check_text("reason", reason, REASON_LENGTH_MAX)?;
        if let Some(token) = expected_token {
            check_token("expected_token", token)?;
        }
        let operator = &if self.inner.operator_certification {
            service_kit::grpc::certified_operator(
                caller,
                "/lock.v1.LockService/ForceRevoke",
                operator,
                &self.inner.metrics.unauthorised_calls,
            )
            .map_err(|_| LockError::OperatorNotCertified {
                operator: operator.to_string(),
            })?
        } else {
            operator.to_string()
        };
        let holder = self
            .inner
            .backend
            .force_revoke(key, expected_token, operator, reason)
            .await
            .inspect_err(|e| {
                if let LockError::HolderChanged {
                    expected_token,
                    current_token,
                    ..
                } = e
                {
                    // Not an alert: the caller looked at a grant that is gone, and the grant
                    // that holds the key now is left alone (the caller may look again).
                    tracing::warn!(
                        event = event::REVOKE_REFUSED,
                        reason_refused = "holder_changed",
                        key,
                        expected_token,
                        current_token,
                        operator,
                        reason,
                        "force-revoke refused: the key is held by a later grant than the one expected; nothing revoked"
                    );
                    self.inner
                        .metrics
                        .force_revokes_refused
                        .with_label_values(&["holder_changed", self.inner.backend.name()])
                        .inc();
                }
            })?;
        if expected_token.is_some_and(|expected| expected != holder.token) {
            // The backend compares the token in its transaction: another grant revoked here is
            // a bug in that compare. The revoke happened, so it is still logged and counted
            // below (the page fires); this line says the compare broke.
            tracing::error!(
                alert = true,
                key,
                expected_token,
                revoked_token = holder.token,
                "BUG: force-revoke took another grant than the expected one (the backend's compare broke)"
            );
        }
        // The deposed holder is fenced by the next, higher token either way. An operator's
        // break-glass is alert level; the resolver's takeover is the system healing itself (a
        // warning; its alert is on takeovers repeating).
        self.inner.callers.released(&holder.session_id, key);
        let by = revoked_by(caller);
        if by == revoked_by::RESOLVER {
            tracing::warn!(
                event = event::REVOKED,
                by,
                key,
                owner = %holder.owner,
                session_id = %holder.session_id,
                token = holder.token,
                expected_token,
                operator,
                reason,
                "lock taken over by the resolver (its payout's workflow is not running)"
            );
        } else {
            tracing::error!(
                event = event::REVOKED,
                alert = true,
                by,
                key,
                owner = %holder.owner,
                session_id = %holder.session_id,
                token = holder.token,
                expected_token,
                operator,
                reason,
                "lock force-revoked by an operator"
            );
        }
        self.count(event::REVOKED);
        self.inner
            .metrics
            .force_revokes
            .with_label_values(&[by, self.inner.backend.name()])
            .inc();
        Ok(pb::ForceRevokeResponse {
            key: key.to_string(),
            revoked_owner: holder.owner,
            revoked_session_id: holder.session_id,
            revoked_token: holder.token,
        })
    }

    pub async fn describe(&self, key: &str) -> Result<pb::DescribeResponse, LockError> {
        crate::key::check("key", key)?;
        let holder = self.inner.backend.describe(key).await?;
        let waiter_count = self.inner.queues.len(key) as u64;
        Ok(match holder {
            Some(h) => pb::DescribeResponse {
                key: key.to_string(),
                held: true,
                holder_owner: h.owner,
                // Never revealed: with it, anyone could act on the holder's session (and a
                // session id is bound to its creator's certificate anyway).
                holder_session_id: String::new(),
                token: h.token,
                server_expiry_unix_ms: h.server_expiry_unix_ms,
                waiter_count,
                holder_session_state: h
                    .session_state
                    .map(|s| s.as_str().to_string())
                    .unwrap_or_default(),
            },
            None => pb::DescribeResponse {
                key: key.to_string(),
                waiter_count,
                ..Default::default()
            },
        })
    }
}

/// Session ids on the wire are bound to the certificate that created the session:
/// `<SHA-256 of the creator's certificate, hex>:<backend session id>`. Every call naming a session
/// (KeepAlive, CloseSession, Acquire, and the handles of Renew, Release and KeepAlive's vouch) is
/// refused PERMISSION_DENIED unless its caller presents that same certificate, so a session id
/// learnt from a log, an error or an old Describe answer is worth nothing to anyone else. The
/// binding is stateless (nothing to lose in a restart) and both backends keep their own ids.
pub mod session_binding {
    use service_kit::grpc::Caller;

    pub fn bind(caller: &Caller, backend_id: &str) -> String {
        format!("{}:{backend_id}", caller.fingerprint_hex())
    }

    /// The backend id of a wire session id, if `caller` created it.
    pub fn unbind(caller: &Caller, wire: &str) -> Result<String, Refused> {
        match wire.split_once(':') {
            Some((fingerprint, id)) if fingerprint == caller.fingerprint_hex() => {
                Ok(id.to_string())
            }
            Some(_) => Err(Refused::NotOwned),
            None => Err(Refused::Unbound),
        }
    }

    #[derive(Debug, PartialEq, Eq)]
    pub enum Refused {
        /// Created by another certificate.
        NotOwned,
        /// Not a session id this server handed out.
        Unbound,
    }
}

impl LockServiceImpl {
    /// `wire`'s backend session id for this caller, or the refusal (counted and logged: a call
    /// on someone else's session is an attempted hijack an operator must see).
    fn own_session(&self, caller: &Caller, wire: &str) -> Result<String, Status> {
        use session_binding::Refused;
        match session_binding::unbind(caller, wire) {
            Ok(id) => Ok(id),
            Err(Refused::NotOwned) => {
                self.count(event::SESSION_NOT_OWNED);
                tracing::error!(
                    event = event::SESSION_NOT_OWNED,
                    alert = true,
                    caller_role = %caller.role,
                    caller_certificate = %caller.fingerprint_hex(),
                    "a call on a session created by another certificate: refused"
                );
                Err(LockError::SessionNotOwned {
                    session_id: wire.to_string(),
                }
                .into())
            }
            Err(Refused::Unbound) => Err(LockError::SessionNotFound {
                session_id: wire.to_string(),
            }
            .into()),
        }
    }

    fn own_handle(
        &self,
        caller: &Caller,
        handle: Option<pb::Handle>,
    ) -> Result<Option<pb::Handle>, Status> {
        handle
            .map(|mut h| {
                h.session_id = self.own_session(caller, &h.session_id)?;
                Ok(h)
            })
            .transpose()
    }
}

fn bound_grant(caller: &Caller, mut grant: pb::Grant) -> pb::Grant {
    grant.session_id = session_binding::bind(caller, &grant.session_id);
    grant
}

#[tonic::async_trait]
impl pb::lock_service_server::LockService for LockServiceImpl {
    async fn create_session(
        &self,
        r: Request<pb::CreateSessionRequest>,
    ) -> Result<Response<pb::CreateSessionResponse>, Status> {
        let caller = service_kit::grpc::caller(&r)?;
        let r = r.into_inner();
        let reservation = self
            .inner
            .callers
            .reserve_session(&caller.fingerprint_hex())?;
        let (session_id, ttl_ms) =
            LockServiceImpl::create_session(self, &r.owner, r.ttl_ms).await?;
        reservation.created(&session_id);
        Ok(Response::new(pb::CreateSessionResponse {
            session_id: session_binding::bind(&caller, &session_id),
            ttl_ms,
        }))
    }

    async fn keep_alive(
        &self,
        r: Request<pb::KeepAliveRequest>,
    ) -> Result<Response<pb::KeepAliveResponse>, Status> {
        let caller = service_kit::grpc::caller(&r)?;
        let r = r.into_inner();
        let session_id = self.own_session(&caller, &r.session_id)?;
        let vouch = r
            .vouch
            .into_iter()
            .map(|h| {
                Ok(self
                    .own_handle(&caller, Some(h))?
                    .expect("some in, some out"))
            })
            .collect::<Result<Vec<_>, Status>>()?;
        let mut response = LockServiceImpl::keep_alive_vouching(self, &session_id, vouch).await?;
        for h in &mut response.not_held {
            h.session_id = session_binding::bind(&caller, &h.session_id);
        }
        Ok(Response::new(response))
    }

    async fn close_session(
        &self,
        r: Request<pb::CloseSessionRequest>,
    ) -> Result<Response<pb::CloseSessionResponse>, Status> {
        let caller = service_kit::grpc::caller(&r)?;
        let session_id = self.own_session(&caller, &r.into_inner().session_id)?;
        LockServiceImpl::close_session(self, &session_id).await?;
        Ok(Response::new(pb::CloseSessionResponse {}))
    }

    async fn acquire(
        &self,
        r: Request<pb::AcquireRequest>,
    ) -> Result<Response<pb::AcquireResponse>, Status> {
        let caller = service_kit::grpc::caller(&r)?;
        let r = r.into_inner();
        let session_id = self.own_session(&caller, &r.session_id)?;
        let mut response = LockServiceImpl::acquire_for(
            self,
            Some(&caller.fingerprint_hex()),
            &r.key,
            &r.owner,
            &session_id,
            r.wait_ms,
        )
        .await?;
        if let Some(pb::acquire_response::Result::Grant(grant)) = &mut response.result {
            grant.session_id = session_binding::bind(&caller, &grant.session_id);
        }
        Ok(Response::new(response))
    }

    async fn renew(
        &self,
        r: Request<pb::RenewRequest>,
    ) -> Result<Response<pb::RenewResponse>, Status> {
        let caller = service_kit::grpc::caller(&r)?;
        let handle = handle_from(self.own_handle(&caller, r.into_inner().handle)?)?;
        let grant = LockServiceImpl::renew(self, handle).await?;
        Ok(Response::new(pb::RenewResponse {
            grant: Some(bound_grant(
                &caller,
                grant_to_pb(&self.inner.signer, &grant),
            )),
        }))
    }

    async fn release(
        &self,
        r: Request<pb::ReleaseRequest>,
    ) -> Result<Response<pb::ReleaseResponse>, Status> {
        let caller = service_kit::grpc::caller(&r)?;
        let handle = handle_from(self.own_handle(&caller, r.into_inner().handle)?)?;
        LockServiceImpl::release(self, handle).await?;
        Ok(Response::new(pb::ReleaseResponse {}))
    }

    async fn force_revoke(
        &self,
        r: Request<pb::ForceRevokeRequest>,
    ) -> Result<Response<pb::ForceRevokeResponse>, Status> {
        let caller = service_kit::grpc::caller(&r)?;
        let r = r.into_inner();
        Ok(Response::new(
            LockServiceImpl::force_revoke(
                self,
                &caller,
                &r.key,
                r.expected_token,
                &r.operator,
                &r.reason,
            )
            .await?,
        ))
    }

    async fn describe(
        &self,
        r: Request<pb::DescribeRequest>,
    ) -> Result<Response<pb::DescribeResponse>, Status> {
        Ok(Response::new(
            LockServiceImpl::describe(self, &r.into_inner().key).await?,
        ))
    }
}
