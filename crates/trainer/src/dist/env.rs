//! Where a rank learns its place: torchrun's environment, Slurm's, or none (a single process).

use std::collections::HashMap;

/// torchrun's default rendezvous port, used when MASTER_PORT is unset.
pub const DEFAULT_MASTER_PORT: u16 = 29500;

/// Which launcher's variables described this process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EnvSource {
    /// RANK / WORLD_SIZE / LOCAL_RANK (torchrun, `trainer launch`, any launcher that mimics them).
    Torchrun,
    /// SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID (one task per GPU under `srun`).
    Slurm,
    /// Nothing set: one process, world size 1.
    Single,
}

/// This process's place in a data-parallel job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DistEnv {
    /// Global rank, 0..world_size.
    pub rank: usize,
    pub world_size: usize,
    /// Rank on this node: the GPU ordinal it should use.
    pub local_rank: usize,
    /// Processes on this node, when the launcher says.
    pub local_world_size: Option<usize>,
    /// Index of this node (torchrun's GROUP_RANK, Slurm's SLURM_NODEID), when the launcher says.
    pub node_rank: Option<usize>,
    /// Host of rank 0's rendezvous; `None` only when world_size is 1.
    pub master_addr: Option<String>,
    pub master_port: u16,
    pub source: EnvSource,
}

/// A bad distributed environment; the message is one line naming the variable(s) at fault.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EnvError {
    #[error("environment variable {var}=`{value}` is not a non-negative integer")]
    NotANumber { var: &'static str, value: String },
    #[error("environment variable {set} is set but {missing} is not (both are needed for a distributed run)")]
    Missing { set: &'static str, missing: &'static str },
    #[error("environment variable {var}=0: the world size must be at least 1")]
    ZeroWorld { var: &'static str },
    #[error("environment variable {rank_var}={rank} is not below {world_var}={world}")]
    RankOutOfRange { rank_var: &'static str, rank: usize, world_var: &'static str, world: usize },
    #[error("environment variable MASTER_ADDR is not set, and {world_var}={world} needs the address of rank 0's host")]
    NoMasterAddr { world_var: &'static str, world: usize },
    #[error("environment variable MASTER_PORT=`{value}` is not a port (1-65535)")]
    BadPort { value: String },
    #[error("conflicting environment: {0}")]
    Conflict(String),
}

/// Reads a variable; an empty value counts as unset (`RANK= trainer ...`).
fn get<'a>(env: &'a HashMap<String, String>, var: &str) -> Option<&'a str> {
    env.get(var).map(|s| s.trim()).filter(|s| !s.is_empty())
}

fn num(env: &HashMap<String, String>, var: &'static str) -> Result<Option<usize>, EnvError> {
    get(env, var)
        .map(|v| v.parse::<usize>().map_err(|_| EnvError::NotANumber { var, value: v.to_string() }))
        .transpose()
}

impl DistEnv {
    /// The single-process environment: rank 0 of 1.
    pub fn single() -> Self {
        Self {
            rank: 0,
            world_size: 1,
            local_rank: 0,
            local_world_size: Some(1),
            node_rank: Some(0),
            master_addr: None,
            master_port: DEFAULT_MASTER_PORT,
            source: EnvSource::Single,
        }
    }

    /// Parses this process's environment (see [`DistEnv::from_map`]).
    pub fn from_process_env() -> Result<Self, EnvError> {
        Self::from_map(&std::env::vars().collect())
    }

    /// Parses an environment. torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK)
    /// win over Slurm's (SLURM_PROCID, SLURM_STEP_NUM_TASKS or SLURM_NTASKS, SLURM_LOCALID, SLURM_NODEID), so
    /// torchrun inside an `srun` step works; with neither, the world size is 1. MASTER_ADDR is required when the
    /// world size exceeds 1; MASTER_PORT defaults to 29500.
    pub fn from_map(env: &HashMap<String, String>) -> Result<Self, EnvError> {
        let torchrun = ["RANK", "WORLD_SIZE"].iter().any(|v| get(env, v).is_some());
        let slurm = get(env, "SLURM_PROCID").is_some();
        let (source, rank_var, world_var, local_var) = if torchrun {
            (EnvSource::Torchrun, "RANK", "WORLD_SIZE", "LOCAL_RANK")
        } else if slurm {
            let world_var =
                if get(env, "SLURM_STEP_NUM_TASKS").is_some() { "SLURM_STEP_NUM_TASKS" } else { "SLURM_NTASKS" };
            (EnvSource::Slurm, "SLURM_PROCID", world_var, "SLURM_LOCALID")
        } else {
            return Ok(Self::single());
        };
        let rank = num(env, rank_var)?;
        let world = num(env, world_var)?;
        let (rank, world) = match (rank, world) {
            (Some(r), Some(w)) => (r, w),
            (Some(_), None) => return Err(EnvError::Missing { set: rank_var, missing: world_var }),
            (None, _) => return Err(EnvError::Missing { set: world_var, missing: rank_var }),
        };
        if world == 0 {
            return Err(EnvError::ZeroWorld { var: world_var });
        }
        if rank >= world {
            return Err(EnvError::RankOutOfRange { rank_var, rank, world_var, world });
        }
        let (lws_var, node_var) = match source {
            EnvSource::Torchrun => ("LOCAL_WORLD_SIZE", "GROUP_RANK"),
            _ => ("SLURM_NTASKS_PER_NODE", "SLURM_NODEID"),
        };
        // Slurm writes SLURM_NTASKS_PER_NODE as "4" or, for uneven nodes, "4(x2),3": only a plain number is used.
        let local_world = match source {
            EnvSource::Slurm => get(env, lws_var).and_then(|v| v.parse::<usize>().ok()),
            _ => num(env, lws_var)?,
        };
        let node_rank = num(env, node_var)?;
        let local_rank = match num(env, local_var)? {
            Some(l) => l,
            None if world == 1 => 0,
            None => return Err(EnvError::Missing { set: world_var, missing: local_var }),
        };
        if let Some(lw) = local_world {
            if lw == 0 {
                return Err(EnvError::ZeroWorld { var: lws_var });
            }
            if local_rank >= lw {
                return Err(EnvError::RankOutOfRange {
                    rank_var: local_var,
                    rank: local_rank,
                    world_var: lws_var,
                    world: lw,
                });
            }
            if lw > world {
                return Err(EnvError::Conflict(format!("{lws_var}={lw} exceeds {world_var}={world}")));
            }
        }
        if local_rank >= world {
            return Err(EnvError::RankOutOfRange { rank_var: local_var, rank: local_rank, world_var, world });
        }
        // torchrun's nodes are homogeneous: RANK = GROUP_RANK * LOCAL_WORLD_SIZE + LOCAL_RANK.
        if let (EnvSource::Torchrun, Some(lw), Some(node)) = (source, local_world, node_rank) {
            if node * lw + local_rank != rank {
                return Err(EnvError::Conflict(format!(
                    "RANK={rank} but GROUP_RANK={node} x LOCAL_WORLD_SIZE={lw} + LOCAL_RANK={local_rank} = {}",
                    node * lw + local_rank
                )));
            }
        }
        let master_addr = get(env, "MASTER_ADDR").map(str::to_string);
        if world > 1 && master_addr.is_none() {
            return Err(EnvError::NoMasterAddr { world_var, world });
        }
        let master_port = match get(env, "MASTER_PORT") {
            None => DEFAULT_MASTER_PORT,
            Some(v) => match v.parse::<u16>() {
                Ok(p) if p > 0 => p,
                _ => return Err(EnvError::BadPort { value: v.to_string() }),
            },
        };
        Ok(Self {
            rank,
            world_size: world,
            local_rank,
            local_world_size: local_world,
            node_rank,
            master_addr,
            master_port,
            source,
        })
    }

    /// More than one process.
    pub fn is_distributed(&self) -> bool {
        self.world_size > 1
    }

    /// `MASTER_ADDR:MASTER_PORT` (IPv6 literals bracketed), the rendezvous endpoint.
    pub fn master_endpoint(&self) -> String {
        endpoint(self.master_addr.as_deref().unwrap_or("127.0.0.1"), self.master_port)
    }

    /// One line for logs: `rank 3/8 (local 1, node 1) via torchrun, rendezvous 10.0.0.1:29500`.
    pub fn describe(&self) -> String {
        let source = match self.source {
            EnvSource::Torchrun => "torchrun",
            EnvSource::Slurm => "slurm",
            EnvSource::Single => "no launcher",
        };
        let node = self.node_rank.map(|n| format!(", node {n}")).unwrap_or_default();
        let rdv =
            if self.is_distributed() { format!(", rendezvous {}", self.master_endpoint()) } else { String::new() };
        format!("rank {}/{} (local {}{node}) via {source}{rdv}", self.rank, self.world_size, self.local_rank)
    }
}

/// `host:port`, with an IPv6 literal in brackets.
pub fn endpoint(host: &str, port: u16) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    fn err(pairs: &[(&str, &str)]) -> String {
        DistEnv::from_map(&env(pairs)).unwrap_err().to_string()
    }

    #[test]
    fn nothing_set_is_a_single_process() {
        let e = DistEnv::from_map(&env(&[("PATH", "/bin")])).unwrap();
        assert_eq!(e, DistEnv::single());
        assert!(!e.is_distributed());
        // Empty values count as unset.
        assert_eq!(DistEnv::from_map(&env(&[("RANK", ""), ("WORLD_SIZE", " ")])).unwrap(), DistEnv::single());
    }

    #[test]
    fn torchrun_variables() {
        let e = DistEnv::from_map(&env(&[
            ("RANK", "5"),
            ("WORLD_SIZE", "8"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "4"),
            ("GROUP_RANK", "1"),
            ("MASTER_ADDR", "node-a"),
            ("MASTER_PORT", "1234"),
        ]))
        .unwrap();
        assert_eq!(
            e,
            DistEnv {
                rank: 5,
                world_size: 8,
                local_rank: 1,
                local_world_size: Some(4),
                node_rank: Some(1),
                master_addr: Some("node-a".into()),
                master_port: 1234,
                source: EnvSource::Torchrun,
            }
        );
        assert_eq!(e.master_endpoint(), "node-a:1234");
        assert_eq!(e.describe(), "rank 5/8 (local 1, node 1) via torchrun, rendezvous node-a:1234");
        // World size 1 needs neither LOCAL_RANK nor MASTER_ADDR; the port defaults to torchrun's.
        let e = DistEnv::from_map(&env(&[("RANK", "0"), ("WORLD_SIZE", "1")])).unwrap();
        assert_eq!((e.world_size, e.local_rank, e.master_port, e.source), (1, 0, 29500, EnvSource::Torchrun));
    }

    #[test]
    fn slurm_variables() {
        let base = [
            ("SLURM_PROCID", "3"),
            ("SLURM_NTASKS", "4"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_NODEID", "1"),
            ("SLURM_NTASKS_PER_NODE", "2"),
            ("MASTER_ADDR", "gpu-01"),
        ];
        let e = DistEnv::from_map(&env(&base)).unwrap();
        assert_eq!((e.rank, e.world_size, e.local_rank, e.node_rank), (3, 4, 1, Some(1)));
        assert_eq!((e.local_world_size, e.source, e.master_port), (Some(2), EnvSource::Slurm, 29500));
        // The step's task count wins over the allocation's; an uneven per-node count is ignored.
        let mut m = env(&base);
        m.insert("SLURM_STEP_NUM_TASKS".into(), "6".into());
        m.insert("SLURM_NTASKS_PER_NODE".into(), "4(x1),2".into());
        let e = DistEnv::from_map(&m).unwrap();
        assert_eq!((e.world_size, e.local_world_size), (6, None));
        // torchrun inside an srun step: torchrun's variables win.
        m.extend(env(&[("RANK", "0"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "0")]));
        let e = DistEnv::from_map(&m).unwrap();
        assert_eq!((e.rank, e.world_size, e.source), (0, 2, EnvSource::Torchrun));
        // Missing MASTER_ADDR names it and the world size variable.
        let no_addr: Vec<_> = base.iter().copied().filter(|(k, _)| *k != "MASTER_ADDR").collect();
        assert_eq!(
            err(&no_addr),
            "environment variable MASTER_ADDR is not set, and SLURM_NTASKS=4 needs the address of rank 0's host"
        );
    }

    #[test]
    fn errors_name_the_variable() {
        let ok = [("RANK", "1"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "1"), ("MASTER_ADDR", "h")];
        assert!(DistEnv::from_map(&env(&ok)).is_ok());
        let with = |k: &str, v: &str| {
            let mut m = env(&ok);
            m.insert(k.into(), v.into());
            DistEnv::from_map(&m).unwrap_err().to_string()
        };
        let without = |k: &str| {
            let mut m = env(&ok);
            m.remove(k);
            DistEnv::from_map(&m).unwrap_err().to_string()
        };
        assert_eq!(with("RANK", "x1"), "environment variable RANK=`x1` is not a non-negative integer");
        assert_eq!(with("RANK", "-1"), "environment variable RANK=`-1` is not a non-negative integer");
        assert_eq!(with("RANK", "2"), "environment variable RANK=2 is not below WORLD_SIZE=2");
        assert_eq!(with("WORLD_SIZE", "0"), "environment variable WORLD_SIZE=0: the world size must be at least 1");
        assert_eq!(with("LOCAL_RANK", "2"), "environment variable LOCAL_RANK=2 is not below WORLD_SIZE=2");
        assert_eq!(with("LOCAL_WORLD_SIZE", "1"), "environment variable LOCAL_RANK=1 is not below LOCAL_WORLD_SIZE=1");
        assert_eq!(with("MASTER_PORT", "70000"), "environment variable MASTER_PORT=`70000` is not a port (1-65535)");
        assert_eq!(with("MASTER_PORT", "0"), "environment variable MASTER_PORT=`0` is not a port (1-65535)");
        let mut m = env(&ok);
        m.insert("MASTER_PORT".into(), "65535".into());
        assert_eq!(DistEnv::from_map(&m).unwrap().master_port, 65535);
        assert_eq!(
            without("WORLD_SIZE"),
            "environment variable RANK is set but WORLD_SIZE is not (both are needed for a distributed run)"
        );
        assert_eq!(
            without("RANK"),
            "environment variable WORLD_SIZE is set but RANK is not (both are needed for a distributed run)"
        );
        assert_eq!(
            without("LOCAL_RANK"),
            "environment variable WORLD_SIZE is set but LOCAL_RANK is not (both are needed for a distributed run)"
        );
        assert!(without("MASTER_ADDR").starts_with("environment variable MASTER_ADDR is not set, and WORLD_SIZE=2"));
        let mut m = env(&ok);
        m.extend(env(&[("LOCAL_WORLD_SIZE", "2"), ("GROUP_RANK", "1")]));
        assert_eq!(
            DistEnv::from_map(&m).unwrap_err().to_string(),
            "conflicting environment: RANK=1 but GROUP_RANK=1 x LOCAL_WORLD_SIZE=2 + LOCAL_RANK=1 = 3"
        );
        m.insert("LOCAL_WORLD_SIZE".into(), "4".into());
        assert_eq!(
            DistEnv::from_map(&m).unwrap_err().to_string(),
            "conflicting environment: LOCAL_WORLD_SIZE=4 exceeds WORLD_SIZE=2"
        );
    }

    #[test]
    fn ipv6_endpoints_are_bracketed() {
        assert_eq!(endpoint("::1", 80), "[::1]:80");
        assert_eq!(endpoint("[::1]", 80), "[::1]:80");
        assert_eq!(endpoint("10.0.0.1", 80), "10.0.0.1:80");
    }
}
