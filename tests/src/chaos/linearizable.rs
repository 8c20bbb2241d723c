//! INV-06 as linearizability: each key's lock history checked against the model of a fenced lock
//! with the Wing-Gong-Lowe search, as Porcupine and Knossos do (issue 36;
//! docs/design/fault-suite section 6). It runs beside `checker::grants_never_overlap` and finds
//! what that check cannot: a token that goes back between grants that never overlap, a release
//! the lock service confirmed to a client that did not hold the key.
//!
//! A history is linearizable when each operation can be given one instant inside its interval
//! [invoke, return] such that, taken in the order of those instants, every operation is one the
//! model allows, with the result it had. Keys are independent objects and linearizability is
//! compositional, so each key is checked alone.
//!
//! # The model
//!
//! State: the holder (owner, session, token) if any, and the last token granted.
//! - `acquire(owner, session) -> token`: a fresh grant when the key is free and the token is above
//!   the last (holder := the grant, last := token); or the holder asking again, answered with its
//!   own grant (the lock service's idempotent re-acquire: same owner, session and token).
//! - `release(owner, token)`: frees the key when that owner's grant of that token holds it.
//! - `revoke(token)`: an operator's force-revoke; frees the key when the grant of that token holds it.
//! - `lapse(owner, session, token)`: the lock service ending the grant on its own (its session's
//!   lease ran out, or the session was closed); frees the key when that grant holds it.
//!
//! # Where each operation and its interval come from
//!
//! Times are `CLOCK_MONOTONIC` nanoseconds, shared by the recorders and the harness.
//! - acquire: a `grant` line, [`requested_ns`, `at_ns`] (the request sent, the answer arrived; a
//!   re-established handle's Renew the same). A line written before `requested_ns` existed is
//!   taken as invoked at 0: sound, only slower to search.
//! - release: a `release` line (sent), answered by a `released` line (the service freed the key).
//!   An answer is paired with the earliest release of that grant sent before it and not yet
//!   paired: at most one release of a grant can free it, and whichever did lies inside that
//!   interval. Releases with no answer are open (below).
//! - revoke: each [`Revoke`] of the evidence (the operator's, from the harness's log; those a
//!   lock history recorded), [`Revoke::sent_ns`, `Revoke::answered_ns`], one per grant (a grant
//!   is revoked once: the same revoke on record twice is merged into its widest interval), kept
//!   only when a grant line of the key has its token: a revoke of a holder the history never saw
//!   (a grant whose answer was lost, the restore probe) concerns a holder the model lacks too.
//! - lapse: one per grant, open, invoked at the earliest instant the service could have ended it
//!   without an operator. A lease runs out no earlier than the last keep-alive the service
//!   RECEIVED plus the TTL, so no earlier than the last recorded `deadline` of the grant's session
//!   or the last `grant_deadline` of the grant (each a SEND time plus the TTL minus a margin); a
//!   session that is closed is recorded `lost` before the close is sent; a session the service
//!   dropped, or a grant it disowned, is recorded (`lost`, `grant_lost`) once heard. The lapse is
//!   invoked at the earliest of those four, the very instants `grants_never_overlap` ends a
//!   belief at, so a hand-over that a lease alone explains to that check is no alarm here either.
//!   A lapse that starts later than the service really freed the key would mean a lease ran out
//!   before its holder's conservative deadline: the service broke its contract, and both checks
//!   report it. A grant with none of the four may lapse from its own acquire's invoke.
//!
//! # Open operations
//!
//! An operation whose answer never arrived may have taken effect at any instant after its invoke,
//! or never. Open here: a release without its answer (refused as not the holder, which changed
//! nothing, or its answer lost), every lapse (a session may outlive the run), and a prefix's
//! operations answered after it (see the search). The search must place every answered operation
//! and places an open one only where it takes effect; never placing it is always allowed.
//!
//! An Acquire answered "not acquired" changed nothing, and one whose answer never arrived leaves
//! no line at all (the recorder writes a grant when its answer arrives): the same as an open
//! acquire never placed. Placing it could not help: it would only hold the key with a token no
//! recorded operation knows. The model still takes such an acquire ([`Call::Acquire`] with no
//! token: holder := (owner, session, unknown), which only that owner and session's next answered
//! acquire can name), so hand-made histories can say what the recorder cannot.
//!
//! Ties: an operation answered at the instant another is invoked counts as concurrent with it
//! (the reading that never refuses more).
//!
//! # The search
//!
//! Wing and Gong's search with Lowe's memoisation, as Porcupine implements it: the calls and
//! returns in time order form a linked list; the calls before the first return are the
//! candidates to go first; one the model accepts is lifted out (with its return) and the search
//! starts over; reaching a return means the operation it ends cannot be placed next, so the last
//! placement is undone and the next candidate tried. A (set of placed operations, state) already
//! explored is not explored again. Two cuts keep a long key's search short, neither losing an
//! order: an open operation that can no longer take effect (its token is behind the last one
//! granted, or is the last and no longer holds) is set aside as never taking effect, so scans
//! stop walking past it; a placement that raises the last token above an answered operation not
//! yet placed is refused at once, as that operation could never be placed after it (so of many
//! acquires waiting in line, only the lowest token is tried first). Each key's search is bounded
//! by [`STEPS_PER_KEY_MAX`] and [`MEMO_BYTES_MAX`]; past either the key is reported UNDECIDED, a
//! finding like any other (the check did not pass).
//!
//! A refused key is described by its smallest refused prefix: the operations invoked up to some
//! answer, those answered later taken as open with the result they had. A refused prefix stays
//! refused when the history grows (linearizability is prefix-closed), so the first refused one
//! is found by bisecting the answers' times, and the answer that ends it is the one no order of
//! what came before can make room for.

use std::collections::{BTreeMap, HashMap, HashSet};

use serde::Deserialize;

use super::checker::Revoke;

/// Turns of one key's search before the key is reported undecided. A key of a CI-sized run has
/// tens of operations, mostly one after another, which the search places in a few times that
/// many turns (measured on this module's search in a debug build: 6,000 sequential operations
/// in 25 ms; 1,000 acquires waiting in line at once in 50 ms); a million turns took 0.1 s on
/// histories built to defeat it, so a pathological key costs a bounded moment, not a hung run.
pub const STEPS_PER_KEY_MAX: u64 = 1_000_000;
/// Operations a refused key's finding names (its smallest refused prefix's latest): enough to see
/// the conflict, few enough for one report line.
const NAMED_OPS_MAX: usize = 6;
/// The memo's size past which a key's search is reported undecided: it holds one set of placed
/// operations (a bit each) per placement, so a key of thousands of operations searched to
/// [`STEPS_PER_KEY_MAX`] would otherwise take gigabytes; a sequential key of 6,000 operations
/// needs about 5 MiB.
pub const MEMO_BYTES_MAX: usize = 64 << 20;

/// What an operation asked, and what it was answered, in the model's terms.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Call {
    /// A client's Acquire; `token` is the grant's, `None` when no answer arrived.
    Acquire {
        owner: String,
        session: String,
        token: Option<u64>,
    },
    /// A client's Release of its grant.
    Release { owner: String, token: u64 },
    /// An operator's force-revoke of the grant of `token`.
    Revoke { token: u64 },
    /// The lock service ending the grant because its session ended.
    Lapse {
        owner: String,
        session: String,
        token: u64,
    },
}

/// One operation on one key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Op {
    pub call: Call,
    pub invoke_ns: u64,
    /// When its answer arrived; `None`: open (it took effect after `invoke_ns`, or never).
    pub return_ns: Option<u64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    Linearizable,
    Refused,
    /// [`STEPS_PER_KEY_MAX`] (or the caller's bound) ran out first.
    Undecided,
}

/// What [`check`] found over every key.
#[derive(Debug, Clone, Default)]
pub struct Report {
    pub keys: usize,
    pub ops: usize,
    /// One line per key that is not linearizable (or undecided).
    pub findings: Vec<String>,
}

/// Checks every key of the workers' lock history lines (as `checker::Evidence` holds them) with
/// the operator's revokes. Lines this check cannot read are skipped: `grants_never_overlap`
/// reports them.
pub fn check(lines: &[serde_json::Value], revokes: &[Revoke]) -> Report {
    let by_key = histories(lines, revokes);
    let mut report = Report {
        keys: by_key.len(),
        ..Report::default()
    };
    for (key, ops) in &by_key {
        report.ops += ops.len();
        report.findings.extend(check_key(key, ops));
    }
    report
}

/// One key's finding, if its operations are not linearizable or the search is undecided.
pub fn check_key(key: &str, ops: &[Op]) -> Option<String> {
    match linearizable(ops, STEPS_PER_KEY_MAX) {
        Verdict::Linearizable => None,
        Verdict::Refused => Some(refusal(key, ops)),
        Verdict::Undecided => Some(format!(
            "UNDECIDED: {key}: {} operations; no order found or ruled out within {STEPS_PER_KEY_MAX} steps",
            ops.len()
        )),
    }
}

/// A lock history line, as `lock-client::history` documents the format (read here, not with the
/// client's own types: the checker is independent of the code under test).
#[derive(Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
enum Line {
    Grant {
        key: String,
        owner: String,
        token: u64,
        session: String,
        at_ns: u64,
        #[serde(default)]
        requested_ns: Option<u64>,
    },
    Deadline {
        session: String,
        deadline_ns: u64,
    },
    Lost {
        session: String,
        at_ns: u64,
    },
    Release {
        key: String,
        owner: String,
        token: u64,
        at_ns: u64,
    },
    Released {
        key: String,
        owner: String,
        token: u64,
        at_ns: u64,
    },
    GrantDeadline {
        key: String,
        owner: String,
        token: u64,
        deadline_ns: u64,
    },
    GrantLost {
        key: String,
        owner: String,
        token: u64,
        at_ns: u64,
    },
    #[serde(other)]
    Other,
}

/// (key, owner, token): how release, grant deadline and grant loss lines name a grant.
type GrantName = (String, String, u64);

/// The lines gathered by what they say about grants and sessions.
#[derive(Default)]
struct Gathered {
    /// Each grant line: its grant, session, and interval.
    grants: Vec<(GrantName, String, u64, u64)>,
    /// Each grant's releases' send times and its answers' arrival times.
    releases: BTreeMap<GrantName, Vec<u64>>,
    released: BTreeMap<GrantName, Vec<u64>>,
    session_deadline_last: BTreeMap<String, u64>,
    session_lost_first: BTreeMap<String, u64>,
    grant_deadline_last: BTreeMap<GrantName, u64>,
    grant_lost_first: BTreeMap<GrantName, u64>,
}

fn keep_max<K: Ord>(map: &mut BTreeMap<K, u64>, key: K, t: u64) {
    let kept = map.entry(key).or_insert(t);
    *kept = (*kept).max(t);
}

fn keep_min<K: Ord>(map: &mut BTreeMap<K, u64>, key: K, t: u64) {
    let kept = map.entry(key).or_insert(t);
    *kept = (*kept).min(t);
}

impl Gathered {
    fn read(lines: &[serde_json::Value]) -> Self {
        let mut g = Self::default();
        for line in lines.iter().filter_map(|v| Line::deserialize(v).ok()) {
            g.add(line);
        }
        g
    }

    fn add(&mut self, line: Line) {
        match line {
            Line::Grant {
                key,
                owner,
                token,
                session,
                at_ns,
                requested_ns,
            } => {
                let invoke_ns = requested_ns.unwrap_or(0).min(at_ns);
                self.grants
                    .push(((key, owner, token), session, invoke_ns, at_ns));
            }
            Line::Deadline {
                session,
                deadline_ns,
            } => keep_max(&mut self.session_deadline_last, session, deadline_ns),
            Line::Lost { session, at_ns } => keep_min(&mut self.session_lost_first, session, at_ns),
            Line::Release {
                key,
                owner,
                token,
                at_ns,
            } => self
                .releases
                .entry((key, owner, token))
                .or_default()
                .push(at_ns),
            Line::Released {
                key,
                owner,
                token,
                at_ns,
            } => self
                .released
                .entry((key, owner, token))
                .or_default()
                .push(at_ns),
            Line::GrantDeadline {
                key,
                owner,
                token,
                deadline_ns,
            } => keep_max(
                &mut self.grant_deadline_last,
                (key, owner, token),
                deadline_ns,
            ),
            Line::GrantLost {
                key,
                owner,
                token,
                at_ns,
            } => keep_min(&mut self.grant_lost_first, (key, owner, token), at_ns),
            Line::Other => {}
        }
    }

    /// Every grant line's acquire.
    fn acquires(&self) -> impl Iterator<Item = (String, Op)> + '_ {
        self.grants
            .iter()
            .map(|((key, owner, token), session, invoke_ns, return_ns)| {
                let call = Call::Acquire {
                    owner: owner.clone(),
                    session: session.clone(),
                    token: Some(*token),
                };
                (
                    key.clone(),
                    Op {
                        call,
                        invoke_ns: *invoke_ns,
                        return_ns: Some(*return_ns),
                    },
                )
            })
    }

    /// One lapse per grant (per owner, session and token, however often answered).
    fn lapses(&self) -> Vec<(String, Op)> {
        let mut first_invoke: BTreeMap<(&GrantName, &str), u64> = BTreeMap::new();
        for (name, session, invoke_ns, _) in &self.grants {
            keep_min(&mut first_invoke, (name, session.as_str()), *invoke_ns);
        }
        first_invoke
            .into_iter()
            .map(|((name, session), first_invoke_ns)| {
                let (key, owner, token) = name.clone();
                let call = Call::Lapse {
                    owner,
                    session: session.to_string(),
                    token,
                };
                let invoke_ns = self.lapse_from(name, session).unwrap_or(first_invoke_ns);
                (
                    key,
                    Op {
                        call,
                        invoke_ns,
                        return_ns: None,
                    },
                )
            })
            .collect()
    }

    /// The earliest instant the lock service could have ended the grant on its own (module doc).
    fn lapse_from(&self, grant: &GrantName, session: &str) -> Option<u64> {
        [
            self.session_deadline_last.get(session),
            self.session_lost_first.get(session),
            self.grant_deadline_last.get(grant),
            self.grant_lost_first.get(grant),
        ]
        .into_iter()
        .flatten()
        .min()
        .copied()
    }

    /// Every release line's release, with its answer if one arrived.
    fn releases(&self) -> impl Iterator<Item = (String, Op)> + '_ {
        self.releases.iter().flat_map(|(name, sent)| {
            let answers = self.released.get(name).map_or(&[][..], Vec::as_slice);
            release_ops(name, sent, answers)
                .into_iter()
                .map(|op| (name.0.clone(), op))
        })
    }
}

/// Each key's operations, from the lock history lines and the operator's revokes.
pub fn histories(lines: &[serde_json::Value], revokes: &[Revoke]) -> BTreeMap<String, Vec<Op>> {
    let gathered = Gathered::read(lines);
    let mut by_key: BTreeMap<String, Vec<Op>> = BTreeMap::new();
    let recorded = gathered
        .acquires()
        .chain(gathered.lapses())
        .chain(gathered.releases());
    for (key, op) in recorded {
        by_key.entry(key).or_default().push(op);
    }
    // One revoke per grant: a grant is revoked once (a second is refused), so the same one seen
    // twice (the harness's log and a recorded line) is merged into its widest interval.
    let mut by_grant: BTreeMap<(&str, u64), (u64, u64)> = BTreeMap::new();
    for r in revokes {
        let (sent_ns, answered_ns) = by_grant
            .entry((r.key.as_str(), r.revoked_token))
            .or_insert((r.sent_ns, r.answered_ns));
        *sent_ns = (*sent_ns).min(r.sent_ns);
        *answered_ns = (*answered_ns).max(r.answered_ns);
    }
    for ((key, token), (sent_ns, answered_ns)) in by_grant {
        let Some(ops) = by_key.get_mut(key) else {
            continue;
        };
        let granted = |o: &Op| matches!(o.call, Call::Acquire { token: Some(t), .. } if t == token);
        if ops.iter().any(granted) {
            ops.push(Op {
                call: Call::Revoke { token },
                invoke_ns: sent_ns,
                return_ns: Some(answered_ns.max(sent_ns)),
            });
        }
    }
    for ops in by_key.values_mut() {
        ops.sort_by_key(|o| o.invoke_ns);
    }
    by_key
}

/// One grant's releases: each answer paired with the earliest release sent before it and not yet
/// paired (the widest interval the release that freed the key can have); the rest open.
fn release_ops(grant: &GrantName, sent: &[u64], answers: &[u64]) -> Vec<Op> {
    let mut sent = sent.to_vec();
    sent.sort_unstable();
    let mut answers = answers.to_vec();
    answers.sort_unstable();
    let mut answered: Vec<Option<u64>> = vec![None; sent.len()];
    for a in answers {
        let unpaired = (0..sent.len()).find(|&i| answered[i].is_none() && sent[i] <= a);
        if let Some(i) = unpaired {
            answered[i] = Some(a);
        }
    }
    sent.into_iter()
        .zip(answered)
        .map(|(invoke_ns, return_ns)| Op {
            call: Call::Release {
                owner: grant.1.clone(),
                token: grant.2,
            },
            invoke_ns,
            return_ns,
        })
        .collect()
}

/// A holder as the search sees it: owner and session interned.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct Holder {
    owner: usize,
    session: usize,
    /// `None`: granted to an acquire whose answer never arrived.
    token: Option<u64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
struct State {
    holder: Option<Holder>,
    last_token: u64,
}

/// A [`Call`] with its owner and session interned.
#[derive(Debug, Clone, Copy)]
enum Act {
    Acquire(Holder),
    Release { owner: usize, token: u64 },
    Revoke { token: u64 },
    Lapse(Holder),
}

impl Act {
    /// The token the operation names (an unanswered acquire's is unknown).
    fn token(self) -> Option<u64> {
        match self {
            Self::Acquire(h) | Self::Lapse(h) => h.token,
            Self::Release { token, .. } | Self::Revoke { token } => Some(token),
        }
    }
}

fn acts<'a>(ops: &'a [Op]) -> Vec<Act> {
    let mut names: HashMap<&'a str, usize> = HashMap::new();
    let mut id = |name: &'a str| -> usize {
        let next = names.len();
        *names.entry(name).or_insert(next)
    };
    ops.iter()
        .map(|op| match &op.call {
            Call::Acquire {
                owner,
                session,
                token,
            } => Act::Acquire(Holder {
                owner: id(owner),
                session: id(session),
                token: *token,
            }),
            Call::Release { owner, token } => Act::Release {
                owner: id(owner),
                token: *token,
            },
            Call::Revoke { token } => Act::Revoke { token: *token },
            Call::Lapse {
                owner,
                session,
                token,
            } => Act::Lapse(Holder {
                owner: id(owner),
                session: id(session),
                token: Some(*token),
            }),
        })
        .collect()
}

/// The model: the state after `act`, or `None` if a fenced lock could not have done it here.
fn step(s: State, act: Act) -> Option<State> {
    let freed = State { holder: None, ..s };
    match act {
        Act::Acquire(asked) => acquire(s, asked),
        Act::Release { owner, token } => s
            .holder
            .filter(|h| h.owner == owner && h.token == Some(token))
            .map(|_| freed),
        Act::Revoke { token } => s.holder.filter(|h| h.token == Some(token)).map(|_| freed),
        Act::Lapse(grant) => (s.holder == Some(grant)).then_some(freed),
    }
}

fn acquire(s: State, asked: Holder) -> Option<State> {
    let granted = |token: u64| State {
        holder: Some(Holder {
            token: Some(token),
            ..asked
        }),
        last_token: token,
    };
    match s.holder {
        // Free: a fresh grant, its token above every earlier one (unknown if never answered).
        None => match asked.token {
            Some(t) => (t > s.last_token).then(|| granted(t)),
            None => Some(State {
                holder: Some(asked),
                ..s
            }),
        },
        // The holder asking again is answered with its own grant...
        Some(h) if h.owner == asked.owner && h.session == asked.session => {
            match (h.token, asked.token) {
                (_, None) => Some(s),
                (Some(held), Some(t)) => (held == t).then_some(s),
                // ...which names the token its unanswered acquire was granted.
                (None, Some(t)) => (t > s.last_token).then(|| granted(t)),
            }
        }
        Some(_) => None,
    }
}

/// The set of placed operations, one bit each.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Bits(Vec<u64>);

impl Bits {
    fn new(n: usize) -> Self {
        Self(vec![0; n.div_ceil(64)])
    }
    fn set(&mut self, i: usize) {
        self.0[i / 64] |= 1 << (i % 64);
    }
    fn clear(&mut self, i: usize) {
        self.0[i / 64] &= !(1 << (i % 64));
    }
}

/// No next node.
const END: usize = usize::MAX;

/// The calls and returns of one key's operations in time order, a doubly linked list that
/// operations are lifted out of and put back into (undone in the reverse order).
struct Timeline {
    /// Node 0 is the head; node `i` > 0 is an event: (operation, is its call).
    event: Vec<(usize, bool)>,
    next: Vec<usize>,
    prev: Vec<usize>,
    call_node: Vec<usize>,
    return_node: Vec<Option<usize>>,
}

impl Timeline {
    fn new(ops: &[Op]) -> Self {
        // (time, is a return, operation): at one instant calls sort before returns.
        let mut events: Vec<(u64, bool, usize)> = Vec::with_capacity(2 * ops.len());
        for (i, op) in ops.iter().enumerate() {
            events.push((op.invoke_ns, false, i));
            if let Some(r) = op.return_ns {
                events.push((r.max(op.invoke_ns), true, i));
            }
        }
        events.sort_unstable();
        let nodes = events.len() + 1;
        let mut t = Self {
            event: vec![(0, false); nodes],
            next: (1..=nodes)
                .map(|n| if n == nodes { END } else { n })
                .collect(),
            prev: (0..nodes).map(|n| n.saturating_sub(1)).collect(),
            call_node: vec![0; ops.len()],
            return_node: vec![None; ops.len()],
        };
        for (n, (_, is_return, op)) in (1..).zip(events) {
            t.event[n] = (op, !is_return);
            if is_return {
                t.return_node[op] = Some(n);
            } else {
                t.call_node[op] = n;
            }
        }
        t
    }

    fn first(&self) -> usize {
        self.next[0]
    }

    /// The operation whose call `node` is; `None` for a return or the end.
    fn call_at(&self, node: usize) -> Option<usize> {
        let (op, is_call) = *self.event.get(node)?;
        is_call.then_some(op)
    }

    fn unlink(&mut self, n: usize) {
        let (p, x) = (self.prev[n], self.next[n]);
        self.next[p] = x;
        if x != END {
            self.prev[x] = p;
        }
    }

    fn relink(&mut self, n: usize) {
        let (p, x) = (self.prev[n], self.next[n]);
        self.next[p] = n;
        if x != END {
            self.prev[x] = n;
        }
    }

    fn lift(&mut self, op: usize) {
        self.unlink(self.call_node[op]);
        if let Some(r) = self.return_node[op] {
            self.unlink(r);
        }
    }

    fn unlift(&mut self, op: usize) {
        if let Some(r) = self.return_node[op] {
            self.relink(r);
        }
        self.relink(self.call_node[op]);
    }
}

/// One step undone on backtracking.
enum Undo {
    /// An operation placed where it took effect, and the state before it.
    Placed { op: usize, before: State },
    /// An open operation set aside as never taking effect ([`dead`]).
    Retired(usize),
}

/// The search's position: what is placed, in which state, and how to undo it.
struct Search<'a> {
    ops: &'a [Op],
    acts: Vec<Act>,
    timeline: Timeline,
    state: State,
    placed: Bits,
    /// Answered operations not placed yet: none left is a linearization.
    unplaced: usize,
    /// The tokens those name, counted: none may fall below the last token granted.
    unplaced_tokens: BTreeMap<u64, usize>,
    seen: HashSet<(Bits, State)>,
    seen_bytes: usize,
    undo: Vec<Undo>,
}

impl<'a> Search<'a> {
    fn new(ops: &'a [Op]) -> Self {
        let mut search = Self {
            ops,
            acts: acts(ops),
            timeline: Timeline::new(ops),
            state: State::default(),
            placed: Bits::new(ops.len()),
            unplaced: 0,
            unplaced_tokens: BTreeMap::new(),
            seen: HashSet::new(),
            seen_bytes: 0,
            undo: Vec::new(),
        };
        (0..ops.len()).for_each(|op| search.count_unplaced(op, true));
        search
    }

    /// Counts an answered operation in or out of those still to place.
    fn count_unplaced(&mut self, op: usize, unplaced: bool) {
        if self.ops[op].return_ns.is_none() {
            return;
        }
        let token = self.acts[op].token();
        if unplaced {
            self.unplaced += 1;
            if let Some(t) = token {
                *self.unplaced_tokens.entry(t).or_default() += 1;
            }
        } else {
            self.unplaced -= 1;
            if let Some(t) = token {
                let n = self.unplaced_tokens.entry(t).or_default();
                *n -= 1;
                if *n == 0 {
                    self.unplaced_tokens.remove(&t);
                }
            }
        }
    }

    /// Whether `after` leaves an answered operation unplaceable for good: one still to place
    /// names a token below the last granted (see [`dead`]).
    fn strands_one(&self, after: State) -> bool {
        self.unplaced_tokens
            .keys()
            .next()
            .is_some_and(|t| *t < after.last_token)
    }

    /// Places `op` next if the model takes it here into a (placed, state) not explored yet.
    fn place(&mut self, op: usize) -> bool {
        let Some(after) = step(self.state, self.acts[op]) else {
            return false;
        };
        if self.strands_one(after) {
            return false;
        }
        self.placed.set(op);
        if !self.seen.insert((self.placed.clone(), after)) {
            self.placed.clear(op);
            return false;
        }
        self.seen_bytes += std::mem::size_of::<(Bits, State)>() + 8 * self.placed.0.len();
        self.undo.push(Undo::Placed {
            op,
            before: self.state,
        });
        self.state = after;
        self.timeline.lift(op);
        self.count_unplaced(op, false);
        true
    }

    /// Sets aside an open operation that can no longer take effect: never placing it loses
    /// nothing, and the scans no longer walk past it.
    fn retire(&mut self, op: usize) {
        self.placed.set(op);
        self.timeline.lift(op);
        self.undo.push(Undo::Retired(op));
    }

    /// Undoes the latest placement (and what was set aside after it); the operation it had
    /// placed, `None` when nothing is left to undo.
    fn backtrack(&mut self) -> Option<usize> {
        while let Some(undo) = self.undo.pop() {
            let op = match undo {
                Undo::Retired(op) => op,
                Undo::Placed { op, before } => {
                    self.state = before;
                    self.count_unplaced(op, true);
                    op
                }
            };
            self.placed.clear(op);
            self.timeline.unlift(op);
            if matches!(undo, Undo::Placed { .. }) {
                return Some(op);
            }
        }
        None
    }
}

/// An open operation that can take effect in no state reachable from `s`: the model refuses it
/// now and its token is not above the last one granted. Tokens only grow, a holder's token is
/// always the last, and a grant once freed is never held again, so it stays refused.
fn dead(s: State, act: Act) -> bool {
    act.token().is_some_and(|t| t <= s.last_token) && step(s, act).is_none()
}

/// The Wing-Gong-Lowe search over one key's operations, from a free key (module doc).
/// `steps_max` bounds the turns of its loop; [`MEMO_BYTES_MAX`] its memory.
pub fn linearizable(ops: &[Op], steps_max: u64) -> Verdict {
    let mut search = Search::new(ops);
    let mut node = search.timeline.first();
    for _ in 0..steps_max {
        if search.unplaced == 0 {
            return Verdict::Linearizable;
        }
        if search.seen_bytes > MEMO_BYTES_MAX {
            return Verdict::Undecided;
        }
        match search.timeline.call_at(node) {
            Some(op) if ops[op].return_ns.is_none() && dead(search.state, search.acts[op]) => {
                search.retire(op);
                node = search.timeline.next[node];
            }
            Some(op) if search.place(op) => node = search.timeline.first(),
            Some(_) => node = search.timeline.next[node],
            // A return: the operation it ends cannot be placed next. Undo the last placement
            // and try the candidate after it.
            None => match search.backtrack() {
                Some(op) => node = search.timeline.next[search.timeline.call_node[op]],
                None => return Verdict::Refused,
            },
        }
    }
    Verdict::Undecided
}

/// The operations invoked by `end_ns`, those answered later open with the result they had.
fn prefix(ops: &[Op], end_ns: u64) -> Vec<Op> {
    ops.iter()
        .filter(|o| o.invoke_ns <= end_ns)
        .map(|o| Op {
            return_ns: o.return_ns.filter(|r| *r <= end_ns),
            ..o.clone()
        })
        .collect()
}

/// A refused key's finding: its smallest refused prefix, by bisecting the answers' times.
fn refusal(key: &str, ops: &[Op]) -> String {
    let mut ends: Vec<u64> = ops.iter().filter_map(|o| o.return_ns).collect();
    ends.sort_unstable();
    ends.dedup();
    // The first answer time whose prefix is refused: every later one's is too.
    let (mut lo, mut hi) = (0, ends.len());
    while lo < hi {
        let mid = (lo + hi) / 2;
        match linearizable(&prefix(ops, ends[mid]), STEPS_PER_KEY_MAX) {
            Verdict::Refused => hi = mid,
            Verdict::Linearizable => lo = mid + 1,
            Verdict::Undecided => break,
        }
    }
    match ends.get(hi).filter(|_| lo == hi) {
        Some(&end_ns) => describe(key, &prefix(ops, end_ns), end_ns, ops.len()),
        None => format!(
            "NOT LINEARIZABLE: {key}: no order of its {} operations fits a fenced lock",
            ops.len()
        ),
    }
}

fn describe(key: &str, prefix: &[Op], end_ns: u64, total: usize) -> String {
    let base_ns = prefix.iter().map(|o| o.invoke_ns).min().unwrap_or(0);
    let answered: Vec<String> = prefix
        .iter()
        .filter(|o| o.return_ns == Some(end_ns))
        .map(|o| show(o, base_ns))
        .collect();
    let mut latest: Vec<&Op> = prefix.iter().collect();
    latest.sort_by_key(|o| std::cmp::Reverse(o.invoke_ns));
    let latest: Vec<String> = latest
        .into_iter()
        .take(NAMED_OPS_MAX)
        .map(|o| show(o, base_ns))
        .collect();
    format!(
        "NOT LINEARIZABLE: {key}: no order of its {total} operations fits a fenced lock; the smallest \
         refused prefix ({} operations) ends with the answer to {}; its latest, newest first: {}",
        prefix.len(),
        answered.join(" and "),
        latest.join("; ")
    )
}

/// One operation for a finding, its times in ms from `base_ns`.
fn show(op: &Op, base_ns: u64) -> String {
    let ms = |t: u64| t.saturating_sub(base_ns) as f64 / 1e6;
    let what = match &op.call {
        Call::Acquire {
            owner,
            session,
            token: Some(t),
        } => format!("acquire by {owner} (session {session}) -> token {t}"),
        Call::Acquire { owner, session, .. } => {
            format!("acquire by {owner} (session {session}), never answered")
        }
        Call::Release { owner, token } => format!("release of token {token} by {owner}"),
        Call::Revoke { token } => format!("operator's revoke of token {token}"),
        Call::Lapse { owner, token, .. } => format!("lapse of {owner}'s token {token}"),
    };
    match op.return_ns {
        Some(r) => format!("{what} [{:.1}, {:.1}] ms", ms(op.invoke_ns), ms(r)),
        None => format!("{what} [{:.1} ms, open)", ms(op.invoke_ns)),
    }
}

#[cfg(test)]
mod tests {
    //! Each known-bad history must be refused and each known-good one accepted; the lines are
    //! made by the worker's own serializer (`lock_client::history::HistoryEvent`).
    use super::*;
    use crate::chaos::checker::{self, Evidence};
    use lock_client::history::{HistoryEvent, HistoryRecorder};

    const MS: u64 = 1_000_000;
    /// Far beyond every test's grants: a session that outlives the history.
    const LONG_MS: u64 = 60_000;

    fn line(event: HistoryEvent) -> serde_json::Value {
        serde_json::to_value(event).expect("history events serialize")
    }
    fn grant(
        owner: &str,
        session: &str,
        token: u64,
        requested_ms: u64,
        at_ms: u64,
    ) -> HistoryEvent {
        HistoryEvent::Grant {
            key: "k".into(),
            owner: owner.into(),
            token,
            session: session.into(),
            at_ns: at_ms * MS,
            requested_ns: Some(requested_ms * MS),
        }
    }
    fn release(owner: &str, token: u64, at_ms: u64) -> HistoryEvent {
        HistoryEvent::Release {
            key: "k".into(),
            owner: owner.into(),
            token,
            at_ns: at_ms * MS,
        }
    }
    fn released(owner: &str, token: u64, at_ms: u64) -> HistoryEvent {
        HistoryEvent::Released {
            key: "k".into(),
            owner: owner.into(),
            token,
            at_ns: at_ms * MS,
        }
    }
    fn deadline(session: &str, at_ms: u64) -> HistoryEvent {
        HistoryEvent::Deadline {
            session: session.into(),
            deadline_ns: at_ms * MS,
        }
    }
    fn lost(session: &str, at_ms: u64) -> HistoryEvent {
        HistoryEvent::Lost {
            session: session.into(),
            at_ns: at_ms * MS,
        }
    }
    fn grant_deadline(owner: &str, token: u64, at_ms: u64) -> HistoryEvent {
        HistoryEvent::GrantDeadline {
            key: "k".into(),
            owner: owner.into(),
            token,
            deadline_ns: at_ms * MS,
        }
    }
    fn grant_lost(owner: &str, token: u64, at_ms: u64) -> HistoryEvent {
        HistoryEvent::GrantLost {
            key: "k".into(),
            owner: owner.into(),
            token,
            at_ns: at_ms * MS,
        }
    }
    fn revoke(token: u64, sent_ms: u64, answered_ms: u64) -> Revoke {
        Revoke {
            key: "k".into(),
            revoked_token: token,
            sent_ns: sent_ms * MS,
            answered_ns: answered_ms * MS,
        }
    }
    /// Sessions s1 and s2, alive long past every test's grants.
    fn with_sessions(events: Vec<HistoryEvent>) -> Vec<serde_json::Value> {
        let sessions = [deadline("s1", LONG_MS), deadline("s2", LONG_MS)];
        sessions.into_iter().chain(events).map(line).collect()
    }
    fn findings(lines: &[serde_json::Value], revokes: &[Revoke]) -> Vec<String> {
        check(lines, revokes).findings
    }
    fn overlaps(lines: &[serde_json::Value]) -> Vec<checker::Violation> {
        let e = Evidence {
            lock_history: lines.to_vec(),
            ..Evidence::default()
        };
        checker::grants_never_overlap(&e).violations
    }

    #[test]
    fn sequential_acquires_and_releases_are_linearizable() {
        let lines = with_sessions(vec![
            grant("a", "s1", 5, 0, 10),
            release("a", 5, 20),
            released("a", 5, 30),
            grant("b", "s2", 9, 40, 50),
            release("b", 9, 60),
            released("b", 9, 70),
        ]);
        let report = check(&lines, &[]);
        assert!(report.findings.is_empty(), "{:?}", report.findings);
        // Two acquires, two releases, a lapse per grant: every line was read.
        assert_eq!((report.keys, report.ops), (1, 6));
    }

    /// B asks while A holds and is answered after A's release: B's interval spans A's release.
    #[test]
    fn an_acquire_that_waits_for_the_holders_release_is_linearizable() {
        let lines = with_sessions(vec![
            grant("a", "s1", 5, 0, 10),
            release("a", 5, 40),
            released("a", 5, 50),
            grant("b", "s2", 9, 5, 60),
        ]);
        assert!(findings(&lines, &[]).is_empty());
        assert!(overlaps(&lines).is_empty());
    }

    /// C's acquire is never answered (the recorder writes no line for it; said here as an
    /// operation): it may never have taken effect, so B's grant after A's release stands. The
    /// same acquire answered with a token of its own is refused: it would hold the key B got.
    #[test]
    fn a_pending_acquire_with_no_answer_is_linearizable() {
        let op = |call: Call, invoke_ms: u64, return_ms: Option<u64>| Op {
            call,
            invoke_ns: invoke_ms * MS,
            return_ns: return_ms.map(|r| r * MS),
        };
        let acquire = |owner: &str, token: Option<u64>| Call::Acquire {
            owner: owner.into(),
            session: format!("s-{owner}"),
            token,
        };
        let a_release = Call::Release {
            owner: "a".into(),
            token: 5,
        };
        let mut ops = vec![
            op(acquire("a", Some(5)), 0, Some(10)),
            op(acquire("c", None), 15, None),
            op(a_release, 40, Some(50)),
            op(acquire("b", Some(9)), 45, Some(60)),
        ];
        assert_eq!(linearizable(&ops, STEPS_PER_KEY_MAX), Verdict::Linearizable);
        ops[1] = op(acquire("c", Some(7)), 15, Some(55));
        assert_eq!(linearizable(&ops, STEPS_PER_KEY_MAX), Verdict::Refused);
    }

    /// A lapse invoked before its grant can be placed (no deadline recorded: it may come any time
    /// after the acquire) is kept until the grant holds; C's grant needs it.
    #[test]
    fn an_open_operation_is_kept_until_it_can_take_effect() {
        let op = |call: Call, invoke_ms: u64, return_ms: Option<u64>| Op {
            call,
            invoke_ns: invoke_ms * MS,
            return_ns: return_ms.map(|r| r * MS),
        };
        let grant = |owner: &str, token: u64| Call::Acquire {
            owner: owner.into(),
            session: format!("s-{owner}"),
            token: Some(token),
        };
        let ops = vec![
            op(grant("b", 3), 0, Some(10)),
            op(grant("a", 5), 5, Some(30)),
            op(
                Call::Lapse {
                    owner: "a".into(),
                    session: "s-a".into(),
                    token: 5,
                },
                5,
                None,
            ),
            op(
                Call::Release {
                    owner: "b".into(),
                    token: 3,
                },
                20,
                Some(25),
            ),
            op(grant("c", 7), 40, Some(50)),
        ];
        assert_eq!(linearizable(&ops, STEPS_PER_KEY_MAX), Verdict::Linearizable);
        let without_lapse: Vec<Op> = ops
            .iter()
            .filter(|o| !matches!(o.call, Call::Lapse { .. }))
            .cloned()
            .collect();
        assert_eq!(
            linearizable(&without_lapse, STEPS_PER_KEY_MAX),
            Verdict::Refused
        );
    }

    /// A's session lost its lease (deadline passed, then found lost); B is granted after it.
    #[test]
    fn a_lost_lease_followed_by_another_owners_grant_is_linearizable() {
        let lines: Vec<serde_json::Value> = [
            deadline("s1", 1_000),
            deadline("s2", LONG_MS),
            grant("a", "s1", 5, 0, 10),
            grant_deadline("a", 5, 900),
            lost("s1", 1_010),
            grant("b", "s2", 9, 1_200, 1_210),
        ]
        .into_iter()
        .map(line)
        .collect();
        assert!(findings(&lines, &[]).is_empty());
    }

    /// Issue 13's shape: the operator's revoke is sent before A's grant answer arrives, and B is
    /// granted at once. Withheld, the same history is two holders.
    #[test]
    fn an_operator_revoke_then_a_new_grant_is_linearizable() {
        let lines = with_sessions(vec![
            grant("a", "s1", 5, 0, 100),
            grant("b", "s2", 9, 96, 120),
            grant_lost("a", 5, 1_100),
        ]);
        assert!(findings(&lines, &[revoke(5, 90, 95)]).is_empty());
        // The same revoke on record twice (the harness's log and a recorded line) is one.
        assert!(findings(&lines, &[revoke(5, 90, 95), revoke(5, 91, 94)]).is_empty());
        assert_eq!(findings(&lines, &[]).len(), 1);
        // A revoke of another grant hands nothing on.
        assert_eq!(findings(&lines, &[revoke(4, 90, 95)]).len(), 1);
    }

    /// A sends two releases and one answer arrives: it may be the first's, which freed the key
    /// before B's grant and before the second was sent (refused then, unanswered). Paired with
    /// the second, it would say A still held the key after B's grant.
    #[test]
    fn a_release_answer_pairs_with_the_earliest_release_sent_before_it() {
        let lines = with_sessions(vec![
            grant("a", "s1", 5, 0, 10),
            release("a", 5, 20),
            grant("b", "s2", 9, 25, 35),
            release("a", 5, 40),
            released("a", 5, 50),
        ]);
        assert!(findings(&lines, &[]).is_empty());
    }

    #[test]
    fn the_holder_acquiring_again_is_handed_its_own_token() {
        let again = with_sessions(vec![
            grant("a", "s1", 5, 0, 10),
            grant("a", "s1", 5, 20, 30),
            release("a", 5, 40),
            released("a", 5, 50),
        ]);
        assert!(findings(&again, &[]).is_empty());
        // The same token to another session of the same owner is a second grant of it.
        let other_session = with_sessions(vec![
            grant("a", "s1", 5, 0, 10),
            grant("a", "s2", 5, 20, 30),
        ]);
        assert_eq!(findings(&other_session, &[]).len(), 1);
    }

    /// One token for two grants, one after the other: the second is not above the last.
    #[test]
    fn a_token_granted_again_after_its_release_is_refused() {
        let lines = with_sessions(vec![
            grant("a", "s1", 5, 0, 10),
            release("a", 5, 20),
            released("a", 5, 30),
            grant("b", "s2", 5, 40, 50),
        ]);
        assert_eq!(findings(&lines, &[]).len(), 1);
    }

    #[test]
    fn two_grants_overlapping_in_time_are_refused() {
        let lines = with_sessions(vec![
            grant("a", "s1", 5, 0, 10),
            grant("b", "s2", 9, 200, 300),
            release("a", 5, 400),
            released("a", 5, 410),
        ]);
        let found = findings(&lines, &[]);
        assert_eq!(found.len(), 1, "{found:?}");
        assert!(found[0].starts_with("NOT LINEARIZABLE: k:"), "{found:?}");
        assert!(
            found[0].contains("ends with the answer to acquire by b (session s2) -> token 9"),
            "{found:?}"
        );
        assert_eq!(overlaps(&lines).len(), 1, "the overlap check sees it too");
    }

    /// A lease of A's still running (its session's and its own deadline ahead, no loss, no
    /// revoke) when B is granted: refused. The same with A's session found lost first is not.
    #[test]
    fn a_grant_inside_another_holders_lease_is_refused() {
        let history = [
            deadline("s1", 1_000),
            deadline("s2", LONG_MS),
            grant("a", "s1", 5, 0, 10),
            grant_deadline("a", 5, 1_000),
            grant("b", "s2", 9, 490, 500),
        ];
        let lines: Vec<serde_json::Value> = history.iter().cloned().map(line).collect();
        assert_eq!(findings(&lines, &[]).len(), 1);
        let other_key = Revoke {
            key: "other".into(),
            ..revoke(5, 450, 460)
        };
        assert_eq!(findings(&lines, &[other_key]).len(), 1);
        let mut with_loss = lines;
        with_loss.push(line(lost("s1", 400)));
        assert!(findings(&with_loss, &[]).is_empty());
    }

    /// Two histories the overlap check passes and this one refuses: a token that goes back
    /// between grants that never overlap, and a release the service confirmed to a non-holder.
    #[test]
    fn a_token_going_back_or_a_non_holders_release_passes_the_overlap_check_and_is_refused() {
        let backwards = with_sessions(vec![
            grant("a", "s1", 9, 0, 10),
            release("a", 9, 20),
            released("a", 9, 30),
            grant("b", "s2", 5, 40, 50),
            release("b", 5, 60),
            released("b", 5, 70),
        ]);
        assert!(overlaps(&backwards).is_empty());
        let found = findings(&backwards, &[]);
        assert_eq!(found.len(), 1, "{found:?}");
        assert!(
            found[0].contains("answer to acquire by b (session s2) -> token 5"),
            "{found:?}"
        );

        let non_holder = with_sessions(vec![
            grant("a", "s1", 5, 0, 10),
            release("b", 5, 20),
            released("b", 5, 30),
        ]);
        assert!(overlaps(&non_holder).is_empty());
        let found = findings(&non_holder, &[]);
        assert_eq!(found.len(), 1, "{found:?}");
        assert!(
            found[0].contains("answer to release of token 5 by b"),
            "{found:?}"
        );
        // Unanswered (refused, as the service would refuse it), the same release is no finding.
        let refused: Vec<serde_json::Value> = non_holder
            .into_iter()
            .filter(|v| v["kind"] != "released")
            .collect();
        assert!(findings(&refused, &[]).is_empty());
    }

    /// The history as a worker writes it: the recorder's file, read by the checker's reader.
    #[test]
    fn the_lines_a_worker_records_are_read_and_checked() {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let write = |name: &str, events: Vec<HistoryEvent>| {
            let path = dir
                .path()
                .join(format!("{}{name}.jsonl", checker::LOCK_HISTORY_PREFIX));
            let recorder = HistoryRecorder::open(&path).expect("the history file opens");
            for e in &events {
                recorder.record(e);
            }
        };
        write(
            "worker-1",
            vec![
                deadline("s1", LONG_MS),
                grant("a", "s1", 5, 0, 10),
                release("a", 5, 20),
                released("a", 5, 30),
            ],
        );
        write(
            "worker-2",
            vec![deadline("s2", LONG_MS), grant("b", "s2", 9, 25, 40)],
        );
        let (lines, malformed) = checker::read_lock_histories(dir.path()).expect("readable");
        assert!(malformed.is_empty(), "{malformed:?}");
        let report = check(&lines, &[]);
        assert!(report.findings.is_empty(), "{:?}", report.findings);
        assert_eq!(report.ops, 5, "two acquires, one release, two lapses");
        // C is answered while A holds the key (its release not yet sent): found in the files.
        write(
            "worker-3",
            vec![deadline("s3", LONG_MS), grant("c", "s3", 12, 11, 15)],
        );
        let (lines, _) = checker::read_lock_histories(dir.path()).expect("readable");
        assert_eq!(check(&lines, &[]).findings.len(), 1);
    }

    /// Lines written before `requested_ns` existed: the acquire may have been invoked at any
    /// earlier time, so a revoke sent before its answer arrived still pairs with it.
    #[test]
    fn a_grant_line_without_its_request_time_is_taken_as_invoked_at_the_start() {
        let mut lines = with_sessions(vec![grant("b", "s2", 9, 96, 120)]);
        lines.push(serde_json::json!({"kind": "grant", "key": "k", "owner": "a", "token": 5, "session": "s1", "at_ns": 100 * MS}));
        assert!(findings(&lines, &[revoke(5, 90, 95)]).is_empty());
    }

    #[test]
    fn a_search_past_its_step_bound_is_undecided_not_passed() {
        let lines = with_sessions(vec![
            grant("a", "s1", 5, 0, 10),
            release("a", 5, 20),
            released("a", 5, 30),
            grant("b", "s2", 9, 40, 50),
        ]);
        let ops = &histories(&lines, &[])["k"];
        assert_eq!(linearizable(ops, 2), Verdict::Undecided);
        assert_eq!(linearizable(ops, STEPS_PER_KEY_MAX), Verdict::Linearizable);
    }
}
