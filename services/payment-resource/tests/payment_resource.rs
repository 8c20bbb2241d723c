//! The payment resource against a real PostgreSQL (testkit), served in-process on port 0 and
//! called over gRPC with the typed client. Each test has its own fresh database.
//!
//! Every grant presented here is signed, as the lock service signs it, by this test binary's own
//! key ([`signer`]), whose public half is the only key the test servers verify with; [`fence`]
//! signs for the lock key of the account whose payout the fence is used on.

use std::sync::OnceLock;
use std::time::Duration;

use grant_signing::{Signer, Verifier};
use payment_client::model::{
    AbandonRequest, Evidence, Fence, NewPayout, OperatorDecision, OperatorSignature, Payout,
    RailEvidence, RailFact, RailOutcome, Signature,
};
use payment_client::{InvalidReason, PaymentClient, PaymentError};
use payment_resource::{Store, StoreOptions};
use payout_domain::{
    lock_key, AccountId, AmountMinor, BeneficiaryRef, Currency, FencingToken, PayoutEvent,
    PayoutId, PayoutState, TRANSITIONS,
};
use payout_proto::payment as pb;
use service_kit::{Metrics, Shutdown};
use sqlx::PgPool;
use testkit::pki::{tls, Role};
use testkit::{PgServer, Stack};

/// Bound of every poll in these tests: a blocked backend shows up in pg_stat_activity well within it.
const POLL_TIMEOUT: Duration = Duration::from_secs(20);

struct Service {
    client: PaymentClient,
    endpoint: String,
    metrics: Metrics,
    _stop: tokio::sync::watch::Sender<bool>,
}

struct Harness {
    url: String,
    pool: PgPool,
    service: Service,
}

impl Harness {
    fn c(&self) -> &PaymentClient {
        &self.service.client
    }
}

async fn start_service(url: &str, options: StoreOptions) -> Service {
    let pool = service_kit::connect_pg(url).await.expect("pool");
    payment_resource::migrate(&pool).await.expect("migrations");
    let metrics = Metrics::default();
    let store = Store::new(pool, options, &metrics);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (shutdown, stop) = Shutdown::new();
    let served = front(&metrics);
    tokio::spawn(async move {
        payment_resource::serve(listener, store, served, shutdown)
            .await
            .expect("serve")
    });
    let endpoint = format!("https://{addr}");
    let client = PaymentClient::connect(&endpoint, &tls(Role::Worker))
        .await
        .expect("connect");
    Service {
        client,
        endpoint,
        metrics,
        _stop: stop,
    }
}

/// This suite's subject is the service's logic, which it drives from one client in several roles
/// (fixture, intake, worker, operator): the in-process server lets every role call every method.
/// The real table is exercised against the binary (`binary_serves_and_stops_on_sigterm`,
/// `binary_refuses_calls_outside_the_authorisation_table`) and by the system and attack suites.
fn front(metrics: &Metrics) -> payment_resource::Front {
    payment_resource::Front::new(tls(Role::PaymentResource), metrics.clone())
        .with_fixture_accounts(true)
        .with_policy_for_tests(testkit::pki::every_role(&payment_resource::authz::POLICY))
}

/// The shared harness enforces no resolution SLA (zero), so the transition table's
/// RAIL_AMBIGUOUS -> ABANDONED row can be driven at once; the SLA has its own tests.
async fn harness() -> Harness {
    let url = Stack::shared().fresh_db(PgServer::Main).await;
    let service = start_service(
        &url,
        options().with_resolution_sla(std::time::Duration::ZERO),
    )
    .await;
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .connect(&url)
        .await
        .expect("test pool");
    Harness { url, pool, service }
}

/// This test binary's grant signing key: the lock service's role. Generated once per run.
fn signer() -> &'static Signer {
    static SIGNER: OnceLock<Signer> = OnceLock::new();
    SIGNER.get_or_init(|| Signer::generate("test-1").expect("a signing key").0)
}

/// The payment resource's instruction key in these tests; [`instruction_verifier`] is the proxy's
/// side.
fn instruction_signer() -> std::sync::Arc<Signer> {
    static SIGNER: OnceLock<std::sync::Arc<Signer>> = OnceLock::new();
    SIGNER
        .get_or_init(|| std::sync::Arc::new(Signer::generate("pr-test-1").expect("a key").0))
        .clone()
}

fn instruction_verifier() -> Verifier {
    Verifier::new([instruction_signer().public_key()]).expect("a verifier")
}

/// The rail proxy's rail-fact key in these tests (signs the facts the tests present).
fn fact_signer() -> &'static Signer {
    static SIGNER: OnceLock<Signer> = OnceLock::new();
    SIGNER.get_or_init(|| Signer::generate("proxy-facts-test-1").expect("a key").0)
}

fn fact_verifier() -> Verifier {
    Verifier::new([fact_signer().public_key()]).expect("a verifier")
}

/// The rail proxy's signed outcome of `payout`'s submission, as the proxy answers it, by `key`:
/// `outcome` (`ACKED`, `REJECTED`) with its rail reference or decline code, under token 7.
fn outcome_fact(
    key: &Signer,
    payout: &str,
    account: &str,
    outcome: &str,
    rail_ref: &str,
    decline_code: &str,
) -> RailFact {
    let payout_id = pid(payout);
    let cref = payout_domain::ClientReference::for_payout(&payout_id);
    let mut fact = RailFact {
        outcome: outcome.into(),
        rail_ref: rail_ref.into(),
        decline_code: decline_code.into(),
        token: 7,
        signed_at_unix_ms: 1_800_000_000_000,
        signature: Signature {
            key_id: String::new(),
            bytes: Vec::new(),
        },
    };
    fact.signature = key.sign_outcome(&fact.message(payout, account, cref.as_str()));
    fact
}

/// The rail proxy's signed evidence of an inquiry about `payout`, by `key`: `evidence` (`FOUND`,
/// `ABSENT`, `NEVER_SENT`, `UNKNOWN`) listing `rail_refs`.
fn evidence_fact(
    key: &Signer,
    payout: &str,
    account: &str,
    evidence: &str,
    rail_refs: &[&str],
) -> RailEvidence {
    let payout_id = pid(payout);
    let cref = payout_domain::ClientReference::for_payout(&payout_id);
    let mut proof = RailEvidence {
        evidence: evidence.into(),
        rail_refs: rail_refs.iter().map(|r| r.to_string()).collect(),
        asked_by: "resolver".into(),
        asked_at_unix_ms: 1_800_000_000_000,
        signature: Signature {
            key_id: String::new(),
            bytes: Vec::new(),
        },
    };
    proof.signature = key.sign_evidence(&proof.message(payout, account, cref.as_str()));
    proof
}

/// The proxy's genuine fact for `outcome` on payout `p` (ACKED, DECLINED; none for the others),
/// read from the payout's own record: what a genuine worker relays.
async fn genuine_outcome(
    c: &PaymentClient,
    p: &PayoutId,
    outcome: &RailOutcome,
) -> Option<RailFact> {
    let account = c.get_payout(p).await.ok()?.payout.account_id;
    match outcome {
        RailOutcome::Acked { rail_ref } => Some(outcome_fact(
            fact_signer(),
            p.as_str(),
            account.as_str(),
            "ACKED",
            rail_ref,
            "",
        )),
        RailOutcome::Declined { decline_code } => Some(outcome_fact(
            fact_signer(),
            p.as_str(),
            account.as_str(),
            "REJECTED",
            "",
            decline_code,
        )),
        RailOutcome::Timeout | RailOutcome::OutcomeMissing => None,
    }
}

/// The proxy's genuine evidence for `evidence` on payout `p`.
async fn genuine_evidence(
    c: &PaymentClient,
    p: &PayoutId,
    evidence: &Evidence,
) -> Option<RailEvidence> {
    let account = c.get_payout(p).await.ok()?.payout.account_id;
    Some(match evidence {
        Evidence::Found { rail_ref } => evidence_fact(
            fact_signer(),
            p.as_str(),
            account.as_str(),
            "FOUND",
            &[rail_ref],
        ),
        Evidence::Absent => {
            evidence_fact(fact_signer(), p.as_str(), account.as_str(), "ABSENT", &[])
        }
    })
}

/// RecordOutcome as a genuine worker makes it: with the proxy's signed fact.
async fn record(
    c: &PaymentClient,
    p: &PayoutId,
    f: &Fence,
    outcome: &RailOutcome,
    detail: &str,
) -> Result<Payout, PaymentError> {
    let fact = genuine_outcome(c, p, outcome).await;
    c.record_outcome_proven(p, f, outcome, detail, fact.as_ref())
        .await
}

/// ResolveAmbiguity as a genuine resolver makes it: with the proxy's signed evidence.
async fn resolve(
    c: &PaymentClient,
    p: &PayoutId,
    f: &Fence,
    evidence: &Evidence,
) -> Result<Payout, PaymentError> {
    let proof = genuine_evidence(c, p, evidence).await;
    c.resolve_ambiguity_proven(p, f, evidence, "rail-lookup", proof.as_ref())
        .await
}

/// The binary's signed-facts flags: the instruction signing key (written once per test binary,
/// in a folder kept until the process exits) and the proxy's public rail-fact key.
fn binary_fact_args() -> Vec<std::ffi::OsString> {
    static KEY: OnceLock<(tempfile::TempDir, testkit::grants::SigningKey)> = OnceLock::new();
    let (_, key) = KEY.get_or_init(|| {
        let dir = tempfile::tempdir().expect("a key folder");
        let key = testkit::grants::SigningKey::instruction(dir.path()).expect("a key");
        (dir, key)
    });
    let mut args = key.signing_args("instruction").to_vec();
    args.push("--rail-fact-verify-keys".into());
    args.push(fact_signer().public_key().to_string().into());
    args
}

/// The store options every test server starts from: the test signer's public key and the test
/// operators' keys, nothing else.
fn options() -> StoreOptions {
    StoreOptions::new(
        Verifier::new([signer().public_key()]).expect("a verifier"),
        payment_resource::SignedFacts::new(
            instruction_signer(),
            grant_signing::instruction::TTL_DEFAULT_MS,
            fact_verifier(),
        )
        .expect("signed facts"),
    )
    .with_operator_keys(
        Verifier::new(OPERATORS.iter().map(|name| operator(name).public_key())).unwrap(),
    )
}

/// The registered operators of the test servers.
const OPERATORS: [&str; 2] = ["op-1", "alice"];

/// A registered operator's key (or, for any other name, a key nobody registered).
fn operator(name: &str) -> &'static Signer {
    static KEYS: OnceLock<std::sync::Mutex<std::collections::HashMap<String, &'static Signer>>> =
        OnceLock::new();
    let mut keys = KEYS.get_or_init(Default::default).lock().unwrap();
    keys.entry(name.to_string())
        .or_insert_with(|| Box::leak(Box::new(Signer::generate(name).unwrap().0)))
}

/// `operator`'s signature of an abandon of `payout` for `reason`, made now.
fn signed(payout: &str, name: &str, reason: &str) -> Option<OperatorSignature> {
    signed_by(
        operator(name),
        payout,
        name,
        reason,
        grant_signing::operator::now_unix_ms(),
    )
}

/// `key`'s signature, under operator `name`, of an abandon of `payout` for `reason` at `at`.
fn signed_by(
    key: &Signer,
    payout: &str,
    name: &str,
    reason: &str,
    at: u64,
) -> Option<OperatorSignature> {
    let decision = grant_signing::operator::Decision {
        operator: name,
        decision: "abandon",
        payout_id: payout,
        reason,
        signed_at_unix_ms: at,
    };
    Some(OperatorSignature {
        signature: key.sign_decision(&decision).bytes,
        signed_at_unix_ms: at,
    })
}

/// A genuine grant of `account`'s lock key (`payout:{account}`) with `token` to `owner`.
fn fence(account: &str, owner: &str, token: u64) -> Fence {
    let key = lock_key(&aid(account));
    let signature = signer().sign(&key, token, owner);
    Fence::new(owner, FencingToken::new(token).unwrap())
        .unwrap()
        .signed(key, signature)
}

/// The same on the wire, for hand-built requests: any token and owner, even ones the server
/// refuses as invalid, signed for `account`.
fn wire_fence(account: &str, owner: &str, token: u64) -> pb::Fence {
    let key = lock_key(&aid(account));
    let signature = signer().sign(&key, token, owner);
    pb::Fence {
        owner: owner.into(),
        token,
        key,
        signing_key_id: signature.key_id,
        signature: signature.bytes,
    }
}

fn pid(s: &str) -> PayoutId {
    PayoutId::parse(s).unwrap()
}

fn aid(s: &str) -> AccountId {
    AccountId::parse(s).unwrap()
}

fn eur() -> Currency {
    Currency::parse("EUR").unwrap()
}

/// The registered operator "op-1"'s authorisation of `account`'s opening `balance_minor` in EUR,
/// signed now.
fn funding(account: &str, balance_minor: i64) -> payment_client::model::Funding {
    let signed_at_unix_ms = grant_signing::operator::now_unix_ms();
    let signature = operator("op-1").sign_funding(&grant_signing::operator::Funding {
        operator: "op-1",
        account_id: account,
        currency: "EUR",
        amount_minor: balance_minor,
        signed_at_unix_ms,
    });
    payment_client::model::Funding {
        operator: "op-1".into(),
        signature: signature.bytes,
        signed_at_unix_ms,
    }
}

async fn open(h: &Harness, account: &str, balance_minor: i64) {
    h.c()
        .open_funded_account(
            &aid(account),
            &eur(),
            balance_minor,
            &funding(account, balance_minor),
        )
        .await
        .expect("open account");
}

async fn create(h: &Harness, payout: &str, account: &str, amount_minor: i64) -> Payout {
    h.c()
        .create_payout(&NewPayout {
            payout_id: pid(payout),
            account_id: aid(account),
            amount_minor: AmountMinor::new(amount_minor).unwrap(),
            currency: eur(),
            beneficiary_ref: BeneficiaryRef::parse("ben-1").unwrap(),
        })
        .await
        .expect("create payout")
}

/// Performs `event` through the RPC that carries it.
async fn perform(
    c: &PaymentClient,
    p: &PayoutId,
    event: PayoutEvent,
    f: &Fence,
) -> Result<Payout, PaymentError> {
    use PayoutEvent as E;
    match event {
        E::Claim | E::FundsInsufficient => c.claim(p, f).await,
        E::SubmissionAccepted => c.mark_submitted(p, f).await,
        E::RailAcked => {
            record(
                c,
                p,
                f,
                &RailOutcome::Acked {
                    rail_ref: "rail-1".into(),
                },
                "",
            )
            .await
        }
        E::RailDeclined => {
            record(
                c,
                p,
                f,
                &RailOutcome::Declined {
                    decline_code: "BENEFICIARY_CLOSED".into(),
                },
                "",
            )
            .await
        }
        E::RailTimeout => {
            c.record_outcome(p, f, &RailOutcome::Timeout, "deadline exceeded")
                .await
        }
        E::OutcomeMissing => {
            c.record_outcome(p, f, &RailOutcome::OutcomeMissing, "")
                .await
        }
        E::Posted => c.post(p, f).await.map(|o| o.payout),
        E::EvidenceFound => {
            resolve(
                c,
                p,
                f,
                &Evidence::Found {
                    rail_ref: "rail-1".into(),
                },
            )
            .await
        }
        E::EvidenceAbsent => resolve(c, p, f, &Evidence::Absent).await,
        E::OperatorAbandon => {
            c.abandon(
                p,
                f,
                &AbandonRequest {
                    operator: "op-1".into(),
                    reason: "customer request".into(),
                    resolution_sla_passed: true,
                    sla_check: "ambiguous_since=T0 sla=24h now=T0+25h".into(),
                    signature: signed(p.as_str(), "op-1", "customer request"),
                },
            )
            .await
        }
    }
}

/// A key the test servers do not know: what a forger signs with.
fn rogue_signer() -> &'static Signer {
    static ROGUE: OnceLock<Signer> = OnceLock::new();
    ROGUE.get_or_init(|| Signer::generate("rogue-1").expect("a signing key").0)
}

/// Brings a PENDING payout to `target` along the table's legal path, as holder "worker-a" (T=10,
/// a grant of the payout's account's key).
async fn drive(c: &PaymentClient, p: &PayoutId, target: PayoutState) -> Fence {
    use PayoutEvent as E;
    use PayoutState as S;
    let account = c.get_payout(p).await.expect("the payout").payout.account_id;
    let f = fence(account.as_str(), "worker-a", 10);
    let path: &[PayoutEvent] = match target {
        S::Pending => &[],
        S::Claimed => &[E::Claim],
        S::RailSubmitted => &[E::Claim, E::SubmissionAccepted],
        S::RailAcked => &[E::Claim, E::SubmissionAccepted, E::RailAcked],
        S::RailAmbiguous => &[E::Claim, E::SubmissionAccepted, E::RailTimeout],
        S::Posted => &[E::Claim, E::SubmissionAccepted, E::RailAcked, E::Posted],
        S::Failed => &[E::Claim, E::SubmissionAccepted, E::RailDeclined],
        S::Abandoned => &[E::OperatorAbandon],
    };
    for e in path {
        let p2 = perform(c, p, *e, &f)
            .await
            .unwrap_or_else(|err| panic!("driving to {target} at {e:?}: {err}"));
        assert_ne!(p2.state, S::Pending);
    }
    f
}

/// Everything a refused or fenced-out call must leave untouched.
#[derive(Debug, PartialEq, Eq)]
struct Snapshot {
    state: String,
    version: i64,
    token_stamp: Option<i64>,
    claimed_by: Option<String>,
    fence: i64,
    balance_minor: i64,
    ledger_rows: i64,
    outbox_rows: i64,
}

async fn snapshot(pool: &PgPool, payout: &str) -> Snapshot {
    let (state, version, token_stamp, claimed_by, fence, balance_minor): (
        String,
        i64,
        Option<i64>,
        Option<String>,
        i64,
        i64,
    ) = sqlx::query_as(
        "SELECT p.state, p.version, p.token_stamp, p.claimed_by, a.fence, a.balance_minor \
             FROM payout p JOIN account a ON a.id = p.account_id WHERE p.id = $1",
    )
    .bind(payout)
    .fetch_one(pool)
    .await
    .unwrap();
    let ledger_rows: i64 = sqlx::query_scalar("SELECT count(*) FROM ledger_entry")
        .fetch_one(pool)
        .await
        .unwrap();
    let outbox_rows: i64 = sqlx::query_scalar("SELECT count(*) FROM ledger_outbox")
        .fetch_one(pool)
        .await
        .unwrap();
    Snapshot {
        state,
        version,
        token_stamp,
        claimed_by,
        fence,
        balance_minor,
        ledger_rows,
        outbox_rows,
    }
}

async fn audit_count(pool: &PgPool, kind: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM audit_event WHERE kind = $1")
        .bind(kind)
        .fetch_one(pool)
        .await
        .unwrap()
}

async fn assert_ledger_clean(h: &Harness) {
    let check = h.c().check_ledger().await.unwrap();
    assert!(
        check.violations.is_empty(),
        "ledger violations: {:?}",
        check.violations
    );
}

// ---------------------------------------------------------------------------------------------

/// Every row of the 2.3 table, driven from the table itself: the transition happens, with the
/// row's actor recorded, and its side effects are there.
#[tokio::test]
async fn every_listed_transition_happens() {
    let h = harness().await;
    for (i, row) in TRANSITIONS.iter().enumerate() {
        let account = format!("acct-{i}");
        let payout = format!("p-{i}");
        open(&h, &account, 10_000).await;
        let amount = if row.event == PayoutEvent::FundsInsufficient {
            20_000
        } else {
            1_000
        };
        create(&h, &payout, &account, amount).await;
        let p = pid(&payout);
        drive(h.c(), &p, row.from).await;
        // A re-claim and an outcome found missing are a later holder's; everyone else is worker-a.
        let f = match (row.from, row.event) {
            (PayoutState::Claimed, PayoutEvent::Claim) | (_, PayoutEvent::OutcomeMissing) => {
                fence(&account, "worker-b", 20)
            }
            _ => fence(&account, "worker-a", 10),
        };
        let after = perform(h.c(), &p, row.event, &f)
            .await
            .unwrap_or_else(|e| panic!("{row:?}: {e}"));
        assert_eq!(after.state, row.to, "{row:?}");
        assert_eq!(after.token_stamp, Some(f.token().get()), "{row:?}");
        let history = h.c().get_payout(&p).await.unwrap().history;
        let last = history.last().unwrap();
        assert_eq!(last.kind, "transition");
        assert_eq!(last.event.as_deref(), Some(row.event.as_str()));
        assert_eq!(last.actor, row.actor.as_str());
        assert_eq!(last.token, Some(f.token().get()));
        match (row.from, row.event) {
            (PayoutState::Claimed, PayoutEvent::Claim) => {
                assert_eq!(after.claimed_by.as_deref(), Some("worker-b"))
            }
            (PayoutState::Pending, PayoutEvent::Claim) => {
                assert_eq!(after.claimed_by.as_deref(), Some("worker-a"));
                assert!(after.claimed_at.is_some());
            }
            (_, PayoutEvent::FundsInsufficient) => {
                assert!(after
                    .failure_reason
                    .as_deref()
                    .unwrap()
                    .starts_with("INSUFFICIENT_FUNDS"))
            }
            (_, PayoutEvent::RailAcked) | (_, PayoutEvent::EvidenceFound) => {
                assert_eq!(after.rail_ref.as_deref(), Some("rail-1"))
            }
            (_, PayoutEvent::RailDeclined) => {
                assert_eq!(
                    after.failure_reason.as_deref(),
                    Some("RAIL_DECLINED: BENEFICIARY_CLOSED")
                )
            }
            (_, PayoutEvent::RailTimeout) => {
                assert_eq!(after.rail_outcome.as_deref(), Some("TIMEOUT"))
            }
            (_, PayoutEvent::OutcomeMissing) => {
                assert_eq!(after.rail_outcome.as_deref(), Some("OUTCOME_MISSING"))
            }
            (_, PayoutEvent::Posted) => {
                assert!(after.settled_at.is_some() && after.transaction_group.is_some());
                assert_eq!(
                    h.c()
                        .get_account(&aid(&account))
                        .await
                        .unwrap()
                        .balance_minor,
                    9_000
                );
            }
            (_, PayoutEvent::EvidenceAbsent) => {
                assert!(after
                    .failure_reason
                    .as_deref()
                    .unwrap()
                    .contains("rail-lookup"))
            }
            (_, PayoutEvent::OperatorAbandon) => {
                assert!(after.failure_reason.as_deref().unwrap().contains("op-1"));
                assert_eq!(
                    last.detail["sla_check"],
                    "ambiguous_since=T0 sla=24h now=T0+25h"
                );
            }
            (_, PayoutEvent::SubmissionAccepted) => assert!(after.submitted_at.is_some()),
            (from, PayoutEvent::Claim) => {
                panic!("the table lists Claim from {from}: extend this test")
            }
        }
    }
    assert_ledger_clean(&h).await;
}

/// Every (state, event) pair the table does not list is refused with a typed
/// `RefusedTransition`, recorded and counted, and changes nothing (terminal states included, with
/// a higher token too). POSTED + Post is the one idempotent answer, recorded and counted too.
#[tokio::test]
async fn every_unlisted_pair_is_refused_and_changes_nothing() {
    let h = harness().await;
    let mut case = 0;
    let mut refused = 0;
    let mut idempotent_posts = 0;
    for state in PayoutState::ALL {
        for event in PayoutEvent::ALL {
            if TRANSITIONS
                .iter()
                .any(|t| t.from == state && t.event == event)
            {
                continue;
            }
            // FundsInsufficient is only decided by a Claim of a PENDING payout; from any other
            // state the claim RPC carries the Claim event. The domain unit tests cover the pair.
            if event == PayoutEvent::FundsInsufficient {
                continue;
            }
            case += 1;
            let account = format!("acct-{case}");
            let payout = format!("p-{case}");
            open(&h, &account, 10_000).await;
            create(&h, &payout, &account, 1_000).await;
            let p = pid(&payout);
            drive(h.c(), &p, state).await;
            let before = snapshot(&h.pool, &payout).await;
            let refused_before = audit_count(&h.pool, "refused_transition").await;
            // A later holder (T=30 > 10): the guard passes, the table refuses.
            let result = perform(h.c(), &p, event, &fence(&account, "worker-c", 30)).await;
            if state == PayoutState::Posted && event == PayoutEvent::Posted {
                assert!(result.is_ok(), "{result:?}");
                let again = h
                    .c()
                    .post(&p, &fence(&account, "worker-c", 30))
                    .await
                    .unwrap();
                assert!(again.already_posted);
                assert_eq!(
                    snapshot(&h.pool, &payout).await,
                    before,
                    "idempotent post changed something"
                );
                idempotent_posts += 2;
                assert_eq!(
                    audit_count(&h.pool, "refused_transition").await,
                    refused_before + 2
                );
                continue;
            }
            match result {
                Err(PaymentError::RefusedTransition { from, event: e, .. }) => {
                    assert_eq!(
                        (from.as_str(), e.as_str()),
                        (state.as_str(), event.as_str())
                    );
                }
                other => panic!("({state}, {event:?}) should be refused, got {other:?}"),
            }
            refused += 1;
            assert_eq!(
                snapshot(&h.pool, &payout).await,
                before,
                "({state}, {event:?}) changed something"
            );
            assert_eq!(
                audit_count(&h.pool, "refused_transition").await,
                refused_before + 1
            );
        }
    }
    assert!(refused >= 60, "only {refused} refused pairs exercised");
    let metrics = h.service.metrics.render();
    let counted: u64 = metrics
        .lines()
        .filter(|l| l.starts_with("payment_refused_transitions_total{"))
        .map(|l| l.rsplit(' ').next().unwrap().parse::<u64>().unwrap())
        .sum();
    assert_eq!(counted, refused + idempotent_posts);
    assert_ledger_clean(&h).await;
}

/// Post on a POSTED payout (spec 2.3: a terminal state rejects everything, and the rejection is
/// a defect signal): the answer stays the first posting's, idempotently, and changes nothing. The
/// posting grant's own retry (its answer was lost) is no refusal; a later holder's is counted and
/// audited exactly like every other refused transition. Control: the posting itself
/// (RAIL_ACKED -> POSTED) counts and audits no refusal.
#[tokio::test]
async fn post_of_a_posted_payout_answers_idempotently_and_is_a_refused_transition() {
    let h = harness().await;
    open(&h, "acct-1", 10_000).await;
    create(&h, "p-1", "acct-1", 1_000).await;
    let f = drive(h.c(), &pid("p-1"), PayoutState::RailAcked).await;
    let refused_counter = |h: &Harness| {
        h.service
            .metrics
            .render()
            .lines()
            .find(|l| {
                l.starts_with("payment_refused_transitions_total{")
                    && l.contains("from=\"POSTED\"")
                    && l.contains("event=\"POSTED\"")
            })
            .map(|l| l.rsplit(' ').next().unwrap().parse::<u64>().unwrap())
            .unwrap_or(0)
    };
    let first = h.c().post(&pid("p-1"), &f).await.unwrap();
    assert!(!first.already_posted);
    assert_eq!(refused_counter(&h), 0, "the posting itself is no refusal");
    assert_eq!(audit_count(&h.pool, "refused_transition").await, 0);

    let before = snapshot(&h.pool, "p-1").await;
    // The same holder's retry (no refusal), then a later holder's (one).
    for (refusals, retry) in [(0, f.clone()), (1, fence("acct-1", "worker-b", 11))] {
        let retry = &retry;
        let again = h.c().post(&pid("p-1"), retry).await.unwrap();
        assert!(again.already_posted);
        assert_eq!(again.entries, first.entries);
        assert_eq!(again.transaction_group, first.transaction_group);
        assert_eq!(again.payout.state, PayoutState::Posted);
        assert_eq!(refused_counter(&h), refusals);
        assert_eq!(
            audit_count(&h.pool, "refused_transition").await,
            refusals as i64
        );
        if refusals == 0 {
            continue;
        }
        let (from, event, owner, token): (String, String, String, i64) = sqlx::query_as(
            "SELECT from_state, event, owner, token FROM audit_event \
             WHERE kind = 'refused_transition' ORDER BY id DESC LIMIT 1",
        )
        .fetch_one(&h.pool)
        .await
        .unwrap();
        assert_eq!(
            (from.as_str(), event.as_str(), owner.as_str(), token),
            ("POSTED", "POSTED", retry.owner(), retry.token().as_i64())
        );
    }
    assert_eq!(snapshot(&h.pool, "p-1").await, before, "nothing changed");
    assert_ledger_clean(&h).await;
}

/// A step repeated under the grant that made it (its answer lost after the COMMIT: a restart, a
/// reset connection, a local-activity timeout) answers with the record as it stands: no second
/// transition, no refusal, no defect signal. Another step under the same grant from a state it
/// cannot leave, and the same step under another grant, stay refusals and signals. Before, every
/// repeat was refused, and a payout whose MarkSubmitted answer was lost ended FAILED, never sent.
#[tokio::test]
async fn a_step_repeated_under_the_grant_that_made_it_answers_with_the_record() {
    use PayoutEvent as E;
    let h = harness().await;
    let refused_counted = |h: &Harness| -> u64 {
        h.service
            .metrics
            .render()
            .lines()
            .filter(|l| l.starts_with("payment_refused_transitions_total{"))
            .map(|l| l.rsplit(' ').next().unwrap().parse::<u64>().unwrap())
            .sum()
    };
    // Each step, then the same step again under the same grant.
    let paths: [(&str, &[PayoutEvent]); 3] = [
        (
            "r1",
            &[E::Claim, E::SubmissionAccepted, E::RailAcked, E::Posted],
        ),
        (
            "r2",
            &[
                E::Claim,
                E::SubmissionAccepted,
                E::RailTimeout,
                E::EvidenceFound,
            ],
        ),
        ("r3", &[E::OperatorAbandon]),
    ];
    for (name, path) in paths {
        let (account, payout) = (format!("acct-{name}"), format!("p-{name}"));
        open(&h, &account, 10_000).await;
        create(&h, &payout, &account, 1_000).await;
        let f = fence(&account, "worker-a", 10);
        for event in path {
            let first = perform(h.c(), &pid(&payout), *event, &f).await.unwrap();
            let before = snapshot(&h.pool, &payout).await;
            let transitions = audit_count(&h.pool, "transition").await;
            let again = perform(h.c(), &pid(&payout), *event, &f)
                .await
                .unwrap_or_else(|e| panic!("{event:?} repeated under its grant: {e}"));
            assert_eq!(again.state, first.state, "{event:?}");
            assert_eq!(snapshot(&h.pool, &payout).await, before, "{event:?}");
            assert_eq!(
                audit_count(&h.pool, "transition").await,
                transitions,
                "{event:?}: no second transition"
            );
            assert_eq!(audit_count(&h.pool, "refused_transition").await, 0);
            assert_eq!(refused_counted(&h), 0, "{event:?}: no defect signal");
        }
    }
    // Another step under the same grant: p-r2 is RAIL_ACKED on evidence; a decline under the
    // grant that recorded the evidence is no repeat of anything that grant did.
    let r2 = fence("acct-r2", "worker-a", 10);
    let declined = perform(h.c(), &pid("p-r2"), E::RailDeclined, &r2).await;
    assert!(
        matches!(declined, Err(PaymentError::RefusedTransition { .. })),
        "{declined:?}"
    );
    // The same step under another grant (a later holder): refused, recorded, counted.
    let later = fence("acct-r1", "worker-b", 11);
    let before = snapshot(&h.pool, "p-r1").await;
    let marked = perform(h.c(), &pid("p-r1"), E::SubmissionAccepted, &later).await;
    assert!(
        matches!(marked, Err(PaymentError::RefusedTransition { .. })),
        "{marked:?}"
    );
    assert_eq!(snapshot(&h.pool, "p-r1").await, before);
    assert_eq!(audit_count(&h.pool, "refused_transition").await, 2);
    assert_eq!(refused_counted(&h), 2);
    assert_ledger_clean(&h).await;
}

/// Two holders, T=10 < T'=20, interleave on one payout. After T' is accepted, every write under T
/// is fenced out with the typed detail, recorded, counted, and changes nothing; T' carries on.
#[tokio::test]
async fn stale_holder_is_fenced_out_and_changes_nothing() {
    let h = harness().await;
    open(&h, "acct-1", 10_000).await;
    create(&h, "p-1", "acct-1", 1_000).await;
    let p = pid("p-1");
    let old = fence("acct-1", "worker-a", 10);
    let new = fence("acct-1", "worker-b", 20);
    h.c().claim(&p, &old).await.unwrap();
    let reclaimed = h.c().claim(&p, &new).await.unwrap();
    assert_eq!(reclaimed.claimed_by.as_deref(), Some("worker-b"));

    let before = snapshot(&h.pool, "p-1").await;
    for event in PayoutEvent::ALL {
        match perform(h.c(), &p, event, &old).await {
            Err(PaymentError::FencedOut {
                key,
                presented,
                stored,
                owner,
                account_id,
                payout_id,
            }) => {
                assert_eq!(key, "payout:acct-1");
                assert_eq!((presented, stored), (10, 20));
                assert_eq!(owner, "worker-a");
                assert_eq!((account_id.as_str(), payout_id.as_str()), ("acct-1", "p-1"));
            }
            other => panic!("{event:?} under the stale token should be fenced out, got {other:?}"),
        }
        assert_eq!(
            snapshot(&h.pool, "p-1").await,
            before,
            "{event:?} under T changed something"
        );
    }
    let fenced = audit_count(&h.pool, "fenced_out").await;
    assert_eq!(fenced, PayoutEvent::ALL.len() as i64);
    let row: (i64, String, serde_json::Value) = sqlx::query_as(
        "SELECT token, owner, detail::text FROM audit_event WHERE kind = 'fenced_out' ORDER BY id LIMIT 1",
    )
    .fetch_one(&h.pool)
    .await
    .map(|(t, o, d): (i64, String, sqlx::types::Text<String>)| (t, o, serde_json::from_str(&d.0).unwrap()))
    .unwrap();
    assert_eq!((row.0, row.1.as_str()), (10, "worker-a"));
    assert_eq!(row.2["stored"], 20);
    assert_eq!(row.2["key"], "payout:acct-1");
    assert!(h
        .service
        .metrics
        .render()
        .contains("fenced_out_total{guard=\"payment_resource\",operation=\"claim\"} 2"));
    // The same refusals in the latency histogram, under their own outcome.
    assert!(h.service.metrics.render().contains(
        "guard_call_duration_seconds_count{guard=\"payment_resource\",operation=\"claim\",outcome=\"fenced_out\"} 2"
    ));

    // Interleave further: T' moves on, T keeps trying at every step and never lands.
    h.c().mark_submitted(&p, &new).await.unwrap();
    assert!(matches!(
        perform(h.c(), &p, PayoutEvent::RailTimeout, &old).await,
        Err(PaymentError::FencedOut { .. })
    ));
    record(
        h.c(),
        &p,
        &new,
        &RailOutcome::Acked {
            rail_ref: "rail-9".into(),
        },
        "",
    )
    .await
    .unwrap();
    assert!(matches!(
        h.c().post(&p, &old).await,
        Err(PaymentError::FencedOut { .. })
    ));
    let posted = h.c().post(&p, &new).await.unwrap();
    assert_eq!(posted.payout.state, PayoutState::Posted);
    assert!(
        posted.entries.iter().all(|e| e.token == Some(20)),
        "ledger rows carry the token they were posted under"
    );
    // Even the idempotent answer is behind the guard.
    assert!(matches!(
        h.c().post(&p, &old).await,
        Err(PaymentError::FencedOut { .. })
    ));
    assert_ledger_clean(&h).await;
}

/// The fence is per account, not per payout: a stale holder cannot act on another payout of the
/// same account either (the hole spec 2.2 names).
#[tokio::test]
async fn stale_holder_is_fenced_out_on_every_payout_of_the_account() {
    let h = harness().await;
    open(&h, "acct-1", 10_000).await;
    create(&h, "p-1", "acct-1", 1_000).await;
    create(&h, "p-2", "acct-1", 1_000).await;
    h.c()
        .abandon(
            &pid("p-1"),
            &fence("acct-1", "op", 20),
            &AbandonRequest {
                operator: "op-1".into(),
                reason: "r".into(),
                resolution_sla_passed: false,
                sla_check: String::new(),
                signature: signed("p-1", "op-1", "r"),
            },
        )
        .await
        .unwrap();
    let before = snapshot(&h.pool, "p-2").await;
    let err = h
        .c()
        .claim(&pid("p-2"), &fence("acct-1", "worker-a", 10))
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            PaymentError::FencedOut {
                presented: 10,
                stored: 20,
                ..
            }
        ),
        "{err:?}"
    );
    assert_eq!(snapshot(&h.pool, "p-2").await, before);
}

/// NEGATIVE CONTROL of the two tests above: the same interleaving against a service whose fence
/// predicate is disabled (test-only switch). The stale write lands, so the tests above would see it.
#[tokio::test]
async fn negative_control_without_the_predicate_the_stale_write_lands() {
    let h = harness().await;
    let unguarded = start_service(&h.url, options().without_fence_predicate_for_tests()).await;
    open(&h, "acct-1", 10_000).await;
    create(&h, "p-1", "acct-1", 1_000).await;
    let p = pid("p-1");
    h.c()
        .claim(&p, &fence("acct-1", "worker-a", 10))
        .await
        .unwrap();
    h.c()
        .claim(&p, &fence("acct-1", "worker-b", 20))
        .await
        .unwrap();
    // Guarded: refused.
    assert!(matches!(
        h.c()
            .mark_submitted(&p, &fence("acct-1", "worker-a", 10))
            .await,
        Err(PaymentError::FencedOut { .. })
    ));
    // Unguarded: the stale holder's write lands.
    let landed = unguarded
        .client
        .mark_submitted(&p, &fence("acct-1", "worker-a", 10))
        .await
        .unwrap();
    assert_eq!(landed.state, PayoutState::RailSubmitted);
    assert_eq!(landed.token_stamp, Some(10));
    let s = snapshot(&h.pool, "p-1").await;
    assert_eq!(
        (s.state.as_str(), s.token_stamp, s.fence),
        ("RAIL_SUBMITTED", Some(10), 20)
    );
}

/// The sum of a counter's samples over all its labels, as the service's `/metrics` renders it.
fn counted(h: &Harness, name: &str) -> u64 {
    h.service
        .metrics
        .render()
        .lines()
        .filter(|l| l.starts_with(&format!("{name}{{")))
        .map(|l| l.rsplit(' ').next().unwrap().parse::<u64>().unwrap())
        .sum()
}

/// The largest token there is: what a forger presents to fence out every real holder for ever.
fn max_token() -> FencingToken {
    FencingToken::new(i64::MAX as u64).unwrap()
}

/// Fabricated grants (issue 17 section 1): i64::MAX unsigned, with and without the right key; a
/// signature by a key this guard does not know; another key under the known key id; the real
/// holder's genuine signature presented with another token or another owner. Each is refused on
/// every fenced operation as `forged_grant` before the fence statement: nothing changes (the fence
/// neither, the payout neither), each refusal is audited and counted, and the real holder's next
/// write is still accepted.
#[tokio::test]
async fn a_fabricated_grant_is_refused_as_forged_and_changes_nothing() {
    let h = harness().await;
    open(&h, "acct-1", 10_000).await;
    create(&h, "p-1", "acct-1", 1_000).await;
    let p = pid("p-1");
    let real = fence("acct-1", "worker-a", 10);
    h.c().claim(&p, &real).await.unwrap();
    let key = lock_key(&aid("acct-1"));
    let max = max_token();
    let mallory = || Fence::new("mallory", max).unwrap();
    let (impostor, _) = Signer::generate(signer().key_id()).unwrap();
    let forgeries: Vec<(&str, Fence, &str)> = vec![
        ("i64::MAX, unsigned, no key", mallory(), "unsigned"),
        (
            "i64::MAX, unsigned, the account's key",
            mallory().signed(key.clone(), Signature::default()),
            "unsigned",
        ),
        (
            "i64::MAX signed by a key the guard does not know",
            mallory().signed(key.clone(), rogue_signer().sign(&key, max.get(), "mallory")),
            "unknown_key_id",
        ),
        (
            "i64::MAX signed by another key under the known key id",
            mallory().signed(key.clone(), impostor.sign(&key, max.get(), "mallory")),
            "bad_signature",
        ),
        (
            "the real holder's signature with i64::MAX",
            Fence::new("worker-a", max)
                .unwrap()
                .signed(key.clone(), real.signature().clone()),
            "bad_signature",
        ),
        (
            "the real holder's signature with another owner",
            Fence::new("mallory", real.token())
                .unwrap()
                .signed(key.clone(), real.signature().clone()),
            "bad_signature",
        ),
    ];
    let before = snapshot(&h.pool, "p-1").await;
    assert_eq!((before.fence, before.state.as_str()), (10, "CLAIMED"));
    let mut refused = 0;
    for (name, forged, reason) in &forgeries {
        for event in PayoutEvent::ALL {
            match perform(h.c(), &p, event, forged).await {
                Err(PaymentError::ForgedGrant {
                    key,
                    presented,
                    owner,
                    signing_key_id,
                    reason: why,
                    payout_id,
                }) => {
                    assert_eq!(
                        (key.as_str(), presented, owner.as_str()),
                        (forged.key(), forged.token().get(), forged.owner()),
                        "{name}"
                    );
                    assert_eq!(signing_key_id, forged.signature().key_id, "{name}");
                    assert_eq!(
                        (why.as_str(), payout_id.as_str()),
                        (*reason, "p-1"),
                        "{name}"
                    );
                }
                other => panic!("{name}, {event:?}: expected ForgedGrant, got {other:?}"),
            }
            refused += 1;
            assert_eq!(
                snapshot(&h.pool, "p-1").await,
                before,
                "{name}, {event:?} changed something"
            );
        }
    }
    // Verification comes first: a forged grant on a payout that does not exist is a forged grant.
    assert!(matches!(
        h.c().claim(&pid("p-404"), &mallory()).await,
        Err(PaymentError::ForgedGrant { .. })
    ));
    refused += 1;
    assert_eq!(audit_count(&h.pool, "forged_grant").await, refused);
    assert_eq!(audit_count(&h.pool, "fenced_out").await, 0);
    assert_eq!(counted(&h, "forged_grants_total"), refused as u64);
    let (account, token, owner, detail): (Option<String>, i64, String, serde_json::Value) =
        sqlx::query_as(
            "SELECT account_id, token, owner, detail FROM audit_event WHERE kind = 'forged_grant' ORDER BY id LIMIT 1",
        )
        .fetch_one(&h.pool)
        .await
        .unwrap();
    assert_eq!(
        (account.as_deref(), token, owner.as_str()),
        (Some("acct-1"), i64::MAX, "mallory")
    );
    assert_eq!(
        (detail["reason"].as_str(), detail["operation"].as_str()),
        (Some("unsigned"), Some("claim")),
        "{detail}"
    );

    // The real holder carries on: its fence is where it was.
    let submitted = h.c().mark_submitted(&p, &real).await.unwrap();
    assert_eq!(submitted.state, PayoutState::RailSubmitted);
    assert_eq!(snapshot(&h.pool, "p-1").await.fence, 10);
    assert_ledger_clean(&h).await;
}

/// MarkSubmitted answers the instruction the rail proxy requires (issue 33): signed by this
/// service's instruction key, its payment fields from the payout row, the grant's key and token,
/// issued at paydb's submission time and valid for the TTL. The idempotent repeat under the same
/// grant answers the same bytes; no other answer carries one, nor does a later grant's refused
/// MarkSubmitted.
#[tokio::test]
async fn mark_submitted_answers_the_instruction_signed_for_exactly_this_payout() {
    let h = harness().await;
    open(&h, "acct-i", 100_000).await;
    let created = create(&h, "p-i", "acct-i", 1_234).await;
    assert_eq!(created.instruction, None);
    let p = pid("p-i");
    let grant = fence("acct-i", "worker-a", 10);
    let claimed = h.c().claim(&p, &grant).await.unwrap();
    assert_eq!(claimed.instruction, None, "only MarkSubmitted signs");
    let submitted = h.c().mark_submitted(&p, &grant).await.unwrap();
    let signed = submitted.instruction.clone().expect("a signed instruction");
    let i = &signed.instruction;
    assert_eq!(
        (
            i.payout_id.as_str(),
            i.account_id.as_str(),
            i.amount_minor,
            i.currency.as_str(),
            i.beneficiary_ref.as_str(),
            i.client_reference.as_str(),
            i.lock_key.as_str(),
            i.token
        ),
        (
            "p-i",
            "acct-i",
            1_234,
            "EUR",
            "ben-1",
            submitted.client_reference.as_str(),
            "payout:acct-i",
            10
        )
    );
    let issued = submitted
        .submitted_at
        .expect("submitted")
        .timestamp_millis();
    assert_eq!(i.issued_at_unix_ms, issued);
    assert_eq!(
        i.expires_at_unix_ms - i.issued_at_unix_ms,
        payment_resource::INSTRUCTION_TTL_DEFAULT_MS as i64
    );
    assert_eq!(
        instruction_verifier().verify_instruction(&signed, &i.presented(), issued),
        Ok(())
    );
    let again = h.c().mark_submitted(&p, &grant).await.unwrap();
    assert_eq!(again.instruction, Some(signed), "same row, same bytes");
    // A later grant finds RAIL_SUBMITTED: its MarkSubmitted is refused, nothing is signed.
    assert!(h
        .c()
        .mark_submitted(&p, &fence("acct-i", "worker-b", 11))
        .await
        .is_err());
}

/// NEGATIVE CONTROL of the test above: with the signature check switched off (test-only switch),
/// the fabricated i64::MAX write (unsigned, naming the account's key) lands, and the real holder
/// is then fenced out for good, on the verifying service too.
#[tokio::test]
async fn negative_control_without_verification_a_fabricated_token_lands() {
    let h = harness().await;
    let unverified = start_service(&h.url, options().without_grant_verification_for_tests()).await;
    open(&h, "acct-1", 10_000).await;
    create(&h, "p-1", "acct-1", 1_000).await;
    let p = pid("p-1");
    let real = fence("acct-1", "worker-a", 10);
    h.c().claim(&p, &real).await.unwrap();
    let forged = Fence::new("mallory", max_token())
        .unwrap()
        .signed(lock_key(&aid("acct-1")), Signature::default());
    // Verified: refused.
    assert!(matches!(
        h.c().mark_submitted(&p, &forged).await,
        Err(PaymentError::ForgedGrant { .. })
    ));
    // Unverified: the fabricated token's write lands and the fence jumps to i64::MAX.
    let landed = unverified.client.mark_submitted(&p, &forged).await.unwrap();
    assert_eq!(landed.state, PayoutState::RailSubmitted);
    assert_eq!(landed.token_stamp, Some(i64::MAX as u64));
    assert_eq!(snapshot(&h.pool, "p-1").await.fence, i64::MAX);
    // Every real holder is fenced out for good.
    for c in [h.c(), &unverified.client] {
        let err = c
            .record_outcome(&p, &real, &RailOutcome::Timeout, "")
            .await
            .unwrap_err();
        assert!(
            matches!(err, PaymentError::FencedOut { presented: 10, stored, .. } if stored == i64::MAX as u64),
            "{err:?}"
        );
    }
}

/// Tokens are global across keys (etcd revisions): a genuine grant of account A's key, with a
/// token above account B's fence, is refused on B's payout as `grant_for_another_key` on every
/// fenced operation, and so is a genuine grant of a key of another shape (it names no payout
/// account): nothing changes on either account, each refusal is audited and counted, and B's real
/// holder carries on.
#[tokio::test]
async fn a_grant_for_another_account_is_refused_and_changes_nothing() {
    let h = harness().await;
    open(&h, "acct-1", 10_000).await;
    open(&h, "acct-2", 10_000).await;
    create(&h, "p-a", "acct-1", 1_000).await;
    create(&h, "p-b", "acct-2", 1_000).await;
    let a_grant = fence("acct-1", "worker-a", 30);
    let b_grant = fence("acct-2", "worker-b", 20);
    h.c().claim(&pid("p-a"), &a_grant).await.unwrap();
    h.c().claim(&pid("p-b"), &b_grant).await.unwrap();
    let other_shape = |key: &str| {
        Fence::new("worker-x", FencingToken::new(40).unwrap())
            .unwrap()
            .signed(key, signer().sign(key, 40, "worker-x"))
    };
    let grants = [
        ("account A's grant", a_grant.clone()),
        ("a grant of another kind of key", other_shape("orders:42")),
        (
            "a grant of a key naming no valid account",
            other_shape("payout:acct 2"),
        ),
        (
            "a grant of the account's key with a suffix",
            other_shape("payout:acct-2:x"),
        ),
    ];
    let (before_a, before_b) = (
        snapshot(&h.pool, "p-a").await,
        snapshot(&h.pool, "p-b").await,
    );
    assert_eq!((before_a.fence, before_b.fence), (30, 20));
    let mut refused = 0;
    for (name, grant) in &grants {
        for event in PayoutEvent::ALL {
            match perform(h.c(), &pid("p-b"), event, grant).await {
                Err(PaymentError::GrantForAnotherKey {
                    presented_key,
                    required_key,
                    presented,
                    owner,
                    payout_id,
                }) => {
                    assert_eq!(
                        (
                            presented_key.as_str(),
                            required_key.as_str(),
                            payout_id.as_str()
                        ),
                        (grant.key(), "payout:acct-2", "p-b"),
                        "{name}"
                    );
                    assert_eq!(
                        (presented, owner.as_str()),
                        (grant.token().get(), grant.owner())
                    );
                }
                other => panic!("{name}, {event:?}: expected GrantForAnotherKey, got {other:?}"),
            }
            refused += 1;
            assert_eq!(
                snapshot(&h.pool, "p-b").await,
                before_b,
                "{name}, {event:?}"
            );
            assert_eq!(
                snapshot(&h.pool, "p-a").await,
                before_a,
                "{name}, {event:?}"
            );
        }
    }
    assert_eq!(audit_count(&h.pool, "grant_for_another_key").await, refused);
    assert_eq!(audit_count(&h.pool, "fenced_out").await, 0);
    assert_eq!(counted(&h, "grants_for_another_key_total"), refused as u64);
    let (account, detail): (String, serde_json::Value) = sqlx::query_as(
        "SELECT account_id, detail FROM audit_event WHERE kind = 'grant_for_another_key' ORDER BY id LIMIT 1",
    )
    .fetch_one(&h.pool)
    .await
    .unwrap();
    assert_eq!(account, "acct-2");
    assert_eq!(
        (
            detail["presented_key"].as_str(),
            detail["required_key"].as_str()
        ),
        (Some("payout:acct-1"), Some("payout:acct-2")),
        "{detail}"
    );
    // B's real holder carries on under its own fence.
    let submitted = h.c().mark_submitted(&pid("p-b"), &b_grant).await.unwrap();
    assert_eq!(submitted.state, PayoutState::RailSubmitted);
    assert_eq!(snapshot(&h.pool, "p-b").await.fence, 20);
}

/// NEGATIVE CONTROL of the test above: with the key binding dropped (test-only switch), account
/// A's grant is accepted on B's payout and B's fence jumps to A's token, fencing out B's real
/// holder.
#[tokio::test]
async fn negative_control_without_key_binding_another_accounts_grant_lands() {
    let h = harness().await;
    let unbound = start_service(&h.url, options().without_key_binding_for_tests()).await;
    open(&h, "acct-1", 10_000).await;
    open(&h, "acct-2", 10_000).await;
    create(&h, "p-a", "acct-1", 1_000).await;
    create(&h, "p-b", "acct-2", 1_000).await;
    let a_grant = fence("acct-1", "worker-a", 30);
    let b_grant = fence("acct-2", "worker-b", 20);
    h.c().claim(&pid("p-a"), &a_grant).await.unwrap();
    h.c().claim(&pid("p-b"), &b_grant).await.unwrap();
    // Bound: refused.
    assert!(matches!(
        h.c().mark_submitted(&pid("p-b"), &a_grant).await,
        Err(PaymentError::GrantForAnotherKey { .. })
    ));
    // Unbound: A's grant lands on B's payout, and B's fence jumps to A's token.
    let landed = unbound
        .client
        .mark_submitted(&pid("p-b"), &a_grant)
        .await
        .unwrap();
    assert_eq!(landed.state, PayoutState::RailSubmitted);
    assert_eq!(landed.token_stamp, Some(30));
    assert_eq!(snapshot(&h.pool, "p-b").await.fence, 30);
    let err = h
        .c()
        .record_outcome(&pid("p-b"), &b_grant, &RailOutcome::Timeout, "")
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            PaymentError::FencedOut {
                presented: 20,
                stored: 30,
                ..
            }
        ),
        "{err:?}"
    );
}

/// Concurrent claims and re-claims of one payout with distinct tokens: each either lands or is
/// fenced out; the highest token always wins; accepted tokens never go backwards.
#[tokio::test]
async fn concurrent_claims_and_reclaims() {
    let h = harness().await;
    open(&h, "acct-1", 10_000).await;
    create(&h, "p-1", "acct-1", 1_000).await;
    const CLAIMERS: u64 = 16;
    let tasks: Vec<_> = (1..=CLAIMERS)
        .map(|t| {
            let c = h.c().clone();
            tokio::spawn(async move {
                (
                    t,
                    c.claim(&pid("p-1"), &fence("acct-1", &format!("worker-{t}"), t))
                        .await,
                )
            })
        })
        .collect();
    let mut landed = 0;
    for task in futures::future::join_all(tasks).await {
        match task.unwrap() {
            (_, Ok(p)) => {
                assert_eq!(p.state, PayoutState::Claimed);
                landed += 1;
            }
            (
                _,
                Err(PaymentError::FencedOut {
                    presented, stored, ..
                }),
            ) => assert!(presented < stored),
            (t, Err(e)) => panic!("claim {t}: unexpected {e}"),
        }
    }
    assert!(landed >= 1);
    let s = snapshot(&h.pool, "p-1").await;
    assert_eq!(s.fence, CLAIMERS as i64);
    assert_eq!(
        s.claimed_by.as_deref(),
        Some(format!("worker-{CLAIMERS}").as_str())
    );
    let tokens: Vec<i64> = sqlx::query_scalar(
        "SELECT token FROM audit_event WHERE kind = 'transition' AND payout_id = 'p-1' ORDER BY id",
    )
    .fetch_all(&h.pool)
    .await
    .unwrap();
    assert_eq!(tokens.len(), landed);
    assert!(
        tokens.windows(2).all(|w| w[0] < w[1]),
        "accepted tokens went backwards: {tokens:?}"
    );
    assert_eq!(
        audit_count(&h.pool, "fenced_out").await,
        (CLAIMERS as usize - landed) as i64
    );

    // Different payouts of one account claimed concurrently: at most one is in flight.
    for i in 2..=9 {
        create(&h, &format!("p-{i}"), "acct-1", 100).await;
    }
    let tasks: Vec<_> = (2..=9u64)
        .map(|i| {
            let c = h.c().clone();
            tokio::spawn(async move {
                c.claim(
                    &pid(&format!("p-{i}")),
                    &fence("acct-1", "worker-z", 100 + i),
                )
                .await
            })
        })
        .collect();
    for r in futures::future::join_all(tasks).await {
        match r.unwrap() {
            Err(PaymentError::AccountBusy {
                account_id,
                in_flight_payout_id,
            }) => {
                assert_eq!(account_id, "acct-1");
                assert!(!in_flight_payout_id.is_empty());
            }
            Err(PaymentError::FencedOut { .. }) => {}
            other => panic!("a second in-flight payout was accepted: {other:?}"),
        }
    }
    let in_flight: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM payout WHERE account_id = 'acct-1' AND state IN ('CLAIMED','RAIL_SUBMITTED','RAIL_ACKED','RAIL_AMBIGUOUS')",
    )
    .fetch_one(&h.pool)
    .await
    .unwrap();
    assert_eq!(in_flight, 1);
}

/// The database refuses a second in-flight payout per account (defense in depth under the lock),
/// as a typed AccountBusy that changes nothing, the fence included.
#[tokio::test]
async fn second_in_flight_payout_is_account_busy() {
    let h = harness().await;
    open(&h, "acct-1", 10_000).await;
    create(&h, "p-1", "acct-1", 1_000).await;
    create(&h, "p-2", "acct-1", 1_000).await;
    drive(h.c(), &pid("p-1"), PayoutState::RailAmbiguous).await;
    let before = snapshot(&h.pool, "p-2").await;
    let err = h
        .c()
        .claim(&pid("p-2"), &fence("acct-1", "worker-b", 50))
        .await
        .unwrap_err();
    match err {
        PaymentError::AccountBusy {
            account_id,
            in_flight_payout_id,
        } => {
            assert_eq!(
                (account_id.as_str(), in_flight_payout_id.as_str()),
                ("acct-1", "p-1")
            )
        }
        other => panic!("expected AccountBusy, got {other:?}"),
    }
    assert_eq!(snapshot(&h.pool, "p-2").await, before);
    assert_eq!(audit_count(&h.pool, "account_busy").await, 1);
}

/// Concurrent postings of one payout: exactly one posts, the others answer as it did; two ledger
/// rows, one posting outbox row and one POSTED event, the balance debited once.
#[tokio::test]
async fn concurrent_postings_post_exactly_once() {
    let h = harness().await;
    open(&h, "acct-1", 10_000).await;
    create(&h, "p-1", "acct-1", 1_234).await;
    let f = drive(h.c(), &pid("p-1"), PayoutState::RailAcked).await;
    const POSTERS: usize = 12;
    let tasks: Vec<_> = (0..POSTERS)
        .map(|_| {
            let (c, f) = (h.c().clone(), f.clone());
            tokio::spawn(async move { c.post(&pid("p-1"), &f).await.unwrap() })
        })
        .collect();
    let outcomes: Vec<_> = futures::future::join_all(tasks)
        .await
        .into_iter()
        .map(|r| r.unwrap())
        .collect();
    assert_eq!(outcomes.iter().filter(|o| !o.already_posted).count(), 1);
    let first = outcomes.iter().find(|o| !o.already_posted).unwrap();
    for o in &outcomes {
        assert_eq!(o.transaction_group, first.transaction_group);
        assert_eq!(o.entries, first.entries);
        assert_eq!(
            o.outbox_idempotency_key,
            "payment-resource:payout:p-1:posting:v1"
        );
    }
    let s = snapshot(&h.pool, "p-1").await;
    assert_eq!(s.balance_minor, 10_000 - 1_234);
    let payout_rows: i64 =
        sqlx::query_scalar("SELECT count(*) FROM ledger_entry WHERE payout_id = 'p-1'")
            .fetch_one(&h.pool)
            .await
            .unwrap();
    assert_eq!(payout_rows, 2);
    let journals: i64 =
        sqlx::query_scalar("SELECT count(*) FROM ledger_outbox WHERE kind = 'JOURNAL'")
            .fetch_one(&h.pool)
            .await
            .unwrap();
    assert_eq!(journals, 2, "one opening row and one posting row");
    // Beside them, the payout's lifecycle: created, claimed, submitted, acknowledged, posted once.
    assert_eq!(s.outbox_rows, 2 + 5);
    assert_eq!(lifecycle_rows(&h.pool, "p-1").await.len(), 5);
    assert_ledger_clean(&h).await;

    // Many accounts posting at once (each under a grant of its own account's key): the ledger
    // stays balanced throughout.
    let mut grants = Vec::new();
    for i in 2..=9 {
        open(&h, &format!("acct-{i}"), 5_000).await;
        create(&h, &format!("p-{i}"), &format!("acct-{i}"), 100 * i).await;
        grants.push((
            i,
            drive(h.c(), &pid(&format!("p-{i}")), PayoutState::RailAcked).await,
        ));
    }
    let tasks: Vec<_> = grants
        .into_iter()
        .map(|(i, f)| {
            let c = h.c().clone();
            tokio::spawn(async move { c.post(&pid(&format!("p-{i}")), &f).await.unwrap() })
        })
        .collect();
    for o in futures::future::join_all(tasks).await {
        assert!(!o.unwrap().already_posted);
    }
    assert_ledger_clean(&h).await;
}

/// The posting's rows and outbox payload, exactly; a later holder repeating Post changes nothing.
#[tokio::test]
async fn posting_writes_balanced_rows_and_the_outbox_payload() {
    let h = harness().await;
    open(&h, "acct-1", 100_000).await;
    create(&h, "p-1", "acct-1", 1_234).await;
    let f = drive(h.c(), &pid("p-1"), PayoutState::RailAcked).await;
    let posted = h.c().post(&pid("p-1"), &f).await.unwrap();
    assert!(!posted.already_posted);
    assert_eq!(posted.entries.len(), 2);
    assert_eq!(
        posted.entries.iter().map(|e| e.amount_minor).sum::<i64>(),
        0
    );
    assert_eq!(posted.entries[0].account_id, "acct-1");
    assert_eq!(posted.entries[0].amount_minor, -1_234);
    assert_eq!(posted.entries[1].account_id, "sys:payout-clearing:EUR");
    assert_eq!(posted.entries[0].counterparty, "sys:payout-clearing:EUR");

    let payload: sqlx::types::Text<String> = sqlx::query_scalar(
        "SELECT payload::text FROM ledger_outbox WHERE idempotency_key = 'payment-resource:payout:p-1:posting:v1'",
    )
    .fetch_one(&h.pool)
    .await
    .unwrap();
    let v: serde_json::Value = serde_json::from_str(&payload.0).unwrap();
    assert_eq!(v["source_service"], "payment-resource");
    assert_eq!(v["source_transaction_id"], "p-1");
    assert_eq!(v["tracking_code"], "cref-p-1");
    assert_eq!(v["effect_kind"], "PAYOUT_POSTED");
    assert_eq!(v["effect_version"], 1);
    assert_eq!(v["correlation_id"], "p-1");
    assert_eq!(v["actor_id"], "worker-a");
    assert_eq!(v["metadata"]["fencing_token"], 10);
    assert_eq!(
        v["metadata"]["transaction_group"],
        posted.transaction_group.to_string()
    );
    assert_eq!(v["metadata"]["payout_id"], "p-1");
    assert_eq!(v["entries"][0]["amount"], "-12.34");
    assert_eq!(v["entries"][0]["account"]["class"], "CUSTOMER_AVAILABLE");
    assert_eq!(v["entries"][1]["amount"], "12.34");
    assert_eq!(v["entries"][1]["account"]["owner_id"], "rail");
    let occurred =
        chrono::DateTime::parse_from_rfc3339(v["occurred_at"].as_str().unwrap()).unwrap();
    assert_eq!(
        occurred.with_timezone(&chrono::Utc),
        posted.payout.settled_at.unwrap()
    );
    let opening: sqlx::types::Text<String> = sqlx::query_scalar(
        "SELECT payload::text FROM ledger_outbox WHERE idempotency_key = 'payment-resource:account:acct-1:opening:v1'",
    )
    .fetch_one(&h.pool)
    .await
    .unwrap();
    let o: serde_json::Value = serde_json::from_str(&opening.0).unwrap();
    assert_eq!(
        (
            o["effect_kind"].as_str(),
            o["entries"][0]["amount"].as_str()
        ),
        (Some("ACCOUNT_OPENED"), Some("1000.00"))
    );

    // A later holder repeats the posting: same answer, nothing changes (not even the fence).
    let before = snapshot(&h.pool, "p-1").await;
    let again = h
        .c()
        .post(&pid("p-1"), &fence("acct-1", "worker-b", 99))
        .await
        .unwrap();
    assert!(again.already_posted);
    assert_eq!(again.entries, posted.entries);
    assert_eq!(snapshot(&h.pool, "p-1").await, before);
    assert_eq!(
        h.c()
            .get_account(&aid("acct-1"))
            .await
            .unwrap()
            .balance_minor,
        100_000 - 1_234
    );

    assert_ledger_clean(&h).await;
}

/// A payout's lifecycle events in the outbox, in outbox order: (id, account, kind, key, payload).
async fn lifecycle_rows(
    pool: &PgPool,
    payout: &str,
) -> Vec<(i64, String, String, String, serde_json::Value)> {
    sqlx::query_as::<_, (i64, String, String, String, sqlx::types::Text<String>)>(
        "SELECT id, account_id, kind, idempotency_key, payload::text FROM ledger_outbox \
         WHERE kind = 'TRANSACTION_EVENT' AND payload->>'source_transaction_id' = $1 ORDER BY id",
    )
    .bind(payout)
    .fetch_all(pool)
    .await
    .unwrap()
    .into_iter()
    .map(|(id, account, kind, key, payload)| {
        (
            id,
            account,
            kind,
            key,
            serde_json::from_str(&payload.0).unwrap(),
        )
    })
    .collect()
}

/// Issue 19: the payout's lifecycle reaches the GL through the same outbox. Its creation and every
/// transition (a re-claim, an ambiguity resolved by evidence and the posting included) write one
/// TRANSACTION_EVENT row each, on the payout's account, versions 1..n in outbox order, with the
/// step's name, actor and states; the POSTED journal row comes first in the posting's own
/// transaction and carries the rail's and the client's reference. A refused, fenced-out or
/// idempotent call writes none, and a transition killed while its event row waits leaves nothing
/// of itself (the step and its event are one transaction). An operator's abandon names the
/// verified operator as the event's actor.
#[tokio::test]
async fn every_step_of_a_payouts_lifecycle_writes_its_event_in_the_same_transaction() {
    let h = harness().await;
    open(&h, "acct-1", 10_000).await;
    create(&h, "p-1", "acct-1", 1_000).await;
    let p = pid("p-1");
    let a = fence("acct-1", "worker-a", 10);
    let b = fence("acct-1", "worker-b", 20);
    let steps: [(PayoutEvent, &Fence, &str, &str, &str); 6] = [
        (
            PayoutEvent::Claim,
            &a,
            "PAYOUT_CLAIMED",
            "PENDING",
            "worker-a",
        ),
        (
            PayoutEvent::Claim,
            &b,
            "PAYOUT_CLAIMED",
            "CLAIMED",
            "worker-b",
        ),
        (
            PayoutEvent::SubmissionAccepted,
            &b,
            "PAYOUT_SUBMITTED",
            "CLAIMED",
            "worker-b",
        ),
        (
            PayoutEvent::RailTimeout,
            &b,
            "PAYOUT_AMBIGUOUS",
            "RAIL_SUBMITTED",
            "worker-b",
        ),
        (
            PayoutEvent::EvidenceFound,
            &b,
            "PAYOUT_RESOLVED",
            "RAIL_AMBIGUOUS",
            "worker-b",
        ),
        (
            PayoutEvent::Posted,
            &b,
            "PAYOUT_POSTED",
            "RAIL_ACKED",
            "worker-b",
        ),
    ];
    let created = lifecycle_rows(&h.pool, "p-1").await;
    assert_eq!(created.len(), 1);
    let (_, account, kind, key, v) = &created[0];
    assert_eq!(
        (account.as_str(), kind.as_str(), key.as_str()),
        (
            "acct-1",
            "TRANSACTION_EVENT",
            "payment-resource:payout:p-1:event:v1"
        )
    );
    assert_eq!(
        (&v["event_type"], &v["event_version"], &v["actor_id"]),
        (&"PAYOUT_CREATED".into(), &1.into(), &"CREATOR".into())
    );
    assert_eq!(v["metadata"]["to_state"], "PENDING");
    assert!(v["metadata"]["from_state"].is_null());
    assert_eq!(v["metadata"]["amount_minor"], 1_000);
    assert_eq!(v["metadata"]["client_reference"], "cref-p-1");

    for (n, (event, f, name, from, actor)) in steps.iter().enumerate() {
        let version = n as i64 + 2;
        let after = perform(h.c(), &p, *event, f)
            .await
            .unwrap_or_else(|e| panic!("{event:?}: {e}"));
        let rows = lifecycle_rows(&h.pool, "p-1").await;
        assert_eq!(rows.len() as i64, version, "one event per step, {event:?}");
        let (_, account, kind, key, v) = rows.last().unwrap();
        assert_eq!(
            (account.as_str(), kind.as_str()),
            ("acct-1", "TRANSACTION_EVENT")
        );
        assert_eq!(
            key,
            &format!("payment-resource:payout:p-1:event:v{version}")
        );
        assert_eq!(v["idempotency_key"], key.as_str());
        assert_eq!(v["event_type"], *name, "{event:?}");
        assert_eq!(v["event_version"], version);
        assert_eq!(v["source_service"], "payment-resource");
        assert_eq!(
            (&v["source_transaction_id"], &v["correlation_id"]),
            (&"p-1".into(), &"p-1".into())
        );
        assert_eq!(v["actor_id"], *actor);
        assert_eq!(v["metadata"]["from_state"], *from);
        assert_eq!(v["metadata"]["to_state"], after.state.as_str());
        assert_eq!(v["metadata"]["transition_event"], event.as_str());
        assert_eq!(v["metadata"]["fencing_token"], f.token().get());
        assert_eq!(v["metadata"]["account_id"], "acct-1");
        let occurred =
            chrono::DateTime::parse_from_rfc3339(v["occurred_at"].as_str().unwrap()).unwrap();
        assert_eq!(occurred.with_timezone(&chrono::Utc), after.updated_at);
        let payout_version: i64 = sqlx::query_scalar("SELECT version FROM payout WHERE id = 'p-1'")
            .fetch_one(&h.pool)
            .await
            .unwrap();
        assert_eq!(
            payout_version + 1,
            version,
            "event n is the payout's version + 1"
        );
    }
    let rows = lifecycle_rows(&h.pool, "p-1").await;
    assert!(
        rows.windows(2).all(|w| w[0].0 < w[1].0),
        "versions in outbox order"
    );
    assert_eq!(rows.last().unwrap().4["metadata"]["rail_ref"], "rail-1");
    // The posting's journal: first in its transaction, JOURNAL, with the references as fields.
    let (journal_id, journal_kind, journal): (i64, String, sqlx::types::Text<String>) =
        sqlx::query_as(
            "SELECT id, kind, payload::text FROM ledger_outbox \
             WHERE idempotency_key = 'payment-resource:payout:p-1:posting:v1'",
        )
        .fetch_one(&h.pool)
        .await
        .unwrap();
    let journal: serde_json::Value = serde_json::from_str(&journal.0).unwrap();
    assert_eq!(journal_kind, "JOURNAL");
    assert_eq!(
        journal_id + 1,
        rows.last().unwrap().0,
        "journal, then its POSTED event"
    );
    assert_eq!(
        (
            &journal["settlement_reference"],
            &journal["client_reference"]
        ),
        (&"rail-1".into(), &"cref-p-1".into())
    );
    let opening: String = sqlx::query_scalar(
        "SELECT kind FROM ledger_outbox WHERE idempotency_key = 'payment-resource:account:acct-1:opening:v1'",
    )
    .fetch_one(&h.pool)
    .await
    .unwrap();
    assert_eq!(opening, "JOURNAL");

    // Refused, fenced out, idempotent: no event.
    let before = snapshot(&h.pool, "p-1").await;
    assert!(matches!(
        h.c().claim(&p, &fence("acct-1", "worker-c", 30)).await,
        Err(PaymentError::RefusedTransition { .. })
    ));
    assert!(matches!(
        h.c().mark_submitted(&p, &a).await,
        Err(PaymentError::FencedOut { .. })
    ));
    assert!(
        h.c()
            .post(&p, &fence("acct-1", "worker-c", 30))
            .await
            .unwrap()
            .already_posted
    );
    assert_eq!(snapshot(&h.pool, "p-1").await, before);
    assert_eq!(lifecycle_rows(&h.pool, "p-1").await.len(), 7);
    // The same id created again (idempotent): no second CREATED.
    create(&h, "p-1", "acct-1", 1_000).await;
    assert_eq!(lifecycle_rows(&h.pool, "p-1").await.len(), 7);

    // A claim killed while its event row waits on the outbox: nothing of the step survives.
    create(&h, "p-2", "acct-1", 500).await;
    let before = snapshot(&h.pool, "p-2").await;
    let transitions_before = audit_count(&h.pool, "transition").await;
    let c = h.c().clone();
    let (_, claimed) = killed_at_its_insert_into(&h.pool, "ledger_outbox", async move {
        c.claim(&pid("p-2"), &fence("acct-1", "worker-d", 40)).await
    })
    .await;
    assert!(claimed.is_err());
    assert_eq!(
        snapshot(&h.pool, "p-2").await,
        before,
        "the killed claim left nothing"
    );
    assert_eq!(audit_count(&h.pool, "transition").await, transitions_before);
    assert_eq!(
        lifecycle_rows(&h.pool, "p-2").await.len(),
        1,
        "only its CREATED"
    );

    // An operator's abandon: the verified operator is the event's actor.
    perform(
        h.c(),
        &pid("p-2"),
        PayoutEvent::OperatorAbandon,
        &fence("acct-1", "worker-d", 40),
    )
    .await
    .unwrap();
    let rows = lifecycle_rows(&h.pool, "p-2").await;
    let v = &rows.last().unwrap().4;
    assert_eq!(
        (&v["event_type"], &v["event_version"], &v["actor_id"]),
        (&"PAYOUT_ABANDONED".into(), &2.into(), &"op-1".into())
    );
    assert_eq!(v["metadata"]["owner"], "worker-d");
    assert_eq!(v["metadata"]["actor"], "OPERATOR");
    assert!(v["metadata"]["failure_reason"]
        .as_str()
        .unwrap()
        .contains("op-1"));
    assert_ledger_clean(&h).await;
}

/// Kill the database connection in the middle of a posting (after the ledger rows and the balance
/// were written, while the outbox insert waits on a lock): nothing of it survives; a retry posts.
#[tokio::test]
async fn killed_connection_mid_posting_leaves_no_partial_state() {
    let h = harness().await;
    open(&h, "acct-1", 10_000).await;
    create(&h, "p-1", "acct-1", 2_500).await;
    drive(h.c(), &pid("p-1"), PayoutState::RailAcked).await;
    let before = snapshot(&h.pool, "p-1").await;

    let c = h.c().clone();
    // The victim's transaction has already written both ledger rows and the balance.
    let (killed, posting) = killed_at_its_insert_into(&h.pool, "ledger_outbox", async move {
        c.post(&pid("p-1"), &fence("acct-1", "worker-b", 40)).await
    })
    .await;
    assert!(killed);
    let err = posting.unwrap_err();
    assert!(matches!(err, PaymentError::Transport { .. }), "{err:?}");
    assert_eq!(
        snapshot(&h.pool, "p-1").await,
        before,
        "a killed posting left partial state"
    );
    assert_ledger_clean(&h).await;

    let posted = h
        .c()
        .post(&pid("p-1"), &fence("acct-1", "worker-b", 40))
        .await
        .unwrap();
    assert!(!posted.already_posted);
    assert_eq!(snapshot(&h.pool, "p-1").await.balance_minor, 7_500);
    assert_ledger_clean(&h).await;
}

/// The same for a claim: killed after the fence advance and the payout update, before commit.
#[tokio::test]
async fn killed_connection_mid_claim_leaves_no_partial_state() {
    let h = harness().await;
    open(&h, "acct-1", 10_000).await;
    create(&h, "p-1", "acct-1", 2_500).await;
    let before = snapshot(&h.pool, "p-1").await;
    let c = h.c().clone();
    let (_, claimed) = killed_at_its_insert_into(&h.pool, "audit_event", async move {
        c.claim(&pid("p-1"), &fence("acct-1", "worker-a", 10)).await
    })
    .await;
    assert!(claimed.is_err());
    let after = snapshot(&h.pool, "p-1").await;
    assert_eq!(after, before, "a killed claim left partial state");
    assert_eq!(
        after.fence, 0,
        "the fence advance was rolled back with the rest"
    );
    let claimed = h
        .c()
        .claim(&pid("p-1"), &fence("acct-1", "worker-a", 10))
        .await
        .unwrap();
    assert_eq!(claimed.state, PayoutState::Claimed);
}

/// Runs `call` while `table` is locked, kills the database connection whose insert into `table`
/// waits on that lock (so its transaction dies after everything it wrote before the insert), and
/// returns whether the kill landed and what `call` answered.
async fn killed_at_its_insert_into<T: Send + 'static>(
    pool: &PgPool,
    table: &'static str,
    call: impl std::future::Future<Output = T> + Send + 'static,
) -> (bool, T) {
    let mut locker = pool.begin().await.unwrap();
    sqlx::query(&format!("LOCK TABLE {table} IN EXCLUSIVE MODE"))
        .execute(&mut *locker)
        .await
        .unwrap();
    let call = tokio::spawn(call);
    let victim = blocked_backend(pool, &format!("INSERT INTO {table}%")).await;
    let killed: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1)")
        .bind(victim)
        .fetch_one(&mut *locker)
        .await
        .unwrap();
    locker.commit().await.unwrap();
    (killed, call.await.unwrap())
}

async fn blocked_backend(pool: &PgPool, query_like: &str) -> i32 {
    let query_like = query_like.to_string();
    testkit::eventually(
        POLL_TIMEOUT,
        "a backend blocked on the test's table lock",
        || {
            let (pool, query_like) = (pool.clone(), query_like.clone());
            async move {
                sqlx::query_scalar::<_, i32>(
                    "SELECT pid FROM pg_stat_activity WHERE datname = current_database() \
                 AND wait_event_type = 'Lock' AND query LIKE $1",
                )
                .bind(query_like)
                .fetch_optional(&pool)
                .await
                .ok()
                .flatten()
            }
        },
    )
    .await
    .unwrap()
}

async fn row_counts(pool: &PgPool) -> Vec<i64> {
    let mut counts = Vec::new();
    for table in [
        "account",
        "payout",
        "ledger_entry",
        "ledger_outbox",
        "audit_event",
        "system_account",
    ] {
        counts.push(
            sqlx::query_scalar(&format!("SELECT count(*) FROM {table}"))
                .fetch_one(pool)
                .await
                .unwrap(),
        );
    }
    let fences: i64 = sqlx::query_scalar("SELECT coalesce(sum(fence), 0)::bigint FROM account")
        .fetch_one(pool)
        .await
        .unwrap();
    counts.push(fences);
    counts
}

fn invalid(field: &str, reason: InvalidReason) -> PaymentError {
    PaymentError::InvalidArgument {
        field: field.into(),
        reason,
    }
}

fn same(a: &PaymentError, b: &PaymentError) -> bool {
    format!("{a:?}") == format!("{b:?}")
}

/// Each bad request gets its own specific, typed error, and writes nothing (row counts and fences
/// compared before and after).
#[tokio::test]
async fn bad_input_is_refused_specifically_and_writes_nothing() {
    use payment_client::wire::status_to_error;
    let h = harness().await;
    open(&h, "acct-1", 10_000).await;
    create(&h, "p-1", "acct-1", 1_000).await;
    drive(h.c(), &pid("p-1"), PayoutState::RailAmbiguous).await;
    create(&h, "p-2", "acct-1", 1_000).await;
    let raw = h.c().raw();
    let good = || Some(wire_fence("acct-1", "worker-a", 10));
    let create_req = |f: &dyn Fn(&mut pb::CreatePayoutRequest)| {
        let mut r = pb::CreatePayoutRequest {
            payout_id: "p-9".into(),
            account_id: "acct-1".into(),
            amount_minor: 100,
            currency: "EUR".into(),
            beneficiary_ref: "ben-1".into(),
        };
        f(&mut r);
        r
    };
    let before = row_counts(&h.pool).await;

    let mut cases: Vec<(&str, PaymentError, Result<(), tonic::Status>)> = Vec::new();
    macro_rules! case {
        ($name:expr, $expected:expr, $call:expr) => {
            cases.push(($name, $expected, $call.await.map(|_| ())));
        };
    }
    case!(
        "empty payout id",
        invalid("payout_id", InvalidReason::IdInvalid),
        raw.clone()
            .create_payout(create_req(&|r| r.payout_id.clear()))
    );
    case!(
        "payout id with spaces",
        invalid("payout_id", InvalidReason::IdInvalid),
        raw.clone()
            .create_payout(create_req(&|r| r.payout_id = "p 9".into()))
    );
    case!(
        "payout id too long",
        invalid("payout_id", InvalidReason::IdInvalid),
        raw.clone()
            .create_payout(create_req(&|r| r.payout_id = "p".repeat(65)))
    );
    case!(
        "empty account id",
        invalid("account_id", InvalidReason::IdInvalid),
        raw.clone()
            .create_payout(create_req(&|r| r.account_id.clear()))
    );
    case!(
        "zero amount",
        invalid("amount_minor", InvalidReason::AmountNotPositive),
        raw.clone()
            .create_payout(create_req(&|r| r.amount_minor = 0))
    );
    case!(
        "negative amount",
        invalid("amount_minor", InvalidReason::AmountNotPositive),
        raw.clone()
            .create_payout(create_req(&|r| r.amount_minor = -5))
    );
    case!(
        "lower-case currency",
        invalid("currency", InvalidReason::CurrencyInvalid),
        raw.clone()
            .create_payout(create_req(&|r| r.currency = "eur".into()))
    );
    case!(
        "unsupported currency",
        invalid("currency", InvalidReason::CurrencyInvalid),
        raw.clone()
            .create_payout(create_req(&|r| r.currency = "XXX".into()))
    );
    case!(
        "not the account's currency",
        invalid("currency", InvalidReason::CurrencyMismatch),
        raw.clone()
            .create_payout(create_req(&|r| r.currency = "USD".into()))
    );
    case!(
        "empty beneficiary",
        invalid("beneficiary_ref", InvalidReason::BeneficiaryInvalid),
        raw.clone()
            .create_payout(create_req(&|r| r.beneficiary_ref.clear()))
    );
    case!(
        "unknown account",
        PaymentError::AccountNotFound {
            account_id: "acct-404".into()
        },
        raw.clone()
            .create_payout(create_req(&|r| r.account_id = "acct-404".into()))
    );
    case!(
        "same id, different content",
        PaymentError::PayoutExistsWithDifferentContent {
            payout_id: "p-2".into()
        },
        raw.clone()
            .create_payout(create_req(&|r| r.payout_id = "p-2".into()))
    );
    case!(
        "fence missing",
        invalid("fence", InvalidReason::FenceMissing),
        raw.clone().claim(pb::ClaimRequest {
            payout_id: "p-2".into(),
            fence: None
        })
    );
    case!(
        "token zero",
        invalid("fence.token", InvalidReason::TokenMissing),
        raw.clone().claim(pb::ClaimRequest {
            payout_id: "p-2".into(),
            fence: Some(wire_fence("acct-1", "w", 0))
        })
    );
    case!(
        "token above i64",
        invalid("fence.token", InvalidReason::TokenOutOfRange),
        raw.clone().claim(pb::ClaimRequest {
            payout_id: "p-2".into(),
            fence: Some(wire_fence("acct-1", "w", u64::MAX))
        })
    );
    case!(
        "owner missing",
        invalid("fence.owner", InvalidReason::OwnerMissing),
        raw.clone().claim(pb::ClaimRequest {
            payout_id: "p-2".into(),
            fence: Some(wire_fence("acct-1", " ", 10))
        })
    );
    case!(
        "unknown payout",
        PaymentError::PayoutNotFound {
            payout_id: "p-404".into()
        },
        raw.clone().claim(pb::ClaimRequest {
            payout_id: "p-404".into(),
            fence: good()
        })
    );
    case!(
        "outcome unspecified",
        invalid("outcome", InvalidReason::OutcomeMissingValue),
        raw.clone().record_outcome(pb::RecordOutcomeRequest {
            payout_id: "p-1".into(),
            fence: good(),
            ..Default::default()
        })
    );
    case!(
        "acked without rail ref",
        invalid("rail_ref", InvalidReason::RailRefMissing),
        raw.clone().record_outcome(pb::RecordOutcomeRequest {
            payout_id: "p-1".into(),
            fence: good(),
            outcome: pb::RailOutcome::Acked as i32,
            ..Default::default()
        })
    );
    case!(
        "declined without code",
        invalid("decline_code", InvalidReason::DeclineCodeMissing),
        raw.clone().record_outcome(pb::RecordOutcomeRequest {
            payout_id: "p-1".into(),
            fence: good(),
            outcome: pb::RailOutcome::Declined as i32,
            ..Default::default()
        })
    );
    case!(
        "evidence unspecified",
        invalid("evidence", InvalidReason::EvidenceMissingValue),
        raw.clone().resolve_ambiguity(pb::ResolveAmbiguityRequest {
            payout_id: "p-1".into(),
            fence: good(),
            evidence_source: "rail-lookup".into(),
            ..Default::default()
        })
    );
    case!(
        "found without rail ref",
        invalid("rail_ref", InvalidReason::RailRefMissing),
        raw.clone().resolve_ambiguity(pb::ResolveAmbiguityRequest {
            payout_id: "p-1".into(),
            fence: good(),
            evidence: pb::Evidence::Found as i32,
            evidence_source: "rail-lookup".into(),
            ..Default::default()
        })
    );
    case!(
        "evidence without source",
        invalid("evidence_source", InvalidReason::EvidenceSourceMissing),
        raw.clone().resolve_ambiguity(pb::ResolveAmbiguityRequest {
            payout_id: "p-1".into(),
            fence: good(),
            evidence: pb::Evidence::Absent as i32,
            ..Default::default()
        })
    );
    case!(
        "abandon without operator",
        invalid("operator", InvalidReason::OperatorMissing),
        raw.clone().abandon(pb::AbandonRequest {
            payout_id: "p-1".into(),
            fence: good(),
            reason: "r".into(),
            resolution_sla_passed: true,
            ..Default::default()
        })
    );
    case!(
        "abandon without reason",
        invalid("reason", InvalidReason::ReasonMissing),
        raw.clone().abandon(pb::AbandonRequest {
            payout_id: "p-1".into(),
            fence: good(),
            operator: "op".into(),
            resolution_sla_passed: true,
            ..Default::default()
        })
    );
    case!(
        "abandon reason too long",
        invalid("reason", InvalidReason::TextTooLong),
        raw.clone().abandon(pb::AbandonRequest {
            payout_id: "p-1".into(),
            fence: good(),
            operator: "op".into(),
            reason: "x".repeat(2000),
            resolution_sla_passed: true,
            ..Default::default()
        })
    );
    // NUL is the one character PostgreSQL text and jsonb cannot hold: before it was refused here,
    // the call failed after the guard, as INTERNAL "unsupported Unicode escape sequence".
    case!(
        "abandon reason with NUL",
        invalid("reason", InvalidReason::TextHasNul),
        raw.clone().abandon(pb::AbandonRequest {
            payout_id: "p-1".into(),
            fence: good(),
            operator: "op".into(),
            reason: "a\0b".into(),
            resolution_sla_passed: true,
            ..Default::default()
        })
    );
    case!(
        "owner with NUL",
        invalid("fence.owner", InvalidReason::TextHasNul),
        raw.clone().claim(pb::ClaimRequest {
            payout_id: "p-2".into(),
            fence: Some(wire_fence("acct-1", "worker\0", 10)),
        })
    );
    // The grant's key and key id go into the refusal's audit row: bounded like every text, and
    // refused before the signature is checked.
    case!(
        "key with NUL",
        invalid("fence.key", InvalidReason::TextHasNul),
        raw.clone().claim(pb::ClaimRequest {
            payout_id: "p-2".into(),
            fence: Some(pb::Fence {
                key: "payout:acct-1\0".into(),
                ..wire_fence("acct-1", "worker-a", 10)
            }),
        })
    );
    case!(
        "signing key id too long",
        invalid("fence.signing_key_id", InvalidReason::TextTooLong),
        raw.clone().claim(pb::ClaimRequest {
            payout_id: "p-2".into(),
            fence: Some(pb::Fence {
                signing_key_id: "k".repeat(2000),
                ..wire_fence("acct-1", "worker-a", 10)
            }),
        })
    );
    case!(
        "decision missing",
        invalid("decision", InvalidReason::DecisionMissing),
        raw.clone()
            .record_operator_decision(pb::RecordOperatorDecisionRequest {
                payout_id: "p-1".into(),
                operator: "op".into(),
                ..Default::default()
            })
    );
    // A token above i64::MAX on the one call whose token is optional: this panicked the handler
    // (FencingToken::as_i64) before FencingToken refused it at construction.
    case!(
        "operator decision token above i64",
        invalid("token", InvalidReason::TokenOutOfRange),
        raw.clone()
            .record_operator_decision(pb::RecordOperatorDecisionRequest {
                payout_id: "p-1".into(),
                operator: "op".into(),
                decision: "abandon".into(),
                token: u64::MAX,
                ..Default::default()
            })
    );
    case!(
        "negative opening balance",
        invalid(
            "opening_balance_minor",
            InvalidReason::OpeningBalanceNegative
        ),
        raw.clone().open_account(pb::OpenAccountRequest {
            account_id: "acct-2".into(),
            currency: "EUR".into(),
            opening_balance_minor: -1,
            ..Default::default()
        })
    );
    case!(
        "account with bad currency",
        invalid("currency", InvalidReason::CurrencyInvalid),
        raw.clone().open_account(pb::OpenAccountRequest {
            account_id: "acct-2".into(),
            currency: "EURO".into(),
            opening_balance_minor: 1,
            ..Default::default()
        })
    );
    case!(
        "account reopened differently",
        PaymentError::AccountExistsWithDifferentContent {
            account_id: "acct-1".into()
        },
        raw.clone().open_account(pb::OpenAccountRequest {
            account_id: "acct-1".into(),
            currency: "EUR".into(),
            opening_balance_minor: 0,
            ..Default::default()
        })
    );

    for (name, expected, got) in cases {
        let status = got.expect_err(name);
        let err = status_to_error(status);
        assert!(
            same(&err, &expected),
            "{name}: expected {expected:?}, got {err:?}"
        );
    }
    assert_eq!(
        row_counts(&h.pool).await,
        before,
        "a bad request wrote something"
    );

    // Abandoning an ambiguous payout before its SLA (the production default, one hour): typed
    // refusal, recorded, nothing else.
    let strict = start_service(&h.url, options()).await;
    let before = snapshot(&h.pool, "p-1").await;
    let err = strict
        .client
        .abandon(
            &pid("p-1"),
            &fence("acct-1", "op-1", 10),
            &AbandonRequest {
                operator: "op-1".into(),
                reason: "r".into(),
                resolution_sla_passed: false,
                sla_check: "since=T0 now=T0+1h".into(),
                signature: signed("p-1", "op-1", "r"),
            },
        )
        .await
        .unwrap_err();
    assert!(
        matches!(err, PaymentError::ResolutionSlaNotPassed { .. }),
        "{err:?}"
    );
    assert_eq!(snapshot(&h.pool, "p-1").await, before);
    assert_eq!(audit_count(&h.pool, "resolution_sla_not_passed").await, 1);

    // Idempotent creation and opening: same content returns the same thing, writes nothing.
    let counts = row_counts(&h.pool).await;
    let again = create(&h, "p-2", "acct-1", 1_000).await;
    assert_eq!(again.state, PayoutState::Pending);
    assert_eq!(again.client_reference, "cref-p-2");
    h.c()
        .open_funded_account(&aid("acct-1"), &eur(), 10_000, &funding("acct-1", 10_000))
        .await
        .unwrap();
    assert_eq!(row_counts(&h.pool).await, counts);
}

/// The operator decision is on the payout's record, with who and why, before anything acts on it.
/// The resolution SLA is the payment resource's own decision, from its record of when the payout
/// became RAIL_AMBIGUOUS, on the database's clock: a caller that asserts the SLA has passed is
/// refused before it has (before this, `resolution_sla_passed: true` was enough), and one that
/// asserts nothing is honoured after it.
#[tokio::test]
async fn the_resolution_sla_is_the_resources_own_record_not_the_callers_word() {
    const SLA: std::time::Duration = std::time::Duration::from_millis(1_500);
    let h = harness().await;
    let service = start_service(&h.url, options().with_resolution_sla(SLA)).await;
    let c = &service.client;
    open(&h, "acct-1", 10_000).await;
    create(&h, "p-1", "acct-1", 1_000).await;
    let f = drive(c, &pid("p-1"), PayoutState::RailAmbiguous).await;
    let request = |caller_says_passed: bool| AbandonRequest {
        operator: "op-1".into(),
        reason: "finance ticket 42".into(),
        resolution_sla_passed: caller_says_passed,
        sla_check: "the caller's own clock".into(),
        signature: signed("p-1", "op-1", "finance ticket 42"),
    };
    let err = c
        .abandon(&pid("p-1"), &f, &request(true))
        .await
        .unwrap_err();
    assert!(
        matches!(err, PaymentError::ResolutionSlaNotPassed { .. }),
        "the caller's word is not the SLA: {err:?}"
    );
    assert_eq!(snapshot(&h.pool, "p-1").await.state, "RAIL_AMBIGUOUS");
    tokio::time::sleep(SLA + std::time::Duration::from_millis(200)).await;
    let abandoned = c.abandon(&pid("p-1"), &f, &request(false)).await.unwrap();
    assert_eq!(abandoned.state, PayoutState::Abandoned);
    let detail: serde_json::Value = sqlx::query_scalar(
        "SELECT detail FROM audit_event WHERE payout_id = 'p-1' AND kind = 'transition' AND to_state = 'ABANDONED'",
    )
    .fetch_one(&h.pool)
    .await
    .unwrap();
    assert_eq!(detail["resolution_sla_ms"], 1_500, "{detail}");
    assert!(detail["ambiguous_since"].is_string(), "{detail}");
    assert_eq!(detail["caller_says_sla_passed"], false, "{detail}");
}

#[tokio::test]
async fn operator_decisions_are_recorded() {
    let h = harness().await;
    open(&h, "acct-1", 10_000).await;
    create(&h, "p-1", "acct-1", 1_000).await;
    let e = h
        .c()
        .record_operator_decision(&OperatorDecision {
            payout_id: pid("p-1"),
            operator: "alice".into(),
            decision: "abandon".into(),
            reason: "beneficiary closed".into(),
            accepted: false,
            note: "payout is RAIL_SUBMITTED".into(),
            token: None,
            signature: None,
        })
        .await
        .unwrap();
    assert_eq!(
        (e.kind.as_str(), e.actor.as_str(), e.owner.as_deref()),
        ("operator_decision", "OPERATOR", Some("alice"))
    );
    assert_eq!(e.detail["accepted"], false);
    let history = h.c().get_payout(&pid("p-1")).await.unwrap().history;
    assert_eq!(
        history.iter().map(|e| e.kind.as_str()).collect::<Vec<_>>(),
        ["payout_created", "operator_decision"]
    );
}

/// paydb enforces what the code also checks: append-only ledger and audit, balanced groups,
/// balances equal to entries, a non-decreasing fence, an immutable outbox payload, terminal
/// payouts that never change. Each statement is refused by the database itself.
#[tokio::test]
async fn database_enforces_the_invariants_on_its_own() {
    let h = harness().await;
    open(&h, "acct-1", 10_000).await;
    create(&h, "p-1", "acct-1", 1_000).await;
    drive(h.c(), &pid("p-1"), PayoutState::Posted).await;
    let refused = [
        ("UPDATE ledger_entry SET amount_minor = amount_minor * 2", "append-only"),
        ("DELETE FROM ledger_entry", "append-only"),
        ("TRUNCATE ledger_entry", "append-only"),
        ("UPDATE audit_event SET actor = 'x'", "append-only"),
        ("DELETE FROM audit_event", "append-only"),
        ("UPDATE account SET fence = 1", "may not decrease"),
        ("UPDATE account SET balance_minor = balance_minor + 1", "differs from the sum of its entries"),
        // An entry that moves the account without its balance (a balanced group).
        (
            "INSERT INTO ledger_entry (transaction_group, line_number, account_id, currency, amount_minor, counterparty) \
             VALUES ('00000000-0000-0000-0000-0000000000a1', 1, 'acct-1', 'EUR', 5, 'sys:funding:EUR'), \
                    ('00000000-0000-0000-0000-0000000000a1', 2, 'sys:funding:EUR', 'EUR', -5, 'acct-1')",
            "differs from the sum of its entries",
        ),
        // The kept sum of the account's entries (paydb 0013) moves only with an entry: forging it
        // beside the balance would pass the commit check.
        ("UPDATE account SET entries_sum_minor = entries_sum_minor + 1", "entries_sum_minor is kept by the ledger"),
        (
            "UPDATE account SET balance_minor = balance_minor + 1, entries_sum_minor = entries_sum_minor + 1",
            "entries_sum_minor is kept by the ledger",
        ),
        (
            "INSERT INTO account (id, currency, balance_minor, opening_balance_minor, entries_sum_minor) \
             VALUES ('acct-9', 'EUR', 5, 5, 5)",
            "entries_sum_minor is kept by the ledger",
        ),
        ("UPDATE ledger_outbox SET payload = '{}'::jsonb", "payload is immutable"),
        // A row's kind decides the GL call that delivers it (paydb 0008): immutable too.
        ("UPDATE ledger_outbox SET kind = 'JOURNAL' WHERE kind = 'TRANSACTION_EVENT'", "payload is immutable"),
        ("DELETE FROM ledger_outbox", "never deleted"),
        ("DELETE FROM payout", "never deleted"),
        ("UPDATE payout SET state = 'PENDING'", "is terminal"),
        (
            "INSERT INTO ledger_entry (transaction_group, line_number, account_id, currency, amount_minor, counterparty) \
             VALUES (gen_random_uuid(), 1, 'sys:funding:EUR', 'EUR', 5, 'x')",
            "does not sum to zero",
        ),
        (
            "INSERT INTO ledger_entry (transaction_group, line_number, account_id, currency, amount_minor, counterparty) \
             VALUES (gen_random_uuid(), 1, 'nobody', 'EUR', 5, 'x')",
            "is unknown",
        ),
        (
            "INSERT INTO payout (id, account_id, amount_minor, currency, beneficiary_ref, client_reference) \
             VALUES ('p-9', 'acct-1', 5, 'EUR', 'b', 'cref-other')",
            "payout_check",
        ),
    ];
    for (sql, why) in refused {
        let mut tx = h.pool.begin().await.unwrap();
        let result = match sqlx::query(sql).execute(&mut *tx).await {
            Ok(_) => tx.commit().await,
            Err(e) => Err(e),
        };
        let err = result.expect_err(sql).to_string();
        assert!(
            err.contains(why),
            "{sql}: refused for another reason: {err}"
        );
    }
    // The dispatcher's delivery columns stay writable.
    sqlx::query("UPDATE ledger_outbox SET attempts = attempts + 1, last_error = 'x'")
        .execute(&h.pool)
        .await
        .unwrap();
    assert_ledger_clean(&h).await;
}

/// The commit check of INV-03 reads the account's kept sum of its entries (paydb 0013), not its
/// history: the sum follows every entry (an opening, a posting) and equals the whole-history sum
/// (that no statement may write it is `database_enforces_the_invariants_on_its_own`'s).
#[tokio::test]
async fn the_kept_sum_of_an_accounts_entries_follows_every_entry() {
    let h = harness().await;
    open(&h, "acct-1", 10_000).await;
    create(&h, "p-1", "acct-1", 1_000).await;
    create(&h, "p-2", "acct-1", 2_500).await;
    drive(h.c(), &pid("p-1"), PayoutState::Posted).await;
    drive(h.c(), &pid("p-2"), PayoutState::Posted).await;
    let (balance, kept, summed): (i64, i64, i64) = sqlx::query_as(
        "SELECT a.balance_minor, a.entries_sum_minor, \
                (SELECT coalesce(sum(amount_minor), 0)::bigint FROM ledger_entry e WHERE e.account_id = a.id) \
           FROM account a WHERE a.id = 'acct-1'",
    )
    .fetch_one(&h.pool)
    .await
    .unwrap();
    assert_eq!((balance, kept, summed), (6_500, 6_500, 6_500));
    assert_ledger_clean(&h).await;
}

/// NEGATIVE CONTROL of the kept sum's guard (`account_entries_sum_kept`, paydb 0013): with the
/// guard trigger off (the owner, in this test's own database), a statement that moves the balance
/// and the kept sum together commits, a balance changed without any entry, which the commit check
/// cannot see; only the after-the-fact check that sums the history (CheckLedger, the reconciler's
/// INV-03) reports it. With the guard on, the same statement is refused
/// (`database_enforces_the_invariants_on_its_own`).
#[tokio::test]
async fn negative_control_without_the_kept_sum_guard_a_balance_moves_without_entries() {
    let h = harness().await;
    open(&h, "acct-1", 10_000).await;
    sqlx::query("ALTER TABLE account DISABLE TRIGGER account_entries_sum_kept")
        .execute(&h.pool)
        .await
        .unwrap();
    sqlx::query(
        "UPDATE account SET balance_minor = balance_minor + 1, entries_sum_minor = entries_sum_minor + 1 \
         WHERE id = 'acct-1'",
    )
    .execute(&h.pool)
    .await
    .expect("without its guard the forged pair commits");
    let balance: i64 = sqlx::query_scalar("SELECT balance_minor FROM account WHERE id = 'acct-1'")
        .fetch_one(&h.pool)
        .await
        .unwrap();
    assert_eq!(balance, 10_001, "the balance moved without an entry");
    let report = h.c().check_ledger().await.unwrap();
    let kinds: Vec<_> = report
        .violations
        .iter()
        .map(|v| (v.kind.as_str(), v.account_id.as_str(), v.actual_minor))
        .collect();
    assert_eq!(kinds, [("BALANCE_MISMATCH", "acct-1", 10_001)]);
}

/// NEGATIVE CONTROL of CheckLedger: with the database's triggers bypassed (replication role,
/// superuser only), a broken balance and an unbalanced group are written, and CheckLedger reports
/// both; before that it reports none.
#[tokio::test]
async fn check_ledger_reports_what_is_broken() {
    let h = harness().await;
    open(&h, "acct-1", 10_000).await;
    open(&h, "acct-2", 10_000).await;
    let clean = h.c().check_ledger().await.unwrap();
    assert!(clean.violations.is_empty());
    assert_eq!((clean.groups_checked, clean.accounts_checked), (2, 2));
    let mut conn = h.pool.acquire().await.unwrap();
    sqlx::query("SET session_replication_role = replica")
        .execute(&mut *conn)
        .await
        .unwrap();
    sqlx::query("UPDATE account SET balance_minor = 1 WHERE id = 'acct-1'")
        .execute(&mut *conn)
        .await
        .unwrap();
    sqlx::query(
        "INSERT INTO ledger_entry (transaction_group, line_number, account_id, currency, amount_minor, counterparty) \
         VALUES ('00000000-0000-0000-0000-000000000001', 1, 'sys:funding:EUR', 'EUR', 7, 'x')",
    )
    .execute(&mut *conn)
    .await
    .unwrap();
    sqlx::query("SET session_replication_role = origin")
        .execute(&mut *conn)
        .await
        .unwrap();
    drop(conn);
    let broken = h.c().check_ledger().await.unwrap();
    let kinds: Vec<_> = broken
        .violations
        .iter()
        .map(|v| (v.kind.as_str(), v.account_id.as_str(), v.actual_minor))
        .collect();
    assert!(
        kinds.contains(&("BALANCE_MISMATCH", "acct-1", 1)),
        "{kinds:?}"
    );
    assert!(kinds.contains(&("GROUP_UNBALANCED", "", 7)), "{kinds:?}");
    assert_eq!(broken.violations.len(), 2);
}

/// `payment-resource fixture` opens accounts through the same code as OpenAccount, idempotently.
#[tokio::test]
async fn fixture_command_opens_accounts() {
    let h = harness().await;
    let bin = env!("CARGO_BIN_EXE_payment-resource");
    for _ in 0..2 {
        let out = tokio::process::Command::new(bin)
            .env("PAYDB_URL", &h.url)
            .args([
                "fixture",
                "--accounts",
                "3",
                "--balance-minor",
                "5000",
                "--currency",
                "EUR",
            ])
            .output()
            .await
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    for i in 1..=3 {
        let a = h.c().get_account(&aid(&format!("acct-{i}"))).await.unwrap();
        assert_eq!(
            (a.balance_minor, a.currency.as_str(), a.fence),
            (5_000, "EUR", 0)
        );
    }
    let outbox: i64 = sqlx::query_scalar("SELECT count(*) FROM ledger_outbox")
        .fetch_one(&h.pool)
        .await
        .unwrap();
    assert_eq!(outbox, 3);
    assert_ledger_clean(&h).await;
}

/// grpc.health.v1 reports SERVING once the database ping succeeds.
#[tokio::test]
async fn health_reports_serving() {
    let url = Stack::shared().fresh_db(PgServer::Main).await;
    let pool = service_kit::connect_pg(&url).await.unwrap();
    payment_resource::migrate(&pool).await.unwrap();
    let metrics = Metrics::default();
    let store = Store::new(pool, options(), &metrics);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (shutdown, _stop) = Shutdown::new();
    tokio::spawn(payment_resource::serve(
        listener,
        store,
        front(&metrics),
        shutdown,
    ));
    let channel = tls(Role::Reconciler)
        .connect(&format!("https://{addr}"), Role::PaymentResource)
        .await
        .unwrap();
    let health = tonic_health::pb::health_client::HealthClient::new(channel);
    testkit::eventually(POLL_TIMEOUT, "SERVING", || {
        let mut health = health.clone();
        async move {
            let r = health
                .check(tonic_health::pb::HealthCheckRequest {
                    service: payment_resource::SERVICE_NAME.into(),
                })
                .await
                .ok()?;
            (r.into_inner().status
                == tonic_health::pb::health_check_response::ServingStatus::Serving as i32)
                .then_some(())
        }
    })
    .await
    .unwrap();
}

/// The binary: `serve` applies migrations, reports SERVING, answers over gRPC, and stops cleanly
/// on SIGTERM (well within the kit's grace period, with its own "stopped" log line).
#[tokio::test]
async fn binary_serves_and_stops_on_sigterm() {
    let url = Stack::shared()
        .provisioned_db(PgServer::Main, testkit::db_access::Database::Paydb)
        .await;
    let operators = operator("op-1").public_key().to_string();
    let binary = Binary::start(&url, &["--fixture-accounts", "--operator-keys", &operators]);
    let fixture = binary.client(&tls(Role::Fixture)).await;
    let client = binary.client(&tls(Role::Worker)).await;
    let account = fixture
        .open_funded_account(&aid("acct-1"), &eur(), 1_000, &funding("acct-1", 1_000))
        .await
        .unwrap();
    assert_eq!(account.balance_minor, 1_000);
    // The binary verifies with the key it was given: a signed grant passes, an unsigned one not.
    fixture
        .create_payout(&NewPayout {
            payout_id: pid("p-1"),
            account_id: aid("acct-1"),
            amount_minor: AmountMinor::new(100).unwrap(),
            currency: eur(),
            beneficiary_ref: BeneficiaryRef::parse("ben-1").unwrap(),
        })
        .await
        .unwrap();
    let unsigned = Fence::new("worker-a", max_token()).unwrap();
    assert!(matches!(
        client.claim(&pid("p-1"), &unsigned).await,
        Err(PaymentError::ForgedGrant { .. })
    ));
    let claimed = client
        .claim(&pid("p-1"), &fence("acct-1", "worker-a", 10))
        .await
        .unwrap();
    assert_eq!(claimed.state, PayoutState::Claimed);
    let started = std::time::Instant::now();
    binary.process.terminate().unwrap();
    let text = std::fs::read_to_string(binary.log.path()).unwrap();
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "did not stop promptly on SIGTERM: {text}"
    );
    assert!(text.contains("payment-resource stopped"), "{text}");
}

/// The binary never runs DDL (its role may not: `payoutctl migrate` applies the schema as the
/// owner); it checks the schema and refuses to serve a database that is not at this build's,
/// naming what is wrong and what to run. Here: a database no migration ran on.
#[tokio::test]
async fn binary_refuses_a_database_not_at_its_schema() {
    let url = Stack::shared().fresh_db(PgServer::Main).await;
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_payment-resource"))
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--metrics-listen",
            "127.0.0.1:0",
        ])
        .args(["--grant-verify-keys", &signer().public_key().to_string()])
        .args(binary_fact_args())
        .args(
            testkit::pki::shared()
                .issue(Role::PaymentResource, "payment-resource-schema")
                .unwrap()
                .to_args(),
        )
        .env("PAYOUT_TLS_DENYLIST", testkit::pki::empty_denylist())
        .env("PAYDB_URL", &url)
        .output()
        .await
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains("no migration has been applied"), "{stderr}");
    assert!(stderr.contains("payoutctl migrate"), "{stderr}");
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    let tables: i64 =
        sqlx::query_scalar("SELECT count(*) FROM pg_tables WHERE schemaname = 'public'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(tables, 0, "the binary created something");
}

/// `serve` requires `--grant-verify-keys` (there is no unsigned mode): missing, empty or malformed,
/// the binary stops at start-up with an error naming the flag or the bad key, before it touches
/// the database (the URL here leads nowhere).
#[tokio::test]
async fn binary_refuses_to_start_without_valid_grant_verify_keys() {
    let bin = env!("CARGO_BIN_EXE_payment-resource");
    let serve = [
        "serve",
        "--database-url",
        "postgres://nobody@127.0.0.1:1/none",
    ];
    let cases: [(&str, Option<&str>, Option<&str>, &str); 5] = [
        ("missing", None, None, "--grant-verify-keys"),
        (
            "empty flag",
            Some(""),
            None,
            "no grant verification key given",
        ),
        ("empty env", None, Some(""), "--grant-verify-keys"),
        (
            "not hex",
            Some("k1=zz"),
            None,
            "expected `key_id=<64 hex digits>`",
        ),
        (
            "bad key id",
            Some("bad id=00"),
            None,
            "must be 1..=64 characters",
        ),
    ];
    for (name, flag, env, expected) in cases {
        let mut command = tokio::process::Command::new(bin);
        command
            .args(serve)
            .args(binary_fact_args())
            .env_remove("GRANT_VERIFY_KEYS");
        if let Some(flag) = flag {
            command.args(["--grant-verify-keys", flag]);
        }
        if let Some(env) = env {
            command.env("GRANT_VERIFY_KEYS", env);
        }
        let out = tokio::time::timeout(POLL_TIMEOUT, command.output())
            .await
            .unwrap_or_else(|_| panic!("{name}: the binary did not stop"))
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{name}: started: {stderr}");
        assert!(stderr.contains(expected), "{name}: {stderr}");
    }
}

// ---------------------------------------------------------------------------------------------
// Concurrent creates, and the boundary under arbitrary wire values (issue 14, item 4)

/// Many creates of one payout id at once. Every answer is the original payout (field for field)
/// or, for a request whose content differs from the winner's, the typed
/// `payout_exists_with_different_content` refusal; exactly one row and one `payout_created` audit
/// row exist. The same holds for the account fixture's create. Before the fix a loser of the race
/// on the client reference's unique key got INTERNAL ("duplicate key value violates unique
/// constraint payout_client_reference_key").
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_creates_of_one_id_answer_the_original_or_a_typed_refusal() {
    use pb::rejection::Kind;
    use std::sync::Arc;
    /// Races are probabilistic: enough rounds that an unhandled one shows up on every run.
    const ROUNDS: usize = 8;
    const CREATORS: usize = 16;
    let h = harness().await;
    open(&h, "acct-1", 10_000).await;
    for round in 0..ROUNDS {
        for different_content in [false, true] {
            let payout_id = format!("p-race-{round}-{different_content}");
            let barrier = Arc::new(tokio::sync::Barrier::new(CREATORS));
            let tasks: Vec<_> = (0..CREATORS)
                .map(|i| {
                    let request = pb::CreatePayoutRequest {
                        payout_id: payout_id.clone(),
                        account_id: "acct-1".into(),
                        amount_minor: if different_content {
                            100 + i as i64 % 2
                        } else {
                            100
                        },
                        currency: "EUR".into(),
                        beneficiary_ref: "ben-1".into(),
                    };
                    let (mut raw, barrier) = (h.c().raw(), barrier.clone());
                    tokio::spawn(async move {
                        barrier.wait().await;
                        let answer = raw.create_payout(request.clone()).await;
                        (request, answer.map(|p| p.into_inner()))
                    })
                })
                .collect();
            let answers = futures::future::join_all(tasks).await;
            let stored = h
                .c()
                .raw()
                .get_payout(pb::GetPayoutRequest {
                    payout_id: payout_id.clone(),
                })
                .await
                .expect("the payout exists")
                .into_inner()
                .payout
                .expect("a payout");
            for answer in answers {
                let (request, answer) = answer.expect("task");
                match answer {
                    Ok(payout) => {
                        assert_eq!(payout, stored, "an OK answer is the original payout");
                        assert_eq!(request.amount_minor, stored.amount_minor);
                    }
                    Err(status) => {
                        let kind = service_kit::rejection::decode::<pb::Rejection>(&status)
                            .and_then(|r| r.kind);
                        assert!(
                            different_content
                                && status.code() == tonic::Code::AlreadyExists
                                && matches!(&kind, Some(Kind::PayoutExistsWithDifferentContent(p)) if p.payout_id == payout_id)
                                && request.amount_minor != stored.amount_minor,
                            "round {round}, different content {different_content}: {:?} {:?} {kind:?}",
                            status.code(),
                            status.message()
                        );
                    }
                }
            }
            let (rows, created): (i64, i64) = sqlx::query_as(
                "SELECT (SELECT count(*) FROM payout WHERE id = $1), \
                        (SELECT count(*) FROM audit_event WHERE payout_id = $1 AND kind = 'payout_created')",
            )
            .bind(&payout_id)
            .fetch_one(&h.pool)
            .await
            .unwrap();
            assert_eq!((rows, created), (1, 1), "{payout_id}");
        }
        // The account fixture's create has the same shape (a second unique key beside the id).
        let account_id = format!("acct-race-{round}");
        let tasks: Vec<_> = (0..CREATORS)
            .map(|_| {
                let (c, account_id) = (h.c().clone(), account_id.clone());
                tokio::spawn(async move {
                    c.open_funded_account(
                        &aid(&account_id),
                        &eur(),
                        500,
                        &funding(&account_id, 500),
                    )
                    .await
                })
            })
            .collect();
        let opened: Vec<_> = futures::future::join_all(tasks)
            .await
            .into_iter()
            .map(|r| {
                r.expect("task")
                    .expect("same content: the original account")
            })
            .collect();
        assert!(opened.iter().all(|a| *a == opened[0]));
    }
    assert_ledger_clean(&h).await;
}

/// The paydb tables a call may write, in the order a failure message lists them.
const PAYDB_TABLES: [&str; 6] = [
    "account",
    "system_account",
    "payout",
    "ledger_entry",
    "ledger_outbox",
    "audit_event",
];

/// One call of `payment.v1.PaymentResource`, with whatever field values.
#[derive(Debug, Clone)]
enum PaymentCall {
    OpenAccount(pb::OpenAccountRequest),
    GetAccount(pb::GetAccountRequest),
    CreatePayout(pb::CreatePayoutRequest),
    GetPayout(pb::GetPayoutRequest),
    Claim(pb::ClaimRequest),
    MarkSubmitted(pb::MarkSubmittedRequest),
    RecordOutcome(pb::RecordOutcomeRequest),
    Post(pb::PostRequest),
    ResolveAmbiguity(pb::ResolveAmbiguityRequest),
    Abandon(pb::AbandonRequest),
    RecordOperatorDecision(pb::RecordOperatorDecisionRequest),
    CheckLedger,
}

mod payment_values {
    use super::pb;
    use proptest::prelude::*;
    use testkit::wire::{hostile_i64, hostile_text, hostile_u64};

    /// Account and payout ids seeded before the cases run (so that valid ids reach the handlers'
    /// deep paths), beside fresh ones.
    pub const ACCOUNTS: [&str; 2] = ["acct-w", "acct-w2"];
    pub const PAYOUTS: [&str; 3] = ["p-w-pending", "p-w-posted", "p-w-claimed"];
    const TEXT_LENGTH_MAX: usize = payment_client::model::TEXT_LENGTH_MAX;
    const ID_LENGTH_MAX: usize = payout_domain::ids::ID_LENGTH_MAX;

    fn id(known: &'static [&'static str], fresh: &'static str) -> BoxedStrategy<String> {
        let valid = prop_oneof![
            3 => prop::sample::select(known).prop_map(String::from),
            1 => fresh,
        ]
        .boxed();
        hostile_text(valid, ID_LENGTH_MAX)
    }
    pub fn account_id() -> BoxedStrategy<String> {
        id(&ACCOUNTS, "acct-n[a-z0-9]{1,8}")
    }
    pub fn payout_id() -> BoxedStrategy<String> {
        id(&PAYOUTS, "p-n[a-z0-9]{1,8}")
    }
    pub fn text() -> BoxedStrategy<String> {
        hostile_text("[a-z][a-z -]{0,15}".boxed(), TEXT_LENGTH_MAX)
    }
    pub fn currency() -> BoxedStrategy<String> {
        hostile_text(
            prop::sample::select(vec!["EUR", "EUR", "USD", "XXX", "eur"])
                .prop_map(String::from)
                .boxed(),
            3,
        )
    }
    pub fn amount() -> BoxedStrategy<i64> {
        hostile_i64((1i64..100_000).boxed())
    }
    pub fn token() -> BoxedStrategy<u64> {
        hostile_u64((1u64..50).boxed())
    }
    /// The account of a seeded payout (a fresh or hostile id: the first account).
    fn account_of(payout_id: &str) -> &'static str {
        match payout_id {
            "p-w-claimed" => ACCOUNTS[1],
            _ => ACCOUNTS[0],
        }
    }
    /// A payout id and the fence presented with it: mostly a genuine grant of the payout's
    /// account's key (so that calls reach the handlers' deep paths), else a grant of the other
    /// account's key, an unsigned one or one signed by an unknown key.
    pub fn fenced() -> BoxedStrategy<(String, Option<pb::Fence>)> {
        (
            payout_id(),
            prop::option::weighted(0.9, (text(), token(), 0..9u8)),
        )
            .prop_map(|(payout_id, fence)| {
                let fence = fence.map(|(owner, token, grant)| {
                    let account = account_of(&payout_id);
                    let other = if account == ACCOUNTS[0] {
                        ACCOUNTS[1]
                    } else {
                        ACCOUNTS[0]
                    };
                    match grant {
                        0 => super::wire_fence(other, &owner, token),
                        1 => pb::Fence {
                            owner,
                            token,
                            key: format!("payout:{account}"),
                            ..pb::Fence::default()
                        },
                        2 => {
                            let key = format!("payout:{account}");
                            let rogue = super::rogue_signer().sign(&key, token, &owner);
                            pb::Fence {
                                owner,
                                token,
                                key,
                                signing_key_id: rogue.key_id,
                                signature: rogue.bytes,
                            }
                        }
                        _ => super::wire_fence(account, &owner, token),
                    }
                });
                (payout_id, fence)
            })
            .boxed()
    }
}

fn payment_call() -> impl proptest::strategy::Strategy<Value = PaymentCall> {
    use payment_values::*;
    use proptest::prelude::*;
    use testkit::wire::hostile_enum;
    prop_oneof![
        (account_id(), currency(), amount()).prop_map(
            |(account_id, currency, opening_balance_minor)| {
                PaymentCall::OpenAccount(pb::OpenAccountRequest {
                    account_id,
                    currency,
                    opening_balance_minor,
                    ..Default::default()
                })
            }
        ),
        account_id()
            .prop_map(|account_id| PaymentCall::GetAccount(pb::GetAccountRequest { account_id })),
        (payout_id(), account_id(), amount(), currency(), text()).prop_map(
            |(payout_id, account_id, amount_minor, currency, beneficiary_ref)| {
                PaymentCall::CreatePayout(pb::CreatePayoutRequest {
                    payout_id,
                    account_id,
                    amount_minor,
                    currency,
                    beneficiary_ref,
                })
            }
        ),
        payout_id()
            .prop_map(|payout_id| PaymentCall::GetPayout(pb::GetPayoutRequest { payout_id })),
        fenced().prop_map(|(payout_id, fence)| PaymentCall::Claim(pb::ClaimRequest {
            payout_id,
            fence
        })),
        fenced().prop_map(|(payout_id, fence)| PaymentCall::MarkSubmitted(
            pb::MarkSubmittedRequest { payout_id, fence }
        )),
        (
            fenced(),
            hostile_enum(&[1, 2, 3, 4]),
            text(),
            text(),
            text()
        )
            .prop_map(
                |((payout_id, fence), outcome, rail_ref, decline_code, detail)| {
                    PaymentCall::RecordOutcome(pb::RecordOutcomeRequest {
                        payout_id,
                        fence,
                        outcome,
                        rail_ref,
                        decline_code,
                        detail,
                        rail_fact: None,
                    })
                }
            ),
        fenced()
            .prop_map(|(payout_id, fence)| PaymentCall::Post(pb::PostRequest { payout_id, fence })),
        (fenced(), hostile_enum(&[1, 2]), text(), text()).prop_map(
            |((payout_id, fence), evidence, rail_ref, evidence_source)| {
                PaymentCall::ResolveAmbiguity(pb::ResolveAmbiguityRequest {
                    payout_id,
                    fence,
                    evidence,
                    rail_ref,
                    evidence_source,
                    rail_evidence: None,
                })
            }
        ),
        (fenced(), text(), text(), any::<bool>(), text()).prop_map(
            |((payout_id, fence), operator, reason, resolution_sla_passed, sla_check)| {
                PaymentCall::Abandon(pb::AbandonRequest {
                    operator_signature: None,
                    payout_id,
                    fence,
                    operator,
                    reason,
                    resolution_sla_passed,
                    sla_check,
                })
            }
        ),
        (
            payout_id(),
            text(),
            text(),
            text(),
            any::<bool>(),
            text(),
            token()
        )
            .prop_map(
                |(payout_id, operator, decision, reason, accepted, note, token)| {
                    PaymentCall::RecordOperatorDecision(pb::RecordOperatorDecisionRequest {
                        operator_signature: None,
                        payout_id,
                        operator,
                        decision,
                        reason,
                        accepted,
                        note,
                        token,
                    })
                }
            ),
        Just(PaymentCall::CheckLedger),
    ]
}

async fn send_payment_call(
    mut raw: pb::payment_resource_client::PaymentResourceClient<tonic::transport::Channel>,
    call: PaymentCall,
) -> Result<(), tonic::Status> {
    use PaymentCall as C;
    match call {
        C::OpenAccount(r) => raw.open_account(r).await.map(drop),
        C::GetAccount(r) => raw.get_account(r).await.map(drop),
        C::CreatePayout(r) => raw.create_payout(r).await.map(drop),
        C::GetPayout(r) => raw.get_payout(r).await.map(drop),
        C::Claim(r) => raw.claim(r).await.map(drop),
        C::MarkSubmitted(r) => raw.mark_submitted(r).await.map(drop),
        C::RecordOutcome(r) => raw.record_outcome(r).await.map(drop),
        C::Post(r) => raw.post(r).await.map(drop),
        C::ResolveAmbiguity(r) => raw.resolve_ambiguity(r).await.map(drop),
        C::Abandon(r) => raw.abandon(r).await.map(drop),
        C::RecordOperatorDecision(r) => raw.record_operator_decision(r).await.map(drop),
        C::CheckLedger => raw.check_ledger(pb::CheckLedgerRequest {}).await.map(drop),
    }
}

/// Arbitrary field values through the real client to the real server on paydb. For every case:
/// no panic anywhere in the process; the answer is OK or a status carrying a decodable typed
/// `Rejection` (INVALID_ARGUMENT names its field); an INVALID_ARGUMENT, NOT_FOUND or
/// ALREADY_EXISTS refusal changed no row of any table (counts and contents); a
/// FAILED_PRECONDITION refusal (fenced out, refused transition, account busy, SLA) or
/// PERMISSION_DENIED one (forged grant, grant for another key) changed nothing but its one
/// evidence row in `audit_event`; and the server still reports SERVING and answers a valid call.
#[test]
fn wire_values_never_panic_and_refusals_are_typed_and_write_nothing() {
    use pb::rejection::Kind;
    use proptest::prelude::*;
    use testkit::wire;
    const CASES: u32 = 128;
    let runtime = wire::runtime();
    let h = runtime.block_on(async {
        let h = harness().await;
        open(&h, "acct-w", 1_000_000_000).await;
        open(&h, "acct-w2", 1_000_000_000).await;
        create(&h, "p-w-pending", "acct-w", 1_000).await;
        create(&h, "p-w-posted", "acct-w", 1_000).await;
        drive(h.c(), &pid("p-w-posted"), PayoutState::Posted).await;
        create(&h, "p-w-claimed", "acct-w2", 1_000).await;
        drive(h.c(), &pid("p-w-claimed"), PayoutState::Claimed).await;
        h
    });
    wire::run_cases(&runtime, CASES, payment_call(), |call| {
        let h = &h;
        async move {
            let wire::Observed {
                answer,
                before,
                after,
            } = wire::observe(&h.pool, &PAYDB_TABLES, send_payment_call(h.c().raw(), call)).await?;
            if let Err(status) = answer {
                let kind =
                    service_kit::rejection::decode::<pb::Rejection>(&status).and_then(|r| r.kind);
                prop_assert!(
                    kind.is_some(),
                    "untyped refusal {:?}: {}",
                    status.code(),
                    status.message()
                );
                match status.code() {
                    tonic::Code::InvalidArgument => {
                        prop_assert!(
                            matches!(&kind, Some(Kind::InvalidArgument(i)) if !i.field.is_empty() && i.reason != 0),
                            "{kind:?}"
                        );
                        prop_assert_eq!(before.changed(&after), Vec::<String>::new());
                    }
                    tonic::Code::NotFound | tonic::Code::AlreadyExists => {
                        prop_assert_eq!(before.changed(&after), Vec::<String>::new());
                    }
                    tonic::Code::PermissionDenied => {
                        prop_assert!(
                            matches!(
                                &kind,
                                Some(
                                    Kind::ForgedGrant(_)
                                        | Kind::GrantForAnotherKey(_)
                                        | Kind::OperatorNotVerified(_)
                                        | Kind::RailFactRefused(_)
                                        | Kind::FundingNotAuthorised(_)
                                )
                            ),
                            "{kind:?}"
                        );
                        let changed = before.changed(&after);
                        prop_assert!(
                            changed.is_empty() || changed == ["audit_event"],
                            "{changed:?}"
                        );
                        prop_assert!(before.rows_added(&after, "audit_event") <= 1);
                    }
                    tonic::Code::FailedPrecondition => {
                        let changed = before.changed(&after);
                        prop_assert!(
                            changed.is_empty() || changed == ["audit_event"],
                            "{changed:?}"
                        );
                        prop_assert!(before.rows_added(&after, "audit_event") <= 1);
                    }
                    other => prop_assert!(false, "unexpected code {other:?}: {}", status.message()),
                }
            }
            let mut raw = h.c().raw();
            let valid = raw.get_account(pb::GetAccountRequest {
                account_id: "acct-w".into(),
            });
            wire::still_serving(
                &h.service.endpoint,
                payment_resource::SERVICE_NAME,
                testkit::pki::Role::PaymentResource,
                valid,
            )
            .await
        }
    });
}

/// The shipped binary, serving on free ports with this suite's grant key and a payment-resource
/// certificate from its test authority, plus `extra` flags.
struct Binary {
    process: testkit::ManagedProcess,
    log: tempfile::NamedTempFile,
    port: u16,
    metrics_port: u16,
}

impl Binary {
    /// The binary on the provisioned paydb at `admin_url`, logged in as its own role (the URL, with
    /// its password, through the environment).
    fn start(admin_url: &str, extra: &[&str]) -> Binary {
        let database_url = Stack::shared().pg(PgServer::Main).login_url(
            "payment_resource",
            testkit::system::database_name(admin_url),
        );
        let (port, metrics_port) = (testkit::free_port(), testkit::free_port());
        let log = tempfile::NamedTempFile::new().unwrap();
        let process = testkit::ManagedProcess::start(
            testkit::ProcessSpec::new(
                "payment-resource",
                env!("CARGO_BIN_EXE_payment-resource"),
                log.path(),
            )
            .args(["serve", "--listen", &format!("127.0.0.1:{port}")])
            .args([
                "--metrics-listen",
                &format!("127.0.0.1:{metrics_port}"),
                "--grant-verify-keys",
                &signer().public_key().to_string(),
            ])
            .env("PAYDB_URL", database_url)
            .env(
                "PAYOUT_TLS_DENYLIST",
                testkit::pki::empty_denylist().display().to_string(),
            )
            .args(binary_fact_args())
            .args(extra)
            .args(
                testkit::pki::shared()
                    .issue(Role::PaymentResource, "payment-resource-binary")
                    .unwrap()
                    .to_args(),
            ),
        )
        .unwrap();
        Binary {
            process,
            log,
            port,
            metrics_port,
        }
    }

    fn endpoint(&self) -> String {
        format!("https://127.0.0.1:{}", self.port)
    }

    /// A client with `tls`'s certificate, once the binary accepts connections.
    async fn client(&self, tls: &mtls::Tls) -> PaymentClient {
        let endpoint = self.endpoint();
        // A process start on a loaded two-core machine: the kit's own bound for a service.
        let ready = Duration::from_millis(testkit::system::SERVICE_READY_TIMEOUT_MS);
        let answer = testkit::eventually(ready, "the binary to accept connections", || {
            let (endpoint, tls) = (endpoint.clone(), tls.clone());
            async move { PaymentClient::connect(&endpoint, &tls).await.ok() }
        })
        .await;
        match answer {
            Ok(client) => client,
            Err(e) => panic!("{e:#}; the binary's log:\n{}", self.process.log_tail(40)),
        }
    }
}

/// The binary serves its real authorisation table (`authz::POLICY`) over mutual TLS, with the
/// fixture path off by default: a worker cannot open an account, an integrator cannot claim, the
/// fixture path answers no one without `--fixture-accounts`; a certificate from another authority
/// and a plaintext client do not get a single call through. Each refusal is counted where an
/// operator sees it (`unauthorised_calls_total` by method and role), and nothing is written.
#[tokio::test]
async fn binary_refuses_calls_outside_the_authorisation_table() {
    let url = Stack::shared()
        .provisioned_db(PgServer::Main, testkit::db_access::Database::Paydb)
        .await;
    let binary = Binary::start(&url, &[]);
    let (port, metrics_port) = (binary.port, binary.metrics_port);
    let endpoint = binary.endpoint();
    let worker = binary.client(&tls(Role::Worker)).await;
    let fixture = binary.client(&tls(Role::Fixture)).await;
    let intake = binary.client(&tls(Role::Intake)).await;
    fn code<T: std::fmt::Debug>(r: Result<T, PaymentError>) -> (tonic::Code, String) {
        match r {
            Err(PaymentError::Transport { code, message }) => (code, message),
            other => panic!("expected a transport-level refusal, got {other:?}"),
        }
    }

    let (c, m) = code(worker.open_account(&aid("acct-1"), &eur(), 1_000).await);
    assert_eq!(c, tonic::Code::PermissionDenied, "{m}");
    assert!(m.contains("worker may not call it"), "{m}");
    let (c, m) = code(fixture.open_account(&aid("acct-1"), &eur(), 1_000).await);
    assert_eq!(c, tonic::Code::FailedPrecondition, "{m}");
    assert!(m.contains("--fixture-accounts"), "{m}");
    let (c, m) = code(intake.claim(&pid("p-1"), &fence("acct-1", "w", 1)).await);
    assert_eq!(c, tonic::Code::PermissionDenied, "{m}");
    assert!(m.contains("PaymentResource/Claim"), "{m}");
    // The table admits an operator to RecordOperatorDecision (a refusal met outside the
    // workflow): the service answers (no such payout), the door does not refuse.
    let operator = binary.client(&tls(Role::Operator)).await;
    let answered = operator
        .record_operator_decision(&refused_abandon(testkit::pki::TEST_OPERATOR, false))
        .await;
    assert!(
        matches!(answered, Err(PaymentError::PayoutNotFound { .. })),
        "{answered:?}"
    );
    let (c, m) = code(
        intake
            .record_operator_decision(&refused_abandon(testkit::pki::TEST_OPERATOR, false))
            .await,
    );
    assert_eq!(c, tonic::Code::PermissionDenied, "{m}");

    // Another authority's certificate: the handshake fails, no call is made.
    let foreign = mtls::issue::Authority::create()
        .unwrap()
        .issue(Role::Worker, "intruder")
        .unwrap()
        .tls();
    assert!(PaymentClient::connect(&endpoint, &foreign).await.is_err());
    // Plaintext: refused by the client library, and by the server's TLS listener.
    let plain = tonic::transport::Endpoint::from_shared(format!("http://127.0.0.1:{port}"))
        .unwrap()
        .connect()
        .await;
    if let Ok(channel) = plain {
        let answer = PaymentClient::from_channel(channel)
            .get_payout(&pid("p-1"))
            .await;
        assert!(answer.is_err(), "a plaintext call was answered: {answer:?}");
    }
    assert!(matches!(
        PaymentClient::connect(&format!("http://127.0.0.1:{port}"), &tls(Role::Worker)).await,
        Err(PaymentError::Transport { .. })
    ));

    let metrics = reqwest::get(format!("http://127.0.0.1:{metrics_port}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        metrics.contains(r#"unauthorised_calls_total{method="/payment.v1.PaymentResource/OpenAccount",reason="role_not_allowed",role="worker"} 1"#),
        "{metrics}"
    );
    assert!(
        metrics.contains(r#"unauthorised_calls_total{method="/payment.v1.PaymentResource/Claim",reason="role_not_allowed",role="intake"} 1"#),
        "{metrics}"
    );
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    let (accounts, payouts): (i64, i64) =
        sqlx::query_as("SELECT (SELECT count(*) FROM account), (SELECT count(*) FROM payout)")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(
        (accounts, payouts),
        (0, 0),
        "a refused call wrote something"
    );
}

/// Negative control of the authorisation table: served with a table that lets every role call
/// everything (what the binary's `authz::POLICY` is not), the same worker certificate that the
/// binary refuses opens a funded account.
#[tokio::test]
async fn negative_control_with_every_role_allowed_a_worker_opens_a_funded_account() {
    let h = harness().await;
    let worker = PaymentClient::connect(&h.service.endpoint, &tls(Role::Worker))
        .await
        .unwrap();
    let account = worker
        .open_funded_account(
            &aid("acct-forged"),
            &eur(),
            1_000_000_000,
            &funding("acct-forged", 1_000_000_000),
        )
        .await
        .expect("the permissive table lets a worker open a funded account");
    assert_eq!(account.balance_minor, 1_000_000_000);
}

/// Operators are authenticated (issue 17, section 3): an abandon is carried out only under the
/// signature of a registered operator, over exactly this payout, decision and reason, and
/// recently. Unsigned, signed by an unregistered key, signed for another payout or reason, or
/// stale: PERMISSION_DENIED `OperatorNotVerified` naming why, the payout unchanged, the refusal
/// audited (`operator_not_verified`) and counted. A decision recorded as accepted without a
/// verified signature is recorded as refused.
#[tokio::test]
async fn an_abandon_without_a_registered_operators_signature_is_refused_and_changes_nothing() {
    let h = harness().await;
    open(&h, "acct-1", 10_000).await;
    create(&h, "p-1", "acct-1", 1_000).await;
    let f = fence("acct-1", "worker-a", 10);
    let request = |signature: Option<OperatorSignature>| AbandonRequest {
        operator: "op-1".into(),
        reason: "customer withdrew".into(),
        resolution_sla_passed: false,
        sla_check: String::new(),
        signature,
    };
    let now = grant_signing::operator::now_unix_ms();
    let stale = signed_by(
        operator("op-1"),
        "p-1",
        "op-1",
        "customer withdrew",
        now - grant_signing::operator::MAX_AGE_MS - 60_000,
    );
    // A key nobody registered, under a registered operator's name.
    let (rogue, _) = Signer::generate("op-1").unwrap();
    let mallory = signed_by(&rogue, "p-1", "op-1", "customer withdrew", now);
    let cases = [
        ("unsigned", None),
        ("bad_signature", mallory),
        ("bad_signature", signed("p-2", "op-1", "customer withdrew")),
        ("bad_signature", signed("p-1", "op-1", "another reason")),
        ("stale", stale),
    ];
    for (expected, signature) in cases {
        let before = snapshot(&h.pool, "p-1").await;
        let err = h
            .c()
            .abandon(&pid("p-1"), &f, &request(signature))
            .await
            .unwrap_err();
        match &err {
            PaymentError::OperatorNotVerified {
                reason, operator, ..
            } => {
                assert_eq!((reason.as_str(), operator.as_str()), (expected, "op-1"))
            }
            other => panic!("expected OperatorNotVerified({expected}), got {other:?}"),
        }
        assert_eq!(
            snapshot(&h.pool, "p-1").await,
            before,
            "{expected}: nothing changed"
        );
    }
    // An unregistered operator's own, valid signature.
    let err = h
        .c()
        .abandon(
            &pid("p-1"),
            &f,
            &AbandonRequest {
                operator: "mallory".into(),
                signature: signed("p-1", "mallory", "customer withdrew"),
                ..request(None)
            },
        )
        .await
        .unwrap_err();
    assert!(
        matches!(&err, PaymentError::OperatorNotVerified { reason, .. } if reason == "unknown_operator"),
        "{err:?}"
    );
    let audited: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM audit_event WHERE payout_id = 'p-1' AND kind = 'operator_not_verified'",
    )
    .fetch_one(&h.pool)
    .await
    .unwrap();
    assert_eq!(audited, 6);
    let counted = h.service.metrics.render();
    assert!(
        counted.contains(
            r#"payment_operator_not_verified_total{decision="abandon",reason="unsigned"} 1"#
        ),
        "{counted}"
    );
    // An accepted decision without a verified signature is recorded as refused, with why.
    let e = h
        .c()
        .record_operator_decision(&OperatorDecision {
            payout_id: pid("p-1"),
            operator: "op-1".into(),
            decision: "abandon".into(),
            reason: "customer withdrew".into(),
            accepted: true,
            note: String::new(),
            token: None,
            signature: None,
        })
        .await
        .unwrap();
    assert_eq!(e.detail["accepted"], false, "{}", e.detail);
    assert_eq!(e.detail["operator_verified"], false, "{}", e.detail);
    assert!(
        e.detail["note"].as_str().unwrap().contains("unsigned"),
        "{}",
        e.detail
    );
    // The operator's own signature: carried out, the verified operator on record.
    let abandoned = h
        .c()
        .abandon(
            &pid("p-1"),
            &f,
            &request(signed("p-1", "op-1", "customer withdrew")),
        )
        .await
        .unwrap();
    assert_eq!(abandoned.state, PayoutState::Abandoned);
}

/// Negative control: with operator verification switched off in-process, the same unsigned
/// abandon is carried out: the test above sees what it claims to.
#[tokio::test]
async fn negative_control_without_operator_verification_an_unsigned_abandon_lands() {
    let h = harness().await;
    open(&h, "acct-1", 10_000).await;
    create(&h, "p-1", "acct-1", 1_000).await;
    // A second server on the same database, as the other controls do: verification off.
    let unverified =
        start_service(&h.url, options().without_operator_verification_for_tests()).await;
    let abandoned = unverified
        .client
        .abandon(
            &pid("p-1"),
            &fence("acct-1", "worker-a", 10),
            &AbandonRequest {
                operator: "anyone".into(),
                reason: "no signature at all".into(),
                resolution_sla_passed: false,
                sla_check: String::new(),
                signature: None,
            },
        )
        .await
        .unwrap();
    assert_eq!(abandoned.state, PayoutState::Abandoned);
    assert_eq!(snapshot(&h.pool, "p-1").await.state, "ABANDONED");
}

// ----- the rail's answer is recorded only on the rail proxy's signed fact (issue 33, rows 2a-2c) -----

/// `call`'s refusal must be `RailFactRefused` for `reason` on `operation`, and nothing of the
/// payout or its account changed (state, version, token stamp, fence, balance).
async fn refused_unchanged(
    h: &Harness,
    payout: &str,
    operation: &str,
    reason: &str,
    call: impl std::future::Future<Output = Result<Payout, PaymentError>>,
) {
    let before = snapshot(&h.pool, payout).await;
    match call.await {
        Err(PaymentError::RailFactRefused {
            payout_id,
            operation: op,
            reason: r,
            ..
        }) => assert_eq!(
            (payout_id.as_str(), op.as_str(), r.as_str()),
            (payout, operation, reason)
        ),
        other => panic!("expected RailFactRefused({operation}, {reason}), got {other:?}"),
    }
    assert_eq!(
        snapshot(&h.pool, payout).await,
        before,
        "{operation} {reason}: nothing changed"
    );
}

async fn rail_fact_refusals(h: &Harness, payout: &str) -> Vec<(String, String, String)> {
    sqlx::query_as(
        "SELECT from_state, detail->>'operation', detail->>'reason' FROM audit_event \
         WHERE payout_id = $1 AND kind = 'rail_fact_refused' ORDER BY id",
    )
    .bind(payout)
    .fetch_all(&h.pool)
    .await
    .unwrap()
}

/// Rows 2a and 2c: after a real submission, a RecordOutcome is recorded only with the rail
/// proxy's signed outcome saying the same thing. Without one, with another payout's, with one
/// signed by a key the resource does not know, or with a genuine one that says something else,
/// it is refused, audited and counted, and the payout (and the fence) stay as they were.
#[tokio::test]
async fn a_rail_outcome_is_recorded_only_on_the_proxys_signed_fact() {
    let h = harness().await;
    open(&h, "acct-1", 10_000).await;
    create(&h, "p-1", "acct-1", 1_000).await;
    let (p, f) = (pid("p-1"), fence("acct-1", "worker-a", 10));
    h.c().claim(&p, &f).await.unwrap();
    h.c().mark_submitted(&p, &f).await.unwrap();
    let declined = RailOutcome::Declined {
        decline_code: "BENEFICIARY_CLOSED".into(),
    };
    let acked_fact = outcome_fact(fact_signer(), "p-1", "acct-1", "ACKED", "rail-1", "");
    let cases: [(&str, RailOutcome, Option<RailFact>); 5] = [
        ("unsigned", declined.clone(), None),
        (
            "bad_signature",
            declined.clone(),
            Some(outcome_fact(
                fact_signer(),
                "p-2",
                "acct-1",
                "REJECTED",
                "",
                "BENEFICIARY_CLOSED",
            )),
        ),
        (
            "unknown_key_id",
            declined.clone(),
            Some(outcome_fact(
                rogue_signer(),
                "p-1",
                "acct-1",
                "REJECTED",
                "",
                "BENEFICIARY_CLOSED",
            )),
        ),
        ("contradicts", declined.clone(), Some(acked_fact.clone())),
        (
            "contradicts",
            RailOutcome::Acked {
                rail_ref: "rail-fake".into(),
            },
            Some(acked_fact.clone()),
        ),
    ];
    for (reason, outcome, fact) in &cases {
        refused_unchanged(
            &h,
            "p-1",
            "record_outcome",
            reason,
            h.c()
                .record_outcome_proven(&p, &f, outcome, "", fact.as_ref()),
        )
        .await;
    }
    let refusals = rail_fact_refusals(&h, "p-1").await;
    assert_eq!(
        refusals,
        cases
            .iter()
            .map(|(reason, _, _)| (
                "RAIL_SUBMITTED".to_string(),
                "record_outcome".to_string(),
                reason.to_string()
            ))
            .collect::<Vec<_>>(),
        "one audit row per refusal"
    );
    let counted = h.service.metrics.render();
    for (reason, n) in [
        ("unsigned", 1),
        ("bad_signature", 1),
        ("unknown_key_id", 1),
        ("contradicts", 2),
    ] {
        let line = format!(
            "payment_rail_facts_refused_total{{operation=\"record_outcome\",reason=\"{reason}\"}} {n}"
        );
        assert!(counted.contains(&line), "{line} in {counted}");
    }
    // The genuine fact: recorded, and kept in the transition's audit detail for re-verification.
    let acked = h
        .c()
        .record_outcome_proven(
            &p,
            &f,
            &RailOutcome::Acked {
                rail_ref: "rail-1".into(),
            },
            "",
            Some(&acked_fact),
        )
        .await
        .unwrap();
    assert_eq!(acked.state, PayoutState::RailAcked);
    let kept: Option<String> = sqlx::query_scalar(
        "SELECT detail->'rail_fact'->>'signing_key_id' FROM audit_event \
         WHERE payout_id = 'p-1' AND kind = 'transition' AND to_state = 'RAIL_ACKED'",
    )
    .fetch_one(&h.pool)
    .await
    .unwrap();
    assert_eq!(kept.as_deref(), Some("proxy-facts-test-1"));
}

/// Row 2b (and 2c for evidence): an ambiguous payout is resolved only on the rail proxy's signed
/// evidence saying the same thing: FOUND listing the rail reference asked, ABSENT or NEVER_SENT
/// for absence. A FOUND for a movement that never happened is refused and the payout stays
/// RAIL_AMBIGUOUS (nobody is debited for nothing).
#[tokio::test]
async fn an_ambiguity_is_resolved_only_on_the_proxys_signed_evidence() {
    let h = harness().await;
    open(&h, "acct-1", 10_000).await;
    create(&h, "p-1", "acct-1", 1_000).await;
    let (p, f) = (pid("p-1"), fence("acct-1", "worker-a", 10));
    h.c().claim(&p, &f).await.unwrap();
    h.c().mark_submitted(&p, &f).await.unwrap();
    let ambiguous = h
        .c()
        .record_outcome(&p, &f, &RailOutcome::Timeout, "deadline exceeded")
        .await
        .unwrap();
    assert_eq!(
        ambiguous.state,
        PayoutState::RailAmbiguous,
        "a TIMEOUT needs no fact: it decides nothing"
    );
    let fake = Evidence::Found {
        rail_ref: "fake".into(),
    };
    let found_1 = evidence_fact(fact_signer(), "p-1", "acct-1", "FOUND", &["rail-1"]);
    let cases: [(&str, Evidence, Option<RailEvidence>); 6] = [
        ("unsigned", fake.clone(), None),
        ("contradicts", fake.clone(), Some(found_1.clone())),
        (
            "bad_signature",
            fake.clone(),
            Some(evidence_fact(
                fact_signer(),
                "p-2",
                "acct-1",
                "FOUND",
                &["fake"],
            )),
        ),
        (
            "unknown_key_id",
            fake.clone(),
            Some(evidence_fact(
                rogue_signer(),
                "p-1",
                "acct-1",
                "FOUND",
                &["fake"],
            )),
        ),
        (
            "contradicts",
            Evidence::Absent,
            Some(evidence_fact(
                fact_signer(),
                "p-1",
                "acct-1",
                "UNKNOWN",
                &[],
            )),
        ),
        ("contradicts", Evidence::Absent, Some(found_1.clone())),
    ];
    for (reason, evidence, proof) in &cases {
        refused_unchanged(
            &h,
            "p-1",
            "resolve_ambiguity",
            reason,
            h.c()
                .resolve_ambiguity_proven(&p, &f, evidence, "rail-lookup", proof.as_ref()),
        )
        .await;
    }
    assert_eq!(rail_fact_refusals(&h, "p-1").await.len(), cases.len());
    assert!(h.service.metrics.render().contains(
        "payment_rail_facts_refused_total{operation=\"resolve_ambiguity\",reason=\"contradicts\"} 3"
    ));
    let resolved = h
        .c()
        .resolve_ambiguity_proven(
            &p,
            &f,
            &Evidence::Found {
                rail_ref: "rail-1".into(),
            },
            "rail-lookup",
            Some(&found_1),
        )
        .await
        .unwrap();
    assert_eq!(resolved.state, PayoutState::RailAcked);
    // ABSENT on the proxy's NEVER_SENT (a sealed submission) is enough, on another payout.
    open(&h, "acct-2", 10_000).await;
    create(&h, "p-2", "acct-2", 500).await;
    let p2 = pid("p-2");
    let f2 = fence("acct-2", "worker-a", 11);
    h.c().claim(&p2, &f2).await.unwrap();
    h.c().mark_submitted(&p2, &f2).await.unwrap();
    h.c()
        .record_outcome(&p2, &f2, &RailOutcome::OutcomeMissing, "")
        .await
        .unwrap();
    let never_sent = evidence_fact(fact_signer(), "p-2", "acct-2", "NEVER_SENT", &[]);
    let failed = h
        .c()
        .resolve_ambiguity_proven(
            &p2,
            &f2,
            &Evidence::Absent,
            "rail-lookup",
            Some(&never_sent),
        )
        .await
        .unwrap();
    assert_eq!(failed.state, PayoutState::Failed);
}

/// Negative control of both: with the rail-fact check switched off in-process (a test-only
/// switch), the caller's word is recorded: a DECLINED after a real submission fails the payout
/// (money may be gone, the customer is not debited), and a FOUND without a movement acks it.
#[tokio::test]
async fn negative_control_without_rail_fact_verification_the_callers_word_is_recorded() {
    let h = harness().await;
    open(&h, "acct-1", 10_000).await;
    create(&h, "p-1", "acct-1", 1_000).await;
    create(&h, "p-2", "acct-1", 500).await;
    let unverified =
        start_service(&h.url, options().without_rail_fact_verification_for_tests()).await;
    let c = &unverified.client;
    let (p1, f1) = (pid("p-1"), fence("acct-1", "worker-a", 10));
    c.claim(&p1, &f1).await.unwrap();
    c.mark_submitted(&p1, &f1).await.unwrap();
    let failed = c
        .record_outcome(
            &p1,
            &f1,
            &RailOutcome::Declined {
                decline_code: "BENEFICIARY_CLOSED".into(),
            },
            "",
        )
        .await
        .unwrap();
    assert_eq!(failed.state, PayoutState::Failed);
    let (p2, f2) = (pid("p-2"), fence("acct-1", "worker-a", 11));
    c.claim(&p2, &f2).await.unwrap();
    c.mark_submitted(&p2, &f2).await.unwrap();
    c.record_outcome(&p2, &f2, &RailOutcome::Timeout, "")
        .await
        .unwrap();
    let acked = c
        .resolve_ambiguity(
            &p2,
            &f2,
            &Evidence::Found {
                rail_ref: "fake".into(),
            },
            "rail-lookup",
        )
        .await
        .unwrap();
    assert_eq!(acked.state, PayoutState::RailAcked);
    assert!(rail_fact_refusals(&h, "p-1").await.is_empty());
}

// ----- a quarantine replay is recorded under the certified operator (issue 17, section 3) -----

/// A quarantined outbox row, made directly as the test's superuser (as the dispatcher leaves one
/// the GL refused): returns its id.
async fn quarantined_row(h: &Harness) -> i64 {
    sqlx::query_scalar(
        "INSERT INTO ledger_outbox (account_id, idempotency_key, payload, attempts, last_error, quarantined_at)
         VALUES ('acct-q', 'poison-1', '{}'::jsonb, 3, 'refused by the GL', now()) RETURNING id",
    )
    .fetch_one(&h.pool)
    .await
    .unwrap()
}

/// `service` called with this test binary's operator certificate, which carries
/// `testkit::pki::TEST_OPERATOR`.
async fn as_operator(
    service: &Service,
) -> pb::payment_resource_client::PaymentResourceClient<tonic::transport::Channel> {
    pb::payment_resource_client::PaymentResourceClient::new(
        tls(Role::Operator)
            .endpoint(&service.endpoint, Role::PaymentResource)
            .unwrap()
            .connect()
            .await
            .unwrap(),
    )
}

fn replay(outbox_id: i64, operator: &str) -> pb::ReplayQuarantinedRequest {
    pb::ReplayQuarantinedRequest {
        outbox_id,
        operator: operator.into(),
        reason: "GL fixed".into(),
    }
}

/// The operators `outbox_replay` recorded for `outbox_id`, and whether the row is still
/// quarantined.
async fn replays_of(h: &Harness, outbox_id: i64) -> (Vec<String>, bool) {
    let operators = sqlx::query_scalar(
        "SELECT operator_id FROM outbox_replay WHERE outbox_id = $1 ORDER BY id",
    )
    .bind(outbox_id)
    .fetch_all(&h.pool)
    .await
    .unwrap();
    let quarantined =
        sqlx::query_scalar("SELECT quarantined_at IS NOT NULL FROM ledger_outbox WHERE id = $1")
            .bind(outbox_id)
            .fetch_one(&h.pool)
            .await
            .unwrap();
    (operators, quarantined)
}

/// An operator's certificate that names another operator (here `alice`, a registered operator)
/// is refused PERMISSION_DENIED `OperatorNotCertified` before the row is looked at: the row stays
/// quarantined, no replay is recorded, the refusal is counted. Under the name its certificate
/// carries, the same replay is carried out and recorded under that name.
#[tokio::test]
async fn a_quarantine_replay_naming_another_operator_is_refused_and_changes_nothing() {
    let h = harness().await;
    let row = quarantined_row(&h).await;
    let mut operator = as_operator(&h.service).await;
    let refused = operator
        .replay_quarantined(replay(row, "alice"))
        .await
        .unwrap_err();
    assert_eq!(refused.code(), tonic::Code::PermissionDenied, "{refused:?}");
    assert!(
        refused
            .message()
            .contains("is not the operator the caller's certificate carries"),
        "{refused:?}"
    );
    assert_eq!(replays_of(&h, row).await, (vec![], true), "nothing changed");
    assert!(
        h.service.metrics.render().contains(
            r#"unauthorised_calls_total{method="/payment.v1.PaymentResource/ReplayQuarantined",reason="operator_not_certified",role="operator"} 1"#
        ),
        "the refusal is counted"
    );
    let answer = operator
        .replay_quarantined(replay(row, testkit::pki::TEST_OPERATOR))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(answer.operator, testkit::pki::TEST_OPERATOR);
    assert_eq!(
        replays_of(&h, row).await,
        (vec![testkit::pki::TEST_OPERATOR.to_string()], false)
    );
}

/// Negative control: with the certificate check switched off in-process, the same replay under
/// another operator's name is carried out and recorded under that name: the test above sees what
/// it claims to.
#[tokio::test]
async fn negative_control_without_operator_certification_a_replay_is_recorded_under_another_name() {
    let h = harness().await;
    let row = quarantined_row(&h).await;
    let uncertified =
        start_service(&h.url, options().without_operator_certification_for_tests()).await;
    let answer = as_operator(&uncertified)
        .await
        .replay_quarantined(replay(row, "alice"))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(answer.operator, "alice");
    assert_eq!(
        replays_of(&h, row).await,
        (vec!["alice".to_string()], false)
    );
}

// ----- an operator records a refusal met outside the workflow (issue 32) -----

/// `service`'s typed client with this test binary's operator certificate (it carries
/// `testkit::pki::TEST_OPERATOR`).
async fn operator_client(service: &Service) -> PaymentClient {
    PaymentClient::connect(&service.endpoint, &tls(Role::Operator))
        .await
        .unwrap()
}

/// What `payoutctl payout abandon` records when the payout's workflow has closed: a refused
/// abandon, by the operator its certificate carries, signed as `payoutctl sign abandon` signs.
fn refused_abandon(operator: &str, accepted: bool) -> OperatorDecision {
    OperatorDecision {
        payout_id: pid("p-1"),
        operator: operator.into(),
        decision: "abandon".into(),
        reason: "customer cancelled".into(),
        accepted,
        note: "refused: workflow payout-p-1 is not running; the payout is POSTED".into(),
        token: None,
        signature: signed("p-1", operator, "customer cancelled"),
    }
}

/// The operator decisions in p-1's audit trail: (owner, detail).
async fn decisions_of_p1(h: &Harness) -> Vec<(Option<String>, serde_json::Value)> {
    h.c()
        .get_payout(&pid("p-1"))
        .await
        .unwrap()
        .history
        .into_iter()
        .filter(|e| e.kind == "operator_decision")
        .map(|e| (e.owner, e.detail))
        .collect()
}

/// An operator's certificate records a refused decision under the name it carries: it is in the
/// payout's audit trail as refused, with the note, and says it was recorded by an operator.
#[tokio::test]
async fn an_operator_records_a_refused_decision_under_its_certified_name() {
    let h = harness().await;
    open(&h, "acct-1", 10_000).await;
    create(&h, "p-1", "acct-1", 1_000).await;
    let operator = operator_client(&h.service).await;
    let e = operator
        .record_operator_decision(&refused_abandon(testkit::pki::TEST_OPERATOR, false))
        .await
        .unwrap();
    assert_eq!(
        (e.kind.as_str(), e.actor.as_str(), e.owner.as_deref()),
        (
            "operator_decision",
            "OPERATOR",
            Some(testkit::pki::TEST_OPERATOR)
        )
    );
    let recorded = decisions_of_p1(&h).await;
    assert_eq!(recorded.len(), 1, "{recorded:?}");
    let (owner, detail) = &recorded[0];
    assert_eq!(owner.as_deref(), Some(testkit::pki::TEST_OPERATOR));
    assert_eq!(detail["accepted"], false, "{detail}");
    assert_eq!(detail["recorded_by"], "operator", "{detail}");
    assert!(
        detail["note"]
            .as_str()
            .is_some_and(|n| n.contains("is not running; the payout is POSTED")),
        "{detail}"
    );
    // The workflow's own records say so too.
    let by_worker = h
        .c()
        .record_operator_decision(&refused_abandon("alice", false))
        .await
        .unwrap();
    assert_eq!(by_worker.detail["recorded_by"], "worker");
}

/// An accepted decision is the workflow's alone (it carries the abandon out): from an operator's
/// certificate it is INVALID_ARGUMENT `accepted` ACCEPTED_NOT_ALLOWED, even signed by that very
/// operator, and nothing is recorded. The worker's certificate records the same decision.
#[tokio::test]
async fn an_operator_may_not_record_an_accepted_decision() {
    let h = harness().await;
    open(&h, "acct-1", 10_000).await;
    create(&h, "p-1", "acct-1", 1_000).await;
    let operator = operator_client(&h.service).await;
    let refused = operator
        .record_operator_decision(&refused_abandon(testkit::pki::TEST_OPERATOR, true))
        .await
        .unwrap_err();
    assert!(
        same(
            &refused,
            &invalid("accepted", InvalidReason::AcceptedNotAllowed)
        ),
        "{refused:?}"
    );
    assert_eq!(decisions_of_p1(&h).await, vec![], "nothing recorded");
    // The control: the workflow's worker records an accepted decision (as refused here, since
    // the test operator has no registered key, but recorded).
    h.c()
        .record_operator_decision(&refused_abandon(testkit::pki::TEST_OPERATOR, true))
        .await
        .unwrap();
    assert_eq!(decisions_of_p1(&h).await.len(), 1);
}

/// An operator's certificate that names another operator (`alice`, a registered one) is refused
/// PERMISSION_DENIED `OperatorNotCertified`, counted, and nothing is recorded: an audit row never
/// names someone the call could not prove it was.
#[tokio::test]
async fn an_operator_recording_a_decision_under_another_name_is_refused() {
    let h = harness().await;
    open(&h, "acct-1", 10_000).await;
    create(&h, "p-1", "acct-1", 1_000).await;
    let operator = operator_client(&h.service).await;
    let refused = operator
        .record_operator_decision(&refused_abandon("alice", false))
        .await
        .unwrap_err();
    assert!(
        matches!(&refused, PaymentError::OperatorNotCertified { operator } if operator == "alice"),
        "{refused:?}"
    );
    assert_eq!(decisions_of_p1(&h).await, vec![], "nothing recorded");
    assert!(
        h.service.metrics.render().contains(
            r#"unauthorised_calls_total{method="/payment.v1.PaymentResource/RecordOperatorDecision",reason="operator_not_certified",role="operator"} 1"#
        ),
        "the refusal is counted"
    );
}

/// Negative control: with the certificate check switched off in-process, the same record under
/// another operator's name lands under that name: the test above sees what it claims to.
#[tokio::test]
async fn negative_control_without_operator_certification_a_decision_is_recorded_under_another_name()
{
    let h = harness().await;
    open(&h, "acct-1", 10_000).await;
    create(&h, "p-1", "acct-1", 1_000).await;
    let uncertified =
        start_service(&h.url, options().without_operator_certification_for_tests()).await;
    operator_client(&uncertified)
        .await
        .record_operator_decision(&refused_abandon("alice", false))
        .await
        .unwrap();
    let recorded = decisions_of_p1(&h).await;
    assert_eq!(recorded.len(), 1, "{recorded:?}");
    assert_eq!(recorded[0].0.as_deref(), Some("alice"));
}

// ----- the fence survives a restore of paydb (issue 19, section 3; migration 0006) -----

/// The gauge `guard_database_restored{guard="payment_resource"}` as the service renders it.
fn restored_gauge(service: &Service) -> Option<i64> {
    service
        .metrics
        .render()
        .lines()
        .find(|l| l.starts_with("guard_database_restored{guard=\"payment_resource\"}"))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
}

async fn gauge_becomes(service: &Service, want: i64) {
    let deadline = tokio::time::Instant::now() + POLL_TIMEOUT;
    while restored_gauge(service) != Some(want) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "guard_database_restored stayed {:?}, wanted {want}",
            restored_gauge(service)
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// paydb at fence 10 is dumped; the successor's token 20 then moves the fence to 20; paydb is
/// restored from the dump (a real `pg_dump` / `pg_restore --clean`), which rewinds the fence to
/// 10. Returns the dump's path (kept for the caller's lifetime by the temp dir).
async fn restored_behind_a_successor(h: &Harness) -> tempfile::TempDir {
    open(h, "acct-1", 10_000).await;
    create(h, "p-1", "acct-1", 1_000).await;
    let p = pid("p-1");
    h.c()
        .claim(&p, &fence("acct-1", "worker-a", 10))
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let dump = dir.path().join("paydb.dump");
    let pg = Stack::shared().pg(PgServer::Main);
    pg.dump(testkit::system::database_name(&h.url), &dump)
        .unwrap();
    h.c()
        .claim(&p, &fence("acct-1", "worker-b", 20))
        .await
        .unwrap();
    // Before the restore the guard holds as always: the stale 15 is fenced out.
    assert!(matches!(
        h.c()
            .mark_submitted(&p, &fence("acct-1", "worker-a", 15))
            .await,
        Err(PaymentError::FencedOut { stored: 20, .. })
    ));
    pg.restore_clean(testkit::system::database_name(&h.url), &dump)
        .unwrap();
    let s = snapshot(&h.pool, "p-1").await;
    assert_eq!(
        (s.fence, s.token_stamp),
        (10, Some(10)),
        "the restore rewound the fence"
    );
    dir
}

/// A paydb restored from a backup rewinds every fence: without more, a token the lost writes had
/// fenced out passes again. The restored copy refuses every fenced write (the stale token and the
/// real holder's alike) as `DatabaseRestored`, changes nothing, audits and counts each refusal,
/// and raises the alarm (`guard_database_restored`). After the procedure's database half
/// (`rearm_after_restore` with the lock service's horizon, 25 here) every fence is at the horizon:
/// the stale and the superseded tokens are fenced out (so their holders re-acquire, rather than
/// wait), a new grant (26) writes, the alarm clears. An account opened after the re-arming has a
/// fence of 0, and a token below the horizon is still fenced out there: no such token was issued
/// after the procedure.
#[tokio::test]
async fn a_restored_paydb_refuses_every_fenced_write_until_it_is_rearmed() {
    let h = harness().await;
    let _dump = restored_behind_a_successor(&h).await;
    let p = pid("p-1");
    let before = snapshot(&h.pool, "p-1").await;
    for (owner, token) in [("worker-a", 15), ("worker-b", 20), ("worker-a", 10)] {
        let err = h
            .c()
            .mark_submitted(&p, &fence("acct-1", owner, token))
            .await
            .unwrap_err();
        assert!(
            matches!(
                err,
                PaymentError::DatabaseRestored {
                    incarnation_current: false,
                    presented,
                    ..
                } if presented == token
            ),
            "token {token}: {err:?}"
        );
    }
    assert_eq!(snapshot(&h.pool, "p-1").await, before, "nothing changed");
    assert_eq!(audit_count(&h.pool, "database_restored").await, 3);
    assert_eq!(counted(&h, "database_restored_refusals_total"), 3);
    gauge_becomes(&h.service, 1).await;

    // The procedure's database half, as the owner: raise every fence to the lock service's
    // horizon and re-arm the database.
    let raised: i64 = sqlx::query_scalar(
        "SELECT rearm_after_restore(25, 'alice', 'restored from the nightly dump')",
    )
    .fetch_one(&h.pool)
    .await
    .unwrap();
    assert_eq!(raised, 1);
    assert_eq!(snapshot(&h.pool, "p-1").await.fence, 25);
    for token in [15, 20, 25 - 1] {
        let err = h
            .c()
            .mark_submitted(&p, &fence("acct-1", "worker-b", token))
            .await
            .unwrap_err();
        assert!(
            matches!(err, PaymentError::FencedOut { stored: 25, .. }),
            "token {token}: {err:?}"
        );
    }
    h.c()
        .claim(&p, &fence("acct-1", "worker-c", 26))
        .await
        .unwrap();
    let submitted = h
        .c()
        .mark_submitted(&p, &fence("acct-1", "worker-c", 26))
        .await
        .unwrap();
    assert_eq!(
        (submitted.state, submitted.token_stamp),
        (PayoutState::RailSubmitted, Some(26))
    );
    assert_eq!(audit_count(&h.pool, "fence_raised_after_restore").await, 1);
    assert_eq!(audit_count(&h.pool, "rearmed_after_restore").await, 1);
    gauge_becomes(&h.service, 0).await;

    open(&h, "acct-2", 10_000).await;
    create(&h, "p-2", "acct-2", 1_000).await;
    let err = h
        .c()
        .claim(&pid("p-2"), &fence("acct-2", "worker-a", 15))
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            PaymentError::FencedOut {
                presented: 15,
                stored: 25,
                ..
            }
        ),
        "{err:?}"
    );
    h.c()
        .claim(&pid("p-2"), &fence("acct-2", "worker-c", 27))
        .await
        .unwrap();

    // A horizon below an accepted fence means the lock backend is behind this guard: refused.
    let refused = sqlx::query_scalar::<_, i64>("SELECT rearm_after_restore(20, 'alice', 'wrong')")
        .fetch_one(&h.pool)
        .await
        .unwrap_err();
    assert!(
        refused
            .to_string()
            .contains("above the lock service's horizon"),
        "{refused}"
    );
}

/// NEGATIVE CONTROL of the test above: the same restore, against a service whose fence statement
/// does not ask whether the database is a restored copy (test-only switch). The stale token 15,
/// which the successor's 20 had fenced out before the restore, lands on the rewound fence.
#[tokio::test]
async fn negative_control_without_the_restore_check_a_stale_token_lands_on_a_restored_paydb() {
    let h = harness().await;
    let _dump = restored_behind_a_successor(&h).await;
    let unguarded = start_service(&h.url, options().without_restore_check_for_tests()).await;
    let landed = unguarded
        .client
        .mark_submitted(&pid("p-1"), &fence("acct-1", "worker-a", 15))
        .await
        .unwrap();
    assert_eq!(
        (landed.state, landed.token_stamp),
        (PayoutState::RailSubmitted, Some(15))
    );
}

/// The gauges of the payouts in flight (the alerts AmbiguousPastResolutionSla, PayoutStuckInState
/// and PayoutNonTerminalTooLong; paydb 0011's partial index): every non-terminal state exported
/// (0 when empty), and an ambiguous payout counted past the resource's own SLA once it has been
/// RAIL_AMBIGUOUS that long on the database's clock, not before; a terminal payout leaves them.
#[tokio::test]
async fn payout_age_gauges_count_the_payouts_in_flight_and_the_ambiguous_past_the_sla() {
    use payment_resource::payout_ages;
    const SLA: Duration = Duration::from_millis(1_000);
    let h = harness().await;
    let metrics = Metrics::default();
    let store = Store::new(
        service_kit::connect_pg(&h.url).await.unwrap(),
        options().with_resolution_sla(SLA),
        &metrics,
    );
    let gauges = store.payout_age_gauges();
    let (ages, past) = payout_ages::measure(&h.pool, gauges, SLA).await.unwrap();
    assert_eq!(ages.len(), payout_ages::NON_TERMINAL.len());
    assert!(ages.iter().all(|a| a.count == 0), "{ages:?}");
    assert_eq!(past, 0);

    open(&h, "acct-1", 10_000).await;
    open(&h, "acct-2", 10_000).await;
    create(&h, "p-1", "acct-1", 1_000).await;
    create(&h, "p-2", "acct-2", 1_000).await;
    let f = drive(h.c(), &pid("p-2"), PayoutState::RailAmbiguous).await;
    let count_of = |ages: &[payout_ages::StateAges], state: &str| {
        ages.iter().find(|a| a.state == state).unwrap().count
    };
    let (ages, past) = payout_ages::measure(&h.pool, gauges, SLA).await.unwrap();
    assert_eq!(count_of(&ages, "PENDING"), 1);
    assert_eq!(count_of(&ages, "RAIL_AMBIGUOUS"), 1);
    assert_eq!(past, 0, "not past the SLA yet");
    let past = testkit::eventually(Duration::from_secs(10), "past the SLA", || async {
        let (_, past) = payout_ages::measure(&h.pool, gauges, SLA).await.ok()?;
        (past == 1).then_some(past)
    })
    .await
    .unwrap();
    assert_eq!(past, 1);
    let rendered = metrics.render();
    for line in [
        "payouts_ambiguous_past_sla 1",
        "payouts_non_terminal{state=\"PENDING\"} 1",
        "payouts_non_terminal{state=\"RAIL_AMBIGUOUS\"} 1",
        "payouts_non_terminal{state=\"CLAIMED\"} 0",
    ] {
        assert!(rendered.contains(line), "{line} in\n{rendered}");
    }
    let in_state: f64 = rendered
        .lines()
        .find_map(|l| l.strip_prefix("payout_oldest_in_state_seconds{state=\"RAIL_AMBIGUOUS\"} "))
        .unwrap()
        .parse()
        .unwrap();
    assert!(in_state >= SLA.as_secs_f64(), "{in_state}");

    // Abandoned: terminal, out of every gauge.
    h.c()
        .abandon(
            &pid("p-2"),
            &f,
            &AbandonRequest {
                operator: "op-1".into(),
                reason: "finance ticket 42".into(),
                resolution_sla_passed: true,
                sla_check: "test".into(),
                signature: signed("p-2", "op-1", "finance ticket 42"),
            },
        )
        .await
        .unwrap();
    let (ages, past) = payout_ages::measure(&h.pool, gauges, SLA).await.unwrap();
    assert_eq!(count_of(&ages, "RAIL_AMBIGUOUS"), 0);
    assert_eq!(past, 0);
    assert!(metrics.render().contains("payouts_ambiguous_past_sla 0"));
}

/// Issue 34, row 6c: an opening balance is money from outside the ledger, so only an operator
/// authorises it. OpenAccount with a positive balance and no signature, a signature by a key
/// nobody registered, one for another amount, account or currency, or one signed too long ago, is
/// PERMISSION_DENIED `FundingNotAuthorised` naming why, nothing written (no account, ledger,
/// outbox or audit row), counted in `payment_funding_refused_total{reason}`. Control: the same
/// request under a registered operator's fresh signature opens the account, and the signature is
/// on its `account_opened` audit row; an empty account needs none.
#[tokio::test]
async fn a_funded_account_opens_only_under_an_operators_signature() {
    let h = harness().await;
    let before = row_counts(&h.pool).await;
    let signed_as = |key: &Signer, name: &str, account: &str, amount: i64, at: u64| {
        payment_client::model::Funding {
            operator: name.into(),
            signature: key
                .sign_funding(&grant_signing::operator::Funding {
                    operator: name,
                    account_id: account,
                    currency: "EUR",
                    amount_minor: amount,
                    signed_at_unix_ms: at,
                })
                .bytes,
            signed_at_unix_ms: at,
        }
    };
    let now = grant_signing::operator::now_unix_ms();
    let refused = [
        ("unsigned", None),
        (
            "unknown_operator",
            Some(signed_as(
                operator("mallory"),
                "mallory",
                "acct-9",
                1_000,
                now,
            )),
        ),
        (
            "bad_signature",
            Some(signed_as(operator("op-1"), "op-1", "acct-9", 999, now)),
        ),
        (
            "bad_signature",
            Some(signed_as(operator("op-1"), "op-1", "acct-8", 1_000, now)),
        ),
        (
            "stale",
            Some(signed_as(
                operator("op-1"),
                "op-1",
                "acct-9",
                1_000,
                now - grant_signing::operator::MAX_AGE_MS - 60_000,
            )),
        ),
    ];
    for (reason, funding) in &refused {
        let err = match funding {
            None => h.c().open_account(&aid("acct-9"), &eur(), 1_000).await,
            Some(f) => {
                h.c()
                    .open_funded_account(&aid("acct-9"), &eur(), 1_000, f)
                    .await
            }
        }
        .unwrap_err();
        match &err {
            PaymentError::FundingNotAuthorised {
                account_id,
                reason: r,
                ..
            } => assert_eq!((account_id.as_str(), r.as_str()), ("acct-9", *reason)),
            other => panic!("{reason}: expected FundingNotAuthorised, got {other:?}"),
        }
    }
    assert_eq!(
        row_counts(&h.pool).await,
        before,
        "a refused opening wrote something"
    );
    let counted = h.service.metrics.render();
    for (reason, n) in [
        ("unsigned", 1),
        ("unknown_operator", 1),
        ("bad_signature", 2),
        ("stale", 1),
    ] {
        assert!(
            counted.contains(&format!(
                r#"payment_funding_refused_total{{reason="{reason}"}} {n}"#
            )),
            "{reason} {n}: {counted}"
        );
    }
    // Control: signed by a registered operator, now.
    let opened = h
        .c()
        .open_funded_account(&aid("acct-9"), &eur(), 1_000, &funding("acct-9", 1_000))
        .await
        .expect("a signed funding opens the account");
    assert_eq!(opened.balance_minor, 1_000);
    let detail: serde_json::Value = sqlx::query_scalar(
        "SELECT detail FROM audit_event WHERE account_id = 'acct-9' AND kind = 'account_opened'",
    )
    .fetch_one(&h.pool)
    .await
    .unwrap();
    assert_eq!(detail["funded_by"], "op-1", "{detail}");
    assert!(
        detail["funding_signature"]
            .as_str()
            .is_some_and(|s| s.len() == 128),
        "{detail}"
    );
    // An empty account needs no signature.
    let empty = h
        .c()
        .open_account(&aid("acct-empty"), &eur(), 0)
        .await
        .unwrap();
    assert_eq!(empty.balance_minor, 0);
}
