//! [`Doorbell`]: wakes a thread that waits on many engines' outputs at once.
//!
//! An orchestrator holds one request stream per running request across several engines
//! (tokio channels it reads with `try_recv` from a plain thread) and its own command channel.
//! Rather than polling all of them on a timer, it waits on one doorbell: every output sink
//! of a request added with [`crate::EngineHandle::add_request_with_bell`] rings it after each
//! item it sends (whichever kind of engine sends it), and its command senders ring it after
//! each send. The ring count makes a ring between a poll and
//! the wait impossible to miss. std's `Mutex` and `Condvar` are all it needs; a crate such as
//! `event-listener` would add a dependency for the same few lines.

use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::Duration;

/// A counter of rings and the condition its waiters sleep on. Clones share it.
#[derive(Debug, Clone, Default)]
pub struct Doorbell {
    inner: Arc<(Mutex<u64>, Condvar)>,
}

impl Doorbell {
    pub fn new() -> Self {
        Self::default()
    }

    /// Rings: wakes every waiter.
    pub fn ring(&self) {
        let (count, cv) = &*self.inner;
        *count.lock().unwrap_or_else(PoisonError::into_inner) += 1;
        cv.notify_all();
    }

    /// Rings so far; pass it to [`Doorbell::wait_past`] after polling.
    pub fn rings(&self) -> u64 {
        *self.inner.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Sleeps until the ring count passes `seen`, or `timeout`; whether it rang.
    pub fn wait_past(&self, seen: u64, timeout: Duration) -> bool {
        let (count, cv) = &*self.inner;
        let guard = count.lock().unwrap_or_else(PoisonError::into_inner);
        let (guard, _) = cv
            .wait_timeout_while(guard, timeout, |c| *c <= seen)
            .unwrap_or_else(PoisonError::into_inner);
        *guard > seen
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    #[test]
    fn a_ring_before_the_wait_is_not_missed() {
        let bell = Doorbell::new();
        let seen = bell.rings();
        bell.ring();
        let t = Instant::now();
        assert!(bell.wait_past(seen, Duration::from_secs(5)));
        assert!(t.elapsed() < Duration::from_secs(1));
        assert!(!bell.wait_past(bell.rings(), Duration::from_millis(20)));
    }

    #[test]
    fn a_ring_from_another_thread_wakes_the_waiter() {
        let bell = Doorbell::new();
        let seen = bell.rings();
        let other = bell.clone();
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(30));
            other.ring();
        });
        let start = Instant::now();
        assert!(bell.wait_past(seen, Duration::from_secs(10)));
        assert!(start.elapsed() < Duration::from_secs(5));
        t.join().expect("ringer");
    }
}
