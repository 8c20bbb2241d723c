//! The gRPC contracts between our processes. One module per `.proto` file under `proto/`.
//! These are the wire types of a process boundary: each service converts them to its domain types
//! in one place (its `api` module) and nowhere else.

/// Lock service: sessions, grants with fencing tokens, force-revoke.
pub mod lock {
    tonic::include_proto!("lock.v1");
}

/// Payment resource: the account fence (first guard), payouts, the ledger, the outbox.
pub mod payment {
    tonic::include_proto!("payment.v1");
}

/// Rail proxy: the second guard, in front of the rail.
pub mod railproxy {
    tonic::include_proto!("railproxy.v1");
}

/// General Ledger: append-only double-entry journal.
pub mod ledger {
    tonic::include_proto!("ledger.v1");
}
