//! The training library behind the `trainer` binary: configuration, data, optimisation, checkpoints.

pub mod config;
pub mod plot;
pub mod telemetry;
