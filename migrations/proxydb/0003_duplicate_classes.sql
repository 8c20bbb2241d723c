-- proxydb 0003: a DUPLICATE guard event says which kind of duplicate it was (spec 2.3: a second
-- submission attempt pages; the same grant's retry after a crash is ordinary recovery).
-- Forward-only; 0001 and 0002 are never edited.
--
--   RETRY             the recorded submission's own grant asking again: same token, same owner,
--                     same payment, and the record is a submission (not a seal). Nothing is sent.
--   SECOND_SUBMITTER  anyone else: another token or owner, another payment, or a Submit of a
--                     payout sealed unsent. The defect signal that pages.
--
-- `kind = 'DUPLICATE'` still counts every duplicate. Rows written before this migration stay
-- unclassified (NULL): the constraint is NOT VALID, so it binds every new row and rewrites none
-- (guard_event is append-only).
ALTER TABLE guard_event
    ADD COLUMN duplicate text NULL CHECK (duplicate IN ('RETRY', 'SECOND_SUBMITTER'));
ALTER TABLE guard_event
    ADD CONSTRAINT guard_event_duplicate_classified
        CHECK ((kind = 'DUPLICATE') = (duplicate IS NOT NULL)) NOT VALID;
