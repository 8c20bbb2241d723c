-- Signed grants (issue 17): the payment resource verifies the lock service's signature on every
-- fenced call's grant and binds the fence statement to the signed key's account. Its two new
-- refusals are audited like `fenced_out`: `forged_grant` (no valid signature) and
-- `grant_for_another_key` (a genuine grant for another account's lock key). The new list is a
-- superset of the old one, so every existing row satisfies it.
ALTER TABLE audit_event DROP CONSTRAINT audit_event_kind_check;
ALTER TABLE audit_event ADD CONSTRAINT audit_event_kind_check CHECK (kind IN (
    'transition', 'fenced_out', 'refused_transition', 'account_busy',
    'resolution_sla_not_passed', 'operator_decision', 'payout_created',
    'account_opened', 'forged_grant', 'grant_for_another_key'));
