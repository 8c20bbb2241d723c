-- gldb 0003 (issue 19, section 1): the source's own order beside the receipt order, and a posted
-- payout's settlement reference as first-class fields.
--
-- * `source_sequence`: the position of the record in its source's order (for the payment
--   resource, the id of its outbox row: the order in which its effects committed, per account).
--   Spec 002: the GL "records both source and receipt ordering"; `receipt_sequence` is the
--   receipt order. NULL for a sender that states none (and for every record before this).
--   Delivery metadata, not content: never part of a payload hash.
-- * `settlement_reference`, `client_reference` on journals: the rail's reference of the settled
--   movement and the reference the payout was sent to the rail with. Empty when the journal has
--   none (an opening, a record before this).
ALTER TABLE journals
    ADD COLUMN source_sequence bigint CHECK (source_sequence > 0),
    ADD COLUMN settlement_reference text NOT NULL DEFAULT '',
    ADD COLUMN client_reference text NOT NULL DEFAULT '';
ALTER TABLE transaction_events
    ADD COLUMN source_sequence bigint CHECK (source_sequence > 0);

CREATE INDEX journals_source_sequence ON journals (source_service, source_sequence)
    WHERE source_sequence IS NOT NULL;
CREATE INDEX transaction_events_source_sequence ON transaction_events (source_service, source_sequence)
    WHERE source_sequence IS NOT NULL;

-- Grants (0001, 0002) are table-level: gl_app's SELECT and INSERT and the reconciler's SELECT
-- cover the new columns; the append-only triggers cover them too.
