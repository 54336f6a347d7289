//! Data-parallel foundations (one process per GPU): the launcher's environment, a TCP rendezvous that hands out
//! the NCCL unique id and watches for failed ranks, `trainer launch`, and each rank's shard of an epoch.
//! The training loop takes a [`Collective`] (`train::train_ranks`); see README "Multi-GPU (in progress)".

pub mod buckets;
pub mod env;
pub mod launch;
#[cfg(feature = "nccl")]
pub mod nccl;
pub mod rendezvous;
pub mod shard;

pub use env::{DistEnv, EnvError, EnvSource};
pub use launch::{launch, LaunchError, LaunchOptions};
pub use rendezvous::{rendezvous, Group, Options, RendezvousError, NCCL_UNIQUE_ID_BYTES};
pub use shard::{shard, shard_batches, steps_per_epoch};

use std::time::Duration;

/// Exit status of a rank that stops because another rank failed (`trainer launch` then names the rank that
/// failed first on its own, not this one).
pub const PEER_FAILED_EXIT_CODE: i32 = 75;

/// What data-parallel training needs from the other ranks: an in-place sum over all ranks of a contiguous f32
/// tensor on this rank's device, queued in the device's stream order. [`nccl::NcclComm`] is the implementation
/// (cargo feature `nccl`); the training loop sees only this trait.
pub trait Collective {
    fn rank(&self) -> usize;
    fn world_size(&self) -> usize;
    /// Every rank's `t` (contiguous f32 or bf16) becomes the sum of all ranks' `t`: work queued on the device
    /// afterwards sees the sum.
    fn all_reduce_sum(&self, t: &candle_core::Tensor) -> anyhow::Result<()>;
    /// Starts the sum of `t` over the ranks ([`Self::all_reduce_sum`]) without making the device's later work
    /// wait for it: the all-reduce overlaps whatever is queued next (NCCL: on a stream of its own). `t` must not
    /// be read or written, nor dropped, until [`Self::join`]. Collectives still run in call order.
    fn start_all_reduce_sum(&self, t: &candle_core::Tensor) -> anyhow::Result<()> {
        self.all_reduce_sum(t)
    }
    /// Makes the device's later work wait for every all-reduce started so far.
    fn join(&self) -> anyhow::Result<()> {
        Ok(())
    }
}

/// The process exit status for an error: [`PEER_FAILED_EXIT_CODE`] when it is another rank's failure, else 1.
pub fn exit_code(e: &anyhow::Error) -> i32 {
    let peer =
        e.chain().any(|c| matches!(c.downcast_ref::<RendezvousError>(), Some(RendezvousError::RankFailed { .. })));
    if peer {
        PEER_FAILED_EXIT_CODE
    } else {
        1
    }
}

/// The line to print at the start of a data-parallel run: `train.batch_size` is per GPU and the learning rate
/// is used as configured (never rescaled behind the user's back).
pub fn batch_summary(per_gpu: usize, world: usize, grad_accum: usize, lr: f64) -> String {
    let accum = if grad_accum > 1 { format!(" x {grad_accum} accumulation steps") } else { String::new() };
    format!(
        "batch: {per_gpu} per GPU (train.batch_size) x {world} rank(s){accum} = global batch {}; optim.lr = {lr} \
         as configured (not rescaled for the global batch)",
        per_gpu * world * grad_accum.max(1)
    )
}

/// FNV-1a of a payload: a short fingerprint to compare what each rank received.
pub fn fingerprint(bytes: &[u8]) -> String {
    let h = bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3));
    format!("{h:016x}")
}

/// What `trainer dist-check` does (a diagnostic, and the child of the launcher's tests).
#[derive(Debug, Clone)]
pub struct CheckOptions {
    /// Rendezvous and barrier timeout.
    pub timeout: Duration,
    /// After the first barrier, how long to watch for failed ranks before the final barrier.
    pub hold: Duration,
    /// This rank exits with `exit_code` right after the first barrier, without a goodbye (a crash).
    pub fail_rank: Option<usize>,
    pub exit_code: i32,
    /// These ranks hang after the first barrier (their heartbeats go on: a stuck training loop).
    pub hang_ranks: Vec<usize>,
    /// The payload is an NCCL unique id; after the first barrier every rank all-reduces a tensor on
    /// cuda:LOCAL_RANK through NCCL and checks the sum ([`nccl_check`]).
    pub nccl: bool,
}

/// Rendezvous with a random 128-byte id from rank 0, print what this rank got, barrier, watch, barrier.
pub fn check(o: &CheckOptions) -> anyhow::Result<()> {
    let env = DistEnv::from_process_env()?;
    eprintln!("dist-check: {}", env.describe());
    let opts = Options { timeout: o.timeout, ..Options::default() };
    if o.nccl && !cfg!(feature = "nccl") {
        anyhow::bail!("dist-check --nccl: this trainer was built without NCCL (cargo feature `nccl`)");
    }
    #[cfg_attr(not(feature = "nccl"), allow(unused_mut))]
    let mut id_error = None;
    let make_id = || {
        if o.nccl {
            #[cfg(feature = "nccl")]
            match nccl::unique_id() {
                Ok(id) => return id,
                Err(e) => id_error = Some(e),
            }
        }
        (0..NCCL_UNIQUE_ID_BYTES).map(|_| rand::random::<u8>()).collect()
    };
    let (id, mut group) = rendezvous(&env, make_id, &opts)?;
    if let Some(e) = id_error {
        return Err(e);
    }
    println!(
        "dist-check: rank {}/{} local {} node {} payload {} bytes fingerprint {}",
        env.rank,
        env.world_size,
        env.local_rank,
        env.node_rank.map_or("?".into(), |n| n.to_string()),
        id.len(),
        fingerprint(&id)
    );
    group.barrier(o.timeout)?;
    if o.nccl {
        nccl_check(&env, &id)?;
    }
    if o.hang_ranks.contains(&env.rank) {
        eprintln!("dist-check: rank {} hangs (--hang-ranks)", env.rank);
        loop {
            std::thread::sleep(Duration::from_secs(3600));
        }
    }
    if o.fail_rank == Some(env.rank) {
        eprintln!("dist-check: rank {} exits with status {} (--fail-rank)", env.rank, o.exit_code);
        std::process::exit(o.exit_code);
    }
    if let Some(e) = group.wait_failure(o.hold) {
        return Err(e.into());
    }
    group.barrier(o.timeout)?;
    group.close();
    println!("dist-check: rank {} ok", env.rank);
    Ok(())
}

/// NCCL on this rank: a communicator on cuda:LOCAL_RANK from the rendezvous' id, then a sum all-reduce of 2^20
/// floats holding rank + 1, which must come back as world (world + 1) / 2 everywhere.
fn nccl_check(env: &DistEnv, id: &[u8]) -> anyhow::Result<()> {
    #[cfg(feature = "nccl")]
    {
        use anyhow::Context;
        let device = candle_core::Device::new_cuda(env.local_rank)
            .with_context(|| format!("rank {}: cannot open cuda:{} (LOCAL_RANK)", env.rank, env.local_rank))?;
        let comm = nccl::NcclComm::new(&device, id, env.rank, env.world_size)?;
        let t = candle_core::Tensor::full((env.rank + 1) as f32, 1 << 20, &device)?;
        comm.all_reduce_sum(&t)?;
        let want = (env.world_size * (env.world_size + 1) / 2) as f32;
        let (lo, hi) = (t.min(0)?.to_scalar::<f32>()?, t.max(0)?.to_scalar::<f32>()?);
        if lo != want || hi != want {
            anyhow::bail!("rank {}: NCCL all-reduce gave values in [{lo}, {hi}], expected {want}", env.rank);
        }
        println!(
            "dist-check: rank {} nccl all-reduce of 2^20 floats over {} rank(s) ok ({want})",
            env.rank, env.world_size
        );
        Ok(())
    }
    #[cfg(not(feature = "nccl"))]
    {
        let _ = (env, id);
        anyhow::bail!("dist-check --nccl: this trainer was built without NCCL (cargo feature `nccl`)")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batch_summary_states_the_global_batch() {
        assert_eq!(
            batch_summary(32, 8, 1, 0.1),
            "batch: 32 per GPU (train.batch_size) x 8 rank(s) = global batch 256; optim.lr = 0.1 as configured \
             (not rescaled for the global batch)"
        );
        assert!(batch_summary(16, 2, 4, 0.5).contains("x 2 rank(s) x 4 accumulation steps = global batch 128"));
    }

    #[test]
    fn another_ranks_failure_exits_with_75() {
        let peer = anyhow::Error::from(RendezvousError::RankFailed { rank: 1, msg: "gone".into() });
        assert_eq!(exit_code(&peer), PEER_FAILED_EXIT_CODE);
        assert_eq!(exit_code(&peer.context("step 3")), PEER_FAILED_EXIT_CODE);
        let own = anyhow::Error::from(RendezvousError::BarrierTimeout { secs: 1.0, missing: "2".into() });
        assert_eq!(exit_code(&own), 1);
        assert_eq!(exit_code(&anyhow::anyhow!("config")), 1);
    }

    #[test]
    fn fingerprints_differ() {
        assert_eq!(fingerprint(&[]), "cbf29ce484222325");
        assert_ne!(fingerprint(&[1, 2]), fingerprint(&[2, 1]));
    }
}
