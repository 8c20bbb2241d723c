//! The shipped worker refuses a bad Temporal or deployment setting at start, naming it, before
//! it waits for any service (the binary, as a deployment runs it; no server needed).

use std::process::Command;
use std::time::{Duration, Instant};

/// The refusal comes before any connection attempt: well under a second here.
const REFUSAL_WITHIN: Duration = Duration::from_secs(20);

fn refusal(env: &[(&str, &str)]) -> String {
    let started = Instant::now();
    let out = Command::new(env!("CARGO_BIN_EXE_payout-worker"))
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        // No config file of the developer's own leaks in.
        .env("TEMPORAL_CONFIG_FILE", "/nonexistent/temporal.toml")
        // Required, but read only after the settings under test (so they may point nowhere).
        .env("PAYOUT_TLS_CA", "/nonexistent/ca.pem")
        .env("PAYOUT_TLS_CERT", "/nonexistent/worker.pem")
        .env("PAYOUT_TLS_KEY", "/nonexistent/worker.key")
        .envs(env.iter().copied())
        .output()
        .unwrap();
    assert!(!out.status.success(), "{env:?} was accepted");
    assert!(
        started.elapsed() < REFUSAL_WITHIN,
        "{env:?}: refused only after {:?}",
        started.elapsed()
    );
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn a_bad_setting_stops_the_worker_at_start_naming_it() {
    for (env, setting) in [
        (vec![("TEMPORAL_TLS", "perhaps")], "TEMPORAL_TLS"),
        (
            vec![("TEMPORAL_ADDRESS", "not an address")],
            "TEMPORAL_ADDRESS",
        ),
        (
            vec![("TEMPORAL_TLS_CLIENT_CERT_PATH", "/nonexistent/client.pem")],
            "TEMPORAL_TLS_CLIENT_CERT_PATH",
        ),
        (vec![("TEMPORAL_PROFILE", "nosuch")], "TEMPORAL_PROFILE"),
        (
            vec![("PAYOUT_WORKER_DEPLOYMENT_NAME", "pay.outs")],
            "PAYOUT_WORKER_DEPLOYMENT_NAME",
        ),
    ] {
        let stderr = refusal(&env);
        assert!(stderr.contains(setting), "{env:?}: {stderr}");
    }
}
