//! Which CPUs each local rank may run on.
//!
//! When this node's ranks are no more than the CPUs `distrun` may use, each rank gets its own
//! contiguous share of them (Open MPI binds to cores by default in the same case). Ranks that
//! wait for each other by spinning, as dist-gloo's shared-memory transport does for a couple of
//! microseconds, then never wait for a peer that the scheduler put on their own core while
//! another core ran something else. With more ranks than CPUs nothing is bound (as Open MPI
//! does when oversubscribed), and `DIST_RUN_BIND=none` turns binding off.

/// The CPUs of each local rank, in local-rank order; `None` leaves the ranks unbound.
pub(crate) fn plan(nproc: usize) -> Option<Vec<Vec<usize>>> {
    if std::env::var("DIST_RUN_BIND").is_ok_and(|v| v == "none") {
        return None;
    }
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let list = status
        .lines()
        .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))?;
    split(&parse_list(list.trim())?, nproc)
}

/// A kernel CPU list ("0-3,8,10-11") as CPU numbers.
fn parse_list(list: &str) -> Option<Vec<usize>> {
    let mut cpus = Vec::new();
    for part in list.split(',').filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => cpus.extend(a.parse::<usize>().ok()?..=b.parse().ok()?),
            None => cpus.push(part.parse().ok()?),
        }
    }
    Some(cpus)
}

/// `cpus` cut into `nproc` contiguous shares (the first ones one CPU larger when it does not
/// divide); `None` when there are fewer CPUs than ranks, or a single rank (nothing to share).
fn split(cpus: &[usize], nproc: usize) -> Option<Vec<Vec<usize>>> {
    if nproc < 2 || cpus.len() < nproc {
        return None;
    }
    Some(
        (0..nproc)
            .map(|i| cpus[i * cpus.len() / nproc..(i + 1) * cpus.len() / nproc].to_vec())
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lists_parse_and_split_into_contiguous_shares() {
        assert_eq!(parse_list("0-3,8,10-11"), Some(vec![0, 1, 2, 3, 8, 10, 11]));
        assert_eq!(parse_list("x"), None);
        let cpus: Vec<usize> = (0..7).collect();
        assert_eq!(
            split(&cpus, 3),
            Some(vec![vec![0, 1], vec![2, 3], vec![4, 5, 6]])
        );
        assert_eq!(split(&[0, 1], 2), Some(vec![vec![0], vec![1]]));
        assert_eq!(split(&[0, 1], 4), None, "oversubscribed: unbound");
        assert_eq!(split(&[0, 1], 1), None);
    }
}
