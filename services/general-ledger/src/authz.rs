//! Who may call what on the general ledger: the whole table, in one place. Every server is built with
//! `service_kit::grpc::server`, which refuses (PERMISSION_DENIED, counted in
//! `unauthorised_calls_total`) any call whose verified certificate role is not in the
//! method's row; a method missing from the table is refused to everyone.

use service_kit::grpc::{Policy, Role, Rule};

pub static POLICY: Policy = Policy {
    service: "ledger.v1.GeneralLedgerService",
    rules: &[
        // Postings arrive only through the outbox.
        Rule {
            method: "AppendJournal",
            roles: &[Role::OutboxDispatcher],
        },
        Rule {
            method: "AppendTransactionEvent",
            roles: &[Role::OutboxDispatcher],
        },
        // The dispatcher opens the GL accounts a posting needs; an operator opens one by hand to mend
        // a quarantined row.
        Rule {
            method: "OpenAccount",
            roles: &[Role::OutboxDispatcher, Role::Operator],
        },
        Rule {
            method: "GetJournal",
            roles: &[Role::Reconciler, Role::Operator, Role::OutboxDispatcher],
        },
        Rule {
            method: "ListEntries",
            roles: &[Role::Reconciler, Role::Operator, Role::OutboxDispatcher],
        },
        Rule {
            method: "GetBalance",
            roles: &[Role::Reconciler, Role::Operator, Role::OutboxDispatcher],
        },
        Rule {
            method: "SetOperatingMode",
            roles: &[Role::Operator],
        },
        Rule {
            method: "GetOperatingMode",
            roles: &[Role::Reconciler, Role::Operator, Role::OutboxDispatcher],
        },
    ],
};

#[cfg(test)]
mod tests {
    /// Every rpc of the service's proto has a row, and every row an rpc.
    #[test]
    fn every_method_of_the_proto_has_a_row() {
        let proto = include_str!("../../../crates/proto/proto/ledger.proto");
        let (missing, extra) = super::POLICY.rows_out_of_step_with(proto);
        assert!(proto.contains("rpc "));
        assert!(
            missing.is_empty(),
            "rpcs with no row in the table: {missing:?}"
        );
        assert!(extra.is_empty(), "rows naming no rpc: {extra:?}");
    }
}
