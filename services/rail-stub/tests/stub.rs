//! The stub over real HTTP: non-idempotence, every fault mode, the settlement window, and the
//! ground truth surviving a SIGKILL of the binary.

use std::time::Duration;

use rail_stub::client::{DirectAnswer, StubClient};
use rail_stub::{FaultMode, PaymentOrder, RunningStub, StubConfig};

fn order(reference: &str) -> PaymentOrder {
    PaymentOrder {
        client_reference: reference.into(),
        amount_minor: 250,
        currency: "EUR".into(),
        beneficiary_ref: "ben-1".into(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_request_twice_moves_money_twice() {
    let stub = RunningStub::start(StubConfig::default()).await.unwrap();
    let client = stub.client();
    let a = client.pay(&order("cref-twice")).await.unwrap();
    let b = client.pay(&order("cref-twice")).await.unwrap();
    assert!(
        matches!((&a, &b), (DirectAnswer::Accepted { rail_ref: x }, DirectAnswer::Accepted { rail_ref: y }) if x != y)
    );
    let truth = client.ground_truth().await.unwrap();
    assert_eq!(truth.movement_counts["cref-twice"], 2);
    assert_eq!(truth.submit_request_counts["cref-twice"], 2);
    stub.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_fault_mode_does_what_it_says() {
    let stub = RunningStub::start(StubConfig::default()).await.unwrap();
    let admin = stub.client();
    let client = StubClient::with_timeout(stub.endpoints(), Duration::from_millis(500)).unwrap();
    let modes = [
        FaultMode::Accept,
        FaultMode::Decline,
        FaultMode::FailBeforeActing,
        FaultMode::AcceptThenFail,
        FaultMode::AcceptThenHang,
        FaultMode::ResetBeforeActing,
        FaultMode::AcceptThenReset,
    ];
    for mode in modes {
        let reference = format!("cref-{mode:?}");
        admin.force(&reference, Some(mode)).await.unwrap();
        let answer = client.pay(&order(&reference)).await;
        match mode {
            FaultMode::Accept => assert!(
                matches!(answer, Ok(DirectAnswer::Accepted { .. })),
                "{answer:?}"
            ),
            FaultMode::Decline => {
                assert!(
                    matches!(answer, Ok(DirectAnswer::Declined { ref code }) if code == "INSUFFICIENT_FUNDS"),
                    "{answer:?}"
                )
            }
            FaultMode::FailBeforeActing => assert!(
                matches!(answer, Ok(DirectAnswer::Failed { status: 503, .. })),
                "{answer:?}"
            ),
            FaultMode::AcceptThenFail => assert!(
                matches!(answer, Ok(DirectAnswer::Failed { status: 500, .. })),
                "{answer:?}"
            ),
            FaultMode::AcceptThenHang => {
                let e = answer.expect_err("the response never comes");
                assert!(
                    matches!(&e, rail_stub::client::StubClientError::Http(h) if h.is_timeout()),
                    "{e:?}"
                );
            }
            FaultMode::ResetBeforeActing | FaultMode::AcceptThenReset => {
                let e = answer.expect_err("the connection is dropped without a response");
                assert!(
                    matches!(&e, rail_stub::client::StubClientError::Http(h) if !h.is_timeout()),
                    "{e:?}"
                );
            }
        }
        let truth = admin.ground_truth().await.unwrap();
        let moved = truth.movement_counts.get(&reference).copied().unwrap_or(0);
        assert_eq!(
            moved,
            u64::from(mode.moves_money()),
            "{mode:?}: an accepted payment is settled whatever the caller saw"
        );
        assert_eq!(truth.submit_request_counts[&reference], 1, "{mode:?}");
    }
    stub.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lookups_are_unknown_inside_the_settlement_window_then_authoritative() {
    let config = StubConfig {
        settlement_window: Duration::from_millis(300),
        ..Default::default()
    };
    let stub = RunningStub::start(config).await.unwrap();
    let client = stub.client();
    client
        .force("cref-none", Some(FaultMode::FailBeforeActing))
        .await
        .unwrap();
    client.pay(&order("cref-none")).await.unwrap();
    assert_eq!(client.lookup("cref-none").await.unwrap().state, "unknown");
    testkit::eventually(
        Duration::from_secs(5),
        "an authoritative absent",
        || async { (client.lookup("cref-none").await.unwrap().state == "absent").then_some(()) },
    )
    .await
    .unwrap();
    client.pay(&order("cref-paid")).await.unwrap();
    let found = client.lookup("cref-paid").await.unwrap();
    assert_eq!((found.state.as_str(), found.movements.len()), ("found", 1));
    stub.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn movements_survive_a_sigkill_of_the_stub() {
    let dir = tempfile::tempdir().unwrap();
    let rail = testkit::rail::RailTls::issue(dir.path()).unwrap();
    let (port, admin, metrics) = (
        testkit::free_port(),
        testkit::free_port(),
        testkit::free_port(),
    );
    let spec = testkit::ProcessSpec::new(
        "rail-stub",
        env!("CARGO_BIN_EXE_rail-stub"),
        dir.path().join("stub.log"),
    )
    .args([
        "--listen".to_string(),
        format!("127.0.0.1:{port}"),
        "--admin-listen".to_string(),
        format!("127.0.0.1:{admin}"),
        "--metrics-listen".to_string(),
        format!("127.0.0.1:{metrics}"),
        "--movements-file".to_string(),
        dir.path().join("movements.jsonl").display().to_string(),
    ])
    .args(
        testkit::grants::SigningKey::rail_answer(dir.path())
            .unwrap()
            .signing_args("answer"),
    )
    .args(rail.stub_args());
    let process = testkit::ManagedProcess::start(spec).unwrap();
    let client = StubClient::new(rail_stub::client::RailEndpoints {
        payments_url: format!("https://127.0.0.1:{port}"),
        admin_url: format!("https://127.0.0.1:{admin}"),
        tls: rail.harness.load().unwrap(),
    })
    .unwrap();
    let up = || async { client.ground_truth().await.ok() };
    testkit::eventually(Duration::from_secs(10), "the stub to listen", up)
        .await
        .unwrap();
    client.pay(&order("cref-durable")).await.unwrap();
    client.pay(&order("cref-durable")).await.unwrap();
    process.kill().unwrap();
    process.restart().unwrap();
    let truth = testkit::eventually(Duration::from_secs(10), "the restarted stub", up)
        .await
        .unwrap();
    assert_eq!(truth.movement_counts["cref-durable"], 2);
    let third = client.pay(&order("cref-other")).await.unwrap();
    assert_eq!(
        third,
        DirectAnswer::Accepted {
            rail_ref: "rr-00000003".into()
        },
        "sequence continues after restart"
    );
    process.terminate().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instruction_acted_on_after_its_valid_until_is_refused_and_moves_nothing() {
    // The rail takes 300 ms to act: an instruction valid for 100 ms reaches that point expired.
    let config = StubConfig {
        faults: rail_stub::FaultConfig {
            latency_ms_min: 300,
            latency_ms_max: 300,
            ..Default::default()
        },
        ..Default::default()
    };
    let stub = RunningStub::start(config).await.unwrap();
    let client = stub.client();
    let now = rail_stub::book::unix_ms_now();
    let late = rail_stub::PaymentRequest {
        order: order("cref-late"),
        valid_until_unix_ms: Some(now + 100),
    };
    assert_eq!(
        client.pay_request(&late).await.unwrap(),
        DirectAnswer::Declined {
            code: rail_stub::EXPIRED_DECLINE_CODE.into()
        }
    );
    // Already expired on arrival: refused too.
    let stale = rail_stub::PaymentRequest {
        order: order("cref-stale"),
        valid_until_unix_ms: Some(now - 1),
    };
    assert!(matches!(
        client.pay_request(&stale).await.unwrap(),
        DirectAnswer::Declined { code } if code == rail_stub::EXPIRED_DECLINE_CODE
    ));
    // Control: the same rail executes an instruction still valid when it acts, and one without
    // any expiry (what the proxy sent before instructions expired).
    let valid = rail_stub::PaymentRequest {
        order: order("cref-valid"),
        valid_until_unix_ms: Some(rail_stub::book::unix_ms_now() + 60_000),
    };
    assert!(matches!(
        client.pay_request(&valid).await.unwrap(),
        DirectAnswer::Accepted { .. }
    ));
    assert!(matches!(
        client.pay(&order("cref-forever")).await.unwrap(),
        DirectAnswer::Accepted { .. }
    ));
    let truth = client.ground_truth().await.unwrap();
    for reference in ["cref-late", "cref-stale"] {
        assert_eq!(truth.movement_counts.get(reference), None, "{reference}");
        assert_eq!(truth.expired_request_counts[reference], 1, "{reference}");
    }
    assert_eq!(truth.movement_counts["cref-valid"], 1);
    assert_eq!(truth.movement_counts["cref-forever"], 1);
    stub.stop().await.unwrap();
}

/// `rail-stub keygen` writes the secret (mode 0600) and prints the public line the proxy takes; it
/// never overwrites a key, and the stub serves with the key it made.
#[test]
fn keygen_makes_an_answer_key_once() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("answer.key");
    let keygen = || {
        std::process::Command::new(env!("CARGO_BIN_EXE_rail-stub"))
            .args(["keygen", "--key-id", "rail-2026-12", "--out"])
            .arg(&out)
            .output()
            .unwrap()
    };
    let made = keygen();
    assert!(made.status.success(), "{made:?}");
    let line = String::from_utf8(made.stdout).unwrap();
    let public: grant_signing::PublicKey = line.trim().parse().unwrap();
    assert_eq!(public.key_id, "rail-2026-12");
    let mode = std::fs::metadata(&out).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600);
    let secret = std::fs::read_to_string(&out).unwrap();
    let signer = grant_signing::Signer::from_hex("rail-2026-12", &secret).unwrap();
    assert_eq!(signer.public_key(), public);
    let again = keygen();
    assert!(
        !again.status.success(),
        "an existing key is never overwritten"
    );
    assert_eq!(std::fs::read_to_string(&out).unwrap(), secret);
}

/// Each API on its own listener only: the payments listener answers no admin path, the admin
/// listener no payments path (its own `/admin/payments` pays, outside the proxy), the metrics
/// listener only `/healthz` and `/metrics`. A deployment can then publish the admin API to the
/// harness without the rail's payments API, and the reverse.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_api_is_served_on_its_own_listener_only() {
    let stub = RunningStub::start(StubConfig::default()).await.unwrap();
    // The harness's certificate over TLS to the payments and admin APIs (each admits it), plain
    // HTTP to the metrics listener.
    let https = rail_stub::client::http(
        Duration::from_secs(10),
        &stub.identity(rail_stub::tls::HARNESS_NAME),
    )
    .unwrap();
    let plain = reqwest::Client::new();
    let metrics_addr = stub.metrics_addr;
    let status = |addr: std::net::SocketAddr, method: &str, path: &str| {
        let (http, scheme) = if addr == metrics_addr {
            (&plain, "http")
        } else {
            (&https, "https")
        };
        let request = match method {
            "POST" => {
                http.post(format!("{scheme}://{addr}{path}"))
                    .json(&rail_stub::PaymentRequest {
                        order: order("cref-listener"),
                        valid_until_unix_ms: None,
                    })
            }
            _ => http.get(format!("{scheme}://{addr}{path}")),
        };
        async move { request.send().await.unwrap().status().as_u16() }
    };
    let (payments, admin, metrics) = (stub.addr, stub.admin_addr, stub.metrics_addr);
    for (addr, method, path, want) in [
        (payments, "GET", "/v1/payments?client_reference=x", 200),
        (payments, "GET", "/admin/movements", 404),
        (payments, "POST", "/admin/faults", 404),
        (payments, "POST", "/admin/payments", 404),
        (payments, "GET", "/metrics", 404),
        (admin, "GET", "/admin/movements", 200),
        (admin, "GET", "/v1/payments?client_reference=x", 404),
        (admin, "POST", "/v1/payments", 404),
        (admin, "GET", "/healthz", 404),
        (metrics, "GET", "/healthz", 200),
        (metrics, "GET", "/metrics", 200),
        (metrics, "GET", "/admin/movements", 404),
        (metrics, "POST", "/v1/payments", 404),
    ] {
        assert_eq!(
            status(addr, method, path).await,
            want,
            "{method} {path} at {addr}"
        );
    }
    // Nothing moved through the paths that were refused; the admin API's own payment moves.
    assert!(stub
        .client()
        .ground_truth()
        .await
        .unwrap()
        .movements
        .is_empty());
    assert_eq!(status(admin, "POST", "/admin/payments").await, 200);
    let truth = stub.client().ground_truth().await.unwrap();
    assert_eq!(truth.movement_counts["cref-listener"], 1);
    stub.stop().await.unwrap();
}
