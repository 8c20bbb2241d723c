//! Who may call what on the rail proxy: the whole table, in one place. Every server is built with
//! `service_kit::grpc::server`, which refuses (PERMISSION_DENIED, counted in
//! `unauthorised_calls_total`) any call whose verified certificate role is not in the
//! method's row; a method missing from the table is refused to everyone.

use service_kit::grpc::{Policy, Role, Rule};

pub static POLICY: Policy = Policy {
    service: "railproxy.v1.RailProxy",
    rules: &[
        // The one call that can move money: workers only.
        Rule {
            method: "Submit",
            roles: &[Role::Worker],
        },
        Rule {
            method: "Lookup",
            roles: &[Role::Worker, Role::Reconciler, Role::Operator],
        },
        // Fenced: the resolver inquires under its own grant.
        Rule {
            method: "Inquire",
            roles: &[Role::Worker, Role::Reconciler],
        },
        Rule {
            method: "RailMovements",
            roles: &[Role::Reconciler, Role::Operator],
        },
    ],
};

#[cfg(test)]
mod tests {
    /// Every rpc of the service's proto has a row, and every row an rpc.
    #[test]
    fn every_method_of_the_proto_has_a_row() {
        let proto = include_str!("../../../crates/proto/proto/railproxy.proto");
        let (missing, extra) = super::POLICY.rows_out_of_step_with(proto);
        assert!(proto.contains("rpc "));
        assert!(
            missing.is_empty(),
            "rpcs with no row in the table: {missing:?}"
        );
        assert!(extra.is_empty(), "rows naming no rpc: {extra:?}");
    }
}
