//! Pipeline parallelism: a model cut into stages on different ranks, micro-batches flowing
//! through them.
//!
//! Three parts, each usable alone:
//!
//! * **Schedules as data** ([`Schedule`], [`Action`]): each rank's ordered list of compute
//!   actions (`F`, `B`, or `B` split into `I` and `W`); sends and receives are implied by which
//!   rank holds which stage. Generators: [`Schedule::gpipe`], [`Schedule::one_f_one_b`],
//!   [`Schedule::interleaved_1f1b`], [`Schedule::zero_bubble_h1`]; or write the lists by hand
//!   ([`Schedule::new`], [`Schedule::parse`]). Every constructor validates: completeness,
//!   local order and, by simulation, that the ranks' orders cannot deadlock.
//! * **The simulator** ([`Schedule::simulate`]): makespan, bubble fraction and peak in-flight
//!   activations for given stage times ([`StageCost`]).
//! * **The executor** ([`Pipeline`]): runs any schedule over a process group with the user's
//!   [`Stage`]s and a [`Loss`] on the last stage.
//!
//! Pipeline × data parallelism composes through a 2-D [`DeviceMesh`](dist_collective::DeviceMesh):
//! `DeviceMesh::new(&pg, &[("dp", d), ("pp", p)])`, the pipeline over `mesh.dim("pp")` (each
//! replica's own pipeline, fed its share of the batch), and one [`Ddp`](crate::Ddp) per local
//! stage over `mesh.dim("dp")` that averages the stage's accumulated gradients across its
//! replicas after each step (`tests/pipeline.rs` checks it against one process).
//!
//! With the `candle` feature, `split_blocks` cuts a model given as a list of blocks at
//! split points and `CandleStage` turns each piece into a [`Stage`] (candle's autograd does
//! the backward).
//!
//! ```
//! use dist_collective::testing::run_world;
//! use dist_parallel::pipeline::{Pipeline, Schedule, Stage, StageResult};
//!
//! /// y = w·x on one value per micro-batch.
//! struct Scale { w: f32, gw: f32, saved: Vec<f32> }
//! impl Stage for Scale {
//!     fn input_len(&self) -> usize { 1 }
//!     fn output_len(&self) -> usize { 1 }
//!     fn forward(&mut self, mb: usize, x: &[f32], y: &mut [f32]) -> StageResult {
//!         self.saved[mb] = x[0];
//!         y[0] = self.w * x[0];
//!         Ok(())
//!     }
//!     fn backward(&mut self, mb: usize, g: &[f32], gx: &mut [f32]) -> StageResult {
//!         self.gw += g[0] * self.saved[mb];
//!         gx[0] = self.w * g[0];
//!         Ok(())
//!     }
//! }
//!
//! let gw = run_world(2, |pg| {
//!     let schedule = Schedule::one_f_one_b(2, 4).unwrap();
//!     let stage = Scale { w: 2.0 + pg.rank() as f32, gw: 0.0, saved: vec![0.0; 4] };
//!     let mut pipe = Pipeline::new(pg, schedule, vec![stage]).unwrap();
//!     // Loss: the sum of the outputs (mean per micro-batch), so dL/dy = 1.
//!     let mut loss = |_mb: usize, y: &[f32], g: &mut [f32]| -> StageResult<f32> {
//!         g[0] = 1.0;
//!         Ok(y[0])
//!     };
//!     pipe.step(&[1.0, 2.0, 3.0, 4.0], &mut loss).unwrap();
//!     Ok(pipe.stages()[0].gw)
//! })
//! .unwrap();
//! // y = 3·(2·x): dL/dw0 = mean(3·x) = 7.5, dL/dw1 = mean(2·x) = 5.
//! assert_eq!(gw, vec![7.5, 5.0]);
//! ```

#[cfg(feature = "candle")]
mod candle;
mod exec;
mod schedule;
mod sim;

#[cfg(feature = "candle")]
pub use candle::{CandleBlock, CandleStage, split_blocks};
pub use exec::{Loss, PIPELINE_TAG_BASE, Pipeline, PipelineStep, Stage, StageError, StageResult};
pub use schedule::{Action, Schedule};
pub use sim::{SimReport, StageCost};
