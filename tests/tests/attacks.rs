//! The attack suite (issue 17, section 5), against a real system: every service is its own
//! process, started by its binary, serving mutual TLS and its real authorisation table. Each case
//! is someone who can reach a port and tries one thing; it asserts the specific refusal, that
//! nothing was written, and that the refusal was recorded where an operator would see it (a
//! metric on the service's `/metrics`, or the guard's audit). The suite prints a table of the
//! cases and their results, then fails if any case did not hold.
//!
//! Section 6 logs in to each database as each service's own role and tries the statements that
//! would rewrite history (UPDATE or DELETE of append-only rows, disabling triggers, replica mode,
//! DDL): the database refuses each with `insufficient_privilege`, nothing changes, and the server
//! log records the refused statement with the role. Its negative control runs the same statements
//! as the superuser (rolled back) and sees them accepted, so the refusals are the roles' doing.
//!

use std::time::Duration;

use grant_signing::Signer;
use payment_client::model::{Fence, NewPayout};
use payment_client::{PaymentClient, PaymentError};
use payout_domain::{
    AccountId, AmountMinor, BeneficiaryRef, Currency, FencingToken, PayoutId, PayoutState,
};
use payout_proto::{ledger, lock, payment, railproxy};
use system_tests::metrics::sample;
use testkit::db_access::Database;
use testkit::etcd::EtcdRole;
use testkit::pki::Role;
use testkit::stack::PgServer;
use testkit::system::{System, SystemOptions};
use testkit::Stack;
use tonic::transport::Channel;

/// A case's verdict: what was seen, and whether it is what the system must do.
struct Row {
    case: &'static str,
    expected: &'static str,
    observed: String,
    held: bool,
}

fn code_of<T>(r: Result<tonic::Response<T>, tonic::Status>) -> Option<tonic::Code> {
    r.err().map(|s| s.code())
}

async fn metrics(system: &System, index: usize) -> String {
    system_tests::metrics::scrape(system.ports.metrics[index]).await
}

const METRICS_LOCK: usize = 0;
const METRICS_PAYMENT: usize = 1;
const METRICS_PROXY: usize = 3;
const METRICS_GL: usize = 4;

async fn channel(system: &System, role: Role, url: &str, server: Role) -> Channel {
    system.tls(role).connect(url, server).await.unwrap()
}

/// The payment resource, called with `role`'s certificate.
async fn payment_as(
    system: &System,
    role: Role,
) -> payment::payment_resource_client::PaymentResourceClient<Channel> {
    payment::payment_resource_client::PaymentResourceClient::new(
        channel(system, role, &system.payment_url(), Role::PaymentResource).await,
    )
}

async fn count(url: &str, sql: &str) -> i64 {
    let pool = sqlx::PgPool::connect(url).await.unwrap();
    let n = sqlx::query_scalar(sql).fetch_one(&pool).await.unwrap();
    testkit::util::close_pool(pool).await;
    n
}

/// A genuine grant of `account`'s key from the system's lock service, on a worker's session of
/// the attacker's own (an attacker who holds a worker certificate).
async fn genuine_grant(
    system: &System,
    account: &str,
) -> (lock_client::Session, lock_client::GrantHandle) {
    let lock = lock_client::LockClient::connect(&system.lock_url(), &system.tls(Role::Worker))
        .await
        .unwrap();
    let session = lock
        .open_session("attacker", Duration::from_secs(10))
        .await
        .unwrap();
    let lock_client::Acquired::Granted(grant) = session
        .acquire(
            &payout_domain::lock_key(&AccountId::parse(account).unwrap()),
            Duration::from_secs(5),
        )
        .await
        .unwrap()
    else {
        panic!("no grant for {account}");
    };
    (session, grant)
}

/// The four gRPC services: name, URL, the role their certificate names, their metrics index.
fn services(system: &System) -> [(&'static str, String, Role); 4] {
    [
        ("lock-server", system.lock_url(), Role::LockServer),
        (
            "payment-resource",
            system.payment_url(),
            Role::PaymentResource,
        ),
        ("rail-proxy", system.proxy_url(), Role::RailProxy),
        ("general-ledger", system.gl_url(), Role::GeneralLedger),
    ]
}

/// A health check over `endpoint`: the cheapest call every server answers to anyone it lets in.
async fn health(endpoint: tonic::transport::Endpoint) -> Result<(), String> {
    use tonic_health::pb::health_client::HealthClient;
    use tonic_health::pb::HealthCheckRequest;
    let channel = endpoint
        .connect()
        .await
        .map_err(|e| format!("connect: {e}"))?;
    HealthClient::new(channel)
        .check(HealthCheckRequest {
            service: String::new(),
        })
        .await
        .map(|_| ())
        .map_err(|s| format!("{:?}: {}", s.code(), s.message()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attacks_from_anyone_who_can_reach_a_port_are_refused_and_recorded() {
    let system = System::start(
        Stack::shared(),
        SystemOptions {
            workers: 0,
            ..Default::default()
        },
    )
    .await
    .expect("the system starts");
    let mut rows = Vec::new();
    let ca = std::fs::read(system.pki.ca_file()).unwrap();

    // 1. No client certificate, plaintext, a certificate from another authority: no call gets
    //    through to any service (the TLS handshake or the connection fails first).
    let foreign = mtls::issue::Authority::create()
        .unwrap()
        .issue(Role::Operator, "intruder")
        .unwrap()
        .tls();
    for (name, url, role) in services(&system) {
        let anonymous = tonic::transport::Endpoint::from_shared(url.clone())
            .unwrap()
            .tls_config(
                tonic::transport::ClientTlsConfig::new()
                    .ca_certificate(tonic::transport::Certificate::from_pem(&ca))
                    .domain_name(role.name()),
            )
            .unwrap();
        let answer = health(anonymous).await;
        rows.push(Row {
            case: leak(format!("unauthenticated call to {name}")),
            expected: "refused before any call",
            held: answer.is_err(),
            observed: format!("{answer:?}"),
        });
        let plain =
            tonic::transport::Endpoint::from_shared(url.replace("https://", "http://")).unwrap();
        let answer = health(plain).await;
        rows.push(Row {
            case: leak(format!("plaintext call to {name}")),
            expected: "refused before any call",
            held: answer.is_err(),
            observed: format!("{answer:?}"),
        });
        let answer = health(foreign.endpoint(&url, role).unwrap()).await;
        rows.push(Row {
            case: leak(format!("another authority's certificate at {name}")),
            expected: "refused before any call",
            held: answer.is_err(),
            observed: format!("{answer:?}"),
        });
    }

    // 2. A genuine certificate of the wrong role: PERMISSION_DENIED, nothing written, counted in
    //    unauthorised_calls_total{method, role}.
    let paydb = system.databases.paydb.clone();
    let proxydb = system.databases.proxydb.clone();
    let gldb = system.databases.gldb.clone();
    {
        let before = count(&gldb, "SELECT count(*) FROM journals").await;
        let mut gl = ledger::general_ledger_service_client::GeneralLedgerServiceClient::new(
            channel(&system, Role::Worker, &system.gl_url(), Role::GeneralLedger).await,
        );
        let code = code_of(
            gl.append_journal(ledger::AppendJournalRequest::default())
                .await,
        );
        let after = count(&gldb, "SELECT count(*) FROM journals").await;
        let seen = sample(
            &metrics(&system, METRICS_GL).await,
            "unauthorised_calls_total",
            &[r#"AppendJournal""#, r#"role="worker""#],
        );
        rows.push(Row {
            case: "a worker's certificate posts a journal to the GL",
            expected: "PERMISSION_DENIED, no journal, counted",
            held: code == Some(tonic::Code::PermissionDenied) && before == after && seen >= 1.0,
            observed: format!("{code:?}, journals {before}->{after}, counted {seen}"),
        });
        let mut gl = ledger::general_ledger_service_client::GeneralLedgerServiceClient::new(
            channel(
                &system,
                Role::Reconciler,
                &system.gl_url(),
                Role::GeneralLedger,
            )
            .await,
        );
        let code = code_of(
            gl.set_operating_mode(ledger::SetOperatingModeRequest::default())
                .await,
        );
        let seen = sample(
            &metrics(&system, METRICS_GL).await,
            "unauthorised_calls_total",
            &[r#"SetOperatingMode""#, r#"role="reconciler""#],
        );
        rows.push(Row {
            case: "the reconciler's certificate changes the GL's mode",
            expected: "PERMISSION_DENIED, counted",
            held: code == Some(tonic::Code::PermissionDenied) && seen >= 1.0,
            observed: format!("{code:?}, counted {seen}"),
        });
    }
    {
        let before = count(&proxydb, "SELECT count(*) FROM rail_submission").await;
        let mut proxy = railproxy::rail_proxy_client::RailProxyClient::new(
            channel(
                &system,
                Role::OutboxDispatcher,
                &system.proxy_url(),
                Role::RailProxy,
            )
            .await,
        );
        let code = code_of(proxy.submit(railproxy::SubmitRequest::default()).await);
        let after = count(&proxydb, "SELECT count(*) FROM rail_submission").await;
        let seen = sample(
            &metrics(&system, METRICS_PROXY).await,
            "unauthorised_calls_total",
            &[r#"Submit""#, r#"role="outbox-dispatcher""#],
        );
        rows.push(Row {
            case: "the dispatcher's certificate submits to the rail",
            expected: "PERMISSION_DENIED, no submission, counted",
            held: code == Some(tonic::Code::PermissionDenied) && before == after && seen >= 1.0,
            observed: format!("{code:?}, submissions {before}->{after}, counted {seen}"),
        });
    }
    {
        let before = count(&paydb, "SELECT count(*) FROM account").await;
        let mut pay = payment_as(&system, Role::Worker).await;
        let code = code_of(
            pay.open_account(payment::OpenAccountRequest {
                account_id: "attack-funded".into(),
                currency: "EUR".into(),
                opening_balance_minor: 1_000_000_000,
                ..Default::default()
            })
            .await,
        );
        let after = count(&paydb, "SELECT count(*) FROM account").await;
        let seen = sample(
            &metrics(&system, METRICS_PAYMENT).await,
            "unauthorised_calls_total",
            &[r#"OpenAccount""#, r#"role="worker""#],
        );
        rows.push(Row {
            case: "a worker's certificate opens a funded account",
            expected: "PERMISSION_DENIED, no account, counted",
            held: code == Some(tonic::Code::PermissionDenied) && before == after && seen >= 1.0,
            observed: format!("{code:?}, accounts {before}->{after}, counted {seen}"),
        });
        // Issue 34, row 6c: the role that may open accounts, without an operator's signature
        // on the funding (or with a key nobody registered): refused, nothing written, counted.
        let fixture = PaymentClient::connect(&system.payment_url(), &system.tls(Role::Fixture))
            .await
            .unwrap();
        let eur = Currency::parse("EUR").unwrap();
        let mallory_dir = tempfile::tempdir().unwrap();
        let mallory = testkit::grants::OperatorKey::in_dir(mallory_dir.path()).unwrap();
        for (case, answer, reason) in [
            (
                "the fixture's certificate opens a funded account unsigned",
                fixture
                    .open_account(
                        &AccountId::parse("attack-mint").unwrap(),
                        &eur,
                        1_000_000_000,
                    )
                    .await,
                "unsigned",
            ),
            (
                "a funded account signed by an unregistered key",
                mallory
                    .open_account(
                        &fixture,
                        &AccountId::parse("attack-mint").unwrap(),
                        &eur,
                        1_000_000_000,
                    )
                    .await,
                "bad_signature",
            ),
        ] {
            let after = count(&paydb, "SELECT count(*) FROM account").await;
            let seen = sample(
                &metrics(&system, METRICS_PAYMENT).await,
                "payment_funding_refused_total",
                &[&format!(r#"reason="{reason}""#)],
            );
            rows.push(Row {
                case,
                expected: "PERMISSION_DENIED FundingNotAuthorised, no account, counted",
                held: matches!(&answer, Err(PaymentError::FundingNotAuthorised { reason: r, .. }) if r == reason)
                    && before == after
                    && seen >= 1.0,
                observed: format!("{answer:?}, accounts {before}->{after}, counted {seen}"),
            });
        }
        let mut pay = payment_as(&system, Role::LockServer).await;
        let code = code_of(pay.post(payment::PostRequest::default()).await);
        rows.push(Row {
            case: "the lock service's certificate posts a payout",
            expected: "PERMISSION_DENIED",
            held: code == Some(tonic::Code::PermissionDenied),
            observed: format!("{code:?}"),
        });
    }
    {
        let mut lock = lock::lock_service_client::LockServiceClient::new(
            channel(&system, Role::Worker, &system.lock_url(), Role::LockServer).await,
        );
        let code = code_of(
            lock.force_revoke(lock::ForceRevokeRequest {
                key: "payout:attack".into(),
                operator: "a worker pretending".into(),
                reason: "attack".into(),
                expected_token: None,
            })
            .await,
        );
        let seen = sample(
            &metrics(&system, METRICS_LOCK).await,
            "unauthorised_calls_total",
            &[r#"ForceRevoke""#, r#"role="worker""#],
        );
        rows.push(Row {
            case: "a worker's certificate force-revokes a lock",
            expected: "PERMISSION_DENIED, counted",
            held: code == Some(tonic::Code::PermissionDenied) && seen >= 1.0,
            observed: format!("{code:?}, counted {seen}"),
        });
    }
    {
        // An operator's certificate, naming another operator: the audit record would say
        // someone else did it. Refused before anything is revoked; the holder keeps its grant.
        let (session, held) = genuine_grant(&system, "attack-revoke").await;
        let mut lock = lock::lock_service_client::LockServiceClient::new(
            channel(
                &system,
                Role::Operator,
                &system.lock_url(),
                Role::LockServer,
            )
            .await,
        );
        let answer = lock
            .force_revoke(lock::ForceRevokeRequest {
                key: held.key().to_string(),
                operator: "alice".into(),
                reason: "attack: blame alice".into(),
                expected_token: Some(held.token().get()),
            })
            .await;
        let refused = answer
            .as_ref()
            .err()
            .map(|s| (s.code(), s.message().to_string()));
        tokio::time::sleep(Duration::from_millis(200)).await;
        let still_held = held.is_held() && held.renew().await.is_ok();
        let seen = sample(
            &metrics(&system, METRICS_LOCK).await,
            "unauthorised_calls_total",
            &[r#"reason="operator_not_certified""#, r#"role="operator""#],
        );
        rows.push(Row {
            case: "an operator's certificate force-revokes naming another operator",
            expected: "PERMISSION_DENIED operator_not_certified, holder kept, counted",
            held: refused.as_ref().is_some_and(|(c, m)| {
                *c == tonic::Code::PermissionDenied && m.contains("operator_not_certified")
            }) && still_held
                && seen >= 1.0,
            observed: format!(
                "{:?}, still held {still_held}, counted {seen}",
                refused.map(|r| r.0)
            ),
        });
        let _ = held.release().await;
        let _ = session.close().await;
    }

    {
        // A quarantine replay: a worker's certificate is refused by the table; an operator's
        // certificate naming another operator is refused before any row is looked at.
        let mut pay = payment_as(&system, Role::Worker).await;
        let code = code_of(
            pay.replay_quarantined(payment::ReplayQuarantinedRequest {
                outbox_id: 1,
                operator: "a worker pretending".into(),
                reason: "attack".into(),
            })
            .await,
        );
        let seen = sample(
            &metrics(&system, METRICS_PAYMENT).await,
            "unauthorised_calls_total",
            &[r#"ReplayQuarantined""#, r#"role="worker""#],
        );
        rows.push(Row {
            case: "a worker's certificate replays a quarantined outbox row",
            expected: "PERMISSION_DENIED, counted",
            held: code == Some(tonic::Code::PermissionDenied) && seen >= 1.0,
            observed: format!("{code:?}, counted {seen}"),
        });
        let mut pay = payment_as(&system, Role::Operator).await;
        let answer = pay
            .replay_quarantined(payment::ReplayQuarantinedRequest {
                outbox_id: 1,
                operator: "alice".into(),
                reason: "attack: blame alice".into(),
            })
            .await;
        let refused = answer
            .as_ref()
            .err()
            .map(|s| (s.code(), s.message().to_string()));
        let seen = sample(
            &metrics(&system, METRICS_PAYMENT).await,
            "unauthorised_calls_total",
            &[
                r#"ReplayQuarantined""#,
                r#"reason="operator_not_certified""#,
                r#"role="operator""#,
            ],
        );
        rows.push(Row {
            case: "an operator's certificate replays a quarantined row naming another operator",
            expected: "PERMISSION_DENIED OperatorNotCertified, counted",
            held: refused.as_ref().is_some_and(|(c, m)| {
                *c == tonic::Code::PermissionDenied
                    && m.contains("is not the operator the caller's certificate carries")
            }) && seen >= 1.0,
            observed: format!("{:?}, counted {seen}", refused.map(|r| r.0)),
        });
    }

    // 3. Session hijack: Describe reveals no session id; a session id learnt elsewhere is
    //    worthless to another certificate; the holder keeps its grant.
    {
        let url = system.lock_url();
        let mut owner = lock::lock_service_client::LockServiceClient::new(
            channel(&system, Role::Worker, &url, Role::LockServer).await,
        );
        let mut intruder = lock::lock_service_client::LockServiceClient::new(
            channel(&system, Role::Worker, &url, Role::LockServer).await,
        );
        let session_id = owner
            .create_session(lock::CreateSessionRequest {
                owner: "victim".into(),
                ttl_ms: 10_000,
            })
            .await
            .unwrap()
            .into_inner()
            .session_id;
        let granted = owner
            .acquire(lock::AcquireRequest {
                key: "payout:hijack".into(),
                owner: "victim".into(),
                session_id: session_id.clone(),
                wait_ms: 0,
            })
            .await
            .unwrap()
            .into_inner();
        let Some(lock::acquire_response::Result::Grant(grant)) = granted.result else {
            panic!("the victim's acquire was not granted: {granted:?}");
        };
        let described = intruder
            .describe(lock::DescribeRequest {
                key: "payout:hijack".into(),
            })
            .await
            .unwrap()
            .into_inner();
        rows.push(Row {
            case: "session hijack through Describe",
            expected: "no session id revealed",
            held: described.held && described.holder_session_id.is_empty(),
            observed: format!("holder_session_id {:?}", described.holder_session_id),
        });
        let keep = code_of(
            intruder
                .keep_alive(lock::KeepAliveRequest {
                    session_id: session_id.clone(),
                    vouch: vec![],
                })
                .await,
        );
        let take = code_of(
            intruder
                .acquire(lock::AcquireRequest {
                    key: "payout:hijack".into(),
                    owner: "victim".into(),
                    session_id: session_id.clone(),
                    wait_ms: 0,
                })
                .await,
        );
        let release = code_of(
            intruder
                .release(lock::ReleaseRequest {
                    handle: Some(lock::Handle {
                        key: grant.key.clone(),
                        owner: grant.owner.clone(),
                        session_id: grant.session_id.clone(),
                        token: grant.token,
                    }),
                })
                .await,
        );
        let close = code_of(
            intruder
                .close_session(lock::CloseSessionRequest {
                    session_id: session_id.clone(),
                })
                .await,
        );
        let still = owner
            .describe(lock::DescribeRequest {
                key: "payout:hijack".into(),
            })
            .await
            .unwrap()
            .into_inner();
        let seen = sample(
            &metrics(&system, METRICS_LOCK).await,
            "lock_events_total",
            &[r#"event="session_not_owned""#],
        );
        let denied = Some(tonic::Code::PermissionDenied);
        rows.push(Row {
            case: "session hijack with a leaked session id",
            expected:
                "KeepAlive/Acquire/Release/CloseSession PERMISSION_DENIED, holder kept, counted",
            held: [keep, take, release, close].iter().all(|c| *c == denied)
                && still.held
                && still.token == grant.token
                && seen >= 4.0,
            observed: format!(
                "{keep:?} {take:?} {release:?} {close:?}, held {} token {}->{}, counted {seen}",
                still.held, grant.token, still.token
            ),
        });
    }

    // 4. Grants: forged, replayed on another account, signed by a key the guards no longer hold.
    {
        let fixture = PaymentClient::connect(&system.payment_url(), &system.tls(Role::Fixture))
            .await
            .unwrap();
        let worker = PaymentClient::connect(&system.payment_url(), &system.tls(Role::Worker))
            .await
            .unwrap();
        let eur = Currency::parse("EUR").unwrap();
        for account in ["attack-a", "attack-b"] {
            system
                .operator
                .open_account(&fixture, &AccountId::parse(account).unwrap(), &eur, 10_000)
                .await
                .unwrap();
        }
        let target = PayoutId::parse("attack-b-p1").unwrap();
        fixture
            .create_payout(&NewPayout {
                payout_id: target.clone(),
                account_id: AccountId::parse("attack-b").unwrap(),
                amount_minor: AmountMinor::new(100).unwrap(),
                currency: eur.clone(),
                beneficiary_ref: BeneficiaryRef::parse("ben-attack").unwrap(),
            })
            .await
            .unwrap();
        let pending = |p: &payment_client::model::Payout| p.state == PayoutState::Pending;

        let forged = Fence::new("attacker", FencingToken::new(i64::MAX as u64).unwrap()).unwrap();
        let answer = worker.claim(&target, &forged).await;
        let state = worker.get_payout(&target).await.unwrap().payout;
        rows.push(Row {
            case: "a forged grant (token i64::MAX, unsigned)",
            expected: "forged_grant, payout untouched",
            held: matches!(answer, Err(PaymentError::ForgedGrant { .. })) && pending(&state),
            observed: format!("{answer:?}, {:?}", state.state),
        });

        // A real grant, minted by the lock service for account A, presented on B's payout.
        let (session, grant_a) = genuine_grant(&system, "attack-a").await;
        let replayed = Fence::new(grant_a.owner(), grant_a.token())
            .unwrap()
            .signed(grant_a.key(), grant_a.signature().clone());
        let answer = worker.claim(&target, &replayed).await;
        let state = worker.get_payout(&target).await.unwrap().payout;
        rows.push(Row {
            case: "a real grant for account A replayed on account B",
            expected: "grant_for_another_key, payout untouched",
            held: matches!(answer, Err(PaymentError::GrantForAnotherKey { .. })) && pending(&state),
            observed: format!("{answer:?}, {:?}", state.state),
        });

        // A key rotated out: signed properly, by a key the guards were not (or no longer) given.
        let (rotated_out, _) = Signer::generate("rotated-out-1").unwrap();
        let key_b = payout_domain::lock_key(&AccountId::parse("attack-b").unwrap());
        let old = Fence::new("attacker", FencingToken::new(5).unwrap())
            .unwrap()
            .signed(key_b.clone(), rotated_out.sign(&key_b, 5, "attacker"));
        let answer = worker.claim(&target, &old).await;
        let state = worker.get_payout(&target).await.unwrap().payout;
        let audited = count(
            &paydb,
            "SELECT count(*) FROM audit_event WHERE kind IN ('forged_grant', 'grant_for_another_key')",
        )
        .await;
        rows.push(Row {
            case: "a grant signed by a rotated-out key",
            expected: "forged_grant, payout untouched, all three audited",
            held: matches!(answer, Err(PaymentError::ForgedGrant { .. }))
                && pending(&state)
                && audited >= 3,
            observed: format!("{answer:?}, {:?}, audit rows {audited}", state.state),
        });
        let _ = grant_a.release().await;
        let _ = session.close().await;
    }

    // 5. Oversize and malformed messages: refused before they are parsed or by the parser, the
    //    server still serving and nothing written.
    {
        let before = count(&paydb, "SELECT count(*) FROM payout").await;
        let mut pay = payment_as(&system, Role::Fixture).await;
        let code = code_of(
            pay.create_payout(payment::CreatePayoutRequest {
                payout_id: "attack-big".into(),
                account_id: "attack-a".into(),
                amount_minor: 1,
                currency: "EUR".into(),
                beneficiary_ref: "x".repeat(1 << 20),
            })
            .await,
        );
        let after = count(&paydb, "SELECT count(*) FROM payout").await;
        let serving = testkit::system::probe_grpc(
            system.ports.payment_resource,
            &system.tls(Role::Reconciler),
            Role::PaymentResource,
        )
        .await;
        rows.push(Row {
            case: "an oversize message (1 MiB) to the payment resource",
            // gRPC's code for a message larger than the server accepts (tonic's own answer,
            // OUT_OF_RANGE, is rewritten at the service kit's edge).
            expected: "RESOURCE_EXHAUSTED, nothing written, still serving",
            held: code == Some(tonic::Code::ResourceExhausted) && before == after && serving,
            observed: format!("{code:?}, payouts {before}->{after}, serving {serving}"),
        });
        let code = code_of(
            pay.create_payout(payment::CreatePayoutRequest {
                payout_id: "attack-\0-nul".into(),
                account_id: "attack-a".into(),
                amount_minor: -1,
                currency: "€€€".into(),
                ..Default::default()
            })
            .await,
        );
        let after_bad = count(&paydb, "SELECT count(*) FROM payout").await;
        rows.push(Row {
            case: "a malformed message (NUL id, negative amount, bad currency)",
            expected: "INVALID_ARGUMENT, nothing written",
            held: code == Some(tonic::Code::InvalidArgument) && after_bad == after,
            observed: format!("{code:?}, payouts {after}->{after_bad}"),
        });
    }

    // 6. Tampering SQL as each service's own database role.
    {
        let stack = Stack::shared();
        let lockdb = stack.provisioned_db(PgServer::Main, Database::Lockdb).await;
        let admin_url = |db: Database| match db {
            Database::Paydb => paydb.clone(),
            Database::Proxydb => proxydb.clone(),
            Database::Gldb => gldb.clone(),
            Database::Lockdb => lockdb.clone(),
        };
        for t in TAMPERING {
            let admin = admin_url(t.database);
            let server = server_of(t.database);
            let login = stack
                .pg(server)
                .login_url(t.role, testkit::system::database_name(&admin));
            let log = stack.pg(server).process.log_path().to_path_buf();
            let logged_before = logged(&log, t.role, t.statement);
            let before = fingerprint(&admin, t.table).await;
            let answer = as_role(&login, t.statement).await;
            let after = fingerprint(&admin, t.table).await;
            let recorded =
                testkit::eventually(Duration::from_secs(30), "the refusal logged", || {
                    let log = log.clone();
                    async move { (logged(&log, t.role, t.statement) > logged_before).then_some(()) }
                })
                .await
                .is_ok();
            rows.push(Row {
                case: leak(format!(
                    "{} as {}: {}",
                    t.database.name(),
                    t.role,
                    t.statement
                )),
                expected: "insufficient_privilege (42501), unchanged, in the server log",
                held: answer == Err("42501".to_string()) && before == after && recorded,
                observed: format!(
                    "{answer:?}, {} {}, logged {recorded}",
                    t.table,
                    if before == after {
                        "unchanged"
                    } else {
                        "CHANGED"
                    }
                ),
            });
        }
    }

    // 8. Operator decisions: an abandon under a valid grant, but unsigned, or signed by a key no
    //    operator registered, or signed by the registered operator for another payout. Each is
    //    refused OperatorNotVerified, the payout untouched, audited and counted. (The same through
    //    Temporal's `abandon` signal: tests/tests/payouts.rs,
    //    an_unsigned_or_forged_abandon_signal_is_refused_on_record_and_the_payout_is_paid.)
    {
        let worker = PaymentClient::connect(&system.payment_url(), &system.tls(Role::Worker))
            .await
            .unwrap();
        let target = PayoutId::parse("attack-b-p1").unwrap();
        let (session, grant_b) = genuine_grant(&system, "attack-b").await;
        let fence = Fence::new(grant_b.owner(), grant_b.token())
            .unwrap()
            .signed(grant_b.key(), grant_b.signature().clone());
        let now = grant_signing::operator::now_unix_ms();
        let sign = |signer: &Signer, payout: &str| {
            Some(payment_client::model::OperatorSignature {
                signature: signer
                    .sign_decision(&grant_signing::operator::Decision {
                        operator: testkit::grants::OPERATOR,
                        decision: "abandon",
                        payout_id: payout,
                        reason: "attack",
                        signed_at_unix_ms: now,
                    })
                    .bytes,
                signed_at_unix_ms: now,
            })
        };
        let (rogue, _) = Signer::generate(testkit::grants::OPERATOR).unwrap();
        let cases = [
            ("an unsigned operator abandon", None, "unsigned"),
            (
                "an operator abandon signed by an unregistered key",
                sign(&rogue, target.as_str()),
                "bad_signature",
            ),
            (
                "the operator's abandon of another payout, replayed on this one",
                sign(&system.operator.signer, "attack-a-p9"),
                "bad_signature",
            ),
        ];
        for (case, signature, reason) in cases {
            let before = count(
                &paydb,
                "SELECT count(*) FROM audit_event WHERE kind = 'operator_not_verified'",
            )
            .await;
            let answer = worker
                .abandon(
                    &target,
                    &fence,
                    &payment_client::model::AbandonRequest {
                        operator: testkit::grants::OPERATOR.into(),
                        reason: "attack".into(),
                        resolution_sla_passed: false,
                        sla_check: String::new(),
                        signature,
                    },
                )
                .await;
            let state = worker.get_payout(&target).await.unwrap().payout;
            let after = count(
                &paydb,
                "SELECT count(*) FROM audit_event WHERE kind = 'operator_not_verified'",
            )
            .await;
            let counted = sample(
                &metrics(&system, METRICS_PAYMENT).await,
                "payment_operator_not_verified_total",
                &[&format!(r#"reason="{reason}""#)],
            );
            rows.push(Row {
                case,
                expected: "OperatorNotVerified, payout untouched, audited, counted",
                held: matches!(&answer, Err(PaymentError::OperatorNotVerified { reason: r, .. }) if r == reason)
                    && state.state == PayoutState::Pending
                    && after == before + 1
                    && counted >= 1.0,
                observed: format!(
                    "{answer:?}, {:?}, audit {before}->{after}, counted {counted}",
                    state.state
                ),
            });
        }
        let _ = grant_b.release().await;
        let _ = session.close().await;
    }

    // 7. The databases themselves: TLS only, a password per login.
    {
        let stack = Stack::shared();
        let pg = stack.pg(PgServer::Main);
        let db = testkit::system::database_name(&paydb).to_string();
        let right = pg.login_url("payment_resource", &db);
        let plaintext = right.replace("sslmode=verify-full", "sslmode=disable");
        let answer = connect_code(&plaintext).await;
        rows.push(Row {
            case: "paydb over plaintext with the right password",
            expected: "refused: no host entry without TLS (28000)",
            held: answer == Err("28000".to_string()),
            observed: format!("{answer:?}"),
        });
        let other = pg.credentials().password("rail_proxy").expect("a password");
        let wrong = pg.server().url("payment_resource", &other, &db);
        let answer = connect_code(&wrong).await;
        rows.push(Row {
            case: "paydb as payment_resource with another role's password",
            expected: "refused: password authentication failed (28P01)",
            held: answer == Err("28P01".to_string()),
            observed: format!("{answer:?}"),
        });
        let answer = connect_code(&pg.login_url("rail_proxy", &db)).await;
        rows.push(Row {
            case: "paydb as rail_proxy (a role of another database)",
            expected: "refused: no CONNECT on paydb (42501)",
            held: answer == Err("42501".to_string()),
            observed: format!("{answer:?}"),
        });
    }

    // 9. etcd (the lock service's backend): TLS only, and only a client certificate from the
    //    deployment's authority. The control: the lock-server's kind of certificate reads.
    {
        let stack = Stack::shared();
        let endpoint = stack.etcd_endpoints()[0].clone();
        let plaintext = endpoint.replace("https://", "http://");
        let ca = std::fs::read_to_string(&stack.etcd.tls.ca_file).unwrap();
        let foreign = mtls::issue::Authority::create()
            .unwrap()
            .issue_named(&["intruder.etcd-client"], "intruder")
            .unwrap();
        let foreign = mtls::Tls::from_pem(&ca, &foreign.cert_pem, &foreign.key_pem);
        // The control: the system's lock-server identity reads its own prefix.
        let key = system.etcd_prefix.clone();
        let own = stack.etcd_identity_tls(EtcdRole::LockServer, &key);
        // Issue 34, row 2a: etcd has an authority of its own. A certificate of the stack's other
        // authority (its databases' and Temporal's, which etcd trusted before) and one of the
        // services' (a worker's) are refused at the handshake.
        // Each presented with etcd's own CA trusted (ca.pem is public): the refusal is etcd's,
        // not the attacker's client refusing etcd's server certificate.
        let with_etcd_ca = |issued: mtls::TlsArgs| {
            mtls::Tls::from_pem(
                &ca,
                &std::fs::read_to_string(&issued.cert).unwrap(),
                &std::fs::read_to_string(&issued.key).unwrap(),
            )
        };
        let stack_worker = with_etcd_ca(
            stack
                .pki()
                .issue(Role::Worker, "attack-stack-worker")
                .unwrap(),
        );
        let system_worker = with_etcd_ca(
            system
                .pki
                .issue(Role::Worker, "attack-system-worker")
                .unwrap(),
        );
        let cases = [
            (
                "etcd over plaintext",
                testkit::etcd::read_as(&plaintext, None, &key).await,
            ),
            (
                "etcd with another authority's client certificate",
                testkit::etcd::read_as(&endpoint, Some(&foreign), &key).await,
            ),
            (
                "etcd with a worker certificate of the stack's authority (databases, Temporal)",
                testkit::etcd::read_as(&endpoint, Some(&stack_worker), &key).await,
            ),
            (
                "etcd with a worker certificate of the services' authority",
                testkit::etcd::read_as(&endpoint, Some(&system_worker), &key).await,
            ),
        ];
        let control = testkit::etcd::read_as(&endpoint, Some(&own), &key).await;
        for (case, answer) in cases {
            rows.push(Row {
                case,
                expected: "refused (no TLS, or a certificate etcd does not trust); a certificate of the authority reads",
                held: answer.is_err() && control.is_ok(),
                observed: format!("{answer:?}; control {control:?}"),
            });
        }
        // Issue 34, row 2b as the test kit runs etcd (authentication on): a certificate of etcd's
        // own authority completes TLS, but a name that is no user reads nothing.
        let stranger = stack.etcd_certificate_without_user("attack-stranger");
        let answer = testkit::etcd::read_as(&endpoint, Some(&stranger), &key).await;
        rows.push(Row {
            case: "etcd with a certificate of etcd's authority whose name is no user",
            expected: "refused: permission denied; the lock-server's identity reads its prefix",
            held: answer
                .as_ref()
                .is_err_and(|e| e.contains("permission denied"))
                && control.is_ok(),
            observed: format!("{answer:?}; control {control:?}"),
        });
    }

    // 9b. etcd admits as a peer only a certificate that names `etcd-peer` (issue 34, row 2d): a
    //     certificate of etcd's own authority that is not a member's, even one naming the address
    //     it connects from (which etcd's own remote-address check would accept), cannot talk to
    //     a member's peer listener, so it cannot join the cluster; the members' own can.
    {
        let stack = Stack::shared();
        let tls = &stack.etcd.tls;
        let peer_port = stack.etcd.members[0].peer_port;
        let not_a_member = tls
            .pki
            .issue_named(&["127.0.0.1", "localhost"], "not-a-member")
            .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let (client_cert, client_key) = (dir.path().join("c.pem"), dir.path().join("c.key"));
        std::fs::write(&client_cert, &not_a_member.cert_pem).unwrap();
        std::fs::write(&client_key, &not_a_member.key_pem).unwrap();
        let answer =
            testkit::etcd::peer_request_as(peer_port, &tls.ca_file, &client_cert, &client_key);
        let (member_cert, member_key) = tls.member_identity();
        let control =
            testkit::etcd::peer_request_as(peer_port, &tls.ca_file, member_cert, member_key);
        rows.push(Row {
            case: "etcd's peer listener with a client certificate of etcd's authority",
            expected:
                "refused at the handshake (no etcd-peer name); a member's certificate is answered",
            held: answer.is_err() && control.is_ok(),
            observed: format!("{answer:?}; control {control:?}"),
        });
    }

    // 10. One certificate floods the lock service (issue 34, row 4g): the shipped binary's
    //     per-caller bound on open sessions (64) refuses the 65th with CallerLimitReached, counted;
    //     another worker certificate is still served.
    {
        let flooder =
            lock_client::LockClient::connect(&system.lock_url(), &system.tls(Role::Worker))
                .await
                .unwrap();
        let mut opened = Vec::new();
        let mut refusal = None;
        for i in 0..65 {
            match flooder
                .open_session(&format!("flood-{i}"), Duration::from_secs(30))
                .await
            {
                Ok(session) => opened.push(session),
                Err(e) => {
                    refusal = Some(e);
                    break;
                }
            }
        }
        let limit = refusal.as_ref().and_then(|e| match e.rejection() {
            Some(lock_client::Rejection::CallerLimitReached(c)) => Some((c.limit.clone(), c.max)),
            _ => None,
        });
        let counted = sample(
            &metrics(&system, METRICS_LOCK).await,
            "lock_caller_limit_refusals_total",
            &[r#"limit="sessions""#],
        );
        let other = lock_client::LockClient::connect(&system.lock_url(), &system.tls(Role::Worker))
            .await
            .unwrap()
            .open_session("another-worker", Duration::from_secs(30))
            .await;
        rows.push(Row {
            case: "one worker certificate opens 65 lock sessions",
            expected: "64 opened, the 65th CallerLimitReached{sessions}, counted; another certificate served",
            held: opened.len() == 64
                && limit == Some(("sessions".to_string(), 64))
                && counted == 1.0
                && other.is_ok(),
            observed: format!(
                "{} opened, refusal {:?}, lock_caller_limit_refusals_total{{limit=\"sessions\"}} {counted}, another {:?}",
                opened.len(),
                limit,
                other.as_ref().map(|_| "served")
            ),
        });
        for session in opened {
            let _ = session.close().await;
        }
    }

    // 11. A leaked certificate revoked without a new authority (issue 34, row 1c): a reconciler
    //     certificate (a role every service serves something to) is appended to the system's
    //     denylist; each server refuses it, health checks included, within its reload period,
    //     counted as certificate_denied. Controls: a second reconciler certificate is served
    //     throughout, and a line for an unrelated certificate changes nothing.
    {
        let leaked = system.tls(Role::Reconciler);
        let other = system.tls(Role::Reconciler);
        let unrelated = system.tls(Role::Reconciler);
        let list = system.denylist_path();
        let line = |tls: &mtls::Tls| tls.own_denylist_entry().expect("a certificate");
        mtls::denylist::append(&list, &line(&unrelated), "unrelated").unwrap();
        let before: Vec<Result<(), String>> = {
            let mut seen = Vec::new();
            for (_, url, role) in services(&system) {
                seen.push(health(leaked.endpoint(&url, role).unwrap()).await);
            }
            seen
        };
        mtls::denylist::append(&list, &line(&leaked), "leaked: attack suite row 1c").unwrap();
        for (i, (name, url, role)) in services(&system).into_iter().enumerate() {
            let refused = testkit::eventually(
                Duration::from_millis(6 * mtls::denylist::RELOAD_MS),
                &format!("{name} refuses the denied certificate"),
                || {
                    let endpoint = leaked.endpoint(&url, role).unwrap();
                    async move {
                        match health(endpoint).await {
                            Err(e) if e.contains("certificate_denied") => Some(e),
                            _ => None,
                        }
                    }
                },
            )
            .await;
            let served = health(other.endpoint(&url, role).unwrap()).await;
            let index = [METRICS_LOCK, METRICS_PAYMENT, METRICS_PROXY, METRICS_GL][i];
            let counted = sample(
                &metrics(&system, index).await,
                "unauthorised_calls_total",
                &[r#"reason="certificate_denied""#],
            );
            rows.push(Row {
                case: leak(format!("a denied certificate at {name}")),
                expected: "served before; PERMISSION_DENIED certificate_denied after, counted; another certificate of the role served",
                held: before[i].is_ok() && refused.is_ok() && served.is_ok() && counted >= 1.0,
                observed: format!(
                    "before {:?}; after {:?}; another {served:?}; counted {counted}",
                    before[i],
                    refused.as_ref().map_err(|e| e.to_string())
                ),
            });
        }
    }

    println!("\n{:<62} {:<72} {:<5} observed", "case", "expected", "held");
    for r in &rows {
        println!(
            "{:<62} {:<72} {:<5} {}",
            r.case,
            r.expected,
            if r.held { "yes" } else { "NO" },
            r.observed
        );
    }
    let failed: Vec<&str> = rows.iter().filter(|r| !r.held).map(|r| r.case).collect();
    assert!(failed.is_empty(), "cases that did not hold: {failed:?}");
}

/// One tampering attempt: a service's role, its database, a statement, the table it aims at.
struct Tamper {
    role: &'static str,
    database: Database,
    statement: &'static str,
    table: &'static str,
}

const fn t(
    role: &'static str,
    database: Database,
    statement: &'static str,
    table: &'static str,
) -> Tamper {
    Tamper {
        role,
        database,
        statement,
        table,
    }
}

/// What a compromised service (or anyone with its password) would try first.
const TAMPERING: &[Tamper] = &[
    t(
        "payment_resource",
        Database::Paydb,
        "UPDATE ledger_entry SET amount_minor = amount_minor + 1",
        "ledger_entry",
    ),
    t(
        "payment_resource",
        Database::Paydb,
        "DELETE FROM audit_event",
        "audit_event",
    ),
    t(
        "payment_resource",
        Database::Paydb,
        "TRUNCATE audit_event",
        "audit_event",
    ),
    t(
        "payment_resource",
        Database::Paydb,
        "ALTER TABLE audit_event DISABLE TRIGGER ALL",
        "audit_event",
    ),
    t(
        "payment_resource",
        Database::Paydb,
        "SET session_replication_role = replica",
        "audit_event",
    ),
    t(
        "payment_resource",
        Database::Paydb,
        "UPDATE ledger_outbox SET payload = '{}'::jsonb",
        "ledger_outbox",
    ),
    t(
        "payment_resource",
        Database::Paydb,
        "DROP TRIGGER audit_event_append_only ON audit_event",
        "audit_event",
    ),
    t(
        "payment_resource",
        Database::Paydb,
        "UPDATE outbox_replay SET operator_id = 'mallory'",
        "outbox_replay",
    ),
    t(
        "payment_resource",
        Database::Paydb,
        "UPDATE row_chain_head SET seq = 0",
        "row_chain_head",
    ),
    // The kept sum of an account's entries (paydb 0013) may move only from inside a trigger
    // (`pg_trigger_depth() >= 2`): no service role may make one, on a table of the schema, on a
    // temporary table of its own, or with a function of its own.
    t(
        "payment_resource",
        Database::Paydb,
        "CREATE TRIGGER forge AFTER INSERT ON ledger_entry FOR EACH ROW EXECUTE FUNCTION add_entry_to_account_sum()",
        "account",
    ),
    t(
        "payment_resource",
        Database::Paydb,
        "CREATE TEMP TABLE forge (x int)",
        "account",
    ),
    t(
        "payment_resource",
        Database::Paydb,
        "CREATE FUNCTION forge() RETURNS trigger LANGUAGE plpgsql AS $f$ BEGIN RETURN NULL; END $f$",
        "account",
    ),
    t(
        "outbox_dispatcher",
        Database::Paydb,
        "UPDATE ledger_outbox SET payload = '{}'::jsonb",
        "ledger_outbox",
    ),
    // Releasing a quarantined row is the payment resource's, for a certified operator: the
    // dispatcher's login (a service password) cannot call the function at all.
    t(
        "outbox_dispatcher",
        Database::Paydb,
        "SELECT replay_quarantined(id, 'mallory', 'attack') FROM ledger_outbox WHERE id < 0",
        "outbox_replay",
    ),
    t(
        "outbox_dispatcher",
        Database::Paydb,
        "DELETE FROM ledger_outbox",
        "ledger_outbox",
    ),
    t(
        "outbox_dispatcher",
        Database::Paydb,
        "UPDATE account SET balance_minor = 0",
        "account",
    ),
    t(
        "outbox_dispatcher",
        Database::Paydb,
        "ALTER TABLE ledger_outbox DISABLE TRIGGER ALL",
        "ledger_outbox",
    ),
    t(
        "outbox_dispatcher",
        Database::Paydb,
        "SET session_replication_role = replica",
        "ledger_outbox",
    ),
    t(
        "reconciler",
        Database::Paydb,
        "UPDATE payout SET state = 'POSTED'",
        "payout",
    ),
    t(
        "reconciler",
        Database::Paydb,
        "DELETE FROM ledger_entry",
        "ledger_entry",
    ),
    t(
        "reconciler",
        Database::Proxydb,
        "UPDATE account_high_water SET high_water = 0",
        "account_high_water",
    ),
    t(
        "reconciler",
        Database::Gldb,
        "DELETE FROM journals",
        "journals",
    ),
    t(
        "rail_proxy",
        Database::Proxydb,
        "DELETE FROM guard_event",
        "guard_event",
    ),
    t(
        "rail_proxy",
        Database::Proxydb,
        "DELETE FROM rail_submission",
        "rail_submission",
    ),
    t(
        "rail_proxy",
        Database::Proxydb,
        "ALTER TABLE rail_submission DISABLE TRIGGER ALL",
        "rail_submission",
    ),
    t(
        "rail_proxy",
        Database::Proxydb,
        "SET session_replication_role = replica",
        "rail_submission",
    ),
    t(
        "rail_proxy",
        Database::Proxydb,
        "UPDATE row_chain_head SET seq = 0",
        "row_chain_head",
    ),
    t(
        "general_ledger",
        Database::Gldb,
        "UPDATE entries SET amount = amount * 2",
        "entries",
    ),
    t(
        "general_ledger",
        Database::Gldb,
        "DELETE FROM journals",
        "journals",
    ),
    t(
        "general_ledger",
        Database::Gldb,
        "ALTER TABLE entries DISABLE TRIGGER ALL",
        "entries",
    ),
    t(
        "general_ledger",
        Database::Gldb,
        "SET session_replication_role = replica",
        "entries",
    ),
    t(
        "general_ledger",
        Database::Gldb,
        "UPDATE operating_mode_changes SET operator_id = 'mallory'",
        "operating_mode_changes",
    ),
    t(
        "general_ledger",
        Database::Gldb,
        "DELETE FROM operating_mode_refusals",
        "operating_mode_refusals",
    ),
    t(
        "lock_server",
        Database::Lockdb,
        "DELETE FROM lock_audit",
        "lock_audit",
    ),
    t(
        "lock_server",
        Database::Lockdb,
        "ALTER TABLE lock_audit DISABLE TRIGGER ALL",
        "lock_audit",
    ),
    t(
        "lock_server",
        Database::Lockdb,
        "SET session_replication_role = replica",
        "lock_audit",
    ),
];

fn server_of(db: Database) -> PgServer {
    match db {
        Database::Proxydb => PgServer::Proxy,
        _ => PgServer::Main,
    }
}

/// Runs `statement` on one connection of `url`, in a transaction rolled back either way: Ok, or
/// the SQLSTATE of the refusal.
async fn as_role(url: &str, statement: &str) -> Result<(), String> {
    run_rolled_back(url, None, statement).await
}

async fn run_rolled_back(url: &str, prelude: Option<&str>, statement: &str) -> Result<(), String> {
    use sqlx::Connection;
    let mut conn = sqlx::PgConnection::connect(url)
        .await
        .map_err(|e| format!("connect: {e}"))?;
    let mut tx = conn.begin().await.map_err(|e| format!("begin: {e}"))?;
    if let Some(prelude) = prelude {
        sqlx::raw_sql(prelude)
            .execute(&mut *tx)
            .await
            .map_err(|e| format!("prelude: {e}"))?;
    }
    let answer = sqlx::raw_sql(statement).execute(&mut *tx).await;
    let _ = tx.rollback().await;
    match answer {
        Ok(_) => Ok(()),
        Err(sqlx::Error::Database(e)) => Err(e.code().map(|c| c.to_string()).unwrap_or_default()),
        Err(e) => Err(e.to_string()),
    }
}

/// Connects once: Ok, or the SQLSTATE of the refusal.
async fn connect_code(url: &str) -> Result<(), String> {
    use sqlx::Connection;
    match sqlx::PgConnection::connect(url).await {
        Ok(conn) => {
            let _ = conn.close().await;
            Ok(())
        }
        Err(sqlx::Error::Database(e)) => Err(e.code().map(|c| c.to_string()).unwrap_or_default()),
        Err(e) => Err(e.to_string()),
    }
}

/// The table's rows as text, in order: equal before and after means nothing was written.
async fn fingerprint(admin_url: &str, table: &str) -> String {
    let pool = sqlx::PgPool::connect(admin_url).await.unwrap();
    let text: Option<String> = sqlx::query_scalar(&format!(
        "SELECT md5(string_agg(t::text, '|' ORDER BY t::text)) || ':' || count(*) FROM {table} t"
    ))
    .fetch_one(&pool)
    .await
    .unwrap();
    testkit::util::close_pool(pool).await;
    text.unwrap_or_default()
}

/// How often the server log records a refusal of `statement` by `role` (the stack's servers log
/// `user@database` before each message, and every error with its statement).
fn logged(log: &std::path::Path, role: &str, statement: &str) -> usize {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let mut n = 0;
    let mut refused_by_role = false;
    for line in text.lines() {
        if line.contains(&format!("{role}@")) && line.contains("ERROR:") {
            refused_by_role = true;
        } else if refused_by_role && line.contains("STATEMENT:") {
            if line.contains(statement) {
                n += 1;
            }
            refused_by_role = false;
        }
    }
    n
}

/// Negative control of section 6: as the superuser, with the triggers switched off the way only a
/// superuser can (`SET LOCAL session_replication_role = replica`), every tampering statement is
/// accepted (each in a transaction rolled back). The statements are real and well-formed; what
/// refuses them in the suite is the service roles' lack of privilege, not a typo or a missing
/// table.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn negative_control_as_the_superuser_every_tampering_statement_runs() {
    let stack = Stack::shared();
    let mut urls = std::collections::HashMap::new();
    for db in Database::ALL {
        urls.insert(db, stack.provisioned_db(server_of(db), db).await);
    }
    let mut accepted = Vec::new();
    for t in TAMPERING {
        let answer = run_rolled_back(
            &urls[&t.database],
            Some("SET LOCAL session_replication_role = replica"),
            t.statement,
        )
        .await;
        println!(
            "superuser on {}: {} -> {answer:?}",
            t.database.name(),
            t.statement
        );
        accepted.push(answer.is_ok());
    }
    assert!(accepted.iter().all(|ok| *ok), "{accepted:?}");
}

fn leak(s: String) -> &'static str {
    Box::leak(s.into_boxed_str())
}
