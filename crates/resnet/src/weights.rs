//! torchvision-compatible weights: a state_dict saved as safetensors, with the same keys
//! (`conv1.weight`, `bn1.running_mean`, `layer3.4.conv2.weight`, `layer1.0.downsample.0.weight`, `fc.bias`, ...).

use crate::model::ResNet;
use crate::{ModelError, Result};
use candle_core::{Device, Tensor};
use std::collections::{BTreeMap, HashMap};
use std::path::Path;

/// What a load did besides setting tensors.
#[derive(Debug, Default, Clone)]
pub struct LoadReport {
    pub loaded: usize,
    /// Tensors kept at their initial value because the head was replaced.
    pub head_replaced: bool,
}

fn err(path: &Path, msg: impl Into<String>) -> ModelError {
    ModelError::Weights { path: path.display().to_string(), msg: msg.into() }
}

/// Reads every tensor of a safetensors file onto the CPU; a missing, truncated or foreign file is an error
/// naming the file.
pub fn read_safetensors(path: &Path) -> Result<HashMap<String, Tensor>> {
    if path.is_dir() {
        return Err(err(path, "is a folder, not a safetensors file"));
    }
    if !path.is_file() {
        return Err(err(path, "no such file"));
    }
    candle_core::safetensors::load(path, &Device::Cpu)
        .map_err(|e| err(path, format!("not a readable safetensors file ({e})")))
}

/// Loads a torchvision-format state_dict into `model`. Missing, unexpected and shape-mismatched tensors are all
/// listed in one error. With `new_head`, an `fc.*` whose shape differs (another number of classes) is skipped and
/// the head keeps its fresh initialisation.
pub fn load_into(model: &ResNet, path: &Path, new_head: bool) -> Result<LoadReport> {
    let tensors = read_safetensors(path)?;
    load_tensors(model, &tensors, new_head).map_err(|m| err(path, m))
}

/// As [`load_into`], from tensors in memory; the error is the message without the file name.
pub fn load_tensors(
    model: &ResNet,
    tensors: &HashMap<String, Tensor>,
    new_head: bool,
) -> std::result::Result<LoadReport, String> {
    let store = model.store();
    let entries = store.entries();
    let mut missing = Vec::new();
    let mut mismatched = Vec::new();
    let mut head_mismatch = false;
    for (name, e) in &entries {
        match tensors.get(name) {
            None if name.ends_with("num_batches_tracked") => {}
            None => missing.push(name.clone()),
            Some(t) if t.dims() != e.param.var().dims() => {
                if new_head && name.starts_with("fc.") {
                    head_mismatch = true;
                } else {
                    mismatched.push(format!("{name} (file {:?}, model {:?})", t.dims(), e.param.var().dims()));
                }
            }
            Some(t) => {
                if let Some(why) = unusable(name, t, e.param.var().dtype()) {
                    return Err(why);
                }
            }
        }
    }
    let known: std::collections::HashSet<&str> = entries.iter().map(|(n, _)| n.as_str()).collect();
    let mut unexpected: Vec<String> = tensors.keys().filter(|k| !known.contains(k.as_str())).cloned().collect();
    unexpected.sort();
    if !(missing.is_empty() && mismatched.is_empty() && unexpected.is_empty()) {
        let mut parts = Vec::new();
        let list = |v: &[String]| {
            if v.len() > 8 {
                format!("{}, ... ({} in all)", v[..8].join(", "), v.len())
            } else {
                v.join(", ")
            }
        };
        if !mismatched.is_empty() {
            let hint = if mismatched.iter().any(|m| m.starts_with("fc.")) && !new_head {
                " (a different number of classes needs a new head: start from these weights with model.init_from, which replaces an fc of another size)"
            } else {
                ""
            };
            parts.push(format!("shape mismatch: {}{hint}", list(&mismatched)));
        }
        if !missing.is_empty() {
            parts.push(format!("missing: {}", list(&missing)));
        }
        if !unexpected.is_empty() {
            let hint = if unexpected.iter().any(|k| k.starts_with("model.")) {
                " (a trainer checkpoint? its model's tensors are the ones named model.*)"
            } else {
                ""
            };
            parts.push(format!("unexpected: {}{hint}", list(&unexpected)));
        }
        return Err(format!("weights do not match {}: {}", model.config.arch.name(), parts.join("; ")));
    }
    let mut loaded = 0;
    for (name, e) in &entries {
        if let Some(t) = tensors.get(name) {
            if t.dims() != e.param.var().dims() {
                continue; // replaced head
            }
            store.set(name, t).map_err(|e| format!("{name}: {e}"))?;
            loaded += 1;
        }
    }
    Ok(LoadReport { loaded, head_replaced: head_mismatch })
}

/// Why a file's tensor cannot become the model's `name` (kept as `dtype`): floating point where the model keeps
/// floating point (a cast between float widths is fine: torchvision files may be FP16), an integer where it keeps
/// an integer (`num_batches_tracked`), finite values, and a running variance of no negative value.
fn unusable(name: &str, t: &Tensor, dtype: candle_core::DType) -> Option<String> {
    if t.dtype().is_float() != dtype.is_float() {
        let kind = if dtype.is_float() { "floating point" } else { "an integer" };
        return Some(format!("{name} is {:?} in the file, the model keeps it as {kind}", t.dtype()));
    }
    if !t.dtype().is_float() {
        return None;
    }
    let v = match t.to_dtype(candle_core::DType::F64).and_then(|t| t.flatten_all()?.to_vec1::<f64>()) {
        Ok(v) => v,
        Err(e) => return Some(format!("{name}: {e}")),
    };
    if let Some(x) = v.iter().find(|x| !x.is_finite()) {
        return Some(format!("{name} holds {x} (not a finite number)"));
    }
    if name.ends_with("running_var") {
        if let Some(x) = v.iter().find(|x| **x < 0.0) {
            return Some(format!("{name} holds {x} (a variance below zero)"));
        }
    }
    None
}

/// Saves every parameter and buffer under torchvision's names (FP32, running stats and counters included),
/// atomically: a temporary file in the same folder, then a rename.
pub fn save(model: &ResNet, path: &Path) -> Result<()> {
    let snap: BTreeMap<String, Tensor> = model.store().snapshot()?;
    save_tensors(&snap, path)
}

/// Writes tensors to a safetensors file atomically.
pub fn save_tensors(tensors: &BTreeMap<String, Tensor>, path: &Path) -> Result<()> {
    let tmp = path.with_extension("safetensors.tmp");
    let map: HashMap<String, Tensor> = tensors.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
    candle_core::safetensors::save(&map, &tmp).map_err(|e| err(&tmp, format!("cannot write ({e})")))?;
    std::fs::rename(&tmp, path).map_err(|e| err(path, format!("cannot rename from {} ({e})", tmp.display())))?;
    Ok(())
}
