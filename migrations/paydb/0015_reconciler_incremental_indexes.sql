-- The reconciler's incremental pass (crates/reconciler/src/scope.rs) asks which accounts' outbox
-- rows were created, delivered or quarantined since its last clean run, and reads the outbox rows
-- of those accounts only: through these indexes, a read bounded by the traffic since that run,
-- never a scan of every outbox row ever written.
CREATE INDEX ledger_outbox_by_account ON ledger_outbox (account_id);
CREATE INDEX ledger_outbox_created ON ledger_outbox (created_at);
CREATE INDEX ledger_outbox_delivered ON ledger_outbox (delivered_at) WHERE delivered_at IS NOT NULL;
CREATE INDEX ledger_outbox_quarantined ON ledger_outbox (quarantined_at) WHERE quarantined_at IS NOT NULL;
