//! What every wire property test shares (a real gRPC client against a real server on a real
//! database, with arbitrary field values): hostile values for each kind of field, a count of the
//! panics anywhere in this process (the servers under test run in it, so a handler that panics
//! shows up here even though the runtime keeps serving), snapshots of tables to show that a
//! refused call wrote nothing, a health probe, and a runner that drives async checks from
//! proptest with a bounded wait per call.

use std::collections::BTreeMap;
use std::fmt::Debug;
use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Once;
use std::time::Duration;

use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};

/// One call (or one probe) that takes longer than this is a hang, which fails the case: the
/// longest legitimate wait behind any of our boundaries is a rail call (seconds).
pub const CALL_TIMEOUT_MS: u64 = 20_000;
/// Shrinking re-runs cases against the live server; a few dozen steps already give a readable
/// counterexample without letting a failing run take minutes.
pub const SHRINK_ITERATIONS_MAX: u32 = 64;

static PANICS: AtomicUsize = AtomicUsize::new(0);
thread_local! {
    /// How the calls observed on this thread were answered, by gRPC code: printed after a run and
    /// checked to hold both answers and refusals (a generator that only ever produced bad input
    /// would never reach past the validation it is meant to test). Per thread, because
    /// [`run_cases`] drives its checks with `block_on` on the test's own thread, and tests of one
    /// binary run in parallel.
    static ANSWERS: std::cell::RefCell<BTreeMap<String, u32>> =
        const { std::cell::RefCell::new(BTreeMap::new()) };
}
static HOOK: Once = Once::new();

/// Panics anywhere in this process since the first call (which installs the counting hook; the
/// previous hook still prints the message).
pub fn panics_so_far() -> usize {
    HOOK.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            PANICS.fetch_add(1, Ordering::SeqCst);
            previous(info);
        }));
    });
    PANICS.load(Ordering::SeqCst)
}

/// How often a field is drawn from its valid values, against 1 for each hostile kind: a request
/// has several fields, and one hostile field already stops it at validation, so valid values
/// must dominate for the cases to reach the handlers' deep paths too.
const VALID_WEIGHT: u32 = 40;

/// A text field: mostly `valid`, otherwise empty, blank, a NUL byte (which no PostgreSQL text
/// can hold), other control characters, odd Unicode, exactly `length_max` bytes, one byte over,
/// and more bytes than `length_max` in fewer characters.
pub fn hostile_text(valid: BoxedStrategy<String>, length_max: usize) -> BoxedStrategy<String> {
    prop_oneof![
        VALID_WEIGHT => valid.clone(),
        1 => Just(String::new()),
        1 => Just(" \t ".to_string()),
        1 => valid.clone().prop_map(|v| format!("{v}\0")),
        1 => Just("\0".to_string()),
        1 => "[a-z]{0,3}[\\x01-\\x1f\\x7f]{1,3}[a-z]{0,3}",
        1 => "\\PC{1,12}",
        1 => prop::sample::select(vec!["\u{202e}evil", "\u{feff}", "😀", "e\u{301}", "\u{fffd}", "ß"])
            .prop_map(String::from),
        1 => Just("x".repeat(length_max)),
        1 => Just("x".repeat(length_max + 1)),
        1 => Just("é".repeat(length_max / 2 + 1)),
    ]
    .boxed()
}

/// An unsigned number (tokens, waits, TTLs): mostly `valid`, otherwise 0, 1, the edges of `i64`
/// (what a `bigint` and an etcd revision hold) and of `u64`, or anything.
pub fn hostile_u64(valid: BoxedStrategy<u64>) -> BoxedStrategy<u64> {
    prop_oneof![
        VALID_WEIGHT => valid,
        1 => Just(0u64),
        1 => Just(1u64),
        1 => Just(i64::MAX as u64),
        1 => Just(i64::MAX as u64 + 1),
        1 => Just(u64::MAX),
        1 => any::<u64>(),
    ]
    .boxed()
}

/// A signed number (amounts, balances): mostly `valid`, otherwise 0, -1, the edges of `i64`, or
/// anything.
pub fn hostile_i64(valid: BoxedStrategy<i64>) -> BoxedStrategy<i64> {
    prop_oneof![
        VALID_WEIGHT => valid,
        1 => Just(0i64),
        1 => Just(-1i64),
        1 => Just(i64::MIN),
        1 => Just(i64::MAX),
        1 => any::<i64>(),
    ]
    .boxed()
}

/// A `uint32` field (line numbers, versions): mostly `valid`, otherwise 0, the edge of `int32`
/// (what an `integer` column holds) and of `u32`, or anything.
pub fn hostile_u32(valid: BoxedStrategy<u32>) -> BoxedStrategy<u32> {
    prop_oneof![
        VALID_WEIGHT => valid,
        1 => Just(0u32),
        1 => Just(i32::MAX as u32),
        1 => Just(i32::MAX as u32 + 1),
        1 => Just(u32::MAX),
        1 => any::<u32>(),
    ]
    .boxed()
}

/// An enum field: one of `values` (the defined ones), or unspecified (0), or a number no enum
/// defines.
pub fn hostile_enum(values: &[i32]) -> BoxedStrategy<i32> {
    prop_oneof![
        VALID_WEIGHT => prop::sample::select(values.to_vec()),
        2 => Just(0),
        2 => prop::sample::select(vec![-1, 99, i32::MAX, i32::MIN]),
    ]
    .boxed()
}

/// Row count and a digest of the content, per table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Snapshot(BTreeMap<String, (i64, String)>);

/// Counts and digests `tables` (small test tables: the digest reads every row).
pub async fn snapshot(pool: &sqlx::PgPool, tables: &[&str]) -> Snapshot {
    let mut out = BTreeMap::new();
    for table in tables {
        let row: (i64, String) = sqlx::query_as(&format!(
            "SELECT count(*), md5(coalesce(string_agg(t::text, E'\\n' ORDER BY t::text), '')) FROM {table} t"
        ))
        .fetch_one(pool)
        .await
        .unwrap_or_else(|e| panic!("snapshot of {table}: {e}"));
        out.insert(table.to_string(), row);
    }
    Snapshot(out)
}

/// Counts and digests the etcd keys under `prefix`, one "table" per first path segment after it
/// (`locks`, `audit`, `grants`, ...), with values and create revisions.
pub async fn etcd_snapshot(stack: &crate::Stack, prefix: &str) -> Snapshot {
    let mut client = stack.etcd_client().await.expect("etcd answers");
    let answer = client
        .get(prefix, Some(etcd_client::GetOptions::new().with_prefix()))
        .await
        .expect("etcd answers");
    let mut tables: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for kv in answer.kvs() {
        let key = String::from_utf8_lossy(kv.key());
        let rest = key.strip_prefix(prefix).unwrap_or(&key);
        let table = rest.split('/').next().unwrap_or_default().to_string();
        let row = format!(
            "{key}={}@{}",
            String::from_utf8_lossy(kv.value()),
            kv.create_revision()
        );
        tables.entry(table).or_default().push(row);
    }
    Snapshot(
        tables
            .into_iter()
            // The rows themselves stand for the digest: a test's prefix holds a handful of keys.
            .map(|(table, rows)| (table, (rows.len() as i64, rows.join("\n"))))
            .collect(),
    )
}

impl Snapshot {
    /// The tables whose rows (count or content) differ in `after`.
    pub fn changed(&self, after: &Snapshot) -> Vec<String> {
        self.0
            .iter()
            .filter(|(table, before)| after.0.get(*table) != Some(before))
            .map(|(table, _)| table.clone())
            .collect()
    }

    /// Rows `after` has more than `self` in `table`.
    pub fn rows_added(&self, after: &Snapshot, table: &str) -> i64 {
        let count = |s: &Snapshot| s.0.get(table).map(|(n, _)| *n).unwrap_or(0);
        count(after) - count(self)
    }
}

/// Whether `grpc.health.v1` at `endpoint` (a `server` certificate of the shared test authority,
/// [`crate::pki::shared`]) reports `service` SERVING right now.
pub async fn serving(endpoint: &str, service: &str, server: crate::pki::Role) -> bool {
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::health_client::HealthClient;
    use tonic_health::pb::HealthCheckRequest;
    let probe = async {
        let channel = crate::pki::tls(crate::pki::Role::Reconciler)
            .connect(endpoint, server)
            .await
            .ok()?;
        let mut client = HealthClient::new(channel);
        let answer = client
            .check(HealthCheckRequest {
                service: service.to_string(),
            })
            .await
            .ok()?;
        Some(answer.into_inner().status == ServingStatus::Serving as i32)
    };
    bounded(probe).await.ok().flatten().unwrap_or(false)
}

/// `call`, or an error once [`CALL_TIMEOUT_MS`] has passed.
pub async fn bounded<T>(call: impl Future<Output = T>) -> Result<T, TestCaseError> {
    tokio::time::timeout(Duration::from_millis(CALL_TIMEOUT_MS), call)
        .await
        .map_err(|_| TestCaseError::fail(format!("no answer within {CALL_TIMEOUT_MS} ms")))
}

/// The runtime a wire property test drives its server and its cases on: proptest's runner is
/// synchronous, so the test builds the runtime itself instead of `#[tokio::test]`.
pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a tokio runtime")
}

/// What one call did: its answer, and `tables` before and after it.
pub struct Observed {
    pub answer: Result<(), tonic::Status>,
    pub before: Snapshot,
    pub after: Snapshot,
}

/// Makes `call` (bounded), snapshotting `tables` around it, and fails the case if anything in the
/// process panicked meanwhile.
pub async fn observe(
    pool: &sqlx::PgPool,
    tables: &[&str],
    call: impl Future<Output = Result<(), tonic::Status>>,
) -> Result<Observed, TestCaseError> {
    observe_with(|| snapshot(pool, tables), call).await
}

/// [`observe`] for a store that is not a PostgreSQL database: `store` takes its snapshot.
pub async fn observe_with<S, F>(
    store: S,
    call: impl Future<Output = Result<(), tonic::Status>>,
) -> Result<Observed, TestCaseError>
where
    S: Fn() -> F,
    F: Future<Output = Snapshot>,
{
    let panics = panics_so_far();
    let before = store().await;
    let answer = bounded(call).await?;
    let after = store().await;
    let code = match &answer {
        Ok(()) => "OK".to_string(),
        Err(status) => format!("{:?}", status.code()),
    };
    ANSWERS.with(|answers| *answers.borrow_mut().entry(code).or_default() += 1);
    prop_assert_eq!(panics_so_far(), panics, "a handler panicked");
    Ok(Observed {
        answer,
        before,
        after,
    })
}

/// Fails the case unless the server at `endpoint` still reports `service` SERVING and answers
/// `valid` (a call that must succeed).
pub async fn still_serving<T>(
    endpoint: &str,
    service: &str,
    server: crate::pki::Role,
    valid: impl Future<Output = Result<T, tonic::Status>>,
) -> Result<(), TestCaseError> {
    prop_assert!(
        serving(endpoint, service, server).await,
        "health is not SERVING"
    );
    if let Err(status) = bounded(valid).await? {
        prop_assert!(false, "a valid call fails after the case: {status:?}");
    }
    Ok(())
}

/// Runs `check` on `cases` values of `strategy` on `runtime`, shrinking a failure to a small
/// counterexample, and panics with it. No regression file: every run explores afresh.
pub fn run_cases<S, F, Fut>(runtime: &tokio::runtime::Runtime, cases: u32, strategy: S, check: F)
where
    S: Strategy,
    S::Value: Debug,
    F: Fn(S::Value) -> Fut,
    Fut: Future<Output = Result<(), TestCaseError>>,
{
    let mut runner = TestRunner::new(Config {
        cases,
        failure_persistence: None,
        max_shrink_iters: SHRINK_ITERATIONS_MAX,
        ..Config::default()
    });
    if let Err(e) = runner.run(&strategy, |value| runtime.block_on(check(value))) {
        panic!("{e}");
    }
    let answers = ANSWERS.with(|answers| answers.take());
    eprintln!("answers by gRPC code over {cases} cases: {answers:?}");
    assert!(
        answers.contains_key("OK") && answers.len() > 1,
        "the cases never got past validation, or never were refused: {answers:?}"
    );
}
