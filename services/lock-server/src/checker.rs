//! INV-06's detective control: a linearizability-style check over a recorded history of grants.
//! Pure: no I/O, no clock. Times are nanoseconds on one monotonic clock shared by the recorders.
//!
//! Each record is the interval during which a client KNEW it held the grant: from the moment the
//! grant's response arrived to the moment it stopped relying on it (release request sent, crash,
//! or the local deadline). That interval lies inside the server's real holding interval, so if two
//! recorded intervals of one key overlap, the real ones did too: a true violation, never a false
//! alarm from network delay.
//!
//! Tokens are unique per grant, so records with the same key, token AND owner are one grant seen
//! twice (an idempotent re-acquire after a release that did not reach the server): they are merged
//! into one interval. The same token with a different owner is a repeated token: a violation.

use std::collections::BTreeMap;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GrantRecord {
    pub key: String,
    pub owner: String,
    pub token: u64,
    pub start_ns: u64,
    pub end_ns: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Violation {
    /// Two grants of one key were believed held at the same time.
    Overlap {
        key: String,
        first: GrantRecord,
        second: GrantRecord,
    },
    /// A later grant of a key carried a token not above an earlier one's (repeat or regression).
    TokenNotIncreasing {
        key: String,
        earlier: GrantRecord,
        later: GrantRecord,
    },
    /// A record whose end precedes its start: the recorder is broken.
    MalformedInterval(GrantRecord),
}

/// Checks that no two grants of a key overlap in real time and that tokens per key strictly
/// increase in grant order. Returns every violation found.
pub fn check(history: &[GrantRecord]) -> Result<(), Vec<Violation>> {
    let mut violations = Vec::new();
    let mut by_key: BTreeMap<&str, Vec<&GrantRecord>> = BTreeMap::new();
    for record in history {
        if record.end_ns < record.start_ns {
            violations.push(Violation::MalformedInterval(record.clone()));
            continue;
        }
        by_key.entry(&record.key).or_default().push(record);
    }
    for (key, records) in by_key {
        let mut merged: BTreeMap<u64, GrantRecord> = BTreeMap::new();
        for r in records {
            match merged.get_mut(&r.token) {
                Some(m) if m.owner == r.owner => {
                    m.start_ns = m.start_ns.min(r.start_ns);
                    m.end_ns = m.end_ns.max(r.end_ns);
                }
                Some(m) => violations.push(Violation::TokenNotIncreasing {
                    key: key.to_string(),
                    earlier: m.clone(),
                    later: r.clone(),
                }),
                None => {
                    merged.insert(r.token, r.clone());
                }
            }
        }
        let mut grants: Vec<&GrantRecord> = merged.values().collect();
        grants.sort_by_key(|g| (g.start_ns, g.end_ns));
        // Tokens strictly increase in grant order: each is above the highest seen before it,
        // which also catches a repeat between non-adjacent grants.
        let mut highest: Option<&GrantRecord> = None;
        for g in &grants {
            if let Some(h) = highest {
                if g.token <= h.token {
                    violations.push(Violation::TokenNotIncreasing {
                        key: key.to_string(),
                        earlier: h.clone(),
                        later: (*g).clone(),
                    });
                }
            }
            if highest.is_none_or(|h| g.token > h.token) {
                highest = Some(g);
            }
        }
        // Overlap: each grant must start after every earlier one ended. Tracking the latest end
        // so far also catches a long grant overlapping a later non-adjacent one.
        let mut latest_end: Option<&GrantRecord> = None;
        for g in &grants {
            if let Some(prev) = latest_end {
                if g.start_ns < prev.end_ns {
                    violations.push(Violation::Overlap {
                        key: key.to_string(),
                        first: prev.clone(),
                        second: (*g).clone(),
                    });
                }
            }
            if latest_end.is_none_or(|p| g.end_ns > p.end_ns) {
                latest_end = Some(g);
            }
        }
    }
    if violations.is_empty() {
        Ok(())
    } else {
        Err(violations)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn g(key: &str, token: u64, start_ns: u64, end_ns: u64) -> GrantRecord {
        GrantRecord {
            key: key.into(),
            owner: format!("o{token}"),
            token,
            start_ns,
            end_ns,
        }
    }

    #[test]
    fn a_clean_history_passes() {
        let history = vec![
            g("a", 5, 0, 10),
            g("a", 9, 10, 20),
            g("b", 6, 5, 30),
            g("a", 12, 25, 26),
        ];
        assert_eq!(check(&history), Ok(()));
    }

    /// Negative control: the checker must catch an overlap and a repeated token.
    #[test]
    fn overlap_and_repeated_token_are_caught() {
        let overlapping = vec![g("a", 5, 0, 10), g("a", 9, 8, 20)];
        let v = check(&overlapping).unwrap_err();
        assert!(matches!(v.as_slice(), [Violation::Overlap { .. }]), "{v:?}");

        let mut second_holder = g("a", 5, 11, 20);
        second_holder.owner = "someone-else".into();
        let repeated = vec![g("a", 5, 0, 10), second_holder];
        let v = check(&repeated).unwrap_err();
        assert!(
            v.iter()
                .any(|x| matches!(x, Violation::TokenNotIncreasing { .. })),
            "{v:?}"
        );

        let going_back = vec![g("a", 9, 0, 10), g("a", 5, 11, 20)];
        assert!(check(&going_back).is_err());

        // A long grant overlapping a non-adjacent later one.
        let long = vec![g("a", 1, 0, 100), g("a", 2, 10, 20), g("a", 3, 50, 60)];
        let v = check(&long).unwrap_err();
        assert_eq!(
            v.iter()
                .filter(|x| matches!(x, Violation::Overlap { .. }))
                .count(),
            2,
            "{v:?}"
        );

        // A repeated token between non-adjacent grants.
        let mut far = g("a", 4, 4, 5);
        far.owner = "someone-else".into();
        let repeat_far = vec![g("a", 4, 0, 1), g("a", 7, 2, 3), far];
        assert!(check(&repeat_far).is_err());

        // The same grant reported twice by its holder merges; another grant inside it overlaps.
        let reacquired = vec![g("a", 4, 0, 10), g("a", 4, 20, 30)];
        assert_eq!(check(&reacquired), Ok(()));
        let inside = vec![g("a", 4, 0, 10), g("a", 6, 12, 15), g("a", 4, 20, 30)];
        assert!(check(&inside).is_err());

        assert!(check(&[g("a", 1, 10, 5)]).is_err());
    }
}
