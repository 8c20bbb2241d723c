-- paydb 0008: the payout's lifecycle reaches the General Ledger through the same outbox (issue 19,
-- section 1). Spec 002: "Pending and failed lifecycle events may be retained as audit events but
-- do not create monetary entries": each transition of a payout (and its creation) writes, in its
-- own transaction, one outbox row of kind TRANSACTION_EVENT beside the JOURNAL rows of monetary
-- effects. The dispatcher delivers a row according to its kind (AppendJournal or
-- AppendTransactionEvent), in order per account as before. Every existing row is a journal.
ALTER TABLE ledger_outbox
    ADD COLUMN kind text NOT NULL DEFAULT 'JOURNAL'
        CHECK (kind IN ('JOURNAL', 'TRANSACTION_EVENT'));

-- The kind is part of what a row is, like its payload: immutable (0001's guard, plus `kind`).
CREATE OR REPLACE FUNCTION guard_outbox_update() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.id <> OLD.id OR NEW.account_id <> OLD.account_id OR NEW.idempotency_key <> OLD.idempotency_key
       OR NEW.payload <> OLD.payload OR NEW.created_at <> OLD.created_at OR NEW.kind <> OLD.kind THEN
        RAISE EXCEPTION 'ledger_outbox % payload is immutable', OLD.id USING ERRCODE = 'check_violation';
    END IF;
    RETURN NEW;
END $$;

-- Grants (0004) still fit: the payment resource holds INSERT and SELECT on the whole table, the
-- reconciler SELECT; the dispatcher SELECT and UPDATE of the delivery columns only, which do not
-- include `kind` (a column-level grant names its columns: a new column is not among them).
