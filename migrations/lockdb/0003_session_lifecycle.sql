-- The session lifecycle of spec 2.4 (issue 19, section 2): ACTIVE -> SUSPECT -> EXPIRED or back
-- to ACTIVE, CLOSED on a clean close, and the grace period after lockdb comes back from an outage.
-- SUSPECT is never stored: it is read from last_heartbeat_at by the database's clock (a keep-alive
-- older than the client's interval, TTL / 3, plus a little slack), so every `state = 'ACTIVE'`
-- predicate keeps its meaning.

-- Set by the lock-server when it sees lockdb answer again after an outage: every session alive at
-- its last contact before the outage gets `expires_at` raised to at least clock_timestamp() + its
-- TTL, and this column to that instant. While it is ahead the session is ACTIVE in the server's
-- view even without keep-alives. NULL: never covered by a grace period.
ALTER TABLE lock_session ADD COLUMN grace_until timestamptz;

-- The lock-server lists the live sessions (state ACTIVE, expires_at ahead) every sweep.
CREATE INDEX lock_session_live_idx ON lock_session (expires_at) WHERE state = 'ACTIVE';

-- Least privilege as in 0002: `lock_server` holds SELECT, INSERT, UPDATE, DELETE on lock_session
-- at table level, which covers the new column (it writes it in the grace statement); no other
-- role gains anything. PUBLIC has nothing on the table (0002's REVOKE).
