//! Who may call what on the payment resource: the whole table, in one place. Every server is built with
//! `service_kit::grpc::server`, which refuses (PERMISSION_DENIED, counted in
//! `unauthorised_calls_total`) any call whose verified certificate role is not in the
//! method's row; a method missing from the table is refused to everyone.

use service_kit::grpc::{Policy, Role, Rule};

pub static POLICY: Policy = Policy {
    service: "payment.v1.PaymentResource",
    rules: &[
        // The fixture path: also off unless the server is started with --fixture-accounts.
        Rule {
            method: "OpenAccount",
            roles: &[Role::Fixture],
        },
        Rule {
            method: "GetAccount",
            roles: &[
                Role::Worker,
                Role::Reconciler,
                Role::Operator,
                Role::Intake,
                Role::Fixture,
            ],
        },
        // The fixture (local stack, tests) is also the load generator that submits payouts.
        Rule {
            method: "CreatePayout",
            roles: &[Role::Intake, Role::Operator, Role::Fixture],
        },
        Rule {
            method: "GetPayout",
            roles: &[
                Role::Worker,
                Role::Reconciler,
                Role::Operator,
                Role::Intake,
                Role::Fixture,
            ],
        },
        // Fenced mutations: workers only.
        Rule {
            method: "Claim",
            roles: &[Role::Worker],
        },
        Rule {
            method: "MarkSubmitted",
            roles: &[Role::Worker],
        },
        Rule {
            method: "RecordOutcome",
            roles: &[Role::Worker],
        },
        // The resolver posts an orphan it resolved as FOUND, under its own grant.
        Rule {
            method: "Post",
            roles: &[Role::Worker, Role::Reconciler],
        },
        Rule {
            method: "ResolveAmbiguity",
            roles: &[Role::Worker, Role::Reconciler],
        },
        // The workflow's abandon step carries the operator's decision.
        Rule {
            method: "Abandon",
            roles: &[Role::Worker],
        },
        Rule {
            method: "RecordOperatorDecision",
            roles: &[Role::Worker],
        },
        Rule {
            method: "CheckLedger",
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
        let proto = include_str!("../../../crates/proto/proto/payment.proto");
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
