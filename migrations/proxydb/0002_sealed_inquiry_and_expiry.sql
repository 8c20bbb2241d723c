-- proxydb 0002: the sealing inquiry and the expiry of a payment instruction (spec 2.3,
-- RAIL_AMBIGUOUS; 2.6 steps 6-9). Forward-only; 0001 is never edited.
--
-- 1. A fenced inquiry that finds no submission for a payout SEALS it: it inserts a row whose
--    outcome is NOT_SENT, born final. `payout_id UNIQUE` then makes every later Submit for that
--    payout a DUPLICATE (nothing sent), whatever its token, so "the proxy never sent it" is
--    definitive and stays true. A sealed row never carried a payment: no amount, currency,
--    beneficiary or validity; it records who sealed it (`sealed_by`, `owner`, `fence_token`).
-- 2. Every new intent carries `valid_until`: the rail refuses the payment after it, and the
--    proxy reports ABSENT for the submission only once it has passed, so a proxy paused between
--    intent and send can never turn a concluded ABSENT into a movement.

ALTER TABLE rail_submission
    ALTER COLUMN amount_minor DROP NOT NULL,
    ALTER COLUMN currency DROP NOT NULL,
    ALTER COLUMN beneficiary_ref DROP NOT NULL,
    -- NULL for rows written before this migration and for sealed rows.
    ADD COLUMN valid_until timestamptz NULL,
    -- Who sealed the payout (the inquirer's `asked_by`); set exactly on NOT_SENT rows.
    ADD COLUMN sealed_by text NULL CHECK (sealed_by IS NULL OR sealed_by <> '');

ALTER TABLE rail_submission DROP CONSTRAINT rail_submission_outcome_check;
ALTER TABLE rail_submission
    ADD CONSTRAINT rail_submission_outcome_check
        CHECK (outcome IN ('ACKED', 'REJECTED', 'TIMEOUT', 'NOT_SENT')),
    ADD CONSTRAINT rail_submission_sealed_by_iff_not_sent
        CHECK ((outcome IS NOT DISTINCT FROM 'NOT_SENT') = (sealed_by IS NOT NULL)),
    -- A submission that was (or may be) sent carries its whole payment.
    ADD CONSTRAINT rail_submission_payment_unless_sealed
        CHECK (outcome IS NOT DISTINCT FROM 'NOT_SENT'
               OR (amount_minor IS NOT NULL AND currency IS NOT NULL AND beneficiary_ref IS NOT NULL)),
    -- A sealed row never carried a payment, so nothing can ever be sent from it.
    ADD CONSTRAINT rail_submission_sealed_carries_no_payment
        CHECK (outcome IS DISTINCT FROM 'NOT_SENT'
               OR (amount_minor IS NULL AND currency IS NULL AND beneficiary_ref IS NULL AND valid_until IS NULL));

-- A row is born either as an intent (outcome NULL, set once later) or sealed (NOT_SENT, final).
CREATE FUNCTION rail_submission_born() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.outcome IS NOT NULL AND NEW.outcome <> 'NOT_SENT' THEN
        RAISE EXCEPTION 'payout % may only be inserted as an intent (NULL outcome) or sealed (NOT_SENT), not %',
            NEW.payout_id, NEW.outcome USING ERRCODE = 'restrict_violation';
    END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER rail_submission_born BEFORE INSERT ON rail_submission
    FOR EACH ROW EXECUTE FUNCTION rail_submission_born();

-- The outcome may go from NULL to a value once (never to NOT_SENT: that is only ever born);
-- nothing else ever changes; nothing is deleted. A sealed row is final from its insertion.
CREATE OR REPLACE FUNCTION rail_submission_immutable() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'DELETE' THEN
        RAISE EXCEPTION 'rail_submission rows are never deleted (payout %)', OLD.payout_id
            USING ERRCODE = 'restrict_violation';
    END IF;
    IF OLD.outcome IS NOT NULL THEN
        RAISE EXCEPTION 'the outcome of payout % is already % and is immutable', OLD.payout_id, OLD.outcome
            USING ERRCODE = 'restrict_violation';
    END IF;
    IF NEW.outcome IS NULL THEN
        RAISE EXCEPTION 'an update of payout % must set its outcome', OLD.payout_id USING ERRCODE = 'restrict_violation';
    END IF;
    IF NEW.outcome = 'NOT_SENT' THEN
        RAISE EXCEPTION 'payout % has an intent and may have been sent: it cannot become NOT_SENT', OLD.payout_id
            USING ERRCODE = 'restrict_violation';
    END IF;
    IF (NEW.id, NEW.payout_id, NEW.account_id, NEW.fence_token, NEW.owner, NEW.client_reference, NEW.amount_minor,
        NEW.currency, NEW.beneficiary_ref, NEW.created_at, NEW.valid_until, NEW.sealed_by)
       IS DISTINCT FROM
       (OLD.id, OLD.payout_id, OLD.account_id, OLD.fence_token, OLD.owner, OLD.client_reference, OLD.amount_minor,
        OLD.currency, OLD.beneficiary_ref, OLD.created_at, OLD.valid_until, OLD.sealed_by) THEN
        RAISE EXCEPTION 'only the outcome of payout % may be set', OLD.payout_id USING ERRCODE = 'restrict_violation';
    END IF;
    RETURN NEW;
END $$;

-- NEVER_SENT: the proxy holds a sealed (NOT_SENT) record: it never called the rail for this
-- payout and never will. Definitive absence, read like ABSENT.
ALTER TABLE resolution DROP CONSTRAINT resolution_evidence_check;
ALTER TABLE resolution
    ADD CONSTRAINT resolution_evidence_check CHECK (evidence IN ('FOUND', 'ABSENT', 'UNKNOWN', 'NEVER_SENT'));

-- Which call a guard refused: a Submit, or a fenced Inquire (a stale resolver).
ALTER TABLE guard_event
    ADD COLUMN operation text NOT NULL DEFAULT 'SUBMIT' CHECK (operation IN ('SUBMIT', 'INQUIRE'));
