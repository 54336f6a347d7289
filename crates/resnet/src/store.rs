//! Named parameters and buffers of a model, keyed by torchvision's state_dict names.

use candle_core::{DType, Device, Tensor, Var};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

thread_local! {
    static NO_GRAD: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs `f` with every parameter detached: no autograd graph is built, so activations are freed as soon as
/// they are used (evaluation, benchmarks of the forward pass).
pub fn no_grad<T>(f: impl FnOnce() -> T) -> T {
    let prev = NO_GRAD.with(|c| c.replace(true));
    let out = f();
    NO_GRAD.with(|c| c.set(prev));
    out
}

/// Whether an entry is trained (parameter) or tracked (buffer: running statistics, counters).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ParamKind {
    Param,
    Buffer,
}

/// A handle to one stored tensor. Cloning shares the storage and the frozen flag.
#[derive(Clone, Debug)]
pub struct Param {
    var: Var,
    frozen: Arc<AtomicBool>,
}

impl Param {
    /// The tensor to use in a forward pass: tracked for gradients unless frozen or inside [`no_grad`].
    pub fn tensor(&self) -> Tensor {
        if self.frozen.load(Ordering::Relaxed) || NO_GRAD.with(|f| f.get()) {
            self.var.as_tensor().detach()
        } else {
            self.var.as_tensor().clone()
        }
    }
    pub fn var(&self) -> &Var {
        &self.var
    }
    pub fn is_frozen(&self) -> bool {
        self.frozen.load(Ordering::Relaxed)
    }
}

#[derive(Clone, Debug)]
pub struct Entry {
    pub param: Param,
    pub kind: ParamKind,
}

/// All tensors of a model by name (sorted), shared between the layers and the optimizer/IO code.
#[derive(Clone, Debug)]
pub struct ParamStore {
    entries: Arc<Mutex<BTreeMap<String, Entry>>>,
    device: Device,
}

impl ParamStore {
    pub fn new(device: &Device) -> Self {
        Self { entries: Arc::new(Mutex::new(BTreeMap::new())), device: device.clone() }
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Registers a tensor under `name` (which must be new) and returns its handle.
    pub fn insert(&self, name: &str, value: Tensor, kind: ParamKind) -> candle_core::Result<Param> {
        let var = Var::from_tensor(&value)?;
        let param = Param { var, frozen: Arc::new(AtomicBool::new(kind == ParamKind::Buffer)) };
        let mut e = self.entries.lock().expect("param store lock");
        if e.contains_key(name) {
            candle_core::bail!("duplicate parameter name {name}");
        }
        e.insert(name.to_string(), Entry { param: param.clone(), kind });
        Ok(param)
    }

    pub fn get(&self, name: &str) -> Option<Entry> {
        self.entries.lock().expect("param store lock").get(name).cloned()
    }

    /// Every entry, sorted by name.
    pub fn entries(&self) -> Vec<(String, Entry)> {
        self.entries.lock().expect("param store lock").iter().map(|(k, v)| (k.clone(), v.clone())).collect()
    }

    /// Trainable (not frozen) parameters, sorted by name.
    pub fn trainable(&self) -> Vec<(String, Var)> {
        self.entries()
            .into_iter()
            .filter(|(_, e)| e.kind == ParamKind::Param && !e.param.is_frozen())
            .map(|(n, e)| (n, e.param.var.clone()))
            .collect()
    }

    /// Number of parameter elements (buffers excluded), as torchvision counts them.
    pub fn num_parameters(&self) -> usize {
        self.entries().iter().filter(|(_, e)| e.kind == ParamKind::Param).map(|(_, e)| e.param.var.elem_count()).sum()
    }

    /// Freezes every parameter whose name equals a prefix or starts with `prefix.`; returns how many were frozen.
    pub fn freeze_prefixes(&self, prefixes: &[String]) -> usize {
        let mut n = 0;
        for (name, e) in self.entries() {
            if e.kind == ParamKind::Param && prefixes.iter().any(|p| name == *p || name.starts_with(&format!("{p}."))) {
                e.param.frozen.store(true, Ordering::Relaxed);
                n += 1;
            }
        }
        n
    }

    /// Sets the value of an entry in place (shape and dtype must match; the value is cast to the stored dtype).
    pub fn set(&self, name: &str, value: &Tensor) -> candle_core::Result<()> {
        let e = self.get(name).ok_or_else(|| candle_core::Error::Msg(format!("no tensor named {name}")))?;
        let target = e.param.var.as_tensor();
        if value.dims() != target.dims() {
            candle_core::bail!("{name}: shape {:?} does not match the model's {:?}", value.dims(), target.dims());
        }
        let v = value.to_dtype(target.dtype())?.to_device(&self.device)?;
        e.param.var.set(&v)
    }

    /// A snapshot of every tensor (detached copies), e.g. for saving.
    pub fn snapshot(&self) -> candle_core::Result<BTreeMap<String, Tensor>> {
        // `force_contiguous`: a storage of the tensor's own size (`copy` clones a view's whole storage).
        self.entries().into_iter().map(|(n, e)| Ok((n, e.param.var.as_tensor().force_contiguous()?.detach()))).collect()
    }

    pub fn dtype_of(&self, name: &str) -> Option<DType> {
        self.get(name).map(|e| e.param.var.dtype())
    }
}
