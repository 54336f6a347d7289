//! Per-device caches: the fatbin modules of the tensor-core kernels and their functions (loaded once per
//! device, with the dynamic shared memory opt-in), and device attributes read on every launch (SM count,
//! compute capability, name). The PTX modules of the other kernels go through candle's own cache
//! (`CudaDevice::get_or_load_custom_func`).

use super::ptx;
use candle_core::cuda_backend::cudarc::driver::sys::{CUdevice_attribute, CUfunction_attribute};
use candle_core::cuda_backend::cudarc::driver::{CudaFunction, CudaModule};
use candle_core::cuda_backend::cudarc::nvrtc::Ptx;
use candle_core::cuda_backend::{CudaDevice, WrapErr};
use candle_core::Result;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

/// A process-wide cache keyed by device.
struct PerDevice<V>(OnceLock<Mutex<HashMap<usize, V>>>);

impl<V: Clone> PerDevice<V> {
    const fn new() -> Self {
        Self(OnceLock::new())
    }
    fn get_or(&self, dev: &CudaDevice, init: impl FnOnce() -> Result<V>) -> Result<V> {
        let key = dev_key(dev);
        let map = self.0.get_or_init(Default::default);
        if let Some(v) = map.lock().unwrap_or_else(|e| e.into_inner()).get(&key) {
            return Ok(v.clone());
        }
        let v = init()?;
        map.lock().unwrap_or_else(|e| e.into_inner()).insert(key, v.clone());
        Ok(v)
    }
}

/// Identity of a device (its context) for the caches.
pub(crate) fn dev_key(dev: &CudaDevice) -> usize {
    Arc::as_ptr(dev.cuda_stream().context()) as usize
}

/// The fatbin of a tensor-core module (`conv/05_tma_wgmma`, ...), from the table build.rs generates.
fn fatbin(module: &str) -> Result<&'static [u8]> {
    ptx::FATBINS
        .iter()
        .find(|(m, _)| *m == module)
        .map(|(_, img)| *img)
        .ok_or_else(|| candle_core::Error::Msg(format!("kernel module {module} is not built into this binary")))
}

type FuncKey = (usize, &'static str, String);
/// Loaded fatbin modules by (device, module name).
type ModuleCache = HashMap<(usize, &'static str), Arc<CudaModule>>;

/// Loads (once per device) function `name` of the fatbin module `module`; opts in to `smem` bytes of dynamic
/// shared memory when that is above the 48 KiB default.
pub fn function(dev: &CudaDevice, module: &'static str, name: &str, smem: u32) -> Result<CudaFunction> {
    static MODULES: OnceLock<Mutex<ModuleCache>> = OnceLock::new();
    static FUNCS: OnceLock<Mutex<HashMap<FuncKey, CudaFunction>>> = OnceLock::new();
    let key = (dev_key(dev), module, name.to_string());
    let funcs = FUNCS.get_or_init(Default::default);
    if let Some(f) = funcs.lock().unwrap_or_else(|e| e.into_inner()).get(&key) {
        return Ok(f.clone());
    }
    let md = {
        let mut mods = MODULES.get_or_init(Default::default).lock().unwrap_or_else(|e| e.into_inner());
        match mods.get(&(key.0, module)) {
            Some(m) => m.clone(),
            None => {
                let img = fatbin(module)?;
                let m = dev.cuda_stream().context().load_module(Ptx::from_binary(img.to_vec())).w()?;
                mods.insert((key.0, module), m.clone());
                m
            }
        }
    };
    let f = md.load_function(name).w()?;
    if smem > 48 * 1024 {
        f.set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem as i32).w()?;
    }
    funcs.lock().unwrap_or_else(|e| e.into_inner()).insert(key, f.clone());
    Ok(f)
}

/// Number of SMs of the device.
pub fn sm_count(dev: &CudaDevice) -> Result<usize> {
    static C: PerDevice<usize> = PerDevice::new();
    C.get_or(dev, || {
        let ctx = dev.cuda_stream().context().clone();
        Ok(ctx.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT).w()? as usize)
    })
}

/// Whether the device runs sm_90a code (wgmma, TMA): compute capability 9.0 exactly.
pub fn has_wgmma(dev: &CudaDevice) -> bool {
    static C: PerDevice<bool> = PerDevice::new();
    C.get_or(dev, || {
        let ctx = dev.cuda_stream().context().clone();
        let major = ctx.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR);
        let minor = ctx.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR);
        Ok(matches!((major, minor), (Ok(9), Ok(0))))
    })
    .unwrap_or(false)
}

/// The device's name (the autotune key is built on every launch), tabs replaced.
pub fn gpu_name(dev: &CudaDevice) -> String {
    static C: PerDevice<String> = PerDevice::new();
    C.get_or(dev, || Ok(dev.cuda_stream().context().name().unwrap_or_else(|_| "unknown GPU".into()).replace('\t', " ")))
        .unwrap_or_else(|_| "unknown GPU".into())
}

/// The tiles the autotuner may try on `dev` (all on compute capability 9.0, else the portable ones).
pub fn tiles_for(dev: &CudaDevice) -> &'static [crate::variants::Tile] {
    crate::variants::tiles_for_arch(has_wgmma(dev))
}
