//! First come, first served among the Acquire calls waiting for one key in this process.
//!
//! A caller that finds the key held joins the key's queue and takes a ticket; only the caller at
//! the head asks the backend again (woken by the release, through the backend's own watch or
//! notification), the others wait for their turn without touching the backend. So a payout that
//! asked first is granted first, and a stream of later arrivals cannot pass it: a newcomer that
//! finds waiters queues behind them even when the key happens to be free at that instant.
//!
//! Fairness only: mutual exclusion is still the backend's conditional write, whatever the queue
//! says. The queue lives in the lock-server process: with several lock-server processes each is
//! fair among its own callers, and between processes the backend's race decides (see
//! ARCHITECTURE.md, "Decision: the waiting queue is in the lock-server process").

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

use tokio::sync::watch;
use tokio::time::Instant;

#[derive(Default)]
pub struct Queues {
    keys: Mutex<HashMap<String, KeyQueue>>,
    /// Waiters over every key (the server's bound, `service::WAITERS_MAX`).
    total: std::sync::atomic::AtomicUsize,
}

struct KeyQueue {
    next_ticket: u64,
    waiting: VecDeque<u64>,
    /// The ticket at the head of the queue, for the waiters behind it.
    head: watch::Sender<Option<u64>>,
}

/// A place in one key's queue, left however the call ends (granted, timed out, cancelled by the
/// caller's disconnect, failed): dropping it wakes the next in line.
pub struct Ticket {
    queues: Arc<Queues>,
    key: String,
    number: u64,
    head: watch::Receiver<Option<u64>>,
    /// The caller's parked-waiter place (`callers`), given back with the ticket.
    slot: Option<crate::callers::WaiterSlot>,
}

impl Queues {
    /// Waiters queued for `key` right now (introspection: `Describe`).
    pub fn len(&self, key: &str) -> usize {
        self.keys
            .lock()
            .expect("queues")
            .get(key)
            .map_or(0, |q| q.waiting.len())
    }

    /// Waiters queued over every key right now.
    pub fn waiting_total(&self) -> usize {
        self.total.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Joins the back of `key`'s queue.
    pub fn join(self: &Arc<Self>, key: &str) -> Ticket {
        let mut keys = self.keys.lock().expect("queues");
        let queue = keys.entry(key.to_string()).or_insert_with(|| KeyQueue {
            next_ticket: 0,
            waiting: VecDeque::new(),
            head: watch::channel(None).0,
        });
        let number = queue.next_ticket;
        queue.next_ticket += 1;
        queue.waiting.push_back(number);
        self.total
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if queue.waiting.len() == 1 {
            queue.head.send_replace(Some(number));
        }
        Ticket {
            queues: Arc::clone(self),
            key: key.to_string(),
            number,
            head: queue.head.subscribe(),
            slot: None,
        }
    }

    fn leave(&self, key: &str, number: u64) {
        let mut keys = self.keys.lock().expect("queues");
        let Some(queue) = keys.get_mut(key) else {
            return;
        };
        let before = queue.waiting.len();
        queue.waiting.retain(|&n| n != number);
        if queue.waiting.len() < before {
            self.total
                .fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
        }
        match queue.waiting.front().copied() {
            None => {
                keys.remove(key);
            }
            Some(front) => {
                if *queue.head.borrow() != Some(front) {
                    queue.head.send_replace(Some(front));
                }
            }
        }
    }
}

impl Ticket {
    /// Keeps the caller's waiter place for as long as this ticket lives.
    pub fn hold(&mut self, slot: Option<crate::callers::WaiterSlot>) {
        self.slot = slot;
    }

    pub fn number(&self) -> u64 {
        self.number
    }

    pub fn is_head(&self) -> bool {
        *self.head.borrow() == Some(self.number)
    }

    /// Waits until this ticket is at the head of the queue; false if `deadline` came first.
    pub async fn wait_turn(&mut self, deadline: Instant) -> bool {
        let number = self.number;
        let turned = tokio::select! {
            turn = self.head.wait_for(|head| *head == Some(number)) => turn.is_ok(),
            _ = tokio::time::sleep_until(deadline) => false,
        };
        turned || self.is_head()
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        self.queues.leave(&self.key, self.number);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn soon() -> Instant {
        Instant::now() + Duration::from_millis(50)
    }

    #[tokio::test]
    async fn tickets_reach_the_head_in_the_order_they_joined() {
        let queues = Arc::new(Queues::default());
        let first = queues.join("k");
        let mut second = queues.join("k");
        let mut third = queues.join("k");
        assert!(first.is_head());
        assert!(!second.is_head() && !third.is_head());
        assert_eq!(queues.len("k"), 3);
        assert!(
            !second.wait_turn(soon()).await,
            "second waits while first is in line"
        );
        drop(first);
        assert!(second.wait_turn(soon()).await);
        assert!(!third.wait_turn(soon()).await);
        drop(second);
        assert!(third.wait_turn(soon()).await);
        drop(third);
        assert_eq!(queues.len("k"), 0);
        assert!(
            queues.keys.lock().unwrap().is_empty(),
            "an empty queue is forgotten"
        );
    }

    /// The server-wide count the waiter bound (`service::WAITERS_MAX`) reads: every join counts,
    /// every leave (granted, timed out, gone) uncounts, over all keys.
    #[tokio::test]
    async fn waiters_are_counted_over_every_key_until_they_leave() {
        let queues = Arc::new(Queues::default());
        let a = queues.join("a");
        let b1 = queues.join("b");
        let b2 = queues.join("b");
        assert_eq!(queues.waiting_total(), 3);
        drop(b1);
        assert_eq!(queues.waiting_total(), 2);
        drop((a, b2));
        assert_eq!(queues.waiting_total(), 0);
    }

    #[tokio::test]
    async fn a_waiter_that_leaves_from_the_middle_keeps_the_order_of_the_rest() {
        let queues = Arc::new(Queues::default());
        let first = queues.join("k");
        let second = queues.join("k");
        let mut third = queues.join("k");
        drop(second);
        assert!(!third.wait_turn(soon()).await);
        drop(first);
        assert!(third.wait_turn(soon()).await);
    }

    #[tokio::test]
    async fn keys_queue_independently() {
        let queues = Arc::new(Queues::default());
        let _a = queues.join("a");
        let b = queues.join("b");
        assert!(b.is_head());
    }

    #[tokio::test]
    async fn a_new_queue_after_an_empty_one_starts_at_its_head() {
        let queues = Arc::new(Queues::default());
        drop(queues.join("k"));
        let again = queues.join("k");
        assert!(again.is_head());
    }
}
