//! Each rank's share of an epoch: the global order (a function of seed and epoch) cut into global batches of
//! `batch_size x world` samples, each global batch split between the ranks in rank order.
//!
//! Step s of rank r trains on slots `[s*G + r*b, s*G + (r+1)*b)` of the global order (G = b x world), so step s
//! of all ranks together is exactly step s of a single-process run with batch G: every sample is seen exactly
//! once per epoch, nothing is padded or dropped, and the result depends only on (order, rank, world, batch).
//! When the dataset size is not a multiple of G, the last global batch (m < G samples) is split as evenly as
//! possible: ranks below `m % world` get `m / world + 1`, the others `m / world`; a rank may then get an empty
//! last batch (when m < world). Every rank runs the same number of steps, [`steps_per_epoch`], so collective
//! operations stay matched: the training loop must still take part in the last step's all-reduce with an empty
//! batch (zero gradient), and weight gradients by sample count (sum, then divide by the global count) for the
//! result to equal the single-process run.

/// Optimizer micro-steps per epoch, the same on every rank: `ceil(len / (batch_size x world))`.
pub fn steps_per_epoch(len: usize, world: usize, batch_size: usize) -> usize {
    assert!(world > 0 && batch_size > 0, "world size and batch size must be at least 1");
    len.div_ceil(batch_size * world)
}

/// The slots `[start, end)` of the global order that `rank` trains on at `step`; empty past the end.
pub fn batch_range(len: usize, rank: usize, world: usize, batch_size: usize, step: usize) -> (usize, usize) {
    assert!(rank < world, "rank {rank} is not below the world size {world}");
    let global = batch_size * world;
    let start = (step * global).min(len);
    let m = (len - start).min(global);
    if m == global {
        let s = start + rank * batch_size;
        return (s, s + batch_size);
    }
    // The last, partial global batch: the first m % world ranks get one more.
    let (base, extra) = (m / world, m % world);
    let s = start + rank * base + rank.min(extra);
    (s, s + base + usize::from(rank < extra))
}

/// This rank's batches of the epoch, one per step ([`steps_per_epoch`] of them; only the last may be short or
/// empty), as dataset indices taken from `order`.
pub fn shard_batches(order: &[usize], rank: usize, world: usize, batch_size: usize) -> Vec<Vec<usize>> {
    (0..steps_per_epoch(order.len(), world, batch_size))
        .map(|step| {
            let (s, e) = batch_range(order.len(), rank, world, batch_size, step);
            order[s..e].to_vec()
        })
        .collect()
}

/// This rank's dataset indices of the epoch in training order (its batches, concatenated): cutting it into
/// chunks of `batch_size` gives its batches, except that a rank whose last batch is empty has one chunk fewer
/// than [`steps_per_epoch`].
pub fn shard(order: &[usize], rank: usize, world: usize, batch_size: usize) -> Vec<usize> {
    shard_batches(order, rank, world, batch_size).concat()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::loader::epoch_order;

    #[test]
    fn every_sample_exactly_once_in_every_layout() {
        for len in [0, 1, 5, 7, 8, 64, 100, 1001] {
            for world in [1, 2, 3, 4, 8] {
                for bs in [1, 2, 3, 16] {
                    let order = epoch_order(len, true, 42, 3);
                    let shards: Vec<Vec<Vec<usize>>> =
                        (0..world).map(|r| shard_batches(&order, r, world, bs)).collect();
                    let steps = steps_per_epoch(len, world, bs);
                    let mut seen = vec![0u32; len];
                    for (r, batches) in shards.iter().enumerate() {
                        // The same number of steps everywhere; full batches except the last step.
                        assert_eq!(batches.len(), steps, "len {len} world {world} bs {bs} rank {r}");
                        for (s, b) in batches.iter().enumerate() {
                            assert!(b.len() <= bs);
                            if s + 1 < steps {
                                assert_eq!(b.len(), bs);
                            }
                            b.iter().for_each(|&i| seen[i] += 1);
                        }
                        assert_eq!(shard(&order, r, world, bs), batches.concat());
                    }
                    assert!(seen.iter().all(|&c| c == 1), "len {len} world {world} bs {bs}: {seen:?}");
                    // Per-rank totals differ by at most one.
                    let sizes: Vec<usize> = shards.iter().map(|b| b.concat().len()).collect();
                    assert!(sizes.iter().max().unwrap() - sizes.iter().min().unwrap() <= 1, "{sizes:?}");
                    // Step s of all ranks, in rank order, is step s of one process with batch bs x world.
                    for s in 0..steps {
                        let joined: Vec<usize> = shards.iter().flat_map(|b| b[s].iter().copied()).collect();
                        let g = bs * world;
                        assert_eq!(joined, order[s * g..((s + 1) * g).min(len)]);
                    }
                }
            }
        }
    }

    #[test]
    fn deterministic_and_a_function_of_seed_and_epoch() {
        let a = shard(&epoch_order(100, true, 7, 2), 1, 4, 8);
        assert_eq!(a, shard(&epoch_order(100, true, 7, 2), 1, 4, 8));
        assert_ne!(a, shard(&epoch_order(100, true, 7, 3), 1, 4, 8));
        assert_ne!(a, shard(&epoch_order(100, true, 8, 2), 1, 4, 8));
    }

    #[test]
    fn uneven_tail() {
        // 10 samples, 4 ranks of batch 2: one full global batch of 8, then 2 left for ranks 0 and 1.
        let order: Vec<usize> = (100..110).collect();
        assert_eq!(steps_per_epoch(10, 4, 2), 2);
        assert_eq!(shard_batches(&order, 0, 4, 2), vec![vec![100, 101], vec![108]]);
        assert_eq!(shard_batches(&order, 1, 4, 2), vec![vec![102, 103], vec![109]]);
        assert_eq!(shard_batches(&order, 3, 4, 2), vec![vec![106, 107], vec![]]);
        assert_eq!(shard(&order, 3, 4, 2), vec![106, 107]);
        // 7 left of a global batch of 8: 2, 2, 2, 1.
        let order: Vec<usize> = (0..15).collect();
        let last: Vec<usize> = (0..4).map(|r| shard_batches(&order, r, 4, 2)[1].len()).collect();
        assert_eq!(last, vec![2, 2, 2, 1]);
    }
}
