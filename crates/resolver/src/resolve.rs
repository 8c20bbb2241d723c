//! Orphan resolution: a RAIL_AMBIGUOUS payout whose workflow is gone (never existed, or closed)
//! has nobody left to ask the rail. The resolver does it, WITH EVIDENCE ONLY: it takes a real
//! lock grant on the account's key, asks the rail proxy with that token (a fenced inquiry that
//! also seals a payout never submitted), and moves the payout through the payment resource under
//! the same token. Time alone never resolves anything; nothing is ever resubmitted.
//!
//! | evidence   | action                                         | new state |
//! |------------|------------------------------------------------|-----------|
//! | FOUND      | ResolveAmbiguity(found) then Post              | POSTED    |
//! | ABSENT     | ResolveAmbiguity(absent)                       | FAILED    |
//! | NEVER_SENT | ResolveAmbiguity(absent) (sealed at the proxy) | FAILED    |
//! | UNKNOWN    | nothing; reported                              | unchanged |

use std::time::Duration;

use lock_client::{Acquired, LockClient};
use payment_client::model::{Evidence as PaymentEvidence, Fence};
use payment_client::PaymentClient;
use payout_domain::{AccountId, PayoutId, PayoutState};
use rail_proxy_client::{Evidence, InquirePayout, RailProxyClient};
use serde::Serialize;

use crate::resume::{Temporal, TemporalConfig, WorkflowStatus, CONSECUTIVE_DESCRIBE_ERRORS_MAX};
use sqlx::PgPool;

/// The resolver's lock session lease: long enough for one payout's inquiry, resolution and
/// posting (each a bounded RPC); short enough that a crashed resolver frees the account fast.
pub const LOCK_TTL: Duration = Duration::from_secs(15);
/// How long to wait for an account's key. A held key means someone is working on the account;
/// the orphan is then left for the next run rather than queued behind them.
pub const LOCK_WAIT: Duration = Duration::from_secs(2);
/// Recorded as the evidence source and the proxy's `asked_by` (the process that runs the
/// resolver, `reconciler`; its grants' owners are `reconciler/{payout}`).
pub const RESOLVER: &str = "reconciler";

#[derive(Debug, thiserror::Error)]
pub enum ResolveError {
    #[error("reading paydb: {0}")]
    Paydb(#[from] sqlx::Error),
    #[error("connecting to {service}: {detail}")]
    Connect {
        service: &'static str,
        detail: String,
    },
    #[error("asking Temporal about {workflow_id}: {detail}")]
    Temporal { workflow_id: String, detail: String },
}

/// Where the resolver's collaborators are.
#[derive(Debug, Clone)]
pub struct ResolveConfig {
    pub lock_url: String,
    pub proxy_url: String,
    pub payment_url: String,
    /// The resolver's certificate (role `reconciler`): its lock session, its fenced inquiry and
    /// its resolution all go over mutual TLS under it.
    pub tls: mtls::Tls,
    pub temporal: TemporalConfig,
    /// How much one pass may do (`crate::walk`).
    pub bounds: crate::walk::PassBounds,
}

/// One orphan handled (or deliberately left alone): payout, evidence, new state.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct Resolution {
    pub payout_id: String,
    pub account_id: String,
    /// What Temporal said about `payout-{id}`.
    pub workflow: String,
    /// FOUND / ABSENT / NEVER_SENT / UNKNOWN, or LOCK_BUSY / STATE_CHANGED (not asked), or
    /// ERROR (a call failed; nothing more was done).
    pub evidence: String,
    /// The payout's state after this run's action (unchanged when left alone).
    pub new_state: String,
    pub token: Option<u64>,
    pub detail: String,
}

impl Resolution {
    /// Whether the payout left RAIL_AMBIGUOUS in this run.
    pub fn resolved(&self) -> bool {
        self.new_state != PayoutState::RailAmbiguous.as_str()
    }
}

/// The orphan resolver's walk (`crate::walk`): RAIL_AMBIGUOUS payouts, oldest first, a page at
/// a time from the cursor.
const AMBIGUOUS_SQL: &str = concat!(
    "SELECT p.created_at, p.id, p.account_id FROM payout p WHERE p.state = 'RAIL_AMBIGUOUS'",
    crate::walk::keyset!()
);

/// One row of [`AMBIGUOUS_SQL`]: created_at, id, account.
#[derive(sqlx::FromRow)]
struct AmbiguousRow(
    sqlx::types::chrono::DateTime<sqlx::types::chrono::Utc>,
    String,
    String,
);

impl crate::walk::Positioned for AmbiguousRow {
    fn position(&self) -> crate::walk::Position {
        (self.0, self.1.clone())
    }
}

/// From where the last pass of this process stopped (`cursor`, moved on here), the
/// RAIL_AMBIGUOUS payouts are examined oldest first, wrapping once (`crate::walk`), until
/// `config.bounds.per_pass` orphans were handled or `examine_max` payouts examined: each whose
/// workflow is not running is resolved with evidence, or left alone and reported. Payouts whose
/// workflow runs are not touched, nor listed, nor counted in the bound. One whose workflow
/// cannot be described is reported (evidence ERROR, logged) and skipped; the pass goes on
/// unless Temporal fails [`CONSECUTIVE_DESCRIBE_ERRORS_MAX`] times in a row.
pub async fn resolve_orphans(
    paydb: &PgPool,
    config: &ResolveConfig,
    cursor: &mut crate::walk::Cursor,
) -> Result<crate::resume::Pass<Resolution>, ResolveError> {
    let mut walk = crate::walk::Walk::<AmbiguousRow>::new(paydb, AMBIGUOUS_SQL, cursor);
    let mut temporal: Option<Temporal> = None;
    let mut orphans = Vec::new();
    let mut out = Vec::new();
    let mut consecutive_errors = 0;
    let found = async {
        while orphans.len() + out.len() < config.bounds.per_pass
            && walk.examined() < config.bounds.examine_max
        {
            let Some(AmbiguousRow(_, id, account)) = walk.next().await? else {
                break;
            };
            let (Ok(payout_id), Ok(account_id)) = (
                PayoutId::parse(id.clone()),
                AccountId::parse(account.clone()),
            ) else {
                tracing::error!(payout_id = %id, account_id = %account, "unparseable ids in paydb; skipped");
                continue;
            };
            // Connected at the first ambiguous payout: a pass with none asks nobody.
            if temporal.is_none() {
                temporal = Some(Temporal::connect(&config.temporal).await.map_err(|e| {
                    ResolveError::Temporal {
                        workflow_id: "(connect)".into(),
                        detail: e.to_string(),
                    }
                })?);
            }
            let Some(temporal) = &temporal else {
                continue;
            };
            let workflow_id = payout_domain::workflow_id(&payout_id);
            match temporal.status(&workflow_id).await {
                Ok(WorkflowStatus::Running) => {
                    consecutive_errors = 0;
                    tracing::info!(payout_id = %payout_id, workflow_id, "ambiguous payout has a running workflow; not touched");
                }
                Ok(status) => {
                    consecutive_errors = 0;
                    orphans.push((payout_id, account_id, status));
                }
                Err(e) => {
                    consecutive_errors += 1;
                    if consecutive_errors >= CONSECUTIVE_DESCRIBE_ERRORS_MAX {
                        return Err(ResolveError::Temporal {
                            workflow_id,
                            detail: e.to_string(),
                        });
                    }
                    tracing::warn!(payout_id = %payout_id, error = %e, "could not describe the ambiguous payout's workflow: skipped this pass");
                    out.push(Resolution {
                        payout_id: payout_id.to_string(),
                        account_id: account_id.to_string(),
                        workflow: crate::resume::UNDESCRIBED.into(),
                        evidence: "ERROR".into(),
                        new_state: PayoutState::RailAmbiguous.as_str().to_string(),
                        token: None,
                        detail: format!("describing its workflow: {e}"),
                    });
                }
            }
        }
        Ok::<(), ResolveError>(())
    }
    .await;
    let progress = walk.stop(cursor);
    found?;
    tracing::info!(
        examined = progress.examined,
        orphans = orphans.len(),
        wrapped = progress.wrapped,
        complete = progress.complete,
        "orphan resolver walked the ambiguous payouts"
    );
    if orphans.is_empty() {
        return Ok(crate::resume::Pass {
            done: out,
            progress,
        });
    }
    fn connect(service: &'static str) -> impl Fn(&dyn std::fmt::Display) -> ResolveError {
        move |e| ResolveError::Connect {
            service,
            detail: e.to_string(),
        }
    }
    let lock = LockClient::connect(&config.lock_url, &config.tls)
        .await
        .map_err(|e| connect("lock-server")(&e))?;
    let session = lock
        .open_session(RESOLVER, LOCK_TTL)
        .await
        .map_err(|e| connect("lock-server")(&e))?;
    let proxy = RailProxyClient::connect(&config.proxy_url, &config.tls)
        .await
        .map_err(|e| connect("rail-proxy")(&e))?;
    let payments = PaymentClient::connect(&config.payment_url, &config.tls)
        .await
        .map_err(|e| connect("payment-resource")(&e))?;
    for (payout_id, account_id, status) in orphans {
        let workflow = status.name();
        let resolution = resolve_one(
            &session,
            proxy.clone(),
            &payments,
            &payout_id,
            &account_id,
            workflow,
        )
        .await;
        tracing::info!(
            payout_id = %resolution.payout_id,
            account_id = %resolution.account_id,
            workflow = %resolution.workflow,
            evidence = %resolution.evidence,
            new_state = %resolution.new_state,
            token = resolution.token,
            detail = %resolution.detail,
            "orphan resolution"
        );
        out.push(resolution);
    }
    let _ = session.close().await;
    Ok(crate::resume::Pass {
        done: out,
        progress,
    })
}

async fn resolve_one(
    session: &lock_client::Session,
    mut proxy: RailProxyClient,
    payments: &PaymentClient,
    payout_id: &PayoutId,
    account_id: &AccountId,
    workflow: String,
) -> Resolution {
    let ambiguous = PayoutState::RailAmbiguous.as_str().to_string();
    let mut r = Resolution {
        payout_id: payout_id.to_string(),
        account_id: account_id.to_string(),
        workflow,
        evidence: String::new(),
        new_state: ambiguous.clone(),
        token: None,
        detail: String::new(),
    };
    let owner = format!("{RESOLVER}/{payout_id}");
    let key = payout_domain::lock_key(account_id);
    let grant = match session.acquire_as(&key, &owner, LOCK_WAIT).await {
        Ok(Acquired::Granted(g)) => g,
        Ok(Acquired::NotAcquired {
            holder_owner,
            holder_token,
        }) => {
            r.evidence = "LOCK_BUSY".into();
            r.detail = format!(
                "{key} held by {holder_owner} (token {holder_token}); left for the next run"
            );
            return r;
        }
        Err(e) => {
            r.evidence = "ERROR".into();
            r.detail = format!("acquiring {key}: {e}");
            return r;
        }
    };
    let token = grant.token();
    r.token = Some(token.get());
    let result = async {
        // Both guards are shown the grant as the lock service signed it: the key and signature
        // come from the handle, so the resolver presents only what it was granted.
        let fence = Fence::new(owner.clone(), token)
            .map_err(|e| e.to_string())?
            .signed(grant.key(), grant.signature().clone());
        // Under the grant, the payout must still be ambiguous: a holder may have finished it.
        let current = payments
            .get_payout(payout_id)
            .await
            .map_err(|e| format!("reading the payout: {e}"))?;
        if current.payout.state != PayoutState::RailAmbiguous {
            r.evidence = "STATE_CHANGED".into();
            r.new_state = current.payout.state.as_str().to_string();
            return Ok::<_, String>(());
        }
        let inquiry = proxy
            .inquire(&InquirePayout::new(
                payout_id.clone(),
                account_id.clone(),
                token,
                owner.clone(),
                RESOLVER,
            )
            .signed(grant.key(), grant.signature().clone()))
            .await
            .map_err(|e| format!("inquiry: {e}"))?;
        r.evidence = inquiry.resolution.evidence.name().to_string();
        let evidence = match &inquiry.resolution.evidence {
            Evidence::Found { rail_refs } => {
                if rail_refs.len() > 1 {
                    tracing::error!(payout_id = %payout_id, ?rail_refs, "DUPLICATE PAYMENT found by the inquiry");
                    r.detail = format!("{} rail movements: {rail_refs:?}", rail_refs.len());
                }
                let Some(rail_ref) = rail_refs.first() else {
                    return Err("FOUND without a rail reference".into());
                };
                PaymentEvidence::Found {
                    rail_ref: rail_ref.clone(),
                }
            }
            Evidence::Absent | Evidence::NeverSent => PaymentEvidence::Absent,
            Evidence::Unknown { detail } => {
                r.detail = format!("left RAIL_AMBIGUOUS: {detail}");
                return Ok(());
            }
        };
        // The proxy's signed evidence, as its Inquire answered it (issue 33): the payment resource
        // resolves only on it.
        let proof = crate::facts::evidence(&inquiry.resolution);
        let resolved = payments
            .resolve_ambiguity_proven(payout_id, &fence, &evidence, RESOLVER, proof.as_ref())
            .await
            .map_err(|e| format!("resolve_ambiguity: {e}"))?;
        r.new_state = resolved.state.as_str().to_string();
        if resolved.state == PayoutState::RailAcked {
            // Money left: the books follow. Post is idempotent, so a retry after a crash is safe.
            let posted = payments
                .post(payout_id, &fence)
                .await
                .map_err(|e| format!("post: {e}"))?;
            r.new_state = posted.payout.state.as_str().to_string();
        }
        Ok(())
    }
    .await;
    if let Err(detail) = result {
        if r.evidence.is_empty() {
            r.evidence = "ERROR".into();
        }
        r.detail = detail;
    }
    if let Err(e) = grant.release().await {
        tracing::warn!(payout_id = %payout_id, error = %e, "releasing the reconciler's grant failed; it expires with the session");
    }
    r
}
