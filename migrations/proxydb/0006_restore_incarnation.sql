-- proxydb 0006: the high-water survives every restore (spec 2.2; issue 19, section 3). The same
-- mechanism as paydb's 0006 (read it first): a restored proxydb has lost submissions and its
-- high-waters have gone back, so a stale holder's Submit would pass the second guard, and a
-- payout whose submission row was lost could be submitted to the rail a second time. The row
-- names this database and its `account_high_water` table; every high-water statement requires
-- `incarnation_admits(token)`, so a restored copy refuses every Submit and fenced inquiry before
-- anything is written or sent, until the procedure has raised the high-waters and the token
-- floor past every token the lock service has issued. The proxy knows no account list: the floor
-- is what fences an account that has no high-water row yet.
CREATE TABLE incarnation (
    only_row      boolean     PRIMARY KEY DEFAULT true CHECK (only_row),
    database_oid  oid         NOT NULL,
    guarded_table oid         NOT NULL,
    token_floor   bigint      NOT NULL DEFAULT 0 CHECK (token_floor >= 0),
    armed_by      text        NOT NULL CHECK (armed_by <> ''),
    reason        text        NOT NULL CHECK (reason <> ''),
    armed_at      timestamptz NOT NULL DEFAULT now()
);

INSERT INTO incarnation (database_oid, guarded_table, armed_by, reason)
SELECT d.oid, 'account_high_water'::regclass, 'migration', 'the database was created'
FROM pg_database d WHERE d.datname = current_database();

CREATE FUNCTION incarnation_is_current() RETURNS boolean LANGUAGE sql STABLE AS $$
    SELECT EXISTS (
        SELECT 1 FROM incarnation i
        WHERE i.database_oid = (SELECT d.oid FROM pg_database d WHERE d.datname = current_database())
          AND i.guarded_table = 'account_high_water'::regclass)
$$;

CREATE FUNCTION incarnation_admits(token bigint) RETURNS boolean LANGUAGE sql STABLE AS $$
    SELECT incarnation_is_current() AND token >= (SELECT i.token_floor FROM incarnation i)
$$;

-- The re-arming's own record (the procedure's evidence; insert-only like guard_event).
CREATE TABLE rearm_event (
    id                bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    horizon           bigint      NOT NULL CHECK (horizon >= 0),
    armed_by          text        NOT NULL CHECK (armed_by <> ''),
    reason            text        NOT NULL CHECK (reason <> ''),
    accounts_raised   bigint      NOT NULL,
    was_database_oid  bigint,
    was_guarded_table bigint,
    was_token_floor   bigint,
    at                timestamptz NOT NULL DEFAULT now()
);
CREATE TRIGGER rearm_event_append_only BEFORE UPDATE OR DELETE ON rearm_event
    FOR EACH ROW EXECUTE FUNCTION append_only();

-- The procedure's database half, as the owner role: every high-water raised to `horizon`, the
-- floor raised to it, the row re-armed for this database, one rearm_event. Refused when a
-- high-water is above the horizon (the lock backend is behind this guard).
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
    SELECT * INTO was FROM incarnation FOR UPDATE;
    -- No Submit inserts a first high-water row while this runs.
    LOCK TABLE account_high_water IN EXCLUSIVE MODE;
    SELECT max(high_water) INTO highest FROM account_high_water;
    IF highest > horizon THEN
        RAISE EXCEPTION 'rearm_after_restore: high-water % is above the lock service''s horizon %: the lock backend is behind this guard (restore it first, services/lock-server/RESTORE.md)', highest, horizon;
    END IF;
    UPDATE account_high_water SET high_water = horizon, owner = 'rearm:' || armed_by, updated_at = now()
    WHERE high_water < horizon;
    GET DIAGNOSTICS raised = ROW_COUNT;
    DELETE FROM incarnation;
    INSERT INTO incarnation (database_oid, guarded_table, token_floor, armed_by, reason)
    SELECT d.oid, 'account_high_water'::regclass, GREATEST(horizon, coalesce(was.token_floor, 0)),
           armed_by, reason
    FROM pg_database d WHERE d.datname = current_database();
    INSERT INTO rearm_event (horizon, armed_by, reason, accounts_raised, was_database_oid,
                             was_guarded_table, was_token_floor)
    VALUES (horizon, armed_by, reason, raised, was.database_oid::bigint,
            was.guarded_table::bigint, was.token_floor);
    RETURN raised;
END
$$;

-- A fenced call refused because this database is a restored copy (or the token is below the last
-- procedure's horizon) leaves its evidence row like every refusal: kind DATABASE_RESTORED, with the
-- account's high-water as it stood in this copy.
ALTER TABLE guard_event DROP CONSTRAINT guard_event_kind_check;
ALTER TABLE guard_event
    ADD CONSTRAINT guard_event_kind_check
        CHECK (kind IN ('FENCED', 'DUPLICATE', 'FORGED_GRANT', 'GRANT_FOR_ANOTHER_KEY',
                        'DATABASE_RESTORED'));

REVOKE ALL ON incarnation, rearm_event FROM PUBLIC;
REVOKE ALL ON FUNCTION rearm_after_restore(bigint, text, text) FROM PUBLIC;
GRANT SELECT ON incarnation TO rail_proxy, reconciler;
GRANT SELECT ON rearm_event TO reconciler;
