-- The reconciler's incremental pass (crates/reconciler/src/scope.rs) asks which accounts' submissions
-- were recorded or resolved since its last clean run, and reads the submissions of those accounts
-- only: through these indexes, a read bounded by the traffic since that run.
CREATE INDEX rail_submission_by_account ON rail_submission (account_id, id);
CREATE INDEX rail_submission_created ON rail_submission (created_at);
CREATE INDEX rail_submission_resolved ON rail_submission (resolved_at) WHERE resolved_at IS NOT NULL;
