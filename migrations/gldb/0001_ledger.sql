-- General Ledger schema (spec 002). Invariants enforced here as well as in the service:
--   * journals, entries, accounts, transaction events and mode changes are append-only:
--     triggers refuse UPDATE/DELETE/TRUNCATE even to the owner, and the service's role `gl_app`
--     holds only SELECT/INSERT on them;
--   * an entry's (account, asset) must be an existing account of that asset (composite FK);
--   * amounts are signed, non-zero numeric(38,18);
--   * the entries of a journal arrive in one statement and balance per asset (statement trigger).
-- `account_balances` is the only mutable table: a disposable projection rebuilt from entries.

-- The service's role. Roles are cluster-wide while each test gets its own database, so creation is
-- tolerant of an existing role (and of a concurrent creator).
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'gl_app') THEN
        BEGIN
            CREATE ROLE gl_app NOLOGIN;
        EXCEPTION WHEN duplicate_object OR unique_violation THEN
            NULL;
        END;
    END IF;
END
$$;

CREATE TABLE ledger_accounts (
    id          uuid PRIMARY KEY,
    class       text NOT NULL CHECK (class IN (
                    'USER_AVAILABLE', 'USER_FROZEN', 'EXTERNAL_BLOCKCHAIN', 'TREASURY',
                    'MARKET_CLEARING', 'IPG_CLEARING', 'COMMISSION_REVENUE',
                    'CUSTOMER_AVAILABLE', 'PAYOUT_CLEARING', 'FUNDING')),
    owner_type  text NOT NULL CHECK (owner_type <> ''),
    owner_id    text NOT NULL CHECK (owner_id <> ''),
    asset_id    text NOT NULL CHECK (asset_id ~ '^[A-Z][A-Z0-9]{2,11}$'),
    created_at  timestamptz NOT NULL DEFAULT now(),
    UNIQUE (class, owner_type, owner_id, asset_id),
    -- Target of the entries' composite FK: an entry's asset must be its account's asset.
    UNIQUE (id, asset_id)
);

-- Receipt order: assigned by the GL when it records a journal.
CREATE SEQUENCE journal_receipt_seq;

CREATE TABLE journals (
    id                    uuid PRIMARY KEY,
    receipt_sequence      bigint NOT NULL UNIQUE DEFAULT nextval('journal_receipt_seq'),
    source_service        text NOT NULL CHECK (source_service <> ''),
    idempotency_key       text NOT NULL UNIQUE CHECK (idempotency_key <> ''),
    payload_hash          text NOT NULL CHECK (payload_hash ~ '^[0-9a-f]{64}$'),
    source_transaction_id text NOT NULL CHECK (source_transaction_id <> ''),
    tracking_code         text NOT NULL,
    effect_kind           text NOT NULL CHECK (effect_kind <> ''),
    effect_version        integer NOT NULL CHECK (effect_version > 0),
    reversal_of           uuid REFERENCES journals (id),
    occurred_at           timestamptz NOT NULL,
    recorded_at           timestamptz NOT NULL DEFAULT clock_timestamp(),
    correlation_id        text NOT NULL,
    actor_id              text NOT NULL,
    metadata              jsonb NOT NULL DEFAULT '{}'::jsonb,
    correction_approved_by text,
    correction_reference  text,
    CHECK (reversal_of IS NULL OR reversal_of <> id),
    CHECK ((correction_approved_by IS NULL) = (correction_reference IS NULL))
);
-- A journal is reversed at most once.
CREATE UNIQUE INDEX journals_reversal_once ON journals (reversal_of) WHERE reversal_of IS NOT NULL;
-- Source order.
CREATE INDEX journals_source_order ON journals (source_service, occurred_at, source_transaction_id);
CREATE INDEX journals_source_transaction ON journals (source_transaction_id);

CREATE TABLE entries (
    journal_id   uuid NOT NULL REFERENCES journals (id),
    line_number  integer NOT NULL CHECK (line_number > 0),
    account_id   uuid NOT NULL,
    asset_id     text NOT NULL,
    amount       numeric(38, 18) NOT NULL CHECK (amount <> 0),
    description  text NOT NULL DEFAULT '',
    PRIMARY KEY (journal_id, line_number),
    FOREIGN KEY (account_id, asset_id) REFERENCES ledger_accounts (id, asset_id)
);
CREATE INDEX entries_by_account ON entries (account_id, journal_id);

-- Rejects entries that leave a journal unbalanced in some asset, and entries added to a journal
-- that already had entries: all lines of a journal come in one statement.
CREATE FUNCTION entries_balance_check() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    bad record;
BEGIN
    SELECT n.journal_id, n.asset_id, sum(n.amount) AS total INTO bad
      FROM new_rows n GROUP BY n.journal_id, n.asset_id HAVING sum(n.amount) <> 0 LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION 'journal % unbalanced in %: %', bad.journal_id, bad.asset_id, bad.total
            USING ERRCODE = 'check_violation', CONSTRAINT = 'entries_balanced_per_asset';
    END IF;
    SELECT n.journal_id INTO bad FROM (SELECT DISTINCT journal_id FROM new_rows) n
     WHERE (SELECT count(*) FROM entries e WHERE e.journal_id = n.journal_id)
        <> (SELECT count(*) FROM new_rows r WHERE r.journal_id = n.journal_id)
     LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION 'journal % already has entries', bad.journal_id
            USING ERRCODE = 'check_violation', CONSTRAINT = 'entries_one_statement_per_journal';
    END IF;
    RETURN NULL;
END
$$;
CREATE TRIGGER entries_balanced AFTER INSERT ON entries
    REFERENCING NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION entries_balance_check();

CREATE TABLE transaction_events (
    id                    uuid PRIMARY KEY,
    source_service        text NOT NULL CHECK (source_service <> ''),
    source_transaction_id text NOT NULL CHECK (source_transaction_id <> ''),
    event_type            text NOT NULL CHECK (event_type <> ''),
    event_version         integer NOT NULL CHECK (event_version > 0),
    payload_hash          text NOT NULL,
    occurred_at           timestamptz NOT NULL,
    recorded_at           timestamptz NOT NULL DEFAULT clock_timestamp(),
    correlation_id        text NOT NULL,
    actor_id              text NOT NULL,
    metadata              jsonb NOT NULL DEFAULT '{}'::jsonb,
    UNIQUE (source_service, source_transaction_id, event_version)
);

-- The audited history of operating-mode changes; the current mode is the latest row.
CREATE TABLE operating_mode_changes (
    change_sequence bigserial PRIMARY KEY,
    mode            text NOT NULL CHECK (mode IN ('MIRROR', 'RECONCILE', 'DEGRADED_LEDGER')),
    operator_id     text NOT NULL CHECK (operator_id <> ''),
    reason          text NOT NULL CHECK (reason <> ''),
    changed_at      timestamptz NOT NULL DEFAULT clock_timestamp()
);
INSERT INTO operating_mode_changes (mode, operator_id, reason)
VALUES ('MIRROR', 'migration', 'initial mode');

-- Refused mode-change requests are audited too (e.g. DEGRADED_LEDGER, not activated).
CREATE TABLE operating_mode_refusals (
    id           bigserial PRIMARY KEY,
    requested    text NOT NULL,
    operator_id  text NOT NULL,
    reason       text NOT NULL,
    refusal      text NOT NULL,
    refused_at   timestamptz NOT NULL DEFAULT clock_timestamp()
);

-- Disposable projection: rebuilt from entries by `general-ledger rebuild-balances`.
CREATE TABLE account_balances (
    account_id   uuid PRIMARY KEY REFERENCES ledger_accounts (id),
    balance      numeric(38, 18) NOT NULL DEFAULT 0,
    entry_count  bigint NOT NULL DEFAULT 0
);

CREATE FUNCTION refuse_mutation() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION '% on % refused: the ledger is append-only', TG_OP, TG_TABLE_NAME
        USING ERRCODE = 'insufficient_privilege';
END
$$;

DO $$
DECLARE
    t text;
BEGIN
    FOREACH t IN ARRAY ARRAY['ledger_accounts', 'journals', 'entries', 'transaction_events',
                             'operating_mode_changes', 'operating_mode_refusals']
    LOOP
        EXECUTE format('CREATE TRIGGER %I BEFORE UPDATE OR DELETE ON %I FOR EACH ROW EXECUTE FUNCTION refuse_mutation()',
                       t || '_append_only', t);
        EXECUTE format('CREATE TRIGGER %I BEFORE TRUNCATE ON %I FOR EACH STATEMENT EXECUTE FUNCTION refuse_mutation()',
                       t || '_no_truncate', t);
        EXECUTE format('REVOKE ALL ON %I FROM PUBLIC', t);
        EXECUTE format('GRANT SELECT, INSERT ON %I TO gl_app', t);
    END LOOP;
END
$$;

GRANT SELECT, INSERT, UPDATE, DELETE ON account_balances TO gl_app;
GRANT USAGE ON SEQUENCE journal_receipt_seq, operating_mode_changes_change_sequence_seq,
    operating_mode_refusals_id_seq TO gl_app;

-- The owner (who runs migrations) switches to gl_app for every service connection.
DO $$
BEGIN
    EXECUTE format('GRANT gl_app TO %I', current_user);
EXCEPTION WHEN OTHERS THEN
    -- Already a member, or a superuser (who may SET ROLE to any role).
    NULL;
END
$$;
