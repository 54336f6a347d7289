//! metrics.jsonl: one JSON object per line (step, epoch, telemetry and eval records), appended as training runs.

use anyhow::{Context, Result};
use std::io::Write;
use std::path::{Path, PathBuf};

pub struct MetricsWriter {
    path: PathBuf,
    /// None: a data-parallel rank other than 0, which counts records but writes none.
    file: Option<std::fs::File>,
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
        Ok(Self { path: path.to_path_buf(), file: Some(file), lines })
    }

    /// A writer that counts records and writes none (data-parallel ranks other than 0: rank 0 writes the file).
    pub fn discard(path: &Path, keep_lines: Option<usize>) -> Self {
        Self { path: path.to_path_buf(), file: None, lines: keep_lines.unwrap_or(0) }
    }

    pub fn write(&mut self, record: &serde_json::Value) -> Result<()> {
        if let Some(f) = &mut self.file {
            writeln!(f, "{record}").with_context(|| format!("cannot write {}", self.path.display()))?;
        }
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
