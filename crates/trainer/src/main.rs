//! `trainer`: train, evaluate, inspect and benchmark ResNets from a TOML config.
fn main() -> anyhow::Result<()> {
    Ok(())
}
