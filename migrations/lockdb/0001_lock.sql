-- lockdb: the PostgreSQL backend of the lock service (spec 2.2 lock_session, lock_entry).
-- Expiry is decided by this database's clock (clock_timestamp()), never by a lock-server's.

-- Tokens for every key come from one sequence that is never reset (INV-04). A restore must advance
-- it past every token issued before (services/lock-server/RESTORE.md). NO CYCLE: wrapping would
-- reissue tokens.
CREATE SEQUENCE lock_token_seq AS bigint MINVALUE 1 START WITH 1 NO CYCLE;

CREATE TABLE lock_session (
    session_id        bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    owner             text        NOT NULL CHECK (length(owner) BETWEEN 1 AND 256),
    ttl_ms            bigint      NOT NULL CHECK (ttl_ms > 0),
    state             text        NOT NULL DEFAULT 'ACTIVE' CHECK (state IN ('ACTIVE', 'EXPIRED', 'CLOSED')),
    created_at        timestamptz NOT NULL DEFAULT clock_timestamp(),
    last_heartbeat_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    -- Alive while state = 'ACTIVE' and expires_at > clock_timestamp(). EXPIRED and CLOSED are final.
    expires_at        timestamptz NOT NULL,
    ended_at          timestamptz
);

-- One row per held key; a row whose session is no longer alive is a free key that the next
-- acquire overwrites. The token sequence outlives the entry: it is the sequence, not the row.
CREATE TABLE lock_entry (
    key         text        PRIMARY KEY CHECK (length(key) BETWEEN 1 AND 512),
    owner       text        NOT NULL,
    session_id  bigint      NOT NULL REFERENCES lock_session (session_id),
    token       bigint      NOT NULL CHECK (token > 0),
    acquired_at timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX lock_entry_session_idx ON lock_entry (session_id);

-- Force-revocations: operator break-glass is always recorded. Append-only.
CREATE TABLE lock_audit (
    audit_id           bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    action             text        NOT NULL,
    key                text        NOT NULL,
    revoked_owner      text        NOT NULL,
    revoked_session_id bigint      NOT NULL,
    revoked_token      bigint      NOT NULL,
    operator           text        NOT NULL CHECK (length(operator) > 0),
    reason             text        NOT NULL CHECK (length(reason) > 0),
    at                 timestamptz NOT NULL DEFAULT clock_timestamp()
);
