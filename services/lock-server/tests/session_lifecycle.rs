//! The session lifecycle of spec 2.4 (issue 19, section 2), against REAL etcd and REAL PostgreSQL
//! (testkit): the server view ACTIVE -> SUSPECT -> EXPIRED or back to ACTIVE, CLOSED, as Describe
//! and /metrics show it; and the grace period after a failover, in both backends: an etcd leader
//! election (etcd's own lessor renews every lease) and lockdb coming back after an outage (the
//! lock-server's grace statement), each with its control.

use std::time::{Duration, Instant};

use lock_client::{Acquired, LockClient, Session};
use lock_server::backend::Backend;
use lock_server::session::{SessionState, CLIENT_KEEP_ALIVES_PER_TTL, SUSPECT_SLACK_MS};
use lock_server::BackendConfig;
use payout_proto::lock as pb;
use testkit::Stack;

mod support;
use support::{
    backend, grant, lockdb, on_three_etcd_members, start_with, unix_now_ms, Kind, Server,
};

/// One keep-alive on the wire, the session's own background ones stopped: its send time is the
/// last keep-alive the server answered for the session.
async fn keep_alive_once(
    client: &LockClient,
    session: &Session,
    vouch: Vec<pb::Handle>,
) -> Instant {
    let sent = Instant::now();
    let answer = client
        .rpc()
        .keep_alive(pb::KeepAliveRequest {
            session_id: session.id().to_string(),
            vouch,
        })
        .await
        .expect("keep-alive answered")
        .into_inner();
    assert!(
        answer.not_held.is_empty() && !answer.unvouched,
        "{answer:?}"
    );
    sent
}

/// Stops the session's background keep-alives and sends one more: returns its send time.
async fn last_keep_alive(client: &LockClient, session: &Session) -> Instant {
    session.stop_keep_alive();
    // A background keep-alive already in flight lands first.
    tokio::time::sleep(Duration::from_millis(100)).await;
    keep_alive_once(client, session, Vec::new()).await
}

/// Describe's view of `key`: None when free, else the holder session's state. A failed call (the
/// backend failing over) is `Err`.
async fn holder_state(client: &LockClient, key: &str) -> Result<Option<String>, String> {
    let d = client.describe(key).await.map_err(|e| e.to_string())?;
    Ok(d.held.then_some(d.holder_session_state))
}

/// The sum of the samples of `name` in Prometheus text whose labels include every `labels` pair.
fn metric(text: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(&format!("{name}{{")) || l.starts_with(&format!("{name} ")))
        .filter(|l| {
            labels
                .iter()
                .all(|(k, v)| l.contains(&format!("{k}=\"{v}\"")))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

fn transitions(s: &Server, from: SessionState, to: SessionState, backend: &str) -> f64 {
    metric(
        &s.server.metrics.render(),
        "lock_session_transitions_total",
        &[
            ("from", from.as_str()),
            ("to", to.as_str()),
            ("backend", backend),
        ],
    )
}

/// The server judges SUSPECT by the lock-client's own cadence.
#[test]
fn the_server_reads_the_clients_keep_alive_cadence() {
    assert_eq!(CLIENT_KEEP_ALIVES_PER_TTL, lock_client::KEEP_ALIVE_PER_TTL);
    // A healthy client's keep-alive is never later than one interval plus the slack, and a
    // session is SUSPECT well before it expires even at the shortest TTL.
    let ttl = Duration::from_millis(lock_server::service::SESSION_TTL_MS_MIN);
    assert!(
        lock_server::session::suspect_after(ttl) < ttl - lock_client::LOCAL_DEADLINE_MARGIN / 2
    );
}

// ---------------------------------------------------------------------------------------------
// ACTIVE -> SUSPECT -> ACTIVE -> SUSPECT -> EXPIRED; CLOSED; a healthy session stays ACTIVE

const TTL: Duration = Duration::from_secs(3);

async fn session_states(kind: Kind) {
    // The backend label on /metrics.
    let label = match kind {
        Kind::Etcd => "etcd",
        Kind::Postgres => "postgres",
    };
    let s = start_with(backend(kind, "lifecycle").await).await;
    let healthy = s.client.open_session("healthy", TTL).await.unwrap();
    let _h = grant(&healthy, "payout:healthy").await;
    let a = s.client.open_session("worker-a", TTL).await.unwrap();
    let _g = grant(&a, "payout:k").await;
    assert_eq!(
        holder_state(&s.client, "payout:k")
            .await
            .unwrap()
            .as_deref(),
        Some("ACTIVE")
    );

    // Keep-alives stop: ACTIVE until one interval (TTL / 3) plus the slack has passed, then
    // SUSPECT, while the healthy session stays ACTIVE throughout.
    let suspect_after = TTL / CLIENT_KEEP_ALIVES_PER_TTL + Duration::from_millis(SUSPECT_SLACK_MS);
    let sent = last_keep_alive(&s.client, &a).await;
    let suspect_at = loop {
        let state = holder_state(&s.client, "payout:k").await.unwrap();
        let at = sent.elapsed();
        assert_eq!(
            holder_state(&s.client, "payout:healthy")
                .await
                .unwrap()
                .as_deref(),
            Some("ACTIVE"),
            "a session whose client keeps alive is never SUSPECT"
        );
        match state.as_deref() {
            Some("ACTIVE") => assert!(at < suspect_after + Duration::from_millis(500), "{at:?}"),
            Some("SUSPECT") => break at,
            other => panic!("before expiry: {other:?}"),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    println!(
        "{label}: SUSPECT {} ms after the last keep-alive (interval + slack {} ms)",
        suspect_at.as_millis(),
        suspect_after.as_millis()
    );
    assert!(
        suspect_at > suspect_after,
        "SUSPECT too early: {suspect_at:?}"
    );
    testkit::eventually(Duration::from_secs(2), "the SUSPECT gauge", || async {
        let text = s.server.metrics.render();
        (metric(
            &text,
            "lock_sessions",
            &[("state", "SUSPECT"), ("backend", label)],
        ) == 1.0)
            .then_some(())
    })
    .await
    .unwrap();

    // A keep-alive brings it back to ACTIVE.
    let sent = keep_alive_once(&s.client, &a, Vec::new()).await;
    assert_eq!(
        holder_state(&s.client, "payout:k")
            .await
            .unwrap()
            .as_deref(),
        Some("ACTIVE")
    );

    // None again: SUSPECT, then EXPIRED (the key is free, by the backend's decision).
    let mut seen_suspect = false;
    let expired_at = loop {
        match holder_state(&s.client, "payout:k")
            .await
            .unwrap()
            .as_deref()
        {
            Some("SUSPECT") => seen_suspect = true,
            Some("ACTIVE") => assert!(!seen_suspect, "back to ACTIVE without a keep-alive"),
            Some(other) => panic!("{other}"),
            None => break sent.elapsed(),
        }
        assert!(sent.elapsed() < TTL * 3, "never expired");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(seen_suspect);
    println!(
        "{label}: expired {} ms after the last keep-alive (TTL {} ms)",
        expired_at.as_millis(),
        TTL.as_millis()
    );
    assert!(
        expired_at >= TTL - Duration::from_millis(100),
        "{expired_at:?}"
    );

    // A clean close: CLOSED.
    let b = s.client.open_session("worker-b", TTL).await.unwrap();
    b.close().await.unwrap();

    use SessionState::*;
    testkit::eventually(
        Duration::from_secs(5),
        "the transitions on /metrics",
        || async {
            let counts = [
                transitions(&s, Active, Suspect, label),
                transitions(&s, Suspect, Active, label),
                transitions(&s, Suspect, Expired, label),
                transitions(&s, Active, Closed, label),
            ];
            (counts == [2.0, 1.0, 1.0, 1.0]).then_some(())
        },
    )
    .await
    .unwrap_or_else(|e| {
        panic!(
            "{e}: {:?}",
            s.server
                .metrics
                .render()
                .lines()
                .filter(|l| l.starts_with("lock_session"))
                .collect::<Vec<_>>()
        )
    });
    let text = s.server.metrics.render();
    assert_eq!(
        metric(
            &text,
            "lock_sessions",
            &[("state", "ACTIVE"), ("backend", label)]
        ),
        1.0,
        "only the healthy session is live"
    );
    assert_eq!(
        metric(
            &text,
            "lock_sessions",
            &[("state", "SUSPECT"), ("backend", label)]
        ),
        0.0
    );
    assert_eq!(s.server.service.session_transitions(Active, Suspect), 2);
    s.server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_session_states_active_suspect_expired_closed() {
    session_states(Kind::Etcd).await;
}
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_session_states_active_suspect_expired_closed() {
    session_states(Kind::Postgres).await;
}

// ---------------------------------------------------------------------------------------------
// The grace period after an etcd leader election

/// Polls Describe until `key` is free: when, and every state seen on the way (in order, deduped).
async fn until_free(client: &LockClient, key: &str, limit: Duration) -> (Instant, Vec<String>) {
    let started = Instant::now();
    let mut seen: Vec<String> = Vec::new();
    loop {
        match holder_state(client, key).await {
            Ok(None) => return (Instant::now(), seen),
            Ok(Some(state)) => {
                if seen.last() != Some(&state) {
                    seen.push(state);
                }
            }
            // The lock-server failing over to another member: ask again.
            Err(_) => {}
        }
        assert!(
            started.elapsed() < limit,
            "{key} still held after {limit:?}: {seen:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// etcd's lessor renews every lease to its full TTL (plus an election timeout) when a new leader
/// is elected (`Promote`), so the grace period of spec 2.4 is etcd's own; this proves it on a real
/// three-member cluster. Control first, on the same cluster with no election: a session that sends
/// no keep-alive is lost at its original expiry. Then a session whose remaining TTL is short
/// (one second of four), no keep-alive, the leader killed: the grant survives past its original
/// expiry, is shown ACTIVE (grace) after having been SUSPECT, another client cannot take it, and
/// it is lost about one TTL after the election. A second such session that sends one keep-alive
/// inside the grace period, after its original expiry, still holds its grant.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_a_leader_election_gives_every_session_one_full_ttl() {
    const TTL: Duration = Duration::from_secs(4);
    let (stack, leader, s) = on_three_etcd_members("/grace/").await;
    let other = s
        .client
        .open_session("other", Duration::from_secs(30))
        .await
        .unwrap();

    // Control: no election, no keep-alive: lost at the original expiry.
    let c = s.client.open_session("control", TTL).await.unwrap();
    let _cg = grant(&c, "payout:control").await;
    let sent = last_keep_alive(&s.client, &c).await;
    let (lost, _) = until_free(&s.client, "payout:control", TTL * 3).await;
    let control_ms = lost.duration_since(sent).as_millis() as i64;
    println!("control (no election): lost {control_ms} ms after its last keep-alive (TTL 4000 ms)");
    assert!(
        (3_500..=5_000).contains(&control_ms),
        "without an election the lease ends at its TTL: {control_ms} ms"
    );

    // The graced session, and one that will resume inside the grace period.
    let a = s.client.open_session("graced", TTL).await.unwrap();
    let ga = grant(&a, "payout:graced").await;
    let b = s.client.open_session("resumes", TTL).await.unwrap();
    let gb = grant(&b, "payout:resumes").await;
    b.stop_keep_alive();
    let sent = last_keep_alive(&s.client, &a).await;
    let b_vouch = pb::Handle {
        key: "payout:resumes".into(),
        owner: "resumes".into(),
        session_id: b.id().to_string(),
        token: gb.token().get(),
    };
    keep_alive_once(&s.client, &b, Vec::new()).await;
    let original_expiry = sent + TTL;
    // SUSPECT before the election.
    testkit::eventually(
        Duration::from_secs(3),
        "SUSPECT before the election",
        || async {
            (holder_state(&s.client, "payout:graced")
                .await
                .ok()?
                .as_deref()
                == Some("SUSPECT"))
            .then_some(())
        },
    )
    .await
    .unwrap();

    // One second of the lease left: kill the leader.
    tokio::time::sleep(
        original_expiry
            .saturating_duration_since(Instant::now())
            .saturating_sub(Duration::from_secs(1)),
    )
    .await;
    let killed_at = Instant::now();
    stack.etcd.members[leader].process.kill().unwrap();
    let elected_at = testkit::eventually(Duration::from_secs(15), "a new leader", || async {
        stack
            .etcd
            .leader()
            .await
            .ok()
            .filter(|l| *l != leader)
            .map(|_| Instant::now())
    })
    .await
    .unwrap();
    println!(
        "killed leader m{leader} {} ms before the original expiry; new leader {} ms after the kill",
        original_expiry.duration_since(killed_at).as_millis(),
        elected_at.duration_since(killed_at).as_millis()
    );

    // Past the original expiry: still held, shown ACTIVE (grace), not available to another.
    tokio::time::sleep(
        (original_expiry + Duration::from_millis(500)).saturating_duration_since(Instant::now()),
    )
    .await;
    // The lock-server shows the grace period once it has noticed the election (its sweep reads
    // the new leader's raft term); until then the session may still read SUSPECT. Never free.
    let mut before_grace: Vec<String> = Vec::new();
    let graced_at = loop {
        match holder_state(&s.client, "payout:graced").await {
            Ok(Some(state)) if state == "ACTIVE" => break Instant::now(),
            Ok(Some(state)) => before_grace.push(state),
            Ok(None) => panic!("lost past its original expiry before the grace period"),
            Err(_) => {}
        }
        assert!(
            original_expiry.elapsed() < Duration::from_secs(5),
            "never shown ACTIVE in the grace period: {before_grace:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    before_grace.dedup();
    println!(
        "shown ACTIVE (grace) {} ms past the original expiry; before that {:?}",
        graced_at.duration_since(original_expiry).as_millis(),
        {
            before_grace.dedup();
            before_grace
        }
    );
    assert!(graced_at > original_expiry);
    match other
        .acquire("payout:graced", Duration::ZERO)
        .await
        .unwrap()
    {
        Acquired::NotAcquired { holder_owner, .. } => assert_eq!(holder_owner, "graced"),
        Acquired::Granted(_) => panic!("the graced grant was taken inside the grace period"),
    }
    // The session that resumes: one keep-alive after its original expiry, inside the grace
    // period, and its grant is still its own.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let resumed_after_ms = Instant::now().duration_since(original_expiry).as_millis();
    keep_alive_once(&s.client, &b, vec![b_vouch]).await;
    println!("the resuming session kept its grant with a keep-alive {resumed_after_ms} ms after its original expiry");

    let (lost, seen) = until_free(&s.client, "payout:graced", TTL * 4).await;
    let past_original_ms = lost.duration_since(original_expiry).as_millis() as i64;
    let after_election_ms = lost.duration_since(elected_at).as_millis() as i64;
    println!(
        "graced: held {past_original_ms} ms past its original expiry, lost {after_election_ms} ms after the election (TTL 4000 ms); states seen {seen:?}"
    );
    assert!(
        past_original_ms >= 2_000,
        "the election must renew the lease: lost only {past_original_ms} ms past its original expiry"
    );
    assert!(
        (3_500..=6_500).contains(&after_election_ms),
        "lost about one TTL (plus etcd's election timeout) after the election: {after_election_ms} ms"
    );
    assert!(seen.contains(&"ACTIVE".to_string()), "{seen:?}");
    // Lost after the grace: another client takes it, with a higher token.
    match other
        .acquire("payout:graced", Duration::ZERO)
        .await
        .unwrap()
    {
        Acquired::Granted(g) => assert!(g.token() > ga.token()),
        Acquired::NotAcquired { holder_owner, .. } => panic!("still held by {holder_owner}"),
    }
    let text = s.server.metrics.render();
    let graces = metric(
        &text,
        "lock_grace_periods_total",
        &[("backend", "etcd"), ("cause", "leader_elected")],
    );
    assert!(graces >= 1.0, "the election was noticed: {graces}");
    assert!(
        s.server
            .service
            .session_transitions(SessionState::Suspect, SessionState::Active)
            >= 1,
        "the grace period showed the SUSPECT session ACTIVE"
    );
    s.server.stop().await;
}

// ---------------------------------------------------------------------------------------------
// The grace period after lockdb comes back from an outage

/// What one outage run measured.
struct Outage {
    /// From lockdb answering again to the graced key being free, or taken by another client.
    freed_after_back_ms: i64,
    /// From the graced session's original expiry (`expires_at` before the outage) to the same.
    freed_past_original_ms: i64,
}

/// A session whose keep-alives stop (its grant SUSPECT), lockdb shut down before the session's
/// expiry and started again one second after it. `grace` off is the negative control (the
/// test-only switch; no setting of the binary reaches it).
async fn lockdb_outage(grace: bool) -> Outage {
    let stack = Stack::builder().start().expect("a stack of its own");
    let (admin, login) = lockdb(&stack).await;
    let s = start_with(BackendConfig::Postgres {
        database_url: login,
    })
    .await;
    let Backend::Postgres(pg) = s.server.service.backend() else {
        unreachable!()
    };
    pg.set_grace_period_enabled_for_tests(grace);
    let label = if grace { "grace" } else { "no grace (control)" };

    // A session that died long before the outage (TTL 1 s, no keep-alive): never revived.
    let dead = s
        .client
        .open_session("dead", Duration::from_secs(1))
        .await
        .unwrap();
    let _dg = grant(&dead, "payout:dead").await;
    dead.stop_keep_alive();

    let a = s.client.open_session("graced", TTL).await.unwrap();
    let ga = grant(&a, "payout:graced").await;
    last_keep_alive(&s.client, &a).await;
    let expiry_of = |owner: &'static str| {
        let admin = admin.clone();
        async move {
            let pool = sqlx::PgPool::connect(&admin).await.unwrap();
            let (expires, grace_until): (i64, Option<i64>) = sqlx::query_as(
                "SELECT (extract(epoch FROM expires_at) * 1000)::bigint, \
                        (extract(epoch FROM grace_until) * 1000)::bigint \
                 FROM lock_session WHERE owner = $1",
            )
            .bind(owner)
            .fetch_one(&pool)
            .await
            .unwrap();
            pool.close().await;
            (expires, grace_until)
        }
    };
    let (original_expiry, _) = expiry_of("graced").await;
    let (dead_expiry, _) = expiry_of("dead").await;
    testkit::eventually(
        Duration::from_secs(3),
        "SUSPECT before the outage",
        || async {
            (holder_state(&s.client, "payout:graced")
                .await
                .ok()?
                .as_deref()
                == Some("SUSPECT"))
            .then_some(())
        },
    )
    .await
    .unwrap();
    testkit::eventually(
        Duration::from_secs(3),
        "the dead session expired",
        || async {
            holder_state(&s.client, "payout:dead")
                .await
                .ok()?
                .is_none()
                .then_some(())
        },
    )
    .await
    .unwrap();

    // lockdb goes away 1.4 s before the session's expiry (fast shutdown: SIGINT) and comes back
    // one second after it.
    tokio::time::sleep(Duration::from_millis(
        (original_expiry - 1_400 - unix_now_ms()).max(0) as u64,
    ))
    .await;
    stack.main.process.terminate_with(2).unwrap();
    let down_at_ms = unix_now_ms();
    tokio::time::sleep(Duration::from_millis(
        (original_expiry + 1_000 - unix_now_ms()).max(0) as u64,
    ))
    .await;
    stack.main.process.restart().unwrap();
    stack.main.wait_ready().unwrap();
    let back_at_ms = unix_now_ms();
    println!(
        "{label}: lockdb down {} ms before the session's expiry, back {} ms after it",
        original_expiry - down_at_ms,
        back_at_ms - original_expiry
    );

    let other = testkit::eventually(
        Duration::from_secs(10),
        "a session after the outage",
        || async {
            s.client
                .open_session("other", Duration::from_secs(30))
                .await
                .ok()
        },
    )
    .await
    .unwrap();
    let freed_at_ms = if grace {
        // Held past its original expiry, ACTIVE in the grace period, not available to another;
        // the session that died before the outage was not revived.
        assert_eq!(
            holder_state(&s.client, "payout:graced")
                .await
                .unwrap()
                .as_deref(),
            Some("ACTIVE")
        );
        match other
            .acquire("payout:graced", Duration::ZERO)
            .await
            .unwrap()
        {
            Acquired::NotAcquired { holder_owner, .. } => assert_eq!(holder_owner, "graced"),
            Acquired::Granted(_) => panic!("the graced grant was taken inside the grace period"),
        }
        let (graced_expiry, grace_until) = expiry_of("graced").await;
        assert!(grace_until.is_some() && graced_expiry >= grace_until.unwrap());
        assert_eq!(
            expiry_of("dead").await,
            (dead_expiry, None),
            "a session that expired before the outage is not revived"
        );
        let _dead_key = grant(&other, "payout:dead").await;
        let (lost, seen) = until_free(&s.client, "payout:graced", TTL * 3).await;
        println!("{label}: states seen after lockdb came back {seen:?}");
        let lost_ms = unix_now_ms() - lost.elapsed().as_millis() as i64;
        match other
            .acquire("payout:graced", Duration::ZERO)
            .await
            .unwrap()
        {
            Acquired::Granted(g) => assert!(g.token() > ga.token()),
            Acquired::NotAcquired { holder_owner, .. } => panic!("still held by {holder_owner}"),
        }
        let text = s.server.metrics.render();
        assert!(
            metric(
                &text,
                "lock_grace_periods_total",
                &[("backend", "postgres"), ("cause", "database_back")]
            ) >= 1.0
        );
        assert!(
            metric(
                &text,
                "lock_grace_sessions_total",
                &[("backend", "postgres")]
            ) >= 1.0
        );
        lost_ms
    } else {
        // Evicted at once: the first acquire after lockdb's return takes the key.
        let taken = match other
            .acquire("payout:graced", Duration::ZERO)
            .await
            .unwrap()
        {
            Acquired::Granted(g) => g,
            Acquired::NotAcquired { holder_owner, .. } => {
                panic!(
                    "without the grace period the expired session still holds it ({holder_owner})"
                )
            }
        };
        assert!(taken.token() > ga.token());
        let text = s.server.metrics.render();
        assert_eq!(metric(&text, "lock_grace_periods_total", &[]), 0.0);
        unix_now_ms()
    };
    s.server.stop().await;
    Outage {
        freed_after_back_ms: freed_at_ms - back_at_ms,
        freed_past_original_ms: freed_at_ms - original_expiry,
    }
}

/// lockdb's clock runs on through an outage while no client can keep alive; when it answers
/// again the lock-server gives every session that was alive at its last contact one full TTL from
/// the database's clock (one statement), so the outage does not evict every client at once. A
/// client that sent no keep-alive through the outage keeps its grant through the grace period and
/// loses it after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_lockdb_back_after_an_outage_gives_every_session_one_full_ttl() {
    let o = lockdb_outage(true).await;
    println!(
        "grace: the grant was held {} ms past its original expiry and freed {} ms after lockdb came back (TTL {} ms)",
        o.freed_past_original_ms,
        o.freed_after_back_ms,
        TTL.as_millis()
    );
    assert!(
        o.freed_past_original_ms >= TTL.as_millis() as i64,
        "held at least one TTL past its original expiry: {} ms",
        o.freed_past_original_ms
    );
    assert!(
        (TTL.as_millis() as i64 - 300..=TTL.as_millis() as i64 + 2_000)
            .contains(&o.freed_after_back_ms),
        "freed about one TTL after lockdb came back: {} ms",
        o.freed_after_back_ms
    );
}

/// Negative control: the same outage with the grace period switched off (test-only setter): the
/// session whose `expires_at` passed during the outage is gone the moment lockdb answers, and the
/// first acquire after it takes the key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn negative_control_without_the_grace_period_lockdb_back_evicts_at_once() {
    let o = lockdb_outage(false).await;
    println!(
        "no grace (control): the key was taken {} ms after lockdb came back ({} ms past the original expiry)",
        o.freed_after_back_ms, o.freed_past_original_ms
    );
    assert!(
        o.freed_after_back_ms < 2_000,
        "evicted at once: {} ms",
        o.freed_after_back_ms
    );
}
