//! `init_process_group` and what surrounds it, one file per job:
//!
//! * `options.rs`: [`InitMethod`] and [`InitOptions`], what a caller says about the job;
//! * `world.rs`: [`new_process_group`], which turns them into the group of every rank (where
//!   rank, world size and store come from, the store namespace of each init);
//! * `default.rs`: the default group (torch's `group.WORLD`): [`init_process_group`],
//!   [`default_group`], [`destroy_process_group`];
//! * `free.rs`: the torch-style free functions over the default group (`get_rank`,
//!   `all_reduce`, ...).
//!
//! Reading the launcher's environment (torchrun, Slurm, MPI) and the `env://`, `tcp://` and
//! `file://` URLs is `dist_backend::init`'s job.

mod default;
mod free;
mod options;
mod world;

pub(crate) use default::forget_default;
pub use default::{default_group, destroy_process_group, init_process_group, is_initialized};
pub use free::{
    all_gather_into, all_reduce, barrier, broadcast, get_backend, get_rank, get_world_size,
    new_group, recv, reduce_scatter_into, send,
};
pub use options::{InitMethod, InitOptions};
pub use world::new_process_group;
