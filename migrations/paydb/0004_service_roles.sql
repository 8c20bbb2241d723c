-- Least privilege (issue 17, section 4). The schema belongs to the owner role that runs these
-- migrations (`payout_owner`); each service logs in as its own role (crates/db-access: ROLES),
-- which `payoutctl db provision` creates before the first migration. Nothing here is granted to
-- PUBLIC. Append-only tables (ledger_entry, audit_event) and the outbox get no UPDATE or DELETE
-- from any service role: their triggers refuse it as well, and a service role, not being the
-- owner, cannot disable a trigger.
REVOKE ALL ON ALL TABLES IN SCHEMA public FROM PUBLIC;
REVOKE ALL ON ALL SEQUENCES IN SCHEMA public FROM PUBLIC;

-- The payment resource: the state machine, the fence, the ledger, the audit trail, the outbox.
GRANT SELECT ON _sqlx_migrations TO payment_resource, outbox_dispatcher, reconciler;
GRANT SELECT, INSERT ON account, system_account, payout, ledger_entry, audit_event, ledger_outbox
    TO payment_resource;
-- The fence and balances (account; the fence trigger refuses a decrease) and the payout's state
-- (payout; the trigger refuses any change of a terminal payout). `SELECT ... FOR UPDATE` on payout
-- needs it too.
GRANT UPDATE ON account, payout TO payment_resource;
GRANT USAGE ON ALL SEQUENCES IN SCHEMA public TO payment_resource;

-- The outbox dispatcher: reads the outbox and writes its delivery columns only (the payload,
-- the key and the account are immutable to it by privilege as well as by trigger).
GRANT SELECT ON ledger_outbox TO outbox_dispatcher;
GRANT UPDATE (attempts, next_attempt_at, last_error, delivered_at, journal_id, quarantined_at,
              claimed_by, claim_expires_at)
    ON ledger_outbox TO outbox_dispatcher;

-- The reconciler (and the resolver inside it): reads everything, writes nothing here (it
-- corrects only through the payment resource's fenced gRPC calls).
GRANT SELECT ON ALL TABLES IN SCHEMA public TO reconciler;
