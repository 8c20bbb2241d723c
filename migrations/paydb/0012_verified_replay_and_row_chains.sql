-- paydb 0012 (issue 17, section 3): a quarantine replay names an operator the system verified,
-- and its record is chained like the audit trail.
--
-- 1. Row chains for the evidence tables that are not audit_event. Each row of a chained table
--    carries its place in its table's chain (`chain_seq`, 1, 2, ...), the hash of the row
--    before it (`prev_hash`) and its own (`row_hash` = sha256(prev_hash || the row's content as
--    canonical JSON, timestamps in UTC)); the chain's head (last seq and hash) is a row of
--    `row_chain_head` named after the table. The trigger runs as the owner (SECURITY DEFINER):
--    no service role may write a head, and none may UPDATE or DELETE a chained row (grants and
--    the append-only trigger). One chain per table, not per account: these tables take a row per
--    operator action (a replay, a mode change, a force-revoke), not per payout, so serialising
--    their inserts on one head row costs nothing measurable. The reconciler's
--    `row_chains_intact` finds an edited row, a deleted row, a removed tail or head, and, against
--    the heads it reported earlier (its anchor), a rewritten chain. The same definitions are in
--    gldb (0004) and lockdb (0004): each database checks its own rows.
CREATE TABLE row_chain_head (
    chain      text        PRIMARY KEY,
    seq        bigint      NOT NULL CHECK (seq >= 0),
    hash       bytea       NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT clock_timestamp()
);

-- A chain's first prev_hash: a fixed value anyone can recompute from the chain's name.
CREATE FUNCTION row_chain_genesis(p_chain text) RETURNS bytea LANGUAGE sql IMMUTABLE
AS $$ SELECT sha256(convert_to('payout-row-chain-v1:' || p_chain, 'UTF8')) $$;

-- What a row's hash covers: every column but the three chain columns, as jsonb text (keys
-- sorted, one spelling per value), timestamps in UTC whatever the session's time zone.
CREATE FUNCTION row_chain_content(p_row anyelement) RETURNS bytea
    LANGUAGE sql STABLE SET timezone = 'UTC'
AS $$ SELECT convert_to((to_jsonb(p_row) - 'chain_seq' - 'prev_hash' - 'row_hash')::text, 'UTF8') $$;

CREATE FUNCTION chain_row() RETURNS trigger
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp SET timezone = 'UTC'
AS $$
DECLARE
    head row_chain_head;
BEGIN
    INSERT INTO row_chain_head (chain, seq, hash)
        VALUES (TG_TABLE_NAME, 0, row_chain_genesis(TG_TABLE_NAME))
        ON CONFLICT (chain) DO NOTHING;
    SELECT * INTO head FROM row_chain_head WHERE chain = TG_TABLE_NAME FOR UPDATE;
    NEW.chain_seq := head.seq + 1;
    NEW.prev_hash := head.hash;
    NEW.row_hash := sha256(NEW.prev_hash || row_chain_content(NEW));
    UPDATE row_chain_head SET seq = NEW.chain_seq, hash = NEW.row_hash,
        updated_at = clock_timestamp() WHERE chain = TG_TABLE_NAME;
    RETURN NEW;
END
$$;

-- Chains `table` (the owner, once, in a migration): adds the columns, links the rows already
-- there in id order, then makes every later insert go through the trigger.
CREATE FUNCTION row_chain_attach(p_table text, p_order text) RETURNS void
    LANGUAGE plpgsql SET timezone = 'UTC'
AS $$
DECLARE
    r record;
    seq bigint := 0;
    prev bytea := row_chain_genesis(p_table);
    hash bytea;
BEGIN
    EXECUTE format('ALTER TABLE %I ADD COLUMN chain_seq bigint, ADD COLUMN prev_hash bytea, '
                   'ADD COLUMN row_hash bytea', p_table);
    EXECUTE format('ALTER TABLE %I DISABLE TRIGGER USER', p_table);
    FOR r IN EXECUTE format('SELECT %I AS k, row_chain_content(t) AS content FROM %I t ORDER BY %I',
                            p_order, p_table, p_order) LOOP
        seq := seq + 1;
        hash := sha256(prev || r.content);
        EXECUTE format('UPDATE %I SET chain_seq = $1, prev_hash = $2, row_hash = $3 WHERE %I = $4',
                       p_table, p_order) USING seq, prev, hash, r.k;
        prev := hash;
    END LOOP;
    EXECUTE format('ALTER TABLE %I ENABLE TRIGGER USER', p_table);
    INSERT INTO row_chain_head (chain, seq, hash) VALUES (p_table, seq, prev);
    EXECUTE format('ALTER TABLE %I ALTER COLUMN chain_seq SET NOT NULL, '
                   'ALTER COLUMN prev_hash SET NOT NULL, ALTER COLUMN row_hash SET NOT NULL', p_table);
    EXECUTE format('ALTER TABLE %I ADD CONSTRAINT %I UNIQUE (chain_seq)', p_table,
                   p_table || '_chain_seq_unique');
    EXECUTE format('CREATE TRIGGER %I BEFORE INSERT ON %I FOR EACH ROW EXECUTE FUNCTION chain_row()',
                   p_table || '_chained', p_table);
END
$$;
REVOKE ALL ON FUNCTION row_chain_attach(text, text) FROM PUBLIC;

SELECT row_chain_attach('outbox_replay', 'id');

REVOKE ALL ON row_chain_head FROM PUBLIC;
GRANT SELECT ON row_chain_head TO reconciler;

-- 2. A replay is the payment resource's, for an operator it verified. Before, the function ran
--    with its caller's privileges and only the dispatcher's role could call it, so whoever held
--    that login (a service's password) released rows under any name they typed. Now it runs as
--    the owner and only the payment resource may call it: the payment resource calls it from
--    its ReplayQuarantined method, which only an operator's certificate may reach, with the
--    operator name that certificate carries (`certified_operator`). The dispatcher's role keeps
--    its delivery columns and loses the replay.
ALTER FUNCTION replay_quarantined(bigint, text, text) SECURITY DEFINER;
ALTER FUNCTION replay_quarantined(bigint, text, text) SET search_path = public, pg_temp;
REVOKE ALL ON FUNCTION replay_quarantined(bigint, text, text) FROM PUBLIC, outbox_dispatcher;
GRANT EXECUTE ON FUNCTION replay_quarantined(bigint, text, text) TO payment_resource;
