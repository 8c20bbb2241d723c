-- paydb 0016 (issue 33): a new refusal kind, `rail_fact_refused`. RecordOutcome (ACKED, DECLINED)
-- and ResolveAmbiguity (FOUND, ABSENT) are recorded only on the rail proxy's signed fact saying the
-- same thing; a call without one changes nothing but this audit row (in its own statement, as every
-- refusal's). The list is a superset of 0014's.
ALTER TABLE audit_event DROP CONSTRAINT audit_event_kind_check;
ALTER TABLE audit_event ADD CONSTRAINT audit_event_kind_check CHECK (kind IN (
    'transition', 'fenced_out', 'refused_transition', 'account_busy',
    'resolution_sla_not_passed', 'operator_decision', 'payout_created',
    'account_opened', 'forged_grant', 'grant_for_another_key', 'operator_not_verified',
    'fence_raised_after_restore', 'rearmed_after_restore', 'database_restored',
    'lost_timeline_after_restore', 'rail_fact_refused'));
