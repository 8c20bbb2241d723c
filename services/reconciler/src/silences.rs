//! The silence watch (`reconciler watch-silences`, issue 34): nothing may quietly mute a page.
//!
//! Any holder of a monitoring login (exporter-toolkit has no per-path permission; before issue 34
//! anyone who reached Alertmanager's port) can silence every page until 2099 with one POST.
//! Alertmanager itself only counts silences; it cannot say whether one hides a ticket or
//! `FencedOut`. So every [`INTERVAL_MS`] this process
//! asks Prometheus for its live alert rules (`/api/v1/rules?type=alert`, so it cannot drift from
//! what is evaluated) and Alertmanager for its active silences (`/api/v2/silences`), and exports,
//! for every rule whose static `severity` is `page` or `heartbeat`, how many active silences
//! **cover** it: `monitoring_page_alerts_silenced{rule}` (not `alertname`, which Prometheus
//! gives every alert as its own rule's name). The rule `PageAlertSilenced`
//! pages on any of them (who silenced what, why, until when, is in this process's log line
//! `event=page_alert_silenced`), `SilenceWatchBlind` on this process not answering or not
//! reading both APIs, and the always-firing `Watchdog` stops (so an external dead man's switch
//! pages) when either holds.
//!
//! A silence covers a rule when every matcher on a label the rule sets statically (`alertname`
//! and the rule's own labels) holds for the rule's value, and every matcher on another label
//! could hold for some instance of the rule (it is taken as satisfiable). That over-reports a
//! silence narrowed to one `instance` or `guard`; such a silence still hides a page, which is the
//! point. Matchers follow Alertmanager's v2 API: `isEqual` (default true) and `isRegex`, a regex
//! anchored as Alertmanager anchors it (`^(?:...)$`).

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use serde::Deserialize;

/// How often the watch looks: one alert within a scrape or two of a silence being created.
pub const INTERVAL_MS: u64 = 10_000;
/// One call to either API.
const CALL_TIMEOUT_MS: u64 = 5_000;
/// The severities the watch guards: a page, and the heartbeat that tells the outside world the
/// pipeline is whole.
pub const GUARDED_SEVERITIES: [&str; 2] = ["page", "heartbeat"];

/// One matcher of a silence, as `/api/v2/silences` gives it.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct Matcher {
    pub name: String,
    pub value: String,
    #[serde(rename = "isRegex")]
    pub is_regex: bool,
    #[serde(rename = "isEqual", default = "yes")]
    pub is_equal: bool,
}

fn yes() -> bool {
    true
}

#[derive(Debug, Clone, Deserialize)]
pub struct SilenceStatus {
    pub state: String,
}

/// One silence, as `/api/v2/silences` gives it (the fields the watch reads).
#[derive(Debug, Clone, Deserialize)]
pub struct Silence {
    pub id: String,
    pub status: SilenceStatus,
    pub matchers: Vec<Matcher>,
    #[serde(rename = "createdBy", default)]
    pub created_by: String,
    #[serde(default)]
    pub comment: String,
    #[serde(rename = "endsAt", default)]
    pub ends_at: String,
}

/// One alert rule: its name and the labels it sets statically.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rule {
    pub name: String,
    pub labels: BTreeMap<String, String>,
}

impl Rule {
    /// The value the rule gives `label` whatever its instance (`alertname` included), if any.
    fn static_value(&self, label: &str) -> Option<&str> {
        if label == "alertname" {
            return Some(&self.name);
        }
        self.labels.get(label).map(String::as_str)
    }

    /// Whether it is a rule the watch guards ([`GUARDED_SEVERITIES`]).
    pub fn is_guarded(&self) -> bool {
        self.labels
            .get("severity")
            .is_some_and(|s| GUARDED_SEVERITIES.contains(&s.as_str()))
    }
}

#[derive(Debug, thiserror::Error)]
pub enum WatchError {
    #[error("asking {what}: {source}")]
    Http {
        what: &'static str,
        source: reqwest::Error,
    },
    #[error("{what} answered {status}")]
    Status { what: &'static str, status: u16 },
    #[error("{what}: unexpected answer: {detail}")]
    Malformed { what: &'static str, detail: String },
    #[error("silence {id}: matcher {name}={value:?} is not a valid regex: {detail}")]
    BadRegex {
        id: String,
        name: String,
        value: String,
        detail: String,
    },
}

impl Matcher {
    /// Whether this matcher holds for `value` (a label's value; absent reads as "").
    fn holds_for(&self, value: &str) -> Result<bool, String> {
        let matched = if self.is_regex {
            regex::Regex::new(&format!("^(?:{})$", self.value))
                .map_err(|e| e.to_string())?
                .is_match(value)
        } else {
            self.value == value
        };
        Ok(matched == self.is_equal)
    }
}

/// Whether `silence` covers `rule` (the module's rule); a matcher whose regex does not compile
/// is an error (Alertmanager would not have accepted it).
pub fn covers(silence: &Silence, rule: &Rule) -> Result<bool, WatchError> {
    for matcher in &silence.matchers {
        let Some(value) = rule.static_value(&matcher.name) else {
            // A label the rule does not set: some instance of it may carry a value that matches.
            continue;
        };
        let holds = matcher
            .holds_for(value)
            .map_err(|detail| WatchError::BadRegex {
                id: silence.id.clone(),
                name: matcher.name.clone(),
                value: matcher.value.clone(),
                detail,
            })?;
        if !holds {
            return Ok(false);
        }
    }
    Ok(true)
}

/// What one look found: every guarded rule with the active silences that cover it (none: an
/// empty list), and how many silences are active in all.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Finding {
    pub covered: BTreeMap<String, Vec<String>>,
    pub active_silences: usize,
}

/// Which active silences cover which guarded rules.
pub fn judge(rules: &[Rule], silences: &[Silence]) -> Result<Finding, WatchError> {
    let active: Vec<&Silence> = silences
        .iter()
        .filter(|s| s.status.state == "active")
        .collect();
    let mut covered = BTreeMap::new();
    for rule in rules.iter().filter(|r| r.is_guarded()) {
        let mut by = Vec::new();
        for silence in &active {
            if covers(silence, rule)? {
                by.push(silence.id.clone());
            }
        }
        covered.insert(rule.name.clone(), by);
    }
    Ok(Finding {
        covered,
        active_silences: active.len(),
    })
}

/// How the watch reaches both APIs: the authority their TLS certificates are checked against, and
/// the login both ask for (deploy/monitoring, "web-config"; the `silence-watch` user).
#[derive(Clone, Default)]
pub struct Access {
    /// The authority's certificate (PEM); none: only plain `http://` URLs can be reached.
    pub ca_pem: Option<Vec<u8>>,
    /// User and password sent as HTTP basic authentication on every call.
    pub login: Option<(String, String)>,
}

impl std::fmt::Debug for Access {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Access")
            .field("ca_pem", &self.ca_pem.as_ref().map(|_| "<pem>"))
            .field("login", &self.login.as_ref().map(|(user, _)| user))
            .finish()
    }
}

/// Why a watch could not be made from its configuration.
#[derive(Debug, thiserror::Error)]
pub enum AccessError {
    #[error("{url}: a login is never sent over plain HTTP (give an https:// URL and --ca-file)")]
    LoginOverPlainHttp { url: String },
    #[error("{url}: an https:// URL needs the authority's certificate (--ca-file)")]
    NoAuthority { url: String },
    #[error("the authority's certificate: {0}")]
    Authority(reqwest::Error),
}

/// The watch: where Prometheus and Alertmanager are, and what it exports.
pub struct SilenceWatch {
    prometheus_url: String,
    alertmanager_url: String,
    http: reqwest::Client,
    login: Option<(String, String)>,
    silenced: service_kit::prometheus::IntGaugeVec,
    active: service_kit::prometheus::IntGauge,
    last_success: service_kit::prometheus::Gauge,
    failures: service_kit::prometheus::IntCounter,
    /// Silences already logged as covering a guarded rule and still covering one (each is logged
    /// once while it does).
    reported: BTreeSet<String>,
}

impl SilenceWatch {
    /// A watch of the Prometheus and Alertmanager at these base URLs, reached with `access`,
    /// exporting into `metrics`. Refused: a login with a plain `http://` URL (it would cross the
    /// network in clear), an `https://` URL without the authority to check it against.
    pub fn new(
        prometheus_url: &str,
        alertmanager_url: &str,
        access: Access,
        metrics: &service_kit::Metrics,
    ) -> anyhow::Result<Self> {
        use service_kit::prometheus::{Gauge, IntCounter, IntGauge, IntGaugeVec, Opts};
        let silenced = IntGaugeVec::new(
            Opts::new(
                "monitoring_page_alerts_silenced",
                "Active Alertmanager silences that cover each page (or heartbeat) alert rule. Any above zero: a safety alert cannot reach anyone (PageAlertSilenced).",
            ),
            &["rule"],
        )?;
        let active = IntGauge::new(
            "monitoring_silences_active",
            "Active Alertmanager silences, of any alert.",
        )?;
        let last_success = Gauge::new(
            "monitoring_silence_watch_last_success_timestamp_seconds",
            "When the silence watch last read both Prometheus's rules and Alertmanager's silences (SilenceWatchBlind past a minute).",
        )?;
        let failures = IntCounter::new(
            "monitoring_silence_watch_failures_total",
            "Looks of the silence watch that could not read Prometheus or Alertmanager.",
        )?;
        for c in [
            Box::new(silenced.clone()) as Box<dyn service_kit::prometheus::core::Collector>,
            Box::new(active.clone()),
            Box::new(last_success.clone()),
            Box::new(failures.clone()),
        ] {
            metrics.registry.register(c)?;
        }
        for url in [prometheus_url, alertmanager_url] {
            let https = url.starts_with("https://");
            if !https && access.login.is_some() {
                return Err(AccessError::LoginOverPlainHttp { url: url.into() }.into());
            }
            if https && access.ca_pem.is_none() {
                return Err(AccessError::NoAuthority { url: url.into() }.into());
            }
        }
        let mut http = reqwest::Client::builder()
            .timeout(Duration::from_millis(CALL_TIMEOUT_MS))
            // Only the given authority is trusted; no redirect is followed (a login would go
            // wherever it pointed).
            .tls_built_in_root_certs(false)
            .redirect(reqwest::redirect::Policy::none());
        if let Some(pem) = &access.ca_pem {
            http = http.add_root_certificate(
                reqwest::Certificate::from_pem(pem).map_err(AccessError::Authority)?,
            );
        }
        Ok(Self {
            prometheus_url: prometheus_url.trim_end_matches('/').to_string(),
            alertmanager_url: alertmanager_url.trim_end_matches('/').to_string(),
            http: http.build()?,
            login: access.login,
            silenced,
            active,
            last_success,
            failures,
            reported: BTreeSet::new(),
        })
    }

    async fn get(&self, what: &'static str, url: String) -> Result<serde_json::Value, WatchError> {
        let mut request = self.http.get(&url);
        if let Some((user, password)) = &self.login {
            request = request.basic_auth(user, Some(password));
        }
        let response = request
            .send()
            .await
            .map_err(|source| WatchError::Http { what, source })?;
        let status = response.status().as_u16();
        if !(200..300).contains(&status) {
            return Err(WatchError::Status { what, status });
        }
        response
            .json()
            .await
            .map_err(|source| WatchError::Http { what, source })
    }

    /// Prometheus's alert rules, each with its static labels.
    async fn rules(&self) -> Result<Vec<Rule>, WatchError> {
        const WHAT: &str = "Prometheus's rules";
        let v = self
            .get(
                WHAT,
                format!("{}/api/v1/rules?type=alert", self.prometheus_url),
            )
            .await?;
        let groups = v["data"]["groups"]
            .as_array()
            .ok_or_else(|| WatchError::Malformed {
                what: WHAT,
                detail: "no data.groups".into(),
            })?;
        let mut rules = Vec::new();
        for rule in groups
            .iter()
            .filter_map(|g| g["rules"].as_array())
            .flatten()
        {
            let Some(name) = rule["name"].as_str() else {
                continue;
            };
            let labels = rule["labels"]
                .as_object()
                .map(|l| {
                    l.iter()
                        .filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_string())))
                        .collect()
                })
                .unwrap_or_default();
            rules.push(Rule {
                name: name.to_string(),
                labels,
            });
        }
        Ok(rules)
    }

    /// Alertmanager's silences (every state).
    async fn silences(&self) -> Result<Vec<Silence>, WatchError> {
        const WHAT: &str = "Alertmanager's silences";
        let v = self
            .get(WHAT, format!("{}/api/v2/silences", self.alertmanager_url))
            .await?;
        serde_json::from_value(v).map_err(|e| WatchError::Malformed {
            what: WHAT,
            detail: e.to_string(),
        })
    }

    /// One look: reads both APIs, exports the finding, logs each newly covering silence once.
    pub async fn look(&mut self) -> Result<Finding, WatchError> {
        let result = async {
            let rules = self.rules().await?;
            let silences = self.silences().await?;
            Ok::<_, WatchError>((judge(&rules, &silences)?, silences))
        }
        .await;
        let (finding, silences) = match result {
            Ok(found) => found,
            Err(e) => {
                self.failures.inc();
                tracing::warn!(error = %e, "silence watch could not look");
                return Err(e);
            }
        };
        // The count first: a scrape between the two sets never pairs a new coverage with an
        // older count.
        self.active.set(finding.active_silences as i64);
        // Only silences still covering are remembered (one log line each while they last).
        self.reported
            .retain(|id| finding.covered.values().any(|by| by.contains(id)));
        for (rule, by) in &finding.covered {
            self.silenced
                .with_label_values(&[rule])
                .set(by.len() as i64);
            for id in by {
                if self.reported.insert(id.clone()) {
                    if let Some(s) = silences.iter().find(|s| &s.id == id) {
                        tracing::error!(
                            event = "page_alert_silenced", alert = true, alertname = %rule,
                            silence = %s.id, created_by = %s.created_by, comment = %s.comment,
                            matchers = ?s.matchers, ends_at = %s.ends_at,
                            "an active silence covers a page alert: it can reach nobody"
                        );
                    }
                }
            }
        }
        self.last_success.set(unix_seconds_now());
        Ok(finding)
    }

    /// Looks every `interval` until `shutdown` fires.
    pub async fn run(
        mut self,
        interval: Duration,
        shutdown: impl std::future::Future<Output = ()>,
    ) {
        tokio::pin!(shutdown);
        loop {
            let _ = self.look().await;
            tokio::select! {
                _ = &mut shutdown => return,
                _ = tokio::time::sleep(interval) => {}
            }
        }
    }
}

fn unix_seconds_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule(name: &str, labels: &[(&str, &str)]) -> Rule {
        Rule {
            name: name.into(),
            labels: labels
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        }
    }

    fn silence(id: &str, state: &str, matchers: &[(&str, &str, bool, bool)]) -> Silence {
        Silence {
            id: id.into(),
            status: SilenceStatus {
                state: state.into(),
            },
            matchers: matchers
                .iter()
                .map(|(name, value, is_regex, is_equal)| Matcher {
                    name: name.to_string(),
                    value: value.to_string(),
                    is_regex: *is_regex,
                    is_equal: *is_equal,
                })
                .collect(),
            created_by: "someone".into(),
            comment: String::new(),
            ends_at: "2099-01-01T00:00:00Z".into(),
        }
    }

    #[test]
    fn a_silence_covers_a_page_rule_when_its_static_labels_match() {
        let fenced = rule("FencedOut", &[("severity", "page")]);
        let cases = [
            // (matchers, covers)
            (vec![("alertname", "FencedOut", false, true)], true),
            (vec![("alertname", "Fenced.*", true, true)], true),
            (vec![("alertname", ".*", true, true)], true),
            (vec![("severity", "page", false, true)], true),
            // A label the rule does not set: some instance may carry it.
            (
                vec![
                    ("alertname", "FencedOut", false, true),
                    ("guard", "rail_proxy", false, true),
                ],
                true,
            ),
            (vec![("instance", "x", false, false)], true),
            // Another rule, a regex that must match whole, a negated match, another severity.
            (vec![("alertname", "ServiceDown", false, true)], false),
            (vec![("alertname", "Fenced", true, true)], false),
            (vec![("alertname", "FencedOut", false, false)], false),
            (vec![("severity", "ticket", false, true)], false),
            (
                vec![
                    ("alertname", "FencedOut", false, true),
                    ("severity", "ticket", false, true),
                ],
                false,
            ),
        ];
        for (matchers, expected) in cases {
            let s = silence("s", "active", &matchers);
            assert_eq!(covers(&s, &fenced).unwrap(), expected, "{matchers:?}");
        }
    }

    #[test]
    fn judge_counts_active_silences_over_guarded_rules_only() {
        let rules = [
            rule("FencedOut", &[("severity", "page")]),
            rule("Watchdog", &[("severity", "heartbeat")]),
            rule("PayoutBacklog", &[("severity", "ticket")]),
        ];
        let silences = [
            silence("all", "active", &[("alertname", ".+", true, true)]),
            silence(
                "ticket",
                "active",
                &[("alertname", "PayoutBacklog", false, true)],
            ),
            silence(
                "expired",
                "expired",
                &[("alertname", "FencedOut", false, true)],
            ),
            silence(
                "pending",
                "pending",
                &[("alertname", "FencedOut", false, true)],
            ),
        ];
        let finding = judge(&rules, &silences).unwrap();
        assert_eq!(finding.active_silences, 2);
        assert_eq!(
            finding.covered,
            BTreeMap::from([
                ("FencedOut".to_string(), vec!["all".to_string()]),
                ("Watchdog".to_string(), vec!["all".to_string()]),
            ])
        );
        // Nothing active over a page: every guarded rule is reported, at zero.
        let quiet = judge(&rules, &silences[1..]).unwrap();
        assert!(quiet.covered.values().all(Vec::is_empty), "{quiet:?}");
        assert_eq!(quiet.covered.len(), 2);
    }

    #[test]
    fn a_matcher_regex_alertmanager_would_refuse_is_an_error_not_a_pass() {
        let s = silence("bad", "active", &[("alertname", "(", true, true)]);
        let r = rule("FencedOut", &[("severity", "page")]);
        assert!(matches!(covers(&s, &r), Err(WatchError::BadRegex { .. })));
    }

    #[test]
    fn the_v2_matcher_shape_parses_with_and_without_is_equal() {
        let with: Matcher = serde_json::from_str(
            r#"{"name":"alertname","value":"FencedOut","isRegex":false,"isEqual":false}"#,
        )
        .unwrap();
        assert!(!with.is_equal);
        let without: Matcher =
            serde_json::from_str(r#"{"name":"alertname","value":"FencedOut","isRegex":false}"#)
                .unwrap();
        assert!(without.is_equal);
    }
}
