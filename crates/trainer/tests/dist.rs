//! `trainer launch` and `trainer dist-check` as processes: ranks rendezvous and agree on the id, two launches act
//! as two nodes, a failing or hanging rank is named and nothing is left running, bad environments give one line.

use std::collections::BTreeMap;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_trainer");

/// A command for the trainer binary without any launcher variables inherited from the test's environment.
fn trainer() -> Command {
    let mut c = Command::new(BIN);
    for (k, _) in std::env::vars() {
        if k.starts_with("SLURM_")
            || ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT"]
                .contains(&k.as_str())
        {
            c.env_remove(k);
        }
    }
    c.stdin(Stdio::null());
    c
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

fn text(o: &Output) -> (String, String) {
    (String::from_utf8_lossy(&o.stdout).into_owned(), String::from_utf8_lossy(&o.stderr).into_owned())
}

/// The `error:` line of a failed run (exit status 1, no panic).
fn error_line(o: &Output) -> String {
    let (_, err) = text(o);
    assert_eq!(o.status.code(), Some(1), "stderr: {err}");
    assert!(!err.contains("panicked"), "{err}");
    err.lines().find(|l| l.starts_with("error:")).unwrap_or_else(|| panic!("no error line in: {err}")).to_string()
}

/// rank -> fingerprint, from the `[rank N] dist-check: rank N/W ...` lines of launches' stdout.
fn fingerprints(stdout: &str, world: usize) -> BTreeMap<usize, String> {
    let mut m = BTreeMap::new();
    for l in stdout.lines() {
        let Some(rest) = l.split_once("] dist-check: rank ").map(|p| p.1) else { continue };
        let Some(fp) = rest.split_whitespace().last().filter(|_| rest.contains("fingerprint")) else { continue };
        let (rank, w) = rest.split_whitespace().next().unwrap().split_once('/').unwrap();
        assert_eq!(w.parse::<usize>().unwrap(), world, "{l}");
        let rank: usize = rank.parse().unwrap();
        assert!(l.starts_with(&format!("[rank {rank}] ")), "output not tagged with its rank: {l}");
        assert!(m.insert(rank, fp.to_string()).is_none(), "rank {rank} twice");
    }
    m
}

#[test]
fn launch_runs_every_rank_and_they_agree_on_the_id() {
    let o = trainer()
        .args(["launch", "--nproc-per-node", "3", "--master-port", "0", "--timeout", "120", "--"])
        .args(["dist-check", "--timeout", "60"])
        .output()
        .unwrap();
    let (out, err) = text(&o);
    assert!(o.status.success(), "stdout: {out}\nstderr: {err}");
    let fps = fingerprints(&out, 3);
    assert_eq!(fps.keys().copied().collect::<Vec<_>>(), vec![0, 1, 2], "{out}");
    assert!(fps.values().all(|f| f == &fps[&0]), "ranks received different ids: {fps:?}");
    for r in 0..3 {
        assert!(out.contains(&format!("[rank {r}] dist-check: rank {r} ok")), "{out}");
        assert!(err.contains(&format!("[rank {r}] dist-check: rank {r}/3 (local {r}, node 0) via torchrun")), "{err}");
    }
}

#[test]
fn two_launches_act_as_two_nodes() {
    let port = free_port().to_string();
    let node = |rank: &str| {
        trainer()
            .args(["launch", "--nnodes", "2", "--node-rank", rank, "--nproc-per-node", "2"])
            .args(["--master-addr", "127.0.0.1", "--master-port", &port, "--timeout", "120", "--"])
            .args(["dist-check", "--timeout", "60"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    // Node 1 first: its ranks retry until node 0's rank 0 listens.
    let n1 = node("1");
    std::thread::sleep(Duration::from_millis(300));
    let n0 = node("0");
    let (o0, o1) = (n0.wait_with_output().unwrap(), n1.wait_with_output().unwrap());
    for o in [&o0, &o1] {
        let (out, err) = text(o);
        assert!(o.status.success(), "stdout: {out}\nstderr: {err}");
    }
    let f0 = fingerprints(&text(&o0).0, 4);
    let f1 = fingerprints(&text(&o1).0, 4);
    assert_eq!(f0.keys().copied().collect::<Vec<_>>(), vec![0, 1]);
    assert_eq!(f1.keys().copied().collect::<Vec<_>>(), vec![2, 3]);
    assert!(f0.values().chain(f1.values()).all(|f| f == &f0[&0]), "{f0:?} {f1:?}");
    assert!(text(&o1).1.contains("[rank 3] dist-check: rank 3/4 (local 1, node 1) via torchrun"));
}

#[test]
fn a_crashing_rank_is_named_and_the_others_stop() {
    let t0 = Instant::now();
    // Rank 1 exits with status 3 after the first barrier; ranks 0 and 2 notice through the rendezvous
    // connections and exit on their own, well within the grace period.
    let o = trainer()
        .args(["launch", "--nproc-per-node", "3", "--master-port", "0", "--grace", "30", "--timeout", "120", "--"])
        .args(["dist-check", "--fail-rank", "1", "--hold", "60"])
        .output()
        .unwrap();
    let line = error_line(&o);
    // Ranks 0 and 2 exit with 75 (stopped because another rank failed), so rank 1 is named even when the
    // launcher sees all three exits at once.
    assert!(line.starts_with("error: rank 1 (node 0, local rank 1) exited with status 3"), "{line}");
    let (_, err) = text(&o);
    for r in [0, 2] {
        assert!(
            err.contains(&format!("[rank {r}] error: rank 1 failed: its connection closed")),
            "rank {r} did not name rank 1: {err}"
        );
    }
    assert!(line.ends_with("; rank(s) 0, 2 failed after it"), "the others should have exited on their own: {line}");
    assert!(t0.elapsed() < Duration::from_secs(60), "{:?}", t0.elapsed());
}

#[test]
fn hung_ranks_are_killed_after_the_grace_period_or_the_timeout() {
    // Rank 0 hangs (its heartbeats go on, as in a stuck training step) while rank 1 fails: killed after 1 s.
    let t0 = Instant::now();
    let o = trainer()
        .args(["launch", "--nproc-per-node", "2", "--master-port", "0", "--grace", "1", "--timeout", "120", "--"])
        .args(["dist-check", "--fail-rank", "1", "--exit-code", "5", "--hang-ranks", "0"])
        .output()
        .unwrap();
    let line = error_line(&o);
    assert_eq!(
        line,
        "error: rank 1 (node 0, local rank 1) exited with status 5; killed rank(s) 0 after the 1s grace period"
    );
    assert!(t0.elapsed() < Duration::from_secs(60));
    // Both hang: the launcher's --timeout kills them.
    let o = trainer()
        .args(["launch", "--nproc-per-node", "2", "--master-port", "0", "--timeout", "3", "--"])
        .args(["dist-check", "--hang-ranks", "0,1"])
        .output()
        .unwrap();
    assert_eq!(error_line(&o), "error: launch: timed out after 3s with rank(s) 0-1 still running; killed them");
}

#[test]
fn a_rank_without_rank_0_times_out_naming_the_address() {
    let port = free_port();
    let t0 = Instant::now();
    let o = trainer()
        .args(["dist-check", "--timeout", "1"])
        .envs([("RANK", "1"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "1"), ("MASTER_ADDR", "127.0.0.1")])
        .env("MASTER_PORT", port.to_string())
        .output()
        .unwrap();
    let line = error_line(&o);
    assert!(
        line.starts_with(&format!("error: rendezvous: rank 1 cannot reach rank 0 at 127.0.0.1:{port} within")),
        "{line}"
    );
    assert!(t0.elapsed() < Duration::from_secs(30));
    // Rank 0 alone names the rank that never came.
    let o = trainer()
        .args(["dist-check", "--timeout", "1"])
        .envs([("RANK", "0"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "127.0.0.1")])
        .env("MASTER_PORT", free_port().to_string())
        .output()
        .unwrap();
    let line = error_line(&o);
    assert!(line.ends_with("waiting for rank(s) 1 of world size 2"), "{line}");
}

#[test]
fn bad_environments_and_arguments_give_one_line() {
    let o = trainer()
        .args(["dist-check"])
        .envs([("RANK", "1"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "1")])
        .output()
        .unwrap();
    assert_eq!(
        error_line(&o),
        "error: environment variable MASTER_ADDR is not set, and WORLD_SIZE=2 needs the address of rank 0's host"
    );
    let o = trainer().args(["dist-check"]).envs([("SLURM_PROCID", "4"), ("SLURM_NTASKS", "4")]).output().unwrap();
    assert_eq!(error_line(&o), "error: environment variable SLURM_PROCID=4 is not below SLURM_NTASKS=4");
    // A rank trains on a CUDA GPU through NCCL: a CPU config, or a build without NCCL, is refused in one line
    // before anything is written.
    let ranks = [("RANK", "0"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "127.0.0.1")];
    let o = trainer()
        .args(["--config", "quickstart.toml"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .envs(ranks)
        .output()
        .unwrap();
    let line = error_line(&o);
    assert!(
        line.starts_with("error: device = \"cpu\": data-parallel training (rank 0/2")
            && line.ends_with("runs one rank per CUDA GPU; set device = \"cuda\""),
        "{line}"
    );
    let o = trainer()
        .args(["--config", "quickstart.toml", "--set", "device=\"cuda\""])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .envs(ranks)
        .output()
        .unwrap();
    let line = error_line(&o);
    assert!(
        line.contains("rank 0/2")
            && line.ends_with("needs a trainer built with NCCL (cargo feature `nccl`, see the README)"),
        "{line}"
    );
    // NCCL needs the `nccl` build (the CPU test build has no CUDA).
    let o = trainer().args(["dist-check", "--nccl"]).output().unwrap();
    assert_eq!(error_line(&o), "error: dist-check --nccl: this trainer was built without NCCL (cargo feature `nccl`)");
    let o = trainer().args(["launch", "--nnodes", "2", "--node-rank", "2", "--", "dist-check"]).output().unwrap();
    assert_eq!(error_line(&o), "error: launch: --node-rank 2 is not below --nnodes 2");
    let o = trainer().args(["launch", "--nnodes", "2", "--master-port", "0", "--", "dist-check"]).output().unwrap();
    assert!(error_line(&o).starts_with("error: launch: --master-port 0 (a free port) works on one node only"));
}
