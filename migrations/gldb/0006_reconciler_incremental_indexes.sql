-- The reconciler's incremental pass (crates/reconciler/src/scope.rs) reads the journals and events
-- the GL recorded since its last clean run: through these indexes, a read bounded by the traffic
-- since that run, never a scan of the whole ledger.
CREATE INDEX journals_recorded ON journals (recorded_at);
CREATE INDEX transaction_events_recorded ON transaction_events (recorded_at);
