-- proxydb 0009: signed instructions (issue 33). Before anything else in a Submit (after the grant
-- check), the proxy verifies the payment resource's signed instruction for exactly that payment.
--
-- A refusal writes one row of `instruction_refusal` and nothing else: why (`reason`: unsigned,
-- unknown_key_id, bad_signature, mismatch, expired, not_yet_valid, ttl_too_long), which field did
-- not match (mismatch only), the key id presented, the request as presented, and the account's
-- high-water as it stood (unchanged). Its own table, not a new guard_event kind as the design
-- first said: guard_event rows are chained by a hash over the whole row (0007), and adding
-- columns to it would change the recomputed hash of every row written before.
--
-- An accepted instruction's key id, signature and issue time are kept on the intent row, so who
-- authorised each payment stays on record (NULL for sealed rows and rows written before).
-- Forward-only; 0001-0008 are never edited.
CREATE TABLE instruction_refusal (
    id               bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    payout_id        text        NOT NULL,
    account_id       text        NOT NULL,
    lock_key         text        NOT NULL,
    presented        bigint      NOT NULL,
    owner            text        NOT NULL,
    reason           text        NOT NULL CHECK (reason IN ('unsigned', 'unknown_key_id',
                         'bad_signature', 'mismatch', 'expired', 'not_yet_valid', 'ttl_too_long')),
    field            text        NULL,
    signing_key_id   text        NOT NULL,
    detail           text        NOT NULL,
    amount_minor     bigint      NOT NULL,
    currency         text        NOT NULL,
    beneficiary_ref  text        NOT NULL,
    stored           bigint      NOT NULL,
    stored_owner     text        NOT NULL,
    at               timestamptz NOT NULL DEFAULT now(),
    CHECK ((reason = 'mismatch') = (field IS NOT NULL))
);
SELECT row_chain_attach('instruction_refusal', 'id');
GRANT SELECT, INSERT ON instruction_refusal TO rail_proxy;
GRANT SELECT ON instruction_refusal TO reconciler;

ALTER TABLE rail_submission
    ADD COLUMN instruction_key_id    text        NULL,
    ADD COLUMN instruction_signature bytea       NULL,
    ADD COLUMN instruction_issued_at timestamptz NULL;

-- The instruction's record is as immutable as the payment it authorised: 0002's rule with the
-- three columns added to what an outcome update may not change.
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
        NEW.currency, NEW.beneficiary_ref, NEW.created_at, NEW.valid_until, NEW.sealed_by,
        NEW.instruction_key_id, NEW.instruction_signature, NEW.instruction_issued_at)
       IS DISTINCT FROM
       (OLD.id, OLD.payout_id, OLD.account_id, OLD.fence_token, OLD.owner, OLD.client_reference, OLD.amount_minor,
        OLD.currency, OLD.beneficiary_ref, OLD.created_at, OLD.valid_until, OLD.sealed_by,
        OLD.instruction_key_id, OLD.instruction_signature, OLD.instruction_issued_at) THEN
        RAISE EXCEPTION 'only the outcome of payout % may be set', OLD.payout_id USING ERRCODE = 'restrict_violation';
    END IF;
    RETURN NEW;
END $$;
