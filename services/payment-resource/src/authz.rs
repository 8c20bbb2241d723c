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
        // The workflow's worker records every decision it makes; an operator (`payoutctl payout
        // abandon`) records only a refusal it met outside the workflow (the workflow has closed),
        // under the name its certificate carries (`api::record_operator_decision`).
        Rule {
            method: "RecordOperatorDecision",
            roles: &[Role::Worker, Role::Operator],
        },
        Rule {
            method: "CheckLedger",
            roles: &[Role::Reconciler, Role::Operator],
        },
        // Break-glass: releasing a row the GL refused, under the operator's certified name.
        Rule {
            method: "ReplayQuarantined",
            roles: &[Role::Operator],
        },
    ],
};

#[cfg(test)]
mod tests {
    /// Every rpc of the service's proto has a row, and every row an rpc.
    #[test]
    fn every_method_of_the_proto_has_a_row() {
        let proto = include_str!("../../../crates/proto/proto/payment.proto");
        let (missing, extra) = super::POLICY.rows_out_of_step_with(proto);
        assert!(proto.contains("rpc "));
        assert!(
            missing.is_empty(),
            "rpcs with no row in the table: {missing:?}"
        );
        assert!(extra.is_empty(), "rows naming no rpc: {extra:?}");
    }
}
