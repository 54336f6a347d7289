//! metrics.jsonl: one JSON object per line (step, epoch, telemetry and eval records), appended as training runs.

use anyhow::{Context, Result};
use std::io::Write;
use std::path::{Path, PathBuf};

pub struct MetricsWriter {
    path: PathBuf,
    file: std::fs::File,
    lines: usize,
}

impl MetricsWriter {
    /// Opens for appending. `keep_lines`: on resume, lines beyond what the checkpoint saw are dropped first so the
    /// file reads as if the run had never stopped. `None` starts a new file.
    pub fn open(path: &Path, keep_lines: Option<usize>) -> Result<Self> {
        let lines = match keep_lines {
            None => {
                std::fs::write(path, "").with_context(|| format!("cannot create {}", path.display()))?;
                0
            }
            Some(n) => {
                let text = std::fs::read_to_string(path).unwrap_or_default();
                let kept: Vec<&str> = text.lines().take(n).collect();
                let mut s = kept.join("\n");
                if !s.is_empty() {
                    s.push('\n');
                }
                std::fs::write(path, s).with_context(|| format!("cannot rewrite {}", path.display()))?;
                kept.len()
            }
        };
        let file = std::fs::OpenOptions::new()
            .append(true)
            .open(path)
            .with_context(|| format!("cannot open {}", path.display()))?;
        Ok(Self { path: path.to_path_buf(), file, lines })
    }

    pub fn write(&mut self, record: &serde_json::Value) -> Result<()> {
        writeln!(self.file, "{record}").with_context(|| format!("cannot write {}", self.path.display()))?;
        self.lines += 1;
        Ok(())
    }

    pub fn lines(&self) -> usize {
        self.lines
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}
