//! How a step waits while nothing moves: spin, then yield, then sleep in the poller; and how
//! long it spins, which adapts to how soon the sleeps it falls into end.
//!
//! Why the spin adapts: waking a process that sleeps in the poller costs more on a virtual
//! machine than on bare metal (the host must run the idle vCPU again), and two ranks that each
//! sleep as soon as the other is late by more than the spin can lock themselves into taking
//! turns to wake each other: each wake-up arrives later than the spin, so the next wait sleeps
//! too. On the 2-core host, a 2-rank all_reduce of 16 MiB over shared memory took 1.4-1.6 ms
//! with the default spin (50 us), 2.5-6.4 ms with none (`DIST_GLOO_SPIN_US=0`: every wait a
//! wake-up) and 2.2-3.4 ms with 5 us, where the ranks fell into that pattern; adapting, 5 us
//! took 1.5-1.6 ms. As Linux's KVM halt-polling does, a sleep that ended within
//! [`MAX_WINDOW`] doubles the spin (spinning that much longer would have caught its wake-up),
//! and a longer one halves it again, down to the configured spin; so a peer that answers late
//! but soon is spun for, and one that computes for milliseconds is slept through.

use std::time::{Duration, Instant};

/// The most the spin grows to: it covers the wake-up of an idle vCPU (about 150 us per wait
/// with no spin above) several times over, and bounds the time a rank burns waiting for a peer
/// that is merely late.
pub(super) const MAX_WINDOW: Duration = Duration::from_millis(1);

/// Which part of the spin busy-waits without yielding the core.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Busy {
    /// All of it, however long it grows: this host's ranks have a core each
    /// (`MeshOptions::busy_spin` unset and resolved so).
    Whole,
    /// Its first part (`MeshOptions::busy_spin` as set, or zero where ranks share cores).
    First(Duration),
}

/// How long a step spins before it sleeps, and which part of that busy-waits without yielding
/// the core.
#[derive(Debug)]
pub(super) struct SpinWindow {
    /// The configured spin (`MeshOptions::spin`): the window never shrinks below it.
    base: Duration,
    busy: Busy,
    /// The spin now, between `base` and [`MAX_WINDOW`].
    now: Duration,
}

impl SpinWindow {
    /// A window of `spin`, `busy` of which busy-waits.
    pub(super) fn new(spin: Duration, busy: Busy) -> SpinWindow {
        SpinWindow {
            base: spin,
            busy,
            now: spin,
        }
    }

    /// Sets the configured spin, and the window back to it; which part busy-waits stays as
    /// it was resolved.
    pub(super) fn set_base(&mut self, spin: Duration) {
        self.base = spin;
        self.now = spin;
    }

    /// Whether the window grows at all: only where the whole spin busy-waits (this host's
    /// ranks have a core each), so that ranks sharing cores keep handing them over at once,
    /// and a configured spin of zero stays zero.
    fn adapts(&self) -> bool {
        self.busy == Busy::Whole && !self.base.is_zero() && self.base < MAX_WINDOW
    }

    /// The spin now.
    pub(super) fn spin(&self) -> Duration {
        self.now
    }

    /// The busy part of the spin now.
    pub(super) fn busy(&self) -> Duration {
        match self.busy {
            Busy::Whole => self.now,
            Busy::First(d) => d,
        }
    }

    /// A sleep in the poller lasted `slept`: one that ended within [`MAX_WINDOW`] doubles the
    /// window, a longer one halves it (see the module's doc).
    pub(super) fn slept(&mut self, slept: Duration) {
        if !self.adapts() {
            return;
        }
        self.now = if slept < MAX_WINDOW {
            self.now.saturating_mul(2).min(MAX_WINDOW)
        } else {
            (self.now / 2).max(self.base)
        };
    }
}

/// How long a step has waited with nothing to do, and so how it waits next.
#[derive(Default)]
pub(super) struct Idle {
    spin_until: Option<Instant>,
    idle_since: Option<Instant>,
}

impl Idle {
    /// Something moved: the next wait spins afresh.
    pub(super) fn reset(&mut self) {
        *self = Idle::default();
    }

    /// At `now`, with nothing to do: spins once or yields once and returns true while within
    /// the window's spin of the first idle pass, else returns false (time to sleep in the
    /// poller). A CPU spin first, for the window's busy part (see `MeshOptions::busy_spin`): a
    /// peer on another core answers through shared memory within a microsecond, while a yield
    /// on a busy host may hand the core to another process for a whole time slice. Then
    /// yields, which let a peer that shares this core run.
    pub(super) fn spin(&mut self, now: Instant, window: &SpinWindow) -> bool {
        let until = *self
            .spin_until
            .get_or_insert(dist_backend::deadline_after(now, window.spin()));
        if now >= until {
            return false;
        }
        if now.duration_since(*self.idle_since.get_or_insert(now)) < window.busy() {
            std::hint::spin_loop();
        } else {
            std::thread::yield_now();
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const US: Duration = Duration::from_micros(1);

    #[test]
    fn short_sleeps_double_the_spin_up_to_the_cap_and_long_ones_halve_it_to_the_base() {
        let mut w = SpinWindow::new(50 * US, Busy::Whole);
        assert_eq!((w.spin(), w.busy()), (50 * US, 50 * US));
        let mut seen = vec![];
        for _ in 0..6 {
            w.slept(150 * US);
            seen.push(w.spin().as_micros());
        }
        assert_eq!(seen, [100, 200, 400, 800, 1000, 1000]);
        assert_eq!(w.busy(), MAX_WINDOW, "the whole window busy-waits");
        // A sleep of exactly the cap is a long one.
        seen.clear();
        for _ in 0..6 {
            w.slept(MAX_WINDOW);
            seen.push(w.spin().as_micros());
        }
        assert_eq!(seen, [500, 250, 125, 62, 50, 50]);
    }

    #[test]
    fn a_window_that_yields_a_spin_of_zero_or_one_past_the_cap_stays_as_configured() {
        for (spin, busy, busy_part) in [
            (50 * US, Busy::First(Duration::ZERO), Duration::ZERO),
            (50 * US, Busy::First(10 * US), 10 * US),
            (50 * US, Busy::First(50 * US), 50 * US),
            (Duration::ZERO, Busy::Whole, Duration::ZERO),
            (2 * MAX_WINDOW, Busy::Whole, 2 * MAX_WINDOW),
        ] {
            let mut w = SpinWindow::new(spin, busy);
            w.slept(US);
            w.slept(US);
            assert_eq!((w.spin(), w.busy()), (spin, busy_part), "{spin:?} {busy:?}");
        }
    }

    #[test]
    fn setting_the_spin_restarts_the_window_from_it() {
        let mut w = SpinWindow::new(50 * US, Busy::Whole);
        w.slept(US);
        w.set_base(20 * US);
        assert_eq!((w.spin(), w.busy()), (20 * US, 20 * US));
        w.slept(US);
        assert_eq!(w.spin(), 40 * US);
        // Where ranks share cores, a spin set later still yields, and does not grow.
        let mut y = SpinWindow::new(Duration::ZERO, Busy::First(Duration::ZERO));
        y.set_base(20 * US);
        y.slept(US);
        assert_eq!((y.spin(), y.busy()), (20 * US, Duration::ZERO));
    }
}
