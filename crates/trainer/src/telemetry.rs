//! GPU telemetry through NVML: a sampler thread, threshold monitors (ECC, power swings) and a progress-bar summary.
//!
//! NVML (`libnvidia-ml.so.1`) is loaded at run time, so this builds and runs on machines without a GPU:
//! [`Telemetry::start`] then prints one warning line and returns `None`; training goes on without telemetry.
//! Every NVML query that fails yields `None` for its field, never a panic. The threshold logic lives in
//! [`Monitor`], a pure function of the samples fed to it, so it is tested without a GPU.

use nvml_wrapper::enum_wrappers::device::{Clock, EccCounter, MemoryError, TemperatureSensor};
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::sys_exports::field_id::{
    NVML_FI_DEV_NVLINK_LINK_COUNT, NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX, NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX,
};
use nvml_wrapper::{Device, Nvml};
use serde::Serialize;
use std::collections::VecDeque;
use std::sync::mpsc::{self, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

const GIB: f64 = (1u64 << 30) as f64;
/// NVML reports at most this many NVLinks per GPU (NVML_NVLINK_MAX_LINKS).
const MAX_NVLINKS: u32 = 18;
/// Events kept for a caller that never drains them; older ones are dropped first.
const MAX_PENDING_EVENTS: usize = 256;
/// The sampler never polls faster than this, whatever the configured interval.
const MIN_INTERVAL: Duration = Duration::from_millis(50);

/// One reading of the GPU. Fields NVML could not provide (unsupported, permission, error) are `None`.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Sample {
    /// Seconds since the sampler started.
    pub t_s: f64,
    pub sm_util_pct: Option<u32>,
    pub mem_used_gib: Option<f64>,
    pub mem_total_gib: Option<f64>,
    pub power_w: Option<f64>,
    pub sm_clock_mhz: Option<u32>,
    pub temp_c: Option<u32>,
    /// Volatile (since driver load) corrected ECC errors, whole device.
    pub ecc_corrected: Option<u64>,
    /// Volatile (since driver load) uncorrectable ECC errors, whole device.
    pub ecc_uncorrected: Option<u64>,
    /// NVLink data received, all links, averaged since the previous sample; `None` without active links.
    pub nvlink_rx_mib_s: Option<f64>,
    /// NVLink data sent, all links, averaged since the previous sample; `None` without active links.
    pub nvlink_tx_mib_s: Option<f64>,
}

/// Something the training loop should act on.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// Worth a log line; training goes on.
    Warning(String),
    /// The GPU can no longer be trusted: the caller saves a checkpoint and stops.
    Fatal(String),
}

/// Limits applied by [`Monitor`]. `Default` holds the values used in training.
#[derive(Debug, Clone, PartialEq)]
pub struct Thresholds {
    /// Corrected ECC errors per day (extrapolated from the increase since start) above which to warn.
    pub ecc_corrected_per_day: f64,
    /// The corrected-ECC rate is judged only after this long, or once the count grew by more than
    /// `ecc_corrected_per_day` (whichever comes first).
    pub ecc_min_window_s: f64,
    /// Number of power readings in the sliding window.
    pub power_window: usize,
    /// Largest allowed deviation of a reading from the window mean, as a fraction of the mean.
    pub power_swing_frac: f64,
    /// Power swings are ignored while the window mean is at or below this (idle GPU).
    pub power_min_mean_w: f64,
    /// A repeated warning of the same kind is raised at most once per this many seconds.
    pub warn_every_s: f64,
}

impl Default for Thresholds {
    fn default() -> Self {
        Self {
            ecc_corrected_per_day: 100.0,
            ecc_min_window_s: 60.0,
            power_window: 30,
            power_swing_frac: 0.05,
            power_min_mean_w: 50.0,
            warn_every_s: 60.0,
        }
    }
}

/// Turns a stream of [`Sample`]s into [`Event`]s. Pure: time is the samples' `t_s`, nothing else is read.
#[derive(Debug, Clone)]
pub struct Monitor {
    th: Thresholds,
    /// (t_s, count) of the first corrected-ECC reading.
    ecc_c_start: Option<(f64, u64)>,
    /// Highest uncorrectable-ECC count seen so far (the first reading is the baseline).
    ecc_u_seen: Option<u64>,
    /// (power W, SM clock MHz) of the last `power_window` samples that had a power reading.
    power: VecDeque<(f64, Option<u32>)>,
    last_ecc_c_warn: Option<f64>,
    last_power_warn: Option<f64>,
}

impl Monitor {
    pub fn new(th: Thresholds) -> Self {
        Self {
            power: VecDeque::with_capacity(th.power_window.max(1)),
            th,
            ecc_c_start: None,
            ecc_u_seen: None,
            last_ecc_c_warn: None,
            last_power_warn: None,
        }
    }

    /// Feeds one sample; returns the events it raises (usually none).
    pub fn observe(&mut self, s: &Sample) -> Vec<Event> {
        let mut events = Vec::new();
        self.check_ecc_uncorrected(s, &mut events);
        self.check_ecc_corrected(s, &mut events);
        self.check_power(s, &mut events);
        events
    }

    fn check_ecc_uncorrected(&mut self, s: &Sample, events: &mut Vec<Event>) {
        let Some(now) = s.ecc_uncorrected else { return };
        match self.ecc_u_seen {
            None => {
                if now > 0 {
                    events.push(Event::Warning(format!(
                        "GPU already has {now} uncorrectable ECC error(s) since the driver loaded; \
                         any further one stops training"
                    )));
                }
                self.ecc_u_seen = Some(now);
            }
            Some(seen) if now > seen => {
                events.push(Event::Fatal(format!(
                    "uncorrectable ECC errors rose from {seen} to {now} at t={:.0}s: GPU memory can no longer be trusted",
                    s.t_s
                )));
                self.ecc_u_seen = Some(now);
            }
            Some(_) => {}
        }
    }

    fn check_ecc_corrected(&mut self, s: &Sample, events: &mut Vec<Event>) {
        let Some(now) = s.ecc_corrected else { return };
        let (t0, c0) = *self.ecc_c_start.get_or_insert((s.t_s, now));
        let increase = now.saturating_sub(c0) as f64;
        let elapsed = s.t_s - t0;
        if elapsed < self.th.ecc_min_window_s && increase <= self.th.ecc_corrected_per_day {
            return;
        }
        if increase == 0.0 {
            return;
        }
        let per_day = increase / elapsed.max(1e-3) * 86_400.0;
        if per_day > self.th.ecc_corrected_per_day && rate_ok(&mut self.last_ecc_c_warn, s.t_s, self.th.warn_every_s) {
            events.push(Event::Warning(format!(
                "{increase:.0} corrected ECC error(s) in {elapsed:.0}s (~{per_day:.0}/day, limit {:.0}/day): \
                 GPU memory may be degrading",
                self.th.ecc_corrected_per_day
            )));
        }
    }

    fn check_power(&mut self, s: &Sample, events: &mut Vec<Event>) {
        let Some(p) = s.power_w else { return };
        let n = self.th.power_window.max(2);
        if self.power.len() == n {
            self.power.pop_front();
        }
        self.power.push_back((p, s.sm_clock_mhz));
        if self.power.len() < n {
            return;
        }
        let mean = self.power.iter().map(|(p, _)| p).sum::<f64>() / n as f64;
        if mean <= self.th.power_min_mean_w {
            return;
        }
        let (lo, hi) = self.power.iter().fold((f64::MAX, f64::MIN), |(lo, hi), (p, _)| (lo.min(*p), hi.max(*p)));
        let swing = (hi - mean).max(mean - lo) / mean;
        if swing <= self.th.power_swing_frac || !rate_ok(&mut self.last_power_warn, s.t_s, self.th.warn_every_s) {
            return;
        }
        let clocks: Vec<u32> = self.power.iter().filter_map(|(_, c)| *c).collect();
        let clock_note = match (clocks.iter().min(), clocks.iter().max()) {
            (Some(cmin), Some(cmax)) => format!("; SM clock {cmin}-{cmax} MHz"),
            _ => String::new(),
        };
        events.push(Event::Warning(format!(
            "power swings ±{:.1}% around {mean:.0} W over the last {n} samples ({lo:.0}-{hi:.0} W, limit ±{:.0}%){clock_note}: \
             the GPU is hitting its power limit and SM clocks drop as a result",
            swing * 100.0,
            self.th.power_swing_frac * 100.0
        )));
    }
}

impl Default for Monitor {
    fn default() -> Self {
        Self::new(Thresholds::default())
    }
}

/// True (and records `t`) when no warning of this kind was raised in the last `every_s` seconds.
fn rate_ok(last: &mut Option<f64>, t: f64, every_s: f64) -> bool {
    match *last {
        Some(prev) if t - prev < every_s => false,
        _ => {
            *last = Some(t);
            true
        }
    }
}

/// Which NVML device a CUDA ordinal is, honouring `CUDA_VISIBLE_DEVICES` (numbers or `GPU-` UUIDs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NvmlTarget {
    Index(u32),
    Uuid(String),
}

/// Maps CUDA ordinal `ordinal` to the NVML device, given the value of `CUDA_VISIBLE_DEVICES` (if set).
/// Assumes CUDA and NVML enumerate in the same (PCI bus) order, as they do on nodes of identical GPUs.
pub fn nvml_target(ordinal: u32, cuda_visible_devices: Option<&str>) -> Result<NvmlTarget, String> {
    let Some(list) = cuda_visible_devices.map(str::trim).filter(|v| !v.is_empty()) else {
        return Ok(NvmlTarget::Index(ordinal));
    };
    let entry = list
        .split(',')
        .map(str::trim)
        .nth(ordinal as usize)
        .ok_or_else(|| format!("CUDA device {ordinal} is not in CUDA_VISIBLE_DEVICES={list:?}"))?;
    if let Ok(i) = entry.parse::<u32>() {
        Ok(NvmlTarget::Index(i))
    } else if entry.starts_with("GPU-") {
        Ok(NvmlTarget::Uuid(entry.to_string()))
    } else {
        Err(format!("cannot map CUDA_VISIBLE_DEVICES entry {entry:?} (device {ordinal}) to an NVML device"))
    }
}

/// Short text for a progress bar, e.g. "sm 97% 61.2GiB 652W 1980MHz 54C"; missing fields are left out.
pub fn summarize(s: &Sample) -> String {
    let mut parts = Vec::new();
    if let Some(u) = s.sm_util_pct {
        parts.push(format!("sm {u}%"));
    }
    if let Some(m) = s.mem_used_gib {
        parts.push(format!("{m:.1}GiB"));
    }
    if let Some(p) = s.power_w {
        parts.push(format!("{p:.0}W"));
    }
    if let Some(c) = s.sm_clock_mhz {
        parts.push(format!("{c}MHz"));
    }
    if let Some(t) = s.temp_c {
        parts.push(format!("{t}C"));
    }
    if let (Some(rx), Some(tx)) = (s.nvlink_rx_mib_s, s.nvlink_tx_mib_s) {
        parts.push(format!("nvl {:.1}/{:.1}GiB/s", rx / 1024.0, tx / 1024.0));
    }
    parts.join(" ")
}

#[derive(Default)]
struct Shared {
    latest: Option<Sample>,
    events: Vec<Event>,
}

/// A running sampler of one GPU. Dropping it stops and joins the thread.
pub struct Telemetry {
    shared: Arc<Mutex<Shared>>,
    stop: Option<Sender<()>>,
    thread: Option<JoinHandle<()>>,
    device_name: String,
}

impl Telemetry {
    /// Starts a sampler thread for CUDA device `ordinal`, sampling every `interval`. Returns `None`, after printing
    /// one warning line naming the reason, when NVML or the device is unavailable: telemetry never fails training.
    pub fn start(ordinal: u32, interval: Duration) -> Option<Telemetry> {
        match Self::try_start(ordinal, interval) {
            Ok(t) => Some(t),
            Err(why) => {
                eprintln!("warning: GPU telemetry unavailable for device {ordinal}: {}", one_line(&why));
                None
            }
        }
    }

    fn try_start(ordinal: u32, interval: Duration) -> Result<Telemetry, String> {
        let target = nvml_target(ordinal, std::env::var("CUDA_VISIBLE_DEVICES").ok().as_deref())?;
        let nvml = Nvml::init().map_err(|e| format!("NVML could not be loaded ({e})"))?;
        let device_name = {
            let device = open(&nvml, &target)?;
            device.name().unwrap_or_else(|_| format!("GPU {ordinal}"))
        };
        let shared = Arc::new(Mutex::new(Shared::default()));
        let (stop, stopped) = mpsc::channel::<()>();
        let interval = interval.max(MIN_INTERVAL);
        let thread = std::thread::Builder::new()
            .name(format!("telemetry-gpu{ordinal}"))
            .spawn({
                let shared = Arc::clone(&shared);
                move || run_sampler(nvml, target, interval, shared, stopped)
            })
            .map_err(|e| format!("cannot spawn the sampler thread ({e})"))?;
        Ok(Telemetry { shared, stop: Some(stop), thread: Some(thread), device_name })
    }

    /// The device's name as NVML reports it, e.g. "NVIDIA H200".
    pub fn device_name(&self) -> &str {
        &self.device_name
    }

    /// The most recent sample, if one was taken yet.
    pub fn latest(&self) -> Option<Sample> {
        self.shared.lock().ok().and_then(|s| s.latest.clone())
    }

    /// Drains the events raised since the last call.
    pub fn events(&self) -> Vec<Event> {
        self.shared.lock().map(|mut s| std::mem::take(&mut s.events)).unwrap_or_default()
    }

    /// Short text for a progress bar, e.g. "sm 97% 61.2GiB 652W 1980MHz 54C"; empty before the first sample.
    pub fn summary(&self) -> String {
        self.latest().map(|s| summarize(&s)).unwrap_or_default()
    }
}

impl Drop for Telemetry {
    fn drop(&mut self) {
        // Dropping the sender wakes the sampler out of its wait at once.
        drop(self.stop.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn open<'n>(nvml: &'n Nvml, target: &NvmlTarget) -> Result<Device<'n>, String> {
    match target {
        NvmlTarget::Index(i) => nvml.device_by_index(*i).map_err(|e| format!("NVML device {i}: {e}")),
        NvmlTarget::Uuid(u) => nvml.device_by_uuid(u.as_str()).map_err(|e| format!("NVML device {u}: {e}")),
    }
}

fn one_line(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

fn run_sampler(
    nvml: Nvml,
    target: NvmlTarget,
    interval: Duration,
    shared: Arc<Mutex<Shared>>,
    stopped: mpsc::Receiver<()>,
) {
    let push = |events: Vec<Event>, sample: Option<Sample>| {
        if let Ok(mut sh) = shared.lock() {
            sh.events.extend(events);
            let excess = sh.events.len().saturating_sub(MAX_PENDING_EVENTS);
            sh.events.drain(..excess);
            if sample.is_some() {
                sh.latest = sample;
            }
        }
    };
    let device = match open(&nvml, &target) {
        Ok(d) => d,
        Err(e) => return push(vec![Event::Warning(format!("GPU telemetry stopped: {e}"))], None),
    };
    let mut sampler = Sampler::new(&device);
    let mut monitor = Monitor::default();
    let start = Instant::now();
    let mut lost_reported = false;
    loop {
        let (sample, lost) = sampler.sample(start);
        let mut events = monitor.observe(&sample);
        if lost && !lost_reported {
            lost_reported = true;
            events.push(Event::Fatal("NVML reports the GPU is lost (fell off the bus)".into()));
        }
        push(events, Some(sample));
        match stopped.recv_timeout(interval) {
            Err(RecvTimeoutError::Timeout) => {}
            Ok(()) | Err(RecvTimeoutError::Disconnected) => break,
        }
    }
}

/// Reads one device; keeps the NVLink counters between reads to turn them into rates.
struct Sampler<'a, 'n> {
    device: &'a Device<'n>,
    nvlink: Option<NvLinkCounters>,
    /// (time, rx KiB, tx KiB) of the previous NVLink read.
    prev_nvlink: Option<(Instant, u64, u64)>,
}

impl<'a, 'n> Sampler<'a, 'n> {
    fn new(device: &'a Device<'n>) -> Self {
        Self { device, nvlink: NvLinkCounters::open(device), prev_nvlink: None }
    }

    /// One sample, and whether NVML said the GPU is lost.
    fn sample(&mut self, start: Instant) -> (Sample, bool) {
        let d = self.device;
        let util = d.utilization_rates();
        let lost = matches!(util, Err(NvmlError::GpuLost));
        let mem = d.memory_info().ok();
        let (nvlink_rx_mib_s, nvlink_tx_mib_s) = self.nvlink_rates();
        let sample = Sample {
            t_s: start.elapsed().as_secs_f64(),
            sm_util_pct: util.ok().map(|u| u.gpu),
            mem_used_gib: mem.as_ref().map(|m| m.used as f64 / GIB),
            mem_total_gib: mem.as_ref().map(|m| m.total as f64 / GIB),
            power_w: d.power_usage().ok().map(|mw| mw as f64 / 1000.0),
            sm_clock_mhz: d.clock_info(Clock::SM).ok(),
            temp_c: d.temperature(TemperatureSensor::Gpu).ok(),
            ecc_corrected: d.total_ecc_errors(MemoryError::Corrected, EccCounter::Volatile).ok(),
            ecc_uncorrected: d.total_ecc_errors(MemoryError::Uncorrected, EccCounter::Volatile).ok(),
            nvlink_rx_mib_s,
            nvlink_tx_mib_s,
        };
        (sample, lost)
    }

    fn nvlink_rates(&mut self) -> (Option<f64>, Option<f64>) {
        let Some(counters) = &self.nvlink else {
            return (None, None);
        };
        let now = Instant::now();
        let Some((rx, tx)) = counters.read_kib(self.device) else {
            self.prev_nvlink = None;
            return (None, None);
        };
        let prev = self.prev_nvlink.replace((now, rx, tx));
        match prev {
            Some((t0, rx0, tx0)) if rx >= rx0 && tx >= tx0 => {
                let dt = now.duration_since(t0).as_secs_f64();
                if dt <= 0.0 {
                    return (None, None);
                }
                (Some((rx - rx0) as f64 / 1024.0 / dt), Some((tx - tx0) as f64 / 1024.0 / dt))
            }
            // First read, or a counter reset: no rate yet.
            _ => (None, None),
        }
    }
}

/// NVLink data counters summed over all links (`NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_{RX,TX}`, KiB, with
/// scopeId = UINT_MAX). nvml-wrapper's `field_values_for` leaves scopeId at 0 (link 0 only), so this calls
/// `nvmlDeviceGetFieldValues` through a second handle on the same, already initialised, library.
struct NvLinkCounters {
    lib: nvml_wrapper_sys::bindings::NvmlLib,
}

impl NvLinkCounters {
    /// `None` when the device has no active NVLink or the counters cannot be read.
    fn open(device: &Device) -> Option<Self> {
        let links = device
            .field_values_for(&[nvml_wrapper::structs::device::FieldId(NVML_FI_DEV_NVLINK_LINK_COUNT)])
            .ok()
            .and_then(|v| v.into_iter().next())
            .and_then(|s| s.ok())
            .and_then(|s| s.value.ok())
            .and_then(|v| sample_value_u64(&v))
            .map_or(MAX_NVLINKS, |n| (n as u32).min(MAX_NVLINKS));
        let active = (0..links).any(|l| device.link_wrapper_for(l).is_active().unwrap_or(false));
        if !active {
            return None;
        }
        // SAFETY: loads the same shared object nvml-wrapper already loaded and initialised; only symbol lookups.
        let lib = unsafe { nvml_wrapper_sys::bindings::NvmlLib::new("libnvidia-ml.so.1") }.ok()?;
        let counters = Self { lib };
        counters.read_kib(device)?;
        Some(counters)
    }

    /// (rx KiB, tx KiB) since the counters' origin, summed over links.
    fn read_kib(&self, device: &Device) -> Option<(u64, u64)> {
        use nvml_wrapper_sys::bindings::{nvmlFieldValue_t, nvmlReturn_enum_NVML_SUCCESS};
        let sym = self.lib.nvmlDeviceGetFieldValues.as_ref().ok()?;
        // SAFETY: nvmlFieldValue_t is plain old data (zero is a valid value); the handle comes from a live Device
        // of the same library, and the array length passed matches the vector.
        unsafe {
            let mut values: Vec<nvmlFieldValue_t> =
                [NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX, NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX]
                    .iter()
                    .map(|&id| {
                        let mut v: nvmlFieldValue_t = std::mem::zeroed();
                        v.fieldId = id;
                        v.scopeId = u32::MAX;
                        v
                    })
                    .collect();
            if sym(device.handle(), values.len() as i32, values.as_mut_ptr()) != nvmlReturn_enum_NVML_SUCCESS {
                return None;
            }
            let read =
                |v: &nvmlFieldValue_t| (v.nvmlReturn == nvmlReturn_enum_NVML_SUCCESS).then(|| raw_u64(v)).flatten();
            Some((read(&values[0])?, read(&values[1])?))
        }
    }
}

fn sample_value_u64(v: &nvml_wrapper::enums::device::SampleValue) -> Option<u64> {
    use nvml_wrapper::enums::device::SampleValue;
    match *v {
        SampleValue::U32(x) => Some(x as u64),
        SampleValue::U64(x) => Some(x),
        SampleValue::I64(x) => u64::try_from(x).ok(),
        SampleValue::F64(_) => None,
    }
}

/// The unsigned value of a field, whatever integer type NVML chose for it.
///
/// # Safety
/// `v` must have been filled in by NVML, so that `valueType` names the union member that was written.
#[allow(non_upper_case_globals)] // bindgen's constant names
#[allow(clippy::useless_conversion)] // c_ulong is u64 here, u32 on Windows
unsafe fn raw_u64(v: &nvml_wrapper_sys::bindings::nvmlFieldValue_t) -> Option<u64> {
    use nvml_wrapper_sys::bindings::*;
    match v.valueType {
        nvmlValueType_enum_NVML_VALUE_TYPE_UNSIGNED_INT => Some(u64::from(v.value.uiVal)),
        nvmlValueType_enum_NVML_VALUE_TYPE_UNSIGNED_LONG => Some(u64::from(v.value.ulVal)),
        nvmlValueType_enum_NVML_VALUE_TYPE_UNSIGNED_LONG_LONG => Some(v.value.ullVal),
        nvmlValueType_enum_NVML_VALUE_TYPE_SIGNED_LONG_LONG => u64::try_from(v.value.sllVal).ok(),
        nvmlValueType_enum_NVML_VALUE_TYPE_SIGNED_INT => u64::try_from(v.value.siVal).ok(),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(t_s: f64) -> Sample {
        Sample { t_s, ..Default::default() }
    }

    fn warnings(ev: &[Event]) -> usize {
        ev.iter().filter(|e| matches!(e, Event::Warning(_))).count()
    }

    fn fatals(ev: &[Event]) -> usize {
        ev.iter().filter(|e| matches!(e, Event::Fatal(_))).count()
    }

    #[test]
    fn ecc_corrected_rate_warns_only_after_window_and_above_limit() {
        let mut m = Monitor::default();
        // 10 corrected errors within 30 s: too early to extrapolate.
        assert!(m.observe(&Sample { ecc_corrected: Some(5), ..at(0.0) }).is_empty());
        assert!(m.observe(&Sample { ecc_corrected: Some(15), ..at(30.0) }).is_empty());
        // At 120 s, 10 errors extrapolate to 7200/day > 100/day.
        let ev = m.observe(&Sample { ecc_corrected: Some(15), ..at(120.0) });
        assert_eq!(warnings(&ev), 1, "{ev:?}");
        assert!(format!("{ev:?}").contains("corrected ECC"));

        // 2 errors over two days is well below 100/day.
        let mut m = Monitor::default();
        m.observe(&Sample { ecc_corrected: Some(0), ..at(0.0) });
        assert!(m.observe(&Sample { ecc_corrected: Some(2), ..at(2.0 * 86_400.0) }).is_empty());
    }

    #[test]
    fn ecc_corrected_burst_warns_before_window() {
        let mut m = Monitor::default();
        m.observe(&Sample { ecc_corrected: Some(0), ..at(0.0) });
        assert!(m.observe(&Sample { ecc_corrected: Some(100), ..at(5.0) }).is_empty());
        let ev = m.observe(&Sample { ecc_corrected: Some(101), ..at(6.0) });
        assert_eq!(warnings(&ev), 1, "{ev:?}");
    }

    #[test]
    fn ecc_uncorrectable_increase_is_fatal_and_nonzero_start_warns() {
        let mut m = Monitor::default();
        assert!(m.observe(&Sample { ecc_uncorrected: Some(0), ..at(0.0) }).is_empty());
        assert!(m.observe(&Sample { ecc_uncorrected: Some(0), ..at(1.0) }).is_empty());
        let ev = m.observe(&Sample { ecc_uncorrected: Some(1), ..at(2.0) });
        assert_eq!(fatals(&ev), 1, "{ev:?}");
        // Reported once per increase, not again while the count stays put.
        assert!(m.observe(&Sample { ecc_uncorrected: Some(1), ..at(3.0) }).is_empty());
        assert_eq!(fatals(&m.observe(&Sample { ecc_uncorrected: Some(2), ..at(4.0) })), 1);

        let mut m = Monitor::default();
        let ev = m.observe(&Sample { ecc_uncorrected: Some(3), ..at(0.0) });
        assert_eq!((warnings(&ev), fatals(&ev)), (1, 0), "{ev:?}");
        assert!(m.observe(&Sample { ecc_uncorrected: Some(3), ..at(1.0) }).is_empty());
        // A missing reading is neither an increase nor a reset.
        assert!(m.observe(&at(2.0)).is_empty());
        assert_eq!(fatals(&m.observe(&Sample { ecc_uncorrected: Some(4), ..at(3.0) })), 1);
    }

    fn power(t_s: f64, w: f64) -> Sample {
        Sample { power_w: Some(w), sm_clock_mhz: Some(if w > 660.0 { 1700 } else { 1980 }), ..at(t_s) }
    }

    #[test]
    fn steady_power_raises_nothing() {
        let mut m = Monitor::default();
        for i in 0..200 {
            // ±2% ripple around 650 W.
            let w = 650.0 + if i % 2 == 0 { 13.0 } else { -13.0 };
            assert!(m.observe(&power(i as f64, w)).is_empty(), "sample {i}");
        }
    }

    #[test]
    fn power_swing_warns_and_names_clock_drop() {
        let mut m = Monitor::default();
        let mut all = Vec::new();
        for i in 0..30 {
            // Alternates 600 W / 700 W: ±7.7% around 650 W.
            let ev = m.observe(&power(i as f64, if i % 2 == 0 { 600.0 } else { 700.0 }));
            if i < 29 {
                assert!(ev.is_empty(), "window not full yet at {i}: {ev:?}");
            }
            all.extend(ev);
        }
        assert_eq!(warnings(&all), 1, "{all:?}");
        let text = format!("{all:?}");
        assert!(text.contains("SM clock") && text.contains("1700-1980 MHz"), "{text}");
    }

    #[test]
    fn idle_power_swings_are_ignored() {
        let mut m = Monitor::default();
        for i in 0..100 {
            assert!(m.observe(&power(i as f64, if i % 2 == 0 { 20.0 } else { 60.0 })).is_empty());
        }
    }

    #[test]
    fn repeated_warnings_are_rate_limited() {
        let mut m = Monitor::default();
        let mut times = Vec::new();
        // One sample every 0.5 s for 150 s, swinging all along.
        for i in 0..300 {
            let t = i as f64 * 0.5;
            let ev = m.observe(&power(t, if i % 2 == 0 { 500.0 } else { 700.0 }));
            if warnings(&ev) > 0 {
                times.push(t);
            }
        }
        assert_eq!(times, vec![14.5, 74.5, 134.5]);

        let mut last = None;
        assert!(rate_ok(&mut last, 0.0, 60.0));
        assert!(!rate_ok(&mut last, 59.9, 60.0));
        assert!(rate_ok(&mut last, 60.0, 60.0));
    }

    #[test]
    fn cuda_visible_devices_maps_to_nvml() {
        assert_eq!(nvml_target(1, None), Ok(NvmlTarget::Index(1)));
        assert_eq!(nvml_target(1, Some("")), Ok(NvmlTarget::Index(1)));
        assert_eq!(nvml_target(1, Some("4, 6")), Ok(NvmlTarget::Index(6)));
        assert_eq!(nvml_target(0, Some("GPU-abc,1")), Ok(NvmlTarget::Uuid("GPU-abc".into())));
        assert!(nvml_target(2, Some("4,6")).unwrap_err().contains("not in CUDA_VISIBLE_DEVICES"));
        assert!(nvml_target(0, Some("MIG-xyz")).is_err());
    }

    #[test]
    fn summary_lists_present_fields() {
        let s = Sample {
            sm_util_pct: Some(97),
            mem_used_gib: Some(61.23),
            power_w: Some(652.4),
            sm_clock_mhz: Some(1980),
            temp_c: Some(54),
            ..at(1.0)
        };
        assert_eq!(summarize(&s), "sm 97% 61.2GiB 652W 1980MHz 54C");
        assert_eq!(summarize(&at(0.0)), "");
        let json = serde_json::to_string(&s).expect("sample serializes");
        assert!(json.contains("\"sm_util_pct\":97") && json.contains("\"ecc_corrected\":null"), "{json}");
    }

    /// On a machine without NVML this must return None (after one warning line) and not panic; on a GPU machine
    /// it must produce samples and stop cleanly on drop.
    #[test]
    fn start_is_graceful() {
        match Telemetry::start(0, Duration::from_millis(50)) {
            None => {}
            Some(t) => {
                std::thread::sleep(Duration::from_millis(300));
                let s = t.latest().expect("a sample after 300 ms");
                eprintln!("{}: {} {s:?}", t.device_name(), t.summary());
                let _ = t.events();
            }
        }
        // An ordinal no machine has is unavailable either way.
        assert!(Telemetry::start(4096, Duration::from_millis(50)).is_none());
    }

    /// Prints samples for a few seconds; run by hand on a GPU machine: `cargo test -p trainer --lib
    /// telemetry::tests::probe_gpu -- --ignored --nocapture`.
    #[test]
    #[ignore = "needs an NVIDIA GPU"]
    fn probe_gpu() {
        let t = Telemetry::start(0, Duration::from_millis(500)).expect("NVML and GPU 0");
        for _ in 0..6 {
            std::thread::sleep(Duration::from_millis(500));
            println!("{} | {:?}", t.summary(), t.latest());
        }
        println!("events: {:?}", t.events());
    }
}
