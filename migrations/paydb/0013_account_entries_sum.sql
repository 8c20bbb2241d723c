-- paydb 0013 (issue 15): INV-03's commit-time check in constant time.
--
-- Until now `assert_balance_matches_entries` summed every entry the account ever had, at the
-- commit of every transaction that wrote one of its entries or its balance (0001), and the
-- posting summed them once more in the payment resource: three scans of the account's whole
-- history per payout, so a payout's cost grew without bound with the age of its account.
--
-- Now each customer account carries `entries_sum_minor`, the sum of its entries, kept by the
-- database alone: it starts at 0, and only the insert of one of the account's entries moves it,
-- by that entry's amount (`ledger_entry_sums_into_account`, in the inserting statement). Entries
-- are append-only (0001: no UPDATE, DELETE or TRUNCATE), so the column equals the sum of the
-- entries at every commit, by induction. No statement may write the column itself
-- (`account_entries_sum_kept`: an INSERT must leave it at 0, an UPDATE may change it only from
-- inside the entry trigger), so the check below compares the cached balance with the true sum,
-- as before, without reading the history. The whole-history comparison stays where it belongs,
-- after the fact: the reconciler's INV-03 (`ledger_balanced`) and CheckLedger sum every
-- account's entries.
ALTER TABLE account ADD COLUMN entries_sum_minor bigint NOT NULL DEFAULT 0;

UPDATE account a SET entries_sum_minor = s.total
  FROM (SELECT account_id, sum(amount_minor)::bigint AS total FROM ledger_entry GROUP BY account_id) s
 WHERE s.account_id = a.id;

CREATE FUNCTION add_entry_to_account_sum() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    -- A system account has no row here (its balance is never cached): nothing to move.
    UPDATE account SET entries_sum_minor = entries_sum_minor + NEW.amount_minor
     WHERE id = NEW.account_id;
    RETURN NULL;
END $$;

CREATE TRIGGER ledger_entry_sums_into_account AFTER INSERT ON ledger_entry
    FOR EACH ROW EXECUTE FUNCTION add_entry_to_account_sum();

CREATE FUNCTION keep_entries_sum() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'INSERT' THEN
        IF NEW.entries_sum_minor <> 0 THEN
            RAISE EXCEPTION 'account %: entries_sum_minor is kept by the ledger (it starts at 0)',
                NEW.id USING ERRCODE = 'check_violation';
        END IF;
    -- Depth 1 is a statement on account itself; the entry trigger's UPDATE runs at depth 2.
    ELSIF NEW.entries_sum_minor IS DISTINCT FROM OLD.entries_sum_minor AND pg_trigger_depth() < 2 THEN
        RAISE EXCEPTION 'account %: entries_sum_minor is kept by the ledger (only an entry moves it)',
            NEW.id USING ERRCODE = 'check_violation';
    END IF;
    RETURN NEW;
END $$;

CREATE TRIGGER account_entries_sum_kept BEFORE INSERT OR UPDATE ON account
    FOR EACH ROW EXECUTE FUNCTION keep_entries_sum();

-- The same check and message as 0001's, against the kept sum instead of a scan of the history.
CREATE OR REPLACE FUNCTION assert_balance_matches_entries(account_key text) RETURNS void
    LANGUAGE plpgsql AS $$
DECLARE
    cached bigint;
    summed bigint;
BEGIN
    SELECT balance_minor, entries_sum_minor INTO cached, summed FROM account WHERE id = account_key;
    IF NOT FOUND THEN
        RETURN; -- a system account: its balance is never cached
    END IF;
    IF cached <> summed THEN
        RAISE EXCEPTION 'account % balance % differs from the sum of its entries %', account_key, cached, summed
            USING ERRCODE = 'check_violation';
    END IF;
END $$;
