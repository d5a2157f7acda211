//! The command line.

use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;

/// `distrun`'s arguments (torchrun's names where torchrun has one).
#[derive(Clone, Debug, Parser)]
#[command(
    name = "distrun",
    version,
    about = "Start the ranks of a distributed job (torchrun's contract, for any program)",
    after_help = "Example: distrun --nproc-per-node 4 -- ./target/release/train --epochs 3"
)]
pub struct Args {
    /// Processes (ranks) to start on this node.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    pub nproc_per_node: u32,
    /// Number of nodes (hosts) in the job; each runs its own `distrun`.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    pub nnodes: u32,
    /// Rank of this node, 0 to `nnodes - 1`; node 0 serves the rendezvous store.
    #[arg(long, default_value_t = 0)]
    pub node_rank: u32,
    /// Address of node 0, as the other nodes (and the ranks) reach it.
    #[arg(long, default_value = "127.0.0.1")]
    pub master_addr: String,
    /// Port of the rendezvous store on node 0. 0 picks a free port, which node 0 prints
    /// (`store at ADDR:PORT`): with several nodes, only node 0 may be given 0, and the other
    /// nodes must be given the port it printed. The default is 0 on one node and 29500 on
    /// several.
    #[arg(long)]
    pub master_port: Option<u16>,
    /// Restart the whole job up to this many times after a rank fails.
    #[arg(long, default_value_t = 0)]
    pub max_restarts: u32,
    /// Also write each rank's output to `<log-dir>/attempt_<n>/rank_<r>/{stdout,stderr}.log`
    /// (with no `--log-dir`, a new directory under the system's temporary one).
    #[arg(long)]
    pub tee: bool,
    /// Directory for the per-rank logs; implies `--tee`.
    #[arg(long)]
    pub log_dir: Option<PathBuf>,
    /// Seconds between SIGTERM and SIGKILL when stopping ranks.
    #[arg(long, default_value = "5", value_parser = parse_secs)]
    pub grace_period: Duration,
    /// Seconds the nodes wait for each other before each attempt (several nodes only).
    #[arg(long, default_value = "600", value_parser = parse_secs)]
    pub rdzv_timeout: Duration,
    /// Lines of a failed rank's output shown in the failure summary.
    #[arg(long, default_value_t = 20)]
    pub tail_lines: usize,
    /// Job id, passed to the ranks as `TORCHELASTIC_RUN_ID`.
    #[arg(long, default_value = "none")]
    pub run_id: String,
    /// The program and its arguments (after `--`).
    #[arg(required = true, trailing_var_arg = true, allow_hyphen_values = true)]
    pub command: Vec<String>,
}

impl Args {
    /// Checks what clap cannot: the node rank fits, and only node 0 picks a free port.
    pub fn validate(&self) -> Result<(), String> {
        if self.node_rank >= self.nnodes {
            return Err(format!(
                "--node-rank {} is not below --nnodes {}",
                self.node_rank, self.nnodes
            ));
        }
        if self.node_rank > 0 && self.master_port == Some(0) {
            return Err(format!(
                "--master-port 0 (a free port) is for node 0 only: node {} must be given the port \
                 node 0 picked (node 0 prints it: `store at ADDR:PORT`)",
                self.node_rank
            ));
        }
        if self.nproc_per_node.checked_mul(self.nnodes).is_none() {
            return Err("--nproc-per-node × --nnodes is too large".to_owned());
        }
        Ok(())
    }
}

fn parse_secs(s: &str) -> Result<Duration, String> {
    let v: f64 = s
        .trim()
        .parse()
        .map_err(|_| format!("{s:?} is not a number of seconds"))?;
    Duration::try_from_secs_f64(v).map_err(|e| format!("{s:?}: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Args, clap::Error> {
        Args::try_parse_from(std::iter::once("distrun").chain(args.iter().copied()))
    }

    #[test]
    fn defaults_and_command() {
        let a = parse(&["--nproc-per-node", "4", "--", "sh", "-c", "echo $RANK"]).unwrap();
        assert_eq!(a.nproc_per_node, 4);
        assert_eq!((a.nnodes, a.node_rank, a.max_restarts), (1, 0, 0));
        assert_eq!(a.master_addr, "127.0.0.1");
        assert_eq!(a.master_port, None);
        assert_eq!(a.command, ["sh", "-c", "echo $RANK"]);
        assert_eq!(a.grace_period, Duration::from_secs(5));
        a.validate().unwrap();
        // The command's own flags are not ours.
        let a = parse(&["./train", "--nproc-per-node", "9"]).unwrap();
        assert_eq!(a.nproc_per_node, 1);
        assert_eq!(a.command, ["./train", "--nproc-per-node", "9"]);
    }

    #[test]
    fn bad_arguments() {
        assert!(parse(&["--nproc-per-node", "0", "--", "x"]).is_err());
        assert!(parse(&["--nproc-per-node", "2"]).is_err());
        assert!(parse(&["--grace-period", "-1", "--", "x"]).is_err());
        let a = parse(&["--nnodes", "2", "--node-rank", "2", "--", "x"]).unwrap();
        assert!(a.validate().unwrap_err().contains("--node-rank 2"));
        // Node 0 may pick a free port; the others must be told it.
        let a = parse(&["--nnodes", "2", "--master-port", "0", "--", "x"]).unwrap();
        a.validate().unwrap();
        let a = parse(&[
            "--nnodes",
            "2",
            "--node-rank",
            "1",
            "--master-port",
            "0",
            "--",
            "x",
        ])
        .unwrap();
        assert!(a.validate().unwrap_err().contains("node 0 only"));
    }
}
