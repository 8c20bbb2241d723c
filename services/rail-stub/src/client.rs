//! An HTTP client of the stub for tests, tools and the benchmark's direct-call baseline: its
//! payments API (pay, look up) and its admin API (ground truth, faults, a payment outside the
//! proxy), each at its own listener, over HTTPS: the stub's certificate checked against the rail's
//! authority only, the caller's own certificate presented (the harness's, [`HARNESS_NAME`](crate::tls::HARNESS_NAME), for
//! the admin API). The rail proxy deliberately does not use it: it has its own client of the
//! rail's wire format.

use std::time::Duration;

use serde::Deserialize;

use crate::{
    FaultConfig, FaultMode, ForcedMode, GroundTruth, LookupAnswer, PaymentOrder, PaymentRequest,
};

/// Bound on admin calls; they answer from memory.
pub const ADMIN_TIMEOUT_MS: u64 = 10_000;

#[derive(Debug, thiserror::Error)]
pub enum StubClientError {
    #[error("rail stub request failed: {0}")]
    Http(#[from] reqwest::Error),
    #[error("rail stub answered {status}: {body}")]
    Status { status: u16, body: String },
    #[error("this client knows the stub's admin API only, not its payments API")]
    NoPaymentsApi,
    #[error("the client's TLS material: {0}")]
    Tls(reqwest::Error),
}

/// Where the stub's two APIs are, and the TLS the caller reaches them with.
#[derive(Debug, Clone)]
pub struct RailEndpoints {
    /// The rail's payments API (`/v1/payments`), what the proxy calls.
    pub payments_url: String,
    /// The harness's admin API (`/admin/*`).
    pub admin_url: String,
    /// The rail's authority (the stub's certificate must chain to it) and the caller's own
    /// certificate of it (the admin API serves only one naming [`HARNESS_NAME`](crate::tls::HARNESS_NAME)).
    pub tls: mtls::Tls,
}

/// What one direct payment request got back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DirectAnswer {
    Accepted {
        rail_ref: String,
    },
    Declined {
        code: String,
    },
    /// Any other status; the body as text.
    Failed {
        status: u16,
        body: String,
    },
}

impl From<(String, String, mtls::Tls)> for RailEndpoints {
    /// `(payments_url, admin_url, the harness's TLS)`, as the test kit's
    /// `System::rail_stub_endpoints` gives them.
    fn from((payments_url, admin_url, tls): (String, String, mtls::Tls)) -> Self {
        Self {
            payments_url,
            admin_url,
            tls,
        }
    }
}

#[derive(Clone)]
pub struct StubClient {
    /// `None`: an admin-only client ([`StubClient::admin`]).
    payments_url: Option<String>,
    admin_url: String,
    http: reqwest::Client,
}

#[derive(Deserialize)]
struct Answer {
    status: String,
    rail_ref: Option<String>,
    code: Option<String>,
}

impl StubClient {
    /// A client of both APIs. Fails only on TLS material reqwest cannot read.
    pub fn new(endpoints: impl Into<RailEndpoints>) -> Result<Self, StubClientError> {
        Self::with_timeout(endpoints.into(), Duration::from_millis(ADMIN_TIMEOUT_MS))
    }

    /// A client of the admin API alone (ground truth, faults): what an operator's tools reach,
    /// with the harness's certificate.
    pub fn admin(admin_url: impl Into<String>, tls: &mtls::Tls) -> Result<Self, StubClientError> {
        Ok(Self {
            payments_url: None,
            admin_url: admin_url.into(),
            http: http(Duration::from_millis(ADMIN_TIMEOUT_MS), tls)?,
        })
    }

    /// A client whose every call gives up after `timeout` (a test of the hanging rail).
    pub fn with_timeout(
        endpoints: RailEndpoints,
        timeout: Duration,
    ) -> Result<Self, StubClientError> {
        let http = http(timeout, &endpoints.tls)?;
        Ok(Self::with_http(endpoints, http))
    }

    /// A client of the stub over `http`, a client made elsewhere with its own TLS (the proxy
    /// benchmark's floor passes the rail proxy's own, `rail_proxy::rail::http_client`: a
    /// connection, so a handshake, per payment); `endpoints.tls` is not used.
    pub fn with_http(endpoints: RailEndpoints, http: reqwest::Client) -> Self {
        Self {
            payments_url: Some(endpoints.payments_url),
            admin_url: endpoints.admin_url,
            http,
        }
    }

    /// The payments API's base URL, if this client knows it.
    pub fn payments_url(&self) -> Option<&str> {
        self.payments_url.as_deref()
    }

    fn payments(&self) -> Result<&str, StubClientError> {
        self.payments_url
            .as_deref()
            .ok_or(StubClientError::NoPaymentsApi)
    }

    /// One payment request, sent once. Transport errors (timeouts, resets) are `Err`.
    pub async fn pay(&self, order: &PaymentOrder) -> Result<DirectAnswer, StubClientError> {
        self.pay_request(&PaymentRequest {
            order: order.clone(),
            valid_until_unix_ms: None,
        })
        .await
    }

    /// One payment request with its optional expiry, sent once.
    pub async fn pay_request(
        &self,
        request: &PaymentRequest,
    ) -> Result<DirectAnswer, StubClientError> {
        let response = self
            .http
            .post(format!("{}/v1/payments", self.payments()?))
            .json(request)
            .send()
            .await?;
        let status = response.status().as_u16();
        let body = response.text().await?;
        let parsed: Option<Answer> = serde_json::from_str(&body).ok();
        Ok(match parsed {
            Some(Answer {
                status: s,
                rail_ref: Some(rail_ref),
                ..
            }) if status == 200 && s == "accepted" => DirectAnswer::Accepted { rail_ref },
            Some(Answer {
                status: s,
                code: Some(code),
                ..
            }) if s == "declined" => DirectAnswer::Declined { code },
            _ => DirectAnswer::Failed { status, body },
        })
    }

    pub async fn lookup(&self, client_reference: &str) -> Result<LookupAnswer, StubClientError> {
        let response = self
            .http
            .get(format!("{}/v1/payments", self.payments()?))
            .query(&[("client_reference", client_reference)])
            .send()
            .await?;
        Self::json(response).await
    }

    pub async fn ground_truth(&self) -> Result<GroundTruth, StubClientError> {
        Self::json(
            self.http
                .get(format!("{}/admin/movements", self.admin_url))
                .send()
                .await?,
        )
        .await
    }

    pub async fn set_faults(&self, config: &FaultConfig) -> Result<(), StubClientError> {
        Self::empty(
            self.http
                .post(format!("{}/admin/faults", self.admin_url))
                .json(config)
                .send()
                .await?,
        )
        .await
    }

    pub async fn force(
        &self,
        client_reference: &str,
        mode: Option<FaultMode>,
    ) -> Result<(), StubClientError> {
        let body = ForcedMode {
            client_reference: client_reference.to_string(),
            mode,
        };
        Self::empty(
            self.http
                .post(format!("{}/admin/forced", self.admin_url))
                .json(&body)
                .send()
                .await?,
        )
        .await
    }

    async fn json<T: serde::de::DeserializeOwned>(
        response: reqwest::Response,
    ) -> Result<T, StubClientError> {
        if !response.status().is_success() {
            let status = response.status().as_u16();
            return Err(StubClientError::Status {
                status,
                body: response.text().await.unwrap_or_default(),
            });
        }
        Ok(response.json().await?)
    }

    async fn empty(response: reqwest::Response) -> Result<(), StubClientError> {
        if !response.status().is_success() {
            let status = response.status().as_u16();
            return Err(StubClientError::Status {
                status,
                body: response.text().await.unwrap_or_default(),
            });
        }
        Ok(())
    }
}

/// An HTTPS client that trusts the rail's authority alone and presents `tls`'s certificate (the
/// harness's, or a test's other caller of the stub). No retry: a payment is sent once.
pub fn http(timeout: Duration, tls: &mtls::Tls) -> Result<reqwest::Client, StubClientError> {
    let root = reqwest::Certificate::from_pem(tls.ca_pem()).map_err(StubClientError::Tls)?;
    let identity =
        reqwest::Identity::from_pem(&tls.identity_pem()).map_err(StubClientError::Tls)?;
    reqwest::Client::builder()
        .timeout(timeout)
        .retry(reqwest::retry::never())
        .redirect(reqwest::redirect::Policy::none())
        .tls_built_in_root_certs(false)
        .add_root_certificate(root)
        .identity(identity)
        .https_only(true)
        .build()
        .map_err(StubClientError::Tls)
}
