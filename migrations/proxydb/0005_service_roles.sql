-- Least privilege (issue 17, section 4): see paydb's 0004_service_roles.sql. The rail proxy may
-- insert anything and update only the high-water (its trigger refuses a decrease) and a
-- submission's outcome (its trigger refuses a second write); guard_event and resolution are
-- insert-only. The reconciler reads.
REVOKE ALL ON ALL TABLES IN SCHEMA public FROM PUBLIC;
REVOKE ALL ON ALL SEQUENCES IN SCHEMA public FROM PUBLIC;

GRANT SELECT ON _sqlx_migrations TO rail_proxy, reconciler;
GRANT SELECT, INSERT ON account_high_water, rail_submission, guard_event, resolution TO rail_proxy;
GRANT UPDATE ON account_high_water, rail_submission TO rail_proxy;
GRANT USAGE ON ALL SEQUENCES IN SCHEMA public TO rail_proxy;

GRANT SELECT ON ALL TABLES IN SCHEMA public TO reconciler;
