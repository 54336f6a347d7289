//! The training library behind the `trainer` binary: configuration, data, optimisation, checkpoints.

pub mod bench;
pub mod checkpoint;
pub mod config;
pub mod data;
pub mod databench;
pub mod dist;
#[cfg(feature = "cuda")]
pub mod feed;
pub mod graphs;
pub mod metrics;
pub mod optim;
pub mod plot;
pub mod scaler;
pub mod sched;
pub mod telemetry;
pub mod train;

/// An error and its causes on one line, outermost first; backtraces that candle attaches to its errors are dropped.
pub fn one_line(e: &anyhow::Error) -> String {
    e.chain()
        .map(|c| {
            let s = c.to_string();
            // candle appends "\n   0: frame..." lines when it captured a backtrace.
            let cut = s.find("\n    0:").or_else(|| s.find("\n   0:")).unwrap_or(s.len());
            s[..cut].split_whitespace().collect::<Vec<_>>().join(" ")
        })
        .collect::<Vec<_>>()
        .join(": ")
}
