-- paydb 0014: a restored paydb, once re-armed, leaves the outbox and the GL consistent (issue 35,
-- item 9).
--
-- A restore of paydb loses every write made after the backup, but the General Ledger had already
-- received what the outbox delivered of them: lifecycle events (key
-- `payment-resource:payout:{id}:event:v{n}`, n = the payout's version + 1) and postings (key
-- `payment-resource:payout:{id}:posting:v1`). A payout the restored copy holds at an earlier state
-- is run again, and its re-run would write those same keys with other content (another grant,
-- another time): the GL answers IDEMPOTENCY_CONFLICT, the dispatcher quarantines the row and
-- holds every later row of the account behind it, and the reconciler finds the lost timeline's
-- events without an outbox row for ever.
--
-- So the re-arming carries the lost timeline forward. `payoutctl restore rearm --database paydb`
-- reads from gldb what the GL holds of each payout beyond what the restored copy holds, and
-- `rearm_paydb_after_restore` records it here, in the same transaction as the fences:
--   * `restore_lost_timeline`: one row per GL record whose key the restored outbox lacks (a lost
--     event or posting), with the GL's id, type and (a posting) its lines. Append-only.
--   * each non-terminal payout's `version` lifted so its next transition's event version is above
--     the highest the GL holds for it: a re-run's events are new versions, never a reuse of one
--     the GL has seen with other content (one audit row `lost_timeline_after_restore` each).
--   * the payment resource's posting of a payout whose posting the GL already holds from the lost
--     timeline (`lost_posting_carried`, same key, same lines) is written to the outbox as already
--     delivered, recording the GL's journal: the movement is posted in the GL once, and paydb's
--     own ledger rows are written again (they were lost with the restore).
-- The reconciler reads the table (`gl_matches_paydb`): a GL record of a lost timeline is a named,
-- explained note, not a violation. The GL's idempotency is unchanged: same key and same content
-- is a duplicate, other content a conflict.

CREATE TABLE restore_lost_timeline (
    id              bigserial   PRIMARY KEY,
    payout_id       text        NOT NULL CHECK (payout_id <> ''),
    kind            text        NOT NULL CHECK (kind IN ('JOURNAL', 'TRANSACTION_EVENT')),
    -- The GL record's idempotency key (a posting's, or the event's key as the outbox names it).
    idempotency_key text        NOT NULL CHECK (idempotency_key <> ''),
    -- A TRANSACTION_EVENT's version (the n of its key); NULL for a JOURNAL.
    event_version   bigint      CHECK ((kind = 'TRANSACTION_EVENT') = (event_version IS NOT NULL)),
    -- The GL's id of the record (journal or event) and its type (effect kind or event type).
    gl_record_id    text        NOT NULL CHECK (gl_record_id <> ''),
    gl_type         text        NOT NULL CHECK (gl_type <> ''),
    -- A JOURNAL's lines as the GL holds them: [{"line_number": n, "amount": "12.3"}, ...].
    lines           jsonb,
    recorded_by     text        NOT NULL CHECK (recorded_by <> ''),
    reason          text        NOT NULL CHECK (reason <> ''),
    recorded_at     timestamptz NOT NULL DEFAULT now(),
    UNIQUE (idempotency_key)
);
CREATE INDEX restore_lost_timeline_by_payout ON restore_lost_timeline (payout_id);

CREATE TRIGGER restore_lost_timeline_append_only BEFORE UPDATE OR DELETE ON restore_lost_timeline
    FOR EACH ROW EXECUTE FUNCTION refuse_ledger_change();
CREATE TRIGGER restore_lost_timeline_no_truncate BEFORE TRUNCATE ON restore_lost_timeline
    FOR EACH STATEMENT EXECUTE FUNCTION refuse_ledger_change();

ALTER TABLE audit_event DROP CONSTRAINT audit_event_kind_check;
ALTER TABLE audit_event ADD CONSTRAINT audit_event_kind_check CHECK (kind IN (
    'transition', 'fenced_out', 'refused_transition', 'account_busy',
    'resolution_sla_not_passed', 'operator_decision', 'payout_created',
    'account_opened', 'forged_grant', 'grant_for_another_key', 'operator_not_verified',
    'fence_raised_after_restore', 'rearmed_after_restore', 'database_restored',
    'lost_timeline_after_restore'));

-- The procedure's database half for paydb: the fences as `rearm_after_restore` (0006) raises
-- them, and the lost timeline carried forward, in one transaction. `gl_lost` is what
-- `payoutctl restore rearm` read from gldb: a JSON array of {payout_id, kind, idempotency_key,
-- event_version, gl_record_id, gl_type, lines} for every GL record of a payout beyond the
-- restored copy's version (or of a payout it does not hold). Records whose key the restored
-- outbox holds are not lost (delivered before the backup, or delivered again as duplicates) and
-- are skipped, as are records already carried by an earlier re-arming. Answers {raised,
-- carried, payouts_lifted}.
CREATE FUNCTION rearm_paydb_after_restore(horizon bigint, armed_by text, reason text, gl_lost jsonb)
RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
    raised  bigint;
    carried bigint;
    lifted  bigint;
BEGIN
    IF gl_lost IS NULL OR jsonb_typeof(gl_lost) <> 'array' THEN
        RAISE EXCEPTION 'rearm_paydb_after_restore: gl_lost must be a JSON array (what the GL holds beyond this copy), got %', gl_lost;
    END IF;
    raised := rearm_after_restore(horizon, armed_by, reason);
    INSERT INTO restore_lost_timeline (payout_id, kind, idempotency_key, event_version,
                                       gl_record_id, gl_type, lines, recorded_by, reason)
    SELECT r->>'payout_id', r->>'kind', r->>'idempotency_key', (r->>'event_version')::bigint,
           r->>'gl_record_id', r->>'gl_type', r->'lines', armed_by, reason
    FROM jsonb_array_elements(gl_lost) r
    WHERE NOT EXISTS (SELECT 1 FROM ledger_outbox o WHERE o.idempotency_key = r->>'idempotency_key')
    ORDER BY r->>'payout_id', r->>'idempotency_key'
    ON CONFLICT (idempotency_key) DO NOTHING;
    GET DIAGNOSTICS carried = ROW_COUNT;
    -- Each non-terminal payout's next event above the highest lost one: the next transition
    -- writes version + 1 and its event is that plus one (store.rs `commit_transition`).
    WITH highest AS (
        SELECT l.payout_id, max(l.event_version) AS event_version
        FROM restore_lost_timeline l WHERE l.kind = 'TRANSACTION_EVENT' GROUP BY l.payout_id
    ), lifted_rows AS (
        UPDATE payout p SET version = h.event_version - 1, updated_at = now()
        FROM highest h
        WHERE p.id = h.payout_id AND p.version < h.event_version - 1
          AND p.state NOT IN ('POSTED', 'FAILED', 'ABANDONED')
        RETURNING p.id, p.account_id, p.state, h.event_version
    ), audited AS (
        INSERT INTO audit_event (payout_id, account_id, kind, actor, owner, token, from_state,
                                 event, detail)
        SELECT id, account_id, 'lost_timeline_after_restore', 'operator', armed_by, horizon, state,
               'rearm_after_restore',
               jsonb_build_object('reason', reason, 'gl_highest_event_version', event_version,
                                  'next_event_version', event_version + 1)
        FROM lifted_rows ORDER BY id
        RETURNING 1
    )
    SELECT count(*) INTO lifted FROM audited;
    RETURN jsonb_build_object('raised', raised, 'carried', carried, 'payouts_lifted', lifted);
END
$$;

-- The GL journal of the lost timeline that a posting with this key and payload is: its id when
-- the GL holds the key from a lost timeline with the payload's lines (same line numbers, same
-- amounts), else NULL. The payment resource then writes its posting's outbox row as delivered to
-- that journal; with other lines it writes it undelivered, and the GL's conflict quarantines it,
-- loudly.
CREATE FUNCTION lost_posting_carried(p_key text, p_payload jsonb) RETURNS text
LANGUAGE sql STABLE AS $$
    SELECT l.gl_record_id FROM restore_lost_timeline l
    WHERE l.kind = 'JOURNAL' AND l.idempotency_key = p_key
      AND jsonb_array_length(l.lines) = jsonb_array_length(p_payload->'entries')
      AND NOT EXISTS (
          SELECT 1 FROM jsonb_array_elements(p_payload->'entries') e
          WHERE NOT EXISTS (
              SELECT 1 FROM jsonb_array_elements(l.lines) g
              WHERE (g->>'line_number')::int = (e->>'line_number')::int
                AND (g->>'amount')::numeric = (e->>'amount')::numeric))
$$;

REVOKE ALL ON restore_lost_timeline FROM PUBLIC;
REVOKE ALL ON FUNCTION rearm_paydb_after_restore(bigint, text, text, jsonb) FROM PUBLIC;
REVOKE ALL ON FUNCTION lost_posting_carried(text, jsonb) FROM PUBLIC;
GRANT SELECT ON restore_lost_timeline TO payment_resource, reconciler;
GRANT EXECUTE ON FUNCTION lost_posting_carried(text, jsonb) TO payment_resource, reconciler;
