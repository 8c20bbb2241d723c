-- proxydb 0007 (issue 17, section 3): the rail proxy's evidence is chained by hash. Each row of
-- guard_event (the refusals: a stale token, a duplicate submission), resolution (the rail's
-- evidence about an ambiguous submission) and rearm_event (the restore procedure's re-arming)
-- carries its place in its table's chain, the hash of the row before it and its own; each chain's
-- head is a row of `row_chain_head`. The definitions are paydb 0012's, word for word (each
-- database checks its own rows; db-access tests that the copies agree): see there. The
-- reconciler's `row_chains_intact` checks them. A refusal row is rare (a stale worker, a
-- duplicate), so its table's one head row costs the proxy's refusals nothing measurable and its
-- Submit path nothing at all.
CREATE TABLE row_chain_head (
    chain      text        PRIMARY KEY,
    seq        bigint      NOT NULL CHECK (seq >= 0),
    hash       bytea       NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT clock_timestamp()
);

CREATE FUNCTION row_chain_genesis(p_chain text) RETURNS bytea LANGUAGE sql IMMUTABLE
AS $$ SELECT sha256(convert_to('payout-row-chain-v1:' || p_chain, 'UTF8')) $$;

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

SELECT row_chain_attach('guard_event', 'id');
SELECT row_chain_attach('resolution', 'id');
SELECT row_chain_attach('rearm_event', 'id');

REVOKE ALL ON row_chain_head FROM PUBLIC;
GRANT SELECT ON row_chain_head TO reconciler;
