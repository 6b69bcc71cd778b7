//! All-gather of 1 KiB and 1 MiB messages on 8 TCP ranks over loopback.
//!
//! `cargo run --release -p dckpt-collective --example bench_allgather [WORLD]`

use dckpt_collective::bench::bench_tcp_allgather;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let world: usize = std::env::args().nth(1).map(|w| w.parse()).transpose()?.unwrap_or(8);
    println!(
        "{:>6} {:>10} {:>6} {:>12} {:>12} {:>12} {:>14} {:>16}",
        "ranks", "msg", "iters", "p50", "mean", "max", "algbw MB/s", "hub out MB/s"
    );
    for (bytes, iters) in [(1usize << 10, 2000), (1 << 20, 50)] {
        let b = bench_tcp_allgather(world, bytes, iters)?;
        println!(
            "{:>6} {:>10} {:>6} {:>12.1?} {:>12.1?} {:>12.1?} {:>14.1} {:>16.1}",
            b.world_size,
            b.message_bytes,
            b.iterations,
            b.latency_p50,
            b.latency_mean,
            b.latency_max,
            b.algbw_bytes_per_s / 1e6,
            b.hub_egress_bytes_per_s / 1e6
        );
    }
    Ok(())
}
