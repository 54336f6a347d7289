//! The training library behind the `trainer` binary: configuration, data, optimisation, checkpoints.

pub mod config;
pub mod data;
