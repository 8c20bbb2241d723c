//! The gRPC boundary: wire types are converted to domain values here and nowhere else.

use std::sync::Arc;

use payout_proto::ledger as pb;
use payout_proto::ledger::general_ledger_service_server::GeneralLedgerService;
use tonic::{Request, Response, Status};
use uuid::Uuid;

use crate::error::LedgerError;
use crate::store::{wire_amount, EntryFilter, Mode, ModeState, Store, StoredEntry, StoredJournal};
use crate::validate::{self, account_key, format_time, parse_time, AccountKey, ACCOUNT_CLASSES};

#[derive(Clone)]
pub struct LedgerMetrics {
    pub journals: prometheus::IntCounterVec,
    pub events: prometheus::IntCounterVec,
    pub rejections: prometheus::IntCounterVec,
    /// The server's `unauthorised_calls_total`: a mode change naming an operator its
    /// certificate does not carry is counted there.
    pub unauthorised_calls: prometheus::IntCounterVec,
}

impl LedgerMetrics {
    pub fn new(metrics: &service_kit::Metrics) -> Self {
        Self {
            journals: metrics.counter_vec(
                "gl_journals_total",
                "AppendJournal outcomes",
                &["outcome"],
            ),
            events: metrics.counter_vec(
                "gl_transaction_events_total",
                "AppendTransactionEvent outcomes",
                &["outcome"],
            ),
            rejections: metrics.counter_vec(
                "gl_rejections_total",
                "Refused requests by reason",
                &["reason"],
            ),
            unauthorised_calls: metrics.unauthorised_calls(),
        }
    }
}

use service_kit::prometheus;

pub struct LedgerApi {
    pub store: Arc<Store>,
    pub metrics: LedgerMetrics,
    /// Break-glass calls record only the operator the caller's certificate carries (always,
    /// except in a negative control: `Config::without_operator_certification_for_tests`).
    pub certifies_operators: bool,
}

fn entry_to_wire(e: &StoredEntry) -> pb::Entry {
    pb::Entry {
        journal_id: e.journal_id.to_string(),
        line_number: e.line_number as u32,
        account_id: e.account_id.to_string(),
        account: Some(pb::AccountRef {
            class: e.account.class.clone(),
            owner_type: e.account.owner_type.clone(),
            owner_id: e.account.owner_id.clone(),
        }),
        asset: e.account.asset.clone(),
        amount: wire_amount(e.amount),
        description: e.description.clone(),
        receipt_sequence: e.receipt_sequence as u64,
        recorded_at: format_time(e.recorded_at),
        occurred_at: format_time(e.occurred_at),
    }
}

pub fn journal_to_wire(j: &StoredJournal) -> pb::Journal {
    pb::Journal {
        journal_id: j.id.to_string(),
        source_service: j.source_service.clone(),
        idempotency_key: j.idempotency_key.clone(),
        payload_hash: j.payload_hash.clone(),
        source_transaction_id: j.source_transaction_id.clone(),
        tracking_code: j.tracking_code.clone(),
        effect_kind: j.effect_kind.clone(),
        effect_version: j.effect_version as u32,
        reversal_of: j.reversal_of.map(|u| u.to_string()).unwrap_or_default(),
        occurred_at: format_time(j.occurred_at),
        recorded_at: format_time(j.recorded_at),
        correlation_id: j.correlation_id.clone(),
        actor_id: j.actor_id.clone(),
        metadata_json: validate::canonical_json(&j.metadata),
        receipt_sequence: j.receipt_sequence as u64,
        entries: j.entries.iter().map(entry_to_wire).collect(),
        source_sequence: j.source_sequence.map_or(0, |s| s as u64),
        settlement_reference: j.settlement_reference.clone(),
        client_reference: j.client_reference.clone(),
        correction: j
            .correction
            .as_ref()
            .map(|(by, reference)| pb::CorrectionApproval {
                approved_by: by.clone(),
                approval_reference: reference.clone(),
            }),
    }
}

fn mode_to_wire(m: &ModeState) -> pb::OperatingModeState {
    let mode = match m.mode {
        Mode::Mirror => pb::OperatingMode::Mirror,
        Mode::Reconcile => pb::OperatingMode::Reconcile,
        Mode::DegradedLedger => pb::OperatingMode::DegradedLedger,
    };
    pb::OperatingModeState {
        mode: mode as i32,
        changed_by: m.changed_by.clone(),
        reason: m.reason.clone(),
        changed_at: format_time(m.changed_at),
        change_sequence: m.change_sequence as u64,
    }
}

fn account_input(account: Option<&pb::AccountRef>, asset: &str) -> Result<AccountKey, LedgerError> {
    validate::check_account_text(account)?;
    if !validate::valid_asset(asset) {
        return Err(LedgerError::InvalidField {
            field: "asset",
            detail: format!("{asset:?}"),
        });
    }
    match account_key(account, asset) {
        Some(k)
            if ACCOUNT_CLASSES.contains(&k.class.as_str())
                && !k.owner_type.is_empty()
                && !k.owner_id.is_empty() =>
        {
            Ok(k)
        }
        _ => Err(LedgerError::InvalidField {
            field: "account",
            detail: "class (one of the known classes), owner_type and owner_id".into(),
        }),
    }
}

impl LedgerApi {
    fn refuse(&self, e: LedgerError) -> Status {
        if !matches!(e, LedgerError::Storage(_)) {
            self.metrics
                .rejections
                .with_label_values(&[e.reason().as_str_name()])
                .inc();
        }
        e.into_status()
    }
}

#[tonic::async_trait]
impl GeneralLedgerService for LedgerApi {
    async fn append_journal(
        &self,
        request: Request<pb::AppendJournalRequest>,
    ) -> Result<Response<pb::AppendJournalResponse>, Status> {
        let req = request.into_inner();
        let validated = match validate::validate(&req) {
            Ok(v) => v,
            Err(e) => {
                tracing::warn!(idempotency_key = %req.idempotency_key, error = %e, "journal refused");
                return Err(self.refuse(e));
            }
        };
        match self.store.append_journal(&validated).await {
            Ok((journal, created)) => {
                let outcome = if created { "created" } else { "replayed" };
                self.metrics.journals.with_label_values(&[outcome]).inc();
                tracing::info!(journal_id = %journal.id, idempotency_key = %journal.idempotency_key,
                    receipt_sequence = journal.receipt_sequence, created, "journal recorded");
                Ok(Response::new(pb::AppendJournalResponse {
                    journal: Some(journal_to_wire(&journal)),
                    created,
                }))
            }
            Err(e) => {
                tracing::warn!(idempotency_key = %validated.idempotency_key, error = %e, "journal refused");
                Err(self.refuse(e))
            }
        }
    }

    async fn append_transaction_event(
        &self,
        request: Request<pb::AppendTransactionEventRequest>,
    ) -> Result<Response<pb::AppendTransactionEventResponse>, Status> {
        let r = request.into_inner();
        let result = match validate::validate_event(&r) {
            Ok(event) => self.store.append_event(&event).await,
            Err(e) => Err(e),
        };
        match result {
            Ok((id, created, recorded_at)) => {
                self.metrics
                    .events
                    .with_label_values(&[if created { "created" } else { "replayed" }])
                    .inc();
                tracing::info!(event_id = %id, source_transaction_id = %r.source_transaction_id,
                    event_type = %r.event_type, event_version = r.event_version,
                    source_sequence = r.source_sequence, created, "transaction event recorded");
                Ok(Response::new(pb::AppendTransactionEventResponse {
                    event_id: id.to_string(),
                    created,
                    recorded_at: format_time(recorded_at),
                }))
            }
            Err(e) => {
                tracing::warn!(source_transaction_id = %r.source_transaction_id,
                    event_version = r.event_version, error = %e, "transaction event refused");
                Err(self.refuse(e))
            }
        }
    }

    async fn open_account(
        &self,
        request: Request<pb::OpenAccountRequest>,
    ) -> Result<Response<pb::OpenAccountResponse>, Status> {
        let r = request.into_inner();
        let key = account_input(r.account.as_ref(), &r.asset).map_err(|e| self.refuse(e))?;
        let (id, created) = self
            .store
            .open_account(&key)
            .await
            .map_err(|e| self.refuse(e))?;
        if created {
            tracing::info!(account = %key, account_id = %id, "ledger account opened");
        }
        Ok(Response::new(pb::OpenAccountResponse {
            account_id: id.to_string(),
            created,
        }))
    }

    async fn get_journal(
        &self,
        request: Request<pb::GetJournalRequest>,
    ) -> Result<Response<pb::Journal>, Status> {
        let id = match request.into_inner().key {
            Some(pb::get_journal_request::Key::JournalId(id)) => Uuid::parse_str(&id).ok(),
            Some(pb::get_journal_request::Key::IdempotencyKey(key)) => {
                validate::bounded(&key, "idempotency_key").map_err(|e| self.refuse(e))?;
                self.store
                    .journal_id_by_key(&key)
                    .await
                    .map_err(|e| self.refuse(e))?
            }
            None => None,
        };
        let journal = match id {
            Some(id) => self.store.journal(id).await.map_err(|e| self.refuse(e))?,
            None => None,
        };
        journal
            .map(|j| Response::new(journal_to_wire(&j)))
            .ok_or_else(|| {
                self.refuse(LedgerError::NotFound {
                    what: "journal".into(),
                })
            })
    }

    async fn list_entries(
        &self,
        request: Request<pb::ListEntriesRequest>,
    ) -> Result<Response<pb::ListEntriesResponse>, Status> {
        let r = request.into_inner();
        let parse = || -> Result<EntryFilter, LedgerError> {
            validate::check_account_text(r.account.as_ref())?;
            validate::bounded(&r.asset, "asset")?;
            validate::bounded(&r.source_transaction_id, "source_transaction_id")?;
            let after = match r.page_token.as_str() {
                "" => (0, 0),
                token => token
                    .split_once(':')
                    .and_then(|(s, l)| Some((s.parse().ok()?, l.parse().ok()?)))
                    .ok_or(LedgerError::InvalidField {
                        field: "page_token",
                        detail: "malformed".into(),
                    })?,
            };
            let time = |t: &str, field| {
                if t.is_empty() {
                    Ok(None)
                } else {
                    parse_time(t, field).map(Some)
                }
            };
            Ok(EntryFilter {
                account: r
                    .account
                    .as_ref()
                    .map(|a| (a.class.clone(), a.owner_type.clone(), a.owner_id.clone())),
                asset: Some(r.asset.clone()).filter(|a| !a.is_empty()),
                source_transaction_id: Some(r.source_transaction_id.clone())
                    .filter(|a| !a.is_empty()),
                recorded_from: time(&r.recorded_from, "recorded_from")?,
                recorded_to: time(&r.recorded_to, "recorded_to")?,
                after,
                limit: if r.page_size == 0 {
                    crate::store::ENTRIES_PAGE_SIZE_MAX
                } else {
                    r.page_size
                },
            })
        };
        let filter = parse().map_err(|e| self.refuse(e))?;
        let entries = self
            .store
            .entries(&filter, None)
            .await
            .map_err(|e| self.refuse(e))?;
        let next_page_token =
            if entries.len() as u32 == filter.limit.clamp(1, crate::store::ENTRIES_PAGE_SIZE_MAX) {
                entries
                    .last()
                    .map(|e| format!("{}:{}", e.receipt_sequence, e.line_number))
                    .unwrap_or_default()
            } else {
                String::new()
            };
        Ok(Response::new(pb::ListEntriesResponse {
            entries: entries.iter().map(entry_to_wire).collect(),
            next_page_token,
        }))
    }

    async fn get_balance(
        &self,
        request: Request<pb::GetBalanceRequest>,
    ) -> Result<Response<pb::GetBalanceResponse>, Status> {
        let r = request.into_inner();
        let key = account_input(r.account.as_ref(), &r.asset).map_err(|e| self.refuse(e))?;
        let b = self.store.balance(&key).await.map_err(|e| self.refuse(e))?;
        Ok(Response::new(pb::GetBalanceResponse {
            account_id: b.account_id.to_string(),
            balance: wire_amount(b.balance),
            projected_balance: wire_amount(b.projected_balance),
            entry_count: b.entry_count as u64,
        }))
    }

    async fn set_operating_mode(
        &self,
        request: Request<pb::SetOperatingModeRequest>,
    ) -> Result<Response<pb::OperatingModeState>, Status> {
        let checked = validate::bounded(&request.get_ref().operator_id, "operator_id")
            .and_then(|_| validate::bounded(&request.get_ref().reason, "reason"));
        if let Err(e) = checked {
            return Err(self.refuse(e));
        }
        // The operator recorded is the one the caller's certificate carries, never a free string.
        // (No name at all is the store's InvalidField, like a missing reason.)
        if self.certifies_operators && !request.get_ref().operator_id.trim().is_empty() {
            service_kit::grpc::certified_operator(
                &service_kit::grpc::caller(&request)?,
                "/ledger.v1.GeneralLedgerService/SetOperatingMode",
                &request.get_ref().operator_id,
                &self.metrics.unauthorised_calls,
            )
            .map_err(|refusal| refusal.status())?;
        }
        let r = request.into_inner();
        let mode = match pb::OperatingMode::try_from(r.mode) {
            Ok(pb::OperatingMode::Mirror) => Mode::Mirror,
            Ok(pb::OperatingMode::Reconcile) => Mode::Reconcile,
            Ok(pb::OperatingMode::DegradedLedger) => Mode::DegradedLedger,
            _ => {
                return Err(self.refuse(LedgerError::InvalidField {
                    field: "mode",
                    detail: "unspecified".into(),
                }))
            }
        };
        match self.store.set_mode(mode, &r.operator_id, &r.reason).await {
            Ok(state) => {
                tracing::warn!(mode = mode.as_str(), operator_id = %r.operator_id, reason = %r.reason, "operating mode changed");
                Ok(Response::new(mode_to_wire(&state)))
            }
            Err(e) => {
                tracing::warn!(mode = mode.as_str(), operator_id = %r.operator_id, error = %e, "operating mode change refused");
                Err(self.refuse(e))
            }
        }
    }

    async fn get_operating_mode(
        &self,
        _: Request<pb::GetOperatingModeRequest>,
    ) -> Result<Response<pb::OperatingModeState>, Status> {
        let state = self.store.mode().await.map_err(|e| self.refuse(e))?;
        Ok(Response::new(mode_to_wire(&state)))
    }
}
