//! The per-method authorisation layer. Each server declares one [`Policy`] (its whole table, in
//! one place) and serves behind [`Authorize`]: a call whose verified role is not in the method's
//! row is answered `PERMISSION_DENIED` before any handler runs, and the refusal is handed to the
//! server's recorder (its metric and log), so an operator sees every refused caller.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use tonic::transport::server::{TcpConnectInfo, TlsConnectInfo};

use crate::{fingerprint, role_of, Caller, Role};

/// One row of a service's table: a method and the roles that may call it.
#[derive(Debug)]
pub struct Rule {
    pub method: &'static str,
    pub roles: &'static [Role],
}

/// A service's authorisation table. `service` is the gRPC service's full name
/// (`payment.v1.PaymentResource`); a method absent from `rules` is refused to everyone.
#[derive(Debug)]
pub struct Policy {
    pub service: &'static str,
    pub rules: &'static [Rule],
}

/// `grpc.health.v1`: any caller with a certificate from the authority may ask.
pub const HEALTH_SERVICE: &str = "grpc.health.v1.Health";

/// Why a call was refused, with what an operator needs to see it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    /// `/service/Method`, as the caller sent it.
    pub path: String,
    pub reason: RefusalReason,
    /// The caller's role, if its certificate named one.
    pub role: Option<Role>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RefusalReason {
    /// No client certificate reached the server (only possible without TLS, which no server
    /// offers; kept so the layer never assumes).
    NoCertificate,
    /// A certificate from the authority that names no role.
    NoRole,
    /// The method is not in this service's table.
    UnknownMethod,
    /// The caller's role is not in the method's row.
    RoleNotAllowed,
    /// An operator action names an operator the caller's certificate does not carry
    /// ([`crate::Caller::is_operator_named`]), or is made by a role that acts only as itself
    /// under another name. Decided by the handler, which knows the claimed name.
    OperatorNotCertified,
    /// The caller's certificate is on the server's denylist ([`crate::denylist`]): refused
    /// before its role is looked at, whatever the method.
    CertificateDenied,
}

impl RefusalReason {
    /// The metric label and log field.
    pub fn as_str(self) -> &'static str {
        match self {
            RefusalReason::NoCertificate => "no_certificate",
            RefusalReason::NoRole => "no_role",
            RefusalReason::UnknownMethod => "unknown_method",
            RefusalReason::RoleNotAllowed => "role_not_allowed",
            RefusalReason::OperatorNotCertified => "operator_not_certified",
            RefusalReason::CertificateDenied => "certificate_denied",
        }
    }
}

impl Refusal {
    pub fn status(&self) -> tonic::Status {
        let role = self.role.map_or("a caller without a role", Role::name);
        let message = match self.reason {
            RefusalReason::NoCertificate => {
                format!("{}: refused, no client certificate", self.path)
            }
            RefusalReason::NoRole => format!(
                "{}: refused, the client certificate names no role",
                self.path
            ),
            RefusalReason::UnknownMethod => {
                format!(
                    "{}: refused, not in this service's authorisation table",
                    self.path
                )
            }
            RefusalReason::RoleNotAllowed => {
                format!("{}: refused, {role} may not call it", self.path)
            }
            RefusalReason::OperatorNotCertified => format!(
                "{}: refused, operator_not_certified: the operator this call names is not the one \
                 the client certificate carries (an operator's certificate names them as \
                 <name>.operator; another role acts only under its own role name)",
                self.path
            ),
            RefusalReason::CertificateDenied => format!(
                "{}: refused, certificate_denied: this client certificate is on the server's \
                 denylist (revoked by an operator)",
                self.path
            ),
        };
        tonic::Status::permission_denied(message)
    }
}

impl Policy {
    /// The decision for one call: the verified caller, or why not.
    pub fn authorize(&self, path: &str, extensions: &http::Extensions) -> Result<Caller, Refusal> {
        self.authorize_unless_denied(path, extensions, None)
    }

    /// [`Policy::authorize`], a certificate on `denylist` refused first, whatever the method.
    pub fn authorize_unless_denied(
        &self,
        path: &str,
        extensions: &http::Extensions,
        denylist: Option<&crate::denylist::Denylist>,
    ) -> Result<Caller, Refusal> {
        let refuse = |reason, role| Refusal {
            path: path.to_string(),
            reason,
            role,
        };
        let cert = extensions
            .get::<TlsConnectInfo<TcpConnectInfo>>()
            .and_then(|info| info.peer_certs())
            .and_then(|certs| certs.first().cloned())
            .ok_or_else(|| refuse(RefusalReason::NoCertificate, None))?;
        let print = fingerprint(&cert);
        if denylist.is_some_and(|d| d.is_denied(&print)) {
            return Err(refuse(RefusalReason::CertificateDenied, role_of(&cert)));
        }
        let role = role_of(&cert).ok_or_else(|| refuse(RefusalReason::NoRole, None))?;
        let caller = Caller {
            role,
            fingerprint: print,
            certificate: cert.into_owned(),
        };
        let (service, method) = path
            .strip_prefix('/')
            .and_then(|p| p.split_once('/'))
            .ok_or_else(|| refuse(RefusalReason::UnknownMethod, Some(role)))?;
        if service == HEALTH_SERVICE {
            return Ok(caller);
        }
        let rule = (service == self.service)
            .then(|| self.rules.iter().find(|r| r.method == method))
            .flatten()
            .ok_or_else(|| refuse(RefusalReason::UnknownMethod, Some(role)))?;
        if rule.roles.contains(&role) {
            Ok(caller)
        } else {
            Err(refuse(RefusalReason::RoleNotAllowed, Some(role)))
        }
    }

    /// The rpcs of `proto` (a service's `.proto` text) that have no row in this table, and the
    /// rows that name no rpc of it. Each service's test asserts both are empty: a new method is
    /// refused to everyone until someone decides who may call it, and the test names it.
    pub fn rows_out_of_step_with(&self, proto: &str) -> (Vec<String>, Vec<&'static str>) {
        let methods: Vec<&str> = proto
            .lines()
            .filter_map(|l| l.trim().strip_prefix("rpc "))
            .map(|l| l.split('(').next().unwrap_or("").trim())
            .collect();
        let missing = methods
            .iter()
            .filter(|m| self.roles(m).is_none())
            .map(|m| m.to_string())
            .collect();
        let extra = self
            .rules
            .iter()
            .map(|r| r.method)
            .filter(|m| !methods.contains(m))
            .collect();
        (missing, extra)
    }

    /// The roles that may call `method`, for tests and documentation.
    pub fn roles(&self, method: &str) -> Option<&'static [Role]> {
        self.rules
            .iter()
            .find(|r| r.method == method)
            .map(|r| r.roles)
    }
}

/// What a server does with a refusal besides answering it: count and log it.
pub type Recorder = Arc<dyn Fn(&Refusal) + Send + Sync>;

/// The layer every server puts in front of its routes (`Server::builder().layer(..)`).
#[derive(Clone)]
pub struct Authorize {
    policy: &'static Policy,
    record: Recorder,
    denylist: Arc<crate::denylist::Denylist>,
}

impl Authorize {
    pub fn new(policy: &'static Policy, record: Recorder) -> Self {
        Self {
            policy,
            record,
            denylist: crate::denylist::Denylist::empty(),
        }
    }

    /// The same layer, refusing every certificate on `denylist` (read on every call, so a
    /// reloaded list is in force at once).
    pub fn denying(mut self, denylist: Arc<crate::denylist::Denylist>) -> Self {
        self.denylist = denylist;
        self
    }
}

impl<S> tower::Layer<S> for Authorize {
    type Service = AuthorizeService<S>;
    fn layer(&self, inner: S) -> Self::Service {
        AuthorizeService {
            inner,
            policy: self.policy,
            record: self.record.clone(),
            denylist: self.denylist.clone(),
        }
    }
}

#[derive(Clone)]
pub struct AuthorizeService<S> {
    inner: S,
    policy: &'static Policy,
    record: Recorder,
    denylist: Arc<crate::denylist::Denylist>,
}

type BoxFuture<T, E> = Pin<Box<dyn Future<Output = Result<T, E>> + Send>>;

impl<S, B> tower::Service<http::Request<B>> for AuthorizeService<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<tonic::body::Body>>,
    S::Future: Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = S::Error;
    type Future = BoxFuture<Self::Response, Self::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: http::Request<B>) -> Self::Future {
        match self.policy.authorize_unless_denied(
            request.uri().path(),
            request.extensions(),
            Some(&self.denylist),
        ) {
            Ok(caller) => {
                request.extensions_mut().insert(caller);
                Box::pin(self.inner.call(request))
            }
            Err(refusal) => {
                (self.record)(&refusal);
                let response = refusal.status().into_http();
                Box::pin(async move { Ok(response) })
            }
        }
    }
}

/// The identity an operator action is recorded under: `claimed`, once the caller's certificate
/// proves it. An operator must present a certificate that carries `<claimed>.operator`; another
/// role the table lets make the call (the resolver's audited take-over) acts only under its own
/// role name. Anything else is refused, so an audit record never names someone the call could
/// not prove it was.
pub fn certified_actor(caller: &Caller, claimed: &str, path: &str) -> Result<String, Refusal> {
    let certified = match caller.role {
        Role::Operator => caller.is_operator_named(claimed),
        role => claimed == role.name(),
    };
    if certified {
        Ok(claimed.to_string())
    } else {
        Err(Refusal {
            path: path.to_string(),
            reason: RefusalReason::OperatorNotCertified,
            role: Some(caller.role),
        })
    }
}
