//! Connecting to Temporal, starting a payout workflow and awaiting its result.
//!
//! Every process that talks to Temporal (the worker, the reconciler and its resolver, payoutdev,
//! payoutctl) connects through [`connect_configured`] with a [`TemporalArgs`]: the connection is
//! configured the way the `temporal` CLI is (the SDK's environment configuration), so pointing the
//! system at another cluster or at Temporal Cloud is configuration only:
//!
//! | setting | flag | environment | profile key (`temporal.toml`) |
//! |---|---|---|---|
//! | address | `--temporal-address` | `TEMPORAL_ADDRESS` | `address` |
//! | namespace | `--temporal-namespace` | `TEMPORAL_NAMESPACE` | `namespace` |
//! | API key (turns TLS on) | | `TEMPORAL_API_KEY` | `api_key` |
//! | TLS on/off | | `TEMPORAL_TLS` | `tls.disabled` |
//! | client certificate and key | | `TEMPORAL_TLS_CLIENT_CERT_PATH`, `TEMPORAL_TLS_CLIENT_KEY_PATH` (or `_DATA`) | `tls.client_cert_path`, `tls.client_key_path` |
//! | server CA, SNI name | | `TEMPORAL_TLS_SERVER_CA_CERT_PATH` (or `_DATA`), `TEMPORAL_TLS_SERVER_NAME` | `tls.server_ca_cert_path`, `tls.server_name` |
//! | profile, config file | `--temporal-profile`, `--temporal-config-file` | `TEMPORAL_PROFILE`, `TEMPORAL_CONFIG_FILE` | |
//!
//! Precedence: a flag, then the environment, then the profile of the config file (by default
//! `~/.config/temporalio/temporal.toml`, profile `default`), then `127.0.0.1:7233` / `default`.
//! A bad setting is refused at start with an error naming it.
//!
//! ```text
//! let client = payout_workflows::client::connect_configured(&args, "payoutctl").await?;
//! let id = payout_workflows::client::start_payout(&client, "payouts", &input).await?;
//! let result = payout_workflows::client::wait_result(&client, &id, Duration::from_secs(120)).await?;
//! ```

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Duration;

use payout_activities::types::{PayoutInput, PayoutStartInput};
use temporalio_client::errors::{
    ClientConnectError, WorkflowGetResultError, WorkflowQueryError, WorkflowStartError,
};
use temporalio_client::{
    Client, ClientOptions, ConnectionOptions, Url, WorkflowGetResultOptions, WorkflowQueryOptions,
};
use temporalio_common::envconfig::{
    load_client_config_profile, ClientConfigProfile, DataSource, LoadClientConfigProfileOptions,
};

use crate::{PayoutResult, PayoutStatus, PayoutWorkflow};

#[derive(Debug, thiserror::Error)]
pub enum PayoutClientError {
    #[error("TEMPORAL_ADDRESS must be host:port, got {0}")]
    BadAddress(String),
    /// The Temporal connection's configuration is refused; `setting` names where it came from
    /// (a flag, an environment variable, or a profile of the config file).
    #[error("Temporal connection setting {setting}: {detail}")]
    Config { setting: String, detail: String },
    #[error("connecting to Temporal: {0}")]
    Connect(#[from] ClientConnectError),
    #[error("connecting to Temporal at {target} (namespace {namespace}): {source}")]
    ConnectTo {
        target: String,
        namespace: String,
        source: ClientConnectError,
    },
    /// A workflow for this payout exists (running or closed): the start is refused, by design.
    #[error("a workflow already exists for {workflow_id}")]
    AlreadyStarted { workflow_id: String },
    #[error("starting {workflow_id}: {source}")]
    Start {
        workflow_id: String,
        source: WorkflowStartError,
    },
    #[error("the workflow {workflow_id} failed: {source}")]
    Result {
        workflow_id: String,
        source: WorkflowGetResultError,
    },
    #[error("no result for {workflow_id} within {timeout:?}")]
    Timeout {
        workflow_id: String,
        timeout: Duration,
    },
    #[error("query on {workflow_id}: {source}")]
    Query {
        workflow_id: String,
        source: WorkflowQueryError,
    },
}

/// The address used when neither a flag, the environment nor a profile names one: the local dev
/// server (the SDK's own default, `localhost`, may resolve to `::1`, where the dev server is not).
pub const DEFAULT_ADDRESS: &str = "127.0.0.1:7233";
/// The namespace used when nothing names one (Temporal's own default).
pub const DEFAULT_NAMESPACE: &str = "default";

/// Where Temporal is and how to reach it, configured as the `temporal` CLI is (see the module
/// documentation for every setting). The flags override the environment, which overrides the
/// config file's profile.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct TemporalArgs {
    /// Temporal frontend, host:port or a URL. Overrides TEMPORAL_ADDRESS and the profile's
    /// address; default 127.0.0.1:7233. TLS, the API key and client certificates come from the
    /// environment (TEMPORAL_TLS*, TEMPORAL_API_KEY) or the profile, as for the temporal CLI.
    #[arg(long = "temporal-address", value_name = "HOST:PORT")]
    pub address: Option<String>,
    /// Temporal namespace. Overrides TEMPORAL_NAMESPACE and the profile's namespace; default
    /// `default`.
    #[arg(long = "temporal-namespace", value_name = "NAMESPACE")]
    pub namespace: Option<String>,
    /// The profile of the Temporal config file to use. Overrides TEMPORAL_PROFILE; default
    /// `default`.
    #[arg(long = "temporal-profile", value_name = "NAME")]
    pub profile: Option<String>,
    /// The Temporal config file (TOML, as `temporal config` writes it). Overrides
    /// TEMPORAL_CONFIG_FILE; default ~/.config/temporalio/temporal.toml when it exists.
    #[arg(long = "temporal-config-file", value_name = "PATH")]
    pub config_file: Option<PathBuf>,
}

/// A resolved Temporal connection: what [`connect_to`] dials.
#[derive(Debug, Clone)]
pub struct TemporalTarget {
    pub connection: ConnectionOptions,
    pub namespace: String,
}

impl TemporalTarget {
    /// `host:port` (or the URL) and the namespace, for logs; never the key or the certificates.
    pub fn describe(&self) -> String {
        format!(
            "{} namespace {}{}",
            self.connection.target,
            self.namespace,
            match (&self.connection.tls_options, &self.connection.api_key) {
                (_, Some(_)) => " (TLS, API key)",
                (Some(_), None) => " (TLS)",
                (None, None) => "",
            }
        )
    }
}

impl TemporalArgs {
    /// These settings for an explicit address and namespace (the test kit's servers).
    pub fn at(address: impl Into<String>, namespace: impl Into<String>) -> Self {
        Self {
            address: Some(address.into()),
            namespace: Some(namespace.into()),
            ..Self::default()
        }
    }

    /// The settings of `profile` in the config file `config_file` (address, namespace and TLS):
    /// the test kit's clients, one profile per role, through the Temporal front.
    pub fn profile_of(config_file: impl Into<PathBuf>, profile: impl Into<String>) -> Self {
        Self {
            config_file: Some(config_file.into()),
            profile: Some(profile.into()),
            ..Self::default()
        }
    }

    /// Resolves the connection from the flags, the process's environment and the config file.
    pub fn resolve(&self) -> Result<TemporalTarget, PayoutClientError> {
        self.resolve_in(None)
    }

    /// The same with `env` standing for the process's environment (tests).
    pub fn resolve_with_env(
        &self,
        env: &HashMap<String, String>,
    ) -> Result<TemporalTarget, PayoutClientError> {
        self.resolve_in(Some(env))
    }

    fn resolve_in(
        &self,
        env: Option<&HashMap<String, String>>,
    ) -> Result<TemporalTarget, PayoutClientError> {
        let var = |name: &str| -> Option<String> {
            match env {
                Some(map) => map.get(name).cloned(),
                None => std::env::var(name).ok(),
            }
            .filter(|v| !v.is_empty())
        };
        check_tls_flag(env)?;
        let config_file = self
            .config_file
            .as_ref()
            .map(|p| p.display().to_string())
            .or_else(|| var("TEMPORAL_CONFIG_FILE"));
        let profile_name = self.profile.clone().or_else(|| var("TEMPORAL_PROFILE"));
        let in_profile = |key: &str| {
            format!(
                "{key} of profile {} in {}",
                profile_name.as_deref().unwrap_or("default"),
                config_file
                    .as_deref()
                    .unwrap_or("the default config file (~/.config/temporalio/temporal.toml)")
            )
        };
        // Where a setting came from, for an error that names it.
        let origin = |flag: Option<&str>, flag_given: bool, var_name: &str, key: &str| {
            if flag_given {
                flag.unwrap_or(var_name).to_string()
            } else if var(var_name).is_some() {
                var_name.to_string()
            } else {
                in_profile(key)
            }
        };
        if let Some(path) = &self.config_file {
            if !path.is_file() {
                return Err(PayoutClientError::Config {
                    setting: "--temporal-config-file".into(),
                    detail: format!("{} is not a readable file", path.display()),
                });
            }
        }
        let options = LoadClientConfigProfileOptions::builder()
            .maybe_config_source(
                self.config_file
                    .as_ref()
                    .map(|p| DataSource::Path(p.display().to_string())),
            )
            .maybe_config_file_profile(self.profile.clone())
            // A misspelt key in the file is refused rather than silently ignored.
            .config_file_strict(true)
            .build();
        let mut profile = load_client_config_profile(options, env).map_err(|e| {
            let setting = match (&self.profile, var("TEMPORAL_PROFILE")) {
                (Some(_), _) => "--temporal-profile".to_string(),
                (None, Some(_)) => "TEMPORAL_PROFILE".to_string(),
                _ if self.config_file.is_some() => "--temporal-config-file".to_string(),
                _ if var("TEMPORAL_CONFIG_FILE").is_some() => "TEMPORAL_CONFIG_FILE".to_string(),
                _ => "the Temporal environment (TEMPORAL_*) or config file".to_string(),
            };
            PayoutClientError::Config {
                setting,
                detail: e.to_string(),
            }
        })?;
        if let Some(address) = &self.address {
            profile.address = Some(address.clone());
        }
        if let Some(namespace) = &self.namespace {
            profile.namespace = Some(namespace.clone());
        }
        check_profile(&profile, &origin, self)?;
        let namespace = profile
            .namespace
            .clone()
            .unwrap_or_else(|| DEFAULT_NAMESPACE.to_string());
        if profile.address.is_none() {
            profile.address = Some(DEFAULT_ADDRESS.to_string());
        }
        let address_origin = origin(
            Some("--temporal-address"),
            self.address.is_some(),
            "TEMPORAL_ADDRESS",
            "address",
        );
        let connection =
            ConnectionOptions::try_from(profile).map_err(|e| PayoutClientError::Config {
                setting: address_origin,
                detail: e.to_string(),
            })?;
        Ok(TemporalTarget {
            connection,
            namespace,
        })
    }
}

type Origin<'a> = dyn Fn(Option<&str>, bool, &str, &str) -> String + 'a;

/// What the SDK would accept silently or report without naming the setting.
fn check_profile(
    profile: &ClientConfigProfile,
    origin: &Origin<'_>,
    args: &TemporalArgs,
) -> Result<(), PayoutClientError> {
    let refuse =
        |setting: String, detail: String| Err(PayoutClientError::Config { setting, detail });
    if let Some(address) = &profile.address {
        let setting = origin(
            Some("--temporal-address"),
            args.address.is_some(),
            "TEMPORAL_ADDRESS",
            "address",
        );
        let with_scheme = if address.contains("://") {
            address.clone()
        } else {
            format!("http://{address}")
        };
        match Url::parse(&with_scheme) {
            Ok(url)
                if url.host_str().is_some_and(|h| !h.is_empty())
                    && url.port_or_known_default().is_some() => {}
            _ => return refuse(setting, format!("{address:?} is not host:port or a URL")),
        }
    }
    if profile.namespace.as_deref() == Some("") {
        return refuse(
            origin(
                Some("--temporal-namespace"),
                args.namespace.is_some(),
                "TEMPORAL_NAMESPACE",
                "namespace",
            ),
            "is empty".into(),
        );
    }
    if let Some(tls) = &profile.tls {
        if tls.disable_host_verification {
            return refuse(
                origin(
                    None,
                    false,
                    "TEMPORAL_TLS_DISABLE_HOST_VERIFICATION",
                    "tls.disable_host_verification",
                ),
                "is not supported: the payout system always verifies Temporal's certificate \
                 (name a CA with TEMPORAL_TLS_SERVER_CA_CERT_PATH and the name with \
                 TEMPORAL_TLS_SERVER_NAME instead)"
                    .into(),
            );
        }
        for (source, var_name, key) in [
            (
                &tls.client_cert,
                "TEMPORAL_TLS_CLIENT_CERT_PATH",
                "tls.client_cert_path",
            ),
            (
                &tls.client_key,
                "TEMPORAL_TLS_CLIENT_KEY_PATH",
                "tls.client_key_path",
            ),
            (
                &tls.server_ca_cert,
                "TEMPORAL_TLS_SERVER_CA_CERT_PATH",
                "tls.server_ca_cert_path",
            ),
        ] {
            if let Some(DataSource::Path(path)) = source {
                if let Err(e) = std::fs::metadata(path).and_then(|m| {
                    if m.is_file() {
                        Ok(())
                    } else {
                        Err(std::io::Error::other("not a file"))
                    }
                }) {
                    return refuse(origin(None, false, var_name, key), format!("{path}: {e}"));
                }
            }
        }
        if tls.client_cert.is_some() != tls.client_key.is_some() {
            let (var_name, key) = if tls.client_cert.is_some() {
                ("TEMPORAL_TLS_CLIENT_KEY_PATH", "tls.client_key_path")
            } else {
                ("TEMPORAL_TLS_CLIENT_CERT_PATH", "tls.client_cert_path")
            };
            return refuse(
                format!("{var_name} (or {key} in the profile)"),
                "is missing: a client certificate and its key go together".into(),
            );
        }
    }
    Ok(())
}

/// Checks a `TEMPORAL_TLS` value the SDK would otherwise ignore when it is not a boolean.
fn check_tls_flag(env: Option<&HashMap<String, String>>) -> Result<(), PayoutClientError> {
    let value = match env {
        Some(map) => map.get("TEMPORAL_TLS").cloned(),
        None => std::env::var("TEMPORAL_TLS").ok(),
    };
    match value.as_deref().map(str::to_ascii_lowercase).as_deref() {
        None | Some("") | Some("true" | "1" | "false" | "0") => Ok(()),
        Some(other) => Err(PayoutClientError::Config {
            setting: "TEMPORAL_TLS".into(),
            detail: format!("{other:?} is not true, false, 1 or 0"),
        }),
    }
}

/// Resolves `args` (flags, environment, config file) and connects, as `identity`.
pub async fn connect_configured(
    args: &TemporalArgs,
    identity: &str,
) -> Result<Client, PayoutClientError> {
    connect_to(&args.resolve()?, identity).await
}

/// Connects to a resolved target, as `identity`.
pub async fn connect_to(
    target: &TemporalTarget,
    identity: &str,
) -> Result<Client, PayoutClientError> {
    let mut connection = target.connection.clone();
    connection.identity = identity.to_string();
    Client::connect(
        connection,
        ClientOptions::new(target.namespace.clone()).build(),
    )
    .await
    .map_err(|source| PayoutClientError::ConnectTo {
        target: target.connection.target.to_string(),
        namespace: target.namespace.clone(),
        source,
    })
}

/// Starts the payout's workflow (id `payout-{payout_id}`) on `task_queue` and returns its id.
/// The payout must exist in the payment resource (CreatePayout) first.
pub async fn start_payout(
    client: &Client,
    task_queue: &str,
    input: &PayoutInput,
) -> Result<String, PayoutClientError> {
    start_with(client, crate::start_options(task_queue, input), input).await
}

/// The same under another workflow id (see [`crate::start_options_with_id`]): tests only.
pub async fn start_payout_with_id(
    client: &Client,
    task_queue: &str,
    input: &PayoutInput,
    workflow_id: &str,
) -> Result<String, PayoutClientError> {
    let options = crate::start_options_with_id(task_queue, input, workflow_id.to_string());
    start_with(client, options, input).await
}

async fn start_with(
    client: &Client,
    options: temporalio_client::WorkflowStartOptions,
    input: &PayoutInput,
) -> Result<String, PayoutClientError> {
    let workflow_id = options.workflow_id.clone();
    match client
        .start_workflow(PayoutWorkflow::run, PayoutStartInput::from(input), options)
        .await
    {
        Ok(_) => Ok(workflow_id),
        Err(WorkflowStartError::AlreadyStarted { .. }) => {
            Err(PayoutClientError::AlreadyStarted { workflow_id })
        }
        Err(source) => Err(PayoutClientError::Start {
            workflow_id,
            source,
        }),
    }
}

/// Waits for the workflow's result, at most `timeout`.
pub async fn wait_result(
    client: &Client,
    workflow_id: &str,
    timeout: Duration,
) -> Result<PayoutResult, PayoutClientError> {
    let handle = client.get_workflow_handle::<PayoutWorkflow>(workflow_id);
    match tokio::time::timeout(
        timeout,
        handle.get_result(WorkflowGetResultOptions::default()),
    )
    .await
    {
        Ok(Ok(result)) => Ok(result),
        Ok(Err(source)) => Err(PayoutClientError::Result {
            workflow_id: workflow_id.to_string(),
            source,
        }),
        Err(_) => Err(PayoutClientError::Timeout {
            workflow_id: workflow_id.to_string(),
            timeout,
        }),
    }
}

/// The `status` query: state, token, claimer, last event, whether the SLA has passed.
pub async fn status(client: &Client, workflow_id: &str) -> Result<PayoutStatus, PayoutClientError> {
    client
        .get_workflow_handle::<PayoutWorkflow>(workflow_id)
        .query(PayoutWorkflow::status, (), WorkflowQueryOptions::default())
        .await
        .map_err(|source| PayoutClientError::Query {
            workflow_id: workflow_id.to_string(),
            source,
        })
}
