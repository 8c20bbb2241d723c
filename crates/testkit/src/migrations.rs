//! Every database's migrations, as `payoutctl migrate` applies them (the owner role runs them;
//! services only check the version: `db_access::require_schema`).

use sqlx::migrate::Migrator;

pub static PAYDB: Migrator = sqlx::migrate!("../../migrations/paydb");
pub static PROXYDB: Migrator = sqlx::migrate!("../../migrations/proxydb");
pub static GLDB: Migrator = sqlx::migrate!("../../migrations/gldb");
pub static LOCKDB: Migrator = sqlx::migrate!("../../migrations/lockdb");

pub fn migrator(database: db_access::Database) -> &'static Migrator {
    match database {
        db_access::Database::Paydb => &PAYDB,
        db_access::Database::Proxydb => &PROXYDB,
        db_access::Database::Gldb => &GLDB,
        db_access::Database::Lockdb => &LOCKDB,
    }
}
