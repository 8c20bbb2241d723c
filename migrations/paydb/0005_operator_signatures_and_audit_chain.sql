-- Issue 17, section 3: operators are authenticated, and the audit trail is tamper-evident.
--
-- 1. A new refusal kind: `operator_not_verified` (an operator decision whose signature is
--    missing, by an unregistered operator, wrong, or stale). The list is a superset of the old.
ALTER TABLE audit_event DROP CONSTRAINT audit_event_kind_check;
ALTER TABLE audit_event ADD CONSTRAINT audit_event_kind_check CHECK (kind IN (
    'transition', 'fenced_out', 'refused_transition', 'account_busy',
    'resolution_sla_not_passed', 'operator_decision', 'payout_created',
    'account_opened', 'forged_grant', 'grant_for_another_key', 'operator_not_verified'));

-- 2. The hash chains. Audit rows are chained per account (`chain` = the row's account, '' for the
--    rare row that names none): a transaction that writes an account's audit row already holds
--    that account's fence row, so per-account chains add no waiting between accounts, where one
--    global chain would serialise every payout's commit on one row. Every row carries its chain,
--    its place in it (`chain_seq`, 1, 2, ...), the hash of the row before it (`prev_hash`) and its
--    own hash (`row_hash` = sha256(prev_hash || the row's content as canonical JSON, timestamps in
--    UTC)). Each chain's head (last seq and hash) is kept in `audit_chain_head`. Both are written
--    only by the trigger below, which runs as the owner (SECURITY DEFINER): no service role may
--    write a head, and none may UPDATE or DELETE an audit row (0004's grants, the append-only
--    trigger). An edited row no longer hashes to its row_hash; a deleted row leaves a gap in its
--    chain or a prev_hash that names no row; a removed tail leaves the head ahead of the last row;
--    a removed head leaves rows with no head; a rewrite by someone who can bypass all of that (a
--    superuser) moves a head away from the one the reconciler reported last. The reconciler's
--    `audit_chain_intact` checks all of them. Inserts into one chain serialise on its head row
--    (held to commit), so a chain's order is its commit order.
ALTER TABLE audit_event ADD COLUMN chain text, ADD COLUMN chain_seq bigint,
    ADD COLUMN prev_hash bytea, ADD COLUMN row_hash bytea;

CREATE TABLE audit_chain_head (
    chain      text        PRIMARY KEY,
    seq        bigint      NOT NULL CHECK (seq >= 0),
    hash       bytea       NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT clock_timestamp()
);

-- Every chain's first prev_hash: a fixed value anyone can recompute.
CREATE FUNCTION audit_chain_genesis() RETURNS bytea LANGUAGE sql IMMUTABLE
AS $$ SELECT sha256(convert_to('payout-audit-chain-v1', 'UTF8')) $$;

-- The content a row's hash covers: every column but the four chain columns, as jsonb text (keys
-- sorted, one spelling per value), timestamps in UTC whatever the session's time zone.
CREATE FUNCTION audit_event_content(e audit_event) RETURNS bytea
    LANGUAGE sql STABLE SET timezone = 'UTC'
AS $$ SELECT convert_to((to_jsonb(e) - 'chain' - 'chain_seq' - 'prev_hash' - 'row_hash')::text, 'UTF8') $$;

CREATE FUNCTION chain_audit_event() RETURNS trigger
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp SET timezone = 'UTC'
AS $$
DECLARE
    head audit_chain_head;
BEGIN
    NEW.chain := coalesce(NEW.account_id, '');
    -- A chain's head starts at seq 0 with the genesis hash; made on the chain's first row.
    INSERT INTO audit_chain_head (chain, seq, hash) VALUES (NEW.chain, 0, audit_chain_genesis())
        ON CONFLICT (chain) DO NOTHING;
    SELECT * INTO head FROM audit_chain_head WHERE chain = NEW.chain FOR UPDATE;
    NEW.chain_seq := head.seq + 1;
    NEW.prev_hash := head.hash;
    NEW.row_hash := sha256(NEW.prev_hash || audit_event_content(NEW));
    UPDATE audit_chain_head SET seq = NEW.chain_seq, hash = NEW.row_hash,
        updated_at = clock_timestamp() WHERE chain = NEW.chain;
    RETURN NEW;
END
$$;

-- Rows from before this migration join their chains in id order (the owner, once, here).
ALTER TABLE audit_event DISABLE TRIGGER audit_event_append_only;
DO $$
DECLARE
    r audit_event;
    c text;
    seq bigint;
    prev bytea;
BEGIN
    SET LOCAL timezone = 'UTC';
    FOR c IN SELECT DISTINCT coalesce(account_id, '') FROM audit_event LOOP
        seq := 0;
        prev := audit_chain_genesis();
        FOR r IN SELECT * FROM audit_event WHERE coalesce(account_id, '') = c ORDER BY id LOOP
            seq := seq + 1;
            UPDATE audit_event SET chain = c, chain_seq = seq, prev_hash = prev,
                row_hash = sha256(prev || audit_event_content(r))
                WHERE id = r.id RETURNING row_hash INTO prev;
        END LOOP;
        INSERT INTO audit_chain_head (chain, seq, hash) VALUES (c, seq, prev);
    END LOOP;
END
$$;
ALTER TABLE audit_event ENABLE TRIGGER audit_event_append_only;

ALTER TABLE audit_event ALTER COLUMN chain SET NOT NULL, ALTER COLUMN chain_seq SET NOT NULL,
    ALTER COLUMN prev_hash SET NOT NULL, ALTER COLUMN row_hash SET NOT NULL;
ALTER TABLE audit_event ADD CONSTRAINT audit_event_chain_seq_unique UNIQUE (chain, chain_seq);

CREATE TRIGGER audit_event_chained BEFORE INSERT ON audit_event
    FOR EACH ROW EXECUTE FUNCTION chain_audit_event();

-- The heads are the trigger's (the owner's): services cannot write them; the reconciler reads them.
REVOKE ALL ON audit_chain_head FROM PUBLIC;
GRANT SELECT ON audit_chain_head TO reconciler;
