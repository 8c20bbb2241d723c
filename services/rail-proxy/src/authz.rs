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
    use super::POLICY;

    /// Every rpc of the service's proto has a row: a new method is refused to everyone until
    /// someone decides who may call it, and this test names it.
    #[test]
    fn every_method_of_the_proto_has_a_row() {
        let proto = include_str!("../../../crates/proto/proto/railproxy.proto");
        let methods: Vec<&str> = proto
            .lines()
            .filter_map(|l| l.trim().strip_prefix("rpc "))
            .map(|l| l.split('(').next().unwrap_or("").trim())
            .collect();
        assert!(!methods.is_empty());
        for method in methods {
            assert!(
                POLICY.roles(method).is_some(),
                "{method} has no row in the table"
            );
        }
        assert_eq!(POLICY.rules.len(), proto.matches("rpc ").count());
    }
}
