-- proxydb 0004: signed grants (issue 17). Before its high-water statement the proxy verifies the
-- lock service's signature over the grant's (key, token, owner) and that the signed key is the
-- account's (`payout:{account_id}`). A refusal writes only its guard event, of a new kind:
--
--   FORGED_GRANT           not signed by the lock service: `forged_reason` says how (UNSIGNED, an
--                          UNKNOWN_KEY_ID, or a BAD_SIGNATURE: e.g. a fabricated token).
--   GRANT_FOR_ANOTHER_KEY  a genuine grant of another lock key (tokens are global across keys).
--
-- `lock_key` stays the key the call needed; `signed_key` and `signing_key_id` are what was
-- presented; `stored` / `stored_owner` are the account's high-water as it stood, unchanged by
-- the refusal (0 and '' if the account has none). Forward-only; 0001-0003 are never edited.
-- Rows written before stay as they are: the new constraints are NOT VALID (guard_event is
-- append-only), so they bind every new row and rewrite none.
ALTER TABLE guard_event DROP CONSTRAINT guard_event_kind_check;
ALTER TABLE guard_event
    ADD CONSTRAINT guard_event_kind_check
        CHECK (kind IN ('FENCED', 'DUPLICATE', 'FORGED_GRANT', 'GRANT_FOR_ANOTHER_KEY'));
ALTER TABLE guard_event
    ADD COLUMN signed_key text NULL,
    ADD COLUMN signing_key_id text NULL,
    ADD COLUMN forged_reason text NULL
        CHECK (forged_reason IN ('UNSIGNED', 'UNKNOWN_KEY_ID', 'BAD_SIGNATURE'));
ALTER TABLE guard_event
    ADD CONSTRAINT guard_event_forged_reason_given
        CHECK ((kind = 'FORGED_GRANT') = (forged_reason IS NOT NULL)) NOT VALID;
ALTER TABLE guard_event
    ADD CONSTRAINT guard_event_grant_refusal_names_its_grant
        CHECK ((kind IN ('FORGED_GRANT', 'GRANT_FOR_ANOTHER_KEY'))
               = (signed_key IS NOT NULL AND signing_key_id IS NOT NULL)) NOT VALID;
