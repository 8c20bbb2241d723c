-- paydb 0007: a quarantine replay leaves a durable audit row (issue 19, section 1). Releasing a
-- quarantined outbox row for delivery again is an operator's decision about money on its way to
-- the General Ledger; before, it left a log line and a `last_error` text the next attempt
-- overwrote. Now each replay writes one row here, in the same transaction as the release: who,
-- when, why, which outbox row and the error it was quarantined with. Append-only like every
-- evidence table: no UPDATE, DELETE or TRUNCATE, for any role.
CREATE TABLE outbox_replay (
    id            bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    outbox_id     bigint      NOT NULL REFERENCES ledger_outbox (id),
    operator_id   text        NOT NULL CHECK (btrim(operator_id) <> ''),
    reason        text        NOT NULL CHECK (btrim(reason) <> ''),
    -- What the row was quarantined with, as it stood when released.
    quarantined_at timestamptz NOT NULL,
    last_error    text,
    attempts      integer     NOT NULL,
    at            timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX outbox_replay_outbox ON outbox_replay (outbox_id);
CREATE TRIGGER outbox_replay_append_only BEFORE UPDATE OR DELETE ON outbox_replay
    FOR EACH ROW EXECUTE FUNCTION refuse_ledger_change();
CREATE TRIGGER outbox_replay_no_truncate BEFORE TRUNCATE ON outbox_replay
    FOR EACH STATEMENT EXECUTE FUNCTION refuse_delete();

REVOKE ALL ON outbox_replay FROM PUBLIC;
GRANT SELECT, INSERT ON outbox_replay TO outbox_dispatcher;
GRANT SELECT ON outbox_replay TO reconciler;
