//! The real stack, for tests and for `payoutdev stack`: PostgreSQL, etcd and the Temporal dev
//! server as real processes on loopback ports with isolated state, plus process fault injection
//! (SIGKILL, SIGTERM, SIGSTOP/SIGCONT, restart). No part of it is a mock.

pub use db_access;
pub mod clock;
pub mod etcd;
pub mod grants;
pub mod monitoring;
pub mod netns;
pub mod pki;
pub mod postgres;
pub mod process;
pub mod rail;
pub mod stack;
pub mod system;
pub mod temporal;
pub mod temporal_front;
pub mod util;
pub mod volume;
pub mod wire;

pub use process::{Lifetime, ManagedProcess, ProcessSpec};
pub use stack::{PgServer, Stack, StackPorts};
pub use util::{eventually, free_port, wait_blocking, workspace_bin, workspace_root};
