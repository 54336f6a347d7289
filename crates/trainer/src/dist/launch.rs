//! `trainer launch`: one child process per GPU of this node, with torchrun's environment, output tagged by rank;
//! when one fails the others get a grace period to exit, then are killed, and the error names the rank.

use std::ffi::OsString;
use std::io::{BufRead, BufReader, Read, Write};
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// What to launch and where this node sits in the job.
#[derive(Debug, Clone)]
pub struct LaunchOptions {
    pub nproc_per_node: usize,
    pub nnodes: usize,
    pub node_rank: usize,
    pub master_addr: String,
    /// 0 picks a free port (one node only).
    pub master_port: u16,
    /// After a rank fails, how long the others may take to exit on their own before they are killed.
    pub grace: Duration,
    /// Kill every rank after this long (`None`: no limit).
    pub timeout: Option<Duration>,
    /// The program each rank runs (the current executable for `trainer launch`) and its arguments.
    pub program: PathBuf,
    pub args: Vec<OsString>,
}

/// A failed launch; the message is one line naming the flag or the rank.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum LaunchError {
    #[error("launch: {flag} {msg}")]
    BadArgs { flag: &'static str, msg: String },
    #[error("launch: cannot start rank {rank} ({program}): {msg}")]
    Spawn { rank: usize, program: String, msg: String },
    #[error("rank {rank} (node {node}, local rank {local}) {status}{also}")]
    RankFailed { rank: usize, node: usize, local: usize, status: String, also: String },
    #[error("launch: timed out after {secs}s with rank(s) {running} still running; killed them")]
    Timeout { secs: f64, running: String },
    #[error("launch: cannot find a free port on this machine: {0}")]
    NoPort(String),
}

/// How a child ended, in words: `exited with status 3`, `was killed by signal 9 (SIGKILL)`.
pub fn describe_status(s: &ExitStatus) -> String {
    if let Some(code) = s.code() {
        let why = if code == super::PEER_FAILED_EXIT_CODE { " (it stopped because another rank failed)" } else { "" };
        return format!("exited with status {code}{why}");
    }
    #[cfg(unix)]
    {
        use std::os::unix::process::ExitStatusExt;
        if let Some(sig) = s.signal() {
            let name = match sig {
                1 => " (SIGHUP)",
                2 => " (SIGINT)",
                4 => " (SIGILL)",
                6 => " (SIGABRT)",
                7 => " (SIGBUS)",
                8 => " (SIGFPE)",
                9 => " (SIGKILL)",
                11 => " (SIGSEGV)",
                13 => " (SIGPIPE)",
                15 => " (SIGTERM)",
                _ => "",
            };
            return format!("was killed by signal {sig}{name}");
        }
    }
    format!("ended with {s}")
}

/// The torchrun variables of one child.
pub fn child_env(o: &LaunchOptions, local_rank: usize, port: u16) -> Vec<(&'static str, String)> {
    let rank = o.node_rank * o.nproc_per_node + local_rank;
    vec![
        ("RANK", rank.to_string()),
        ("WORLD_SIZE", (o.nnodes * o.nproc_per_node).to_string()),
        ("LOCAL_RANK", local_rank.to_string()),
        ("LOCAL_WORLD_SIZE", o.nproc_per_node.to_string()),
        ("GROUP_RANK", o.node_rank.to_string()),
        ("GROUP_WORLD_SIZE", o.nnodes.to_string()),
        ("MASTER_ADDR", o.master_addr.clone()),
        ("MASTER_PORT", port.to_string()),
    ]
}

/// Ranks one node can run (one per GPU: 8 or 16 on today's machines, with room to spare) and nodes one run can
/// have; the rank arithmetic stays far from overflow.
const MAX_PROCS_PER_NODE: usize = 1024;
const MAX_NODES: usize = 1 << 20;

fn validate(o: &LaunchOptions) -> Result<(), LaunchError> {
    let bad = |flag, msg: &str| Err(LaunchError::BadArgs { flag, msg: msg.to_string() });
    if o.nproc_per_node == 0 {
        return bad("--nproc-per-node", "must be at least 1");
    }
    if o.nproc_per_node > MAX_PROCS_PER_NODE {
        return Err(LaunchError::BadArgs {
            flag: "--nproc-per-node",
            msg: format!(
                "{} is more than the {MAX_PROCS_PER_NODE} processes one node runs (one per GPU)",
                o.nproc_per_node
            ),
        });
    }
    if o.nnodes == 0 {
        return bad("--nnodes", "must be at least 1");
    }
    if o.nnodes > MAX_NODES {
        return Err(LaunchError::BadArgs { flag: "--nnodes", msg: format!("{} is more than {MAX_NODES}", o.nnodes) });
    }
    if o.node_rank >= o.nnodes {
        return Err(LaunchError::BadArgs {
            flag: "--node-rank",
            msg: format!("{} is not below --nnodes {}", o.node_rank, o.nnodes),
        });
    }
    if o.master_addr.trim().is_empty() {
        return bad("--master-addr", "is empty");
    }
    if o.master_port == 0 && o.nnodes > 1 {
        return bad("--master-port", "0 (a free port) works on one node only: give every node the same port");
    }
    Ok(())
}

/// A port nobody listens on right now (the kernel's choice for port 0).
fn free_port() -> Result<u16, LaunchError> {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| LaunchError::NoPort(e.to_string()))
}

/// Copies a child's output to ours line by line, each line prefixed with `[rank N] `.
fn tag_lines<R: Read + Send + 'static>(src: R, rank: usize, to_stderr: bool) -> JoinHandle<()> {
    std::thread::spawn(move || {
        let mut r = BufReader::new(src);
        let mut line = Vec::new();
        loop {
            line.clear();
            match r.read_until(b'\n', &mut line) {
                Ok(0) | Err(_) => return,
                Ok(_) => {
                    if !line.ends_with(b"\n") {
                        line.push(b'\n');
                    }
                    let mut out = Vec::with_capacity(line.len() + 12);
                    out.extend_from_slice(format!("[rank {rank}] ").as_bytes());
                    out.extend_from_slice(&line);
                    // One write per line under the lock, so lines of different ranks never interleave.
                    let _ = if to_stderr {
                        std::io::stderr().lock().write_all(&out)
                    } else {
                        std::io::stdout().lock().write_all(&out)
                    };
                }
            }
        }
    })
}

fn spawn(o: &LaunchOptions, local: usize, port: u16) -> Result<Child, LaunchError> {
    let mut cmd = Command::new(&o.program);
    cmd.args(&o.args)
        .envs(child_env(o, local, port))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    // A launcher that dies (even by SIGKILL) takes its ranks with it.
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::process::CommandExt;
        // SAFETY: prctl is async-signal-safe and touches no memory of the parent.
        unsafe {
            cmd.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
    }
    cmd.spawn().map_err(|e| LaunchError::Spawn {
        rank: o.node_rank * o.nproc_per_node + local,
        program: o.program.display().to_string(),
        msg: e.to_string(),
    })
}

/// Runs this node's ranks to the end. Ok when all exit with status 0; otherwise the first failure (the others
/// get `grace` to exit, then are killed), or a timeout naming the ranks still running.
pub fn launch(o: &LaunchOptions) -> Result<(), LaunchError> {
    validate(o)?;
    let port = if o.master_port == 0 { free_port()? } else { o.master_port };
    let first_rank = o.node_rank * o.nproc_per_node;
    eprintln!(
        "launch: ranks {}-{} of {} on node {}/{}, rendezvous {}",
        first_rank,
        first_rank + o.nproc_per_node - 1,
        o.nnodes * o.nproc_per_node,
        o.node_rank,
        o.nnodes,
        super::env::endpoint(&o.master_addr, port)
    );
    let mut children: Vec<Child> = Vec::new();
    let mut pipes = Vec::new();
    for local in 0..o.nproc_per_node {
        match spawn(o, local, port) {
            Ok(mut c) => {
                let rank = first_rank + local;
                if let Some(out) = c.stdout.take() {
                    pipes.push(tag_lines(out, rank, false));
                }
                if let Some(err) = c.stderr.take() {
                    pipes.push(tag_lines(err, rank, true));
                }
                children.push(c);
            }
            Err(e) => {
                for c in &mut children {
                    let _ = c.kill();
                    let _ = c.wait();
                }
                return Err(e);
            }
        }
    }
    let t0 = Instant::now();
    let mut status: Vec<Option<ExitStatus>> = vec![None; children.len()];
    // Failed ranks (local index) in the order their failure was seen.
    let mut failed: Vec<usize> = Vec::new();
    let mut killed: Vec<usize> = Vec::new();
    let mut kill_at: Option<Instant> = None;
    let mut timed_out = false;
    let mut over_time = false;
    loop {
        for (i, c) in children.iter_mut().enumerate() {
            if status[i].is_none() {
                if let Ok(Some(s)) = c.try_wait() {
                    status[i] = Some(s);
                    if !s.success() {
                        if kill_at.is_none() {
                            eprintln!(
                                "launch: rank {} {}; the other ranks have {}s to exit before they are killed",
                                first_rank + i,
                                describe_status(&s),
                                o.grace.as_secs_f64()
                            );
                            kill_at = Some(Instant::now() + o.grace);
                        }
                        // A rank that stopped because another failed goes after the ranks that failed on their
                        // own, even when both are seen in the same poll.
                        let secondary =
                            |j: usize| status[j].and_then(|s| s.code()) == Some(super::PEER_FAILED_EXIT_CODE);
                        let at = if secondary(i) {
                            failed.len()
                        } else {
                            failed.iter().position(|&j| secondary(j)).unwrap_or(failed.len())
                        };
                        failed.insert(at, i);
                    }
                }
            }
        }
        let running: Vec<usize> = (0..children.len()).filter(|&i| status[i].is_none()).collect();
        if running.is_empty() {
            break;
        }
        over_time = o.timeout.is_some_and(|t| t0.elapsed() >= t);
        if kill_at.is_some_and(|k| Instant::now() >= k) || over_time {
            timed_out = over_time && failed.is_empty();
            for &i in &running {
                let _ = children[i].kill();
                if let Ok(s) = children[i].wait() {
                    status[i] = Some(s);
                }
                killed.push(i);
            }
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    // The pipes close when the ranks exit; a grandchild that inherited one could hold it open, so wait a bounded
    // time for the last lines rather than forever.
    let flush_deadline = Instant::now() + Duration::from_secs(2);
    while pipes.iter().any(|p| !p.is_finished()) && Instant::now() < flush_deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    for p in pipes.into_iter().filter(|p| p.is_finished()) {
        let _ = p.join();
    }
    if timed_out {
        let running: Vec<usize> = killed.iter().map(|i| first_rank + i).collect();
        return Err(LaunchError::Timeout {
            secs: o.timeout.map_or(0.0, |t| t.as_secs_f64()),
            running: super::rendezvous::rank_list(&running),
        });
    }
    let Some(&first) = failed.first() else { return Ok(()) };
    let mut notes = Vec::new();
    let mut others: Vec<usize> = failed[1..].iter().map(|i| first_rank + i).collect();
    others.sort_unstable();
    if !others.is_empty() {
        notes.push(format!("rank(s) {} failed after it", super::rendezvous::rank_list(&others)));
    }
    if !killed.is_empty() {
        let k: Vec<usize> = killed.iter().map(|i| first_rank + i).collect();
        let why = if over_time {
            format!("at the {}s --timeout", o.timeout.map_or(0.0, |t| t.as_secs_f64()))
        } else {
            format!("after the {}s grace period", o.grace.as_secs_f64())
        };
        notes.push(format!("killed rank(s) {} {why}", super::rendezvous::rank_list(&k)));
    }
    Err(LaunchError::RankFailed {
        rank: first_rank + first,
        node: o.node_rank,
        local: first,
        status: describe_status(&status[first].expect("a failed rank has a status")),
        also: if notes.is_empty() { String::new() } else { format!("; {}", notes.join("; ")) },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts() -> LaunchOptions {
        LaunchOptions {
            nproc_per_node: 4,
            nnodes: 2,
            node_rank: 1,
            master_addr: "10.0.0.1".into(),
            master_port: 29500,
            grace: Duration::from_secs(1),
            timeout: None,
            program: "/bin/sh".into(),
            args: vec![],
        }
    }

    #[test]
    fn children_get_torchruns_variables() {
        let env = child_env(&opts(), 2, 1234);
        let get = |k: &str| env.iter().find(|(n, _)| *n == k).unwrap().1.clone();
        assert_eq!(get("RANK"), "6");
        assert_eq!(get("WORLD_SIZE"), "8");
        assert_eq!(get("LOCAL_RANK"), "2");
        assert_eq!(get("LOCAL_WORLD_SIZE"), "4");
        assert_eq!(get("GROUP_RANK"), "1");
        assert_eq!(get("MASTER_ADDR"), "10.0.0.1");
        assert_eq!(get("MASTER_PORT"), "1234");
        // What a child parses back is consistent.
        let map = env.into_iter().map(|(k, v)| (k.to_string(), v)).collect();
        let d = crate::dist::DistEnv::from_map(&map).unwrap();
        assert_eq!((d.rank, d.world_size, d.local_rank, d.node_rank), (6, 8, 2, Some(1)));
    }

    #[test]
    fn bad_arguments_name_the_flag() {
        let err = |f: fn(&mut LaunchOptions)| {
            let mut o = opts();
            f(&mut o);
            launch(&o).unwrap_err().to_string()
        };
        assert_eq!(err(|o| o.nproc_per_node = 0), "launch: --nproc-per-node must be at least 1");
        assert_eq!(err(|o| o.node_rank = 2), "launch: --node-rank 2 is not below --nnodes 2");
        assert_eq!(err(|o| o.nnodes = 0), "launch: --nnodes must be at least 1");
        assert_eq!(
            err(|o| o.nproc_per_node = usize::MAX / 2),
            format!(
                "launch: --nproc-per-node {} is more than the 1024 processes one node runs (one per GPU)",
                usize::MAX / 2
            )
        );
        assert_eq!(err(|o| o.nnodes = usize::MAX), format!("launch: --nnodes {} is more than 1048576", usize::MAX));
        assert!(err(|o| o.master_port = 0).starts_with("launch: --master-port 0 (a free port) works on one node only"));
        assert_eq!(err(|o| o.master_addr = " ".into()), "launch: --master-addr is empty");
    }

    #[cfg(unix)]
    #[test]
    fn a_failing_child_is_named_and_the_others_are_killed() {
        // Rank 1 fails at once; ranks 0 and 2 would sleep for a minute but are killed after the grace period.
        let o = LaunchOptions {
            nproc_per_node: 3,
            nnodes: 1,
            node_rank: 0,
            master_port: 0,
            master_addr: "127.0.0.1".into(),
            args: vec!["-c".into(), "if [ \"$RANK\" = 1 ]; then exit 7; fi; exec sleep 60".into()],
            ..opts()
        };
        let t0 = Instant::now();
        let e = launch(&o).unwrap_err().to_string();
        assert_eq!(
            e,
            "rank 1 (node 0, local rank 1) exited with status 7; killed rank(s) 0, 2 after the 1s grace period"
        );
        assert!(t0.elapsed() < Duration::from_secs(20));
        // All succeed.
        let o = LaunchOptions { args: vec!["-c".into(), "test \"$WORLD_SIZE\" = 3".into()], ..o };
        launch(&o).unwrap();
        // A whole-job timeout names the ranks still running.
        let o = LaunchOptions {
            args: vec!["-c".into(), "if [ \"$RANK\" = 0 ]; then exit 0; fi; exec sleep 60".into()],
            timeout: Some(Duration::from_secs(1)),
            ..o
        };
        let e = launch(&o).unwrap_err().to_string();
        assert_eq!(e, "launch: timed out after 1s with rank(s) 1-2 still running; killed them");
    }

    #[cfg(unix)]
    #[test]
    fn signals_are_named() {
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(describe_status(&ExitStatus::from_raw(9)), "was killed by signal 9 (SIGKILL)");
        assert_eq!(describe_status(&ExitStatus::from_raw(3 << 8)), "exited with status 3");
    }
}
