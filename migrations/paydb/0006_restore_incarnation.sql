-- paydb 0006: the fence survives every restore (spec 2.2; issue 19, section 3).
--
-- A restore of paydb from a backup rewinds every account's fence to what the backup held, and a
-- holder whose token the lost writes had already fenced out would pass again: the first guard
-- would be decoration, silently. So the database knows which database it is. `incarnation` is one
-- row naming this database's OID and the OID of its `account` table, written here when the
-- database is made and again only by `rearm_after_restore`. A restore brings the row of the
-- database the backup was taken from: `pg_restore` into a new database gives it a new OID, and
-- `pg_restore --clean` into this one (or a data-only load into freshly migrated tables) recreates
-- or refills `account`, whose OID then differs from the row's, or brings the old row. Either way
-- `incarnation_is_current()` is false, and every fenced statement of the payment resource requires
-- `incarnation_admits(token)`: the restored copy refuses every fenced write until the procedure
-- (RESTORE.md, "A guard's database restored") has raised every fence past every token the lock
-- service has issued and re-armed the row. (A physical restore of the same cluster keeps both
-- OIDs; the procedure is then the runbook's, and the reconciler's witness check is the alarm.)
CREATE TABLE incarnation (
    only_row      boolean     PRIMARY KEY DEFAULT true CHECK (only_row),
    database_oid  oid         NOT NULL,
    guarded_table oid         NOT NULL,
    -- The lock service's token horizon when the row was last armed: no token at or below an
    -- earlier restore's horizon was issued after it, and none below it passes.
    token_floor   bigint      NOT NULL DEFAULT 0 CHECK (token_floor >= 0),
    armed_by      text        NOT NULL CHECK (armed_by <> ''),
    reason        text        NOT NULL CHECK (reason <> ''),
    armed_at      timestamptz NOT NULL DEFAULT now()
);

INSERT INTO incarnation (database_oid, guarded_table, armed_by, reason)
SELECT d.oid, 'account'::regclass, 'migration', 'the database was created'
FROM pg_database d WHERE d.datname = current_database();

-- Whether this database is the one the row was armed in.
CREATE FUNCTION incarnation_is_current() RETURNS boolean LANGUAGE sql STABLE AS $$
    SELECT EXISTS (
        SELECT 1 FROM incarnation i
        WHERE i.database_oid = (SELECT d.oid FROM pg_database d WHERE d.datname = current_database())
          AND i.guarded_table = 'account'::regclass)
$$;

-- Whether a fenced statement may run with `token`: the database is current and the token is not
-- below the last restore's horizon.
CREATE FUNCTION incarnation_admits(token bigint) RETURNS boolean LANGUAGE sql STABLE AS $$
    SELECT incarnation_is_current() AND token >= (SELECT i.token_floor FROM incarnation i)
$$;

ALTER TABLE audit_event DROP CONSTRAINT audit_event_kind_check;
ALTER TABLE audit_event ADD CONSTRAINT audit_event_kind_check CHECK (kind IN (
    'transition', 'fenced_out', 'refused_transition', 'account_busy',
    'resolution_sla_not_passed', 'operator_decision', 'payout_created',
    'account_opened', 'forged_grant', 'grant_for_another_key', 'operator_not_verified',
    'fence_raised_after_restore', 'rearmed_after_restore', 'database_restored'));

-- The procedure's database half, run by the owner role (payoutctl restore rearm): every account's
-- fence raised to `horizon` (the lock service's highest issued token, read by the caller from the
-- lock backend), one audit row per raised account and one for the re-arming, and the row re-armed
-- for this database. Refused when a fence is already above the horizon: the lock service's token
-- sequence is then behind this guard (the lock backend was restored), and raising to its horizon
-- would arm a floor below tokens already accepted. One transaction; returns the accounts raised.
CREATE FUNCTION rearm_after_restore(horizon bigint, armed_by text, reason text)
RETURNS bigint LANGUAGE plpgsql AS $$
DECLARE
    highest bigint;
    raised  bigint;
    was     incarnation;
BEGIN
    IF horizon IS NULL OR horizon < 0 THEN
        RAISE EXCEPTION 'rearm_after_restore: horizon must be a token (>= 0), got %', horizon;
    END IF;
    IF coalesce(btrim(armed_by), '') = '' OR coalesce(btrim(reason), '') = '' THEN
        RAISE EXCEPTION 'rearm_after_restore: who (armed_by) and why (reason) are required';
    END IF;
    -- The row first, exclusively: two procedures at once serialise here.
    SELECT * INTO was FROM incarnation FOR UPDATE;
    -- Every account row locked before the fences are read, so none advances past the check.
    PERFORM 1 FROM account ORDER BY id FOR UPDATE;
    SELECT max(fence) INTO highest FROM account;
    IF highest > horizon THEN
        RAISE EXCEPTION 'rearm_after_restore: account fence % is above the lock service''s horizon %: the lock backend is behind this guard (restore it first, services/lock-server/RESTORE.md)', highest, horizon;
    END IF;
    INSERT INTO audit_event (account_id, kind, actor, owner, token, event, detail)
    SELECT a.id, 'fence_raised_after_restore', 'operator', armed_by, horizon, 'rearm_after_restore',
           jsonb_build_object('from', a.fence, 'to', horizon, 'reason', reason)
    FROM account a WHERE a.fence < horizon ORDER BY a.id;
    UPDATE account SET fence = horizon, updated_at = now() WHERE fence < horizon;
    GET DIAGNOSTICS raised = ROW_COUNT;
    DELETE FROM incarnation;
    INSERT INTO incarnation (database_oid, guarded_table, token_floor, armed_by, reason)
    SELECT d.oid, 'account'::regclass, GREATEST(horizon, coalesce(was.token_floor, 0)), armed_by, reason
    FROM pg_database d WHERE d.datname = current_database();
    INSERT INTO audit_event (kind, actor, owner, token, event, detail)
    VALUES ('rearmed_after_restore', 'operator', armed_by, horizon, 'rearm_after_restore',
            jsonb_build_object('reason', reason, 'accounts_raised', raised,
                               'was_database_oid', was.database_oid::bigint,
                               'was_guarded_table', was.guarded_table::bigint,
                               'was_token_floor', was.token_floor,
                               'was_armed_by', was.armed_by, 'was_armed_at', was.armed_at));
    RETURN raised;
END
$$;

REVOKE ALL ON incarnation FROM PUBLIC;
REVOKE ALL ON FUNCTION rearm_after_restore(bigint, text, text) FROM PUBLIC;
GRANT SELECT ON incarnation TO payment_resource, reconciler;
