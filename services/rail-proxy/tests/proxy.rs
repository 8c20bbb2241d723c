//! The rail proxy against real PostgreSQL (proxydb on its own server) and the real stub over HTTP.
//! The stub's `/admin/movements` is the ground truth of every "did we pay twice?" assertion.
//! Every request presents a grant signed by the test's own lock-service key ([`SIGNER`]), whose
//! public half is the in-process proxy's only verification key.

use std::sync::LazyLock;
use std::time::Duration;
use testkit::pki::{tls, Role};

use grant_signing::{Signature, Signer};
use payout_domain::{AccountId, AmountMinor, BeneficiaryRef, Currency, FencingToken, PayoutId};
use payout_proto::railproxy as pb;
use rail_proxy::{ProxyConfig, RunningProxy, Verifier};
use rail_proxy_client::{
    Evidence, InquirePayout, Outcome, ProxyError, RailProxyClient, SubmitPayout,
};
use rail_stub::{FaultMode, RunningStub, StubConfig};
use testkit::{PgServer, Stack};

/// Short enough that the hanging-rail case is quick, far above the stub's zero latency.
const TEST_RAIL_TIMEOUT_MS: u64 = 700;
const WAIT: Duration = Duration::from_secs(20);

/// The lock service's signing key, as far as these tests are concerned: generated per test
/// binary, never written anywhere.
static SIGNER: LazyLock<Signer> =
    LazyLock::new(|| Signer::generate("proxy-test-1").expect("a fresh key").0);

/// What the proxy under test verifies with: [`SIGNER`]'s public key alone.
fn verifier() -> Verifier {
    Verifier::new([SIGNER.public_key()]).unwrap()
}

/// The payment resource's instruction key, as far as these tests are concerned.
static INSTRUCTION_SIGNER: LazyLock<Signer> =
    LazyLock::new(|| Signer::generate("pr-test-1").expect("a fresh key").0);

/// The proxy's own rail-fact key in these tests; [`fact_verifier`] is the payment resource's side.
static FACT_SIGNER: LazyLock<std::sync::Arc<Signer>> = LazyLock::new(|| {
    std::sync::Arc::new(Signer::generate("proxy-facts-1").expect("a fresh key").0)
});

fn fact_verifier() -> Verifier {
    Verifier::new([FACT_SIGNER.public_key()]).unwrap()
}

/// The in-process proxy's keys: [`SIGNER`]'s grants, [`INSTRUCTION_SIGNER`]'s instructions, and
/// [`FACT_SIGNER`] for its facts.
fn keys() -> rail_proxy::GuardKeys {
    rail_proxy::GuardKeys {
        grants: verifier(),
        instructions: Verifier::new([INSTRUCTION_SIGNER.public_key()]).unwrap(),
        fact_signer: FACT_SIGNER.clone(),
    }
}

/// The genuine signature of the grant (`key`, `token`, `owner`).
fn sign(key: &str, token: u64, owner: &str) -> Signature {
    SIGNER.sign(key, token, owner)
}

/// `request` under the genuine grant of its own account's key, with the payment resource's
/// signed instruction for exactly it.
fn signed(request: SubmitPayout) -> SubmitPayout {
    let key = request.lock_key();
    let signature = sign(&key, request.token.get(), &request.owner);
    instructed(request.signed(key, signature))
}

/// Milliseconds since the Unix epoch on this host (the proxy's clock too).
fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64
}

/// The instruction the payment resource would sign for `request` as it stands, issued now.
fn instruction_for(request: &SubmitPayout) -> grant_signing::instruction::Instruction {
    instructed(request.clone())
        .instruction
        .expect("instructed")
        .instruction
}

/// [`INSTRUCTION_SIGNER`]'s instruction over a raw request's own fields, as the wire carries it.
fn wire_instruction(r: &pb::SubmitRequest) -> pb::PaymentInstruction {
    let signed = INSTRUCTION_SIGNER.sign_instruction(grant_signing::instruction::Instruction {
        payout_id: r.payout_id.clone(),
        account_id: r.account_id.clone(),
        currency: r.currency.clone(),
        beneficiary_ref: r.beneficiary_ref.clone(),
        client_reference: r.client_reference.clone(),
        lock_key: r.key.clone(),
        amount_minor: r.amount_minor,
        token: r.token,
        issued_at_unix_ms: now_ms(),
        expires_at_unix_ms: now_ms() + grant_signing::instruction::TTL_DEFAULT_MS as i64,
    });
    let i = signed.instruction;
    pb::PaymentInstruction {
        payout_id: i.payout_id,
        account_id: i.account_id,
        amount_minor: i.amount_minor,
        currency: i.currency,
        beneficiary_ref: i.beneficiary_ref,
        client_reference: i.client_reference,
        lock_key: i.lock_key,
        token: i.token,
        issued_at_unix_ms: i.issued_at_unix_ms,
        expires_at_unix_ms: i.expires_at_unix_ms,
        signing_key_id: signed.signature.key_id,
        signature: signed.signature.bytes,
    }
}

/// `request` with [`INSTRUCTION_SIGNER`]'s instruction for exactly it.
fn instructed(request: SubmitPayout) -> SubmitPayout {
    request.instructed_by(&INSTRUCTION_SIGNER, now_ms())
}

/// `request` under the genuine grant of its own account's key.
fn signed_inquiry(request: InquirePayout) -> InquirePayout {
    let key = request.lock_key();
    let signature = sign(&key, request.token.get(), &request.owner);
    request.signed(key, signature)
}

struct Rig {
    stub: RunningStub,
    proxy: RunningProxy,
    client: RailProxyClient,
    pool: sqlx::PgPool,
    db_url: String,
}

async fn rig_with(
    stub_config: StubConfig,
    configure: impl FnOnce(ProxyConfig) -> ProxyConfig,
) -> Rig {
    rig_keyed(stub_config, keys(), configure).await
}

/// A rig whose proxy is given `keys`.
async fn rig_keyed(
    stub_config: StubConfig,
    keys: rail_proxy::GuardKeys,
    configure: impl FnOnce(ProxyConfig) -> ProxyConfig,
) -> Rig {
    rig_railed(
        stub_config,
        keys,
        |stub| rail_link(stub, stub.base_url(), stub.answer_verifier()),
        configure,
    )
    .await
}

/// The proxy's link to the rail at `url` (the stub's, or something on the way), with `keys` and
/// the proxy's client certificate of the stub's authority.
fn rail_link(stub: &RunningStub, url: String, keys: Verifier) -> rail_proxy::RailLink {
    rail_proxy::RailLink::new(url, keys, &stub.identity(testkit::rail::PROXY_NAME)).unwrap()
}

/// The proxy's `--rail-ca/--rail-client-cert/--rail-client-key` for a process of its own, its
/// files written into `dir`.
fn rail_tls_args(stub: &RunningStub, dir: &std::path::Path) -> Vec<String> {
    let tls = stub.identity(testkit::rail::PROXY_NAME);
    let mut args = Vec::new();
    for (flag, file, pem) in [
        ("--rail-ca", "rail-ca.pem", tls.ca_pem()),
        ("--rail-client-cert", "rail-proxy.pem", tls.cert_pem()),
        ("--rail-client-key", "rail-proxy.key", tls.key_pem()),
    ] {
        let path = dir.join(file);
        std::fs::write(&path, pem).unwrap();
        args.extend([flag.to_string(), path.display().to_string()]);
    }
    args
}

/// A rig whose proxy reaches the rail through `link` (made from the rig's stub: the stub's own
/// address and key, or something else on the way).
async fn rig_railed(
    stub_config: StubConfig,
    keys: rail_proxy::GuardKeys,
    link: impl FnOnce(&RunningStub) -> rail_proxy::RailLink,
    configure: impl FnOnce(ProxyConfig) -> ProxyConfig,
) -> Rig {
    let db_url = Stack::shared().fresh_db(PgServer::Proxy).await;
    let pool = service_kit::connect_pg(&db_url).await.unwrap();
    let stub = RunningStub::start(stub_config).await.unwrap();
    let config = configure(
        ProxyConfig::new(link(&stub), keys, tls(Role::RailProxy))
            // The suite calls as worker and as reconciler from one client; the binary's real
            // table is exercised by the system and attack suites.
            .with_policy_for_tests(testkit::pki::every_role(&rail_proxy::authz::POLICY))
            .with_rail_timeout(Duration::from_millis(TEST_RAIL_TIMEOUT_MS)),
    );
    let proxy = RunningProxy::start(pool.clone(), config).await.unwrap();
    let client = RailProxyClient::connect(&proxy.endpoint(), &tls(Role::Worker))
        .await
        .unwrap();
    Rig {
        stub,
        proxy,
        client,
        pool,
        db_url,
    }
}

async fn rig() -> Rig {
    rig_with(
        StubConfig {
            settlement_window: Duration::from_millis(1_500),
            ..Default::default()
        },
        |c| c,
    )
    .await
}

/// A Submit of `payout` on `account` by `owner`, unsigned (the grant's key defaults to the
/// account's).
fn unsigned_payout(payout: &str, account: &str, token: u64, owner: &str) -> SubmitPayout {
    SubmitPayout::new(
        PayoutId::parse(payout).unwrap(),
        AccountId::parse(account).unwrap(),
        FencingToken::new(token).unwrap(),
        owner,
        AmountMinor::new(1_000).unwrap(),
        Currency::parse("EUR").unwrap(),
        BeneficiaryRef::parse("ben-1").unwrap(),
    )
}

/// A Submit by `owner` under its genuine grant (`payout:{account}`, `token`).
fn payout(payout: &str, account: &str, token: u64, owner: &str) -> SubmitPayout {
    signed(unsigned_payout(payout, account, token, owner))
}

/// A fenced inquiry by `owner` holding `token` on the payout's account, unsigned.
fn unsigned_inquiry(payout_id: &PayoutId, account: &str, token: u64, owner: &str) -> InquirePayout {
    InquirePayout::new(
        payout_id.clone(),
        AccountId::parse(account).unwrap(),
        FencingToken::new(token).unwrap(),
        owner,
        owner,
    )
}

/// A fenced inquiry by `owner` holding the genuine grant (`payout:{account}`, `token`).
fn inquiry(payout_id: &PayoutId, account: &str, token: u64, owner: &str) -> InquirePayout {
    signed_inquiry(unsigned_inquiry(payout_id, account, token, owner))
}

/// The same payout's inquiry under the submitter's token (signed for `owner`).
fn inquiry_of(request: &SubmitPayout, owner: &str) -> InquirePayout {
    signed_inquiry(InquirePayout::new(
        request.payout_id.clone(),
        request.account_id.clone(),
        request.token,
        owner,
        owner,
    ))
}

async fn count(pool: &sqlx::PgPool, sql: &str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(pool).await.unwrap()
}

/// (movements, payment requests) at the stub for one payout's client reference.
async fn at_rail(rig: &Rig, request: &SubmitPayout) -> (u64, u64) {
    let truth = rig.stub.client().ground_truth().await.unwrap();
    let reference = request.client_reference.as_str();
    (
        truth.movement_counts.get(reference).copied().unwrap_or(0),
        truth
            .submit_request_counts
            .get(reference)
            .copied()
            .unwrap_or(0),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_holders_race_at_most_one_movement_and_the_stale_holder_is_fenced() {
    // The rail is slow, so both holders are in flight together.
    let stub = StubConfig {
        faults: rail_stub::FaultConfig {
            latency_ms_min: 100,
            latency_ms_max: 100,
            ..Default::default()
        },
        ..Default::default()
    };
    let rig = rig_with(stub, |c| c).await;
    for round in 0..5 {
        let stale = payout(
            &format!("p-race-{round}"),
            &format!("acct-race-{round}"),
            10,
            "worker-old",
        );
        let fresh = payout(
            &format!("p-race-{round}"),
            &format!("acct-race-{round}"),
            11,
            "worker-new",
        );
        let (mut a, mut b) = (rig.client.clone(), rig.client.clone());
        let (ra, rb) = tokio::join!(async { a.submit(&stale).await }, async {
            b.submit(&fresh).await
        });
        match (&ra, &rb) {
            (
                Err(ProxyError::FencedOut {
                    presented: 10,
                    stored: 11,
                    ..
                }),
                Ok(s),
            ) => assert_eq!(s.token.get(), 11),
            (
                Ok(s),
                Err(ProxyError::Duplicate {
                    existing,
                    payload_matches: true,
                }),
            ) => {
                assert_eq!((s.token.get(), existing.token.get()), (10, 10))
            }
            other => panic!("round {round}: unexpected pair {other:?}"),
        }
        assert_eq!(
            at_rail(&rig, &stale).await,
            (1, 1),
            "round {round}: exactly one payment request and movement"
        );
    }

    // Deterministically: the newer holder went first; the stale holder is fenced out on the same
    // payout AND on another payout of the same account (the hole a per-payout fence would leave).
    // The payment resource is not involved at all: this proxy is the only guard in the test.
    let fresh = payout("p-fence", "acct-fence", 21, "worker-new");
    assert!(matches!(
        rig.client.clone().submit(&fresh).await.unwrap().outcome,
        Outcome::Acked { .. }
    ));
    for target in ["p-fence", "p-fence-other"] {
        let stale = payout(target, "acct-fence", 20, "worker-old");
        match rig.client.clone().submit(&stale).await {
            Err(ProxyError::FencedOut {
                key,
                presented,
                stored,
                owner,
                stored_owner,
                payout_id,
            }) => {
                assert_eq!(
                    (
                        key.as_str(),
                        presented,
                        stored,
                        owner.as_str(),
                        stored_owner.as_str(),
                        payout_id.as_str()
                    ),
                    (
                        "payout:acct-fence",
                        20,
                        21,
                        "worker-old",
                        "worker-new",
                        target
                    )
                );
            }
            other => panic!("expected FencedOut, got {other:?}"),
        }
        assert_eq!(
            at_rail(&rig, &stale).await,
            (
                u64::from(target == "p-fence"),
                u64::from(target == "p-fence")
            )
        );
    }
    // Equal passes (the same grant performs several writes), and a fenced attempt left no row.
    let again = payout("p-fence-third", "acct-fence", 21, "worker-new");
    assert!(matches!(
        rig.client.clone().submit(&again).await.unwrap().outcome,
        Outcome::Acked { .. }
    ));
    assert_eq!(
        count(
            &rig.pool,
            "SELECT count(*) FROM rail_submission WHERE payout_id = 'p-fence-other'"
        )
        .await,
        0
    );
    assert_eq!(
        count(
            &rig.pool,
            "SELECT count(*) FROM guard_event WHERE kind = 'FENCED' AND account_id = 'acct-fence'"
        )
        .await,
        2
    );
    // Counted once per refusal (the racing rounds above may have fenced some too).
    let fenced_events = count(
        &rig.pool,
        "SELECT count(*) FROM guard_event WHERE kind = 'FENCED'",
    )
    .await;
    assert!(fenced_events >= 2);
    assert_eq!(
        counted(
            &rig,
            "fenced_out_total{guard=\"rail_proxy\",operation=\"submit\"}"
        ) as i64,
        fenced_events
    );
    // The same refusals in the latency histogram, under their own outcome.
    assert_eq!(
        counted(
            &rig,
            "guard_call_duration_seconds_count{guard=\"rail_proxy\",operation=\"submit\",outcome=\"fenced_out\"}"
        ) as i64,
        fenced_events
    );
}

/// The value of `rail_proxy_duplicate_submissions_total{kind}` (0 before the first).
fn duplicates_counted(rig: &Rig, kind: &str) -> u64 {
    let series = format!("rail_proxy_duplicate_submissions_total{{kind=\"{kind}\"}} ");
    rig.proxy
        .metrics
        .render()
        .lines()
        .find_map(|l| l.strip_prefix(&series).map(|v| v.parse().unwrap()))
        .unwrap_or(0)
}

/// A duplicate Submit is a retry only when it is the recorded submission's own grant (same token,
/// same owner) asking again for the same payment; every other duplicate is a second submitter,
/// the defect signal that pages. Both send nothing; the two are counted apart (metric label and
/// `guard_event.duplicate`), and `kind = 'DUPLICATE'` and the metric's sum still count them all.
/// Every final outcome and every evidence the proxy answers carries its signature, which the
/// payment resource's side (the proxy's public rail-fact key) verifies: Submit's answer, a
/// Duplicate's `existing`, Lookup's submission and resolutions, Inquire's pair. The signature
/// covers the record: the same record with another rail reference (a forged ACK) does not verify.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_final_outcome_and_evidence_the_proxy_answers_is_signed() {
    let mut rig = rig().await;
    let facts = fact_verifier();
    let verify_outcome = |s: &rail_proxy_client::Submission| {
        let fact = s.outcome_fact().expect("a final outcome");
        let signature = &s.outcome_signature.as_ref().expect("signed").signature;
        facts.verify_outcome(&fact, signature)
    };
    let request = payout("p-signed", "acct-signed", 5, "worker-1");
    let submitted = rig.client.submit(&request).await.unwrap();
    assert!(matches!(submitted.outcome, Outcome::Acked { .. }));
    assert_eq!(verify_outcome(&submitted), Ok(()));
    // A forged ACK (another rail reference) under the genuine signature does not verify.
    let forged = rail_proxy_client::Submission {
        outcome: Outcome::Acked {
            rail_ref: "fake".into(),
        },
        ..submitted.clone()
    };
    assert_eq!(
        verify_outcome(&forged),
        Err(grant_signing::Forged::BadSignature)
    );
    match rig.client.submit(&request).await {
        Err(ProxyError::Duplicate { existing, .. }) => {
            assert_eq!(verify_outcome(&existing), Ok(()))
        }
        other => panic!("expected a duplicate, got {other:?}"),
    }
    let inquiry = rig
        .client
        .inquire(&inquiry_of(&request, "resolver-1"))
        .await
        .unwrap();
    assert_eq!(verify_outcome(&inquiry.submission), Ok(()));
    let verify_evidence = |r: &rail_proxy_client::Resolution| {
        assert_eq!(r.account_id.as_ref(), Some(&request.account_id));
        let fact = r.evidence_fact(&request.account_id, &request.client_reference);
        facts.verify_evidence(&fact, &r.signature.as_ref().expect("signed").signature)
    };
    assert!(matches!(
        inquiry.resolution.evidence,
        Evidence::Found { .. }
    ));
    assert_eq!(verify_evidence(&inquiry.resolution), Ok(()));
    let record = rig
        .client
        .lookup(&request.payout_id)
        .await
        .unwrap()
        .expect("recorded");
    assert_eq!(verify_outcome(&record.submission), Ok(()));
    assert_eq!(record.resolutions.len(), 1);
    assert_eq!(verify_evidence(&record.resolutions[0]), Ok(()));
    // A payout sealed unsent: its NOT_SENT outcome and NEVER_SENT evidence are signed too.
    let sealed = payout("p-signed-sealed", "acct-signed", 6, "resolver-1");
    let never = rig
        .client
        .inquire(&inquiry_of(&sealed, "resolver-1"))
        .await
        .unwrap();
    assert_eq!(never.resolution.evidence, Evidence::NeverSent);
    assert_eq!(verify_outcome(&never.submission), Ok(()));
    let fact = never
        .resolution
        .evidence_fact(&sealed.account_id, &sealed.client_reference);
    let signature = never.resolution.signature.clone().expect("signed");
    assert_eq!(facts.verify_evidence(&fact, &signature.signature), Ok(()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_duplicate_is_a_retry_only_from_the_recorded_grant_and_a_second_submitter_otherwise() {
    use rail_proxy::DuplicateClass::{self, Retry, SecondSubmitter};
    let mut rig = rig().await;
    let original = payout("p-dup", "acct-dup", 5, "worker-1");
    let submitted = rig.client.submit(&original).await.unwrap();
    assert!(matches!(submitted.outcome, Outcome::Acked { .. }));
    let mut other_payment = original.clone();
    other_payment.amount_minor = AmountMinor::new(2_000).unwrap();
    // Instructed for the other payment: the duplicate, not the instruction, is what is tested.
    let other_payment = instructed(other_payment);
    // On its own account: the sealing inquiry advances that account's high-water.
    let sealed = payout("p-dup-sealed", "acct-dup-sealed", 7, "resolver-1");
    rig.client
        .inquire(&inquiry_of(&sealed, "resolver-1"))
        .await
        .expect("the inquiry seals the unsent payout");
    // In token order, so that no case is fenced out by an earlier one's higher token.
    let cases: Vec<(&str, SubmitPayout, DuplicateClass)> = vec![
        (
            "the same grant again (a crash retry)",
            original.clone(),
            Retry,
        ),
        ("the same grant once more", original.clone(), Retry),
        (
            "the same token under another owner",
            payout("p-dup", "acct-dup", 5, "worker-3"),
            SecondSubmitter,
        ),
        (
            "the same grant, another payment",
            other_payment,
            SecondSubmitter,
        ),
        (
            "a later holder",
            payout("p-dup", "acct-dup", 6, "worker-2"),
            SecondSubmitter,
        ),
        (
            "the sealer's own grant on a sealed payout",
            sealed,
            SecondSubmitter,
        ),
    ];
    let (mut retries, mut seconds) = (0, 0);
    for (name, request, class) in cases {
        match rig.client.submit(&request).await {
            Err(ProxyError::Duplicate { .. }) => {}
            other => panic!("{name}: expected Duplicate, got {other:?}"),
        }
        match class {
            Retry => retries += 1,
            SecondSubmitter => seconds += 1,
        }
        assert_eq!(
            (
                duplicates_counted(&rig, "retry"),
                duplicates_counted(&rig, "second_submitter")
            ),
            (retries, seconds),
            "{name}"
        );
        let recorded: Option<String> = sqlx::query_scalar(
            "SELECT duplicate FROM guard_event WHERE kind = 'DUPLICATE' ORDER BY id DESC LIMIT 1",
        )
        .fetch_one(&rig.pool)
        .await
        .unwrap();
        assert_eq!(recorded.as_deref(), Some(class.name()), "{name}");
    }
    assert_eq!(
        count(
            &rig.pool,
            "SELECT count(*) FROM guard_event WHERE kind = 'DUPLICATE'"
        )
        .await,
        (retries + seconds) as i64,
        "the DUPLICATE total still counts every duplicate"
    );
    assert_eq!(at_rail(&rig, &original).await, (1, 1), "nothing sent again");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn many_concurrent_submits_for_one_payout_reach_the_rail_once() {
    let stub = StubConfig {
        faults: rail_stub::FaultConfig {
            latency_ms_min: 50,
            latency_ms_max: 50,
            ..Default::default()
        },
        ..Default::default()
    };
    // The rail's answer is what this case is about, never its timeout: 16 callers on a loaded
    // 2-core machine once held the winner's 50 ms call past the suite's 700 ms and it came back
    // TIMEOUT; a bound this case cannot reach keeps it about the uniqueness alone.
    let rig = rig_with(stub, |c| c.with_rail_timeout(Duration::from_secs(60))).await;
    const CALLERS: usize = 16;
    let request = payout("p-many", "acct-many", 5, "worker-1");
    let calls = (0..CALLERS).map(|_| {
        let (mut client, request) = (rig.client.clone(), request.clone());
        tokio::spawn(async move { client.submit(&request).await })
    });
    let results: Vec<_> = futures::future::join_all(calls)
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect();
    let winners: Vec<_> = results.iter().filter_map(|r| r.as_ref().ok()).collect();
    assert_eq!(winners.len(), 1, "{results:?}");
    for result in &results {
        if let Err(e) = result {
            match e {
                ProxyError::Duplicate {
                    existing,
                    payload_matches,
                } => {
                    assert!(*payload_matches);
                    assert_eq!(existing.payout_id, request.payout_id);
                    assert_eq!(existing.client_reference, request.client_reference);
                }
                other => panic!("expected Duplicate, got {other:?}"),
            }
        }
    }
    assert_eq!(at_rail(&rig, &request).await, (1, 1), "{winners:?}");
    assert_eq!(
        count(
            &rig.pool,
            "SELECT count(*) FROM guard_event WHERE kind = 'DUPLICATE'"
        )
        .await,
        CALLERS as i64 - 1
    );
    // A retry after the outcome also gets the existing, now resolved, record and sends nothing.
    match rig.client.clone().submit(&request).await {
        Err(ProxyError::Duplicate { existing, .. }) => {
            assert!(matches!(existing.outcome, Outcome::Acked { .. }))
        }
        other => panic!("expected Duplicate, got {other:?}"),
    }
    assert_eq!(at_rail(&rig, &request).await, (1, 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_fault_mode_maps_to_its_outcome_once_and_evidence_sits_beside_it() {
    let mut rig = rig().await;
    let modes = [
        FaultMode::Accept,
        FaultMode::Decline,
        FaultMode::FailBeforeActing,
        FaultMode::AcceptThenFail,
        FaultMode::AcceptThenHang,
        FaultMode::ResetBeforeActing,
        FaultMode::AcceptThenReset,
    ];
    let mut cases = Vec::new();
    for (i, mode) in modes.into_iter().enumerate() {
        let request = payout(
            &format!("p-fault-{i}"),
            &format!("acct-fault-{i}"),
            3,
            "worker-1",
        );
        rig.stub
            .client()
            .force(request.client_reference.as_str(), Some(mode))
            .await
            .unwrap();
        let submission = rig
            .client
            .submit(&request)
            .await
            .unwrap_or_else(|e| panic!("{mode:?}: {e:?}"));
        match (mode, &submission.outcome) {
            (FaultMode::Accept, Outcome::Acked { rail_ref }) => {
                assert!(rail_ref.starts_with("rr-"))
            }
            (FaultMode::Decline, Outcome::Rejected { decline_code }) => {
                assert_eq!(decline_code, "INSUFFICIENT_FUNDS")
            }
            (
                FaultMode::FailBeforeActing | FaultMode::AcceptThenFail,
                Outcome::Timeout { detail },
            ) => assert!(detail.contains("rail answered 5"), "{detail}"),
            (FaultMode::AcceptThenHang, Outcome::Timeout { detail }) => {
                assert!(detail.starts_with("timeout"), "{detail}")
            }
            (
                FaultMode::ResetBeforeActing | FaultMode::AcceptThenReset,
                Outcome::Timeout { .. },
            ) => {}
            (mode, outcome) => panic!("{mode:?} recorded as {outcome:?}"),
        }
        assert_eq!(
            submission.outcome.is_ambiguous(),
            !matches!(mode, FaultMode::Accept | FaultMode::Decline)
        );
        let record = rig
            .client
            .lookup(&request.payout_id)
            .await
            .unwrap()
            .expect("recorded");
        assert_eq!(
            record.submission, submission,
            "the answer is what was recorded"
        );
        assert_eq!(
            at_rail(&rig, &request).await,
            (u64::from(mode.moves_money()), 1),
            "{mode:?}: sent once, never retried"
        );
        cases.push((mode, request, submission));
    }
    // The raw wire says "ambiguous" explicitly.
    let raw = rig
        .client
        .raw()
        .lookup(pb::LookupRequest {
            payout_id: "p-fault-4".into(),
        })
        .await
        .unwrap()
        .into_inner();
    let raw = raw.submission.unwrap();
    assert_eq!(
        (raw.outcome, raw.ambiguous),
        (pb::Outcome::Timeout as i32, true)
    );

    // Inquiries: FOUND at once for a moved payment; UNKNOWN inside the window, then ABSENT.
    for (mode, request, submission) in &cases {
        if mode.moves_money() {
            let inquiry = rig
                .client
                .inquire(&inquiry_of(request, "reconciler-1"))
                .await
                .unwrap();
            assert!(
                matches!(&inquiry.resolution.evidence, Evidence::Found { rail_refs } if rail_refs.len() == 1),
                "{mode:?}"
            );
            assert_eq!(
                &inquiry.submission, submission,
                "an inquiry never changes the outcome"
            );
        }
    }
    let (_, not_moved, _) = &cases[2];
    let first = rig
        .client
        .inquire(&inquiry_of(not_moved, "reconciler-1"))
        .await
        .unwrap();
    assert!(
        matches!(first.resolution.evidence, Evidence::Unknown { .. }),
        "{first:?}"
    );
    let mut client = rig.client.clone();
    let payout_id = not_moved.payout_id.clone();
    let asked = inquiry_of(not_moved, "reconciler-1");
    testkit::eventually(WAIT, "an authoritative ABSENT", || {
        let (mut client, asked) = (client.clone(), asked.clone());
        async move {
            (client.inquire(&asked).await.unwrap().resolution.evidence == Evidence::Absent)
                .then_some(())
        }
    })
    .await
    .unwrap();
    let record = client.lookup(&payout_id).await.unwrap().unwrap();
    assert!(
        matches!(record.submission.outcome, Outcome::Timeout { .. }),
        "the outcome stays TIMEOUT"
    );
    assert!(record.resolutions.len() >= 2);
    assert!(record
        .resolutions
        .iter()
        .all(|r| r.asked_by == "reconciler-1"));
    assert_eq!(
        record.resolutions.last().unwrap().evidence,
        Evidence::Absent
    );

    // The database itself refuses to rewrite history.
    for sql in [
        "UPDATE rail_submission SET outcome = 'ACKED', rail_ref = 'rr-x' WHERE payout_id = 'p-fault-2'",
        "UPDATE rail_submission SET amount_minor = 1 WHERE payout_id = 'p-fault-0'",
        "DELETE FROM rail_submission WHERE payout_id = 'p-fault-1'",
        "TRUNCATE rail_submission CASCADE",
        "DELETE FROM resolution",
        "UPDATE account_high_water SET high_water = 1",
    ] {
        assert!(sqlx::query(sql).execute(&rig.pool).await.is_err(), "{sql} must be refused");
    }
    // No inquiry or lookup ever reached the rail's payment endpoint.
    let truth = rig.stub.client().ground_truth().await.unwrap();
    assert_eq!(truth.submit_requests_total, modes.len() as u64);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_proxy_killed_between_intent_and_rail_call_leaves_an_ambiguous_null() {
    let rig = rig().await;
    let port = testkit::free_port();
    let dir = tempfile::tempdir().unwrap();
    // A process of its own that dies by abort() right after the intent commits: the test-only
    // `rail-proxy-failpoint` (tests/src/bin), the shipped start-up with the failpoint set.
    let spec = testkit::ProcessSpec::new(
        "rail-proxy-failpoint",
        testkit::workspace_bin("rail-proxy-failpoint"),
        dir.path().join("proxy.log"),
    )
    .args(["--listen".to_string(), format!("127.0.0.1:{port}")])
    .args(["--database-url".to_string(), rig.db_url.clone()])
    .args(["--rail-url".to_string(), rig.stub.base_url()])
    .args(rail_tls_args(&rig.stub, dir.path()))
    .args([
        "--rail-answer-verify-keys".to_string(),
        rig.stub.answer_key.to_string(),
    ])
    .args([
        "--grant-verify-keys".to_string(),
        SIGNER.public_key().to_string(),
    ])
    .args([
        "--instruction-verify-keys".to_string(),
        INSTRUCTION_SIGNER.public_key().to_string(),
    ])
    .args(
        testkit::grants::SigningKey::rail_fact(dir.path())
            .unwrap()
            .signing_args("rail-fact"),
    )
    .args(
        testkit::pki::shared()
            .issue(Role::RailProxy, "rail-proxy-binary")
            .unwrap()
            .to_args(),
    );
    let process = testkit::ManagedProcess::start(spec).unwrap();
    let endpoint = format!("https://127.0.0.1:{port}");
    let mut doomed = testkit::eventually(WAIT, "the proxy binary to listen", || {
        let endpoint = endpoint.clone();
        async move {
            RailProxyClient::connect(&endpoint, &tls(Role::Worker))
                .await
                .ok()
        }
    })
    .await
    .unwrap();
    let request = payout("p-crash", "acct-crash", 7, "worker-1");
    let died = doomed.submit(&request).await;
    assert!(matches!(died, Err(ProxyError::Rpc(_))), "{died:?}");
    testkit::eventually(WAIT, "the proxy to be dead", || async {
        (!process.is_running()).then_some(())
    })
    .await
    .unwrap();

    // A surviving proxy on the same proxydb reports the NULL outcome as "may have moved money".
    let mut client = rig.client.clone();
    let record = client
        .lookup(&request.payout_id)
        .await
        .unwrap()
        .expect("the intent was committed");
    assert_eq!(record.submission.outcome, Outcome::Pending);
    assert!(record.submission.outcome.is_ambiguous());
    assert_eq!(record.submission.resolved_at_unix_ms, None);
    // Nobody may resubmit it, whatever the token: the answer is the existing record, nothing is sent.
    let later = payout("p-crash", "acct-crash", 8, "worker-2");
    match client.submit(&later).await {
        Err(ProxyError::Duplicate { existing, .. }) => {
            assert_eq!(existing.outcome, Outcome::Pending)
        }
        other => panic!("expected Duplicate, got {other:?}"),
    }
    assert_eq!(at_rail(&rig, &request).await, (0, 0));
    // Resolution is by evidence only: the rail saw nothing, so after its window: ABSENT.
    let asked = inquiry_of(&later, "reconciler-1");
    testkit::eventually(WAIT, "an authoritative ABSENT", || {
        let (mut client, asked) = (client.clone(), asked.clone());
        async move {
            (client.inquire(&asked).await.unwrap().resolution.evidence == Evidence::Absent)
                .then_some(())
        }
    })
    .await
    .unwrap();
    assert_eq!(
        client
            .lookup(&request.payout_id)
            .await
            .unwrap()
            .unwrap()
            .submission
            .outcome,
        Outcome::Pending
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn negative_control_without_the_guard_the_same_race_pays_twice() {
    let stub = StubConfig {
        faults: rail_stub::FaultConfig {
            latency_ms_min: 50,
            latency_ms_max: 50,
            ..Default::default()
        },
        ..Default::default()
    };
    let rig = rig_with(stub, |c| c.disable_guards_for_negative_control()).await;
    let stale = payout("p-control", "acct-control", 10, "worker-old");
    let fresh = payout("p-control", "acct-control", 11, "worker-new");
    let (mut a, mut b) = (rig.client.clone(), rig.client.clone());
    let (ra, rb) = tokio::join!(async { a.submit(&stale).await }, async {
        b.submit(&fresh).await
    });
    assert!(ra.is_ok() && rb.is_ok(), "{ra:?} {rb:?}");
    assert_eq!(
        at_rail(&rig, &stale).await,
        (2, 2),
        "without the guard the rail pays twice: what the guard prevents"
    );
}

/// The rows an instruction refusal wrote for `payout`: (reason, field).
async fn instruction_refusals(pool: &sqlx::PgPool, payout: &str) -> Vec<(String, Option<String>)> {
    sqlx::query_as("SELECT reason, field FROM instruction_refusal WHERE payout_id = $1 ORDER BY id")
        .bind(payout)
        .fetch_all(pool)
        .await
        .unwrap()
}

/// Attack row 1c (issue 33): a genuine instruction copied and one thing changed. The request
/// differing from the signed instruction in any field (what a rogue relay would change to pay
/// someone else, more, or under another grant), an instruction signed by an unregistered key,
/// a tampered signature, an expired one, one not yet valid, one of a key removed after a rotation:
/// each is refused `instruction_refused` with its reason (and field), writes only its
/// `instruction_refusal` row, is counted, and sends nothing. The untouched instruction, and one
/// of the new key during a rotation, are accepted and sent (the control).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_submit_is_sent_only_on_the_payment_resources_instruction_for_exactly_it() {
    let rig = rig().await;
    let genuine = payout("p-ins", "acct-ins", 5, "worker-1");
    type Mutation = Box<dyn Fn(&mut SubmitPayout)>;
    let mutations: Vec<(&str, Mutation)> = vec![
        (
            "amount_minor",
            Box::new(|r| r.amount_minor = AmountMinor::new(999_999).unwrap()),
        ),
        (
            "beneficiary_ref",
            Box::new(|r| r.beneficiary_ref = BeneficiaryRef::parse("mallory").unwrap()),
        ),
        (
            "currency",
            Box::new(|r| r.currency = Currency::parse("USD").unwrap()),
        ),
        // The instruction of another account's payout, presented for this one.
        (
            "account_id",
            Box::new(|r| {
                let i = r.instruction.as_mut().unwrap();
                *i = INSTRUCTION_SIGNER.sign_instruction(grant_signing::instruction::Instruction {
                    account_id: "acct-other".into(),
                    ..i.instruction.clone()
                });
            }),
        ),
        (
            "payout_id",
            Box::new(|r| {
                let i = r.instruction.as_mut().unwrap();
                *i = INSTRUCTION_SIGNER.sign_instruction(grant_signing::instruction::Instruction {
                    payout_id: "p-other".into(),
                    ..i.instruction.clone()
                });
            }),
        ),
        (
            "token",
            Box::new(|r| {
                let i = r.instruction.as_mut().unwrap();
                *i = INSTRUCTION_SIGNER.sign_instruction(grant_signing::instruction::Instruction {
                    token: 4,
                    ..i.instruction.clone()
                });
            }),
        ),
        (
            "lock_key",
            Box::new(|r| {
                let i = r.instruction.as_mut().unwrap();
                *i = INSTRUCTION_SIGNER.sign_instruction(grant_signing::instruction::Instruction {
                    lock_key: "payout:acct-other".into(),
                    ..i.instruction.clone()
                });
            }),
        ),
    ];
    let mut refused = 0;
    for (field, mutate) in &mutations {
        let mut forged = genuine.clone();
        mutate(&mut forged);
        match rig.client.clone().submit(&forged).await {
            Err(ProxyError::InstructionRefused {
                reason,
                field: named,
                ..
            }) => {
                assert_eq!((reason.as_str(), named.as_str()), ("mismatch", *field));
            }
            other => panic!("{field}: expected instruction_refused, got {other:?}"),
        }
        refused += 1;
    }
    let (stranger, _) = Signer::generate("pr-stranger").unwrap();
    let (new_key, _) = Signer::generate("pr-test-2").unwrap();
    let signed_by = |signer: &Signer, i: grant_signing::instruction::Instruction| {
        genuine.clone().instructed(Some(signer.sign_instruction(i)))
    };
    let base = instruction_for(&genuine);
    let mut tampered = genuine.clone();
    if let Some(i) = tampered.instruction.as_mut() {
        i.signature.bytes[0] ^= 1;
    }
    let skew = grant_signing::instruction::CLOCK_SKEW_MS;
    let cases: Vec<(&str, SubmitPayout)> = vec![
        ("unsigned", genuine.clone().instructed(None)),
        ("unknown_key_id", signed_by(&stranger, base.clone())),
        ("unknown_key_id", signed_by(&new_key, base.clone())),
        ("bad_signature", tampered),
        (
            "expired",
            signed_by(
                &INSTRUCTION_SIGNER,
                grant_signing::instruction::Instruction {
                    issued_at_unix_ms: now_ms() - 120_000,
                    expires_at_unix_ms: now_ms() - 2 * skew,
                    ..base.clone()
                },
            ),
        ),
        (
            "not_yet_valid",
            signed_by(
                &INSTRUCTION_SIGNER,
                grant_signing::instruction::Instruction {
                    issued_at_unix_ms: now_ms() + 60_000,
                    expires_at_unix_ms: now_ms() + 120_000,
                    ..base.clone()
                },
            ),
        ),
    ];
    for (reason, request) in &cases {
        match rig.client.clone().submit(request).await {
            Err(ProxyError::InstructionRefused { reason: r, .. }) => assert_eq!(&r, reason),
            other => panic!("{reason}: expected instruction_refused, got {other:?}"),
        }
        refused += 1;
    }
    // Nothing sent, nothing written but the refusal rows.
    assert_eq!(
        at_rail(&rig, &genuine).await,
        (0, 0),
        "a refused submit reached the rail"
    );
    assert_eq!(
        count(
            &rig.pool,
            "SELECT count(*) FROM rail_submission WHERE payout_id = 'p-ins'"
        )
        .await,
        0
    );
    assert_eq!(
        count(&rig.pool, "SELECT count(*) FROM account_high_water").await,
        0
    );
    let rows = instruction_refusals(&rig.pool, "p-ins").await;
    assert_eq!(rows.len(), refused);
    assert_eq!(rows[0], ("mismatch".into(), Some("amount_minor".into())));
    let metrics = rig.proxy.metrics.render();
    for (reason, n) in [
        ("mismatch", 7),
        ("unknown_key_id", 2),
        ("unsigned", 1),
        ("expired", 1),
    ] {
        let line =
            format!("instructions_refused_total{{guard=\"rail_proxy\",reason=\"{reason}\"}} {n}");
        assert!(metrics.contains(&line), "missing {line}");
    }

    // The control: the untouched instruction is accepted and sent, and recorded as authorising.
    let sent = rig.client.clone().submit(&genuine).await.unwrap();
    assert!(matches!(sent.outcome, Outcome::Acked { .. }));
    assert_eq!(at_rail(&rig, &genuine).await, (1, 1));
    let key_id: Option<String> = sqlx::query_scalar(
        "SELECT instruction_key_id FROM rail_submission WHERE payout_id = 'p-ins'",
    )
    .fetch_one(&rig.pool)
    .await
    .unwrap();
    assert_eq!(key_id.as_deref(), Some("pr-test-1"));
}

/// Rotation: a proxy given the old and the new instruction key accepts both; once the old key is
/// removed, its instructions are refused `unknown_key_id`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_instruction_key_rotation_accepts_both_keys_then_only_the_new_one() {
    let (new_key, _) = Signer::generate("pr-test-2").unwrap();
    let both = Verifier::new([INSTRUCTION_SIGNER.public_key(), new_key.public_key()]).unwrap();
    let only_new = Verifier::new([new_key.public_key()]).unwrap();
    for (verifier, old_accepted) in [(both, true), (only_new, false)] {
        let keys = rail_proxy::GuardKeys {
            instructions: verifier,
            ..keys()
        };
        let rig = rig_keyed(StubConfig::default(), keys, |c| c).await;
        // Signed by the old key (INSTRUCTION_SIGNER).
        let by_old = payout("p-rot-old", "acct-rot", 5, "worker-1");
        let old = rig.client.clone().submit(&by_old).await;
        assert_eq!(old.is_ok(), old_accepted, "{old:?}");
        if !old_accepted {
            assert!(
                matches!(&old, Err(ProxyError::InstructionRefused { reason, .. }) if reason == "unknown_key_id"),
                "{old:?}"
            );
        }
        let fresh = signed(unsigned_payout("p-rot-new", "acct-rot", 6, "worker-1"));
        let fresh = fresh
            .clone()
            .instructed(Some(new_key.sign_instruction(instruction_for(&fresh))));
        assert!(
            rig.client.clone().submit(&fresh).await.is_ok(),
            "the new key's instruction"
        );
    }
}

/// NEGATIVE CONTROL of attack row 1c: with the instruction check switched off (test-only
/// switch), the same altered request (another beneficiary, another amount) is sent and paid.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn negative_control_without_the_instruction_check_an_altered_submit_is_paid() {
    let rig = rig_with(StubConfig::default(), |c| {
        c.disable_instruction_verification_for_negative_control()
    })
    .await;
    let mut forged = payout("p-ins-control", "acct-ins-control", 5, "worker-1");
    forged.amount_minor = AmountMinor::new(999_999).unwrap();
    forged.beneficiary_ref = BeneficiaryRef::parse("mallory").unwrap();
    let sent = rig.client.clone().submit(&forged).await.unwrap();
    assert!(matches!(sent.outcome, Outcome::Acked { .. }));
    assert_eq!(
        at_rail(&rig, &forged).await,
        (1, 1),
        "without the check the rail pays the forgery"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn bad_input_gets_a_specific_error_and_writes_nothing() {
    let mut rig = rig().await;
    let grant = sign("payout:acct-bad", 4, "worker-1");
    let good = pb::SubmitRequest {
        payout_id: "p-bad".into(),
        account_id: "acct-bad".into(),
        token: 4,
        owner: "worker-1".into(),
        client_reference: "cref-p-bad".into(),
        amount_minor: 100,
        currency: "EUR".into(),
        beneficiary_ref: "ben-1".into(),
        key: "payout:acct-bad".into(),
        signing_key_id: grant.key_id.clone(),
        signature: grant.bytes.clone(),
        instruction: None,
    };
    let table: Vec<(&str, pb::SubmitRequest)> = vec![
        (
            "token",
            pb::SubmitRequest {
                token: 0,
                ..good.clone()
            },
        ),
        // Above i64::MAX: no lock backend issues it and no bigint holds it (this panicked the
        // handler before FencingToken refused it at construction).
        (
            "token",
            pb::SubmitRequest {
                token: u64::MAX,
                ..good.clone()
            },
        ),
        (
            "token",
            pb::SubmitRequest {
                token: i64::MAX as u64 + 1,
                ..good.clone()
            },
        ),
        // NUL: PostgreSQL text cannot hold it; before this was refused here, the intent
        // transaction failed after the guard and the answer was UNAVAILABLE.
        (
            "owner",
            pb::SubmitRequest {
                owner: "worker\0".into(),
                ..good.clone()
            },
        ),
        (
            "currency",
            pb::SubmitRequest {
                currency: "XXX".into(),
                ..good.clone()
            },
        ),
        (
            "currency",
            pb::SubmitRequest {
                currency: "".into(),
                ..good.clone()
            },
        ),
        (
            "amount_minor",
            pb::SubmitRequest {
                amount_minor: 0,
                ..good.clone()
            },
        ),
        (
            "amount_minor",
            pb::SubmitRequest {
                amount_minor: -5,
                ..good.clone()
            },
        ),
        (
            "payout_id",
            pb::SubmitRequest {
                payout_id: "".into(),
                ..good.clone()
            },
        ),
        (
            "account_id",
            pb::SubmitRequest {
                account_id: "".into(),
                ..good.clone()
            },
        ),
        (
            "client_reference",
            pb::SubmitRequest {
                client_reference: "".into(),
                ..good.clone()
            },
        ),
        (
            "client_reference",
            pb::SubmitRequest {
                client_reference: "cref-someone-else".into(),
                ..good.clone()
            },
        ),
        (
            "beneficiary_ref",
            pb::SubmitRequest {
                beneficiary_ref: "".into(),
                ..good.clone()
            },
        ),
        (
            "owner",
            pb::SubmitRequest {
                owner: "".into(),
                ..good.clone()
            },
        ),
        // The grant's texts are kept in a refusal's guard event: bounded, without NUL, and
        // refused as bad input before any signature is checked.
        (
            "key",
            pb::SubmitRequest {
                key: "payout:acct-bad\0".into(),
                ..good.clone()
            },
        ),
        (
            "key",
            pb::SubmitRequest {
                key: "k".repeat(rail_proxy_client::KEY_LENGTH_MAX + 1),
                ..good.clone()
            },
        ),
        (
            "signing_key_id",
            pb::SubmitRequest {
                signing_key_id: "proxy-test-1\0".into(),
                ..good.clone()
            },
        ),
        (
            "signing_key_id",
            pb::SubmitRequest {
                signing_key_id: "k".repeat(grant_signing::KEY_ID_LENGTH_MAX + 1),
                ..good.clone()
            },
        ),
    ];
    for (field, request) in table {
        let status = rig
            .client
            .raw()
            .submit(request.clone())
            .await
            .expect_err(field);
        assert_eq!(status.code(), tonic::Code::InvalidArgument, "{field}");
        let detail =
            service_kit::rejection::decode::<pb::Rejection>(&status).expect("typed detail");
        match detail.kind {
            Some(pb::rejection::Kind::InvalidArgument(i)) => {
                assert_eq!(i.field, field, "{request:?}")
            }
            other => panic!("{field}: {other:?}"),
        }
    }
    for table in [
        "rail_submission",
        "account_high_water",
        "guard_event",
        "resolution",
    ] {
        assert_eq!(
            count(&rig.pool, &format!("SELECT count(*) FROM {table}")).await,
            0,
            "{table}"
        );
    }
    assert_eq!(
        rig.stub
            .client()
            .ground_truth()
            .await
            .unwrap()
            .submit_requests_total,
        0
    );
    // Inquire validates too (it must present a fence); Lookup says NOT_FOUND for an unknown payout.
    let mut no_asker = inquiry(&PayoutId::parse("p-bad").unwrap(), "acct-bad", 1, "r");
    no_asker.asked_by.clear();
    assert!(
        matches!(rig.client.inquire(&no_asker).await, Err(ProxyError::InvalidArgument { field, .. }) if field == "asked_by")
    );
    let mut raw = rig.client.clone();
    let unfenced = raw
        .raw()
        .inquire(pb::InquireRequest {
            payout_id: "p-bad".into(),
            asked_by: "r".into(),
            account_id: "acct-bad".into(),
            token: 0,
            owner: "r".into(),
            key: "payout:acct-bad".into(),
            signing_key_id: grant.key_id.clone(),
            signature: grant.bytes.clone(),
        })
        .await
        .expect_err("an inquiry without a token is refused");
    assert_eq!(unfenced.code(), tonic::Code::InvalidArgument);
    assert_eq!(
        count(&rig.pool, "SELECT count(*) FROM rail_submission").await,
        0,
        "nothing sealed"
    );
    assert!(rig
        .client
        .lookup(&PayoutId::parse("p-bad").unwrap())
        .await
        .unwrap()
        .is_none());
}

/// Issue 7, at the proxy: holder A (token 10) is delayed before its Submit reaches the proxy;
/// holder B (token 11) inquires first. B's fenced inquiry advances the high-water and seals the
/// payout (NEVER_SENT). A's late Submit is FENCED, and even a Submit with a token at or above
/// B's is a DUPLICATE: nothing ever reaches the rail.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_fenced_inquiry_seals_an_unsent_payout_so_a_late_submit_sends_nothing() {
    let mut rig = rig().await;
    let a = payout("p-seal", "acct-seal", 10, "worker-a");
    let asked = inquiry(&a.payout_id, "acct-seal", 11, "worker-b");
    let sealed = rig.client.inquire(&asked).await.unwrap();
    assert_eq!(sealed.resolution.evidence, Evidence::NeverSent);
    assert_eq!(
        sealed.submission.outcome,
        Outcome::NotSent {
            sealed_by: "worker-b".into()
        }
    );
    assert_eq!(
        (
            sealed.submission.token.get(),
            sealed.submission.payment.as_ref()
        ),
        (11, None)
    );
    assert!(!sealed.submission.outcome.is_ambiguous());
    assert_eq!(
        count(
            &rig.pool,
            "SELECT high_water FROM account_high_water WHERE account_id = 'acct-seal'"
        )
        .await,
        11
    );

    // A resumes: its stale token is fenced by the high-water the inquiry advanced.
    match rig.client.submit(&a).await {
        Err(ProxyError::FencedOut {
            presented: 10,
            stored: 11,
            stored_owner,
            ..
        }) => assert_eq!(stored_owner, "worker-b"),
        other => panic!("expected FencedOut, got {other:?}"),
    }
    // A Submit at or above the sealer's token (a late one from B itself, or a later holder) is a
    // DUPLICATE of the sealed record.
    for (token, owner) in [(11, "worker-b"), (12, "worker-c")] {
        let late = payout("p-seal", "acct-seal", token, owner);
        match rig.client.submit(&late).await {
            Err(ProxyError::Duplicate { existing, .. }) => {
                assert!(existing.is_sealed(), "{existing:?}")
            }
            other => panic!("token {token}: expected Duplicate, got {other:?}"),
        }
    }
    assert_eq!(
        at_rail(&rig, &a).await,
        (0, 0),
        "nothing ever reached the rail"
    );
    // The seal is final: asked again it still answers NEVER_SENT, and the database refuses to
    // turn it into anything else.
    let again = rig
        .client
        .inquire(&inquiry(&a.payout_id, "acct-seal", 12, "worker-c"))
        .await
        .unwrap();
    assert_eq!(again.resolution.evidence, Evidence::NeverSent);
    assert_eq!(
        again.submission.owner, "worker-b",
        "the record names its sealer"
    );
    for sql in [
        "UPDATE rail_submission SET outcome = 'ACKED', rail_ref = 'rr-x', sealed_by = NULL WHERE payout_id = 'p-seal'",
        "DELETE FROM rail_submission WHERE payout_id = 'p-seal'",
        // An intent may never be turned into a seal, nor a row born with a real outcome.
        "INSERT INTO rail_submission (payout_id, account_id, fence_token, owner, client_reference, outcome, rail_ref, resolved_at, amount_minor, currency, beneficiary_ref) \
           VALUES ('p-born', 'acct-x', 1, 'w', 'cref-p-born', 'ACKED', 'rr-1', now(), 1, 'EUR', 'b')",
    ] {
        assert!(sqlx::query(sql).execute(&rig.pool).await.is_err(), "{sql} must be refused");
    }
    // A stale inquirer is fenced like a stale submitter, and seals nothing.
    let stale = rig
        .client
        .inquire(&inquiry(
            &PayoutId::parse("p-seal-other").unwrap(),
            "acct-seal",
            9,
            "worker-z",
        ))
        .await;
    assert!(
        matches!(
            stale,
            Err(ProxyError::FencedOut {
                presented: 9,
                stored: 12,
                ..
            })
        ),
        "{stale:?}"
    );
    assert_eq!(
        count(
            &rig.pool,
            "SELECT count(*) FROM rail_submission WHERE payout_id = 'p-seal-other'"
        )
        .await,
        0
    );
    assert_eq!(
        count(
            &rig.pool,
            "SELECT count(*) FROM guard_event WHERE payout_id LIKE 'p-seal%' AND kind = 'FENCED'"
        )
        .await,
        2,
        "A's submit and the stale inquiry"
    );
    assert_eq!(
        count(
            &rig.pool,
            "SELECT count(*) FROM guard_event WHERE payout_id = 'p-seal-other' AND operation = 'INQUIRE'"
        )
        .await,
        1
    );
    assert_eq!(
        count(
            &rig.pool,
            "SELECT count(*) FROM guard_event WHERE payout_id = 'p-seal' AND kind = 'DUPLICATE'"
        )
        .await,
        2
    );
    assert!(rig
        .proxy
        .metrics
        .render()
        .contains("rail_proxy_seals_total 1"));
}

/// The negative control of the seal: the same sequence with sealing switched off. A's stale
/// token is still fenced (the high-water advanced), but a late Submit at or above the
/// inquirer's token is accepted and moves money for a payout the inquiry concluded was never
/// sent: the money-losing hole of issue 7.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn negative_control_without_the_seal_a_late_submit_moves_money() {
    let mut rig = rig_with(
        StubConfig {
            settlement_window: Duration::from_millis(1_500),
            ..Default::default()
        },
        |c| c.disable_seal_for_negative_control(),
    )
    .await;
    let a = payout("p-unsealed", "acct-unsealed", 10, "worker-a");
    let asked = inquiry(&a.payout_id, "acct-unsealed", 11, "worker-b");
    assert!(matches!(
        rig.client.inquire(&asked).await,
        Err(ProxyError::NotFound { .. })
    ));
    assert!(matches!(
        rig.client.submit(&a).await,
        Err(ProxyError::FencedOut {
            presented: 10,
            stored: 11,
            ..
        })
    ));
    let late = payout("p-unsealed", "acct-unsealed", 11, "worker-b");
    let sent = rig.client.submit(&late).await.unwrap();
    assert!(matches!(sent.outcome, Outcome::Acked { .. }), "{sent:?}");
    assert_eq!(
        at_rail(&rig, &a).await,
        (1, 1),
        "without the seal the late submit moves money"
    );
}

/// The proxy paused between the intent and the send for longer than its rail timeout: while the
/// instruction is still valid an inquiry answers UNKNOWN (never ABSENT), and the late send is
/// refused by the rail as EXPIRED, so no movement can follow a concluded absence.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_send_delayed_past_valid_until_is_refused_and_absent_waits_for_expiry() {
    const PAUSE_MS: u64 = 2_500;
    let mut rig = rig_with(
        StubConfig {
            settlement_window: Duration::from_millis(100),
            ..Default::default()
        },
        |c| {
            c.with_failpoint(Some(rail_proxy::Failpoint::PauseAfterIntent {
                ms: PAUSE_MS,
            }))
        },
    )
    .await;
    let request = payout("p-expiry", "acct-expiry", 5, "worker-1");
    let mut submitter = rig.client.clone();
    let submitted = {
        let request = request.clone();
        tokio::spawn(async move { submitter.submit(&request).await })
    };
    let record = testkit::eventually(WAIT, "the intent", || {
        let (mut client, payout_id) = (rig.client.clone(), request.payout_id.clone());
        async move { client.lookup(&payout_id).await.unwrap() }
    })
    .await
    .unwrap();
    let valid_until = record
        .submission
        .valid_until_unix_ms
        .expect("every intent carries its expiry");
    assert_eq!(
        valid_until - record.submission.created_at_unix_ms,
        TEST_RAIL_TIMEOUT_MS as i64,
        "valid for the proxy's rail timeout from the intent"
    );
    // The rail has seen nothing and its settlement window is long past: it says "absent". The
    // instruction is still valid, so the proxy does not believe it yet.
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        rig.stub
            .client()
            .lookup(request.client_reference.as_str())
            .await
            .unwrap()
            .state,
        "absent"
    );
    let early = rig
        .client
        .inquire(&inquiry_of(&request, "worker-2"))
        .await
        .unwrap();
    assert!(
        matches!(&early.resolution.evidence, Evidence::Unknown { detail } if detail.contains("valid at the rail until")),
        "{early:?}"
    );
    // The paused send goes out after valid_until: the rail refuses it, nothing moves.
    let outcome = submitted.await.unwrap().unwrap().outcome;
    assert_eq!(
        outcome,
        Outcome::Rejected {
            decline_code: rail_stub::EXPIRED_DECLINE_CODE.into()
        }
    );
    let truth = rig.stub.client().ground_truth().await.unwrap();
    assert_eq!(
        truth.movement_counts.get(request.client_reference.as_str()),
        None
    );
    assert_eq!(
        truth.expired_request_counts[request.client_reference.as_str()],
        1
    );
    // After the expiry (and the clock margin), the rail's absence is definitive.
    let asked = inquiry_of(&request, "worker-2");
    testkit::eventually(WAIT, "an authoritative ABSENT", || {
        let (mut client, asked) = (rig.client.clone(), asked.clone());
        async move {
            (client.inquire(&asked).await.unwrap().resolution.evidence == Evidence::Absent)
                .then_some(())
        }
    })
    .await
    .unwrap();
}

/// The negative control of the expiry: the same pause without `valid_until`. The proxy takes the
/// rail's ABSENT at its word while the send is still pending, and the late send then moves money
/// for a payout already concluded absent.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn negative_control_without_expiry_a_paused_send_moves_money_after_absent() {
    const PAUSE_MS: u64 = 2_500;
    let mut rig = rig_with(
        StubConfig {
            settlement_window: Duration::from_millis(100),
            ..Default::default()
        },
        |c| {
            c.with_failpoint(Some(rail_proxy::Failpoint::PauseAfterIntent {
                ms: PAUSE_MS,
            }))
            .disable_instruction_expiry_for_negative_control()
        },
    )
    .await;
    let request = payout("p-no-expiry", "acct-no-expiry", 5, "worker-1");
    let mut submitter = rig.client.clone();
    let submitted = {
        let request = request.clone();
        tokio::spawn(async move { submitter.submit(&request).await })
    };
    testkit::eventually(WAIT, "the intent", || {
        let (mut client, payout_id) = (rig.client.clone(), request.payout_id.clone());
        async move { client.lookup(&payout_id).await.unwrap() }
    })
    .await
    .unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let concluded = rig
        .client
        .inquire(&inquiry_of(&request, "worker-2"))
        .await
        .unwrap();
    assert_eq!(concluded.resolution.evidence, Evidence::Absent);
    let outcome = submitted.await.unwrap().unwrap().outcome;
    assert!(matches!(outcome, Outcome::Acked { .. }), "{outcome:?}");
    assert_eq!(
        at_rail(&rig, &request).await,
        (1, 1),
        "money moved after ABSENT"
    );
}

// ---------------------------------------------------------------------------------------------
// Signed grants (issue 17): a token the lock service never signed, or signed for another key,
// is refused before the high-water statement.

/// The sum of a counter's series whose labels include the given ones, e.g.
/// `forged_grants_total{guard="rail_proxy",reason="unsigned"}` (over every `operation`);
/// 0 if there is none.
fn counted(rig: &Rig, series: &str) -> u64 {
    fn split(series: &str) -> (&str, Vec<&str>) {
        match series.split_once('{') {
            Some((name, labels)) => (
                name,
                labels
                    .trim_end_matches('}')
                    .split(',')
                    .filter(|l| !l.is_empty())
                    .collect(),
            ),
            None => (series, Vec::new()),
        }
    }
    let (name, wanted) = split(series);
    rig.proxy
        .metrics
        .render()
        .lines()
        .filter_map(|l| l.rsplit_once(' '))
        .filter(|(s, _)| {
            let (n, labels) = split(s);
            n == name && wanted.iter().all(|w| labels.contains(w))
        })
        .map(|(_, v)| v.parse::<u64>().unwrap())
        .sum()
}

/// (high-water, its owner) of an account at the proxy.
async fn high_water(pool: &sqlx::PgPool, account: &str) -> (i64, String) {
    sqlx::query_as("SELECT high_water, owner FROM account_high_water WHERE account_id = $1")
        .bind(account)
        .fetch_one(pool)
        .await
        .unwrap()
}

/// Payment requests the stub has received in all.
async fn requests_at_rail(rig: &Rig) -> u64 {
    rig.stub
        .client()
        .ground_truth()
        .await
        .unwrap()
        .submit_requests_total
}

/// Fabricated tokens: i64::MAX unsigned, i64::MAX signed by a key the proxy does not know, the
/// real holder's genuine signature presented with another token, another account's genuine
/// grant relabelled as this account's key, and a key of its own under the known key id. Each is
/// refused as `forged_grant` (PERMISSION_DENIED) on Submit and on Inquire: nothing reaches the
/// rail, no submission or seal is written, the high-water is unchanged, and only the refusal's
/// guard event (FORGED_GRANT, with its reason) and counter are written. The real holder is not
/// fenced out afterwards.
/// Negative control: `negative_control_without_grant_verification_a_fabricated_token_fences_out_the_real_holder`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_fabricated_token_is_refused_as_a_forged_grant_and_changes_nothing() {
    const ACCOUNT: &str = "acct-forge";
    const KEY: &str = "payout:acct-forge";
    let mut rig = rig().await;
    let real = payout("p-forge-real", ACCOUNT, 5, "worker-real");
    assert!(matches!(
        rig.client.submit(&real).await.unwrap().outcome,
        Outcome::Acked { .. }
    ));
    let max = i64::MAX as u64;
    let (rogue, _) = Signer::generate("rogue-1").unwrap();
    let (impostor, _) = Signer::generate("proxy-test-1").unwrap();
    // (what, token, owner, signed key, signature, reason)
    let forgeries: Vec<(&str, u64, &str, &str, Signature, &str)> = vec![
        (
            "i64::MAX, unsigned",
            max,
            "mallory",
            KEY,
            Signature::default(),
            "unsigned",
        ),
        (
            "i64::MAX signed by a key the proxy does not know",
            max,
            "mallory",
            KEY,
            rogue.sign(KEY, max, "mallory"),
            "unknown_key_id",
        ),
        (
            "the real holder's genuine signature with another token",
            max,
            "worker-real",
            KEY,
            sign(KEY, 5, "worker-real"),
            "bad_signature",
        ),
        (
            "another account's genuine grant relabelled as this account's key",
            900,
            "worker-other",
            KEY,
            sign("payout:acct-other", 900, "worker-other"),
            "bad_signature",
        ),
        (
            "a key of its own under the known key id",
            max,
            "mallory",
            KEY,
            impostor.sign(KEY, max, "mallory"),
            "bad_signature",
        ),
    ];
    let mut refused = 0;
    for (i, (what, token, owner, key, signature, reason)) in forgeries.into_iter().enumerate() {
        let submit = unsigned_payout(&format!("p-forge-{i}"), ACCOUNT, token, owner)
            .signed(key, signature.clone());
        let asked = unsigned_inquiry(
            &PayoutId::parse(format!("p-forge-inq-{i}")).unwrap(),
            ACCOUNT,
            token,
            owner,
        )
        .signed(key, signature.clone());
        for operation in ["submit", "inquire"] {
            let (answer, payout_id) = if operation == "submit" {
                (
                    rig.client.submit(&submit).await.map(drop),
                    &submit.payout_id,
                )
            } else {
                (rig.client.inquire(&asked).await.map(drop), &asked.payout_id)
            };
            match answer {
                Err(ProxyError::ForgedGrant {
                    key: k,
                    presented,
                    owner: o,
                    signing_key_id,
                    reason: r,
                    payout_id: p,
                }) => assert_eq!(
                    (
                        k.as_str(),
                        presented,
                        o.as_str(),
                        signing_key_id.as_str(),
                        r.as_str(),
                        p.as_str()
                    ),
                    (
                        key,
                        token,
                        owner,
                        signature.key_id.as_str(),
                        reason,
                        payout_id.as_str()
                    ),
                    "{what} ({operation})"
                ),
                other => panic!("{what} ({operation}): expected ForgedGrant, got {other:?}"),
            }
            refused += 1;
            let recorded: (String, String, Option<String>, String, i64, i64, String) =
                sqlx::query_as(
                    "SELECT kind, operation, forged_reason, signed_key, presented, stored, stored_owner \
                     FROM guard_event ORDER BY id DESC LIMIT 1",
                )
                .fetch_one(&rig.pool)
                .await
                .unwrap();
            assert_eq!(
                recorded,
                (
                    "FORGED_GRANT".to_string(),
                    operation.to_uppercase(),
                    Some(reason.to_uppercase()),
                    key.to_string(),
                    token as i64,
                    5,
                    "worker-real".to_string()
                ),
                "{what} ({operation})"
            );
        }
        // Nothing sent, nothing submitted or sealed, the high-water unchanged.
        assert_eq!(
            requests_at_rail(&rig).await,
            1,
            "{what}: only the real holder's payment"
        );
        assert_eq!(at_rail(&rig, &submit).await, (0, 0), "{what}");
        assert_eq!(
            count(
                &rig.pool,
                "SELECT count(*) FROM rail_submission WHERE account_id = 'acct-forge'"
            )
            .await,
            1,
            "{what}: no submission, no seal"
        );
        assert_eq!(
            high_water(&rig.pool, ACCOUNT).await,
            (5, "worker-real".to_string()),
            "{what}"
        );
        assert_eq!(
            count(&rig.pool, "SELECT count(*) FROM resolution").await,
            0,
            "{what}: no evidence recorded"
        );
    }
    assert_eq!(
        count(&rig.pool, "SELECT count(*) FROM guard_event").await,
        refused,
        "each refusal wrote its one guard event, and nothing else was refused"
    );
    for (reason, n) in [("unsigned", 2), ("unknown_key_id", 2), ("bad_signature", 6)] {
        assert_eq!(
            counted(
                &rig,
                &format!("forged_grants_total{{guard=\"rail_proxy\",reason=\"{reason}\"}}")
            ),
            n,
            "{reason}"
        );
    }
    // On the wire: PERMISSION_DENIED with the typed rejection.
    let unsigned = unsigned_payout("p-forge-raw", ACCOUNT, max, "mallory");
    let status = rig
        .client
        .raw()
        .submit(rail_proxy_client::wire::submit_request(&unsigned))
        .await
        .unwrap_err();
    assert_eq!(status.code(), tonic::Code::PermissionDenied);
    assert!(matches!(
        service_kit::rejection::decode::<pb::Rejection>(&status).and_then(|r| r.kind),
        Some(pb::rejection::Kind::ForgedGrant(pb::ForgedGrant { reason, .. })) if reason == "unsigned"
    ));
    // The real holder is not fenced out: its next payout goes through, and its inquiry too.
    let next = payout("p-forge-real-2", ACCOUNT, 5, "worker-real");
    assert!(matches!(
        rig.client.submit(&next).await.unwrap().outcome,
        Outcome::Acked { .. }
    ));
    rig.client
        .inquire(&inquiry_of(&next, "worker-real"))
        .await
        .unwrap();
}

/// The negative control of the grant signature: the same fabricated token with the check
/// switched off in-process. The unsigned i64::MAX Submit is accepted and moves money, the
/// account's high-water becomes i64::MAX, and the real holder is fenced out for ever; a forged
/// Inquire seals a payout it never held.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn negative_control_without_grant_verification_a_fabricated_token_fences_out_the_real_holder()
{
    const ACCOUNT: &str = "acct-forge-nc";
    let mut rig = rig_with(
        StubConfig {
            settlement_window: Duration::from_millis(1_500),
            ..Default::default()
        },
        |c| c.disable_grant_verification_for_negative_control(),
    )
    .await;
    let max = i64::MAX as u64;
    let real = payout("p-forge-nc-real", ACCOUNT, 5, "worker-real");
    rig.client.submit(&real).await.unwrap();
    // With an instruction for exactly it: the grant check alone is switched off here.
    let forged = instructed(unsigned_payout("p-forge-nc", ACCOUNT, max, "mallory"));
    let sent = rig.client.submit(&forged).await.unwrap();
    assert!(matches!(sent.outcome, Outcome::Acked { .. }), "{sent:?}");
    assert_eq!(
        at_rail(&rig, &forged).await,
        (1, 1),
        "without the check the forged Submit moves money"
    );
    assert_eq!(
        high_water(&rig.pool, ACCOUNT).await,
        (i64::MAX, "mallory".to_string())
    );
    match rig
        .client
        .submit(&payout("p-forge-nc-real-2", ACCOUNT, 5, "worker-real"))
        .await
    {
        Err(ProxyError::FencedOut {
            presented: 5,
            stored,
            stored_owner,
            ..
        }) => assert_eq!((stored, stored_owner.as_str()), (max, "mallory")),
        other => panic!("expected the real holder fenced out, got {other:?}"),
    }
    let sealed = rig
        .client
        .inquire(&unsigned_inquiry(
            &PayoutId::parse("p-forge-nc-sealed").unwrap(),
            ACCOUNT,
            max,
            "mallory",
        ))
        .await
        .unwrap();
    assert_eq!(sealed.resolution.evidence, Evidence::NeverSent);
    assert_eq!(
        count(
            &rig.pool,
            "SELECT count(*) FROM guard_event WHERE kind = 'FORGED_GRANT'"
        )
        .await,
        0
    );
}

/// Tokens are global across keys (etcd revisions), so account A's genuine grant carries a token
/// that may be above account B's high-water. Presented on B's Submit or Inquire it is refused as
/// `grant_for_another_key` (PERMISSION_DENIED): nothing sent, nothing submitted or sealed, B's
/// high-water unchanged, one GRANT_FOR_ANOTHER_KEY guard event each. The same grant relabelled
/// as B's key is forged. B's own holder is not fenced out.
/// Negative control: `negative_control_without_the_key_binding_a_grant_of_account_a_fences_account_b`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_genuine_grant_of_another_account_is_refused_as_grant_for_another_key() {
    let mut rig = rig().await;
    let b = payout("p-key-b-1", "acct-key-b", 5, "worker-b");
    rig.client.submit(&b).await.unwrap();
    // A's grant is genuine: A's own writes pass with it.
    let a = payout("p-key-a-1", "acct-key-a", 9, "worker-a");
    rig.client.submit(&a).await.unwrap();
    let a_grant = sign("payout:acct-key-a", 9, "worker-a");
    let cross = unsigned_payout("p-key-b-2", "acct-key-b", 9, "worker-a")
        .signed("payout:acct-key-a", a_grant.clone());
    let cross_inquiry = unsigned_inquiry(&b.payout_id, "acct-key-b", 9, "worker-a")
        .signed("payout:acct-key-a", a_grant.clone());
    let answers = [
        rig.client.submit(&cross).await.map(drop),
        rig.client.inquire(&cross_inquiry).await.map(drop),
    ];
    for (answer, payout_id) in answers.into_iter().zip(["p-key-b-2", "p-key-b-1"]) {
        match answer {
            Err(ProxyError::GrantForAnotherKey {
                presented_key,
                required_key,
                presented,
                owner,
                payout_id: p,
            }) => assert_eq!(
                (
                    presented_key.as_str(),
                    required_key.as_str(),
                    presented,
                    owner.as_str(),
                    p.as_str()
                ),
                (
                    "payout:acct-key-a",
                    "payout:acct-key-b",
                    9,
                    "worker-a",
                    payout_id
                )
            ),
            other => panic!("{payout_id}: expected GrantForAnotherKey, got {other:?}"),
        }
    }
    assert_eq!(at_rail(&rig, &cross).await, (0, 0), "nothing sent");
    assert_eq!(requests_at_rail(&rig).await, 2, "only B's and A's own");
    assert_eq!(
        count(
            &rig.pool,
            "SELECT count(*) FROM rail_submission WHERE account_id = 'acct-key-b'"
        )
        .await,
        1
    );
    assert_eq!(count(&rig.pool, "SELECT count(*) FROM resolution").await, 0);
    assert_eq!(
        high_water(&rig.pool, "acct-key-b").await,
        (5, "worker-b".to_string())
    );
    assert_eq!(
        count(
            &rig.pool,
            "SELECT count(*) FROM guard_event WHERE kind = 'GRANT_FOR_ANOTHER_KEY' \
             AND lock_key = 'payout:acct-key-b' AND signed_key = 'payout:acct-key-a' \
             AND signing_key_id = 'proxy-test-1' AND presented = 9 AND stored = 5"
        )
        .await,
        2
    );
    assert_eq!(
        counted(&rig, "grants_for_another_key_total{guard=\"rail_proxy\"}"),
        2
    );
    // Relabelled as B's key, A's signature no longer matches: forged.
    let relabelled = unsigned_payout("p-key-b-2", "acct-key-b", 9, "worker-a")
        .signed("payout:acct-key-b", a_grant);
    assert!(matches!(
        rig.client.submit(&relabelled).await,
        Err(ProxyError::ForgedGrant { reason, .. }) if reason == "bad_signature"
    ));
    // B's holder is not fenced out.
    let b_next = payout("p-key-b-3", "acct-key-b", 5, "worker-b");
    assert!(matches!(
        rig.client.submit(&b_next).await.unwrap().outcome,
        Outcome::Acked { .. }
    ));
}

/// The negative control of the key binding: with it switched off in-process, account A's genuine
/// grant is accepted on account B's Submit, moves money, and fences B's own holder out.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn negative_control_without_the_key_binding_a_grant_of_account_a_fences_account_b() {
    let mut rig = rig_with(
        StubConfig {
            settlement_window: Duration::from_millis(1_500),
            ..Default::default()
        },
        |c| c.disable_grant_key_binding_for_negative_control(),
    )
    .await;
    rig.client
        .submit(&payout("p-nk-b-1", "acct-nk-b", 5, "worker-b"))
        .await
        .unwrap();
    let cross = instructed(
        unsigned_payout("p-nk-b-2", "acct-nk-b", 9, "worker-a")
            .signed("payout:acct-nk-a", sign("payout:acct-nk-a", 9, "worker-a")),
    );
    let sent = rig.client.submit(&cross).await.unwrap();
    assert!(matches!(sent.outcome, Outcome::Acked { .. }), "{sent:?}");
    assert_eq!(
        at_rail(&rig, &cross).await,
        (1, 1),
        "without the binding A's grant moves B's money"
    );
    match rig
        .client
        .submit(&payout("p-nk-b-3", "acct-nk-b", 5, "worker-b"))
        .await
    {
        Err(ProxyError::FencedOut {
            presented: 5,
            stored: 9,
            stored_owner,
            ..
        }) => assert_eq!(stored_owner, "worker-a"),
        other => panic!("expected B's holder fenced out, got {other:?}"),
    }
}

/// The shipped binary has no unsigned mode: without `--grant-verify-keys` (or `GRANT_VERIFY_KEYS`),
/// or with a value that is not a public key list, it refuses to start with a message naming what
/// is wrong, before it touches any database.
#[test]
fn the_binary_will_not_start_without_valid_grant_verify_keys() {
    let bin = env!("CARGO_BIN_EXE_rail-proxy");
    let cases: [(&[&str], &str); 4] = [
        (&[], "--grant-verify-keys"),
        (
            &["--grant-verify-keys", ""],
            "no grant verification key given",
        ),
        (
            &["--grant-verify-keys", "k1=zz"],
            "expected `key_id=<64 hex digits>`",
        ),
        (
            &["--grant-verify-keys", "bad id=00"],
            "must be 1..=64 characters",
        ),
    ];
    for (args, expected) in cases {
        let out = std::process::Command::new(bin)
            .args(["--database-url", "postgres://nobody@127.0.0.1:1/none"])
            .args(["--rail-url", "https://127.0.0.1:1"])
            .args(UNREAD_RAIL_TLS)
            .args(args)
            .env_remove("GRANT_VERIFY_KEYS")
            .env_remove("INSTRUCTION_VERIFY_KEYS")
            .env_remove("RAIL_FACT_SIGNING_KEY_ID")
            .env_remove("RAIL_FACT_SIGNING_KEY_FILE")
            .env_remove("RAIL_ANSWER_VERIFY_KEYS")
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} started");
        assert_eq!(
            out.status.code(),
            Some(2),
            "{args:?}: a usage error: {stderr}"
        );
        assert!(stderr.contains(expected), "{args:?}: {stderr}");
    }
}

/// The shipped proxy's binary, with a server certificate named `name` and an empty denylist: the
/// start-up flags a test does not look at.
fn proxy_binary(name: &str) -> std::process::Command {
    let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_rail-proxy"));
    command
        .args(
            testkit::pki::shared()
                .issue(Role::RailProxy, name)
                .unwrap()
                .to_args(),
        )
        .env("PAYOUT_TLS_DENYLIST", testkit::pki::empty_denylist());
    command
}

/// The rail link's TLS flags where a test's start fails before they are read.
const UNREAD_RAIL_TLS: [&str; 6] = [
    "--rail-ca",
    "/nonexistent/rail-ca.pem",
    "--rail-client-cert",
    "/nonexistent/rail-proxy.pem",
    "--rail-client-key",
    "/nonexistent/rail-proxy.key",
];

/// Nor an unsigned mode for instructions, rail facts or the rail's answers (issues 33, 34): with
/// valid grant keys, a missing instruction key list, rail-fact signing key or rail answer key list
/// is a usage error naming the flag, a malformed answer key list names itself, and an unreadable
/// key file stops the start naming the file, before any database is touched.
#[test]
fn the_binary_will_not_start_without_its_instruction_and_rail_fact_keys() {
    let grants = SIGNER.public_key().to_string();
    let instructions = INSTRUCTION_SIGNER.public_key().to_string();
    let dir = tempfile::tempdir().unwrap();
    let missing_file = dir.path().join("absent.key");
    let missing_file = missing_file.to_str().unwrap();
    let rail_answers = Signer::generate("rail-1")
        .unwrap()
        .0
        .public_key()
        .to_string();
    let all_but_rail_answers = [
        "--instruction-verify-keys",
        &instructions,
        "--rail-fact-signing-key-id",
        "k",
        "--rail-fact-signing-key-file",
        missing_file,
    ];
    let no_rail_answers = all_but_rail_answers.to_vec();
    let mut bad_rail_answers = all_but_rail_answers.to_vec();
    bad_rail_answers.extend(["--rail-answer-verify-keys", "rail-1=00"]);
    let cases: [(Vec<&str>, &str, i32); 5] = [
        (no_rail_answers, "--rail-answer-verify-keys", 2),
        (bad_rail_answers, "rail-1=00", 2),
        (
            vec![
                "--rail-fact-signing-key-id",
                "k",
                "--rail-fact-signing-key-file",
                missing_file,
            ],
            "--instruction-verify-keys",
            2,
        ),
        (
            vec!["--instruction-verify-keys", &instructions],
            "--rail-fact-signing-key-id",
            2,
        ),
        (
            vec![
                "--instruction-verify-keys",
                &instructions,
                "--rail-fact-signing-key-id",
                "k",
                "--rail-fact-signing-key-file",
                missing_file,
            ],
            "reading the rail-fact signing key",
            1,
        ),
    ];
    for (args, expected, code) in cases {
        let answer_keys = if args.contains(&"--rail-answer-verify-keys")
            || expected == "--rail-answer-verify-keys"
        {
            vec![]
        } else {
            vec!["--rail-answer-verify-keys", rail_answers.as_str()]
        };
        let out = proxy_binary("rail-proxy-keys")
            .args(["--database-url", "postgres://nobody@127.0.0.1:1/none"])
            .args(["--rail-url", "https://127.0.0.1:1"])
            .args(UNREAD_RAIL_TLS)
            .args(["--grant-verify-keys", &grants])
            .args(&answer_keys)
            .args(&args)
            .env_remove("INSTRUCTION_VERIFY_KEYS")
            .env_remove("RAIL_FACT_SIGNING_KEY_ID")
            .env_remove("RAIL_FACT_SIGNING_KEY_FILE")
            .env_remove("RAIL_ANSWER_VERIFY_KEYS")
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(code), "{args:?}: {stderr}");
        assert!(stderr.contains(expected), "{args:?}: {stderr}");
    }
}

// ---------------------------------------------------------------------------------------------
// The boundary under arbitrary wire values (issue 14, item 4)

/// The proxydb tables a call may write.
const PROXYDB_TABLES: [&str; 5] = [
    "account_high_water",
    "rail_submission",
    "guard_event",
    "resolution",
    "instruction_refusal",
];

/// One call of `railproxy.v1.RailProxy`, with whatever field values.
#[derive(Debug, Clone)]
enum ProxyCall {
    Submit(Box<pb::SubmitRequest>),
    Lookup(pb::LookupRequest),
    Inquire(pb::InquireRequest),
}

/// The grant a call presents beside its token and owner.
#[derive(Debug, Clone)]
enum GrantChoice {
    /// The lock service's signature over the account's own key, the token and the owner.
    Genuine,
    /// No signature at all (the account's key).
    Unsigned,
    /// A genuine signature of another account's key, presented as it is.
    OtherAccount,
    /// Whatever key, key id and bytes.
    Arbitrary {
        key: String,
        key_id: String,
        bytes: Vec<u8>,
    },
}

impl GrantChoice {
    /// (key, signing key id, signature bytes) as the wire carries them.
    fn present(&self, account_id: &str, token: u64, owner: &str) -> (String, String, Vec<u8>) {
        let own_key = format!("payout:{account_id}");
        match self {
            Self::Genuine => {
                let s = sign(&own_key, token, owner);
                (own_key, s.key_id, s.bytes)
            }
            Self::Unsigned => (own_key, String::new(), Vec::new()),
            Self::OtherAccount => {
                let key = "payout:acct-elsewhere".to_string();
                let s = sign(&key, token, owner);
                (key, s.key_id, s.bytes)
            }
            Self::Arbitrary { key, key_id, bytes } => (key.clone(), key_id.clone(), bytes.clone()),
        }
    }
}

fn grant_choice() -> impl proptest::strategy::Strategy<Value = GrantChoice> {
    use proptest::prelude::*;
    use testkit::wire::hostile_text;
    let arbitrary = (
        hostile_text(
            "payout:acct-[a-z]{1,4}".boxed(),
            rail_proxy_client::KEY_LENGTH_MAX,
        ),
        hostile_text(
            prop::sample::select(vec!["proxy-test-1", "rogue-1"])
                .prop_map(String::from)
                .boxed(),
            grant_signing::KEY_ID_LENGTH_MAX,
        ),
        prop::collection::vec(any::<u8>(), 0..80),
    )
        .prop_map(|(key, key_id, bytes)| GrantChoice::Arbitrary { key, key_id, bytes });
    prop_oneof![
        5 => Just(GrantChoice::Genuine),
        1 => Just(GrantChoice::Unsigned),
        1 => Just(GrantChoice::OtherAccount),
        1 => arbitrary,
    ]
}

fn proxy_call() -> impl proptest::strategy::Strategy<Value = ProxyCall> {
    use proptest::prelude::*;
    use testkit::wire::{hostile_i64, hostile_text, hostile_u64};
    const ID_LENGTH_MAX: usize = payout_domain::ids::ID_LENGTH_MAX;
    let id = |known: &'static str, fresh: &'static str| {
        hostile_text(
            prop_oneof![3 => Just(known.to_string()), 1 => fresh.prop_map(String::from)].boxed(),
            ID_LENGTH_MAX,
        )
    };
    let payout_id = id("p-w-sent", "p-n[a-z0-9]{1,8}");
    let account_id = id("acct-w", "acct-n[a-z0-9]{1,6}");
    let token = hostile_u64((1u64..50).boxed());
    let holder = hostile_text(
        "worker-[a-z]{1,6}".boxed(),
        rail_proxy_client::model::OWNER_LENGTH_MAX,
    );
    // Mostly the reference derived from the payout id, as every honest caller sends it (a
    // `Some` is an arbitrary one instead).
    let client_reference =
        prop::option::weighted(0.15, hostile_text("cref-[a-z-]{1,8}".boxed(), 70));
    let currency = hostile_text(
        prop::sample::select(vec!["EUR", "EUR", "EUR", "USD", "XXX"])
            .prop_map(String::from)
            .boxed(),
        3,
    );
    let submit = (
        (
            payout_id.clone(),
            account_id.clone(),
            token.clone(),
            holder.clone(),
        ),
        client_reference,
        hostile_i64((1i64..100_000).boxed()),
        currency,
        hostile_text("ben-[a-z0-9]{1,6}".boxed(), ID_LENGTH_MAX),
        grant_choice(),
    )
        .prop_map(
            |(
                (payout_id, account_id, token, owner),
                client_reference,
                amount_minor,
                currency,
                beneficiary_ref,
                grant,
            )| {
                let (key, signing_key_id, signature) = grant.present(&account_id, token, &owner);
                let mut request = pb::SubmitRequest {
                    client_reference: client_reference
                        .unwrap_or_else(|| format!("cref-{payout_id}")),
                    payout_id,
                    account_id,
                    token,
                    owner,
                    amount_minor,
                    currency,
                    beneficiary_ref,
                    key,
                    signing_key_id,
                    signature,
                    instruction: None,
                };
                // The payment resource's instruction over whatever the request says, so that the
                // boundary behind the instruction check is still reached.
                request.instruction = Some(wire_instruction(&request));
                ProxyCall::Submit(Box::new(request))
            },
        );
    let lookup = payout_id
        .clone()
        .prop_map(|payout_id| ProxyCall::Lookup(pb::LookupRequest { payout_id }));
    let inquire = (
        payout_id,
        holder.clone(),
        account_id,
        token,
        holder,
        grant_choice(),
    )
        .prop_map(|(payout_id, asked_by, account_id, token, owner, grant)| {
            let (key, signing_key_id, signature) = grant.present(&account_id, token, &owner);
            ProxyCall::Inquire(pb::InquireRequest {
                payout_id,
                asked_by,
                account_id,
                token,
                owner,
                key,
                signing_key_id,
                signature,
            })
        });
    prop_oneof![3 => submit, 1 => lookup, 2 => inquire]
}

/// Arbitrary field values through the real client to the real proxy on proxydb (and the real
/// rail stub behind it). For every case: no panic anywhere in the process; the answer is OK or a
/// status carrying a decodable typed `Rejection` (INVALID_ARGUMENT names its field); an
/// INVALID_ARGUMENT or NOT_FOUND refusal changed no row of any table (counts and contents), and
/// reached the rail not at all; a fenced-out refusal (FAILED_PRECONDITION) and a refused grant
/// (PERMISSION_DENIED: forged, or of another key) wrote only their one `guard_event`; a duplicate (ALREADY_EXISTS) wrote only its one `guard_event` beside the
/// high-water its token advanced, and no submission or resolution; and the proxy still reports
/// SERVING and answers a valid call.
#[test]
fn wire_values_never_panic_and_refusals_are_typed_and_write_nothing() {
    use pb::rejection::Kind;
    use proptest::prelude::*;
    use testkit::wire;
    const CASES: u32 = 96;
    let runtime = wire::runtime();
    let rig = runtime.block_on(async {
        let mut rig = rig().await;
        rig.client
            .submit(&payout("p-w-sent", "acct-w", 5, "worker-w"))
            .await
            .expect("seeded submission");
        rig
    });
    let requests_at_rail = || async {
        let truth = rig.stub.client().ground_truth().await;
        truth.expect("the stub answers").submit_requests_total
    };
    wire::run_cases(&runtime, CASES, proxy_call(), |call| {
        let (rig, requests_at_rail) = (&rig, &requests_at_rail);
        async move {
            let rail_before = requests_at_rail().await;
            let mut client = rig.client.clone();
            let raw = client.raw();
            let send = async {
                match call {
                    ProxyCall::Submit(r) => raw.submit(*r).await.map(drop),
                    ProxyCall::Lookup(r) => raw.lookup(r).await.map(drop),
                    ProxyCall::Inquire(r) => raw.inquire(r).await.map(drop),
                }
            };
            let wire::Observed {
                answer,
                before,
                after,
            } = wire::observe(&rig.pool, &PROXYDB_TABLES, send).await?;
            if let Err(status) = answer {
                let kind =
                    service_kit::rejection::decode::<pb::Rejection>(&status).and_then(|r| r.kind);
                prop_assert!(
                    kind.is_some(),
                    "untyped refusal {:?}: {}",
                    status.code(),
                    status.message()
                );
                prop_assert_eq!(
                    requests_at_rail().await,
                    rail_before,
                    "a refused call reached the rail"
                );
                let changed = before.changed(&after);
                match status.code() {
                    tonic::Code::InvalidArgument => {
                        prop_assert!(
                            matches!(&kind, Some(Kind::InvalidArgument(i)) if !i.field.is_empty()),
                            "{kind:?}"
                        );
                        prop_assert_eq!(changed, Vec::<String>::new());
                    }
                    tonic::Code::NotFound => prop_assert_eq!(changed, Vec::<String>::new()),
                    tonic::Code::FailedPrecondition => {
                        prop_assert!(matches!(kind, Some(Kind::FencedOut(_))), "{kind:?}");
                        prop_assert_eq!(changed, vec!["guard_event".to_string()]);
                        prop_assert_eq!(before.rows_added(&after, "guard_event"), 1);
                    }
                    tonic::Code::PermissionDenied
                        if matches!(kind, Some(Kind::InstructionRefused(_))) =>
                    {
                        prop_assert_eq!(changed, vec!["instruction_refusal".to_string()]);
                        prop_assert_eq!(before.rows_added(&after, "instruction_refusal"), 1);
                    }
                    tonic::Code::PermissionDenied => {
                        prop_assert!(
                            matches!(
                                kind,
                                Some(Kind::ForgedGrant(_) | Kind::GrantForAnotherKey(_))
                            ),
                            "{kind:?}"
                        );
                        prop_assert_eq!(changed, vec!["guard_event".to_string()]);
                        prop_assert_eq!(before.rows_added(&after, "guard_event"), 1);
                    }
                    tonic::Code::AlreadyExists => {
                        prop_assert!(matches!(kind, Some(Kind::Duplicate(_))), "{kind:?}");
                        prop_assert!(
                            !changed
                                .iter()
                                .any(|t| t == "rail_submission" || t == "resolution"),
                            "{changed:?}"
                        );
                        prop_assert_eq!(before.rows_added(&after, "guard_event"), 1);
                    }
                    other => prop_assert!(false, "unexpected code {other:?}: {}", status.message()),
                }
            }
            let mut client = rig.client.clone();
            let valid = client.raw().lookup(pb::LookupRequest {
                payout_id: "p-w-sent".into(),
            });
            wire::still_serving(
                &rig.proxy.endpoint(),
                rail_proxy::SERVICE_NAME,
                testkit::pki::Role::RailProxy,
                valid,
            )
            .await
        }
    });
}

// ----- the high-water survives a restore of proxydb (issue 19, section 3; migration 0006) -----

/// p-r-1 paid under token 10; proxydb dumped; p-r-2 paid under the successor's 20; proxydb
/// restored from the dump (real `pg_dump` / `pg_restore --clean`): the high-water is back at 10
/// and p-r-2's submission is gone from the record, though the rail paid it.
async fn restored_behind_a_successor(rig: &mut Rig) -> (tempfile::TempDir, SubmitPayout) {
    let first = payout("p-r-1", "acct-r", 10, "worker-a");
    rig.client.submit(&first).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let dump = dir.path().join("proxydb.dump");
    let pg = Stack::shared().pg(PgServer::Proxy);
    pg.dump(testkit::system::database_name(&rig.db_url), &dump)
        .unwrap();
    let second = payout("p-r-2", "acct-r", 20, "worker-b");
    let sent = rig.client.submit(&second).await.unwrap();
    assert!(matches!(sent.outcome, Outcome::Acked { .. }), "{sent:?}");
    assert_eq!(at_rail(rig, &second).await, (1, 1));
    pg.restore_clean(testkit::system::database_name(&rig.db_url), &dump)
        .unwrap();
    assert_eq!(high_water(&rig.pool, "acct-r").await.0, 10, "rewound");
    (dir, second)
}

/// A proxydb restored from a backup rewinds every high-water and loses the submissions made
/// since the backup. The restored copy refuses every fenced call (Submit and Inquire, the stale
/// token and the real holder's alike) as `DatabaseRestored` before the intent: nothing is sent,
/// nothing recorded but a DATABASE_RESTORED guard event, each counted. After the procedure's
/// database half (`rearm_after_restore` to the lock service's horizon, 25) the tokens it passed
/// are fenced out (on an account with no high-water row too: the floor), and a new grant sends.
#[tokio::test]
async fn a_restored_proxydb_refuses_every_fenced_call_until_it_is_rearmed() {
    let mut rig = rig().await;
    let (_dump, second) = restored_behind_a_successor(&mut rig).await;
    let stale = payout("p-r-2", "acct-r", 15, "worker-a");
    for request in [&stale, &second] {
        match rig.client.submit(request).await {
            Err(ProxyError::DatabaseRestored {
                incarnation_current: false,
                presented,
                ..
            }) => assert_eq!(presented, request.token.get()),
            other => panic!("expected DatabaseRestored, got {other:?}"),
        }
    }
    match rig.client.inquire(&inquiry_of(&second, "worker-b")).await {
        Err(ProxyError::DatabaseRestored { .. }) => {}
        other => panic!("expected DatabaseRestored, got {other:?}"),
    }
    assert_eq!(at_rail(&rig, &second).await, (1, 1), "nothing sent again");
    assert_eq!(
        count(
            &rig.pool,
            "SELECT count(*) FROM rail_submission WHERE payout_id = 'p-r-2'"
        )
        .await,
        0,
        "nothing recorded, not even a seal"
    );
    assert_eq!(
        count(
            &rig.pool,
            "SELECT count(*) FROM guard_event WHERE kind = 'DATABASE_RESTORED'"
        )
        .await,
        3
    );
    assert_eq!(
        counted(
            &rig,
            "database_restored_refusals_total{guard=\"rail_proxy\",operation=\"submit\"}"
        ),
        2
    );
    assert_eq!(high_water(&rig.pool, "acct-r").await.0, 10, "unchanged");

    let raised: i64 = sqlx::query_scalar("SELECT rearm_after_restore(25, 'alice', 'restored')")
        .fetch_one(&rig.pool)
        .await
        .unwrap();
    assert_eq!(raised, 1);
    for request in [&stale, &second] {
        match rig.client.submit(request).await {
            Err(ProxyError::FencedOut { stored: 25, .. }) => {}
            other => panic!("expected FencedOut at 25, got {other:?}"),
        }
    }
    // An account without a high-water row: the floor fences a token below the horizon.
    match rig
        .client
        .submit(&payout("p-r-3", "acct-r-new", 12, "worker-a"))
        .await
    {
        Err(ProxyError::FencedOut { stored: 25, .. }) => {}
        other => panic!("expected FencedOut at the floor, got {other:?}"),
    }
    let fresh = payout("p-r-3", "acct-r-new", 26, "worker-c");
    let sent = rig.client.submit(&fresh).await.unwrap();
    assert!(matches!(sent.outcome, Outcome::Acked { .. }), "{sent:?}");
    assert_eq!(at_rail(&rig, &second).await, (1, 1), "p-r-2 paid once");
}

/// NEGATIVE CONTROL of the test above: the same restore against a proxy whose high-water
/// statement does not ask whether proxydb is a restored copy (test-only switch). The submission
/// of p-r-2 is gone from the restored record and the stale token 15 passes the rewound
/// high-water: the rail pays p-r-2 a second time.
#[tokio::test]
async fn negative_control_without_the_restore_check_a_restored_proxydb_pays_twice() {
    let mut rig = rig_with(
        StubConfig {
            settlement_window: Duration::from_millis(1_500),
            ..Default::default()
        },
        |c| c.disable_restore_check_for_negative_control(),
    )
    .await;
    let (_dump, second) = restored_behind_a_successor(&mut rig).await;
    let stale = payout("p-r-2", "acct-r", 15, "worker-a");
    let sent = rig.client.submit(&stale).await.unwrap();
    assert!(matches!(sent.outcome, Outcome::Acked { .. }), "{sent:?}");
    assert_eq!(
        at_rail(&rig, &second).await,
        (2, 2),
        "without the check the restored proxy pays p-r-2 twice"
    );
}

/// What stands on the rail's address in the answer-authentication tests (issue 34, rows 5a, 5b).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum OnTheWay {
    /// An impostor that never reaches the rail: a payment is `accepted` (`rr-forged`), a lookup
    /// `absent`, unsigned.
    Impostor,
    /// Forwards to the rail and changes the genuine answer's body, keeping its signature: an
    /// accept's reference, a lookup's finding.
    ChangesTheBody,
    /// Forwards the first request of each method and keeps its genuine, signed answer; every
    /// later request is answered with that copy and never reaches the rail.
    ReplaysTheFirst,
}

/// A man in the middle between the proxy and `stub`, doing `what`; its URL. It holds what an
/// attacker who took the stub's TLS material would (a certificate of the rail's authority naming
/// the stub, a client certificate of it), but not the stub's answer key.
fn on_the_way(stub: &RunningStub, what: OnTheWay) -> String {
    on_the_way_as(
        stub,
        what,
        &stub.issue(&rail_stub::SERVER_NAMES, "rail-stub"),
    )
}

/// The same, serving TLS with `server` (its certificate, and the authority its clients must
/// chain to).
fn on_the_way_as(stub: &RunningStub, what: OnTheWay, server: &service_kit::grpc::Tls) -> String {
    use axum::response::IntoResponse;
    type Kept = std::sync::Arc<
        std::sync::Mutex<std::collections::HashMap<String, (u16, Option<String>, Vec<u8>)>>,
    >;
    let kept: Kept = Default::default();
    let rail = stub.base_url();
    let http =
        rail_stub::client::http(Duration::from_secs(10), &stub.identity("on-the-way")).unwrap();
    let handler = move |request: axum::extract::Request| {
        let (rail, http, kept) = (rail.clone(), http.clone(), kept.clone());
        async move {
            let (parts, body) = request.into_parts();
            let body = axum::body::to_bytes(body, 1 << 20).await.unwrap();
            let method = parts.method.as_str().to_string();
            let path = parts.uri.path_and_query().unwrap().as_str().to_string();
            let (status, signature, answer) = match what {
                OnTheWay::Impostor if method == "POST" => (
                    200,
                    None,
                    br#"{"status":"accepted","rail_ref":"rr-forged"}"#.to_vec(),
                ),
                OnTheWay::Impostor => (200, None, br#"{"state":"absent","movements":[]}"#.to_vec()),
                OnTheWay::ReplaysTheFirst if kept.lock().unwrap().contains_key(&method) => {
                    kept.lock().unwrap()[&method].clone()
                }
                OnTheWay::ChangesTheBody | OnTheWay::ReplaysTheFirst => {
                    let mut forwarded = http
                        .request(parts.method.clone(), format!("{rail}{path}"))
                        .body(body.to_vec());
                    for name in [
                        "content-type",
                        grant_signing::rail_answer::REQUEST_ID_HEADER,
                    ] {
                        if let Some(v) = parts.headers.get(name) {
                            forwarded = forwarded.header(name, v.as_bytes());
                        }
                    }
                    let answer = forwarded.send().await.unwrap();
                    let status = answer.status().as_u16();
                    let signature = answer
                        .headers()
                        .get(grant_signing::rail_answer::SIGNATURE_HEADER)
                        .map(|v| v.to_str().unwrap().to_string());
                    let mut body = answer.bytes().await.unwrap().to_vec();
                    if what == OnTheWay::ChangesTheBody {
                        body = if method == "POST" {
                            String::from_utf8(body)
                                .unwrap()
                                .replace("\"rr-", "\"rr-forged-")
                                .into_bytes()
                        } else {
                            br#"{"state":"absent","movements":[]}"#.to_vec()
                        };
                    }
                    kept.lock()
                        .unwrap()
                        .insert(method.clone(), (status, signature.clone(), body.clone()));
                    (status, signature, body)
                }
            };
            let mut response = (
                axum::http::StatusCode::from_u16(status).unwrap(),
                [("content-type", "application/json")],
                answer,
            )
                .into_response();
            if let Some(signature) = signature {
                response.headers_mut().insert(
                    grant_signing::rail_answer::SIGNATURE_HEADER,
                    signature.parse().unwrap(),
                );
            }
            response
        }
    };
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let url = format!("https://{}", listener.local_addr().unwrap());
    let listener = rail_stub::tls::TlsListener::new(
        tokio::net::TcpListener::from_std(listener).unwrap(),
        rail_stub::tls::server_config(server).unwrap(),
        rail_stub::tls::Clients::Authority,
    )
    .unwrap();
    tokio::spawn(async move {
        axum::serve(listener, axum::Router::new().fallback(handler))
            .await
            .unwrap()
    });
    url
}

/// `rail_answers_unauthenticated_total{operation,reason}` (registered at 0).
fn unauthenticated_counted(rig: &Rig, operation: &str, reason: &str) -> u64 {
    let series = format!(
        "rail_answers_unauthenticated_total{{operation=\"{operation}\",reason=\"{reason}\"}} "
    );
    rig.proxy
        .metrics
        .render()
        .lines()
        .find_map(|l| l.strip_prefix(&series).map(|v| v.parse().unwrap()))
        .expect("the series is registered at start")
}

/// Row 5a/5b: whatever stands on the rail's address, an answer the rail did not sign for exactly
/// this request is never an ACK, a decline, FOUND or ABSENT: a payment is recorded TIMEOUT
/// (ambiguous: the inquiry decides), a lookup is UNKNOWN, each counted by reason. An impostor's
/// unsigned accept, a genuine answer whose body was changed, a genuine accept replayed for another
/// payment, and an answer signed by another key (a rail impostor running the rail's software).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_answer_the_rail_did_not_sign_for_this_request_is_never_believed() {
    let other_key = std::sync::Arc::new(Signer::generate(rail_stub::TEST_ANSWER_KEY_ID).unwrap().0);
    let cases: [(&str, Option<OnTheWay>, &str); 4] = [
        ("impostor", Some(OnTheWay::Impostor), "unsigned"),
        ("changed", Some(OnTheWay::ChangesTheBody), "bad_signature"),
        ("replayed", Some(OnTheWay::ReplaysTheFirst), "bad_signature"),
        ("foreign-key", None, "unknown_key_id"),
    ];
    for (name, what, reason) in cases {
        // The foreign-key case: the stub signs with a key the proxy does not hold (the proxy is
        // given the key a default stub would have had).
        let stub_config = match what {
            None => StubConfig {
                answer_signer: other_key.clone(),
                ..Default::default()
            },
            Some(_) => StubConfig::default(),
        };
        let expected_key = Signer::generate("rail-expected").unwrap().0;
        let rig = rig_railed(
            stub_config,
            keys(),
            |stub| match what {
                Some(what) => rail_link(stub, on_the_way(stub, what), stub.answer_verifier()),
                None => rail_link(
                    stub,
                    stub.base_url(),
                    Verifier::new([expected_key.public_key()]).unwrap(),
                ),
            },
            |c| c,
        )
        .await;
        // The replay needs a genuine first answer to replay: one payment goes through whole.
        if what == Some(OnTheWay::ReplaysTheFirst) {
            let first = payout(
                &format!("p-{name}-first"),
                &format!("acct-{name}-first"),
                3,
                "worker-1",
            );
            let sent = rig.client.clone().submit(&first).await.unwrap();
            assert!(
                matches!(sent.outcome, Outcome::Acked { .. }),
                "{name}: {sent:?}"
            );
            let found = rig
                .client
                .clone()
                .rail_movements(&first.payout_id)
                .await
                .unwrap();
            assert!(
                matches!(found, rail_proxy_client::RailLookup::Found(_)),
                "{name}: {found:?}"
            );
        }
        let request = payout(&format!("p-{name}"), &format!("acct-{name}"), 3, "worker-1");
        let submission = rig.client.clone().submit(&request).await.unwrap();
        match &submission.outcome {
            Outcome::Timeout { detail } => assert!(
                detail.contains(&format!("unauthenticated rail answer ({reason}")),
                "{name}: {detail}"
            ),
            other => panic!("{name}: an unauthenticated answer was believed: {other:?}"),
        }
        assert_eq!(unauthenticated_counted(&rig, "pay", reason), 1, "{name}");
        let recorded: String =
            sqlx::query_scalar("SELECT outcome FROM rail_submission WHERE payout_id = $1")
                .bind(request.payout_id.as_str())
                .fetch_one(&rig.pool)
                .await
                .unwrap();
        assert_eq!(recorded, "TIMEOUT", "{name}");
        // The lookup (the reconciler's and the resolver's question) is not believed either.
        let lookup = rig
            .client
            .clone()
            .rail_movements(&request.payout_id)
            .await
            .unwrap();
        assert!(
            matches!(&lookup, rail_proxy_client::RailLookup::Unknown { detail } if detail.contains("unauthenticated")),
            "{name}: {lookup:?}"
        );
        let inquiry = rig
            .client
            .clone()
            .inquire(&inquiry_of(&request, "resolver"))
            .await
            .unwrap();
        assert!(
            matches!(&inquiry.resolution.evidence, Evidence::Unknown { .. }),
            "{name}: {inquiry:?}"
        );
        assert_eq!(unauthenticated_counted(&rig, "lookup", reason), 2, "{name}");
        // What the rail itself saw: the impostor and the replay kept the payment from it.
        let at = at_rail(&rig, &request).await;
        match what {
            Some(OnTheWay::Impostor | OnTheWay::ReplaysTheFirst) => {
                assert_eq!(at, (0, 0), "{name}")
            }
            _ => assert_eq!(at, (1, 1), "{name}"),
        }
    }
}

/// A rig whose proxy believes every answer (answer verification off: the negative-control
/// switch) and reaches an impostor answering `accepted`, serving TLS with `server` (`None`: a copy
/// of the stub's own certificate, of the rail's authority).
async fn believing_rig_with_an_impostor(server: Option<&service_kit::grpc::Tls>) -> Rig {
    rig_railed(
        StubConfig::default(),
        keys(),
        |stub| {
            let url = match server {
                Some(server) => on_the_way_as(stub, OnTheWay::Impostor, server),
                None => on_the_way(stub, OnTheWay::Impostor),
            };
            rail_link(stub, url, stub.answer_verifier())
        },
        |c| c.disable_rail_answer_verification_for_negative_control(),
    )
    .await
}

/// The control of rows 5a/5b: the same impostor, with the proxy believing every answer on the
/// rail's address, records an ACK for a payment the rail never saw (the customer would be debited
/// for nothing).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn negative_control_without_answer_verification_an_impostors_accept_is_an_ack() {
    let rig = believing_rig_with_an_impostor(None).await;
    let request = payout("p-believed", "acct-believed", 3, "worker-1");
    let submission = rig.client.clone().submit(&request).await.unwrap();
    assert_eq!(
        submission.outcome,
        Outcome::Acked {
            rail_ref: "rr-forged".into()
        }
    );
    assert_eq!(
        at_rail(&rig, &request).await,
        (0, 0),
        "the rail never saw it"
    );
    assert_eq!(unauthenticated_counted(&rig, "pay", "unsigned"), 0);
}

/// Row 5c: the rail's certificate is checked against the rail's own authority. An impostor on the
/// rail's address with a certificate of another authority (naming the stub's addresses) answering
/// `accepted` is refused at the handshake, even with answer verification off: the payment is
/// ambiguous (TIMEOUT), never an ACK, and nothing reached the impostor. The control is the test
/// above: the same impostor holding a certificate of the rail's authority is believed when the
/// answers are not verified.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_impostor_with_another_authoritys_certificate_is_refused_at_the_handshake() {
    let foreign = tempfile::tempdir().unwrap();
    let foreign = testkit::pki::Pki::in_dir(foreign.path())
        .unwrap()
        .issue_named(&rail_stub::SERVER_NAMES, "rail-stub")
        .unwrap()
        .tls();
    let rig = believing_rig_with_an_impostor(Some(&foreign)).await;
    let request = payout("p-foreign-tls", "acct-foreign-tls", 3, "worker-1");
    let submission = rig.client.clone().submit(&request).await.unwrap();
    match &submission.outcome {
        Outcome::Timeout { detail } => assert!(
            detail.to_lowercase().contains("certificate")
                || detail.to_lowercase().contains("tls")
                || detail.to_lowercase().contains("connect"),
            "the handshake's failure is named: {detail}"
        ),
        other => panic!("an impostor of another authority was believed: {other:?}"),
    }
    assert_eq!(
        at_rail(&rig, &request).await,
        (0, 0),
        "the rail never saw it"
    );
}

/// Row 5c's other half: the shipped binary refuses a rail link that is not HTTPS, or has no rail
/// authority, at start; given both, its start goes on to the database (so neither refusal came
/// from something else).
#[test]
fn the_binary_refuses_a_plain_http_rail_and_a_missing_rail_authority() {
    let dir = tempfile::tempdir().unwrap();
    let rail = testkit::rail::RailTls::issue(dir.path()).unwrap();
    let (_, fact_secret) = Signer::generate("fact-1").unwrap();
    let fact_key = dir.path().join("fact.key");
    std::fs::write(&fact_key, fact_secret).unwrap();
    let rail_answers = Signer::generate("rail-1")
        .unwrap()
        .0
        .public_key()
        .to_string();
    let command = |url: &str, rail_tls: Vec<String>| {
        let mut command = proxy_binary("rail-proxy-link");
        command
            .args(["--database-url", "postgres://nobody@127.0.0.1:1/none"])
            .args(["--rail-url", url])
            .args(rail_tls)
            .args(["--rail-answer-verify-keys", &rail_answers])
            .args(["--grant-verify-keys", &SIGNER.public_key().to_string()])
            .args([
                "--instruction-verify-keys",
                &INSTRUCTION_SIGNER.public_key().to_string(),
            ])
            .args(["--rail-fact-signing-key-id", "fact-1"])
            .args(["--rail-fact-signing-key-file", fact_key.to_str().unwrap()])
            .env_remove("RAIL_PROXY_RAIL_CA")
            .env_remove("RAIL_PROXY_RAIL_CLIENT_CERT")
            .env_remove("RAIL_PROXY_RAIL_CLIENT_KEY")
            .env_remove("LOG_FORMAT");
        command
    };
    let start = |url: &str, rail_tls: Vec<String>| {
        let out = command(url, rail_tls).output().unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (code, stderr) = start("http://127.0.0.1:1", rail.proxy_args());
    assert_eq!(code, Some(1), "{stderr}");
    assert!(stderr.contains("is not https://"), "{stderr}");
    let no_authority: Vec<String> = rail.proxy_args().into_iter().skip(2).collect();
    let (code, stderr) = start("https://127.0.0.1:1", no_authority);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("--rail-ca"), "{stderr}");
    // The control: both given, the rail link is accepted and the start goes on to the database
    // (nobody runs it there: the proxy says so and tries again, until it is stopped here).
    let mut control = command("https://127.0.0.1:1", rail.proxy_args())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let stdout = std::io::BufReader::new(control.stdout.take().unwrap());
    let reached = std::io::BufRead::lines(stdout)
        .map_while(Result::ok)
        .find(|line| line.contains("database not reachable yet"));
    control.kill().unwrap();
    control.wait().unwrap();
    assert!(
        reached.is_some(),
        "the proxy with an https:// rail and its rail TLS went on to its database"
    );
}
