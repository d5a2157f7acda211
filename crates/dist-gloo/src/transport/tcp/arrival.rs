//! Waking a thread that sleeps in the engine's poller for arrivals
//! ([`dist_backend::Backend::wait_for_arrival`]) from another thread: the group's
//! point-to-point engine sleeps there while its receives wait, and is handed new sends by the
//! caller's threads meanwhile.

use std::sync::Arc;
use std::task::{Wake, Waker};

use mio::{Registry, Token};

/// The poller token of the waker's events: no peer's (their tokens are their ranks).
pub(super) const WAKE_TOKEN: Token = Token(usize::MAX);

/// The poller's waker behind a [`std::task::Waker`].
#[derive(Debug)]
pub(super) struct ArrivalWaker(mio::Waker);

impl ArrivalWaker {
    /// A waker whose wakes end the next (or current) poll of `registry`'s poller.
    pub(super) fn new(registry: &Registry) -> std::io::Result<Arc<Self>> {
        Ok(Arc::new(ArrivalWaker(mio::Waker::new(
            registry, WAKE_TOKEN,
        )?)))
    }

    /// As a [`Waker`], for [`dist_backend::Backend::arrival_waker`].
    pub(super) fn waker(self: &Arc<Self>) -> Waker {
        Waker::from(Arc::clone(self))
    }
}

impl Wake for ArrivalWaker {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        // A failed wake (the eventfd's counter full) means wakes are already pending, which
        // end the poll just as well.
        let _ = self.0.wake();
    }
}
