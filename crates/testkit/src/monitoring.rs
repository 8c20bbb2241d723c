//! Prometheus and Alertmanager (Debian's `prometheus`, `prometheus-alertmanager`) as real
//! processes with the project's configuration (deploy/monitoring): the rules of `alerts.yml`, the
//! Prometheus template `prometheus.yml.in`, `alertmanager.yml`, and beside them the silence watch
//! (`reconciler watch-silences`, the workspace's binary), which Prometheus scrapes as the job
//! `silence-watch`. Used by the alerting tests and by `payoutdev stack up`. Targets are file-based
//! service discovery (`targets/*.json`), one group per job, so a part that starts later is added by
//! writing its file; Prometheus also scrapes itself and Alertmanager (jobs `prometheus`,
//! `alertmanager`).
//!
//! Both APIs answer only over TLS and only with a login (issue 34: one anonymous POST used to
//! silence every page): each binary's `--web.config.file` (`web-config.yml`) serves a certificate
//! of the monitoring's own authority (`pki/`) and lists the bcrypt hashes of three users,
//! [`PROMETHEUS_USER`] (Prometheus's own calls to Alertmanager and its scrapes of both),
//! [`SILENCE_WATCH_USER`] and [`OPERATOR_USER`] (people, the tests, `payoutdev`), whose passwords
//! are in `credentials/<user>.password` (0600), made afresh at every start. [`Api::open`] reads
//! the authority and the operator's password from there.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;

use crate::process::{Lifetime, ManagedProcess, ProcessSpec};
use crate::util::{eventually, free_port, workspace_root};

/// The Debian packages' binaries.
pub const PROMETHEUS_BIN: &str = "/usr/bin/prometheus";
pub const ALERTMANAGER_BIN: &str = "/usr/bin/prometheus-alertmanager";

/// How long Prometheus or Alertmanager may take to answer its readiness endpoint: both start in
/// well under a second here; ten seconds covers a loaded CI machine.
const READY_TIMEOUT_MS: u64 = 10_000;
/// One HTTP call to either API, on loopback.
const API_CALL_TIMEOUT_MS: u64 = 2_000;

/// The silence watch's process and scrape job name.
pub const SILENCE_WATCH_JOB: &str = "silence-watch";

/// The login Prometheus uses for Alertmanager and for its scrapes of itself and Alertmanager.
pub const PROMETHEUS_USER: &str = "prometheus";
/// The silence watch's login (it reads Prometheus's rules and Alertmanager's silences).
pub const SILENCE_WATCH_USER: &str = "silence-watch";
/// People's login: the UIs, `amtool`, the tests, `payoutdev stack status`.
pub const OPERATOR_USER: &str = "operator";
const USERS: [&str; 3] = [PROMETHEUS_USER, SILENCE_WATCH_USER, OPERATOR_USER];
/// bcrypt's cost for the logins' hashes: the passwords are 32 random characters (about 190 bits),
/// so the work factor protects nothing, and every API call and scrape pays it on 2 cores.
const BCRYPT_COST: u32 = 6;
/// The web configuration both binaries read (`--web.config.file`); absent when the API was left
/// open (a test's negative control).
pub const WEB_CONFIG: &str = "web-config.yml";

/// The authority that signed both APIs' certificate, under a monitoring directory.
pub fn ca_file(dir: &Path) -> PathBuf {
    dir.join(crate::pki::DIR).join("ca.pem")
}

/// Where a login's password is kept under a monitoring directory.
pub fn password_file(dir: &Path, user: &str) -> PathBuf {
    dir.join("credentials").join(format!("{user}.password"))
}

/// `user:$2y$06$...`: the bcrypt line of `password`, made by Debian's `htpasswd` (apache2-utils;
/// Prometheus and Alertmanager read no other hash), the password given on standard input.
pub fn bcrypt_line(user: &str, password: &str) -> anyhow::Result<String> {
    use std::io::Write;
    let mut child = std::process::Command::new("htpasswd")
        .args(["-niBC", &BCRYPT_COST.to_string(), user])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .context("htpasswd (Debian's apache2-utils; scripts/setup.sh installs it)")?;
    child
        .stdin
        .take()
        .context("htpasswd's standard input")?
        .write_all(password.as_bytes())?;
    let out = child.wait_with_output()?;
    anyhow::ensure!(
        out.status.success(),
        "htpasswd: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let line = String::from_utf8(out.stdout)?;
    let line = line.lines().next().unwrap_or_default().to_string();
    anyhow::ensure!(
        line.starts_with(&format!("{user}:$2")),
        "htpasswd printed no bcrypt line: {line:?}"
    );
    Ok(line)
}

/// Makes the monitoring's TLS and logins under `dir`: its authority (`pki/`, kept across starts),
/// a server certificate naming `127.0.0.1` and `localhost` (`tls/`), a fresh password per user
/// (`credentials/`, 0600) and `web-config.yml` with their bcrypt hashes. Returns the config's path.
fn write_web_config(dir: &Path) -> anyhow::Result<PathBuf> {
    let pki = crate::pki::Pki::in_dir(dir)?;
    let server = pki.issue_named(&["127.0.0.1", "localhost"], "monitoring")?;
    let tls = dir.join("tls");
    std::fs::create_dir_all(&tls)?;
    let (cert, key) = (tls.join("monitoring.pem"), tls.join("monitoring.key"));
    let _ = std::fs::remove_file(&key);
    std::fs::write(&cert, &server.cert_pem)?;
    crate::grants::write_secret(&key, &server.key_pem)?;
    let credentials = dir.join("credentials");
    std::fs::create_dir_all(&credentials)?;
    std::fs::set_permissions(
        &credentials,
        std::os::unix::fs::PermissionsExt::from_mode(0o700),
    )?;
    let mut users = String::new();
    for user in USERS {
        let password = mtls::htpasswd::random_password()?;
        let file = password_file(dir, user);
        let _ = std::fs::remove_file(&file);
        crate::grants::write_secret(&file, &password)?;
        let line = bcrypt_line(user, &password)?;
        let hash = line.split_once(':').map(|(_, h)| h).unwrap_or_default();
        users.push_str(&format!("  {user}: '{hash}'\n"));
    }
    let config = dir.join(WEB_CONFIG);
    std::fs::write(
        &config,
        format!(
            "# Written by testkit::monitoring: TLS and the logins of Prometheus's and \
             Alertmanager's APIs.\ntls_server_config:\n  cert_file: {}\n  key_file: {}\n  \
             min_version: TLS12\nbasic_auth_users:\n{users}",
            cert.display(),
            key.display()
        ),
    )?;
    Ok(config)
}

/// deploy/monitoring in the checkout.
pub fn config_dir() -> PathBuf {
    workspace_root().join("deploy/monitoring")
}

/// One scrape target: the `job` label and `host:port` of its `/metrics`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    pub job: String,
    pub address: String,
}

impl Target {
    pub fn local(job: &str, port: u16) -> Self {
        Self {
            job: job.to_string(),
            address: format!("127.0.0.1:{port}"),
        }
    }
}

/// What to start.
#[derive(Debug, Clone)]
pub struct MonitoringOptions {
    /// Scrape and rule evaluation interval (the tests use 1 s; the local stack 5 s).
    pub interval: Duration,
    /// Alert rules to leave out of `alerts.yml` (a test's negative control only).
    pub without_alerts: Vec<String>,
    pub prometheus_port: Option<u16>,
    pub alertmanager_port: Option<u16>,
    /// The silence watch's `/metrics` port (a free one if `None`).
    pub silence_watch_port: Option<u16>,
    /// Whether to run the silence watch (off: a test's negative control only, which must then
    /// see `SilenceWatchBlind`).
    pub silence_watch: bool,
    pub lifetime: Lifetime,
}

impl Default for MonitoringOptions {
    fn default() -> Self {
        Self {
            interval: Duration::from_secs(1),
            without_alerts: Vec::new(),
            prometheus_port: None,
            alertmanager_port: None,
            silence_watch_port: None,
            silence_watch: true,
            lifetime: Lifetime::Attached,
        }
    }
}

/// An alert as Alertmanager's `/api/v2/alerts` returns it (the fields the tests read).
#[derive(Debug, Clone, serde::Deserialize)]
pub struct Alert {
    pub labels: std::collections::BTreeMap<String, String>,
    pub annotations: std::collections::BTreeMap<String, String>,
    pub status: AlertStatus,
}

#[derive(Debug, Clone, serde::Deserialize)]
pub struct AlertStatus {
    pub state: String,
}

impl Alert {
    pub fn name(&self) -> &str {
        self.labels.get("alertname").map_or("", String::as_str)
    }
}

/// A scrape target's health as Prometheus's `/api/v1/targets` reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TargetHealth {
    pub job: String,
    pub address: String,
    pub health: String,
    pub last_scrape: String,
    /// Why the last scrape failed (empty when it did not).
    pub last_error: String,
}

pub struct Monitoring {
    pub dir: PathBuf,
    pub prometheus: ManagedProcess,
    pub alertmanager: ManagedProcess,
    /// The silence watch, unless [`MonitoringOptions::silence_watch`] was off.
    pub silence_watch: Option<ManagedProcess>,
    /// Its `/metrics` port, when it runs.
    pub silence_watch_port: Option<u16>,
    /// Their HTTP APIs (`monitoring.query(..)` and the rest reach it through `Deref`).
    pub api: Api,
}

impl Monitoring {
    /// The targets Prometheus scrapes besides the ones it was given: itself, Alertmanager and
    /// the silence watch (when it runs).
    pub fn watcher_targets(&self) -> Vec<Target> {
        let mut targets = vec![
            Target::local("prometheus", self.api.prometheus_port),
            Target::local("alertmanager", self.api.alertmanager_port),
        ];
        if let Some(port) = self.silence_watch_port {
            targets.push(Target::local(SILENCE_WATCH_JOB, port));
        }
        targets
    }
}

impl std::ops::Deref for Monitoring {
    type Target = Api;
    fn deref(&self) -> &Api {
        &self.api
    }
}

/// The HTTP APIs of a Prometheus and its Alertmanager on loopback: what the tests, `payoutdev
/// stack status` and the main job's summary ask of a running monitoring pair, whoever started it.
#[derive(Clone)]
pub struct Api {
    pub prometheus_port: u16,
    pub alertmanager_port: u16,
    /// The login sent on every call (none: an anonymous caller).
    login: Option<(String, String)>,
    http: reqwest::Client,
}

/// The rules file with the named alert rules left out (each rule is the block from its
/// `- alert: NAME` line to the next rule or group).
pub fn rules_without(rules: &str, without: &[String]) -> anyhow::Result<String> {
    let mut out = String::new();
    let mut skipping = false;
    let mut left_out = Vec::new();
    for line in rules.lines() {
        let trimmed = line.trim_start();
        if let Some(name) = trimmed.strip_prefix("- alert: ") {
            skipping = without.iter().any(|w| w == name.trim());
            if skipping {
                left_out.push(name.trim().to_string());
            }
        } else if trimmed.starts_with("- name: ") || trimmed.starts_with("groups:") {
            skipping = false;
        }
        if !skipping {
            out.push_str(line);
            out.push('\n');
        }
    }
    for w in without {
        anyhow::ensure!(left_out.contains(w), "no alert rule {w} in alerts.yml");
    }
    Ok(out)
}

/// Writes `dir/targets/<job>.json` (file-based service discovery; Prometheus rereads it).
pub fn write_targets(dir: &Path, targets: &[Target]) -> anyhow::Result<()> {
    let targets_dir = dir.join("targets");
    std::fs::create_dir_all(&targets_dir)?;
    let mut jobs: std::collections::BTreeMap<&str, Vec<&str>> = Default::default();
    for t in targets {
        jobs.entry(&t.job).or_default().push(&t.address);
    }
    for (job, addresses) in jobs {
        let group = serde_json::json!([{ "targets": addresses, "labels": { "job": job } }]);
        let path = targets_dir.join(format!("{job}.json"));
        let tmp = targets_dir.join(format!(".{job}.json.tmp"));
        std::fs::write(&tmp, serde_json::to_vec_pretty(&group)?)?;
        std::fs::rename(&tmp, &path).with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

/// Renders deploy/monitoring/prometheus.yml.in.
pub fn prometheus_config(
    interval: Duration,
    rules_file: &Path,
    targets_dir: &Path,
    alertmanager: &str,
    prometheus: &str,
    ca_file: &Path,
    password_file: &Path,
) -> anyhow::Result<String> {
    let template = std::fs::read_to_string(config_dir().join("prometheus.yml.in"))?;
    let interval = format!("{}ms", interval.as_millis());
    // Prometheus resolves a relative rule file or target glob against its configuration file's
    // own folder, not the working directory it was started from: a relative state directory
    // rendered as given made the local stack's Prometheus load no rule and scrape nothing.
    let rules_file = std::path::absolute(rules_file)?;
    let targets_dir = std::path::absolute(targets_dir)?;
    let ca_file = std::path::absolute(ca_file)?;
    let password_file = std::path::absolute(password_file)?;
    Ok(template
        .replace("@INTERVAL@", &interval)
        .replace("@MONITORING_CA@", &ca_file.display().to_string())
        .replace(
            "@PROMETHEUS_PASSWORD_FILE@",
            &password_file.display().to_string(),
        )
        .replace("@RULES_FILE@", &rules_file.display().to_string())
        .replace("@TARGETS_DIR@", &targets_dir.display().to_string())
        .replace("@ALERTMANAGER@", alertmanager)
        .replace("@PROMETHEUS@", prometheus))
}

/// An Alertmanager with the project's configuration (copied into `dir`), its data under `dir`,
/// listening on `127.0.0.1:port`, behind `web_config` (TLS and logins) when one is given; with
/// none its API is open to anyone, as it was before issue 34 (a test's negative control only).
pub fn alertmanager_spec(
    dir: &Path,
    port: u16,
    web_config: Option<&Path>,
) -> anyhow::Result<ProcessSpec> {
    let config = dir.join("alertmanager.yml");
    std::fs::copy(config_dir().join("alertmanager.yml"), &config)?;
    let mut spec = ProcessSpec::new(
        "alertmanager",
        ALERTMANAGER_BIN,
        dir.join("alertmanager.log"),
    )
    .arg(format!("--config.file={}", config.display()))
    .arg(format!(
        "--storage.path={}",
        dir.join("alertmanager-data").display()
    ))
    .arg(format!("--web.listen-address=127.0.0.1:{port}"))
    // No gossip cluster: a single instance, and no fixed port shared between stacks.
    .arg("--cluster.listen-address=");
    if let Some(web_config) = web_config {
        spec = spec.arg(format!("--web.config.file={}", web_config.display()));
    }
    Ok(spec)
}

impl Monitoring {
    /// Starts Alertmanager, then Prometheus scraping `targets` with the project's rules (minus
    /// `options.without_alerts`), both behind TLS and logins (`web-config.yml`), then the silence
    /// watch; state and logs under `dir`; waits until both APIs are ready.
    pub async fn start(
        dir: &Path,
        targets: &[Target],
        options: MonitoringOptions,
    ) -> anyhow::Result<Self> {
        std::fs::create_dir_all(dir)?;
        // Every path below goes into a configuration file or a command line that outlives this
        // call (a part restarted from another working directory): absolute, whatever was given.
        let dir = &std::path::absolute(dir)?;
        let rules = std::fs::read_to_string(config_dir().join("alerts.yml"))?;
        let rules_file = dir.join("alerts.yml");
        std::fs::write(&rules_file, rules_without(&rules, &options.without_alerts)?)?;
        let web_config = write_web_config(dir)?;
        let am_port = options.alertmanager_port.unwrap_or_else(free_port);
        let prom_port = options.prometheus_port.unwrap_or_else(free_port);
        let watch_port = options.silence_watch_port.unwrap_or_else(free_port);
        let mut targets = targets.to_vec();
        if options.silence_watch {
            targets.push(Target::local(SILENCE_WATCH_JOB, watch_port));
        }
        write_targets(dir, &targets)?;
        let alertmanager = ManagedProcess::start(
            alertmanager_spec(dir, am_port, Some(&web_config))?.lifetime(options.lifetime),
        )?;
        let prom_config = dir.join("prometheus.yml");
        std::fs::write(
            &prom_config,
            prometheus_config(
                options.interval,
                &rules_file,
                &dir.join("targets"),
                &format!("127.0.0.1:{am_port}"),
                &format!("127.0.0.1:{prom_port}"),
                &ca_file(dir),
                &password_file(dir, PROMETHEUS_USER),
            )?,
        )?;
        let prometheus = ManagedProcess::start(
            ProcessSpec::new("prometheus", PROMETHEUS_BIN, dir.join("prometheus.log"))
                .arg(format!("--config.file={}", prom_config.display()))
                .arg(format!(
                    "--storage.tsdb.path={}",
                    dir.join("prometheus-data").display()
                ))
                .arg(format!("--web.listen-address=127.0.0.1:{prom_port}"))
                .arg(format!("--web.config.file={}", web_config.display()))
                .lifetime(options.lifetime),
        )?;
        let silence_watch = if options.silence_watch {
            Some(ManagedProcess::start(
                ProcessSpec::new(
                    SILENCE_WATCH_JOB,
                    crate::util::workspace_bin("reconciler"),
                    dir.join("silence-watch.log"),
                )
                .arg("watch-silences")
                .arg(format!("--prometheus-url=https://127.0.0.1:{prom_port}"))
                .arg(format!("--alertmanager-url=https://127.0.0.1:{am_port}"))
                .arg(format!("--ca-file={}", ca_file(dir).display()))
                .arg(format!("--username={SILENCE_WATCH_USER}"))
                .arg(format!(
                    "--password-file={}",
                    password_file(dir, SILENCE_WATCH_USER).display()
                ))
                .arg(format!("--metrics-listen=127.0.0.1:{watch_port}"))
                .arg(format!(
                    "--interval-ms={}",
                    options.interval.as_millis().max(1)
                ))
                .lifetime(options.lifetime),
            )?)
        } else {
            None
        };
        let monitoring = Self {
            dir: dir.to_path_buf(),
            prometheus,
            alertmanager,
            silence_watch_port: silence_watch.as_ref().map(|_| watch_port),
            silence_watch,
            api: Api::open(dir, prom_port, am_port)?,
        };
        for (url, process) in [
            (
                monitoring.alertmanager_url("/-/ready"),
                &monitoring.alertmanager,
            ),
            (
                monitoring.prometheus_url("/-/ready"),
                &monitoring.prometheus,
            ),
        ] {
            let api = monitoring.api.clone();
            eventually(
                Duration::from_millis(READY_TIMEOUT_MS),
                &format!(
                    "{} ready (log: {})",
                    process.name(),
                    process.log_path().display()
                ),
                || {
                    let (api, url) = (api.clone(), url.clone());
                    async move {
                        let r = api.get(&url).send().await.ok()?;
                        r.status().is_success().then_some(())
                    }
                },
            )
            .await?;
        }
        Ok(monitoring)
    }
}

impl Api {
    /// The APIs of the monitoring whose state is in `dir` (as [`Monitoring::start`] wrote it),
    /// on these loopback ports, as [`OPERATOR_USER`]: its authority and password read from there.
    pub fn open(dir: &Path, prometheus_port: u16, alertmanager_port: u16) -> anyhow::Result<Self> {
        let password =
            std::fs::read_to_string(password_file(dir, OPERATOR_USER)).with_context(|| {
                format!("the operator's monitoring password under {}", dir.display())
            })?;
        Self::with_login(
            dir,
            prometheus_port,
            alertmanager_port,
            Some((OPERATOR_USER.to_string(), password)),
        )
    }

    /// The same APIs with `login` (none: an anonymous caller, or any user and password a test
    /// tries), over TLS checked against the monitoring's authority.
    pub fn with_login(
        dir: &Path,
        prometheus_port: u16,
        alertmanager_port: u16,
        login: Option<(String, String)>,
    ) -> anyhow::Result<Self> {
        let ca = std::fs::read(ca_file(dir))
            .with_context(|| format!("the monitoring's authority under {}", dir.display()))?;
        Ok(Self {
            prometheus_port,
            alertmanager_port,
            login,
            http: reqwest::Client::builder()
                .timeout(Duration::from_millis(API_CALL_TIMEOUT_MS))
                .tls_built_in_root_certs(false)
                .add_root_certificate(reqwest::Certificate::from_pem(&ca)?)
                .build()?,
        })
    }

    /// `https://127.0.0.1:<prometheus>{path}`.
    pub fn prometheus_url(&self, path: &str) -> String {
        format!("https://127.0.0.1:{}{path}", self.prometheus_port)
    }

    /// `https://127.0.0.1:<alertmanager>{path}`.
    pub fn alertmanager_url(&self, path: &str) -> String {
        format!("https://127.0.0.1:{}{path}", self.alertmanager_port)
    }

    /// A GET of `url` with this API's login.
    pub fn get(&self, url: &str) -> reqwest::RequestBuilder {
        self.authorised(self.http.get(url))
    }

    /// A POST of `url` with this API's login.
    pub fn post(&self, url: &str) -> reqwest::RequestBuilder {
        self.authorised(self.http.post(url))
    }

    fn authorised(&self, request: reqwest::RequestBuilder) -> reqwest::RequestBuilder {
        match &self.login {
            Some((user, password)) => request.basic_auth(user, Some(password)),
            None => request,
        }
    }

    async fn get_json(&self, url: String) -> anyhow::Result<serde_json::Value> {
        let response = self.get(&url).send().await?;
        anyhow::ensure!(
            response.status().is_success(),
            "{url}: {}",
            response.status()
        );
        Ok(response.json().await?)
    }

    /// Every scrape target and its health (`up`, `down`, `unknown` before the first scrape).
    pub async fn targets(&self) -> anyhow::Result<Vec<TargetHealth>> {
        let v = self
            .get_json(self.prometheus_url("/api/v1/targets?state=active"))
            .await?;
        let active = v["data"]["activeTargets"]
            .as_array()
            .context("no activeTargets in /api/v1/targets")?;
        Ok(active
            .iter()
            .map(|t| TargetHealth {
                job: t["labels"]["job"].as_str().unwrap_or_default().to_string(),
                address: t["labels"]["instance"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string(),
                health: t["health"].as_str().unwrap_or_default().to_string(),
                last_scrape: t["lastScrape"].as_str().unwrap_or_default().to_string(),
                last_error: t["lastError"].as_str().unwrap_or_default().to_string(),
            })
            .collect())
    }

    /// Waits until every one of `expected` is a target Prometheus has scraped successfully and
    /// its `up` sample is queryable. Both are needed: the targets API reports a scrape's health
    /// before the scrape's samples are committed to the database, so a query made the moment the
    /// last target turns `up` can still miss that target's `up` series.
    pub async fn wait_targets_up(
        &self,
        expected: &[Target],
        timeout: Duration,
    ) -> anyhow::Result<Vec<TargetHealth>> {
        let waited = eventually(timeout, "every target scraped and up", || async {
            let targets = self.targets().await.ok()?;
            let up = self.query("up == 1").await.ok()?;
            expected
                .iter()
                .all(|e| {
                    targets
                        .iter()
                        .any(|t| t.job == e.job && t.address == e.address && t.health == "up")
                        && up.iter().any(|s| {
                            s["metric"]["job"] == e.job.as_str()
                                && s["metric"]["instance"] == e.address.as_str()
                        })
                })
                .then_some(targets)
        })
        .await;
        match waited {
            Ok(targets) => Ok(targets),
            Err(e) => Err(e.context(format!(
                "expected {expected:?}; Prometheus reports {:?}",
                self.targets().await
            ))),
        }
    }

    /// The number of completed evaluations of the rule groups so far is not exported; this is
    /// the time of each group's last evaluation (RFC 3339), by group name.
    pub async fn rule_group_evaluations(
        &self,
    ) -> anyhow::Result<std::collections::BTreeMap<String, String>> {
        let v = self.get_json(self.prometheus_url("/api/v1/rules")).await?;
        let groups = v["data"]["groups"]
            .as_array()
            .context("no groups in /api/v1/rules")?;
        Ok(groups
            .iter()
            .map(|g| {
                (
                    g["name"].as_str().unwrap_or_default().to_string(),
                    g["lastEvaluation"].as_str().unwrap_or_default().to_string(),
                )
            })
            .collect())
    }

    /// The names of the alert rules Prometheus loaded.
    pub async fn alert_rules(&self) -> anyhow::Result<Vec<String>> {
        let v = self
            .get_json(self.prometheus_url("/api/v1/rules?type=alert"))
            .await?;
        let mut names = Vec::new();
        for g in v["data"]["groups"].as_array().into_iter().flatten() {
            for r in g["rules"].as_array().into_iter().flatten() {
                names.push(r["name"].as_str().unwrap_or_default().to_string());
            }
        }
        Ok(names)
    }

    /// An instant query's result vector (`/api/v1/query`).
    pub async fn query(&self, promql: &str) -> anyhow::Result<Vec<serde_json::Value>> {
        let url = reqwest::Url::parse_with_params(
            &self.prometheus_url("/api/v1/query"),
            &[("query", promql)],
        )?;
        let v = self.get_json(url.to_string()).await?;
        Ok(v["data"]["result"].as_array().cloned().unwrap_or_default())
    }

    /// The alerts Prometheus itself holds as firing (`/api/v1/alerts`), by name.
    pub async fn prometheus_firing(&self) -> anyhow::Result<Vec<String>> {
        Ok(self
            .prometheus_firing_alerts()
            .await?
            .iter()
            .map(|labels| labels.get("alertname").cloned().unwrap_or_default())
            .collect())
    }

    /// The labels of each alert Prometheus holds as firing (`/api/v1/alerts`).
    pub async fn prometheus_firing_alerts(
        &self,
    ) -> anyhow::Result<Vec<std::collections::BTreeMap<String, String>>> {
        let v = self.get_json(self.prometheus_url("/api/v1/alerts")).await?;
        Ok(v["data"]["alerts"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|a| a["state"] == "firing")
            .map(|a| serde_json::from_value(a["labels"].clone()).unwrap_or_default())
            .collect())
    }

    /// Alertmanager's active alerts (`/api/v2/alerts`: firing, not silenced or inhibited).
    pub async fn alertmanager_alerts(&self) -> anyhow::Result<Vec<Alert>> {
        let url =
            self.alertmanager_url("/api/v2/alerts?active=true&silenced=false&inhibited=false");
        let response = self.get(&url).send().await?;
        anyhow::ensure!(
            response.status().is_success(),
            "{url}: {}",
            response.status()
        );
        Ok(response.json().await?)
    }
}

/// The severity of the always-firing `Watchdog` (deploy/monitoring/alerts.yml): a heartbeat, not
/// a problem; "nothing fires" means nothing but it.
pub const HEARTBEAT_SEVERITY: &str = "heartbeat";
/// The heartbeat alert's name.
pub const WATCHDOG: &str = "Watchdog";

impl Api {
    /// Creates a silence in Alertmanager (`POST /api/v2/silences`, with this API's login, as any
    /// operator can) of `matchers` (`(label, value, is_regex)`, each an equality), active from now for
    /// `duration`; its id.
    pub async fn create_silence(
        &self,
        matchers: &[(&str, &str, bool)],
        created_by: &str,
        comment: &str,
        duration: Duration,
    ) -> anyhow::Result<String> {
        let now = chrono::Utc::now();
        let at =
            |t: chrono::DateTime<chrono::Utc>| t.to_rfc3339_opts(chrono::SecondsFormat::Secs, true);
        let body = serde_json::json!({
            "matchers": matchers.iter().map(|(name, value, is_regex)| serde_json::json!({
                "name": name, "value": value, "isRegex": is_regex, "isEqual": true,
            })).collect::<Vec<_>>(),
            "startsAt": at(now - chrono::Duration::seconds(1)),
            "endsAt": at(now + chrono::Duration::seconds(duration.as_secs().max(60) as i64)),
            "createdBy": created_by,
            "comment": comment,
        });
        let url = self.alertmanager_url("/api/v2/silences");
        let response = self.post(&url).json(&body).send().await?;
        let status = response.status();
        let text = response.text().await?;
        anyhow::ensure!(status.is_success(), "{url}: {status}: {text}");
        let answer: serde_json::Value = serde_json::from_str(&text)?;
        answer["silenceID"]
            .as_str()
            .map(str::to_string)
            .with_context(|| format!("no silenceID in {answer}"))
    }

    /// Expires the silence `id` (`DELETE /api/v2/silence/{id}`, with this API's login), as an
    /// operator ends a silence that was not planned.
    pub async fn expire_silence(&self, id: &str) -> anyhow::Result<()> {
        let url = self.alertmanager_url(&format!("/api/v2/silence/{id}"));
        let response = self.authorised(self.http.delete(&url)).send().await?;
        let status = response.status();
        anyhow::ensure!(
            status.is_success(),
            "{url}: {status}: {}",
            response.text().await?
        );
        Ok(())
    }
}

/// Whether a running Prometheus is doing its job, against what it was configured with: every alert
/// rule of its rules file loaded, every target of its target files discovered and scraped up.
/// Prometheus answers `/-/ready` with no rule and no target at all (a rules path it could not
/// resolve is only a log line), so readiness alone says nothing about alerting.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct AlertingHealth {
    /// Alert rules in the rules file Prometheus was given.
    pub rules_expected: usize,
    /// Alert rules Prometheus reports loaded.
    pub rules_loaded: usize,
    /// `job@host:port` of every target in the target files.
    pub targets_expected: Vec<String>,
    /// Of those, the ones Prometheus does not report scraped and `up` (missing, `down` or not
    /// scraped yet), with its health and last error.
    pub targets_not_up: Vec<String>,
}

impl AlertingHealth {
    /// Each thing that keeps an alert from firing, in words; empty when alerting works.
    pub fn problems(&self) -> Vec<String> {
        let mut problems = Vec::new();
        if self.rules_expected == 0 {
            problems.push("the rules file holds no alert rule".to_string());
        } else if self.rules_loaded != self.rules_expected {
            problems.push(format!(
                "{} of {} alert rules loaded",
                self.rules_loaded, self.rules_expected
            ));
        }
        if self.targets_expected.is_empty() {
            problems.push("no scrape target configured".to_string());
        }
        if !self.targets_not_up.is_empty() {
            problems.push(format!(
                "{} of {} targets not up: {}",
                self.targets_not_up.len(),
                self.targets_expected.len(),
                self.targets_not_up.join(", ")
            ));
        }
        problems
    }
}

/// The alert rule names of a rules file (`- alert: NAME` lines).
pub fn rule_names(rules: &str) -> Vec<String> {
    rules_with_severity(rules)
        .into_iter()
        .map(|(name, _)| name)
        .collect()
}

/// `(name, severity)` of every alert rule of a rules file, in file order: each `- alert: NAME`
/// line with the `severity:` label of its block (empty when the block has none).
pub fn rules_with_severity(rules: &str) -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = Vec::new();
    for line in rules.lines().map(str::trim) {
        if let Some(name) = line.strip_prefix("- alert: ") {
            out.push((name.trim().to_string(), String::new()));
        } else if let (Some(severity), Some(last)) =
            (line.strip_prefix("severity:"), out.last_mut())
        {
            last.1 = severity.trim().trim_matches('"').to_string();
        }
    }
    out
}

/// `job@host:port` of every target in `dir/targets/*.json` (as [`write_targets`] writes them).
pub fn configured_targets(dir: &Path) -> anyhow::Result<Vec<String>> {
    let mut out = Vec::new();
    let targets_dir = dir.join("targets");
    let entries = std::fs::read_dir(&targets_dir)
        .with_context(|| format!("reading {}", targets_dir.display()))?;
    for entry in entries {
        let path = entry?.path();
        if path.extension().is_none_or(|e| e != "json") {
            continue;
        }
        let groups: serde_json::Value = serde_json::from_slice(&std::fs::read(&path)?)
            .with_context(|| format!("parsing {}", path.display()))?;
        for group in groups.as_array().into_iter().flatten() {
            let job = group["labels"]["job"].as_str().unwrap_or_default();
            for target in group["targets"].as_array().into_iter().flatten() {
                out.push(format!("{job}@{}", target.as_str().unwrap_or_default()));
            }
        }
    }
    out.sort();
    Ok(out)
}

impl Api {
    /// How the Prometheus of the monitoring state in `dir` (its `alerts.yml` and `targets/`, as
    /// [`Monitoring::start`] writes them) stands against that configuration.
    pub async fn alerting_health(&self, dir: &Path) -> anyhow::Result<AlertingHealth> {
        let rules_file = dir.join("alerts.yml");
        let expected_rules = rule_names(
            &std::fs::read_to_string(&rules_file)
                .with_context(|| format!("reading {}", rules_file.display()))?,
        );
        let loaded = self.alert_rules().await?;
        let targets_expected = configured_targets(dir)?;
        let active = self.targets().await?;
        let targets_not_up = targets_expected
            .iter()
            .filter_map(|expected| {
                let found = active
                    .iter()
                    .find(|t| format!("{}@{}", t.job, t.address) == *expected);
                match found {
                    Some(t) if t.health == "up" => None,
                    Some(t) if t.last_error.is_empty() => {
                        Some(format!("{expected} ({})", t.health))
                    }
                    Some(t) => Some(format!("{expected} ({}: {})", t.health, t.last_error)),
                    None => Some(format!("{expected} (not discovered)")),
                }
            })
            .collect();
        Ok(AlertingHealth {
            rules_loaded: expected_rules.iter().filter(|r| loaded.contains(r)).count(),
            rules_expected: expected_rules.len(),
            targets_expected,
            targets_not_up,
        })
    }
}

/// The scrape targets of a system (crates/testkit/src/system.rs): every service, the
/// dispatcher and every worker that serves `/metrics` (the rail stub's on its metrics listener).
pub fn system_targets(system: &crate::system::System) -> Vec<Target> {
    let ports = &system.ports;
    let mut targets = vec![
        Target::local("lock-server", ports.metrics[0]),
        Target::local("payment-resource", ports.metrics[1]),
        Target::local("rail-stub", ports.metrics[2]),
        Target::local("rail-proxy", ports.metrics[3]),
        Target::local("general-ledger", ports.metrics[4]),
        Target::local("outbox-dispatcher", ports.metrics[5]),
    ];
    targets.extend(
        system
            .worker_metrics
            .iter()
            .map(|port| Target::local("worker", *port)),
    );
    targets
}

/// The scrape targets of a stack's own parts: each etcd member's `/metrics`, and Temporal's if
/// it was started.
pub fn stack_targets(stack: &crate::stack::Stack) -> Vec<Target> {
    let mut targets: Vec<Target> = stack
        .etcd
        .members
        .iter()
        .map(|m| Target::local("etcd", m.metrics_port))
        .collect();
    if let Ok(temporal) = stack.try_temporal() {
        targets.push(Target::local("temporal", temporal.ports.metrics));
    }
    targets
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_relative_state_directory_is_rendered_absolute() {
        // A relative path in prometheus.yml is resolved against the file's own folder: the local
        // stack's default state directory (.state/stack) once left Prometheus with no rule.
        let rendered = prometheus_config(
            Duration::from_secs(5),
            Path::new(".state/stack/monitoring/alerts.yml"),
            Path::new(".state/stack/monitoring/targets"),
            "127.0.0.1:1",
            "127.0.0.1:2",
            Path::new(".state/stack/monitoring/pki/ca.pem"),
            Path::new(".state/stack/monitoring/credentials/prometheus.password"),
        )
        .unwrap();
        let cwd = std::env::current_dir().unwrap();
        let rules = cwd.join(".state/stack/monitoring/alerts.yml");
        let targets = cwd.join(".state/stack/monitoring/targets");
        assert!(
            rendered.contains(&format!("  - {}\n", rules.display())),
            "{rendered}"
        );
        assert!(
            rendered.contains(&format!("[\"{}/*.json\"]", targets.display())),
            "{rendered}"
        );
        assert!(
            rendered.contains(&format!(
                "ca_file: {}\n",
                cwd.join(".state/stack/monitoring/pki/ca.pem").display()
            )),
            "{rendered}"
        );
        assert_eq!(rendered.matches("scheme: https").count(), 3, "{rendered}");
        assert!(
            !rendered.contains("@"),
            "every placeholder replaced: {rendered}"
        );
    }

    #[test]
    fn the_rule_names_of_the_projects_rules_file() {
        let rules = std::fs::read_to_string(config_dir().join("alerts.yml")).unwrap();
        let names = rule_names(&rules);
        for name in ["FencedOut", "ServiceDown", "ReconcilerRunsFailing"] {
            assert!(names.contains(&name.to_string()), "{names:?}");
        }
        assert_eq!(names.len(), rules.matches("- alert: ").count());
    }

    #[test]
    fn alerting_health_names_each_thing_that_keeps_an_alert_dark() {
        let healthy = AlertingHealth {
            rules_expected: 2,
            rules_loaded: 2,
            targets_expected: vec!["etcd@127.0.0.1:1".into()],
            targets_not_up: vec![],
        };
        assert!(healthy.problems().is_empty());
        let dark = AlertingHealth {
            rules_loaded: 0,
            targets_not_up: vec!["etcd@127.0.0.1:1 (not discovered)".into()],
            ..healthy.clone()
        };
        assert_eq!(
            dark.problems(),
            [
                "0 of 2 alert rules loaded",
                "1 of 1 targets not up: etcd@127.0.0.1:1 (not discovered)"
            ]
        );
        let empty = AlertingHealth::default();
        assert_eq!(empty.problems().len(), 2, "{:?}", empty.problems());
    }

    #[test]
    fn a_rule_left_out_is_gone_and_the_others_stay() {
        let rules = std::fs::read_to_string(config_dir().join("alerts.yml")).unwrap();
        let without = rules_without(&rules, &["FencedOut".to_string()]).unwrap();
        assert!(rules.contains("- alert: FencedOut\n"));
        assert!(!without.contains("- alert: FencedOut\n"));
        assert!(!without.contains("fenced_out_total"));
        for kept in ["ForgedGrant", "ServiceDown", "OutboxBacklogOld"] {
            assert!(without.contains(&format!("- alert: {kept}\n")), "{kept}");
        }
        assert!(rules_without(&rules, &["NoSuchAlert".to_string()]).is_err());
    }
}

/// What an anonymous caller on the network sends Alertmanager (issue 34, row 3a): a silence over
/// every alert until 2099 and a fake page whose text reads like a runbook. One attack for the
/// alerting suite (an Alertmanager of the kit's) and the compose suite (the deployment's).
pub mod intruder {
    /// The silence's `comment` and `createdBy`, by which a test finds whether it was taken.
    pub const COMMENT: &str = "maintenance";
    pub const CREATED_BY: &str = "intruder";

    /// How one request of the attack ended.
    #[derive(Debug, Clone, PartialEq, Eq)]
    pub enum Answer {
        /// The API answered with this HTTP status.
        Status(u16),
        /// No connection (nothing listened).
        Refused(String),
        /// The request was sent and no answer was read: a TLS-only port answers plain HTTP
        /// with 400 and closes, and with part of the body unread the close may reset the
        /// connection before the answer is read.
        LostAfterSending(String),
    }

    /// The two requests, each as `(path, body)`.
    pub fn requests() -> [(&'static str, serde_json::Value); 2] {
        let silence = serde_json::json!({
            "matchers": [{"name": "alertname", "value": ".+", "isRegex": true, "isEqual": true}],
            "startsAt": "2026-01-01T00:00:00Z",
            "endsAt": "2099-01-01T00:00:00Z",
            "createdBy": CREATED_BY,
            "comment": COMMENT,
        });
        let fake_page = serde_json::json!([{
            "labels": {"alertname": "FencedOut", "severity": "page", "guard": "payment_resource"},
            "annotations": {"runbook": "run `payoutctl lock revoke --all` now"},
        }]);
        [("/api/v2/silences", silence), ("/api/v2/alerts", fake_page)]
    }

    /// Sends both to the Alertmanager at `base` (`http://...` or `https://...`, no path) with
    /// `http` as it is (no login added): how each ended, in [`requests`]' order.
    pub async fn attack(http: &reqwest::Client, base: &str) -> Vec<Answer> {
        let mut answers = Vec::new();
        for (path, body) in requests() {
            answers.push(
                match http.post(format!("{base}{path}")).json(&body).send().await {
                    Ok(response) => Answer::Status(response.status().as_u16()),
                    Err(e) if e.is_connect() => Answer::Refused(format!("{e:?}")),
                    Err(e) => Answer::LostAfterSending(format!("{e:?}")),
                },
            );
        }
        answers
    }

    /// Whether `silences` (Alertmanager's `/api/v2/silences`) holds one the attack created.
    pub fn took_a_silence(silences: &serde_json::Value) -> bool {
        silences
            .as_array()
            .into_iter()
            .flatten()
            .any(|s| s["comment"] == COMMENT && s["createdBy"] == CREATED_BY)
    }
}
