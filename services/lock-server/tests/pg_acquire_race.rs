//! Issue 35, item 6, settled against REAL PostgreSQL: the lockdb acquire statement racing a session
//! created after its snapshot.
//!
//! The hypothesis held. `ACQUIRE_SQL` (`services/lock-server/src/backend/postgres.rs`) inserts the
//! key's `lock_entry` row and, ON CONFLICT, takes the row over when its holder's session is not
//! alive. Under READ COMMITTED the conflict is arbitrated on the latest committed row (the unique
//! index sees commits made after the statement's snapshot, and the conflicting row is locked and
//! read in its newest version even if the snapshot cannot see it), but the subquery in the
//! `DO UPDATE ... WHERE` reads `lock_session` with the statement's snapshot. The old clause asked
//! `NOT EXISTS (an ACTIVE session with the holder's id)`: a holder whose session was created after
//! the snapshot is absent from it, absence read as "not alive", and the statement took the key
//! from a live session. Two live grants of one key, and the second carried the LOWER token (drawn
//! before the first was even asked for), so the fence's order was inverted too.
//!
//! The fix asks for positive evidence instead: `EXISTS (the holder's session, not ACTIVE)`.
//! EXPIRED and CLOSED are final, so a snapshot that shows one is never stale in the direction that
//! matters; a session the snapshot cannot see is taken as alive, the attempt answers Held, and
//! the backend's re-read (a new snapshot) names the holder. The holder whose lease ran out is
//! still taken over in one statement by the `expired` CTE, whose UPDATE locks the session row and
//! re-checks it in its newest version (EvalPlanQual) before the takeover relies on it.
//!
//! How the race is held, deterministically: a test-only BEFORE INSERT trigger on this test's own
//! lockdb makes the acquire of owner [`HELD_OWNER`] wait on an advisory lock the test holds. A
//! row trigger fires after the statement took its snapshot (and drew its token) and before the
//! insert meets the unique index: exactly the window of the hypothesis. The test waits until
//! PostgreSQL shows that backend waiting for the advisory lock (`pg_locks`), changes the key's
//! state from another lock-server on the same lockdb (a second process: each lock-server's
//! issued-token memory checks only its own grants), then lets the held statement go on.
//!
//! The negative control runs the statement as it was before the fix, from the test, in the same
//! interleavings: it makes two live holders in each race with a session created after its
//! snapshot, and none when the acquiring session was created before it (the control's control:
//! the cause is the snapshot's view of `lock_session`, not the hold).

use std::time::Duration;

use lock_client::{Acquired, ClientError, Session};
use lock_server::BackendConfig;
use sqlx::PgPool;
use testkit::Stack;

mod support;
use support::{grant, lockdb, start_with, Server};

const KEY: &str = "payout:acct-race";
/// The acquirer the trigger holds between its statement's snapshot and its insert.
const HELD_OWNER: &str = "held-acquirer";
/// The advisory lock the held statement waits for (issue 35, item 6); any number unused in
/// the test's own lockdb would do.
const HOLD_LOCK_ID: i64 = 35_006;
/// Sessions' TTL: their clients keep them alive; long, so no session ends by itself mid-race.
const TTL: Duration = Duration::from_secs(10);
/// Upper bound on every step: the held statement reaching the hold, a call being answered. A
/// step past it is a hang (e.g. a lock the fix would have the racers wait on), reported as such.
const STEP_TIMEOUT_MS: u64 = 15_000;

/// The acquire statement before issue 35, item 6 (postgres.rs `ACQUIRE_SQL` at b61e252), kept for
/// the negative control: its takeover clause reads the holder's liveness as the absence of an
/// ACTIVE session row in the statement's snapshot.
const ACQUIRE_SQL_TRUSTING_ITS_SNAPSHOT: &str = r#"
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
RETURNING token
"#;

/// What happens to the key while the held acquire waits between its snapshot and its insert.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Race {
    /// The key is free at the snapshot; a session created after it acquires the key.
    FreeKey,
    /// The key's holder is alive at the snapshot; its lease runs out (lockdb's clock passes its
    /// `expires_at`) and a session created after the snapshot takes the key over.
    HolderExpires,
    /// The key's holder is alive at the snapshot; it closes its session (its entry deleted) and a
    /// session created after the snapshot acquires the key.
    HolderCloses,
    /// Control: the session that acquires the free key was created BEFORE the snapshot.
    SessionTheSnapshotSees,
}

const RACES_WITH_A_FRESH_SESSION: [Race; 3] =
    [Race::FreeKey, Race::HolderExpires, Race::HolderCloses];

/// Who runs the held acquire.
#[derive(Clone, Copy, Debug)]
enum Acquirer {
    /// The lock service, with the product's statement.
    LockService,
    /// The test, with [`ACQUIRE_SQL_TRUSTING_ITS_SNAPSHOT`] (the negative control).
    StatementTrustingItsSnapshot,
}

#[derive(Debug)]
struct Grant {
    who: &'static str,
    session_id: i64,
    token: i64,
}

/// What a race left: every grant of the key in the order it was answered, the key's entry
/// afterwards, and which sessions are alive by lockdb's clock.
#[derive(Debug)]
struct Outcome {
    race: Race,
    grants: Vec<Grant>,
    /// `(session_id, token)` of the key's row.
    entry: Option<(i64, i64)>,
    live_sessions: Vec<i64>,
    /// The held acquirer's answer when it was refused: the holder it was told of.
    held_refused_naming: Option<String>,
}

impl Outcome {
    /// Grants nobody released or revoked whose session is alive: each believes it holds the key.
    /// (A grant ends in these races only with its session.)
    fn live_holders(&self) -> Vec<&Grant> {
        self.grants
            .iter()
            .filter(|g| self.live_sessions.contains(&g.session_id))
            .collect()
    }

    /// The invariant: never two live holders of one key, tokens rise in the order grants are
    /// answered (a later holder's fenced call always outranks an earlier one's), and the key's
    /// entry is the last grant.
    fn assert_one_holder(&self) {
        let live = self.live_holders();
        assert!(
            live.len() <= 1,
            "{:?}: two live holders of {KEY}: {live:?}; the key's entry is {:?}",
            self.race,
            self.entry
        );
        for pair in self.grants.windows(2) {
            assert!(
                pair[0].token < pair[1].token,
                "{:?}: {} was granted after {} with a lower token: {:?}",
                self.race,
                pair[1].who,
                pair[0].who,
                self.grants
            );
        }
        let last = self.grants.last().expect("every race grants the key");
        assert_eq!(
            self.entry,
            Some((last.session_id, last.token)),
            "{:?}: the key's entry is not its last grant {last:?}",
            self.race
        );
    }
}

/// A lockdb as a deployment has it, plus the test-only hold: the acquire of [`HELD_OWNER`] waits
/// for [`HOLD_LOCK_ID`] after its snapshot and before its insert. Returns the owner's pool and
/// the `lock_server` role's URL.
async fn lockdb_with_hold() -> (PgPool, String) {
    let (admin_url, login_url) = lockdb(Stack::shared()).await;
    let admin = PgPool::connect(&admin_url).await.unwrap();
    sqlx::query(&format!(
        "CREATE FUNCTION hold_for_test() RETURNS trigger LANGUAGE plpgsql AS $$ \
         BEGIN \
             IF NEW.owner = '{HELD_OWNER}' THEN \
                 PERFORM pg_advisory_xact_lock_shared({HOLD_LOCK_ID}); \
             END IF; \
             RETURN NEW; \
         END $$"
    ))
    .execute(&admin)
    .await
    .unwrap();
    sqlx::query(
        "CREATE TRIGGER hold_for_test BEFORE INSERT ON lock_entry \
         FOR EACH ROW EXECUTE FUNCTION hold_for_test()",
    )
    .execute(&admin)
    .await
    .unwrap();
    (admin, login_url)
}

/// The lockdb `session_id` of a session (its wire id is `<certificate fingerprint>:<id>`).
fn session_id(session: &Session) -> i64 {
    session
        .id()
        .rsplit_once(':')
        .and_then(|(_, id)| id.parse().ok())
        .unwrap_or_else(|| panic!("{} is not a lockdb session id", session.id()))
}

async fn within<T>(what: &str, step: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_millis(STEP_TIMEOUT_MS), step)
        .await
        .unwrap_or_else(|_| panic!("{what}: no answer within {STEP_TIMEOUT_MS} ms"))
}

/// Waits until a backend of this lockdb waits for the hold's advisory lock: the held statement
/// has its snapshot and has not inserted.
async fn held_statement_waits(admin: &PgPool) {
    testkit::util::eventually(
        Duration::from_millis(STEP_TIMEOUT_MS),
        "the held acquire to wait for the advisory lock",
        || async {
            let waiting: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid \
                 WHERE l.locktype = 'advisory' AND NOT l.granted AND l.objid::bigint = $1 \
                   AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database()) \
                   AND a.wait_event_type = 'Lock' AND a.wait_event = 'advisory'",
            )
            .bind(HOLD_LOCK_ID)
            .fetch_one(admin)
            .await
            .unwrap();
            (waiting == 1).then_some(())
        },
    )
    .await
    .unwrap();
}

/// The held acquire's answer: its token if granted, else the holder it was told of.
type HeldAnswer = Result<i64, String>;

async fn held_acquire(
    acquirer: Acquirer,
    session: Session,
    login: PgPool,
) -> tokio::task::JoinHandle<HeldAnswer> {
    tokio::spawn(async move {
        match acquirer {
            Acquirer::LockService => {
                let answer: Result<Acquired, ClientError> =
                    session.acquire(KEY, Duration::ZERO).await;
                match answer.expect("the held acquire answers") {
                    Acquired::Granted(g) => Ok(g.token().as_i64()),
                    Acquired::NotAcquired { holder_owner, .. } => Err(holder_owner),
                }
            }
            Acquirer::StatementTrustingItsSnapshot => {
                let token: Option<i64> = sqlx::query_scalar(ACQUIRE_SQL_TRUSTING_ITS_SNAPSHOT)
                    .bind(KEY)
                    .bind(HELD_OWNER)
                    .bind(session_id(&session))
                    .fetch_optional(&login)
                    .await
                    .expect("the old statement runs");
                token.ok_or_else(|| "(the statement took nothing)".to_string())
            }
        }
    })
}

/// Runs `race` with the held acquire made by `acquirer`, on a lockdb of its own served by two
/// lock-servers: the held acquirer's and everybody else's.
async fn run(race: Race, acquirer: Acquirer) -> Outcome {
    let (admin, login_url) = lockdb_with_hold().await;
    let backend = || BackendConfig::Postgres {
        database_url: login_url.clone(),
    };
    let held_server: Server = start_with(backend()).await;
    let other_server: Server = start_with(backend()).await;
    let login = PgPool::connect(&login_url).await.unwrap();
    let mut grants = Vec::new();

    let held = held_server
        .client
        .open_session(HELD_OWNER, TTL)
        .await
        .unwrap();
    let holder = match race {
        Race::HolderExpires | Race::HolderCloses => {
            let s = other_server
                .client
                .open_session("holder", TTL)
                .await
                .unwrap();
            let g = grant(&s, KEY).await;
            grants.push(Grant {
                who: "holder",
                session_id: session_id(&s),
                token: g.token().as_i64(),
            });
            Some(s)
        }
        Race::FreeKey | Race::SessionTheSnapshotSees => None,
    };
    let seen_before = match race {
        Race::SessionTheSnapshotSees => Some(
            other_server
                .client
                .open_session("racer", TTL)
                .await
                .unwrap(),
        ),
        Race::FreeKey | Race::HolderExpires | Race::HolderCloses => None,
    };

    let mut hold = admin.acquire().await.unwrap();
    sqlx::query("SELECT pg_advisory_lock($1)")
        .bind(HOLD_LOCK_ID)
        .execute(&mut *hold)
        .await
        .unwrap();
    let held_call = held_acquire(acquirer, held.clone(), login).await;
    held_statement_waits(&admin).await;

    // The held statement has its snapshot. The key's state moves on without it.
    if let Some(s) = &holder {
        match race {
            Race::HolderExpires => {
                // The lease runs out by lockdb's clock, as a holder that stopped keeping alive.
                sqlx::query(
                    "UPDATE lock_session SET expires_at = clock_timestamp() - interval '1 millisecond' \
                     WHERE session_id = $1",
                )
                .bind(session_id(s))
                .execute(&admin)
                .await
                .unwrap();
            }
            Race::HolderCloses => within("the holder's close", s.close()).await.unwrap(),
            Race::FreeKey | Race::SessionTheSnapshotSees => unreachable!(),
        }
    }
    let racer = match seen_before {
        Some(s) => s,
        None => within(
            "a fresh session",
            other_server.client.open_session("racer", TTL),
        )
        .await
        .unwrap(),
    };
    let racer_grant = within("the racer's acquire", grant(&racer, KEY)).await;
    grants.push(Grant {
        who: "racer",
        session_id: session_id(&racer),
        token: racer_grant.token().as_i64(),
    });

    sqlx::query("SELECT pg_advisory_unlock($1)")
        .bind(HOLD_LOCK_ID)
        .execute(&mut *hold)
        .await
        .unwrap();
    let answer = within("the held acquire", held_call).await.unwrap();
    let held_refused_naming = match answer {
        Ok(token) => {
            grants.push(Grant {
                who: HELD_OWNER,
                session_id: session_id(&held),
                token,
            });
            None
        }
        Err(holder) => Some(holder),
    };

    let entry: Option<(i64, i64)> =
        sqlx::query_as("SELECT session_id, token FROM lock_entry WHERE key = $1")
            .bind(KEY)
            .fetch_optional(&admin)
            .await
            .unwrap();
    let live_sessions: Vec<i64> = sqlx::query_scalar(
        "SELECT session_id FROM lock_session WHERE state = 'ACTIVE' AND expires_at > clock_timestamp()",
    )
    .fetch_all(&admin)
    .await
    .unwrap();
    held_server.server.stop().await;
    other_server.server.stop().await;
    Outcome {
        race,
        grants,
        entry,
        live_sessions,
        held_refused_naming,
    }
}

/// The lock service in each race where the key goes to a session created after the held
/// acquire's snapshot: one live holder, the racer, and the held acquire is told so. (Before the
/// fix: "two live holders of acct-race", the held acquirer granted a token below the racer's.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_acquire_racing_a_fresh_session_never_makes_two_holders() {
    for race in RACES_WITH_A_FRESH_SESSION {
        let outcome = run(race, Acquirer::LockService).await;
        outcome.assert_one_holder();
        assert_eq!(
            outcome.held_refused_naming.as_deref(),
            Some("racer"),
            "{outcome:?}"
        );
    }
}

/// The race with a session the held acquire's snapshot can see: one holder, before and after the
/// fix alike.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_acquire_racing_a_session_its_snapshot_sees_never_makes_two_holders() {
    let outcome = run(Race::SessionTheSnapshotSees, Acquirer::LockService).await;
    outcome.assert_one_holder();
    assert_eq!(
        outcome.held_refused_naming.as_deref(),
        Some("racer"),
        "{outcome:?}"
    );
}

/// Negative control: the statement as it was, held the same way, takes the key from the fresh
/// session in every race (two live holders, the later grant's token below the earlier's), and
/// from the session its snapshot sees in none: this harness sees two holders when there are two.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn negative_control_the_statement_trusting_its_snapshot_makes_two_holders() {
    for race in RACES_WITH_A_FRESH_SESSION {
        let outcome = run(race, Acquirer::StatementTrustingItsSnapshot).await;
        let live: Vec<&str> = outcome.live_holders().iter().map(|g| g.who).collect();
        assert_eq!(live, ["racer", HELD_OWNER], "{outcome:?}");
        let racer = &outcome.grants[outcome.grants.len() - 2];
        let held = &outcome.grants[outcome.grants.len() - 1];
        assert!(
            held.token < racer.token,
            "the later grant carries the lower token: {outcome:?}"
        );
        assert_eq!(
            outcome.entry,
            Some((held.session_id, held.token)),
            "{outcome:?}"
        );
    }
    let control = run(
        Race::SessionTheSnapshotSees,
        Acquirer::StatementTrustingItsSnapshot,
    )
    .await;
    control.assert_one_holder();
    assert_eq!(
        control.held_refused_naming.as_deref(),
        Some("(the statement took nothing)"),
        "{control:?}"
    );
}
