//! The environment each rank starts with: torchrun's contract.

/// What every rank of this node must be told about the job.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Job {
    /// Ranks per node.
    pub nproc_per_node: u32,
    /// Nodes in the job.
    pub nnodes: u32,
    /// This node's rank.
    pub node_rank: u32,
    /// Host of the rendezvous store.
    pub master_addr: String,
    /// Port of the rendezvous store (the one actually bound, never 0).
    pub master_port: u16,
    /// `--max-restarts`.
    pub max_restarts: u32,
    /// `--run-id`.
    pub run_id: String,
}

impl Job {
    /// Number of ranks in the job.
    pub fn world_size(&self) -> u32 {
        self.nproc_per_node * self.nnodes
    }

    /// Global rank of local rank `local_rank` of this node.
    pub fn rank(&self, local_rank: u32) -> u32 {
        self.node_rank * self.nproc_per_node + local_rank
    }

    /// The variables local rank `local_rank` gets in attempt `restart` (0 for the first run),
    /// as torchrun sets them. `parent` reads the launcher's own environment, which the child
    /// inherits: `OMP_NUM_THREADS=1` is added only where it is not already set.
    pub fn child_env(
        &self,
        local_rank: u32,
        restart: u32,
        parent: impl Fn(&str) -> Option<String>,
    ) -> Vec<(&'static str, String)> {
        let rank = self.rank(local_rank).to_string();
        let world = self.world_size().to_string();
        let mut env = vec![
            ("RANK", rank.clone()),
            ("LOCAL_RANK", local_rank.to_string()),
            ("WORLD_SIZE", world.clone()),
            ("LOCAL_WORLD_SIZE", self.nproc_per_node.to_string()),
            ("GROUP_RANK", self.node_rank.to_string()),
            ("GROUP_WORLD_SIZE", self.nnodes.to_string()),
            ("ROLE_NAME", "default".to_owned()),
            ("ROLE_RANK", rank),
            ("ROLE_WORLD_SIZE", world),
            ("MASTER_ADDR", self.master_addr.clone()),
            ("MASTER_PORT", self.master_port.to_string()),
            ("TORCHELASTIC_RESTART_COUNT", restart.to_string()),
            ("DIST_RESTART_COUNT", restart.to_string()),
            ("TORCHELASTIC_MAX_RESTARTS", self.max_restarts.to_string()),
            ("TORCHELASTIC_RUN_ID", self.run_id.clone()),
            // The store is ours: rank 0 connects to it instead of starting one.
            ("TORCHELASTIC_USE_AGENT_STORE", "True".to_owned()),
        ];
        if parent("OMP_NUM_THREADS").is_none() {
            env.push(("OMP_NUM_THREADS", "1".to_owned()));
        }
        env
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job() -> Job {
        Job {
            nproc_per_node: 4,
            nnodes: 3,
            node_rank: 2,
            master_addr: "10.0.0.1".into(),
            master_port: 29500,
            max_restarts: 2,
            run_id: "none".into(),
        }
    }

    #[test]
    fn torchrun_contract() {
        let env = job().child_env(1, 1, |_| None);
        let get = |k: &str| env.iter().find(|(n, _)| *n == k).map(|(_, v)| v.as_str());
        assert_eq!(get("RANK"), Some("9"));
        assert_eq!(get("LOCAL_RANK"), Some("1"));
        assert_eq!(get("WORLD_SIZE"), Some("12"));
        assert_eq!(get("LOCAL_WORLD_SIZE"), Some("4"));
        assert_eq!(get("GROUP_RANK"), Some("2"));
        assert_eq!(get("ROLE_RANK"), Some("9"));
        assert_eq!(get("ROLE_WORLD_SIZE"), Some("12"));
        assert_eq!(get("MASTER_ADDR"), Some("10.0.0.1"));
        assert_eq!(get("MASTER_PORT"), Some("29500"));
        assert_eq!(get("TORCHELASTIC_RESTART_COUNT"), Some("1"));
        assert_eq!(get("DIST_RESTART_COUNT"), Some("1"));
        assert_eq!(get("TORCHELASTIC_MAX_RESTARTS"), Some("2"));
        assert_eq!(get("TORCHELASTIC_USE_AGENT_STORE"), Some("True"));
        assert_eq!(get("OMP_NUM_THREADS"), Some("1"));
        let env = job().child_env(0, 0, |k| (k == "OMP_NUM_THREADS").then(|| "8".into()));
        assert!(env.iter().all(|(k, _)| *k != "OMP_NUM_THREADS"));
    }
}
