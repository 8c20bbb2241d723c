-- paydb 0010: a quarantine replay is one function (issue 18, section 4: `payoutctl outbox
-- quarantine replay`). 0007 made every replay leave its outbox_replay row in the same transaction
-- as the release; the two statements lived in the dispatcher's code only. Here they are one
-- statement of the database's own, so whoever releases a row (the operator CLI, the dispatcher's
-- own subcommand) cannot release it without its record, cannot record a replay of a row that is
-- not quarantined, and releases it in exactly one way. It runs with its caller's privileges and
-- only the dispatcher's role may call it: releasing a row is a write on the delivery columns,
-- which only that role has.
CREATE FUNCTION replay_quarantined(p_outbox_id bigint, p_operator text, p_reason text)
RETURNS bigint LANGUAGE plpgsql AS $$
DECLARE
    replay_id bigint;
BEGIN
    IF p_operator IS NULL OR btrim(p_operator) = '' THEN
        RAISE EXCEPTION 'replay_quarantined: the operator is required'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF p_reason IS NULL OR btrim(p_reason) = '' THEN
        RAISE EXCEPTION 'replay_quarantined: the reason is required'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    -- The row is locked before it is read: two operators replaying it at once record one replay.
    PERFORM 1 FROM ledger_outbox WHERE id = p_outbox_id FOR UPDATE;
    INSERT INTO outbox_replay (outbox_id, operator_id, reason, quarantined_at, last_error, attempts)
    SELECT id, btrim(p_operator), btrim(p_reason), quarantined_at, last_error, attempts
      FROM ledger_outbox
     WHERE id = p_outbox_id AND quarantined_at IS NOT NULL AND delivered_at IS NULL
    RETURNING id INTO replay_id;
    IF replay_id IS NULL THEN
        RAISE EXCEPTION 'outbox row % is not quarantined (no such row, already delivered, or waiting for delivery): nothing was replayed', p_outbox_id
            USING ERRCODE = 'no_data_found';
    END IF;
    UPDATE ledger_outbox
       SET quarantined_at = NULL, next_attempt_at = now(), claimed_by = NULL,
           claim_expires_at = NULL,
           -- The dispatcher keeps at most 1,000 characters of error text (ERROR_TEXT_MAX).
           last_error = left('replayed by ' || btrim(p_operator) || ': ' || btrim(p_reason), 1000)
     WHERE id = p_outbox_id;
    RETURN replay_id;
END $$;

REVOKE ALL ON FUNCTION replay_quarantined(bigint, text, text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION replay_quarantined(bigint, text, text) TO outbox_dispatcher;
