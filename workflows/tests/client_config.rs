//! The Temporal connection's configuration (`client::TemporalArgs`): the `temporal` CLI's
//! settings (environment, config file profiles), flags over the environment over the profile,
//! and a bad setting refused with its name. No server: these resolve, they do not dial.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use payout_workflows::client::{PayoutClientError, TemporalArgs, TemporalTarget};

/// A directory of its own per test, removed at the end.
struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Self {
        let dir = std::env::temp_dir().join(format!(
            "payout-client-config-{name}-{}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Self(dir)
    }
    fn write(&self, name: &str, content: &str) -> PathBuf {
        let path = self.0.join(name);
        std::fs::write(&path, content).unwrap();
        path
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// An environment with no config file (the developer's own `~/.config` never leaks in).
fn env(pairs: &[(&str, &str)], dir: &Path) -> HashMap<String, String> {
    let mut env: HashMap<String, String> = pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    env.entry("TEMPORAL_CONFIG_FILE".into())
        .or_insert_with(|| dir.join("absent.toml").display().to_string());
    env
}

fn resolve(args: &TemporalArgs, env: &HashMap<String, String>) -> TemporalTarget {
    args.resolve_with_env(env)
        .unwrap_or_else(|e| panic!("refused: {e}"))
}

fn refusal(args: &TemporalArgs, env: &HashMap<String, String>) -> (String, String) {
    match args.resolve_with_env(env) {
        Err(PayoutClientError::Config { setting, detail }) => (setting, detail),
        Err(other) => panic!("another error: {other}"),
        Ok(target) => panic!("accepted: {}", target.describe()),
    }
}

#[test]
fn defaults_are_the_local_dev_server() {
    let dir = Scratch::new("defaults");
    let target = resolve(&TemporalArgs::default(), &env(&[], &dir.0));
    assert_eq!(target.connection.target.as_str(), "http://127.0.0.1:7233/");
    assert_eq!(target.namespace, "default");
    assert!(target.connection.tls_options.is_none());
    assert!(target.connection.api_key.is_none());
}

#[test]
fn the_environment_configures_address_namespace_tls_and_api_key() {
    let dir = Scratch::new("env");
    let ca = dir.write("ca.pem", "ca");
    let cert = dir.write("client.pem", "cert");
    let key = dir.write("client.key", "key");
    let target = resolve(
        &TemporalArgs::default(),
        &env(
            &[
                ("TEMPORAL_ADDRESS", "payouts.a1b2c.tmprl.cloud:7233"),
                ("TEMPORAL_NAMESPACE", "payouts.a1b2c"),
                ("TEMPORAL_TLS_CLIENT_CERT_PATH", cert.to_str().unwrap()),
                ("TEMPORAL_TLS_CLIENT_KEY_PATH", key.to_str().unwrap()),
                ("TEMPORAL_TLS_SERVER_CA_CERT_PATH", ca.to_str().unwrap()),
                ("TEMPORAL_TLS_SERVER_NAME", "payouts.a1b2c.tmprl.cloud"),
            ],
            &dir.0,
        ),
    );
    // TLS settings make a scheme-less address https.
    assert_eq!(
        target.connection.target.as_str(),
        "https://payouts.a1b2c.tmprl.cloud:7233/"
    );
    assert_eq!(target.namespace, "payouts.a1b2c");
    let tls = target.connection.tls_options.expect("TLS on");
    assert_eq!(tls.server_root_ca_cert.as_deref(), Some(&b"ca"[..]));
    assert_eq!(tls.domain.as_deref(), Some("payouts.a1b2c.tmprl.cloud"));
    let client = tls.client_tls_options.expect("client certificate");
    assert_eq!(client.client_cert, b"cert");
    assert_eq!(client.client_private_key, b"key");

    // An API key alone turns TLS on, as Temporal Cloud needs.
    let target = resolve(
        &TemporalArgs::default(),
        &env(
            &[
                ("TEMPORAL_ADDRESS", "eu-west-1.aws.api.temporal.io:7233"),
                ("TEMPORAL_API_KEY", "secret-key"),
            ],
            &dir.0,
        ),
    );
    assert_eq!(target.connection.api_key.as_deref(), Some("secret-key"));
    assert!(target.connection.tls_options.is_some());
    assert!(
        !target.describe().contains("secret-key"),
        "the key is never logged"
    );
}

#[test]
fn flags_override_the_environment_which_overrides_the_profile() {
    let dir = Scratch::new("precedence");
    let file = dir.write(
        "temporal.toml",
        r#"
[profile.default]
address = "from-file:7233"
namespace = "file-ns"

[profile.cloud]
address = "cloud.example:7233"
namespace = "cloud-ns"
api_key = "cloud-key"
"#,
    );
    let file_env = |pairs: &[(&str, &str)]| {
        let mut e = env(pairs, &dir.0);
        e.insert("TEMPORAL_CONFIG_FILE".into(), file.display().to_string());
        e
    };
    // The profile alone.
    let t = resolve(&TemporalArgs::default(), &file_env(&[]));
    assert_eq!(t.connection.target.as_str(), "http://from-file:7233/");
    assert_eq!(t.namespace, "file-ns");
    // The environment over the profile.
    let t = resolve(
        &TemporalArgs::default(),
        &file_env(&[("TEMPORAL_ADDRESS", "from-env:7233")]),
    );
    assert_eq!(t.connection.target.as_str(), "http://from-env:7233/");
    assert_eq!(t.namespace, "file-ns");
    // A flag over both.
    let t = resolve(
        &TemporalArgs {
            address: Some("from-flag:7233".into()),
            namespace: Some("flag-ns".into()),
            ..TemporalArgs::default()
        },
        &file_env(&[
            ("TEMPORAL_ADDRESS", "from-env:7233"),
            ("TEMPORAL_NAMESPACE", "env-ns"),
        ]),
    );
    assert_eq!(t.connection.target.as_str(), "http://from-flag:7233/");
    assert_eq!(t.namespace, "flag-ns");
    // Another profile, by TEMPORAL_PROFILE and by the flag.
    for (args, pairs) in [
        (TemporalArgs::default(), vec![("TEMPORAL_PROFILE", "cloud")]),
        (
            TemporalArgs {
                profile: Some("cloud".into()),
                config_file: Some(file.clone()),
                ..TemporalArgs::default()
            },
            vec![],
        ),
    ] {
        let t = resolve(&args, &file_env(&pairs));
        assert_eq!(t.connection.target.as_str(), "https://cloud.example:7233/");
        assert_eq!(t.namespace, "cloud-ns");
        assert_eq!(t.connection.api_key.as_deref(), Some("cloud-key"));
    }
}

#[test]
fn a_bad_setting_is_refused_with_its_name() {
    let dir = Scratch::new("refused");
    let cert = dir.write("client.pem", "cert");
    /// The settings, the environment, and the setting the refusal must name.
    type Case<'a> = (TemporalArgs, Vec<(&'a str, String)>, &'a str);
    let cases: Vec<Case> = vec![
        (
            TemporalArgs::default(),
            vec![("TEMPORAL_ADDRESS", "not an address".into())],
            "TEMPORAL_ADDRESS",
        ),
        (
            TemporalArgs {
                address: Some("::::".into()),
                ..TemporalArgs::default()
            },
            vec![],
            "--temporal-address",
        ),
        (
            TemporalArgs::default(),
            vec![("TEMPORAL_TLS", "yes please".into())],
            "TEMPORAL_TLS",
        ),
        (
            TemporalArgs::default(),
            vec![(
                "TEMPORAL_TLS_CLIENT_CERT_PATH",
                dir.0.join("missing.pem").display().to_string(),
            )],
            "TEMPORAL_TLS_CLIENT_CERT_PATH",
        ),
        (
            TemporalArgs::default(),
            vec![("TEMPORAL_TLS_CLIENT_CERT_PATH", cert.display().to_string())],
            "TEMPORAL_TLS_CLIENT_KEY_PATH",
        ),
        (
            TemporalArgs::default(),
            vec![("TEMPORAL_TLS_DISABLE_HOST_VERIFICATION", "true".into())],
            "TEMPORAL_TLS_DISABLE_HOST_VERIFICATION",
        ),
        (
            TemporalArgs::default(),
            vec![("TEMPORAL_PROFILE", "nosuch".into())],
            "TEMPORAL_PROFILE",
        ),
        (
            TemporalArgs {
                config_file: Some(dir.0.join("nosuch.toml")),
                ..TemporalArgs::default()
            },
            vec![],
            "--temporal-config-file",
        ),
    ];
    for (args, pairs, setting) in cases {
        let pairs: Vec<(&str, &str)> = pairs.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let (named, detail) = refusal(&args, &env(&pairs, &dir.0));
        assert!(
            named.contains(setting),
            "{pairs:?}: refused under {named:?} ({detail}), expected {setting}"
        );
    }

    // A misspelt key in the config file is refused, naming the file's profile.
    let file = dir.write(
        "typo.toml",
        "[profile.default]\naddres = \"somewhere:7233\"\n",
    );
    let (named, detail) = refusal(
        &TemporalArgs::default(),
        &env(&[("TEMPORAL_CONFIG_FILE", file.to_str().unwrap())], &dir.0),
    );
    assert!(named.contains("TEMPORAL_CONFIG_FILE"), "{named}: {detail}");
    assert!(detail.contains("addres"), "{detail}");
}
