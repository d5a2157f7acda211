//! Which CPUs each local rank may run on.
//!
//! When this node's ranks are no more than the CPUs `distrun` may use, each rank gets its own
//! contiguous share of them (Open MPI binds to cores by default in the same case). Ranks that
//! wait for each other by spinning, as dist-gloo's shared-memory transport does for a couple of
//! microseconds, then never wait for a peer that the scheduler put on their own core while
//! another core ran something else. Shares are made of whole physical cores, in order of socket
//! and core, where the ranks are no more than the cores: the kernel numbers a core's hardware
//! threads apart (CPUs 0 and 48 are one core of a 2 × 24-core host), so shares of CPU numbers
//! would put two ranks on the same cores and a rank on both sockets. With more ranks than CPUs nothing is bound (as Open MPI
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
    let cpus = parse_list(list.trim())?;
    let cores = cores_of(&cpus, |cpu, what| {
        let path = format!("/sys/devices/system/cpu/cpu{cpu}/topology/{what}");
        std::fs::read_to_string(path).ok()?.trim().parse().ok()
    });
    split_cores(&cores, nproc).or_else(|| split(&cores.concat(), nproc))
}

/// `cpus` grouped by physical core, the cores in order of (socket, core id), each core's CPUs
/// in number order. `read(cpu, "physical_package_id" | "core_id")` reads the topology; a CPU
/// it knows nothing of is a core of its own.
fn cores_of(cpus: &[usize], read: impl Fn(usize, &str) -> Option<usize>) -> Vec<Vec<usize>> {
    let mut keyed: Vec<((usize, usize, usize), usize)> = cpus
        .iter()
        .map(|&cpu| {
            let key = match (read(cpu, "physical_package_id"), read(cpu, "core_id")) {
                (Some(package), Some(core)) => (package, core, 0),
                // Unknown: its own core, after every known one.
                _ => (usize::MAX, usize::MAX, cpu),
            };
            (key, cpu)
        })
        .collect();
    keyed.sort_unstable();
    keyed
        .chunk_by(|a, b| a.0 == b.0)
        .map(|core| core.iter().map(|&(_, cpu)| cpu).collect())
        .collect()
}

/// Whole `cores` cut into `nproc` contiguous shares, as [`split`] cuts CPUs; `None` where
/// there are fewer cores than ranks.
fn split_cores(cores: &[Vec<usize>], nproc: usize) -> Option<Vec<Vec<usize>>> {
    let shares = split(&(0..cores.len()).collect::<Vec<_>>(), nproc)?;
    Some(
        shares
            .into_iter()
            .map(|share| {
                share
                    .iter()
                    .flat_map(|&c| cores[c].iter().copied())
                    .collect()
            })
            .collect(),
    )
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

/// `cpus` cut into `nproc` contiguous shares (the last ones one CPU larger when it does not
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

    /// A 2 × 24-core host with two hardware threads per core, numbered as Linux does: CPU c
    /// and c + 48 are one core, CPUs 0-23 and 48-71 the first socket.
    fn two_sockets(cpu: usize, what: &str) -> Option<usize> {
        let thread0 = cpu % 48;
        match what {
            "physical_package_id" => Some(thread0 / 24),
            "core_id" => Some(thread0 % 24),
            _ => None,
        }
    }

    #[test]
    fn shares_are_whole_cores_of_one_socket() {
        let cpus: Vec<usize> = (0..96).collect();
        let cores = cores_of(&cpus, two_sockets);
        assert_eq!(cores.len(), 48);
        assert_eq!(cores[0], vec![0, 48]);
        assert_eq!(cores[24], vec![24, 72]);
        let shares = split_cores(&cores, 8).unwrap();
        let core = |cpu: usize| cpu % 48;
        for (r, share) in shares.iter().enumerate() {
            assert_eq!(share.len(), 12, "rank {r}: {share:?}");
            let socket = share[0] % 48 / 24;
            assert!(
                share.iter().all(|&c| c % 48 / 24 == socket),
                "rank {r} spans sockets"
            );
            for (q, other) in shares.iter().enumerate().filter(|&(q, _)| q != r) {
                assert!(
                    share
                        .iter()
                        .all(|&a| other.iter().all(|&b| core(a) != core(b))),
                    "ranks {r} and {q} share a core"
                );
            }
        }
        // Five ranks: whole cores still, some shares a core larger.
        let five = split_cores(&cores, 5).unwrap();
        assert_eq!(
            five.iter().map(Vec::len).collect::<Vec<_>>(),
            [18, 20, 18, 20, 20]
        );
        // More ranks than cores: no share of whole cores.
        assert_eq!(split_cores(&cores, 49), None);
        // Without topology every CPU is a core, in number order: the plain split.
        let flat = cores_of(&[0, 1, 2, 3], |_, _| None);
        assert_eq!(flat, vec![vec![0], vec![1], vec![2], vec![3]]);
    }
}
