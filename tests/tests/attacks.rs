//! The attack suite (issue 17, section 5), against a real system: every service is its own
//! process, started by its binary, serving mutual TLS and its real authorisation table. Each case
//! is someone who can reach a port and tries one thing; it asserts the specific refusal, that
//! nothing was written, and that the refusal was recorded where an operator would see it (a
//! metric on the service's `/metrics`, or the guard's audit). The suite prints a table of the
//! cases and their results, then fails if any case did not hold.
//!
//! Cases still to come with the rest of issue 17: operator signatures (an unsigned and a wrongly
//! signed abandon) and tampering SQL as each service's database role.

use std::time::Duration;

use grant_signing::Signer;
use payment_client::model::{Fence, NewPayout};
use payment_client::{PaymentClient, PaymentError};
use payout_domain::{
    AccountId, AmountMinor, BeneficiaryRef, Currency, FencingToken, PayoutId, PayoutState,
};
use payout_proto::{ledger, lock, payment, railproxy};
use testkit::pki::Role;
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
    let url = format!("http://127.0.0.1:{}/metrics", system.ports.metrics[index]);
    match reqwest::get(url).await {
        Ok(r) => r.text().await.unwrap_or_default(),
        Err(_) => String::new(),
    }
}

/// The value of the sample of `name` whose labels contain every one of `labels`.
fn sample(text: &str, name: &str, labels: &[&str]) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(&format!("{name}{{")))
        .filter(|l| labels.iter().all(|want| l.contains(want)))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

const METRICS_LOCK: usize = 0;
const METRICS_PAYMENT: usize = 1;
const METRICS_PROXY: usize = 3;
const METRICS_GL: usize = 4;

async fn channel(system: &System, role: Role, url: &str, server: Role) -> Channel {
    system.tls(role).connect(url, server).await.unwrap()
}

async fn count(url: &str, sql: &str) -> i64 {
    let pool = sqlx::PgPool::connect(url).await.unwrap();
    let n = sqlx::query_scalar(sql).fetch_one(&pool).await.unwrap();
    pool.close().await;
    n
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
        let mut pay = payment::payment_resource_client::PaymentResourceClient::new(
            channel(
                &system,
                Role::Worker,
                &system.payment_url(),
                Role::PaymentResource,
            )
            .await,
        );
        let code = code_of(
            pay.open_account(payment::OpenAccountRequest {
                account_id: "attack-funded".into(),
                currency: "EUR".into(),
                opening_balance_minor: 1_000_000_000,
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
        let mut pay = payment::payment_resource_client::PaymentResourceClient::new(
            channel(
                &system,
                Role::LockServer,
                &system.payment_url(),
                Role::PaymentResource,
            )
            .await,
        );
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
            fixture
                .open_account(&AccountId::parse(account).unwrap(), &eur, 10_000)
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
        let lock = lock_client::LockClient::connect(&system.lock_url(), &system.tls(Role::Worker))
            .await
            .unwrap();
        let session = lock
            .open_session("attacker", Duration::from_secs(10))
            .await
            .unwrap();
        let lock_client::Acquired::Granted(grant_a) = session
            .acquire(
                &payout_domain::lock_key(&AccountId::parse("attack-a").unwrap()),
                Duration::from_secs(5),
            )
            .await
            .unwrap()
        else {
            panic!("no grant for A");
        };
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
        let mut pay = payment::payment_resource_client::PaymentResourceClient::new(
            channel(
                &system,
                Role::Fixture,
                &system.payment_url(),
                Role::PaymentResource,
            )
            .await,
        );
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
            expected: "refused, nothing written, still serving",
            held: code.is_some() && before == after && serving,
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

fn leak(s: String) -> &'static str {
    Box::leak(s.into_boxed_str())
}
