//! The operator's library: which deployment a command talks to ([`target`], [`record`]), the
//! forward-only migrations ([`migrate`]), the detective controls on demand ([`reconcile`]) and
//! the deployment's keys ([`keys`]: the lock service's grant signing key), and the database half
//! of the procedure after a guard's database was restored from a backup ([`restore`]), and the
//! operator's break-glass commands ([`payout`], [`lock`], [`outbox`], sharing [`ops`]: where the
//! deployment is, the exit codes, the tables).
//! The `payoutctl` binary is what ships in the image; the developer harness (`payoutdev`: the
//! local stack, the main job, benchmarks, fault injection) builds on this crate, never the other
//! way round, and this crate links no test kit.

pub mod db;
pub mod etcd;
pub mod keys;
pub mod lock;
pub mod migrate;
pub mod ops;
pub mod outbox;
pub mod payout;
pub mod pki;
pub mod reconcile;
pub mod record;
pub mod restore;
pub mod sign;
pub mod target;
