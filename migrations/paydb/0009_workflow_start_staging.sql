-- paydb 0009: the payout's workflow start is staged in the same transaction as the payout (issue
-- 18, section 4). Before, CreatePayout wrote the payout and its caller had to start the workflow
-- `payout-{id}` separately: a caller that crashed in between (or never knew it had to) left a
-- PENDING payout that nobody would ever pay, until the reconciler's stranded-payout pass minutes
-- later. Now CreatePayout inserts one row here beside the payout row (one commit: both or
-- neither), and the starter (in the outbox-dispatcher process) delivers it to Temporal: start
-- `payout-{id}` with the standard options; "already started" is a delivery too. A delivered row
-- is marked (started_at, start_outcome), never deleted.
CREATE TABLE workflow_start (
    payout_id        text        PRIMARY KEY REFERENCES payout (id),
    workflow_id      text        NOT NULL CHECK (workflow_id = 'payout-' || payout_id),
    -- The payout as CreatePayout recorded it: the start input's instruction fields (payout_id,
    -- account_id, amount_minor, currency, beneficiary_ref). The starter reads nothing else of
    -- paydb; the workflow compares these with the payment resource's record before it claims.
    input            jsonb       NOT NULL CHECK (jsonb_typeof(input) = 'object'),
    staged_at        timestamptz NOT NULL DEFAULT now(),
    -- Delivery columns, written by the starter only.
    attempts         integer     NOT NULL DEFAULT 0,
    next_attempt_at  timestamptz NOT NULL DEFAULT now(),
    last_error       text,
    claimed_by       text,
    claim_expires_at timestamptz,
    started_at       timestamptz,
    start_outcome    text        CHECK (start_outcome IN ('STARTED', 'ALREADY_STARTED')),
    CHECK ((started_at IS NULL) = (start_outcome IS NULL))
);

-- The starter's question, every round: which undelivered rows are due.
CREATE INDEX workflow_start_pending ON workflow_start (next_attempt_at, payout_id)
    WHERE started_at IS NULL;

-- What was staged is immutable, and a delivered row stays delivered.
CREATE FUNCTION guard_workflow_start_update() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.payout_id <> OLD.payout_id OR NEW.workflow_id <> OLD.workflow_id
       OR NEW.input <> OLD.input OR NEW.staged_at <> OLD.staged_at THEN
        RAISE EXCEPTION 'workflow_start % is immutable but for its delivery', OLD.payout_id
            USING ERRCODE = 'check_violation';
    END IF;
    IF OLD.started_at IS NOT NULL AND (NEW.started_at IS DISTINCT FROM OLD.started_at
       OR NEW.start_outcome IS DISTINCT FROM OLD.start_outcome) THEN
        RAISE EXCEPTION 'workflow_start % is delivered; its delivery is final', OLD.payout_id
            USING ERRCODE = 'check_violation';
    END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER workflow_start_staged_immutable BEFORE UPDATE ON workflow_start
    FOR EACH ROW EXECUTE FUNCTION guard_workflow_start_update();
CREATE TRIGGER workflow_start_no_delete BEFORE DELETE ON workflow_start
    FOR EACH ROW EXECUTE FUNCTION refuse_delete();
CREATE TRIGGER workflow_start_no_truncate BEFORE TRUNCATE ON workflow_start
    FOR EACH STATEMENT EXECUTE FUNCTION refuse_delete();

-- Wakes the starter at the commit of a staged start (a notification is delivered only when its
-- transaction commits, once per channel and transaction): submission-to-start latency is one
-- round trip, not a poll interval. The starter still polls as a backstop.
CREATE FUNCTION notify_workflow_start_staged() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('workflow_start_staged', '');
    RETURN NULL;
END $$;
CREATE TRIGGER workflow_start_notify AFTER INSERT ON workflow_start
    FOR EACH STATEMENT EXECUTE FUNCTION notify_workflow_start_staged();

-- Payouts created before this migration that are still PENDING get their start staged now (a
-- workflow that exists already makes the delivery "already started"); a payout further along
-- had a workflow, and a stranded one is the reconciler's resumption's.
INSERT INTO workflow_start (payout_id, workflow_id, input, staged_at)
SELECT id, 'payout-' || id,
       jsonb_build_object('payout_id', id, 'account_id', account_id, 'amount_minor', amount_minor,
                          'currency', currency, 'beneficiary_ref', beneficiary_ref),
       created_at
FROM payout WHERE state = 'PENDING';

REVOKE ALL ON workflow_start FROM PUBLIC;
GRANT SELECT, INSERT ON workflow_start TO payment_resource;
-- The starter reads the staged rows and writes their delivery columns only.
GRANT SELECT ON workflow_start TO outbox_dispatcher;
GRANT UPDATE (attempts, next_attempt_at, last_error, claimed_by, claim_expires_at, started_at,
              start_outcome)
    ON workflow_start TO outbox_dispatcher;
GRANT SELECT ON workflow_start TO reconciler;
