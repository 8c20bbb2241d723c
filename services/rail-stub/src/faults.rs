//! Fault injection: what the rail does with each payment request, chosen per client reference
//! (forced, for tests that need one exact behaviour) or by rate from a seeded generator (for
//! soak runs that must be reproducible).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// Longest injected latency accepted; bounded so that a typo cannot park a test for hours.
pub const LATENCY_MS_MAX: u64 = 120_000;

/// What the rail does with one payment request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FaultMode {
    /// Moves the money and answers `accepted` with a rail reference.
    Accept,
    /// A business rejection: no money moves; answers `declined` with the configured code.
    Decline,
    /// Answers 503 without acting: no money moves, but the caller cannot know that.
    FailBeforeActing,
    /// Moves the money, then answers 500.
    AcceptThenFail,
    /// Moves the money, then never answers: the response is held until the caller gives up.
    AcceptThenHang,
    /// Drops the connection without acting and without a response.
    ResetBeforeActing,
    /// Moves the money, then drops the connection without a response.
    AcceptThenReset,
}

impl FaultMode {
    /// Whether this mode moves money. The ground truth of the tests, stated once.
    pub fn moves_money(self) -> bool {
        matches!(
            self,
            Self::Accept | Self::AcceptThenFail | Self::AcceptThenHang | Self::AcceptThenReset
        )
    }
}

/// The fault configuration, settable at start (flags) and at run time (`POST /admin/faults`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FaultConfig {
    /// Seed of the generator that draws modes and latencies; replacing the config reseeds it.
    pub seed: u64,
    /// Every payment request waits uniformly between these two bounds before acting.
    pub latency_ms_min: u64,
    pub latency_ms_max: u64,
    /// With this probability a request waits `latency_tail_ms` instead: the slow tail of a real rail.
    pub latency_tail_rate: f64,
    pub latency_tail_ms: u64,
    /// Probabilities of each faulty mode; the remainder is `accept`. Their sum must not exceed 1.
    pub decline_rate: f64,
    pub fail_before_acting_rate: f64,
    pub accept_then_fail_rate: f64,
    pub accept_then_hang_rate: f64,
    pub reset_before_acting_rate: f64,
    pub accept_then_reset_rate: f64,
    /// The code a decline carries.
    pub decline_code: String,
    /// Every lookup waits this long before answering.
    pub lookup_latency_ms: u64,
    /// A forced mode per client reference, which wins over the rates.
    pub forced: BTreeMap<String, FaultMode>,
}

impl Default for FaultConfig {
    fn default() -> Self {
        Self {
            seed: 0,
            latency_ms_min: 0,
            latency_ms_max: 0,
            latency_tail_rate: 0.0,
            latency_tail_ms: 0,
            decline_rate: 0.0,
            fail_before_acting_rate: 0.0,
            accept_then_fail_rate: 0.0,
            accept_then_hang_rate: 0.0,
            reset_before_acting_rate: 0.0,
            accept_then_reset_rate: 0.0,
            decline_code: "INSUFFICIENT_FUNDS".to_string(),
            lookup_latency_ms: 0,
            forced: BTreeMap::new(),
        }
    }
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum FaultConfigError {
    #[error("rate {name} must be within [0, 1], got {value}")]
    RateOutOfRange { name: &'static str, value: f64 },
    #[error("the fault rates sum to {sum}, above 1")]
    RatesAboveOne { sum: f64 },
    #[error("latency bounds are inverted or above {LATENCY_MS_MAX} ms")]
    LatencyOutOfRange,
    #[error("the decline code is empty")]
    EmptyDeclineCode,
}

impl FaultConfig {
    fn rates(&self) -> [(&'static str, f64, FaultMode); 6] {
        [
            ("decline_rate", self.decline_rate, FaultMode::Decline),
            (
                "fail_before_acting_rate",
                self.fail_before_acting_rate,
                FaultMode::FailBeforeActing,
            ),
            (
                "accept_then_fail_rate",
                self.accept_then_fail_rate,
                FaultMode::AcceptThenFail,
            ),
            (
                "accept_then_hang_rate",
                self.accept_then_hang_rate,
                FaultMode::AcceptThenHang,
            ),
            (
                "reset_before_acting_rate",
                self.reset_before_acting_rate,
                FaultMode::ResetBeforeActing,
            ),
            (
                "accept_then_reset_rate",
                self.accept_then_reset_rate,
                FaultMode::AcceptThenReset,
            ),
        ]
    }

    pub fn validate(&self) -> Result<(), FaultConfigError> {
        let mut sum = 0.0;
        for (name, value, _) in self.rates() {
            if !(0.0..=1.0).contains(&value) {
                return Err(FaultConfigError::RateOutOfRange { name, value });
            }
            sum += value;
        }
        if !(0.0..=1.0).contains(&self.latency_tail_rate) {
            return Err(FaultConfigError::RateOutOfRange {
                name: "latency_tail_rate",
                value: self.latency_tail_rate,
            });
        }
        if sum > 1.0 + 1e-9 {
            return Err(FaultConfigError::RatesAboveOne { sum });
        }
        let bounded = [
            self.latency_ms_max,
            self.latency_tail_ms,
            self.lookup_latency_ms,
        ]
        .iter()
        .all(|v| *v <= LATENCY_MS_MAX);
        if self.latency_ms_min > self.latency_ms_max || !bounded {
            return Err(FaultConfigError::LatencyOutOfRange);
        }
        if self.decline_code.is_empty() {
            return Err(FaultConfigError::EmptyDeclineCode);
        }
        Ok(())
    }

    /// The mode of one request: forced for its reference, or drawn by rate.
    pub fn choose(&self, client_reference: &str, rng: &mut SplitMix64) -> FaultMode {
        if let Some(mode) = self.forced.get(client_reference) {
            return *mode;
        }
        let roll = rng.next_f64();
        let mut cumulative = 0.0;
        for (_, rate, mode) in self.rates() {
            cumulative += rate;
            if roll < cumulative {
                return mode;
            }
        }
        FaultMode::Accept
    }

    /// The latency of one request, in milliseconds.
    pub fn latency_ms(&self, rng: &mut SplitMix64) -> u64 {
        if self.latency_tail_rate > 0.0 && rng.next_f64() < self.latency_tail_rate {
            return self.latency_tail_ms;
        }
        let span = self.latency_ms_max - self.latency_ms_min;
        if span == 0 {
            return self.latency_ms_min;
        }
        self.latency_ms_min + rng.next_u64() % (span + 1)
    }
}

/// SplitMix64: a tiny, well-known, seedable generator. Reproducibility matters here, statistical
/// quality barely does, and it keeps a dependency out of the stub.
#[derive(Debug, Clone)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [0, 1).
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn forced_mode_wins_over_rates() {
        let mut config = FaultConfig {
            decline_rate: 1.0,
            ..Default::default()
        };
        config
            .forced
            .insert("cref-x".into(), FaultMode::AcceptThenHang);
        let mut rng = SplitMix64::new(1);
        assert_eq!(config.choose("cref-x", &mut rng), FaultMode::AcceptThenHang);
        assert_eq!(config.choose("cref-y", &mut rng), FaultMode::Decline);
    }

    #[test]
    fn rates_are_reproducible_and_roughly_right() {
        let config = FaultConfig {
            seed: 7,
            decline_rate: 0.25,
            accept_then_fail_rate: 0.25,
            ..Default::default()
        };
        let draw = || {
            let mut rng = SplitMix64::new(config.seed);
            (0..4000)
                .map(|_| config.choose("r", &mut rng))
                .collect::<Vec<_>>()
        };
        let first = draw();
        assert_eq!(first, draw(), "same seed, same modes");
        let declines = first.iter().filter(|m| **m == FaultMode::Decline).count();
        let accepts = first.iter().filter(|m| **m == FaultMode::Accept).count();
        assert!((800..1200).contains(&declines), "{declines}");
        assert!((1800..2200).contains(&accepts), "{accepts}");
    }

    #[test]
    fn invalid_configs_are_refused() {
        assert!(FaultConfig {
            decline_rate: 0.7,
            accept_then_fail_rate: 0.4,
            ..Default::default()
        }
        .validate()
        .is_err());
        assert!(FaultConfig {
            decline_rate: -0.1,
            ..Default::default()
        }
        .validate()
        .is_err());
        assert!(FaultConfig {
            latency_ms_min: 5,
            latency_ms_max: 1,
            ..Default::default()
        }
        .validate()
        .is_err());
        assert!(FaultConfig::default().validate().is_ok());
    }

    #[test]
    fn latency_stays_within_bounds() {
        let config = FaultConfig {
            latency_ms_min: 3,
            latency_ms_max: 9,
            ..Default::default()
        };
        let mut rng = SplitMix64::new(3);
        assert!((0..1000)
            .map(|_| config.latency_ms(&mut rng))
            .all(|v| (3..=9).contains(&v)));
    }
}
