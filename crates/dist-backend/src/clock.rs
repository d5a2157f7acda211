//! Deadlines that cannot overflow.

use std::time::{Duration, Instant};

/// About a century: what a timeout too large for [`Instant`] is cut to.
const FOREVER: Duration = Duration::from_secs(100 * 365 * 86_400);

/// The instant `timeout` after `start`, saturating: `Instant + Duration` panics when the sum
/// does not fit, and `Duration::MAX` is how a caller says "no timeout", so a timeout too large
/// to represent gives a deadline about a century away instead.
pub fn deadline_after(start: Instant, timeout: Duration) -> Instant {
    start
        .checked_add(timeout)
        .or_else(|| start.checked_add(FOREVER))
        .or_else(|| start.checked_add(Duration::from_secs(86_400)))
        .unwrap_or(start)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn huge_timeouts_saturate() {
        let now = Instant::now();
        assert!(deadline_after(now, Duration::MAX) > now + Duration::from_secs(86_400 * 365));
        assert_eq!(
            deadline_after(now, Duration::from_secs(3)),
            now + Duration::from_secs(3)
        );
    }
}
