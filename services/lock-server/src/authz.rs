//! Who may call what on the lock service: the whole table, in one place. Every server is built with
//! `service_kit::grpc::server`, which refuses (PERMISSION_DENIED, counted in
//! `unauthorised_calls_total`) any call whose verified certificate role is not in the
//! method's row; a method missing from the table is refused to everyone.

use service_kit::grpc::{Policy, Role, Rule};

pub static POLICY: Policy = Policy {
    service: "lock.v1.LockService",
    rules: &[
        // Workers and the resolver hold sessions; each session belongs to the certificate that created it.
        Rule {
            method: "CreateSession",
            roles: &[Role::Worker, Role::Reconciler],
        },
        Rule {
            method: "KeepAlive",
            roles: &[Role::Worker, Role::Reconciler],
        },
        Rule {
            method: "CloseSession",
            roles: &[Role::Worker, Role::Reconciler],
        },
        Rule {
            method: "Acquire",
            roles: &[Role::Worker, Role::Reconciler],
        },
        Rule {
            method: "Renew",
            roles: &[Role::Worker, Role::Reconciler],
        },
        Rule {
            method: "Release",
            roles: &[Role::Worker, Role::Reconciler],
        },
        // The operator's break-glass, and the resolver's audited takeover of a key whose workflow is gone (spec 2.6).
        Rule {
            method: "ForceRevoke",
            roles: &[Role::Operator, Role::Reconciler],
        },
        // Never reveals session ids.
        Rule {
            method: "Describe",
            roles: &[Role::Worker, Role::Reconciler, Role::Operator],
        },
    ],
};

#[cfg(test)]
mod tests {
    /// Every rpc of the service's proto has a row, and every row an rpc.
    #[test]
    fn every_method_of_the_proto_has_a_row() {
        let proto = include_str!("../../../crates/proto/proto/lock.proto");
        let (missing, extra) = super::POLICY.rows_out_of_step_with(proto);
        assert!(proto.contains("rpc "));
        assert!(
            missing.is_empty(),
            "rpcs with no row in the table: {missing:?}"
        );
        assert!(extra.is_empty(), "rows naming no rpc: {extra:?}");
    }
}
