-- gldb 0005 (issue 15): a journal is appended in one call, one round trip and one commit.
--
-- Before, the GL's append was four round trips on one transaction: BEGIN with the shared mode
-- lock; one read (the mode, the touched accounts' projection rows FOR UPDATE in id order, the
-- idempotency probe); the insert statement (journal, entries, projection); COMMIT. Each round trip
-- is a wake-up of both processes on a machine whose two cores they share, and that, not the rows,
-- was the ledger's cost against plain SQL writing the same rows. The same steps now run here, in
-- the same order and with the same precedence (a known key, then the mode, then a reversal's
-- checks, then the insert), called in autocommit: the call is the transaction.
--
-- Each statement of a VOLATILE function takes its own snapshot under READ COMMITTED, so the mode
-- is read after the shared mode lock is granted (SetOperatingMode takes it exclusively before it
-- records a new mode). Three statements in the common case: the mode lock; the read (the mode,
-- the row locks, the idempotency probe); the insert.
--
-- Outcomes (o_outcome): 'created' (o_journal_id, o_receipt_sequence, o_recorded_at),
-- 'existing' (o_journal_id: the journal of the same idempotency key; the caller compares the
-- payload hash), 'mode_refused' (o_detail: the mode), 'reversal_target_unknown',
-- 'already_reversed' (o_journal_id: the existing reversal), 'reversal_not_mirror' (o_detail).
-- Anything else is an error that rolls the call back: a unique violation of
-- journals_reversal_once (a concurrent reversal of the same target), numeric_value_out_of_range
-- (a projected balance outside numeric(38,18)), the entries' balance trigger, or an account
-- without its projection row.
CREATE FUNCTION append_journal(
    p_mode_lock bigint,
    p_lock_ids uuid[],
    p_id uuid,
    p_source_service text,
    p_idempotency_key text,
    p_payload_hash text,
    p_source_transaction_id text,
    p_tracking_code text,
    p_effect_kind text,
    p_effect_version integer,
    p_reversal_of uuid,
    p_occurred_at timestamptz,
    p_correlation_id text,
    p_actor_id text,
    p_metadata jsonb,
    p_correction_approved_by text,
    p_correction_reference text,
    p_source_sequence bigint,
    p_settlement_reference text,
    p_client_reference text,
    p_lines integer[],
    p_accounts uuid[],
    p_assets text[],
    p_amounts numeric[],
    p_descriptions text[],
    OUT o_outcome text,
    OUT o_journal_id uuid,
    OUT o_receipt_sequence bigint,
    OUT o_recorded_at timestamptz,
    OUT o_detail text)
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_mode text;
    v_locked bigint;
    v_entries bigint;
    v_balances bigint;
    v_original bigint;
BEGIN
    PERFORM pg_advisory_xact_lock_shared(p_mode_lock);
    -- One statement, one snapshot, taken after the mode lock was granted: the mode in force, the
    -- touched accounts' projection rows locked in one global order (by id: posts touching the
    -- same accounts serialise on them, and two journals over overlapping accounts wait for each
    -- other instead of deadlocking), and the idempotency probe.
    SELECT (SELECT m.mode FROM operating_mode_changes m ORDER BY m.change_sequence DESC LIMIT 1),
           (SELECT count(*) FROM (SELECT 1 FROM account_balances bb
                                   WHERE bb.account_id = ANY (p_lock_ids)
                                   ORDER BY bb.account_id FOR UPDATE) l),
           (SELECT j.id FROM journals j WHERE j.idempotency_key = p_idempotency_key)
      INTO v_mode, v_locked, o_journal_id;
    IF v_locked <> cardinality(p_lock_ids) THEN
        RAISE EXCEPTION 'append_journal: % of % accounts have a projection row', v_locked,
            cardinality(p_lock_ids);
    END IF;
    IF o_journal_id IS NOT NULL THEN
        o_outcome := 'existing';
        RETURN;
    END IF;

    IF NOT (v_mode = 'MIRROR' OR (v_mode = 'RECONCILE' AND p_correction_approved_by IS NOT NULL)) THEN
        o_outcome := 'mode_refused';
        o_detail := v_mode;
        RETURN;
    END IF;

    IF p_reversal_of IS NOT NULL THEN
        PERFORM 1 FROM journals j WHERE j.id = p_reversal_of;
        IF NOT FOUND THEN
            o_outcome := 'reversal_target_unknown';
            RETURN;
        END IF;
        SELECT j.id INTO o_journal_id FROM journals j WHERE j.reversal_of = p_reversal_of;
        IF FOUND THEN
            o_outcome := 'already_reversed';
            RETURN;
        END IF;
        -- The reversal's lines are the target's with their amounts negated, as multisets.
        SELECT count(*) INTO v_original FROM entries e WHERE e.journal_id = p_reversal_of;
        IF EXISTS (SELECT e.account_id, e.asset_id, -e.amount FROM entries e
                    WHERE e.journal_id = p_reversal_of
                   EXCEPT ALL
                   SELECT * FROM unnest(p_accounts, p_assets, p_amounts))
           OR EXISTS (SELECT * FROM unnest(p_accounts, p_assets, p_amounts)
                      EXCEPT ALL
                      SELECT e.account_id, e.asset_id, -e.amount FROM entries e
                       WHERE e.journal_id = p_reversal_of) THEN
            o_outcome := 'reversal_not_mirror';
            o_detail := format('%s lines expected with negated amounts, got %s lines that differ',
                               v_original, cardinality(p_amounts));
            RETURN;
        END IF;
    END IF;

    WITH j AS (
        INSERT INTO journals (id, source_service, idempotency_key, payload_hash,
            source_transaction_id, tracking_code, effect_kind, effect_version, reversal_of,
            occurred_at, correlation_id, actor_id, metadata, correction_approved_by,
            correction_reference, source_sequence, settlement_reference, client_reference)
        VALUES (p_id, p_source_service, p_idempotency_key, p_payload_hash,
            p_source_transaction_id, p_tracking_code, p_effect_kind, p_effect_version,
            p_reversal_of, p_occurred_at, p_correlation_id, p_actor_id, p_metadata,
            p_correction_approved_by, p_correction_reference, p_source_sequence,
            p_settlement_reference, p_client_reference)
        ON CONFLICT (idempotency_key) DO NOTHING
        RETURNING id, receipt_sequence, recorded_at),
     u AS (
        SELECT * FROM unnest(p_lines, p_accounts, p_assets, p_amounts, p_descriptions)
            AS u(line, account, asset, amount, description)),
     e AS (
        INSERT INTO entries (journal_id, line_number, account_id, asset_id, amount, description)
        SELECT j.id, u.line, u.account, u.asset, u.amount, u.description FROM j CROSS JOIN u
        RETURNING 1),
     b AS (
        UPDATE account_balances bb
           SET balance = bb.balance + d.delta, entry_count = bb.entry_count + d.n
          FROM (SELECT u.account, sum(u.amount) AS delta, count(*) AS n
                  FROM j CROSS JOIN u GROUP BY u.account) d
         WHERE bb.account_id = d.account
        RETURNING 1)
    SELECT j.id, j.receipt_sequence, j.recorded_at, (SELECT count(*) FROM e), (SELECT count(*) FROM b)
      INTO o_journal_id, o_receipt_sequence, o_recorded_at, v_entries, v_balances
      FROM j;
    IF NOT FOUND THEN
        -- A concurrent append of the same key committed after the probe: this call is its retry.
        SELECT j.id INTO o_journal_id FROM journals j WHERE j.idempotency_key = p_idempotency_key;
        o_outcome := 'existing';
        RETURN;
    END IF;
    IF v_entries <> cardinality(p_lines) OR v_balances <> cardinality(p_lock_ids) THEN
        RAISE EXCEPTION 'append_journal: % of % lines and % of % projection rows written',
            v_entries, cardinality(p_lines), v_balances, cardinality(p_lock_ids);
    END IF;
    o_outcome := 'created';
END
$$;

REVOKE ALL ON FUNCTION append_journal(bigint, uuid[], uuid, text, text, text, text, text, text,
    integer, uuid, timestamptz, text, text, jsonb, text, text, bigint, text, text, integer[],
    uuid[], text[], numeric[], text[]) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION append_journal(bigint, uuid[], uuid, text, text, text, text, text, text,
    integer, uuid, timestamptz, text, text, jsonb, text, text, bigint, text, text, integer[],
    uuid[], text[], numeric[], text[]) TO gl_app;
