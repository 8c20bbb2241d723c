//! The real backend: the lock service (`lock-client`), the payment resource (first guard) and
//! the rail proxy (second guard), behind [`Backend`].
//!
//! The lock session is one per worker process, owned by the process: opened at start, kept alive
//! in the background, replaced by a new one (new grants, higher tokens) once it is lost. Grants
//! live in this process only; a [`Grant`] in workflow history names its session and this
//! process's own task queue, where every fenced activity under it is routed. A grant made by
//! another process (a worker that died, or a previous incarnation of this one) is never adopted:
//! [`Backend::check_held`] reports it as `GrantLost` and the workflow acquires a new one.
//!
//! Every fenced call presents the grant's lock key and the lock service's signature over (key,
//! token, owner), taken from this process's own [`lock_client::GrantHandle`], never from the
//! workflow's history: both guards refuse a token without it (`forged_grant`) or one signed for
//! another account's key (`grant_for_another_key`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use lock_client::{Acquired, ClientError, LockClient, Session, Signature};
use payment_client::model;
use payment_client::{PaymentClient, PaymentError};
use payout_domain::{lock_key, PayoutId};
use rail_proxy_client::{
    Evidence as ProxyEvidence, InquirePayout, Outcome, ProxyError, RailProxyClient, Submission,
    SubmitPayout,
};

use payout_activities::backend::{Answer, Backend};
use payout_activities::refusal::{ActivityFailure, Refusal};
use payout_activities::types::*;

/// The lease TTL default. The worker's session must survive a loaded machine's scheduling
/// hiccups (keep-alives go every TTL/3), and a dead worker's keys must come free quickly enough
/// that its payouts resume within seconds: ten seconds does both. Tests that pause a worker set a
/// shorter one (`PAYOUT_LOCK_TTL_MS`).
pub const LOCK_TTL_MS_DEFAULT: u64 = 10_000;
/// Below this the local deadline (TTL minus the client's 500 ms margin) leaves no room to work.
pub const LOCK_TTL_MS_MIN: u64 = 1_500;
/// A grant that no workflow has used this long after it was made is handed back (see
/// [`ServiceBackend::connect`]). A workflow uses its grant (a fenced call, which vouches for it)
/// within a workflow task or two of receiving it, seconds even on a loaded machine; a grant still
/// unused after a minute was made for an acquire whose answer nobody received.
pub const UNCLAIMED_GRANT_MAX_MS_DEFAULT: u64 = 60_000;
/// How often the unclaimed grants are looked for.
const UNCLAIMED_GRANT_SWEEP: Duration = Duration::from_secs(5);
/// How long the signature of a grant that left this process's handles (handed back, or replaced
/// by a later grant on the same key) is kept for a fenced call already past its grant check. Such
/// a call (a worker frozen between the check and the guard call, exactly what the stall tests and
/// the chaos suite's planted stale holders do) still reaches the guards and is refused there on
/// its token (`fenced_out`): the token at the guards is the safety, not this process's map. A
/// call still in flight after this is answered `GrantLost`, which writes nothing either.
pub const RETIRED_SIGNATURE_KEPT: Duration = Duration::from_secs(15 * 60);

#[derive(Debug, Clone)]
pub struct ServiceConfig {
    /// This worker's identity: the lock owner and the claimer the guards record.
    pub owner: String,
    /// This process's own task queue, where the fenced activities of its grants run.
    pub private_task_queue: String,
    pub lock_server_url: String,
    pub payment_resource_url: String,
    pub rail_proxy_url: String,
    /// This worker's certificate: every call is mutual TLS.
    pub tls: mtls::Tls,
    pub lock_ttl: Duration,
    /// Where the lock client records its history (INV-06 evidence); `None`: not recorded.
    pub lock_history_path: Option<std::path::PathBuf>,
    /// A grant no workflow has used this long after it was made is released.
    pub unclaimed_grant_max: Duration,
}

#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    #[error("lock service: {0}")]
    Lock(#[from] ClientError),
    #[error("payment resource: {0}")]
    Payment(#[from] PaymentError),
    #[error("rail proxy: {0}")]
    Proxy(#[from] mtls::ConnectError),
    #[error("PAYOUT_LOCK_TTL_MS {0} is below the minimum {LOCK_TTL_MS_MIN}")]
    TtlTooShort(u128),
    #[error("lock history file {path}: {source}")]
    LockHistory {
        path: std::path::PathBuf,
        source: std::io::Error,
    },
}

impl ConnectError {
    /// A service the worker needs is not reachable now (down, restarting, a network cut, a
    /// deadline): worth trying again. Anything else is the worker's own configuration (a TTL
    /// below the minimum, a bad URL or certificate, an unwritable history file) and is not.
    pub fn is_transient(&self) -> bool {
        use tonic::Code;
        let transient_code = |code: Code| {
            matches!(
                code,
                Code::Unavailable
                    | Code::DeadlineExceeded
                    | Code::ResourceExhausted
                    | Code::Aborted
            )
        };
        match self {
            ConnectError::Lock(e) => match e {
                ClientError::Connect(_) | ClientError::Timeout(_) => true,
                ClientError::Status(status) => transient_code(status.code()),
                // This worker's certificate is at a per-caller bound of the lock service (its
                // sessions lost and not yet expired, say): room comes back as they end.
                ClientError::Rejected {
                    kind: lock_client::Rejection::CallerLimitReached(_),
                    ..
                } => true,
                _ => false,
            },
            ConnectError::Payment(PaymentError::Transport { code, .. }) => transient_code(*code),
            ConnectError::Payment(_) => false,
            ConnectError::Proxy(mtls::ConnectError::Connect { .. }) => true,
            ConnectError::Proxy(_) => false,
            ConnectError::TtlTooShort(_) | ConnectError::LockHistory { .. } => false,
        }
    }
}

/// A worker that starts while a service it needs is unreachable tries again after this long at
/// first, doubling up to [`CONNECT_RETRY_MAX`]: it waits for its services instead of exiting
/// (before, a worker restarted while the payment resource was down exited at once, and a
/// supervisor restarted it into the same failure: a crash loop, and every payout stalled in one
/// of its frozen calls lost with it).
pub const CONNECT_RETRY_FIRST: std::time::Duration = std::time::Duration::from_millis(200);
pub const CONNECT_RETRY_MAX: std::time::Duration = std::time::Duration::from_secs(5);

/// A failed attempt to open a lock session is the answer for this long: a worker cut off from
/// the lock service fails each lock step within the client's deadline once, not once per queued
/// caller (each waited its turn, so N callers took N deadlines), and a workflow whose local steps
/// give up moves on to a worker that can serve it sooner.
pub const SESSION_OPEN_RETRY_AFTER: std::time::Duration = std::time::Duration::from_secs(1);

/// How often a worker looks whether it still reaches the lock service
/// ([`ServiceBackend::cut_off_from_lock_service`]).
pub const LOCK_REACH_CHECK_INTERVAL: std::time::Duration = std::time::Duration::from_millis(500);

/// Whether a failed call to the lock service means it could not be reached (no connection, no
/// answer within the deadline, the transport's own failure), as opposed to an answer: a typed
/// refusal is the service speaking (its backend unavailable, a limit), which every worker meets
/// alike.
fn unreachable(e: &ClientError) -> bool {
    use tonic::Code;
    match e {
        ClientError::Connect(_) | ClientError::Timeout(_) => true,
        ClientError::Status(status) => matches!(
            status.code(),
            Code::Unavailable | Code::DeadlineExceeded | Code::Cancelled | Code::Unknown
        ),
        _ => false,
    }
}

pub struct ServiceBackend {
    config: ServiceConfig,
    lock: LockClient,
    /// The process's session; replaced (never revived) once lost.
    session: tokio::sync::Mutex<Session>,
    /// When opening a new session last failed, why, and whether the lock service could not be
    /// reached at all ([`unreachable`]): callers queued behind that attempt get its answer at
    /// once instead of each waiting out the lock client's deadline in turn.
    open_failed: Mutex<Option<(std::time::Instant, String, bool)>>,
    /// The live grant handles of this process, by key.
    grants: Arc<Mutex<HashMap<String, Held>>>,
    /// The signatures of this process's grants that left `grants`, for
    /// [`RETIRED_SIGNATURE_KEPT`] (see there).
    retired: Arc<Mutex<Retired>>,
    /// Hands back grants no workflow took up; stopped with the backend.
    sweeper: tokio::task::JoinHandle<()>,
    payment: PaymentClient,
    proxy: RailProxyClient,
}

/// A grant this process made, and whether a workflow has used it since.
struct Held {
    handle: lock_client::GrantHandle,
    made: std::time::Instant,
    used: bool,
}

/// The grant as a guard is shown it: the signed lock key and the lock service's signature.
struct Presented {
    key: String,
    signature: Signature,
}

/// Signatures of grants this process held, after their handle left `grants`, by (key, token,
/// session id), with the time each left.
#[derive(Default)]
struct Retired {
    by_grant: HashMap<(String, u64, String), (Signature, std::time::Instant)>,
}

impl Retired {
    fn keep(&mut self, handle: &lock_client::GrantHandle) {
        self.by_grant.insert(
            (
                handle.key().to_string(),
                handle.token().get(),
                handle.session_id().to_string(),
            ),
            (handle.signature().clone(), std::time::Instant::now()),
        );
    }

    fn find(&self, grant: &Grant) -> Option<Signature> {
        self.by_grant
            .get(&(
                grant.key.clone(),
                grant.token.get(),
                grant.session_id.clone(),
            ))
            .map(|(signature, _)| signature.clone())
    }

    fn prune(&mut self, kept: Duration) {
        self.by_grant.retain(|_, (_, at)| at.elapsed() < kept);
    }
}

impl Drop for ServiceBackend {
    fn drop(&mut self) {
        self.sweeper.abort();
    }
}

impl ServiceBackend {
    /// Connects to the services and opens this process's lock session. It also starts the
    /// sweep that hands back grants no workflow took up: an acquire whose activity Temporal had
    /// already given up on (a heartbeat or a completion that did not arrive in time) can still be
    /// granted by the lock service, and that grant, on this live session, would keep the account's
    /// key from every later payout, the same payout's retry included. A grant still unused after
    /// `unclaimed_grant_max` is released (releasing is always safe: a workflow that did hold it
    /// would find it lost and acquire again).
    pub async fn connect(config: ServiceConfig) -> Result<Self, ConnectError> {
        if config.lock_ttl.as_millis() < u128::from(LOCK_TTL_MS_MIN) {
            return Err(ConnectError::TtlTooShort(config.lock_ttl.as_millis()));
        }
        let mut lock = LockClient::connect(&config.lock_server_url, &config.tls).await?;
        if let Some(path) = &config.lock_history_path {
            let recorder = lock_client::history::HistoryRecorder::open(path).map_err(|source| {
                ConnectError::LockHistory {
                    path: path.clone(),
                    source,
                }
            })?;
            lock = lock.with_history(Arc::new(recorder));
        }
        // Every connection before the session: an attempt that fails on a guard leaves no lease
        // behind it.
        let payment = PaymentClient::connect(&config.payment_resource_url, &config.tls).await?;
        let proxy = RailProxyClient::connect(&config.rail_proxy_url, &config.tls).await?;
        Self::from_clients(config, lock, payment, proxy).await
    }

    /// [`ServiceBackend::connect`] on clients the caller connected (its own channels: the
    /// end-to-end bench's in-process services); `config`'s URLs and certificate are not used.
    /// Opens this process's lock session and starts the unclaimed-grant sweep.
    pub async fn from_clients(
        config: ServiceConfig,
        lock: LockClient,
        payment: PaymentClient,
        proxy: RailProxyClient,
    ) -> Result<Self, ConnectError> {
        if config.lock_ttl.as_millis() < u128::from(LOCK_TTL_MS_MIN) {
            return Err(ConnectError::TtlTooShort(config.lock_ttl.as_millis()));
        }
        let session = lock.open_session(&config.owner, config.lock_ttl).await?;
        tracing::info!(owner = %config.owner, session_id = session.id(), ttl_ms = config.lock_ttl.as_millis() as u64, "lock session opened");
        let grants = Arc::new(Mutex::new(HashMap::new()));
        let retired = Arc::new(Mutex::new(Retired::default()));
        let sweeper = tokio::spawn(sweep_unclaimed(
            Arc::clone(&grants),
            Arc::clone(&retired),
            config.unclaimed_grant_max,
        ));
        Ok(Self {
            config,
            lock,
            session: tokio::sync::Mutex::new(session),
            open_failed: Mutex::new(None),
            grants,
            retired,
            sweeper,
            payment,
            proxy,
        })
    }

    /// Ends the session on a graceful stop: the server frees every key of this worker at once,
    /// so the payouts it handed back continue elsewhere without waiting for the lease.
    pub async fn close(&self) {
        {
            let mut grants = self.grants.lock().expect("grants");
            let mut retired = self.retired.lock().expect("retired");
            for (_, held) in grants.drain() {
                retired.keep(&held.handle);
            }
        }
        let session = self.session.lock().await;
        if let Err(e) = session.close().await {
            tracing::warn!(error = %e, "closing the lock session failed; its lease will expire");
        }
    }

    /// Whether the lock service answers this worker now: its session is alive (its keep-alives
    /// are answered), or a new one opens, or the attempt to open one was answered with a refusal
    /// (the service is there; what it refuses, every worker meets alike). `Err` says why not.
    pub async fn lock_service_reachable(&self) -> Result<(), String> {
        if self.session.lock().await.is_alive() {
            return Ok(());
        }
        match self.live_session().await {
            Ok(_) => Ok(()),
            Err(_) => match self.open_failed.lock().expect("open_failed").as_ref() {
                Some((_, why, true)) => Err(why.clone()),
                _ => Ok(()),
            },
        }
    }

    /// Resolves once this worker has not reached the lock service for longer than its lease
    /// (its session lost, and every attempt to open another unanswered): a worker cut off from
    /// the lock service can do no payout's work, and while it polls Temporal it takes tasks a
    /// worker that reaches the lock service could do (the compose suite once saw all ten retries
    /// of one payout's acquire go to the cut worker, and the payout wait for the cut to heal).
    /// Answers the last reason.
    pub async fn cut_off_from_lock_service(&self) -> String {
        let mut since: Option<std::time::Instant> = None;
        loop {
            tokio::time::sleep(LOCK_REACH_CHECK_INTERVAL).await;
            match self.lock_service_reachable().await {
                Ok(()) => since = None,
                Err(why) => {
                    let since = *since.get_or_insert_with(std::time::Instant::now);
                    if since.elapsed() > self.config.lock_ttl {
                        return why;
                    }
                }
            }
        }
    }

    /// Resolves once the lock service answers this worker again.
    pub async fn lock_service_back(&self) {
        while self.lock_service_reachable().await.is_err() {
            tokio::time::sleep(LOCK_REACH_CHECK_INTERVAL).await;
        }
    }

    /// The live session, or a new one if the current one is lost.
    async fn live_session(&self) -> Result<Session, ActivityFailure> {
        let mut session = self.session.lock().await;
        if !session.is_alive() {
            if let Some((at, why, _)) = self.open_failed.lock().expect("open_failed").as_ref() {
                if at.elapsed() < SESSION_OPEN_RETRY_AFTER {
                    return Err(ActivityFailure::Transient(format!(
                        "opening a lock session: {why} ({} ms ago)",
                        at.elapsed().as_millis()
                    )));
                }
            }
            let fresh = self
                .lock
                .open_session(&self.config.owner, self.config.lock_ttl)
                .await
                .map_err(|e| {
                    *self.open_failed.lock().expect("open_failed") =
                        Some((std::time::Instant::now(), e.to_string(), unreachable(&e)));
                    ActivityFailure::Transient(format!("opening a lock session: {e}"))
                })?;
            *self.open_failed.lock().expect("open_failed") = None;
            tracing::warn!(
                old = session.id(),
                new = fresh.id(),
                "lock session lost; opened a new one"
            );
            *session = fresh;
        }
        Ok(session.clone())
    }

    /// The grant's signed key and signature, from this process's own handle of it (the activity
    /// checked it is held just before: [`Backend::check_held`]), or from the signatures kept for
    /// a grant that left this process's handles since ([`RETIRED_SIGNATURE_KEPT`]). A grant this
    /// process never held is `GrantLost`: it has no signature here to present.
    fn presented(&self, grant: &Grant) -> Result<Presented, ActivityFailure> {
        {
            let grants = self.grants.lock().expect("grants");
            if let Some(held) = grants.get(&grant.key) {
                let handle = &held.handle;
                if handle.token() == grant.token && handle.session_id() == grant.session_id {
                    return Ok(Presented {
                        key: handle.key().to_string(),
                        signature: handle.signature().clone(),
                    });
                }
            }
        }
        if let Some(signature) = self.retired.lock().expect("retired").find(grant) {
            return Ok(Presented {
                key: grant.key.clone(),
                signature,
            });
        }
        Err(Refusal::GrantLost {
            key: grant.key.clone(),
            token: grant.token.get(),
            reason:
                "this worker process holds no signature for the grant (another process made it)"
                    .to_string(),
        }
        .into())
    }

    /// The payment resource's fence: the grant's owner and token, signed.
    fn fence(&self, grant: &Grant) -> Result<model::Fence, ActivityFailure> {
        let presented = self.presented(grant)?;
        Ok(model::Fence::new(grant.owner.clone(), grant.token)
            .map_err(payment_failure)?
            .signed(presented.key, presented.signature))
    }
}

/// The signal's signature as the payment resource takes it. Hex that does not decode is passed on
/// as no bytes: the resource refuses it (and records why) like any other bad signature.
fn operator_signature(
    s: Option<payout_activities::types::OperatorSignatureInput>,
) -> Option<model::OperatorSignature> {
    s.map(|s| model::OperatorSignature {
        signature: grant_signing::operator::from_hex(&s.signature).unwrap_or_default(),
        signed_at_unix_ms: s.signed_at_unix_ms,
    })
}

/// The decision as the payment resource recorded it: its audit event's `accepted` and `note`.
/// An event that does not say both breaks the resource's contract: it is read as refused (the
/// workflow acts on nothing it cannot read as accepted), and said loudly.
fn recorded_decision(event: &model::AuditEvent) -> RecordedDecision {
    let accepted = event.detail.get("accepted").and_then(|v| v.as_bool());
    let note = event.detail.get("note").and_then(|v| v.as_str());
    match (accepted, note) {
        (Some(accepted), Some(note)) => RecordedDecision {
            accepted,
            note: note.to_string(),
        },
        _ => {
            tracing::error!(audit_event = event.id, detail = %event.detail, payout_id = ?event.payout_id,
                "the payment resource's record of an operator decision says no accepted and note: read as refused");
            RecordedDecision {
                accepted: false,
                note: format!(
                    "refused: the payment resource's record of the decision (audit event {}) does \
                     not say whether it was accepted: {}",
                    event.id, event.detail
                ),
            }
        }
    }
}

fn payment_failure(e: PaymentError) -> ActivityFailure {
    match e {
        PaymentError::FencedOut {
            key,
            presented,
            stored,
            owner,
            ..
        } => Refusal::FencedOut {
            key,
            presented,
            stored,
            owner,
        }
        .into(),
        PaymentError::RefusedTransition {
            payout_id,
            from,
            event,
            ..
        } => Refusal::RefusedTransition {
            payout_id,
            from,
            event,
        }
        .into(),
        PaymentError::AccountBusy {
            account_id,
            in_flight_payout_id,
        } => Refusal::AccountBusy {
            account_id,
            in_flight_payout_id,
        }
        .into(),
        PaymentError::ResolutionSlaNotPassed { payout_id } => {
            Refusal::ResolutionSlaNotPassed { payout_id }.into()
        }
        // The database or the network: a retry may cure it.
        e @ PaymentError::Transport { .. } => ActivityFailure::Transient(e.to_string()),
        // paydb is a restored copy not yet re-armed: nothing changed; the step is retried until
        // the restore procedure has run (then this grant meets the raised fence and is fenced
        // out, and the workflow re-acquires). The payout waits; it is neither failed nor lost.
        e @ PaymentError::DatabaseRestored { .. } => ActivityFailure::Transient(e.to_string()),
        // Malformed requests, unknown payouts, broken invariants: a bug; never retried.
        e => Refusal::InvalidRequest {
            detail: e.to_string(),
        }
        .into(),
    }
}

/// The first transition into RAIL_AMBIGUOUS in a payout's audit trail, in Unix milliseconds.
fn ambiguous_since_unix_ms(history: &[model::AuditEvent]) -> Option<u64> {
    history
        .iter()
        .filter(|e| e.kind == "transition" && e.to_state.as_deref() == Some("RAIL_AMBIGUOUS"))
        .map(|e| e.at.timestamp_millis())
        .min()
        .and_then(|ms| u64::try_from(ms).ok())
}

fn snapshot(p: model::Payout) -> PayoutSnapshot {
    let instruction = match (
        payout_domain::AmountMinor::new(p.amount_minor),
        payout_domain::BeneficiaryRef::parse(p.beneficiary_ref.clone()),
    ) {
        (Ok(amount_minor), Ok(beneficiary_ref)) => Some(Instruction {
            account_id: p.account_id.clone(),
            amount_minor,
            currency: p.currency.clone(),
            beneficiary_ref,
        }),
        // The payment resource validated both at creation; a record that does not parse is a
        // broken invariant there, and without an instruction the workflow submits nothing.
        (amount, beneficiary) => {
            tracing::error!(payout_id = %p.payout_id, ?amount, ?beneficiary, "the payout record's instruction does not parse");
            None
        }
    };
    PayoutSnapshot {
        instruction,
        signed_instruction: p.instruction.as_ref().map(signed_instruction_to_history),
        payout_id: p.payout_id,
        state: p.state,
        claimed_by: p.claimed_by.unwrap_or_default(),
        token_stamp: p.token_stamp.unwrap_or(0),
        rail_ref: p.rail_ref.unwrap_or_default(),
        rail_outcome: p.rail_outcome.unwrap_or_default(),
        failure_reason: p.failure_reason.unwrap_or_default(),
        ambiguous_since_unix_ms: None,
    }
}

/// What the proxy's record says, in the workflow's terms. PENDING (intent without an ending) is
/// "no recorded outcome": ambiguous.
fn recorded_outcome(submission: &Submission) -> Option<RailOutcome> {
    let proof = rail_proof(submission);
    match &submission.outcome {
        Outcome::Acked { rail_ref } => Some(RailOutcome::Acked {
            rail_ref: rail_ref.clone(),
            proof,
        }),
        Outcome::Rejected { decline_code } => Some(RailOutcome::Declined {
            decline_code: decline_code.clone(),
            proof,
        }),
        Outcome::Timeout { detail } => Some(RailOutcome::Timeout {
            detail: detail.clone(),
        }),
        // Sealed unsent by a fenced inquiry: the sealer resolves the payout from its evidence;
        // a submitter that finds the seal records nothing definitive of its own.
        Outcome::Pending | Outcome::NotSent { .. } => None,
    }
}

// The signed facts (issue 33) between their wire forms and Temporal's history. The worker only
// carries them: it never makes, checks or alters one.

/// The payment resource's signed instruction, as history keeps it (signature in hex).
fn signed_instruction_to_history(
    s: &grant_signing::instruction::SignedInstruction,
) -> SignedInstruction {
    let i = &s.instruction;
    SignedInstruction {
        payout_id: i.payout_id.clone(),
        account_id: i.account_id.clone(),
        currency: i.currency.clone(),
        beneficiary_ref: i.beneficiary_ref.clone(),
        client_reference: i.client_reference.clone(),
        lock_key: i.lock_key.clone(),
        amount_minor: i.amount_minor,
        token: i.token,
        issued_at_unix_ms: i.issued_at_unix_ms,
        expires_at_unix_ms: i.expires_at_unix_ms,
        signing_key_id: s.signature.key_id.clone(),
        signature: grant_signing::to_hex(&s.signature.bytes),
    }
}

/// History's instruction back to what the proxy verifies. Signature text that is not hex is
/// carried as no bytes: the proxy then refuses it (`bad_signature`), which is the truth.
fn signed_instruction_from_history(
    s: SignedInstruction,
) -> grant_signing::instruction::SignedInstruction {
    grant_signing::instruction::SignedInstruction {
        signature: Signature {
            key_id: s.signing_key_id,
            bytes: grant_signing::from_hex(&s.signature).unwrap_or_default(),
        },
        instruction: grant_signing::instruction::Instruction {
            payout_id: s.payout_id,
            account_id: s.account_id,
            currency: s.currency,
            beneficiary_ref: s.beneficiary_ref,
            client_reference: s.client_reference,
            lock_key: s.lock_key,
            amount_minor: s.amount_minor,
            token: s.token,
            issued_at_unix_ms: s.issued_at_unix_ms,
            expires_at_unix_ms: s.expires_at_unix_ms,
        },
    }
}

/// The proxy's signature over `submission`'s final outcome, as history keeps it.
fn rail_proof(submission: &Submission) -> Option<RailProof> {
    let signed = submission.outcome_signature.as_ref()?;
    Some(RailProof {
        key_id: signed.signature.key_id.clone(),
        signature: grant_signing::to_hex(&signed.signature.bytes),
        token: submission.token.get(),
        signed_at_unix_ms: signed.signed_at_unix_ms,
    })
}

/// The fact a RecordOutcome carries to the payment resource: `outcome` (`ACKED`, `REJECTED`)
/// with `proof`.
fn rail_fact(
    outcome: &str,
    rail_ref: &str,
    decline_code: &str,
    proof: &RailProof,
) -> model::RailFact {
    model::RailFact {
        outcome: outcome.to_string(),
        rail_ref: rail_ref.to_string(),
        decline_code: decline_code.to_string(),
        token: proof.token,
        signed_at_unix_ms: proof.signed_at_unix_ms,
        signature: Signature {
            key_id: proof.key_id.clone(),
            bytes: grant_signing::from_hex(&proof.signature).unwrap_or_default(),
        },
    }
}

/// The newest of the proxy's signed resolutions that supports `evidence`: FOUND listing the
/// rail reference, or ABSENT / NEVER_SENT for absence.
fn supporting_resolution(
    resolutions: &[rail_proxy_client::Resolution],
    evidence: &Evidence,
) -> Option<model::RailEvidence> {
    resolutions
        .iter()
        .filter(|r| match (evidence, &r.evidence) {
            (Evidence::Found { rail_ref }, ProxyEvidence::Found { rail_refs }) => {
                rail_refs.contains(rail_ref)
            }
            (Evidence::Absent, ProxyEvidence::Absent | ProxyEvidence::NeverSent) => true,
            _ => false,
        })
        .filter(|r| r.signature.is_some())
        .max_by_key(|r| r.asked_at_unix_ms)
        .and_then(|r| {
            let signed = r.signature.as_ref()?;
            Some(model::RailEvidence {
                evidence: r.evidence.name().to_string(),
                rail_refs: match &r.evidence {
                    ProxyEvidence::Found { rail_refs } => rail_refs.clone(),
                    _ => Vec::new(),
                },
                asked_by: r.asked_by.clone(),
                asked_at_unix_ms: r.asked_at_unix_ms,
                signature: signed.signature.clone(),
            })
        })
}

/// Every [`UNCLAIMED_GRANT_SWEEP`], releases the grants no workflow has used within `max` of
/// being made (see [`ServiceBackend::connect`]), and forgets the retired signatures older than
/// [`RETIRED_SIGNATURE_KEPT`]. An unused grant's signature is not kept: no fenced call passed
/// its check.
async fn sweep_unclaimed(
    grants: Arc<Mutex<HashMap<String, Held>>>,
    retired: Arc<Mutex<Retired>>,
    max: Duration,
) {
    let mut tick = tokio::time::interval(UNCLAIMED_GRANT_SWEEP.min(max));
    loop {
        tick.tick().await;
        retired
            .lock()
            .expect("retired")
            .prune(RETIRED_SIGNATURE_KEPT);
        let unclaimed: Vec<(String, Held)> = {
            let mut grants = grants.lock().expect("grants");
            let keys: Vec<String> = grants
                .iter()
                .filter(|(_, h)| !h.used && h.made.elapsed() >= max)
                .map(|(k, _)| k.clone())
                .collect();
            keys.into_iter()
                .filter_map(|k| grants.remove(&k).map(|h| (k, h)))
                .collect()
        };
        for (key, held) in unclaimed {
            let token = held.handle.token().get();
            let owner = held.handle.owner().to_string();
            match held.handle.release().await {
                Ok(()) => tracing::warn!(
                    key,
                    owner,
                    token,
                    unused_ms = held.made.elapsed().as_millis() as u64,
                    "released a grant no workflow took up (its acquire's answer reached nobody)"
                ),
                Err(e) => {
                    tracing::warn!(key, owner, token, error = %e, "releasing a grant no workflow took up failed; its session's end will free it")
                }
            }
        }
    }
}

fn boxed<'a, T: Send + 'a>(
    f: impl std::future::Future<Output = Result<T, ActivityFailure>> + Send + 'a,
) -> Answer<'a, T> {
    Box::pin(f)
}

impl Backend for ServiceBackend {
    fn acquire(&self, input: AcquireInput, wait: Duration) -> Answer<'_, AcquireOutcome> {
        boxed(async move {
            let key = lock_key(&input.account_id);
            let session = self.live_session().await?;
            // One grant per payout, not per worker: a worker runs many workflows on one session,
            // and acquire is idempotent per (owner, session). With the worker's identity as the
            // owner, two payouts of one account on one worker would share one grant.
            let owner = format!("{}/{}", self.config.owner, input.payout_id);
            let acquired = session
                .acquire_as(&key, &owner, wait)
                .await
                .map_err(|e| ActivityFailure::Transient(format!("acquire {key}: {e}")))?;
            match acquired {
                Acquired::Granted(handle) => {
                    let grant = Grant {
                        key: key.clone(),
                        owner: handle.owner().to_string(),
                        session_id: handle.session_id().to_string(),
                        token: handle.token(),
                        task_queue: self.config.private_task_queue.clone(),
                    };
                    tracing::info!(payout_id = %input.payout_id, account_id = %input.account_id, key, token = grant.token.get(), "grant held");
                    let replaced = self.grants.lock().expect("grants").insert(
                        key,
                        Held {
                            handle,
                            made: std::time::Instant::now(),
                            used: false,
                        },
                    );
                    if let Some(old) = replaced {
                        self.retired.lock().expect("retired").keep(&old.handle);
                    }
                    Ok(AcquireOutcome::Granted(grant))
                }
                Acquired::NotAcquired {
                    holder_owner,
                    holder_token,
                } => Ok(AcquireOutcome::NotAcquired {
                    holder_owner,
                    holder_token,
                }),
            }
        })
    }

    fn task_queue(&self) -> String {
        self.config.private_task_queue.clone()
    }

    fn check_held(&self, grant: &Grant) -> Result<(), Refusal> {
        let lost = |reason: &str| Refusal::GrantLost {
            key: grant.key.clone(),
            token: grant.token.get(),
            reason: reason.to_string(),
        };
        let mut grants = self.grants.lock().expect("grants");
        let Some(held) = grants.get_mut(&grant.key) else {
            return Err(lost("this worker process holds no grant on the key (another process made it, or it was released)"));
        };
        let handle = &held.handle;
        if handle.token() != grant.token || handle.session_id() != grant.session_id {
            return Err(lost("this worker's grant on the key is a different one"));
        }
        if !handle.is_held() {
            return Err(lost("the lock client's conservative deadline has passed"));
        }
        held.used = true;
        Ok(())
    }

    fn release(&self, grant: Grant) -> Answer<'_, ()> {
        boxed(async move {
            let handle = {
                let mut grants = self.grants.lock().expect("grants");
                match grants.get(&grant.key) {
                    Some(h)
                        if h.handle.token() == grant.token
                            && h.handle.session_id() == grant.session_id =>
                    {
                        grants.remove(&grant.key)
                    }
                    _ => None,
                }
            };
            // Not ours (any more): the session that held it ended, or the key went to a later
            // grant. Either way there is nothing of ours to free.
            let Some(handle) = handle else { return Ok(()) };
            // The handle goes back unless the release is settled: a release that failed in
            // transit (lock service restarting) is retried by the activity's policy, and the
            // retry must still find the handle, or the key stays held by this live session
            // and every later payout of the account waits forever.
            match handle.handle.release().await {
                Ok(()) | Err(ClientError::Rejected { .. }) | Err(ClientError::SessionLost) => {
                    self.retired.lock().expect("retired").keep(&handle.handle);
                    Ok(())
                }
                Err(e) => {
                    self.grants
                        .lock()
                        .expect("grants")
                        .entry(grant.key.clone())
                        .or_insert(handle);
                    Err(ActivityFailure::Transient(format!("release: {e}")))
                }
            }
        })
    }

    fn get_payout(&self, payout_id: PayoutId) -> Answer<'_, PayoutSnapshot> {
        boxed(async move {
            let found = self
                .payment
                .get_payout(&payout_id)
                .await
                .map_err(payment_failure)?;
            let ambiguous_since = ambiguous_since_unix_ms(&found.history);
            Ok(PayoutSnapshot {
                ambiguous_since_unix_ms: ambiguous_since,
                ..snapshot(found.payout)
            })
        })
    }

    fn claim(&self, input: FencedInput) -> Answer<'_, PayoutSnapshot> {
        boxed(async move {
            let fence = self.fence(&input.grant)?;
            let p = self
                .payment
                .claim(&input.payout_id, &fence)
                .await
                .map_err(payment_failure)?;
            Ok(snapshot(p))
        })
    }

    fn mark_submitted(&self, input: FencedInput) -> Answer<'_, PayoutSnapshot> {
        boxed(async move {
            let fence = self.fence(&input.grant)?;
            let p = self
                .payment
                .mark_submitted(&input.payout_id, &fence)
                .await
                .map_err(payment_failure)?;
            Ok(snapshot(p))
        })
    }

    fn record_outcome(&self, input: RecordOutcomeInput) -> Answer<'_, PayoutSnapshot> {
        boxed(async move {
            let fence = self.fence(&input.grant)?;
            // What the proxy signed: (outcome, rail_ref, decline_code) and the proof history
            // carries, if any.
            let (outcome, detail, signed) = match input.outcome {
                RailOutcome::Acked { rail_ref, proof } => (
                    model::RailOutcome::Acked {
                        rail_ref: rail_ref.clone(),
                    },
                    String::new(),
                    Some(("ACKED", rail_ref, String::new(), proof)),
                ),
                RailOutcome::Declined {
                    decline_code,
                    proof,
                } => (
                    model::RailOutcome::Declined {
                        decline_code: decline_code.clone(),
                    },
                    String::new(),
                    Some(("REJECTED", String::new(), decline_code, proof)),
                ),
                RailOutcome::Timeout { detail } => (model::RailOutcome::Timeout, detail, None),
                RailOutcome::OutcomeMissing => {
                    (model::RailOutcome::OutcomeMissing, String::new(), None)
                }
            };
            let fact = match &signed {
                None => None,
                Some((name, rail_ref, code, Some(proof))) => {
                    Some(rail_fact(name, rail_ref, code, proof))
                }
                // A history recorded before proofs were carried: the proxy's record, re-read.
                Some((name, rail_ref, code, None)) => {
                    self.looked_up_outcome(&input.payout_id, name, rail_ref, code)
                        .await?
                }
            };
            // The payment resource bounds free text; a long transport error is cut, not refused.
            let detail: String = detail.chars().take(model::TEXT_LENGTH_MAX / 2).collect();
            let answer = self
                .payment
                .record_outcome_proven(&input.payout_id, &fence, &outcome, &detail, fact.as_ref())
                .await;
            let answer = match (answer, &signed) {
                // The carried proof's key was rotated away (or the proof was damaged on the way):
                // the proxy's record, re-signed with its current key, once.
                (
                    Err(PaymentError::RailFactRefused { reason, .. }),
                    Some((name, rail_ref, code, Some(_carried))),
                ) if reason == "unknown_key_id" || reason == "bad_signature" => {
                    let fresh = self
                        .looked_up_outcome(&input.payout_id, name, rail_ref, code)
                        .await?;
                    self.payment
                        .record_outcome_proven(
                            &input.payout_id,
                            &fence,
                            &outcome,
                            &detail,
                            fresh.as_ref(),
                        )
                        .await
                }
                (answer, _) => answer,
            };
            Ok(snapshot(answer.map_err(payment_failure)?))
        })
    }

    fn post(&self, input: FencedInput) -> Answer<'_, PayoutSnapshot> {
        boxed(async move {
            let fence = self.fence(&input.grant)?;
            let posted = self
                .payment
                .post(&input.payout_id, &fence)
                .await
                .map_err(payment_failure)?;
            Ok(snapshot(posted.payout))
        })
    }

    fn resolve(&self, input: ResolveInput) -> Answer<'_, PayoutSnapshot> {
        boxed(async move {
            let fence = self.fence(&input.grant)?;
            // The proxy's signed evidence is not carried through history (Inquiry's unit variants
            // would not decode in older histories with fields): it is read back from the proxy's
            // record of the inquiry the workflow just made. None found: the payment resource
            // refuses, which is the truth (issue 33).
            // A Lookup that fails is transient: retried, never sent without its evidence.
            let proof = match self.proxy.clone().lookup(&input.payout_id).await {
                Ok(Some(record)) => supporting_resolution(&record.resolutions, &input.evidence),
                Ok(None) => None,
                Err(e) => {
                    tracing::warn!(payout_id = %input.payout_id, error = %e, "no signed evidence yet: the proxy's Lookup failed");
                    return Err(ActivityFailure::Transient(format!(
                        "the rail proxy's signed evidence could not be read: {e}"
                    )));
                }
            };
            let evidence = match input.evidence {
                Evidence::Found { rail_ref } => model::Evidence::Found { rail_ref },
                Evidence::Absent => model::Evidence::Absent,
            };
            let source = format!(
                "rail lookup through the rail proxy, by {}",
                input.grant.owner
            );
            let p = self
                .payment
                .resolve_ambiguity_proven(
                    &input.payout_id,
                    &fence,
                    &evidence,
                    &source,
                    proof.as_ref(),
                )
                .await
                .map_err(payment_failure)?;
            Ok(snapshot(p))
        })
    }

    fn abandon(&self, input: AbandonInput) -> Answer<'_, PayoutSnapshot> {
        boxed(async move {
            let fence = self.fence(&input.grant)?;
            let request = model::AbandonRequest {
                operator: input.operator,
                reason: input.reason,
                resolution_sla_passed: input.resolution_sla_passed,
                sla_check: input.sla_check,
                signature: operator_signature(input.operator_signature),
            };
            let p = self
                .payment
                .abandon(&input.payout_id, &fence, &request)
                .await
                .map_err(payment_failure)?;
            Ok(snapshot(p))
        })
    }

    fn record_operator_decision(
        &self,
        input: OperatorDecisionInput,
    ) -> Answer<'_, RecordedDecision> {
        boxed(async move {
            let decision = model::OperatorDecision {
                payout_id: input.payout_id,
                operator: input.operator,
                decision: input.decision,
                reason: input.reason,
                accepted: input.accepted,
                note: input.note,
                token: input.token,
                signature: operator_signature(input.operator_signature),
            };
            let event = self
                .payment
                .record_operator_decision(&decision)
                .await
                .map_err(payment_failure)?;
            Ok(recorded_decision(&event))
        })
    }

    fn submit(&self, input: SubmitInput) -> Answer<'_, SubmitAnswer> {
        boxed(self.submit_checked(input))
    }

    fn inquire(&self, input: InquireInput) -> Answer<'_, Inquiry> {
        boxed(async move {
            // The inquiry is a fenced call (it may seal the payout): only a live grant of this
            // process presents its token.
            self.check_held(&input.grant)?;
            let presented = self.presented(&input.grant)?;
            let request = InquirePayout::new(
                input.payout_id.clone(),
                input.account_id.clone(),
                input.grant.token,
                input.grant.owner.clone(),
                self.config.owner.clone(),
            )
            .signed(presented.key, presented.signature);
            let mut proxy = self.proxy.clone();
            match proxy.inquire(&request).await {
                Ok(answer) => Ok(match answer.resolution.evidence {
                    ProxyEvidence::Found { rail_refs } => {
                        if rail_refs.len() > 1 {
                            tracing::error!(payout_id = %input.payout_id, ?rail_refs, "the rail shows more than one movement for one payout");
                        }
                        match rail_refs.into_iter().next() {
                            Some(rail_ref) => Inquiry::Found { rail_ref },
                            None => Inquiry::Unknown {
                                detail: "FOUND without a reference".into(),
                            },
                        }
                    }
                    ProxyEvidence::Absent => Inquiry::Absent,
                    ProxyEvidence::NeverSent => Inquiry::NeverSent,
                    ProxyEvidence::Unknown { detail } => Inquiry::Unknown { detail },
                }),
                // A later token holds the account at the proxy: this grant is stale.
                Err(e @ ProxyError::FencedOut { .. }) => Err(proxy_fenced_out(e)),
                // Only a proxy that does not seal answers this: no record, and a stale request
                // could still be on its way, so this is not "absent" evidence.
                Err(ProxyError::NotFound { .. }) => Ok(Inquiry::Unknown {
                    detail: "the rail proxy holds no submission for this payout".into(),
                }),
                Err(ProxyError::InvalidArgument { field, reason }) => {
                    Err(Refusal::InvalidRequest {
                        detail: format!("rail proxy refused {field}: {reason}"),
                    }
                    .into())
                }
                // The proxy refused the grant itself (not the lock service's signature, or signed
                // for another account's key): a misconfiguration or a bug, which no retry cures.
                Err(
                    e @ (ProxyError::ForgedGrant { .. } | ProxyError::GrantForAnotherKey { .. }),
                ) => Err(Refusal::InvalidRequest {
                    detail: format!("rail proxy refused the grant: {e}"),
                }
                .into()),
                // proxydb is a restored copy not yet re-armed: nothing was written; the inquiry
                // is retried until the restore procedure has run.
                Err(e @ ProxyError::DatabaseRestored { .. }) => {
                    Err(ActivityFailure::Transient(e.to_string()))
                }
                Err(e) => Err(ActivityFailure::Transient(e.to_string())),
            }
        })
    }
}

impl ServiceBackend {
    /// The proxy's signed outcome for a RecordOutcome whose history carries none (recorded
    /// before proofs were carried): attached only if the proxy's record says the same thing;
    /// otherwise none, and the payment resource refuses.
    ///
    /// A Lookup that fails (the proxy unreachable) is transient: the step is retried rather than
    /// sent without its fact, which the payment resource would refuse for good.
    async fn looked_up_outcome(
        &self,
        payout_id: &PayoutId,
        outcome: &str,
        rail_ref: &str,
        decline_code: &str,
    ) -> Result<Option<model::RailFact>, ActivityFailure> {
        let record = match self.proxy.clone().lookup(payout_id).await {
            Ok(Some(record)) => record,
            Ok(None) => return Ok(None),
            Err(e) => {
                tracing::warn!(%payout_id, error = %e, "no signed outcome yet: the proxy's Lookup failed");
                return Err(ActivityFailure::Transient(format!(
                    "the rail proxy's signed outcome could not be read: {e}"
                )));
            }
        };
        let Some(fact) = record.submission.outcome_fact() else {
            return Ok(None);
        };
        let says_the_same = fact.outcome == outcome
            && fact.rail_ref == rail_ref
            && fact.decline_code == decline_code;
        if !says_the_same {
            tracing::warn!(%payout_id, recorded = fact.outcome, asked = outcome, "the proxy's record does not say what RecordOutcome asks: no proof attached");
            return Ok(None);
        }
        Ok(rail_proof(&record.submission)
            .map(|proof| rail_fact(outcome, rail_ref, decline_code, &proof)))
    }

    /// The Submit itself, once the activity's grant check is behind it.
    async fn submit_checked(&self, input: SubmitInput) -> Result<SubmitAnswer, ActivityFailure> {
        let presented = self.presented(&input.grant)?;
        let request = SubmitPayout::new(
            input.payout_id.clone(),
            input.account_id.clone(),
            input.grant.token,
            input.grant.owner.clone(),
            input.amount_minor,
            input.currency.clone(),
            input.beneficiary_ref.clone(),
        )
        .signed(presented.key, presented.signature)
        // Relayed as the workflow carried it; the proxy judges it (and audits a refusal).
        .instructed(
            input
                .signed_instruction
                .map(signed_instruction_from_history),
        );
        // The reference is derived from the payout id on both sides; a difference is a bug.
        if request.client_reference != input.client_reference {
            return Err(Refusal::InvalidRequest {
                detail: format!(
                    "client reference {} is not the one derived from payout {}",
                    input.client_reference, input.payout_id
                ),
            }
            .into());
        }
        let mut proxy = self.proxy.clone();
        match proxy.submit(&request).await {
            Ok(submission) => Ok(match submission.outcome.clone() {
                Outcome::Acked { rail_ref } => SubmitAnswer::Acked {
                    rail_ref,
                    proof: rail_proof(&submission),
                },
                Outcome::Rejected { decline_code } => SubmitAnswer::Declined {
                    decline_code,
                    proof: rail_proof(&submission),
                },
                Outcome::Timeout { detail } => SubmitAnswer::Ambiguous { detail },
                Outcome::Pending => SubmitAnswer::Ambiguous {
                    detail: "the proxy recorded the intent but no outcome".into(),
                },
                // A submit never answers with a seal (it would be a DUPLICATE); should it,
                // the conservative reading is "unknown", which the inquiry then resolves.
                Outcome::NotSent { .. } => SubmitAnswer::Ambiguous {
                    detail: "the proxy answered a submit with a sealed (NOT_SENT) record".into(),
                },
            }),
            Err(e @ ProxyError::FencedOut { .. }) => Err(proxy_fenced_out(e)),
            Err(ProxyError::Duplicate { existing, .. }) => Err(Refusal::DuplicateSubmission {
                payout_id: input.payout_id.to_string(),
                existing_outcome: recorded_outcome(&existing),
            }
            .into()),
            Err(ProxyError::InvalidArgument { field, reason }) => Err(Refusal::InvalidRequest {
                detail: format!("rail proxy refused {field}: {reason}"),
            }
            .into()),
            // Refused before anything was written or sent: the grant is not one the lock service
            // signed for this account (a misconfigured key, or a bug). No retry cures it.
            Err(e @ (ProxyError::ForgedGrant { .. } | ProxyError::GrantForAnotherKey { .. })) => {
                Err(Refusal::InvalidRequest {
                    detail: format!("rail proxy refused the grant: {e}"),
                }
                .into())
            }
            // proxydb is a restored copy not yet re-armed: refused before the intent, so nothing
            // was sent. The submission is never retried by Temporal, so the conservative answer
            // stands: ambiguous, which the fenced inquiry resolves once the restore procedure has
            // run (it finds no submission, seals the payout NOT_SENT, and the payout fails with
            // its funds released; it is never paid twice and never stranded).
            Err(e @ ProxyError::DatabaseRestored { .. }) => Ok(SubmitAnswer::Ambiguous {
                detail: e.to_string(),
            }),
            // Everything else is an unclear answer: money may have moved.
            Err(e) => Ok(SubmitAnswer::Ambiguous {
                detail: e.to_string(),
            }),
        }
    }
}

/// The rail proxy's refusal of a stale token, as the workflow's `FencedOut` (one mapping for
/// Submit and Inquire): the worker re-acquires, exactly as after the payment resource's refusal.
fn proxy_fenced_out(error: ProxyError) -> ActivityFailure {
    match error {
        ProxyError::FencedOut {
            key,
            presented,
            stored,
            owner,
            ..
        } => Refusal::FencedOut {
            key,
            presented,
            stored,
            owner,
        }
        .into(),
        other => unreachable!("only called with FencedOut, got {other:?}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn signer(id: &str) -> grant_signing::Signer {
        grant_signing::Signer::generate(id).unwrap().0
    }

    /// The instruction crosses history (hex signature) and comes back verifying exactly as the
    /// payment resource signed it.
    #[test]
    fn a_signed_instruction_survives_history() {
        let pr = signer("pr-1");
        let verifier = grant_signing::Verifier::new([pr.public_key()]).unwrap();
        let signed = pr.sign_instruction(grant_signing::instruction::Instruction {
            payout_id: "p-1".into(),
            account_id: "acct-1".into(),
            currency: "EUR".into(),
            beneficiary_ref: "ben-1".into(),
            client_reference: "cref-p-1".into(),
            lock_key: "payout:acct-1".into(),
            amount_minor: 1_000,
            token: 7,
            issued_at_unix_ms: 1,
            expires_at_unix_ms: 2,
        });
        let back = signed_instruction_from_history(signed_instruction_to_history(&signed));
        assert_eq!(back, signed);
        assert_eq!(
            verifier.verify_instruction(&back, &back.instruction.presented(), 1),
            Ok(())
        );
    }

    /// Evidence for ResolveAmbiguity is the newest signed resolution that supports it: FOUND
    /// listing the reference, ABSENT or NEVER_SENT for absence; nothing else.
    #[test]
    fn the_supporting_resolution_is_the_newest_signed_one_that_says_the_same() {
        let proxy = signer("proxy-1");
        let resolution =
            |evidence: ProxyEvidence, at: i64, signed: bool| rail_proxy_client::Resolution {
                payout_id: PayoutId::parse("p-1").unwrap(),
                asked_by: "w".into(),
                asked_at_unix_ms: at,
                evidence,
                account_id: None,
                signature: signed.then(|| rail_proxy_client::model::FactSignature {
                    signature: proxy.sign("x", 1, "y"),
                    signed_at_unix_ms: at,
                }),
            };
        let found = |refs: &[&str]| ProxyEvidence::Found {
            rail_refs: refs.iter().map(|r| r.to_string()).collect(),
        };
        let rs = vec![
            resolution(found(&["r-1"]), 1, true),
            resolution(found(&["r-1", "r-2"]), 3, true),
            resolution(found(&["r-1"]), 5, false),
            resolution(
                ProxyEvidence::Unknown {
                    detail: String::new(),
                },
                6,
                true,
            ),
            resolution(ProxyEvidence::NeverSent, 2, true),
        ];
        let picked = supporting_resolution(
            &rs,
            &Evidence::Found {
                rail_ref: "r-1".into(),
            },
        )
        .unwrap();
        // The unsigned one at 5 is passed over: the newest signed FOUND listing r-1 is at 3.
        assert_eq!(
            (picked.evidence.as_str(), picked.asked_at_unix_ms),
            ("FOUND", 3)
        );
        assert_eq!(picked.rail_refs, ["r-1", "r-2"]);
        assert!(supporting_resolution(
            &rs,
            &Evidence::Found {
                rail_ref: "fake".into()
            }
        )
        .is_none());
        let absent = supporting_resolution(&rs, &Evidence::Absent).unwrap();
        assert_eq!(absent.evidence, "NEVER_SENT");
    }
}
