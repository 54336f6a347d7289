//! The training library behind the `trainer` binary: configuration, data, optimisation, checkpoints.

pub mod bench;
pub mod checkpoint;
pub mod config;
pub mod data;
pub mod metrics;
pub mod optim;
pub mod plot;
pub mod scaler;
pub mod sched;
pub mod telemetry;
pub mod train;
