//! The session lifecycle of spec 2.4, server view: ACTIVE -> SUSPECT (a heartbeat missed, the
//! session not expired yet) -> EXPIRED, or back to ACTIVE on the next keep-alive; CLOSED on a
//! clean CloseSession. After a backend failover (an etcd leader election, lockdb coming back after
//! an outage) every session is ACTIVE for one full TTL: the grace period.
//!
//! The view is introspection (Describe's `holder_session_state`, the `lock_sessions` gauge and
//! `lock_session_transitions_total`); nothing decides anything from it. Expiry stays the backend's
//! decision (etcd's lease, lockdb's clock): SUSPECT is a name for "a keep-alive is late", never a
//! reason to take a key.
//!
//! - etcd: the last keep-alive of each session is kept in this process ([`Heartbeats`]): etcd
//!   does not tell when a lease was last refreshed. EXPIRED when etcd no longer knows the lease.
//!   The grace period is etcd's own: a new leader's lessor renews every lease to its full TTL
//!   (plus an election timeout); the lock-server notices the election (a higher raft term with a
//!   leader) and shows every session ACTIVE for one TTL from then.
//! - PostgreSQL: the row says it all (`last_heartbeat_at`, `expires_at`, `grace_until`, `state`),
//!   by the database's clock; [`sql_state`] is the same rule as [`classify`].

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use prometheus::{IntCounterVec, IntGaugeVec, Opts};

/// The lock-client's cadence: a keep-alive every TTL / this (`lock_client::KEEP_ALIVE_PER_TTL`;
/// the suite asserts they agree). A session whose last keep-alive is older than one such interval
/// (plus [`SUSPECT_SLACK_MS`]) has missed one.
pub const CLIENT_KEEP_ALIVES_PER_TTL: u32 = 3;
/// How late a keep-alive may arrive before its session is SUSPECT: the request's one-way delay
/// and a loaded 2-core machine's scheduling, so a healthy client is never shown SUSPECT between
/// two keep-alives.
pub const SUSPECT_SLACK_MS: u64 = 250;
/// How often the lock-server reads its sessions' states (the gauge, the transition counters) and
/// probes the backend for a failover (an etcd election, lockdb lost or back).
pub const SWEEP_MS: u64 = 250;

/// One session's state in the server's view.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SessionState {
    Active,
    Suspect,
    Expired,
    Closed,
}

impl SessionState {
    pub const ALL: [SessionState; 4] = [Self::Active, Self::Suspect, Self::Expired, Self::Closed];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Active => "ACTIVE",
            Self::Suspect => "SUSPECT",
            Self::Expired => "EXPIRED",
            Self::Closed => "CLOSED",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|state| state.as_str() == s)
    }

    /// EXPIRED and CLOSED are final.
    pub fn is_final(self) -> bool {
        matches!(self, Self::Expired | Self::Closed)
    }
}

/// How long a session may go without a keep-alive before it is SUSPECT.
pub fn suspect_after(ttl: Duration) -> Duration {
    ttl / CLIENT_KEEP_ALIVES_PER_TTL + Duration::from_millis(SUSPECT_SLACK_MS)
}

/// The state of a session the backend still holds (not expired, not closed), `since_keep_alive`
/// after its last keep-alive, `in_grace` while a failover's grace period covers it.
pub fn classify(ttl: Duration, since_keep_alive: Duration, in_grace: bool) -> SessionState {
    if !in_grace && since_keep_alive > suspect_after(ttl) {
        SessionState::Suspect
    } else {
        SessionState::Active
    }
}

/// [`classify`] for a `lock_session` row aliased `s`, by the database clock: a text column.
pub fn sql_state() -> String {
    format!(
        "CASE WHEN s.state <> 'ACTIVE' THEN s.state \
              WHEN s.expires_at <= clock_timestamp() THEN 'EXPIRED' \
              WHEN s.grace_until IS NOT NULL AND s.grace_until > clock_timestamp() THEN 'ACTIVE' \
              WHEN s.last_heartbeat_at < clock_timestamp() - (s.ttl_ms / {per_ttl} + {slack}) * interval '1 millisecond' THEN 'SUSPECT' \
              ELSE 'ACTIVE' END",
        per_ttl = CLIENT_KEEP_ALIVES_PER_TTL,
        slack = SUSPECT_SLACK_MS,
    )
}

/// etcd: the last keep-alive this process answered for each session, and the last grace period.
/// Only for the view; never read to decide anything.
#[derive(Default)]
pub struct Heartbeats {
    beats: Mutex<HashMap<String, Beat>>,
    grace_started: Mutex<Option<Instant>>,
}

#[derive(Debug, Clone, Copy)]
struct Beat {
    ttl: Duration,
    last: Instant,
    /// When this process first saw the session: a listing of the backend's sessions asked for
    /// before it cannot tell that the session is gone.
    seen_since: Instant,
}

impl Heartbeats {
    /// A keep-alive (or the creation) of `id` was answered now.
    pub fn beat(&self, id: &str, ttl: Duration) {
        let now = Instant::now();
        let mut beats = self.beats.lock().expect("heartbeats");
        let beat = beats.entry(id.to_string()).or_insert(Beat {
            ttl,
            last: now,
            seen_since: now,
        });
        beat.ttl = ttl;
        beat.last = now;
    }

    pub fn forget(&self, id: &str) {
        self.beats.lock().expect("heartbeats").remove(id);
    }

    pub fn tracked(&self) -> usize {
        self.beats.lock().expect("heartbeats").len()
    }

    /// A failover's grace period starts now: every session is ACTIVE for one TTL.
    pub fn start_grace(&self, at: Instant) {
        *self.grace_started.lock().expect("grace") = Some(at);
    }

    fn in_grace(&self, ttl: Duration, now: Instant) -> bool {
        self.grace_started
            .lock()
            .expect("grace")
            .is_some_and(|started| now < started + ttl)
    }

    /// The state of a session still held by the backend, if this process has seen it.
    pub fn state(&self, id: &str) -> Option<SessionState> {
        let beat = *self.beats.lock().expect("heartbeats").get(id)?;
        Some(self.state_of(&beat, Instant::now()))
    }

    /// The state of a session this process has not seen, from what the backend says of it: its
    /// TTL and what is left of it, in whole seconds rounded down (etcd's), so the time since its
    /// last keep-alive is taken a second shorter: generous, as the server view is meant to be.
    pub fn state_from_remaining(&self, ttl: Duration, remaining: Duration) -> SessionState {
        classify(
            ttl,
            ttl.saturating_sub(remaining + Duration::from_secs(1)),
            self.in_grace(ttl, Instant::now()),
        )
    }

    fn state_of(&self, beat: &Beat, now: Instant) -> SessionState {
        classify(
            beat.ttl,
            now.saturating_duration_since(beat.last),
            self.in_grace(beat.ttl, now),
        )
    }

    /// Every tracked session's state, given the backend's live sessions as listed at `asked_at`:
    /// one seen before the listing and missing from it is EXPIRED, and forgotten.
    pub fn sweep(
        &self,
        alive: impl Fn(&str) -> bool,
        asked_at: Instant,
    ) -> Vec<(String, SessionState)> {
        let now = Instant::now();
        let mut beats = self.beats.lock().expect("heartbeats");
        let mut view = Vec::with_capacity(beats.len());
        beats.retain(|id, beat| {
            if beat.seen_since < asked_at && !alive(id) {
                view.push((id.clone(), SessionState::Expired));
                false
            } else {
                view.push((id.clone(), self.state_of(beat, now)));
                true
            }
        });
        view
    }
}

/// The lifecycle's metrics, registered once per server.
#[derive(Clone)]
pub struct SessionMetrics {
    /// `lock_sessions{state,backend}`: live sessions (ACTIVE, SUSPECT) in this server's view.
    pub sessions: IntGaugeVec,
    /// `lock_session_transitions_total{from,to,backend}`.
    pub transitions: IntCounterVec,
    /// `lock_grace_periods_total{backend,cause}`: failovers after which every session was given
    /// one full TTL.
    pub grace_periods: IntCounterVec,
    /// `lock_grace_sessions_total{backend}`: sessions a grace period covered.
    pub grace_sessions: IntCounterVec,
}

impl SessionMetrics {
    pub fn register(metrics: &service_kit::Metrics) -> Self {
        let sessions = IntGaugeVec::new(
            Opts::new(
                "lock_sessions",
                "Live lock sessions in this lock-server's view, by state (ACTIVE, SUSPECT: a keep-alive is late) and backend",
            ),
            &["state", "backend"],
        )
        .expect("valid metric definition");
        metrics
            .registry
            .register(Box::new(sessions.clone()))
            .expect("metric registered once");
        Self {
            sessions,
            transitions: metrics.counter_vec(
                "lock_session_transitions_total",
                "Lock session state transitions seen by this lock-server (spec 2.4: ACTIVE, SUSPECT, EXPIRED, CLOSED)",
                &["from", "to", "backend"],
            ),
            grace_periods: metrics.counter_vec(
                "lock_grace_periods_total",
                "Backend failovers after which every session was treated as ACTIVE for one full TTL (an etcd leader election; lockdb back after an outage)",
                &["backend", "cause"],
            ),
            grace_sessions: metrics.counter_vec(
                "lock_grace_sessions_total",
                "Sessions covered by a grace period",
                &["backend"],
            ),
        }
    }

    pub fn grace(&self, backend: &str, cause: &str, sessions: u64) {
        self.grace_periods
            .with_label_values(&[backend, cause])
            .inc();
        self.grace_sessions
            .with_label_values(&[backend])
            .inc_by(sessions);
    }
}

/// How long a session that ended (EXPIRED, CLOSED) is remembered, so a sweep's reading taken
/// before the end cannot bring it back into the view: far longer than one sweep.
pub const ENDED_KEPT_MS: u64 = 60_000;

/// The last state this server saw of each session it follows, to count transitions.
pub struct Tracker {
    last: Mutex<HashMap<String, Seen>>,
    metrics: SessionMetrics,
    backend: &'static str,
}

#[derive(Debug, Clone, Copy)]
struct Seen {
    state: SessionState,
    at: Instant,
}

impl Tracker {
    pub fn new(metrics: SessionMetrics, backend: &'static str) -> Self {
        Self {
            last: Mutex::new(HashMap::new()),
            metrics,
            backend,
        }
    }

    /// The sessions followed (not ended).
    pub fn followed(&self) -> Vec<String> {
        self.last
            .lock()
            .expect("tracker")
            .iter()
            .filter(|(_, seen)| !seen.state.is_final())
            .map(|(id, _)| id.clone())
            .collect()
    }

    /// One session is now in state `to`: a change is counted and logged. A session seen for the
    /// first time is followed from here (nothing counted); one that ended stays ended (a reading
    /// taken before its end says nothing new).
    pub fn observe(&self, id: &str, to: SessionState) {
        let mut last = self.last.lock().expect("tracker");
        self.observe_locked(&mut last, id, to);
        self.publish(&last);
    }

    fn observe_locked(&self, last: &mut HashMap<String, Seen>, id: &str, to: SessionState) {
        let now = Instant::now();
        let from = match last.get_mut(id) {
            None => {
                last.insert(id.to_string(), Seen { state: to, at: now });
                return;
            }
            Some(seen) if seen.state.is_final() || seen.state == to => return,
            Some(seen) => std::mem::replace(seen, Seen { state: to, at: now }).state,
        };
        self.metrics
            .transitions
            .with_label_values(&[from.as_str(), to.as_str(), self.backend])
            .inc();
        tracing::info!(
            event = "session_state",
            session_id = id,
            from = from.as_str(),
            to = to.as_str(),
            backend = self.backend,
            "lock session state changed"
        );
    }

    /// A sweep's view of the sessions: transitions counted, the gauge set from it, sessions
    /// ended long enough ago forgotten.
    pub fn observe_all(&self, view: Vec<(String, SessionState)>) {
        let mut last = self.last.lock().expect("tracker");
        for (id, state) in &view {
            self.observe_locked(&mut last, id, *state);
        }
        let kept = Duration::from_millis(ENDED_KEPT_MS);
        last.retain(|_, seen| !seen.state.is_final() || seen.at.elapsed() < kept);
        self.publish(&last);
    }

    /// The `lock_sessions` gauge, from the sessions followed.
    fn publish(&self, last: &HashMap<String, Seen>) {
        for state in [SessionState::Active, SessionState::Suspect] {
            let n = last.values().filter(|seen| seen.state == state).count();
            self.metrics
                .sessions
                .with_label_values(&[state.as_str(), self.backend])
                .set(n as i64);
        }
    }

    pub fn transitions(&self, from: SessionState, to: SessionState) -> u64 {
        self.metrics
            .transitions
            .with_label_values(&[from.as_str(), to.as_str(), self.backend])
            .get()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_session_is_suspect_once_a_keep_alive_is_late_unless_in_grace() {
        let ttl = Duration::from_secs(3);
        let late = suspect_after(ttl);
        assert_eq!(late, Duration::from_millis(1_000 + SUSPECT_SLACK_MS));
        assert_eq!(classify(ttl, late, false), SessionState::Active);
        assert_eq!(
            classify(ttl, late + Duration::from_millis(1), false),
            SessionState::Suspect
        );
        assert_eq!(
            classify(ttl, late + Duration::from_millis(1), true),
            SessionState::Active
        );
        assert!(suspect_after(Duration::from_millis(1_000)) < Duration::from_millis(1_000));
    }

    #[test]
    fn transitions_are_counted_once_and_an_ended_session_stays_ended() {
        let metrics = SessionMetrics::register(&service_kit::Metrics::default());
        let t = Tracker::new(metrics, "test");
        t.observe("1", SessionState::Active);
        t.observe_all(vec![("1".into(), SessionState::Suspect)]);
        t.observe_all(vec![("1".into(), SessionState::Suspect)]);
        t.observe_all(vec![("1".into(), SessionState::Active)]);
        t.observe("1", SessionState::Closed);
        t.observe("1", SessionState::Closed);
        // A reading taken before the close does not bring it back, nor count anything.
        t.observe_all(vec![("1".into(), SessionState::Active)]);
        t.observe_all(vec![("1".into(), SessionState::Expired)]);
        use SessionState::*;
        assert_eq!(t.transitions(Active, Suspect), 1);
        assert_eq!(t.transitions(Suspect, Active), 1);
        assert_eq!(t.transitions(Active, Closed), 1);
        assert_eq!(t.transitions(Closed, Active), 0);
        assert_eq!(t.transitions(Active, Expired), 0);
        assert!(t.followed().is_empty());
    }

    #[test]
    fn a_session_missing_from_the_listing_is_expired_only_if_seen_before_it() {
        let h = Heartbeats::default();
        h.beat("old", Duration::from_secs(2));
        let asked_at = Instant::now();
        std::thread::sleep(Duration::from_millis(2));
        h.beat("new", Duration::from_secs(2));
        let mut view = h.sweep(|_| false, asked_at);
        view.sort_by(|a, b| a.0.cmp(&b.0));
        assert_eq!(
            view,
            vec![
                ("new".to_string(), SessionState::Active),
                ("old".to_string(), SessionState::Expired)
            ]
        );
        assert_eq!(h.tracked(), 1);
    }
}
