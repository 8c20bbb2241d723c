//! Attack rows 3a and 3b of issue 33 (design section 4): Temporal is reached only through its mutual-TLS front, by
//! the roles that need it, and its UI only with a login. Every refusal happens before any call
//! reaches the dev server: at the TLS handshake, at the front's role check (a gRPC
//! PERMISSION_DENIED the front answers itself), or at the isolation rules on the raw ports.
//!
//! The clients are the real ones: the `temporal` CLI (grpc-go, as operators use it) for gRPC,
//! curl for the UI. Controls: the operator's certificate through the front answers; the dev
//! server's own user reaches the raw port the rules close to everyone else; and a dev server
//! started without the isolation (test code only) answers on its raw port, so the refusal seen
//! with it is the rules' doing.

use std::process::{Command, Output};

use testkit::pki::{Pki, Role};
use testkit::temporal::{TemporalDev, TemporalOptions, TemporalPorts, UI_USER};
use testkit::temporal_front::{cli_tls_flags, front_user, SERVER_NAME};
use testkit::Lifetime;

/// Bounds one probe; a refused one ends at once, an answered one in well under a second.
const PROBE_TIMEOUT: &str = "20s";

/// `temporal operator namespace describe` at `address` with `flags`: a call every admitted role
/// could make, and that shows the namespace when it gets through.
fn describe(address: &str, flags: &[String]) -> Output {
    Command::new(testkit::temporal::cli_path().unwrap())
        .args(["operator", "namespace", "describe", "--namespace"])
        .arg(testkit::temporal::NAMESPACE)
        .args(["--address", address, "--command-timeout", PROBE_TIMEOUT])
        .args(flags)
        .output()
        .unwrap()
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// The probe got through: the namespace was described.
fn answered(out: &Output) -> bool {
    out.status.success() && text(out).contains(testkit::temporal::NAMESPACE)
}

fn assert_refused(case: &str, out: &Output, because: &[&str]) {
    let said = text(out);
    assert!(!answered(out), "{case}: answered:\n{said}");
    assert!(
        because.iter().any(|b| said.contains(b)),
        "{case}: refused, but not for the expected reason ({because:?}):\n{said}"
    );
    let reason = said.lines().find(|l| !l.trim().is_empty()).unwrap_or("");
    eprintln!("{case}: refused: {reason}");
}

/// The certificate files of `role` from `pki`, in a folder of their own (with that authority's
/// `ca.pem`).
fn certificate(pki: &Pki, role: Role, name: &str, dir: &std::path::Path) -> Vec<String> {
    cli_tls_flags(&pki.issue_into(role, name, &dir.join(name)).unwrap())
}

fn ui_status(url: &str, ca: &std::path::Path, login: Option<(&str, &str)>) -> String {
    let login = login.map(|(user, password)| format!("{user}:{password}"));
    testkit::temporal_front::ui_status(url, ca, login.as_deref()).unwrap()
}

/// A dev server behind its front, with its UI, certificates from `pki`, in `dir`.
fn start(dir: &std::path::Path, pki: &Pki, isolate: bool) -> TemporalDev {
    TemporalDev::start(
        &dir.join("temporal"),
        TemporalPorts::free(true),
        TemporalOptions {
            lifetime: Lifetime::Attached,
            isolate,
        },
        pki,
    )
    .unwrap()
}

#[test]
fn temporal_is_reached_only_through_the_front() {
    let dir = tempfile::tempdir().unwrap();
    let pki = Pki::in_dir(dir.path()).unwrap();
    let temporal = start(dir.path(), &pki, true);
    let front = temporal.address();
    let ca = temporal.client_files(Role::Operator).ca.clone();

    // Control: the operator's certificate through the front answers.
    let operator = cli_tls_flags(temporal.client_files(Role::Operator));
    let out = describe(&front, &operator);
    assert!(
        answered(&out),
        "the operator through the front: {}",
        text(&out)
    );
    // So does every other admitted role.
    for role in [Role::Worker, Role::Reconciler, Role::OutboxDispatcher] {
        let out = describe(&front, &cli_tls_flags(temporal.client_files(role)));
        assert!(answered(&out), "{role} through the front: {}", text(&out));
    }

    // No client certificate: the front's TLS layer refuses (nginx answers 400 to the request,
    // which never reaches the server).
    let server_only = vec![
        "--tls-ca-path".to_string(),
        ca.display().to_string(),
        "--tls-server-name".to_string(),
        SERVER_NAME.to_string(),
    ];
    assert_refused(
        "no client certificate",
        &describe(&front, &server_only),
        &["No required SSL certificate was sent"],
    );

    // A certificate of another authority, of the operator role: refused at the handshake.
    let stranger = Pki::in_dir(&dir.path().join("stranger")).unwrap();
    let foreign = certificate(&stranger, Role::Operator, "mallory", dir.path());
    let mut foreign_trusting_us = foreign.clone();
    // It trusts our front's authority, so only the front's check can refuse it.
    let ca_at = foreign_trusting_us
        .iter()
        .position(|a| a == "--tls-ca-path")
        .unwrap();
    foreign_trusting_us[ca_at + 1] = ca.display().to_string();
    assert_refused(
        "another authority's certificate",
        &describe(&front, &foreign_trusting_us),
        &["The SSL certificate error"],
    );

    // Plaintext to the front: nothing but TLS is spoken there.
    assert_refused(
        "plaintext to the front",
        &describe(&front, &[]),
        &["the server requires TLS"],
    );

    // A certificate of our authority whose role does not need Temporal: the front's role check,
    // answered as a gRPC PERMISSION_DENIED with the front's message, which the Go CLI prints
    // (the compose suite reads the code itself through the Rust SDK).
    for (role, name) in [
        (Role::Intake, "intake-1"),
        (Role::PaymentResource, "payment-resource"),
        (Role::Fixture, "fixture"),
    ] {
        let flags = certificate(&pki, role, name, dir.path());
        assert_refused(
            &format!("a {role} certificate"),
            &describe(&front, &flags),
            &[testkit::temporal_front::DENIED_MESSAGE],
        );
    }

    // Issue 34, row 1d: a leaked operator certificate denied on the front's list (the line
    // `payoutctl pki deny` writes) is refused whatever its role, as gRPC PERMISSION_DENIED with
    // the front's own message, once the front has reloaded (waited for, not slept); another
    // operator's certificate is served throughout.
    let leaked_files = pki
        .issue_into(Role::Operator, "leaked", &dir.path().join("leaked"))
        .unwrap();
    let leaked = cli_tls_flags(&leaked_files);
    assert!(
        answered(&describe(&front, &leaked)),
        "the leaked certificate before its denial"
    );
    let entry = mtls::denylist::entry_of_pem(&std::fs::read(&leaked_files.cert).unwrap()).unwrap();
    mtls::denylist::append(&temporal.front_denylist(), &entry, "row 1d").unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let refused = loop {
        let out = describe(&front, &leaked);
        if text(&out).contains(testkit::temporal_front::REVOKED_MESSAGE) {
            break out;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the denied certificate is still served: {}",
            text(&out)
        );
        std::thread::sleep(std::time::Duration::from_millis(200));
    };
    assert_refused(
        "a denied operator certificate",
        &refused,
        &[testkit::temporal_front::REVOKED_MESSAGE],
    );
    assert!(
        answered(&describe(&front, &operator)),
        "another operator's certificate after the denial"
    );

    // The UI: a login first (3b), for the page and for its API (which shows beneficiaries).
    let ui = temporal.ui_url().unwrap();
    let api = format!("{ui}/api/v1/namespaces/default/workflows");
    let password = std::fs::read_to_string(temporal.ui_password_file().unwrap()).unwrap();
    for url in [&ui, &api] {
        assert_eq!(ui_status(url, &ca, None), "401", "{url} without a login");
        assert_eq!(
            ui_status(url, &ca, Some((UI_USER, "not-the-password"))),
            "401",
            "{url} with a wrong password"
        );
        // Control: the login made for the stack gets in.
        assert_eq!(
            ui_status(url, &ca, Some((UI_USER, &password))),
            "200",
            "{url} with the login"
        );
    }

    // The raw ports: the frontend, its HTTP API (a second way into WorkflowService) and the raw
    // UI, closed to everyone but the dev server's own user.
    if front_user().unwrap().is_none() {
        eprintln!("not root: the raw ports are not isolated here (CI runs as root)");
        return;
    }
    assert!(temporal.isolated());
    assert_refused(
        "the raw frontend port",
        &describe(&temporal.raw_address(), &[]),
        // The REJECT's TCP reset: the CLI reads it as a refused connection.
        &["connection refused", "connection reset"],
    );
    for (what, port, path) in [
        (
            "the raw HTTP API",
            temporal.ports.http,
            "/api/v1/namespaces/default",
        ),
        ("the raw UI", temporal.ports.raw_ui.unwrap(), "/"),
    ] {
        let got = testkit::util::http_get(port, path, std::time::Duration::from_secs(10));
        assert!(got.is_err(), "{what} answered: {got:?}");
    }

    // Control: the dev server's own user (what nginx runs as) reaches the raw port.
    let (uid, gid) = front_user().unwrap().unwrap();
    let mut as_front = Command::new(testkit::temporal::cli_path().unwrap());
    {
        use std::os::unix::process::CommandExt;
        as_front.uid(uid).gid(gid);
    }
    let out = as_front
        .env("HOME", "/tmp")
        .args([
            "operator",
            "namespace",
            "describe",
            "--namespace",
            "default",
        ])
        .args(["--address", &temporal.raw_address()])
        .output()
        .unwrap();
    assert!(
        answered(&out),
        "the front's user on the raw port: {}",
        text(&out)
    );
}

/// The isolation's negative control: a dev server started without it (test code only) answers
/// on its raw port, plaintext, to anyone: the refusal above is the rules' doing.
#[test]
fn without_the_isolation_the_raw_port_answers_anyone() {
    if front_user().unwrap().is_none() {
        eprintln!("not root: nothing is isolated here, so nothing to switch off");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let pki = Pki::in_dir(dir.path()).unwrap();
    let temporal = start(dir.path(), &pki, false);
    assert!(!temporal.isolated());
    let out = describe(&temporal.raw_address(), &[]);
    assert!(answered(&out), "{}", text(&out));
    let got = testkit::util::http_get(
        temporal.ports.raw_ui.unwrap(),
        "/",
        std::time::Duration::from_secs(10),
    );
    assert!(got.is_ok_and(|(status, _)| status == 200));
}
