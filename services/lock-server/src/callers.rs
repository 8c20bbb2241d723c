//! Bounds per caller: what one client certificate may take of this lock-server.
//!
//! The server's own bounds (`service::WAITERS_MAX`, `service::BOUNDS`) protect the process; they
//! do not stop one caller from taking all of it. A compromised worker certificate could open
//! sessions without end, park every waiter slot (every other caller then refused), hold keys
//! without end, or acquire and release in a loop, leaving a grant record per mint in etcd for the
//! retention window until the quota is full and no grant is possible. So each caller, named by
//! its certificate's fingerprint (the identity sessions are already bound to), has four bounds:
//!
//! | bound | default | why |
//! |---|---|---|
//! | open sessions | [`SESSIONS_PER_CALLER_MAX`] | a worker opens one per process and reopens on loss (the lost one lingers a TTL); compose's replicas share one certificate |
//! | keys held | [`HELD_KEYS_PER_CALLER_MAX`] | one grant per payout in flight; far above any batch |
//! | parked waiters | [`WAITERS_PER_CALLER_MAX`] | half the server's bound always stays for every other caller |
//! | new grants per second | [`GRANTS_PER_CALLER_PER_S`], burst [`GRANT_BURST_PER_CALLER`] | compose runs about 5 grants/s; from empty, the etcd quota would take hours to fill, and `EtcdDatabaseNearQuota` pages long before |
//!
//! A refusal is RESOURCE_EXHAUSTED with the typed `CallerLimitReached{limit, in_use, max}`,
//! counted in `lock_caller_limit_refusals_total{limit}` and logged with the caller's fingerprint
//! (never a metric label); nothing was created, granted or parked. A re-acquire of a key the
//! session already holds is free. The counts live in this process: after a restart a caller's
//! surviving sessions are not counted until they end (at most `SESSION_TTL_MS_MAX`), so for that
//! long it may hold up to twice a bound.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use crate::error::LockError;

pub const SESSIONS_PER_CALLER_MAX: usize = 64;
pub const HELD_KEYS_PER_CALLER_MAX: usize = 10_000;
pub const WAITERS_PER_CALLER_MAX: usize = crate::service::WAITERS_MAX / 2;
pub const GRANTS_PER_CALLER_PER_S: u32 = 100;
pub const GRANT_BURST_PER_CALLER: u32 = 200;

/// The `limit` of a refusal, as the wire and the counter name it.
pub mod limit {
    pub const SESSIONS: &str = "sessions";
    pub const HELD_KEYS: &str = "held_keys";
    pub const WAITERS: &str = "waiters";
    pub const GRANT_RATE: &str = "grant_rate";
    pub const ALL: [&str; 4] = [SESSIONS, HELD_KEYS, WAITERS, GRANT_RATE];
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CallerLimits {
    pub sessions: usize,
    pub held_keys: usize,
    pub waiters: usize,
    pub grants_per_s: u32,
    pub grant_burst: u32,
}

impl CallerLimits {
    /// What a shipped lock-server enforces.
    pub const SHIPPED: Self = Self {
        sessions: SESSIONS_PER_CALLER_MAX,
        held_keys: HELD_KEYS_PER_CALLER_MAX,
        waiters: WAITERS_PER_CALLER_MAX,
        grants_per_s: GRANTS_PER_CALLER_PER_S,
        grant_burst: GRANT_BURST_PER_CALLER,
    };

    /// No per-caller bound at all (the server's own bounds remain): the bench, which drives a
    /// thousand grants a second from one certificate, and the tests' negative controls.
    pub const NONE: Self = Self {
        sessions: usize::MAX,
        held_keys: usize::MAX,
        waiters: usize::MAX,
        grants_per_s: u32::MAX,
        grant_burst: u32::MAX,
    };
}

impl Default for CallerLimits {
    fn default() -> Self {
        Self::SHIPPED
    }
}

#[derive(Default)]
struct Usage {
    sessions: HashSet<String>,
    /// Sessions being created (a reservation each, so concurrent creates cannot overshoot).
    sessions_reserved: usize,
    /// (session, key) of every grant a session of this caller holds.
    held: HashSet<(String, String)>,
    waiters: usize,
    /// Grant-rate tokens left, refilled at `grants_per_s` up to `grant_burst`.
    bucket: f64,
    refilled: Option<Instant>,
}

impl Usage {
    fn idle(&self) -> bool {
        self.sessions.is_empty()
            && self.sessions_reserved == 0
            && self.held.is_empty()
            && self.waiters == 0
    }
}

#[derive(Default)]
struct State {
    by_caller: HashMap<String, Usage>,
    /// Backend session id -> its caller.
    session_caller: HashMap<String, String>,
}

/// Every caller's use of this server.
pub struct Callers {
    limits: CallerLimits,
    state: Mutex<State>,
    refusals: prometheus::IntCounterVec,
}

impl Callers {
    pub fn new(limits: CallerLimits, refusals: prometheus::IntCounterVec) -> Arc<Self> {
        for l in limit::ALL {
            refusals.with_label_values(&[l]).inc_by(0);
        }
        Arc::new(Self {
            limits,
            state: Mutex::new(State::default()),
            refusals,
        })
    }

    pub fn limits(&self) -> CallerLimits {
        self.limits
    }

    fn refuse(&self, caller: &str, limit: &'static str, in_use: usize, max: usize) -> LockError {
        self.refusals.with_label_values(&[limit]).inc();
        tracing::warn!(
            event = "caller_limit_reached",
            alert = true,
            caller_certificate = caller,
            limit,
            in_use,
            max,
            "refused: this caller reached its per-caller bound"
        );
        LockError::CallerLimitReached {
            limit,
            in_use: in_use as u64,
            max: max as u64,
        }
    }

    /// A place for one more session of `caller`, held until [`SessionReservation::created`] or
    /// dropped (a failed or abandoned create).
    pub fn reserve_session(
        self: &Arc<Self>,
        caller: &str,
    ) -> Result<SessionReservation, LockError> {
        let mut state = self.state.lock().expect("callers");
        let usage = state.by_caller.entry(caller.to_string()).or_default();
        let in_use = usage.sessions.len() + usage.sessions_reserved;
        if in_use >= self.limits.sessions {
            drop(state);
            return Err(self.refuse(caller, limit::SESSIONS, in_use, self.limits.sessions));
        }
        usage.sessions_reserved += 1;
        Ok(SessionReservation {
            callers: Arc::clone(self),
            caller: caller.to_string(),
            done: false,
        })
    }

    /// A session ended (closed, expired, found gone): it and its grants no longer count.
    pub fn session_ended(&self, session_id: &str) {
        let mut state = self.state.lock().expect("callers");
        let Some(caller) = state.session_caller.remove(session_id) else {
            return;
        };
        if let Some(usage) = state.by_caller.get_mut(&caller) {
            usage.sessions.remove(session_id);
            usage.held.retain(|(s, _)| s != session_id);
            if usage.idle() {
                state.by_caller.remove(&caller);
            }
        }
    }

    /// Before asking the backend for `key` on `session_id`: free if the session holds it already
    /// (a re-acquire); otherwise within the caller's held keys and its grant rate.
    pub fn may_acquire(&self, caller: &str, session_id: &str, key: &str) -> Result<(), LockError> {
        self.may_acquire_at(caller, session_id, key, Instant::now())
    }

    /// [`Callers::may_acquire`] with the grant-rate bucket refilled up to `now` (the tests give
    /// their own instants, so that a slow machine cannot refill a token between two calls).
    fn may_acquire_at(
        &self,
        caller: &str,
        session_id: &str,
        key: &str,
        now: Instant,
    ) -> Result<(), LockError> {
        let mut state = self.state.lock().expect("callers");
        let usage = state.by_caller.entry(caller.to_string()).or_default();
        if usage
            .held
            .contains(&(session_id.to_string(), key.to_string()))
        {
            return Ok(());
        }
        let held = usage.held.len();
        if held >= self.limits.held_keys {
            drop(state);
            return Err(self.refuse(caller, limit::HELD_KEYS, held, self.limits.held_keys));
        }
        let burst = f64::from(self.limits.grant_burst);
        usage.bucket = match usage.refilled {
            None => burst,
            Some(at) => (usage.bucket
                + now.saturating_duration_since(at).as_secs_f64()
                    * f64::from(self.limits.grants_per_s))
            .min(burst),
        };
        usage.refilled = Some(now);
        if usage.bucket < 1.0 {
            drop(state);
            return Err(self.refuse(
                caller,
                limit::GRANT_RATE,
                self.limits.grants_per_s as usize,
                self.limits.grants_per_s as usize,
            ));
        }
        Ok(())
    }

    /// `key` granted to `session_id` of `caller`; a new grant (`minted`) spends a rate token.
    pub fn granted(&self, caller: &str, session_id: &str, key: &str, minted: bool) {
        let mut state = self.state.lock().expect("callers");
        state
            .session_caller
            .entry(session_id.to_string())
            .or_insert_with(|| caller.to_string());
        let usage = state.by_caller.entry(caller.to_string()).or_default();
        usage.held.insert((session_id.to_string(), key.to_string()));
        if minted {
            usage.bucket -= 1.0;
        }
    }

    /// `key` no longer held by `session_id` (released, or reported not held).
    pub fn released(&self, session_id: &str, key: &str) {
        let mut state = self.state.lock().expect("callers");
        let Some(caller) = state.session_caller.get(session_id).cloned() else {
            return;
        };
        if let Some(usage) = state.by_caller.get_mut(&caller) {
            usage
                .held
                .remove(&(session_id.to_string(), key.to_string()));
        }
    }

    /// One more parked waiter of `caller`, counted until the slot is dropped.
    pub fn park(self: &Arc<Self>, caller: &str) -> Result<WaiterSlot, LockError> {
        let mut state = self.state.lock().expect("callers");
        let usage = state.by_caller.entry(caller.to_string()).or_default();
        if usage.waiters >= self.limits.waiters {
            let in_use = usage.waiters;
            drop(state);
            return Err(self.refuse(caller, limit::WAITERS, in_use, self.limits.waiters));
        }
        usage.waiters += 1;
        Ok(WaiterSlot {
            callers: Arc::clone(self),
            caller: caller.to_string(),
        })
    }

    /// (open sessions, held keys, parked waiters) of `caller`: tests and introspection.
    pub fn usage(&self, caller: &str) -> (usize, usize, usize) {
        let state = self.state.lock().expect("callers");
        state
            .by_caller
            .get(caller)
            .map_or((0, 0, 0), |u| (u.sessions.len(), u.held.len(), u.waiters))
    }
}

/// A session being created for a caller: [`SessionReservation::created`] counts it; dropped
/// without, the place is given back.
pub struct SessionReservation {
    callers: Arc<Callers>,
    caller: String,
    done: bool,
}

impl SessionReservation {
    pub fn created(mut self, session_id: &str) {
        let mut state = self.callers.state.lock().expect("callers");
        state
            .session_caller
            .insert(session_id.to_string(), self.caller.clone());
        let usage = state.by_caller.entry(self.caller.clone()).or_default();
        usage.sessions_reserved -= 1;
        usage.sessions.insert(session_id.to_string());
        self.done = true;
    }
}

impl Drop for SessionReservation {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        let mut state = self.callers.state.lock().expect("callers");
        if let Some(usage) = state.by_caller.get_mut(&self.caller) {
            usage.sessions_reserved -= 1;
            if usage.idle() {
                state.by_caller.remove(&self.caller);
            }
        }
    }
}

/// A parked waiter of one caller; dropping it (however the call ends) gives the place back.
pub struct WaiterSlot {
    callers: Arc<Callers>,
    caller: String,
}

impl Drop for WaiterSlot {
    fn drop(&mut self) {
        let mut state = self.callers.state.lock().expect("callers");
        if let Some(usage) = state.by_caller.get_mut(&self.caller) {
            usage.waiters -= 1;
            if usage.idle() {
                state.by_caller.remove(&self.caller);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn callers(limits: CallerLimits) -> Arc<Callers> {
        let registry = service_kit::Metrics::default();
        Callers::new(limits, registry.counter_vec("refusals", "test", &["limit"]))
    }

    const SMALL: CallerLimits = CallerLimits {
        sessions: 2,
        held_keys: 2,
        waiters: 2,
        grants_per_s: 1,
        grant_burst: 3,
    };

    fn limit_of(e: LockError) -> &'static str {
        match e {
            LockError::CallerLimitReached { limit, .. } => limit,
            other => panic!("expected a caller limit, got {other:?}"),
        }
    }

    #[test]
    fn each_bound_holds_per_caller_and_frees_when_the_use_ends() {
        let c = callers(SMALL);
        // One instant for every rate decision below: no token refills between two calls however
        // slow the machine (the refill itself: `the_grant_rate_refills_with_time`).
        let t0 = Instant::now();
        let may_acquire =
            |caller: &str, session: &str, key: &str| c.may_acquire_at(caller, session, key, t0);
        c.reserve_session("a").unwrap().created("s1");
        c.reserve_session("a").unwrap().created("s2");
        assert_eq!(
            limit_of(c.reserve_session("a").err().unwrap()),
            limit::SESSIONS
        );
        // An abandoned create gives its place back; another caller is unaffected.
        drop(c.reserve_session("b").unwrap());
        c.reserve_session("b").unwrap().created("t1");

        for key in ["payout:1", "payout:2"] {
            may_acquire("a", "s1", key).unwrap();
            c.granted("a", "s1", key, true);
        }
        assert_eq!(
            limit_of(may_acquire("a", "s1", "payout:3").unwrap_err()),
            limit::HELD_KEYS
        );
        // A re-acquire of a held key is free.
        may_acquire("a", "s1", "payout:1").unwrap();
        c.released("s1", "payout:1");
        may_acquire("a", "s1", "payout:3").unwrap();
        c.granted("a", "s1", "payout:3", true);
        // Three mints spent the burst of three; the rate refills one a second.
        c.released("s1", "payout:2");
        assert_eq!(
            limit_of(may_acquire("a", "s1", "payout:4").unwrap_err()),
            limit::GRANT_RATE
        );
        may_acquire("b", "t1", "payout:4").unwrap();

        let w1 = c.park("a").unwrap();
        let _w2 = c.park("a").unwrap();
        assert_eq!(limit_of(c.park("a").err().unwrap()), limit::WAITERS);
        let _other = c.park("b").unwrap();
        drop(w1);
        let _w3 = c.park("a").unwrap();

        c.session_ended("s1");
        c.session_ended("s2");
        assert_eq!(c.usage("a"), (0, 0, 2));
        c.reserve_session("a").unwrap().created("s3");
    }

    #[test]
    fn the_grant_rate_refills_with_time_up_to_the_burst() {
        let c = callers(SMALL);
        c.reserve_session("a").unwrap().created("s1");
        let t0 = Instant::now();
        let mint = |key: &str, at: Instant| {
            let r = c.may_acquire_at("a", "s1", key, at);
            if r.is_ok() {
                c.granted("a", "s1", key, true);
                c.released("s1", key);
            }
            r
        };
        for i in 0..3 {
            mint(&format!("payout:{i}"), t0).unwrap();
        }
        assert_eq!(
            limit_of(mint("payout:3", t0).unwrap_err()),
            limit::GRANT_RATE
        );
        // Half a second refills half a token: still refused; a whole second, one grant.
        let half = t0 + Duration::from_millis(500);
        assert_eq!(
            limit_of(mint("payout:3", half).unwrap_err()),
            limit::GRANT_RATE
        );
        let one = t0 + Duration::from_millis(1_000);
        mint("payout:3", one).unwrap();
        assert_eq!(
            limit_of(mint("payout:4", one).unwrap_err()),
            limit::GRANT_RATE
        );
        // An hour idle refills the burst, no more.
        let later = one + Duration::from_secs(3_600);
        for i in 10..13 {
            mint(&format!("payout:{i}"), later).unwrap();
        }
        assert_eq!(
            limit_of(mint("payout:13", later).unwrap_err()),
            limit::GRANT_RATE
        );
    }
}
