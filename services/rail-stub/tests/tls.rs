//! The stub's TLS listener (src/tls.rs), against real handshakes: a client certificate of the
//! rail's authority is served, none or another authority's is refused; the admin listener serves
//! the harness's certificate only; the reset fault is still a reset under TLS; the test kit's rail
//! authority issues what the stub requires.

use std::time::Duration;

use axum::extract::ConnectInfo;
use axum::routing::get;
use axum::Router;
use rail_stub::tls::{server_config, Clients, TlsListener, HARNESS_NAME};
use rail_stub::ConnectionHandle;
use testkit::pki::Pki;

/// An authority and what a test needs of it: the stub's TLS, and client identities by name.
struct Rail {
    pki: Pki,
    _dir: tempfile::TempDir,
}

impl Rail {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let pki = Pki::in_dir(dir.path()).unwrap();
        Self { pki, _dir: dir }
    }

    fn stub_tls(&self) -> mtls::Tls {
        self.pki
            .issue_named(&rail_stub::SERVER_NAMES, "rail-stub")
            .unwrap()
            .tls()
    }

    /// An HTTPS client trusting this authority, presenting a certificate named `name` from
    /// `issuer` (none: no client certificate).
    fn client(&self, issuer: Option<(&Rail, &str)>) -> reqwest::Client {
        let mut builder = reqwest::Client::builder()
            .timeout(Duration::from_secs(10))
            .tls_built_in_root_certs(false)
            .add_root_certificate(
                reqwest::Certificate::from_pem(
                    std::fs::read(self.pki.ca_file()).unwrap().as_slice(),
                )
                .unwrap(),
            );
        if let Some((issuer, name)) = issuer {
            let issued = issuer.pki.issue_named(&[name], name).unwrap();
            let identity = reqwest::Identity::from_pem(
                format!("{}{}", issued.cert_pem, issued.key_pem).as_bytes(),
            )
            .unwrap();
            builder = builder.identity(identity);
        }
        builder.build().unwrap()
    }
}

/// Serves `/hello` and `/reset` (which resets its own connection) behind a TLS listener; its
/// base URL.
async fn serve(rail: &Rail, clients: Clients) -> String {
    serve_as(&rail.stub_tls(), clients).await
}

/// [`serve`] with this server certificate.
async fn serve_as(server: &mtls::Tls, clients: Clients) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let config = server_config(server).unwrap();
    let tls = TlsListener::new(listener, config, clients).unwrap();
    let app = Router::new()
        .route("/hello", get(|| async { "hello" }))
        .route(
            "/reset",
            get(
                |ConnectInfo(connection): ConnectInfo<ConnectionHandle>| async move {
                    connection.reset();
                    "never read"
                },
            ),
        );
    tokio::spawn(async move {
        axum::serve(
            tls,
            app.into_make_service_with_connect_info::<ConnectionHandle>(),
        )
        .await
    });
    format!("https://127.0.0.1:{port}")
}

#[tokio::test]
async fn the_payments_listener_serves_a_client_of_the_rails_authority_only() {
    let (rail, other) = (Rail::new(), Rail::new());
    let base = serve(&rail, Clients::Authority).await;
    let merchant = rail.client(Some((&rail, "rail-proxy")));
    let answer = merchant.get(format!("{base}/hello")).send().await.unwrap();
    assert_eq!(answer.text().await.unwrap(), "hello");
    for (who, client) in [
        ("no client certificate", rail.client(None)),
        (
            "another authority's certificate",
            rail.client(Some((&other, "rail-proxy"))),
        ),
    ] {
        let refused = client.get(format!("{base}/hello")).send().await;
        assert!(refused.is_err(), "{who}: {refused:?}");
    }
    // A client that does not trust the stub's authority does not talk to it either.
    let foreign = other.client(Some((&rail, "rail-proxy")));
    assert!(foreign.get(format!("{base}/hello")).send().await.is_err());
}

#[tokio::test]
async fn the_admin_listener_serves_the_harness_only() {
    let rail = Rail::new();
    let base = serve(&rail, Clients::HarnessOnly).await;
    let harness = rail.client(Some((&rail, HARNESS_NAME)));
    let answer = harness.get(format!("{base}/hello")).send().await.unwrap();
    assert_eq!(answer.text().await.unwrap(), "hello");
    let merchant = rail.client(Some((&rail, "rail-proxy")));
    let refused = merchant.get(format!("{base}/hello")).send().await;
    assert!(
        refused.is_err(),
        "a merchant on the admin listener: {refused:?}"
    );
    // Control: the same merchant certificate is served where any client of the authority is.
    let payments = serve(&rail, Clients::Authority).await;
    assert!(merchant
        .get(format!("{payments}/hello"))
        .send()
        .await
        .is_ok());
}

#[tokio::test]
async fn a_reset_under_tls_reaches_the_client_as_no_answer() {
    let rail = Rail::new();
    let base = serve(&rail, Clients::Authority).await;
    let merchant = rail.client(Some((&rail, "rail-proxy")));
    let reset = merchant.get(format!("{base}/reset")).send().await;
    assert!(
        reset.is_err(),
        "a reset connection answers nothing: {reset:?}"
    );
    // The listener serves the next connection.
    let next = merchant.get(format!("{base}/hello")).send().await.unwrap();
    assert_eq!(next.text().await.unwrap(), "hello");
}

/// The test kit's rail authority (`testkit::rail`, which links no server and so states the stub's
/// names again) issues what the stub requires: its stub certificate is the one a client reaching
/// 127.0.0.1 accepts, its harness certificate is served on the admin listener and its proxy
/// certificate is not, and its names are the stub's own constants.
#[tokio::test]
async fn the_test_kits_rail_authority_issues_what_the_stub_requires() {
    assert_eq!(testkit::rail::HARNESS_NAME, HARNESS_NAME);
    assert_eq!(testkit::rail::STUB_NAMES, rail_stub::SERVER_NAMES);
    let dir = tempfile::tempdir().unwrap();
    let kit = testkit::rail::RailTls::issue(dir.path()).unwrap();
    let admin = serve_as(&kit.stub.load().unwrap(), Clients::HarnessOnly).await;
    let payments = serve_as(&kit.stub.load().unwrap(), Clients::Authority).await;
    let client = |identity: &testkit::rail::Identity| {
        rail_stub::client::http(Duration::from_secs(10), &identity.load().unwrap()).unwrap()
    };
    let (harness, proxy) = (client(&kit.harness), client(&kit.proxy));
    let answer = harness.get(format!("{admin}/hello")).send().await.unwrap();
    assert_eq!(answer.text().await.unwrap(), "hello");
    let answer = proxy.get(format!("{payments}/hello")).send().await.unwrap();
    assert_eq!(answer.text().await.unwrap(), "hello");
    let refused = proxy.get(format!("{admin}/hello")).send().await;
    assert!(
        refused.is_err(),
        "the proxy on the admin listener: {refused:?}"
    );
}
