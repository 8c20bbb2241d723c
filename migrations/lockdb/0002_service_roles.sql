-- Least privilege (issue 17, section 4): the lock service's PostgreSQL backend logs in as
-- `lock_server`. Sessions and entries are its working state (read-write); lock_audit, the record
-- of force-revokes, is insert-only for it.
REVOKE ALL ON ALL TABLES IN SCHEMA public FROM PUBLIC;
REVOKE ALL ON ALL SEQUENCES IN SCHEMA public FROM PUBLIC;
GRANT SELECT ON _sqlx_migrations TO lock_server;
GRANT SELECT, INSERT, UPDATE, DELETE ON lock_session, lock_entry TO lock_server;
GRANT SELECT, INSERT ON lock_audit TO lock_server;
GRANT USAGE ON ALL SEQUENCES IN SCHEMA public TO lock_server;
