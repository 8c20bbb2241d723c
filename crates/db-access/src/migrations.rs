//! Every database's migrations, for whoever applies them as the owner role: `payoutctl migrate`
//! and the test kit's provisioned databases. Behind the `migrations` feature, so that a service,
//! which only checks its own database's schema with its own migrator, links no other database's.

use sqlx::migrate::Migrator;

use crate::Database;

pub static PAYDB: Migrator = sqlx::migrate!("../../migrations/paydb");
pub static PROXYDB: Migrator = sqlx::migrate!("../../migrations/proxydb");
pub static GLDB: Migrator = sqlx::migrate!("../../migrations/gldb");
pub static LOCKDB: Migrator = sqlx::migrate!("../../migrations/lockdb");

pub fn migrator(database: Database) -> &'static Migrator {
    match database {
        Database::Paydb => &PAYDB,
        Database::Proxydb => &PROXYDB,
        Database::Gldb => &GLDB,
        Database::Lockdb => &LOCKDB,
    }
}
