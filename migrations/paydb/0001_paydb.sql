-- paydb: the payment resource's store. The account fence (first guard), payouts, the append-only
-- double-entry ledger, the audit trail and the GL outbox. Spec 000 sections 2.2, 2.3, 2.5.
--
-- Every rule below that protects money or evidence is enforced by the database itself, so that a
-- code path that forgets it (or a psql session) cannot break it: the application checks them too.

-- ---------------------------------------------------------------------------------------------
-- Accounts. Customer accounts are rows here; created by fixture data, never deleted.
-- ---------------------------------------------------------------------------------------------
CREATE TABLE account (
    id                    text        PRIMARY KEY CHECK (id ~ '^[A-Za-z0-9._-]{1,64}$'),
    currency              text        NOT NULL CHECK (currency ~ '^[A-Z]{3}$'),
    -- A cached projection of the ledger, never the truth: equal to the sum of the account's
    -- ledger entries at every commit (deferred trigger below).
    balance_minor         bigint      NOT NULL,
    -- Kept to answer a repeated OpenAccount with the same content idempotently.
    opening_balance_minor bigint      NOT NULL CHECK (opening_balance_minor >= 0),
    -- The highest fencing token ever accepted for this account. Non-decreasing (trigger below).
    fence                 bigint      NOT NULL DEFAULT 0 CHECK (fence >= 0),
    version               bigint      NOT NULL DEFAULT 0,
    created_at            timestamptz NOT NULL DEFAULT now(),
    updated_at            timestamptz NOT NULL DEFAULT now(),
    -- Target of payout's (account_id, currency) key: a payout is in its account's currency.
    UNIQUE (id, currency)
);

-- System accounts (payout clearing, funding), one per currency. Their balances are never cached
-- (a cached clearing balance would be one hot row every posting of every account must lock); they
-- are always the sum of their entries. Ids live in a namespace customer ids cannot use (':').
CREATE TABLE system_account (
    id         text PRIMARY KEY CHECK (id ~ '^sys:[a-z-]+:[A-Z]{3}$'),
    class      text NOT NULL CHECK (class IN ('PAYOUT_CLEARING', 'FUNDING')),
    currency   text NOT NULL CHECK (currency ~ '^[A-Z]{3}$'),
    created_at timestamptz NOT NULL DEFAULT now(),
    UNIQUE (class, currency)
);

CREATE FUNCTION refuse_fence_decrease() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.fence < OLD.fence THEN
        RAISE EXCEPTION 'account % fence may not decrease (% -> %)', OLD.id, OLD.fence, NEW.fence
            USING ERRCODE = 'check_violation';
    END IF;
    IF NEW.id <> OLD.id OR NEW.currency <> OLD.currency
       OR NEW.opening_balance_minor <> OLD.opening_balance_minor OR NEW.created_at <> OLD.created_at THEN
        RAISE EXCEPTION 'account % identity is immutable', OLD.id USING ERRCODE = 'check_violation';
    END IF;
    RETURN NEW;
END $$;

CREATE TRIGGER account_fence_monotonic BEFORE UPDATE ON account
    FOR EACH ROW EXECUTE FUNCTION refuse_fence_decrease();

-- Finance evidence: rows of these tables are never deleted or truncated.
CREATE FUNCTION refuse_delete() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION '% is never deleted (finance evidence)', TG_TABLE_NAME
        USING ERRCODE = 'restrict_violation';
END $$;

CREATE TRIGGER account_no_delete BEFORE DELETE ON account
    FOR EACH ROW EXECUTE FUNCTION refuse_delete();
CREATE TRIGGER account_no_truncate BEFORE TRUNCATE ON account
    FOR EACH STATEMENT EXECUTE FUNCTION refuse_delete();

-- ---------------------------------------------------------------------------------------------
-- Payouts: the aggregate of the 2.3 state machine. Never deleted.
-- ---------------------------------------------------------------------------------------------
CREATE TABLE payout (
    id                text        PRIMARY KEY CHECK (id ~ '^[A-Za-z0-9._-]{1,64}$'),
    account_id        text        NOT NULL REFERENCES account (id),
    amount_minor      bigint      NOT NULL CHECK (amount_minor > 0),
    currency          text        NOT NULL CHECK (currency ~ '^[A-Z]{3}$'),
    beneficiary_ref   text        NOT NULL CHECK (beneficiary_ref ~ '^[A-Za-z0-9._-]{1,64}$'),
    state             text        NOT NULL DEFAULT 'PENDING' CHECK (state IN (
                          'PENDING', 'CLAIMED', 'RAIL_SUBMITTED', 'RAIL_ACKED', 'RAIL_AMBIGUOUS',
                          'POSTED', 'FAILED', 'ABANDONED')),
    -- ClientReference::for_payout(id): derived once, never regenerated.
    client_reference  text        NOT NULL UNIQUE CHECK (client_reference = 'cref-' || id),
    claimed_by        text,
    -- Token of the last accepted mutation: diagnostic only, never a guard (the account fence is).
    token_stamp       bigint,
    failure_reason    text,
    rail_ref          text,
    rail_outcome      text CHECK (rail_outcome IN (
                          'ACKED', 'DECLINED', 'TIMEOUT', 'OUTCOME_MISSING',
                          'EVIDENCE_FOUND', 'EVIDENCE_ABSENT')),
    transaction_group uuid,
    version           bigint      NOT NULL DEFAULT 0,
    created_at        timestamptz NOT NULL DEFAULT now(),
    claimed_at        timestamptz,
    submitted_at      timestamptz,
    settled_at        timestamptz,
    updated_at        timestamptz NOT NULL DEFAULT now(),
    CHECK (state <> 'POSTED' OR (transaction_group IS NOT NULL AND settled_at IS NOT NULL)),
    FOREIGN KEY (account_id, currency) REFERENCES account (id, currency)
);

-- Defense in depth for "at most one payout in flight per account" (spec 2.2): the lock enforces
-- it; this index makes the database refuse a second in-flight payout even if the lock did not.
CREATE UNIQUE INDEX payout_one_in_flight_per_account ON payout (account_id)
    WHERE state IN ('CLAIMED', 'RAIL_SUBMITTED', 'RAIL_ACKED', 'RAIL_AMBIGUOUS');

CREATE INDEX payout_by_account ON payout (account_id);

-- Identity is immutable, and a terminal payout never changes again (INV-08, second line).
CREATE FUNCTION guard_payout_update() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.id <> OLD.id OR NEW.account_id <> OLD.account_id OR NEW.amount_minor <> OLD.amount_minor
       OR NEW.currency <> OLD.currency OR NEW.beneficiary_ref <> OLD.beneficiary_ref
       OR NEW.client_reference <> OLD.client_reference OR NEW.created_at <> OLD.created_at THEN
        RAISE EXCEPTION 'payout % identity is immutable', OLD.id USING ERRCODE = 'check_violation';
    END IF;
    IF OLD.state IN ('POSTED', 'FAILED', 'ABANDONED') THEN
        RAISE EXCEPTION 'payout % is terminal (%) and never changes', OLD.id, OLD.state
            USING ERRCODE = 'check_violation';
    END IF;
    RETURN NEW;
END $$;

CREATE TRIGGER payout_guard_update BEFORE UPDATE ON payout
    FOR EACH ROW EXECUTE FUNCTION guard_payout_update();
CREATE TRIGGER payout_no_delete BEFORE DELETE ON payout
    FOR EACH ROW EXECUTE FUNCTION refuse_delete();
CREATE TRIGGER payout_no_truncate BEFORE TRUNCATE ON payout
    FOR EACH STATEMENT EXECUTE FUNCTION refuse_delete();

-- ---------------------------------------------------------------------------------------------
-- The ledger: the only source of truth about money. Append-only, enforced here.
-- ---------------------------------------------------------------------------------------------
CREATE TABLE ledger_entry (
    id                bigserial   PRIMARY KEY,
    transaction_group uuid        NOT NULL,
    line_number       smallint    NOT NULL CHECK (line_number > 0),
    -- A customer account (account.id) or a system account (system_account.id).
    account_id        text        NOT NULL,
    currency          text        NOT NULL CHECK (currency ~ '^[A-Z]{3}$'),
    -- Signed: negative debits, positive credits. Zero entries carry no movement.
    amount_minor      bigint      NOT NULL CHECK (amount_minor <> 0),
    -- The other leg's account.
    counterparty      text        NOT NULL,
    payout_id         text        REFERENCES payout (id),
    -- The fencing token under which it was posted (NULL for fixture opening balances).
    token             bigint,
    created_at        timestamptz NOT NULL DEFAULT now(),
    -- Group ids are derived from the movement (uuid v5), so a second posting of the same movement
    -- collides here even if every application check were bypassed.
    UNIQUE (transaction_group, line_number)
);

CREATE INDEX ledger_entry_by_account ON ledger_entry (account_id);
CREATE INDEX ledger_entry_by_payout ON ledger_entry (payout_id) WHERE payout_id IS NOT NULL;

CREATE FUNCTION refuse_ledger_change() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION '% is append-only: % refused (a correction is a new compensating group)',
        TG_TABLE_NAME, TG_OP USING ERRCODE = 'restrict_violation';
END $$;

CREATE TRIGGER ledger_entry_append_only BEFORE UPDATE OR DELETE ON ledger_entry
    FOR EACH ROW EXECUTE FUNCTION refuse_ledger_change();
CREATE TRIGGER ledger_entry_no_truncate BEFORE TRUNCATE ON ledger_entry
    FOR EACH STATEMENT EXECUTE FUNCTION refuse_ledger_change();

-- An entry's account must exist, in the entry's currency.
CREATE FUNCTION check_ledger_entry_account() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM account WHERE id = NEW.account_id AND currency = NEW.currency)
       AND NOT EXISTS (SELECT 1 FROM system_account WHERE id = NEW.account_id AND currency = NEW.currency) THEN
        RAISE EXCEPTION 'ledger entry account % (%) is unknown', NEW.account_id, NEW.currency
            USING ERRCODE = 'foreign_key_violation';
    END IF;
    RETURN NEW;
END $$;

CREATE TRIGGER ledger_entry_account_known BEFORE INSERT ON ledger_entry
    FOR EACH ROW EXECUTE FUNCTION check_ledger_entry_account();

-- INV-03, asserted by the database at every commit: each group sums to zero (per currency)...
CREATE FUNCTION check_group_balanced() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    unbalanced numeric;
BEGIN
    SELECT sum(amount_minor) INTO unbalanced FROM ledger_entry
        WHERE transaction_group = NEW.transaction_group AND currency = NEW.currency;
    IF unbalanced <> 0 THEN
        RAISE EXCEPTION 'ledger group % does not sum to zero (%)', NEW.transaction_group, unbalanced
            USING ERRCODE = 'check_violation';
    END IF;
    RETURN NULL;
END $$;

CREATE CONSTRAINT TRIGGER ledger_group_balanced AFTER INSERT ON ledger_entry
    DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW EXECUTE FUNCTION check_group_balanced();

-- ...and each customer account's cached balance equals the sum of its entries.
CREATE FUNCTION assert_balance_matches_entries(account_key text) RETURNS void LANGUAGE plpgsql AS $$
DECLARE
    cached bigint;
    summed numeric;
BEGIN
    SELECT balance_minor INTO cached FROM account WHERE id = account_key;
    IF NOT FOUND THEN
        RETURN; -- a system account: its balance is never cached
    END IF;
    SELECT coalesce(sum(amount_minor), 0) INTO summed FROM ledger_entry WHERE account_id = account_key;
    IF cached <> summed THEN
        RAISE EXCEPTION 'account % balance % differs from the sum of its entries %', account_key, cached, summed
            USING ERRCODE = 'check_violation';
    END IF;
END $$;

CREATE FUNCTION check_account_balance() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM assert_balance_matches_entries(NEW.id);
    RETURN NULL;
END $$;

CREATE FUNCTION check_entry_account_balance() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM assert_balance_matches_entries(NEW.account_id);
    RETURN NULL;
END $$;

CREATE CONSTRAINT TRIGGER account_balance_matches_ledger AFTER INSERT OR UPDATE OF balance_minor ON account
    DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW EXECUTE FUNCTION check_account_balance();
CREATE CONSTRAINT TRIGGER ledger_entry_balance_matches AFTER INSERT ON ledger_entry
    DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW EXECUTE FUNCTION check_entry_account_balance();

-- ---------------------------------------------------------------------------------------------
-- Audit trail: transitions, fenced-out rejections, refused transitions, operator actions.
-- Append-only.
-- ---------------------------------------------------------------------------------------------
CREATE TABLE audit_event (
    id         bigserial   PRIMARY KEY,
    payout_id  text,
    account_id text,
    kind       text        NOT NULL CHECK (kind IN (
                   'transition', 'fenced_out', 'refused_transition', 'account_busy',
                   'resolution_sla_not_passed', 'operator_decision', 'payout_created',
                   'account_opened')),
    actor      text        NOT NULL,
    owner      text,
    token      bigint,
    from_state text,
    to_state   text,
    event      text,
    detail     jsonb       NOT NULL DEFAULT '{}'::jsonb,
    at         timestamptz NOT NULL DEFAULT now()
);

CREATE INDEX audit_event_by_payout ON audit_event (payout_id, id);
CREATE INDEX audit_event_by_kind ON audit_event (kind, id);

CREATE TRIGGER audit_event_append_only BEFORE UPDATE OR DELETE ON audit_event
    FOR EACH ROW EXECUTE FUNCTION refuse_ledger_change();
CREATE TRIGGER audit_event_no_truncate BEFORE TRUNCATE ON audit_event
    FOR EACH STATEMENT EXECUTE FUNCTION refuse_ledger_change();

-- ---------------------------------------------------------------------------------------------
-- The GL outbox (spec 002 "Delivery and ordering"): one row per posted movement, written in the
-- posting transaction. Delivery columns belong to the dispatcher (issue 6); the payload is
-- immutable and rows are never deleted (poison rows are quarantined, remaining replayable).
-- ---------------------------------------------------------------------------------------------
CREATE TABLE ledger_outbox (
    id               bigserial   PRIMARY KEY,
    account_id       text        NOT NULL,
    idempotency_key  text        NOT NULL UNIQUE,
    payload          jsonb       NOT NULL,
    created_at       timestamptz NOT NULL DEFAULT now(),
    attempts         int         NOT NULL DEFAULT 0,
    next_attempt_at  timestamptz NOT NULL DEFAULT now(),
    last_error       text,
    delivered_at     timestamptz,
    journal_id       text,
    quarantined_at   timestamptz,
    claimed_by       text,
    claim_expires_at timestamptz
);

CREATE INDEX ledger_outbox_undelivered ON ledger_outbox (next_attempt_at, id)
    WHERE delivered_at IS NULL AND quarantined_at IS NULL;

CREATE FUNCTION guard_outbox_update() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.id <> OLD.id OR NEW.account_id <> OLD.account_id OR NEW.idempotency_key <> OLD.idempotency_key
       OR NEW.payload <> OLD.payload OR NEW.created_at <> OLD.created_at THEN
        RAISE EXCEPTION 'ledger_outbox % payload is immutable', OLD.id USING ERRCODE = 'check_violation';
    END IF;
    RETURN NEW;
END $$;

CREATE TRIGGER ledger_outbox_payload_immutable BEFORE UPDATE ON ledger_outbox
    FOR EACH ROW EXECUTE FUNCTION guard_outbox_update();
CREATE TRIGGER ledger_outbox_no_delete BEFORE DELETE ON ledger_outbox
    FOR EACH ROW EXECUTE FUNCTION refuse_delete();
CREATE TRIGGER ledger_outbox_no_truncate BEFORE TRUNCATE ON ledger_outbox
    FOR EACH STATEMENT EXECUTE FUNCTION refuse_delete();
