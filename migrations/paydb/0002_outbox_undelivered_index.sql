-- The dispatcher asks, for every candidate row, whether it is the oldest undelivered row of its
-- account (delivery is in order per account). Without this index that question scans the outbox,
-- which grows forever (rows are never deleted).
CREATE INDEX ledger_outbox_undelivered_by_account ON ledger_outbox (account_id, id) WHERE delivered_at IS NULL;
