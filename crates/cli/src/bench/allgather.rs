//! `dckpt bench allgather`: all-gather over TCP on loopback.
//!
//! The ranks are threads of this process, each with its own [`TcpCollective`] and real
//! sockets to rank 0, so the measure includes framing, checksums, syscalls and the star's
//! fan-out, but not process scheduling across machines. There is no ceiling to compare
//! with, so the figures are reported as measured.

use std::net::{IpAddr, Ipv4Addr};
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, ensure};
use dckpt::collective::{Collective, TcpCollective, TcpConfig, TcpOptions};

use super::{BenchArgs, Figure};

/// The figures: 1 KiB messages (latency) and 1 MiB messages (bandwidth) on `--world` ranks.
pub fn figures(a: &BenchArgs) -> Result<Vec<Figure>> {
    let mut out = Vec::new();
    for (name, bytes, iterations) in
        [("allgather_tcp_1kib_mean_us", 1usize << 10, 2000), ("allgather_tcp_1mib_mean_us", 1 << 20, 50)]
    {
        let b = bench_tcp_allgather(a.world, bytes, iterations)?;
        let note = format!(
            "{} ranks, {} calls of {} bytes each: p50 {:.1?}, max {:.1?}, algbw {:.1} MB/s, rank 0 sends {:.1} MB/s",
            b.world_size,
            b.iterations,
            b.message_bytes,
            b.latency_p50,
            b.latency_max,
            b.algbw_bytes_per_s / 1e6,
            b.hub_egress_bytes_per_s / 1e6
        );
        out.push(Figure::plain(name, b.latency_mean.as_secs_f64() * 1e6, note));
    }
    Ok(out)
}

/// One benchmark's measure.
#[derive(Debug, Clone, PartialEq)]
pub struct AllGatherBench {
    /// Ranks.
    pub world_size: usize,
    /// Bytes each rank contributes per call.
    pub message_bytes: usize,
    /// Timed calls (after warm-up).
    pub iterations: usize,
    /// Median wall time of one call, as seen by rank 0.
    pub latency_p50: Duration,
    /// Mean wall time of one call.
    pub latency_mean: Duration,
    /// Slowest call.
    pub latency_max: Duration,
    /// Bytes every rank ends up with per call (`world_size * message_bytes`) divided by
    /// the mean latency: the all-gather's "algorithm bandwidth", bytes per second.
    pub algbw_bytes_per_s: f64,
    /// Bytes rank 0 sends per call (`(world_size - 1)` copies of the whole set) divided by
    /// the mean latency: what the star's hub pushes, bytes per second.
    pub hub_egress_bytes_per_s: f64,
}

/// All-gather of `message_bytes` per rank on `world_size` TCP ranks over 127.0.0.1:
/// `iterations` timed calls after a few warm-up calls.
pub fn bench_tcp_allgather(world_size: usize, message_bytes: usize, iterations: usize) -> Result<AllGatherBench> {
    ensure!(world_size > 0 && iterations > 0, "bench needs at least one rank and one iteration");
    let port = crate::launch::job::free_port()?;
    let mut opts = TcpOptions { listen_addr: Some(IpAddr::V4(Ipv4Addr::LOCALHOST)), ..TcpOptions::default() };
    opts.collective.timeout = Duration::from_secs(60);
    opts.collective.message_bytes_max = (message_bytes as u64).max(1);
    opts.rendezvous_timeout = Duration::from_secs(30);
    let ranks: Vec<_> = (0..world_size)
        .map(|rank| {
            let cfg = TcpConfig {
                rank,
                world_size,
                local_rank: rank,
                master_addr: "127.0.0.1".into(),
                master_port: port,
                job_id: format!("bench-{port}"),
            };
            let opts = opts.clone();
            thread::spawn(move || run_rank(&cfg, &opts, message_bytes, iterations))
        })
        .collect();
    let mut samples = Vec::new();
    for (rank, t) in ranks.into_iter().enumerate() {
        let got = t
            .join()
            .map_err(|_| anyhow!("bench rank {rank} panicked"))?
            .with_context(|| format!("all-gather bench, rank {rank}"))?;
        if rank == 0 {
            samples = got;
        }
    }
    Ok(summarise(world_size, message_bytes, samples))
}

fn run_rank(
    cfg: &TcpConfig,
    opts: &TcpOptions,
    message_bytes: usize,
    iterations: usize,
) -> dckpt::collective::Result<Vec<Duration>> {
    let c = TcpCollective::connect(cfg, opts)?;
    let msg = vec![cfg.rank as u8; message_bytes];
    for _ in 0..3 {
        c.all_gather(msg.clone())?;
    }
    let mut samples = Vec::with_capacity(iterations);
    for _ in 0..iterations {
        c.barrier()?;
        let start = Instant::now();
        let all = c.all_gather(msg.clone())?;
        samples.push(start.elapsed());
        if all.len() != cfg.world_size || all.iter().any(|m| m.len() != message_bytes) {
            return Err(dckpt::collective::Error::Protocol {
                rank: cfg.rank,
                detail: "bench all_gather returned the wrong shape".into(),
            });
        }
    }
    c.barrier()?;
    Ok(samples)
}

fn summarise(world_size: usize, message_bytes: usize, mut samples: Vec<Duration>) -> AllGatherBench {
    samples.sort();
    let n = samples.len().max(1);
    let total: Duration = samples.iter().sum();
    let mean = total / n as u32;
    let secs = mean.as_secs_f64().max(1e-12);
    let set_bytes = (world_size * message_bytes) as f64;
    AllGatherBench {
        world_size,
        message_bytes,
        iterations: samples.len(),
        latency_p50: samples.get(samples.len() / 2).copied().unwrap_or_default(),
        latency_mean: mean,
        latency_max: samples.last().copied().unwrap_or_default(),
        algbw_bytes_per_s: set_bytes / secs,
        hub_egress_bytes_per_s: set_bytes * (world_size.saturating_sub(1)) as f64 / secs,
    }
}
