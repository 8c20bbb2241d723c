-- The payment resource's payout-age gauges (payouts_non_terminal, payout_oldest_age_seconds,
-- payout_oldest_in_state_seconds, payouts_ambiguous_past_sla: the alerts PayoutStuckInState,
-- PayoutNonTerminalTooLong and AmbiguousPastResolutionSla) read the non-terminal payouts every
-- few seconds: through this partial index, a read bounded by the payouts in flight, never a scan
-- of every payout ever made.
CREATE INDEX payout_non_terminal ON payout (state, created_at)
    WHERE state IN ('PENDING', 'CLAIMED', 'RAIL_SUBMITTED', 'RAIL_ACKED', 'RAIL_AMBIGUOUS');
