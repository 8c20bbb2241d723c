//! The benches' certificates: one authority per process, in memory, and a fresh certificate per
//! caller, so every bench runs over mutual TLS behind the real authorisation tables.

use std::sync::OnceLock;

pub use mtls::{Role, Tls};

pub fn tls(role: Role) -> Tls {
    static AUTHORITY: OnceLock<mtls::issue::Authority> = OnceLock::new();
    AUTHORITY
        .get_or_init(|| mtls::issue::Authority::create().expect("a bench certificate authority"))
        .issue(role, &format!("bench-{role}"))
        .expect("a bench certificate")
        .tls()
}
