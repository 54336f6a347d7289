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
pub mod spares;
pub mod telemetry;
pub mod train;

/// An error and its causes on one line, outermost first; backtraces that candle attaches to its errors are dropped.
pub fn one_line(e: &anyhow::Error) -> String {
    let mut parts: Vec<String> = Vec::new();
    for c in e.chain() {
        let s = c.to_string();
        // candle appends "\n   0: frame..." lines when it captured a backtrace.
        let cut = s.find("\n    0:").or_else(|| s.find("\n   0:")).unwrap_or(s.len());
        let s = s[..cut].split_whitespace().collect::<Vec<_>>().join(" ");
        // A cause that an outer message already quotes (an I/O error inside a library's error) is said once.
        if !s.is_empty() && !parts.iter().any(|p| p.contains(&s)) {
            parts.push(s);
        }
    }
    parts.join(": ")
}

#[cfg(test)]
mod tests {
    /// Each cause once: one that the outer message already quotes is left out.
    #[test]
    fn one_line_says_each_cause_once() {
        let io = std::io::Error::from_raw_os_error(13);
        #[derive(Debug, thiserror::Error)]
        #[error("I/O error: {0}")]
        struct Wrapped(#[source] std::io::Error);
        let e = anyhow::Error::new(Wrapped(io)).context("cannot write checkpoint x.tmp");
        assert_eq!(super::one_line(&e), "cannot write checkpoint x.tmp: I/O error: Permission denied (os error 13)");
        let e = anyhow::anyhow!("inner\nwith   a break").context("outer");
        assert_eq!(super::one_line(&e), "outer: inner with a break");
    }
}
