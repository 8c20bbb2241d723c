-- proxydb: the rail proxy's own store (spec 2.2). It lives in a different PostgreSQL server from
-- paydb so that one failure cannot remove a guard's record and the resource it protects together.

-- The proxy's independent copy of "the highest token ever seen for this account". Advanced
-- conditionally and monotonically, in the same transaction that writes the submission intent.
CREATE TABLE account_high_water (
    account_id  text        PRIMARY KEY,
    high_water  bigint      NOT NULL CHECK (high_water > 0),
    -- The holder whose token set the current high-water (diagnostics for fenced_out events).
    owner       text        NOT NULL,
    updated_at  timestamptz NOT NULL DEFAULT now()
);

-- Defence in depth: the high-water never goes down, whatever statement tries.
CREATE FUNCTION account_high_water_monotonic() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.high_water < OLD.high_water THEN
        RAISE EXCEPTION 'account_high_water of % may not decrease (% -> %)', OLD.account_id, OLD.high_water, NEW.high_water
            USING ERRCODE = 'check_violation';
    END IF;
    IF NEW.account_id <> OLD.account_id THEN
        RAISE EXCEPTION 'account_high_water.account_id is immutable' USING ERRCODE = 'check_violation';
    END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER account_high_water_monotonic BEFORE UPDATE ON account_high_water
    FOR EACH ROW EXECUTE FUNCTION account_high_water_monotonic();

-- The durable record of intent and outcome. `payout_id UNIQUE` is the mechanical enforcement of
-- "at most one submission ever" (INV-02). Written before the rail is contacted; the outcome is set
-- exactly once; never deleted. A stale token (FENCED) is NOT a row here (a row would block the
-- valid holder forever, since payout_id is unique): it is a guard_event.
CREATE TABLE rail_submission (
    id               bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    payout_id        text        NOT NULL UNIQUE,
    account_id       text        NOT NULL,
    fence_token      bigint      NOT NULL CHECK (fence_token > 0),
    owner            text        NOT NULL,
    client_reference text        NOT NULL UNIQUE,
    amount_minor     bigint      NOT NULL CHECK (amount_minor > 0),
    currency         text        NOT NULL CHECK (currency ~ '^[A-Z]{3}$'),
    beneficiary_ref  text        NOT NULL CHECK (beneficiary_ref <> ''),
    -- NULL while unresolved ("we may have moved money"), then exactly one of these.
    outcome          text        NULL CHECK (outcome IN ('ACKED', 'REJECTED', 'TIMEOUT')),
    rail_ref         text        NULL,
    decline_code     text        NULL,
    failure_detail   text        NULL,
    created_at       timestamptz NOT NULL DEFAULT now(),
    resolved_at      timestamptz NULL,
    CHECK ((outcome IS NULL) = (resolved_at IS NULL)),
    CHECK (outcome IS DISTINCT FROM 'ACKED' OR rail_ref IS NOT NULL),
    CHECK (outcome IS DISTINCT FROM 'REJECTED' OR decline_code IS NOT NULL)
);
CREATE INDEX rail_submission_unresolved ON rail_submission (created_at) WHERE outcome IS NULL OR outcome = 'TIMEOUT';

-- The outcome may go from NULL to a value once; nothing else ever changes; nothing is deleted.
CREATE FUNCTION rail_submission_immutable() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'DELETE' THEN
        RAISE EXCEPTION 'rail_submission rows are never deleted (payout %)', OLD.payout_id
            USING ERRCODE = 'restrict_violation';
    END IF;
    IF OLD.outcome IS NOT NULL THEN
        RAISE EXCEPTION 'the outcome of payout % is already % and is immutable', OLD.payout_id, OLD.outcome
            USING ERRCODE = 'restrict_violation';
    END IF;
    IF NEW.outcome IS NULL THEN
        RAISE EXCEPTION 'an update of payout % must set its outcome', OLD.payout_id USING ERRCODE = 'restrict_violation';
    END IF;
    IF (NEW.id, NEW.payout_id, NEW.account_id, NEW.fence_token, NEW.owner, NEW.client_reference, NEW.amount_minor,
        NEW.currency, NEW.beneficiary_ref, NEW.created_at)
       IS DISTINCT FROM
       (OLD.id, OLD.payout_id, OLD.account_id, OLD.fence_token, OLD.owner, OLD.client_reference, OLD.amount_minor,
        OLD.currency, OLD.beneficiary_ref, OLD.created_at) THEN
        RAISE EXCEPTION 'only the outcome of payout % may be set', OLD.payout_id USING ERRCODE = 'restrict_violation';
    END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER rail_submission_immutable BEFORE UPDATE OR DELETE ON rail_submission
    FOR EACH ROW EXECUTE FUNCTION rail_submission_immutable();

-- Append-only tables refuse every UPDATE, DELETE and TRUNCATE.
CREATE FUNCTION append_only() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION '% is append-only (% refused)', TG_TABLE_NAME, TG_OP USING ERRCODE = 'restrict_violation';
END $$;
CREATE TRIGGER rail_submission_no_truncate BEFORE TRUNCATE ON rail_submission
    FOR EACH STATEMENT EXECUTE FUNCTION append_only();

-- Evidence that a safety net fired: stale tokens (FENCED) and duplicate attempts (DUPLICATE).
CREATE TABLE guard_event (
    id           bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    kind         text        NOT NULL CHECK (kind IN ('FENCED', 'DUPLICATE')),
    payout_id    text        NOT NULL,
    account_id   text        NOT NULL,
    lock_key     text        NOT NULL,
    presented    bigint      NOT NULL,
    -- FENCED: the high-water that refused the token. DUPLICATE: the token of the existing submission.
    stored       bigint      NOT NULL,
    owner        text        NOT NULL,
    stored_owner text        NOT NULL,
    created_at   timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX guard_event_payout ON guard_event (payout_id);
CREATE TRIGGER guard_event_append_only BEFORE UPDATE OR DELETE ON guard_event
    FOR EACH ROW EXECUTE FUNCTION append_only();
CREATE TRIGGER guard_event_no_truncate BEFORE TRUNCATE ON guard_event
    FOR EACH STATEMENT EXECUTE FUNCTION append_only();

-- The rail's evidence about an ambiguous (or any) submission, kept beside the original outcome,
-- which an inquiry never changes.
CREATE TABLE resolution (
    id              bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    payout_id       text        NOT NULL REFERENCES rail_submission (payout_id),
    asked_by        text        NOT NULL CHECK (asked_by <> ''),
    asked_at        timestamptz NOT NULL DEFAULT now(),
    evidence        text        NOT NULL CHECK (evidence IN ('FOUND', 'ABSENT', 'UNKNOWN')),
    rail_refs       text[]      NOT NULL DEFAULT '{}',
    detail          text        NOT NULL DEFAULT '',
    CHECK ((evidence = 'FOUND') = (cardinality(rail_refs) > 0))
);
CREATE INDEX resolution_payout ON resolution (payout_id, id);
CREATE TRIGGER resolution_append_only BEFORE UPDATE OR DELETE ON resolution
    FOR EACH ROW EXECUTE FUNCTION append_only();
CREATE TRIGGER resolution_no_truncate BEFORE TRUNCATE ON resolution
    FOR EACH STATEMENT EXECUTE FUNCTION append_only();
