-- Least privilege (issue 17, section 4): the General Ledger logs in as `general_ledger`, which the
-- administrator made a member of `gl_app` (`payoutctl db provision`: 0001's grants are to
-- `gl_app`: SELECT and INSERT on the journal tables, the balance projection read-write) and which
-- switches to it on every connection. The reconciler reads.
REVOKE ALL ON _sqlx_migrations FROM PUBLIC;
GRANT SELECT ON _sqlx_migrations TO gl_app, reconciler;
GRANT SELECT ON ALL TABLES IN SCHEMA public TO reconciler;
