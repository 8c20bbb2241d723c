//! The server's own result types, which do not cross the wire as they are (CheckLedger answers
//! with `payout_proto::payment::CheckLedgerResponse`). The types that cross the wire are
//! `payment_client::model`.

use uuid::Uuid;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LedgerViolation {
    GroupUnbalanced {
        transaction_group: Uuid,
        currency: String,
        sum_minor: i64,
    },
    BalanceMismatch {
        account_id: String,
        balance_minor: i64,
        entries_sum_minor: i64,
    },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LedgerCheck {
    pub groups_checked: i64,
    pub accounts_checked: i64,
    pub violations: Vec<LedgerViolation>,
}
